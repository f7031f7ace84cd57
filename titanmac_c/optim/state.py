"""titanmac_c.AdamW's per-parameter state, torch's layout: "step" (a float32 0-d tensor on the
parameter's device), "exp_avg", "exp_avg_sq" and, with amsgrad, "max_exp_avg_sq" (in the
parameter's dtype). Created at a parameter's first step; a checkpoint's entries are checked
against their parameters before torch's load_state_dict takes them, so a corrupted one raises
and leaves the optimizer as it was."""

import math

import torch
from torch import Tensor

from .._internal.runtime import is_one_number

STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def init_state(p, amsgrad):
    """A fresh entry for parameter p (zeros in p's dtype and memory layout)."""
    state = {
        "step": torch.zeros((), dtype=torch.float32, device=p.device),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def step_count(state, device, copy=False):
    """state["step"] as the C core takes it, a float32 tensor on the parameter's device (with
    copy, a fresh one): code that writes optimizer.state itself may leave another
    (ZeroRedundancyOptimizer's load_state_dict moves 0-d state tensors to the CPU, as torch's
    AdamW keeps them). One of several elements is left for the C core to name."""
    step = state["step"]
    if not copy and isinstance(step, Tensor) and (
            step.dtype == torch.float32 and step.device == device or step.numel() != 1):
        return step
    state["step"] = torch.as_tensor(float(step), dtype=torch.float32, device=device)
    return state["step"]


def normalize_steps(optimizer, copy=False):
    """Every step as step_count leaves it (torch's non-fused AdamW keeps steps on the CPU, older
    checkpoints as Python numbers). With copy, every step is a fresh tensor: torch's
    load_state_dict keeps the checkpoint's step tensors by reference, and the C core increments
    steps in place, which would write into the checkpoint (or into another optimizer loaded from
    it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                step_count(state, p.device, copy)


_ABSENT = object()  # no entry in the state dict (one may hold None, set by hand)


class CommittedNewState:
    """A first step's new state, put into the optimizer's state before the C calls (a call
    reads it from there), and taken back when the step stops before any call wrote: a refusal,
    or an interrupt that the count of completed calls (_C.completed_calls) places before the
    first write. One that surfaces as a call returns, after its write, keeps it: the parameters
    were stepped (torch's fused AdamW leaves both)."""

    def __init__(self, state, new_state):
        self.state = state
        self.new_state = new_state
        self.found = {p: state.get(p, _ABSENT) for p in new_state}  # absent, empty or None

    def commit(self):
        self.state.update(self.new_state)

    def take_back(self, refused, batches):
        """After the C call of batch `refused` raised (before any write), and the batches after
        it did not run: their parameters' state as it was found."""
        state = self.state
        later = batches[batches.index(refused):]
        for p in (p for batch in later for p in batch.owners):
            if p in self.found:
                entry = self.found.pop(p)
                if entry is _ABSENT:
                    state.pop(p, None)  # (absent still if commit() did not run)
                else:
                    state[p] = entry


def malformed_state(name, state, error):
    """A ValueError naming the parameter whose state entry lacks a key or holds a step that is
    no number (found while collecting, before any write)."""
    if isinstance(error, KeyError):
        return ValueError(f"{name}: its state has no {error.args[0]!r} (keys: {sorted(state)})")
    return ValueError(f"{name}: state['step'] = {state.get('step')!r}: expected a number or a "
                      f"one-element tensor ({error})")


def check_loaded_state(param_groups, state_dict):
    """Raises ValueError naming the first entry of state_dict that does not fit its parameter
    (the groups' and lists' sizes are left to torch's load_state_dict, which names them)."""
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(param_groups):
        return
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            return
        for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
            entry = state_dict.get("state", {}).get(pid)
            if entry is not None and not isinstance(entry, dict):
                raise ValueError(f"load_state_dict: param_groups[{gi}]['params'][{pi}]: "
                                 f"state is a {type(entry).__name__}, not a dict")
            if entry:
                _check_entry(f"param_groups[{gi}]['params'][{pi}]", p, entry, saved)


def _check_entry(name, p, entry, saved_group):
    required = ["exp_avg", "exp_avg_sq"]
    if saved_group.get("amsgrad", False):
        required.append("max_exp_avg_sq")
    for key in required:
        if key not in entry:
            raise ValueError(f"load_state_dict: {name}: state has no {key!r}")
    for key in STATE_KEYS:
        if key not in entry:
            continue
        value = entry[key]
        if not isinstance(value, Tensor):
            raise ValueError(f"load_state_dict: {name}: {key} is a {type(value).__name__}, "
                             "not a tensor")
        if value.shape != p.shape:
            raise ValueError(f"load_state_dict: {name}: {key} has shape {tuple(value.shape)}, "
                             f"but the parameter has shape {tuple(p.shape)}")
        if value.device.type == "meta":
            raise ValueError(f"load_state_dict: {name}: {key} is on the meta device (no "
                             "values)")
    step = entry.get("step")
    if step is None:
        raise ValueError(f"load_state_dict: {name}: state has no 'step'")
    if not is_one_number(step):
        problem = (f"step has {step.numel()} elements on {step.device}, not 1 with a value"
                   if isinstance(step, Tensor) else f"step is a {type(step).__name__}, not a "
                   "number or a one-element tensor")
        raise ValueError(f"load_state_dict: {name}: {problem}")
    # -1 divides by zero in the bias correction (NaN parameters); NaN and inf poison it too
    if not 0.0 <= float(step) < math.inf:
        raise ValueError(f"load_state_dict: {name}: step = {float(step)}, must be >= 0 and "
                         "finite")
