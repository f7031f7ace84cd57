"""The DeepNestedOptimizer's checkpoints, in the reference's layout (docs/deep_nested_optimizer.md,
Appendix A): saved with the rates and multipliers as the reference's hold them, and loaded from ours
or the reference's only after every part was checked, so a checkpoint that does not fit raises and
leaves the optimizer as it was (the reference loads part by part and stops half-loaded). Two keys
the reference's lack, 'meta_trainer' and 'mlp_output_history', hold the histories that steer the
next meta-update and Phase 1 step, so a resume is exact; the reference's load ignores them, and a
checkpoint without them leaves ours' histories as they are, as the reference's load does."""

import copy
import math

import torch

from .cms_state import check_dense_float
from .args import as_int
from .nets import META_HISTORIES, N_GROUPS
from .._internal.runtime import as_number, is_one_number

_COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper names the wrapped module so


def uncompiled(module_state):
    """A module state_dict with the keys of the plain module, saved with or without
    use_compile=True (the reference's checkpoints of either kind load)."""
    n = len(_COMPILED_PREFIX)
    return type(module_state)((k[n:] if k.startswith(_COMPILED_PREFIX) else k, v)
                              for k, v in module_state.items())


def _check_loads_into_a_copy(key, opt, saved):
    """A meta-optimizer's checkpoint loaded into a copy of it (a few small networks' tensors):
    whatever torch's load would raise on (a missing 'state', a malformed entry) is raised here,
    before the first write, and every state tensor must fit its parameter (torch's Adam would
    load a misfit and fail at its next step)."""
    trial = copy.deepcopy(opt)
    try:
        trial.load_state_dict(copy.deepcopy(saved))
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as e:
        raise ValueError(f"state_dict[{key!r}]: does not load ({type(e).__name__}: {e})") from None
    for gi, group in enumerate(trial.param_groups):
        for pi, p in enumerate(group["params"]):
            for name, value in trial.state.get(p, {}).items():
                if name != "step" and (not isinstance(value, torch.Tensor)
                                       or value.shape != p.shape):
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    raise ValueError(f"state_dict[{key!r}]: param_groups[{gi}]['params'][{pi}]: "
                                     f"{name} is {shape!r}, the parameter {tuple(p.shape)}")


def _checked_meta_histories(meta, window, device):
    """state_dict['meta_trainer'] as SimplifiedMetaTrainer's three lists (the last `window`
    entries, the most it keeps), new objects on `device`; ValueError if it does not fit."""
    if not isinstance(meta, dict) or any(
            not isinstance(meta.get(name), (list, tuple)) for name in META_HISTORIES):
        raise ValueError(f"state_dict['meta_trainer']: expected a dict of the lists "
                         f"{list(META_HISTORIES)}")
    lengths = {len(meta[name]) for name in META_HISTORIES}
    if len(lengths) != 1:
        raise ValueError(f"state_dict['meta_trainer']: its lists differ in length "
                         f"({[len(meta[name]) for name in META_HISTORIES]})")
    out = {}
    for name in META_HISTORIES:
        values = list(meta[name])[max(0, len(meta[name]) - window):]
        for j, value in enumerate(values):
            where = f"state_dict['meta_trainer'][{name!r}][{j}]"
            if name == "multiplier_history":
                values[j] = _checked_tensor(where, value, (N_GROUPS,), device)
            elif not is_one_number(value):
                raise ValueError(f"{where}: {value!r}, expected a number")
            else:
                values[j] = float(value)
        out[name] = values
    return out


def _checked_outputs(outputs, params, device):
    """state_dict['mlp_output_history'] as {tensor index: float32 copy on `device` of that
    tensor's shape}; ValueError if it does not fit."""
    if not isinstance(outputs, dict):
        raise ValueError(f"state_dict['mlp_output_history']: a {type(outputs).__name__}, "
                         "expected a dict {tensor position: tensor}")
    out = {}
    for i, value in outputs.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(params):
            raise ValueError(f"state_dict['mlp_output_history'][{i!r}]: expected a tensor "
                             f"position in the groups, an int in [0, {len(params)})")
        out[i] = _checked_tensor(f"state_dict['mlp_output_history'][{i}]", value,
                                 tuple(params[i].shape), device)
    return out


def _checked_tensor(where, value, shape, device):
    """A float32 copy on `device` of a dense floating tensor of `shape`, else ValueError."""
    check_dense_float(where, value, shape)
    return value.detach().to(device, torch.float32, copy=True)


def module_state(module, use_compile):
    """The module's state_dict, keyed as the reference's: with use_compile=True its modules
    are torch.compile wrappers, whose keys carry the _orig_mod. prefix."""
    sd = module.state_dict()
    if not use_compile:
        return sd
    return type(sd)((_COMPILED_PREFIX + k, v) for k, v in sd.items())


class CheckedCheckpoint:
    """A DeepNestedOptimizer checkpoint with everything a load would refuse after its first write
    found before it: the parts' keys, the modules' keys and shapes (loaded into copies), the
    meta-optimizers' group sizes, the multipliers' and EMA's lengths, global_step, the CMS state,
    the histories. Holds what the load writes besides the parts torch loads itself:
    multipliers, ema, global_step, meta (the meta trainer's histories, or None), outputs (Phase
    1's, or None)."""

    def __init__(self, state_dict, *, momentum_mlp, controller, meta_optimizer, mlp_optimizer,
                 cms_state, meta_window, device):
        for key in ("base_optimizer", "momentum_mlp", "controller", "meta_optimizer"):
            if key not in state_dict:
                raise KeyError(f"DeepNestedOptimizer.load_state_dict: no {key!r} in the checkpoint")
        for key, module in (("momentum_mlp", momentum_mlp), ("controller", controller)):
            try:
                copy.deepcopy(module).load_state_dict(uncompiled(state_dict[key]))
            except RuntimeError as e:
                raise RuntimeError(f"state_dict[{key!r}]: {e}") from None
        # base_optimizer is not checked here: its load (AdamW's: load pre-hooks, then every state
        # tensor checked, then written) is the first write, and it writes only what it checked
        optimizers = [("meta_optimizer", meta_optimizer)]
        if mlp_optimizer is not None and "mlp_optimizer" in state_dict:
            optimizers.append(("mlp_optimizer", mlp_optimizer))
        for key, opt in optimizers:
            saved = state_dict[key].get("param_groups", [])
            if len(saved) != len(opt.param_groups) or any(
                    len(s["params"]) != len(g["params"]) for s, g in zip(saved, opt.param_groups)):
                raise ValueError(f"state_dict[{key!r}]: its parameter groups do not match this "
                                 f"optimizer's (sizes {[len(s['params']) for s in saved]}, "
                                 f"expected {[len(g['params']) for g in opt.param_groups]})")
            _check_loads_into_a_copy(key, opt, state_dict[key])
        values = []
        for key, default in (("lr_multipliers", torch.ones(N_GROUPS)),
                             ("ema_loss", torch.zeros(N_GROUPS))):
            value = state_dict.get(key)
            try:
                value = default if value is None else torch.as_tensor(value, dtype=torch.float32)
                if value.device.type == "meta":
                    raise TypeError
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"state_dict[{key!r}]: {value!r}, expected {N_GROUPS} "
                                 "numbers") from None
            if value.shape != (N_GROUPS,):
                raise ValueError(f"state_dict[{key!r}]: shape {tuple(value.shape)}, expected "
                                 f"({N_GROUPS},)")
            # the controller never writes a non-finite multiplier nor the step a non-finite EMA
            # (a non-finite loss is skipped before it): one loaded would turn every later rate
            # NaN (multipliers kept between controller steps) or hold the EMA at NaN
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"state_dict[{key!r}]: {value.tolist()}: non-finite values "
                                 "(a corrupted checkpoint)")
            values.append(value)
        self.multipliers, self.ema = values
        step = as_int(state_dict.get("global_step", 0))
        if step is None or step < 0:
            raise ValueError(f"state_dict['global_step']: {state_dict.get('global_step')!r}, "
                             "expected a whole number >= 0")
        self.global_step = step
        self.base_lrs = _checked_base_lrs(state_dict.get("base_lrs"))
        if cms_state is not None:
            cms_state.check_state_dict(state_dict.get("cms_state", {}))
        meta = state_dict.get("meta_trainer")
        self.meta = None if meta is None else _checked_meta_histories(meta, meta_window, device)
        # AdamW mode has no Phase 1: ignored there, as cms_state is
        outputs = state_dict.get("mlp_output_history") if cms_state is not None else None
        self.outputs = (None if outputs is None
                        else _checked_outputs(outputs, cms_state.params, device))


def _checked_base_lrs(values):
    """The groups' base learning rates a checkpoint of ours holds (None in the reference's):
    N_GROUPS finite numbers >= 0."""
    if values is None:
        return None
    try:
        lrs = [as_number("base_lrs", v) for v in values]
    except (TypeError, ValueError):
        lrs = None
    if lrs is None or len(lrs) != N_GROUPS or not all(math.isfinite(v) and v >= 0 for v in lrs):
        raise ValueError(f"state_dict['base_lrs']: {values!r}, expected {N_GROUPS} finite "
                         "numbers >= 0 (the groups' base learning rates)")
    return lrs
