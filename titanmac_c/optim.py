"""titanmac_c.AdamW: torch.optim.AdamW's constructor, defaults, state keys and state_dict, with the
step run by the C core as one fused pass per device.

Shaped like torch/optim/adamw.py: a validated constructor, lazily created state, and state_dict /
load_state_dict from the base class, so a checkpoint loads into torch.optim.AdamW and back.
State per parameter: "step" (float32 0-d tensor on the parameter's device), "exp_avg",
"exp_avg_sq" and, with amsgrad, "max_exp_avg_sq" (all in the parameter's dtype).
"""

import math
import numbers

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from . import _C
from . import _profiling as prof
from ._distributed import (
    any_dtensor,
    dtensor_type,
    is_dtensor,
    localize,
    refuse_plain_with_dtensor,
    replicated,
)
from ._flat import Batch, GradientMark, Plan, in_layout_of
from ._runtime import (
    COMPLEX_DTYPES,
    SUPPORTED_DTYPES,
    Scratch,
    call_dense,
    check_supported_dtype,
    compute_dtype,
    exec_kwargs,
    float_in_range,
    is_one_number,
    mark_written,
    norms_scratch,
    real_view,
    reraise_with_names,
)

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _scalar(name, value):
    """The float value of a hyperparameter that may be a 1-element tensor (read on the host:
    a tensor on the GPU costs a sync)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value)
    return value


def _given_total_norm(total_norm, device, dtype):
    """clip_grad_norm_'s total_norm as a one-element floating tensor on the gradients' device
    (a number becomes one of dtype, the gradients' compute dtype); its dtype is the result's."""
    if isinstance(total_norm, numbers.Real) and not isinstance(total_norm, bool):
        # a fill, not torch.tensor([x], device=...): a copy from host memory waits for the GPU
        return torch.full((1,), float(total_norm), dtype=dtype, device=device)
    if not isinstance(total_norm, Tensor):
        raise TypeError(f"total_norm: expected a tensor or a number, got "
                        f"{type(total_norm).__name__}")
    if total_norm.numel() != 1 or not total_norm.is_floating_point():
        raise ValueError(f"total_norm: expected one floating-point element, got "
                         f"{total_norm.dtype} with {total_norm.numel()} elements")
    return total_norm.detach().to(device)  # torch's clip also moves the norm to each device


def _malformed_state(name, state, error):
    """A ValueError naming the parameter whose state entry lacks a key or holds a step that is
    no number (found while collecting, before any write)."""
    if isinstance(error, KeyError):
        return ValueError(f"{name}: its state has no {error.args[0]!r} (keys: {sorted(state)})")
    return ValueError(f"{name}: state['step'] = {state.get('step')!r}: expected a number or a "
                      f"one-element tensor ({error})")


class _AmpScaling:
    """What torch.amp.GradScaler hands step() of an optimizer with _step_supports_amp_scaling:
    the attributes grad_scale (the loss scale the gradients still carry, None once unscale_ ran)
    and found_inf (nonzero when a gradient was not finite), tensors on the scaler's device.
    As torch's fused AdamW: a found_inf step changes nothing; otherwise each gradient is divided
    by grad_scale as the update loads it and stored back so divided. Read on the device only."""

    def __init__(self, grad_scale, found_inf):
        self.loss_scale = None if grad_scale is None else self._one("grad_scale", grad_scale)
        self.found_inf = None if found_inf is None else self._one("found_inf", found_inf)
        self._per_device = {}

    @classmethod
    def of(cls, optimizer):
        """The optimizer's scaling for this step, or None without a GradScaler."""
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        if grad_scale is None and found_inf is None:
            return None
        return cls(grad_scale, found_inf)

    @staticmethod
    def _one(name, value):
        """value as a float32 [1] tensor, or a number (GradScaler's sum of no flags) as a float
        that inputs() fills in on the device."""
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.is_complex():
                raise ValueError(f"optimizer.{name}: expected one real value, got a tensor of "
                                 f"shape {tuple(value.shape)} and dtype {value.dtype}")
            return value.detach().reshape(1).to(torch.float32)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"optimizer.{name}: expected a tensor or a number, got "
                            f"{type(value).__name__}")
        return float(value)

    def inputs(self, device):
        """(loss_scale, skip) of tm_adamw_step for the tensors on device (a number as a fill
        there: a copy from host memory would wait for the GPU)."""
        cached = self._per_device.get(device)
        if cached is None:
            cached = self._per_device[device] = tuple(
                None if t is None else t.to(device) if isinstance(t, Tensor)
                else torch.full((1,), t, dtype=torch.float32, device=device)
                for t in (self.loss_scale, self.found_inf))
        return cached


class AdamW(Optimizer):
    """Drop-in for torch.optim.AdamW (same arguments, defaults, state keys and state_dict).

    foreach, capturable and fused are accepted for compatibility and change nothing: there is one
    fused path. differentiable=True is refused. Parameters: float32, bfloat16, float16, float64
    (computed in double) and complex64/complex128 (stepped as their real views, as torch's).

    Beyond torch: clip_grad_norm_(max_norm) computes the total gradient norm and folds the clip
    coefficient into the next step() (the gradients are scaled as the update loads them), which
    saves a pass over the gradients compared with clip_grad_norm_ followed by step().

    torch.amp.GradScaler: like torch's fused AdamW, step() reads the scaler's grad_scale and
    found_inf attributes (_step_supports_amp_scaling): a step whose gradients overflowed is
    skipped on the device, and gradients not yet unscaled are unscaled as the update loads them
    and stored back unscaled. scaler.step(optimizer) then never reads the flag on the host.
    """

    # torch.amp.GradScaler sets grad_scale and found_inf on the optimizer and calls step()
    # instead of reading found_inf on the host itself (see _AmpScaling)
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    ):
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas: expected 2 values, got {len(betas)}")
        for i, beta in enumerate(betas):
            if not 0.0 <= _scalar(f"betas[{i}]", beta) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        # tensors stay tensors in the groups, as torch keeps them (0-d), and are read at every
        # step: a schedule may change them in place
        betas = tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() else b for b in betas)
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise ValueError("titanmac_c.AdamW does not support differentiable=True")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
        )
        super().__init__(params, defaults)
        self._init_caches()

    def _init_caches(self):
        self._scratch = Scratch()
        self._scratch_bytes = {}  # (device, amsgrad, count) -> bytes the C core asked for
        self._lr_cache = {}  # (device, dtype) -> (host lr values, tensor on device)
        self._clip_coef = {}  # device -> [1] coefficient (float32; float64) for the next step()
        self._clip_mark = None  # _flat.GradientMark of the gradients the coefficient is for
        self._plan = None  # _flat.Plan of the last full step, when it can be reused
        # (group, 0 or 1) -> (the tensor beta there, its _version, its float): one entry a slot,
        # so a schedule that installs new tensors keeps none of the old ones alive
        self._beta_values = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None),
                               ("capturable", False), ("differentiable", False),
                               ("fused", None)):
                group.setdefault(key, value)
            group["decoupled_weight_decay"] = True
        self._init_caches()
        self._normalize_steps()

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, after checking every state tensor against its parameter, so a
        corrupted checkpoint raises here and leaves the optimizer as it was. The check sees the
        checkpoint as the load pre-hooks leave it (torch's way of adapting a foreign one), so
        they run first, on a shallow copy as torch runs them, and not again inside torch's."""
        hooks = getattr(self, "_optimizer_load_state_dict_pre_hooks", None)
        if hooks:
            state_dict = state_dict.copy()
            for hook in list(hooks.values()):
                result = hook(self, state_dict)
                if result is not None:
                    state_dict = result
        self._check_loaded_state(state_dict)
        if hooks:
            self._optimizer_load_state_dict_pre_hooks = type(hooks)()
        # a pending clip_grad_norm_ coefficient stays: its gradients are unchanged, as torch's
        # clipped-in-place gradients survive a load (torch's load resets the caches through
        # __setstate__)
        clip_coef, clip_mark = self._clip_coef, self._clip_mark
        try:
            super().load_state_dict(state_dict)
        finally:
            if hooks:
                self._optimizer_load_state_dict_pre_hooks = hooks
        self._normalize_steps(copy=True)
        self._clip_coef, self._clip_mark = clip_coef, clip_mark
        self._plan = None

    def _check_loaded_state(self, state_dict):
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            return  # the base class raises its own error for this
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                return
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
                entry = state_dict.get("state", {}).get(pid)
                if entry is not None and not isinstance(entry, dict):
                    raise ValueError(f"load_state_dict: param_groups[{gi}]['params'][{pi}]: "
                                     f"state is a {type(entry).__name__}, not a dict")
                if entry:
                    self._check_entry(f"param_groups[{gi}]['params'][{pi}]", p, entry, saved)

    @staticmethod
    def _check_entry(name, p, entry, saved_group):
        required = ["exp_avg", "exp_avg_sq"]
        if saved_group.get("amsgrad", False):
            required.append("max_exp_avg_sq")
        for key in required:
            if key not in entry:
                raise ValueError(f"load_state_dict: {name}: state has no {key!r}")
        for key in _STATE_KEYS:
            if key not in entry:
                continue
            value = entry[key]
            if not isinstance(value, Tensor):
                raise ValueError(f"load_state_dict: {name}: {key} is a {type(value).__name__}, "
                                 "not a tensor")
            if value.shape != p.shape:
                shape = tuple(value.shape)
                raise ValueError(
                    f"load_state_dict: {name}: {key} has shape {shape}, "
                    f"but the parameter has shape {tuple(p.shape)}"
                )
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
        if not float(step) >= 0.0:  # -1 divides by zero in the bias correction (NaN parameters)
            raise ValueError(f"load_state_dict: {name}: step = {float(step)}, must be >= 0")

    def _normalize_steps(self, copy=False):
        """Steps live as float32 0-d tensors on the parameter's device (torch's non-fused AdamW
        keeps them on the CPU, older checkpoints as Python numbers). With copy, every step is a
        fresh tensor: torch's load_state_dict keeps the checkpoint's step tensors by reference,
        and the C core increments steps in place, which would write into the checkpoint (or into
        another optimizer loaded from it)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    self._step_count(state, p.device, copy)

    # ------------------------------------------------------------------ stepping

    def zero_grad(self, set_to_none: bool = True):
        self._clip_coef = {}
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        total_norm=None):
        """Total norm of all gradients of this optimizer's parameters (a tensor); the next step()
        multiplies each gradient by min(1, max_norm / (norm + 1e-6)) as it loads it.

        total_norm: the norm already computed (e.g. group_norms().total_grad, or what
        get_total_norm returned): a one-element floating tensor or a number; then no pass over
        the gradients is made here, and the result has its dtype. The gradients themselves are not
        modified. The coefficient serves only these gradients: a zero_grad() (the optimizer's or
        the model's), a gradient set anew, another backward or an in-place edit before the step
        drops it, as torch's clipped gradients would be gone; load_state_dict() keeps it.
        """
        from .functional import (_check_max_norm, _check_norm_type, _local_norm,
                                 _raise_if_nonfinite, _real_views, _result_dtype, _sharded)

        max_norm = _check_max_norm(max_norm)
        norm_type = _check_norm_type(norm_type)
        grads = self._planned_grads()
        # the returned norm's dtype: fixed by the parameters while the plan holds (the C core
        # refuses gradients of another dtype), so reckoned once per plan
        dtype = self._plan.norm_dtype if grads is not None else None
        if grads is None:
            grads = [g for g in (p.grad for group in self.param_groups for p in group["params"])
                     if g is not None]
            # complex gradients as their real views (a plan holds none: no cost to its step)
            grads = _real_views("grads", grads, norm_type)
            if not grads:
                self._clip_coef = {}
                return torch.tensor(0.0)
            if len({g.device for g in grads}) > 1:
                raise ValueError("clip_grad_norm_: parameters on several devices; use "
                                 "titanmac_c.clip_grad_norm_ instead")
        sharded = mesh = None  # mesh: the result is returned replicated over it
        # a cached plan holds no DTensor (their batches get none): no check needed then
        if total_norm is None and dtype is None and any_dtensor(grads):
            names = [f"param_groups[{gi}]['params'][{pi}]"
                     for gi, group in enumerate(self.param_groups)
                     for pi, p in enumerate(group["params"]) if p.grad is not None]
            sharded = _sharded("grads", grads, names)
            mesh = sharded.mesh
        if is_dtensor(total_norm):  # returned as it came, a replicated DTensor
            mesh, total_norm = total_norm.device_mesh, total_norm.full_tensor()
        device = grads[0].device
        if dtype is None:
            dtype = _result_dtype(grads)
        # the norm and coefficient in float32, or in float64 (torch's arithmetic) for float64
        # gradients or a float64 total_norm given
        work = compute_dtype(dtype)
        if total_norm is not None:
            total_norm = _given_total_norm(total_norm, device, work)
            work = compute_dtype(torch.promote_types(work, total_norm.dtype))
        buf = torch.empty(2, dtype=work, device=device)
        kwargs = exec_kwargs(device)
        if sharded is not None:  # DTensors: the norm over all ranks, then the coefficient
            with prof.step_range(prof.STATS):
                total = sharded.total(_local_norm("grads", norm_type), norm_type).reshape(1)
            _C.clip_coef(total, max_norm, buf[1:2], stream=kwargs.get("stream"))
        elif total_norm is None:
            # One pass; its finishing step also writes the coefficient (one launch on CUDA).
            group = torch.empty(1, dtype=work, device=device)
            def run(ts):
                _C.norms(ts, None, group, buf[0:1], norm_type=norm_type, coef=buf[1:2],
                         max_norm=max_norm, scratch=norms_scratch(device, ts), **kwargs)

            with prof.step_range(prof.STATS):
                call_dense(run, grads, read_only=True)
            total = buf[0:1]
        else:
            total = total_norm.reshape(1).to(work)
            _C.clip_coef(total, max_norm, buf[1:2], stream=kwargs.get("stream"))
        # in the gradients' dtype, as torch's clip_grad_norm_ returns it (the coefficient comes
        # from the float32 norm, or the float64 one)
        if total_norm is not None:
            dtype = total_norm.dtype
        result = total[0] if dtype == total.dtype else total[0].to(dtype)
        if error_if_nonfinite:  # the norm as returned: an fp16 one is inf where the float32 one
            _raise_if_nonfinite(result, norm_type)  # is finite, and torch raises there
        self._clip_coef = {device: buf[1:2]}
        self._clip_mark = GradientMark.of(self.param_groups)
        return result if mesh is None else replicated(mesh, result)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient (one C call per device)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._fused_step(amp=_AmpScaling.of(self))
        except Exception:
            # GradScaler removes its attributes only after a step that returned; left in place,
            # its next step would multiply the next loss scale into this one
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise
        return loss

    def _has_step_hooks(self):
        """Whether torch's step wrapper would run a hook around this optimizer's step() (one of
        its own or a global one): callers of _fused_step that stand for a step() then run them."""
        return bool(self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                    or torch_optimizer._global_optimizer_pre_hooks
                    or torch_optimizer._global_optimizer_post_hooks)

    def _with_step_hooks(self, step):
        """step() run between the step hooks as torch's Optimizer.step wrapper runs them (global
        pre-hooks, own pre-hooks, the step, own post-hooks, global post-hooks; a pre-hook may
        replace the arguments the post-hooks see)."""
        args, kwargs = (self,), {}
        for hook in (*torch_optimizer._global_optimizer_pre_hooks.values(),
                     *self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{hook} must return None or a tuple of (new_args, "
                                       f"new_kwargs), but got {result}.")
                args, kwargs = result
        step()
        for hook in (*self._optimizer_step_post_hooks.values(),
                     *torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, args, kwargs)

    def _fused_step(self, lr=None, grad_scale=None, skip=None, zero_grads_on_skip=False,
                    amp=None):
        """The step itself. lr: None (the groups' "lr" values), or a float32 tensor with one
        learning rate per param group on the parameters' device; grad_scale / skip: None or
        float32 [1] device tensors (see titanmac.h tm_adamw_step; lr and grad_scale may also
        be float64). The DeepNestedOptimizer calls
        this with values its control step computed on the device. amp: the _AmpScaling of a
        GradScaler's step, or None."""
        with prof.step_range(prof.UPDATE):
            self._fused_step_impl(lr, grad_scale, skip, zero_grads_on_skip, amp)

    def _fused_step_impl(self, lr, grad_scale, skip, zero_grads_on_skip, amp):
        if self._clip_coef and self._clip_mark is not None and not self._clip_mark.holds():
            # the clipped gradients are gone (zeroed, replaced or accumulated onto by another
            # backward, e.g. model.zero_grad() after a skipped batch): torch's clip scaled those
            # in place, so the gradients of this step are not clipped
            self._clip_coef = {}
        args = (lr, grad_scale, skip, zero_grads_on_skip, amp)
        if self._planned_step(*args):
            return
        batches, new_state, groups, lrs = self._collect()
        if len(batches) > 1:
            for batch in batches:
                batch.precheck()
        if amp is not None and amp.loss_scale is not None:
            for batch in batches:
                batch.check_grads_storable()
        for batch in batches:
            self._run_batch(batch, groups, lrs, *args)
        self.state.update(new_state)
        self._clip_coef = {}
        n_params = sum(len(g["params"]) for g in self.param_groups)
        if len(batches) == 1 and len(batches[0].params) == n_params and not batches[0].no_plan:
            self._plan = Plan(self, batches[0])

    def _run_batch(self, batch, groups, lrs, lr, grad_scale, skip, zero_grads_on_skip, amp):
        batch_lr = lr if lr is not None else self._lr_tensor(batch.device, lrs, batch.lr_dtype)
        scale = grad_scale if grad_scale is not None else self._clip_coef.get(batch.device)
        loss_scale = None
        if amp is not None:
            loss_scale, found_inf = amp.inputs(batch.device)
            skip = found_inf if found_inf is not None else skip
        self._run(batch, groups, batch_lr, scale, skip, zero_grads_on_skip, loss_scale)

    def _planned_grads(self):
        """Every parameter's gradient (one device) through the cached plan, or None."""
        flat = self._planned_flat()
        return None if flat is None else flat[0]

    def _planned_flat(self):
        """(grads, params, group_of) of every parameter in group order through the cached plan
        (read-only lists), or None when there is no valid plan or a gradient is missing."""
        plan = self._plan
        grads = plan.grads() if plan is not None and plan.matches(self) else None
        return None if grads is None else (grads, plan.batch.params, plan.batch.group_of)

    def _planned_step(self, lr, grad_scale, skip, zero_grads_on_skip, amp):
        """The step through the cached plan; False (nothing written) when there is none, it no
        longer matches, a gradient is missing or the C core refused the call (the full path then
        runs and names the problem)."""
        plan, self._plan = self._plan, None
        grads = plan.grads() if plan is not None and plan.matches(self) else None
        if grads is None:
            return False
        try:
            batch = plan.refresh(grads)
            if batch is None:
                return False
            groups = [self._group_hparams(gi, g) for gi, g in enumerate(self.param_groups)]
            lrs = [g["lr"] for g in self.param_groups]
            self._run_batch(batch, groups, lrs, lr, grad_scale, skip, zero_grads_on_skip, amp)
        except (ValueError, TypeError, BufferError, RuntimeError, KeyError):
            return False  # validated before any write: the full path repeats it with names
        finally:
            plan.batch.release()
        self._clip_coef = {}
        self._plan = plan
        return True

    def _collect(self):
        """Flat lists per (device, amsgrad), each tensor tagged with its param_groups index, plus
        every group's validated hyperparameters and lr. State for parameters seen for the first
        time is created in new_state and committed only after the C calls succeeded."""
        batches = {}
        new_state = {}
        groups = [self._group_hparams(gi, g) for gi, g in enumerate(self.param_groups)]
        lrs = [g["lr"] for g in self.param_groups]
        dtensor = dtensor_type()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                name = f"param_groups[{gi}]['params'][{pi}]"
                if grad.is_sparse:
                    raise RuntimeError(f"{name}: AdamW does not support sparse gradients")
                dtype = p.dtype
                if dtype not in SUPPORTED_DTYPES and dtype not in COMPLEX_DTYPES:
                    check_supported_dtype(name, p)  # raises; also for state loaded elsewhere
                state = self.state.get(p)
                if not state:
                    state = new_state.get(p)
                    if state is None:
                        state = self._init_state(name, p, group["amsgrad"])
                        new_state[p] = state
                key = (p.device, bool(group["amsgrad"]))
                batch = batches.get(key)
                if batch is None:
                    batch = batches[key] = Batch(*key)
                if dtensor is not None and isinstance(p, dtensor):
                    # FSDP2 / tensor parallel: the element-wise step of the local shards (the
                    # state stays a DTensor, as torch's, for distributed checkpoints)
                    batch.wrappers.append(p)
                    batch.no_plan = True
                    p, grad, tensors = localize(name, p, grad, state, _STATE_KEYS)
                    grad = batch.laid_out_grad(name, grad, p)
                else:
                    if dtensor is not None:
                        refuse_plain_with_dtensor(name, p, grad, state, _STATE_KEYS)
                    # gradient and state in the parameter's layout: the state for good (the same
                    # values), the gradient as a copy for this step (the Plan re-reads .grad)
                    for k in _STATE_KEYS:
                        if k in state:
                            state[k] = in_layout_of(state[k], p)
                    grad, tensors = batch.laid_out_grad(name, grad, p), state
                if dtype in COMPLEX_DTYPES:
                    # as torch's AdamW: the real views of parameter, gradient and state (kept
                    # complex, as torch's) stepped by the real math. A Plan re-reads p.grad of
                    # the parameters it holds, so such a batch gets none.
                    batch.no_plan = True
                    p, grad = real_view(p), real_view(grad)
                    tensors = {k: real_view(v) if isinstance(v, Tensor) else v
                               for k, v in tensors.items() if k in _STATE_KEYS}
                    dtype = p.dtype
                if dtype is torch.float64:
                    batch.lr_dtype = torch.float64
                batch.group_of.append(gi)
                batch.params.append(p)
                batch.grads.append(grad)
                try:
                    batch.exp_avgs.append(tensors["exp_avg"])
                    batch.exp_avg_sqs.append(tensors["exp_avg_sq"])
                    if batch.amsgrad:
                        batch.max_exp_avg_sqs.append(tensors["max_exp_avg_sq"])
                    batch.steps.append(self._step_count(state, p.device))
                except (KeyError, TypeError, ValueError, RuntimeError) as e:
                    raise _malformed_state(name, state, e) from None
                batch.names.append(name)
        for batch in batches.values():
            batch.permute_dense()
        return list(batches.values()), new_state, groups, lrs

    def _beta_value(self, slot, beta):
        """A beta's float. A tensor on the CPU is read every step (no sync); one on a device is
        read once per version (an in-place op bumps it), so it costs a sync only when a
        schedule changed it."""
        if not isinstance(beta, Tensor):
            return beta
        if beta.device.type == "cpu":
            return _scalar("betas", beta)
        cached = self._beta_values.get(slot)
        if cached is None or cached[0] is not beta or cached[1] != beta._version:
            cached = self._beta_values[slot] = (beta, beta._version, _scalar("betas", beta))
        return cached[2]

    def _group_hparams(self, gi, group):
        """(beta1, beta2, eps, weight_decay, maximize), validated on the host before any write:
        a scheduler or a user may have changed them since construction."""
        where = f"param_groups[{gi}]"
        try:
            return self._checked_hparams(gi, group, where)
        except KeyError as e:  # looked for only on the error path: no cost to a step
            raise ValueError(f"{where}: no {e.args[0]!r} (e.g. a checkpoint's group without "
                             "it)") from None

    def _checked_hparams(self, gi, group, where):
        """_group_hparams's checks; a missing key raises KeyError."""
        lr = group["lr"]
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{where}['lr']: a tensor of {lr.numel()} elements, not 1")
        else:
            float_in_range(f"{where}['lr']", lr, 0.0, math.inf, high_open=False)
        try:
            beta1, beta2 = (self._beta_value((gi, k), b) for k, b in enumerate(group["betas"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}['betas'] = {group['betas']!r}: expected two numbers "
                             f"in [0, 1) ({e})") from None
        return (
            float_in_range(f"{where}['betas'][0]", beta1, 0.0, 1.0),
            float_in_range(f"{where}['betas'][1]", beta2, 0.0, 1.0),
            float_in_range(f"{where}['eps']", group["eps"], 0.0, math.inf, high_open=False),
            float_in_range(f"{where}['weight_decay']", group["weight_decay"], 0.0, math.inf,
                           high_open=False),
            bool(group["maximize"]),
        )

    @staticmethod
    def _step_count(state, device, copy=False):
        """state["step"] as the C core takes it, a float32 tensor on the parameter's device (with
        copy, a fresh one): code that writes optimizer.state itself may leave another
        (ZeroRedundancyOptimizer's load_state_dict moves 0-d state tensors to the CPU, as
        torch's AdamW keeps them). One of several elements is left for the C core to name."""
        step = state["step"]
        if not copy and isinstance(step, Tensor) and (
                step.dtype == torch.float32 and step.device == device or step.numel() != 1):
            return step
        state["step"] = torch.as_tensor(float(step), dtype=torch.float32, device=device)
        return state["step"]

    @staticmethod
    def _init_state(name, p, amsgrad):
        state = {
            "step": torch.zeros((), dtype=torch.float32, device=p.device),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _lr_tensor(self, device, lrs, dtype):
        """The groups' learning rates as one tensor of dtype (float32; float64, torch's Python
        float, when a parameter is float64) on the device (the C core reads them from memory, so a
        tensor lr never visits the host). Float lrs are cached and re-uploaded only when a value
        changed, in place and without a host sync (pinned, non-blocking), so the tensor keeps its
        address for CUDA graphs."""
        if any(isinstance(lr, Tensor) for lr in lrs):
            return torch.stack([
                torch.as_tensor(lr, dtype=dtype, device=device).reshape(()) for lr in lrs
            ])
        values = tuple(lrs)
        key = (device, dtype)
        cached = self._lr_cache.get(key)
        if cached is not None and cached[0] == values:
            return cached[1]
        host = torch.tensor(values, dtype=dtype)
        if device.type != "cuda":
            tensor = host
        else:
            tensor = cached[1] if cached is not None and len(cached[0]) == len(values) else \
                torch.empty(len(values), dtype=dtype, device=device)
            tensor.copy_(host.pin_memory(), non_blocking=True)
        self._lr_cache[key] = (values, tensor)
        return tensor

    def _run(self, batch, groups, lr, grad_scale, skip, zero_grads_on_skip, loss_scale):
        device = batch.device
        kwargs = exec_kwargs(device)
        lists = (batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs,
                 batch.max_exp_avg_sqs, batch.steps)
        scratch = None
        if device.type == "cuda":
            # Asking the C core imports every tensor; ask again only when the set's size changes.
            sig = (device, batch.amsgrad, len(batch.params))
            nbytes = self._scratch_bytes.get(sig)
            if nbytes is None:
                nbytes = self._scratch_bytes[sig] = _C.adamw_scratch_bytes(*lists)
            scratch = self._scratch.get(device, nbytes)
        try:
            _C.adamw_step(*lists, lr, groups, batch.group_of, amsgrad=batch.amsgrad,
                          grad_scale=grad_scale, skip=skip, scratch=scratch,
                          zero_grads_on_skip=zero_grads_on_skip, loss_scale=loss_scale, **kwargs)
        except (ValueError, TypeError, BufferError) as exc:
            group_names = [f"param_groups[{i}]" for i in range(len(groups))]
            reraise_with_names(exc, batch.names, group_names)
        if loss_scale is not None:
            # a gradient taken as a copy in its parameter's layout: the copy holds what the C
            # core stored (unscaled, or the scaled values of a skipped step). Inference mode:
            # an inference tensor's gradient takes the write too, as the C core's would.
            with torch.inference_mode():
                for _, grad, copy in batch.grad_copies:
                    grad.copy_(copy)
        # the tensors autograd may hold: parameters, and gradients the call may write (the
        # state's versions are left alone: no graph saves optimizer state)
        mark_written(batch.params, batch.wrappers,
                     batch.grads if zero_grads_on_skip or loss_scale is not None else ())
