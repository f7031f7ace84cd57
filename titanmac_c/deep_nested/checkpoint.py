"""The DeepNestedOptimizer's checkpoints, in the reference's layout (spec Appendix A): saved with
the rates and multipliers as the reference's hold them, and loaded from ours or the reference's
only after every part was checked, so a checkpoint that does not fit raises and leaves the
optimizer as it was (the reference loads part by part and stops half-loaded). Two keys the
reference's lack, 'meta_trainer' and 'mlp_output_history', hold the histories that steer the next
meta-update and Phase 1 step, so a resume is exact; the reference's load ignores them, and a
checkpoint without them leaves ours' histories as they are, as the reference's load does."""

import copy

import torch

from .cms_state import check_dense_float
from .args import as_int
from .nets import N_GROUPS
from .._internal.runtime import is_one_number

_META_HISTORIES = ("loss_history", "multiplier_history", "momentum_history")
_COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper names the wrapped module so


def _uncompiled(module_state):
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
            not isinstance(meta.get(name), (list, tuple)) for name in _META_HISTORIES):
        raise ValueError(f"state_dict['meta_trainer']: expected a dict of the lists "
                         f"{list(_META_HISTORIES)}")
    lengths = {len(meta[name]) for name in _META_HISTORIES}
    if len(lengths) != 1:
        raise ValueError(f"state_dict['meta_trainer']: its lists differ in length "
                         f"({[len(meta[name]) for name in _META_HISTORIES]})")
    out = {}
    for name in _META_HISTORIES:
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


class CheckpointMixin:
    """state_dict / load_state_dict of DeepNestedOptimizer."""

    def state_dict(self):
        """The reference's layout (spec appendix A), for torch.save: the AdamW state, both
        networks and the meta-optimizer, the step count, the multipliers and loss EMA, and in
        CMS mode cms_state ({tensor index: {level: buffers}}). Tensors by reference, as torch's
        optimizers return them."""
        base = self.base_optimizer.state_dict()
        if self._cms is None:
            # the reference's AdamW groups hold base_lr * mu_g of the last step (one host read
            # here); in CMS mode it never writes them: base_lr
            for group, lr in zip(base["param_groups"], self.get_effective_lrs()):
                group["lr"] = lr
        sd = {
            "base_optimizer": base,
            "momentum_mlp": self._module_state(self.momentum_mlp),
            "controller": self._module_state(self.controller),
            "meta_optimizer": self.meta_optimizer.state_dict(),
            "global_step": self.global_step,
            "lr_multipliers": self._lr_multipliers.clone(),
            "ema_loss": self.ema_loss.clone(),
            "cms_state": self._cms.state_dict() if self._cms is not None else {},
            "meta_trainer": {name: list(getattr(self.meta_trainer, name))
                             for name in _META_HISTORIES},
            # Phase 1's last output per tensor (by reference, as the CMS buffers): at most
            # SURROGATE_MAX_TENSORS of them, in CMS mode with the DirectUpdateMLP only
            "mlp_output_history": dict(self._mlp_output_history),
        }
        if self.mlp_optimizer is not None:
            sd["mlp_optimizer"] = self.mlp_optimizer.state_dict()
        return sd

    def _check_state_dict(self, state_dict):
        """Everything load_state_dict would refuse after its first write, found before it: the
        parts' keys, the modules' keys and shapes (loaded into copies), the meta-optimizers'
        group sizes, the multipliers' and EMA's lengths, global_step, the CMS state, the
        histories. Returns (multipliers, ema, global_step, (meta histories, Phase 1 outputs))."""
        for key in ("base_optimizer", "momentum_mlp", "controller", "meta_optimizer"):
            if key not in state_dict:
                raise KeyError(f"DeepNestedOptimizer.load_state_dict: no {key!r} in the checkpoint")
        for key, module in (("momentum_mlp", self.momentum_mlp), ("controller", self.controller)):
            try:
                copy.deepcopy(module).load_state_dict(_uncompiled(state_dict[key]))
            except RuntimeError as e:
                raise RuntimeError(f"state_dict[{key!r}]: {e}") from None
        # base_optimizer is not checked here: its load (AdamW's: load pre-hooks, then every state
        # tensor checked, then written) is the first write, and it writes only what it checked
        optimizers = [("meta_optimizer", self.meta_optimizer)]
        if self.mlp_optimizer is not None and "mlp_optimizer" in state_dict:
            optimizers.append(("mlp_optimizer", self.mlp_optimizer))
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
            values.append(value)
        step = as_int(state_dict.get("global_step", 0))
        if step is None or step < 0:
            raise ValueError(f"state_dict['global_step']: {state_dict.get('global_step')!r}, "
                             "expected a whole number >= 0")
        if self._cms is not None:
            self._cms.check_state_dict(state_dict.get("cms_state", {}))
        return values[0], values[1], step, self._checked_histories(state_dict)

    def _checked_histories(self, state_dict):
        """The checkpoint's meta-trainer and Phase 1 histories as load_state_dict writes them
        (None for a part the checkpoint lacks); raises ValueError for one that does not fit."""
        meta = state_dict.get("meta_trainer")
        if meta is not None:
            meta = _checked_meta_histories(meta, self.meta_trainer.window_size, self.device)
        # AdamW mode has no Phase 1: ignored there, as cms_state is
        outputs = state_dict.get("mlp_output_history") if self._cms is not None else None
        if outputs is not None:
            outputs = _checked_outputs(outputs, self._cms.params, self.device)
        return meta, outputs

    def _module_state(self, module):
        """The module's state_dict, keyed as the reference's: with use_compile=True its modules
        are torch.compile wrappers, whose keys carry the _orig_mod. prefix."""
        sd = module.state_dict()
        if not self.use_compile:
            return sd
        return type(sd)((_COMPILED_PREFIX + k, v) for k, v in sd.items())

    def load_state_dict(self, state_dict):
        """Loads ours or the reference's layout. Every part is checked before the first write, so
        a checkpoint that does not fit raises and leaves the optimizer as it was. Values are
        copied into the existing device buffers (B10 fixed: nothing lands on the CPU, a captured
        graph stays valid for the buffers, and is re-captured for the new AdamW state).
        cms_state is ignored in AdamW mode (the reference's holds only zeros there)."""
        mult, ema, step, (meta, outputs) = self._check_state_dict(state_dict)
        self.base_optimizer.load_state_dict(state_dict["base_optimizer"])  # checks, then writes
        self.momentum_mlp.load_state_dict(_uncompiled(state_dict["momentum_mlp"]))
        self.controller.load_state_dict(_uncompiled(state_dict["controller"]))
        # deep copies: torch's load keeps a tensor already on the right device, so an in-memory
        # state_dict would leave two optimizers stepping one Adam state
        self.meta_optimizer.load_state_dict(copy.deepcopy(state_dict["meta_optimizer"]))
        if self.mlp_optimizer is not None and "mlp_optimizer" in state_dict:
            self.mlp_optimizer.load_state_dict(copy.deepcopy(state_dict["mlp_optimizer"]))
        self.global_step = step
        with torch.no_grad():
            self._lr_multipliers.copy_(mult)
            self.ema_loss.copy_(ema)
        if self._cms is not None:
            cms_state = state_dict.get("cms_state", {})
            if not cms_state:  # AdamW mode's (ours saves {}): as the reference's all-zero one
                self._cms.reset()
            self._cms.load_state_dict(cms_state)
        if meta is not None:
            for name, values in meta.items():
                setattr(self.meta_trainer, name, values)
        if outputs is not None:
            self._mlp_output_history = outputs
        if self._graph is not None:
            self._graph.reset()
