"""titanmac_c.AdamW: torch.optim.AdamW's constructor, defaults, state keys and state_dict, with the
step run by the C core as one fused pass per device.

Shaped like torch/optim/adamw.py: a validated constructor, lazily created state, and state_dict /
load_state_dict from the base class, so a checkpoint loads into torch.optim.AdamW and back.
State per parameter: "step" (float32 0-d tensor on the parameter's device), "exp_avg",
"exp_avg_sq" and, with amsgrad, "max_exp_avg_sq" (all in the parameter's dtype).
"""

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import _C
from .._internal import profiling as prof
from .hparams import Hyperparameters
from .state import CommittedNewState, check_loaded_state, init_state, normalize_steps
from .amp import AmpScaling
from .._internal.distributed import dtensor_type
from .batching import Batch, Plan
from .differentiable import check_fused_supported, differentiable_group_step, is_differentiable
from .folded_clip import PendingClip, folded_clip
from .._internal.grad_mark import GradientMark
from .._internal.runtime import (
    COMPLEX_DTYPES,
    SUPPORTED_DTYPES,
    Scratch,
    before_write,
    check_supported_dtype,
    eager_only,
    exec_kwargs,
    mark_written,
    reraise_with_names,
    run_to_completion,
)


class AdamW(Optimizer):
    """Drop-in for torch.optim.AdamW (same arguments, defaults, state keys and state_dict).

    foreach and capturable are accepted for compatibility and change nothing: there is one fused
    path; fused=True changes only how torch.amp.GradScaler steps it (below), as it does torch's.
    differentiable=True is refused. Parameters: float32, bfloat16, float16, float64
    (computed in double) and complex64/complex128 (stepped as their real views, as torch's).

    Beyond torch: clip_grad_norm_(max_norm) computes the total gradient norm and folds the clip
    coefficient into the next step() (the gradients are scaled as the update loads them), which
    saves a pass over the gradients compared with clip_grad_norm_ followed by step().

    torch.amp.GradScaler: built with fused=True, like torch's fused AdamW, step() reads the
    scaler's grad_scale and found_inf attributes (_step_supports_amp_scaling): a step whose
    gradients overflowed is skipped on the device, and gradients not yet unscaled are unscaled as
    the update loads them and stored back unscaled; scaler.step(optimizer) then never reads the
    flag on the host. Otherwise GradScaler unscales the gradients and reads the flag itself, as
    for torch's default AdamW.
    """

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
        # torch's checks, in torch's order and words, before params is read (torch's
        # test_errors builds the optimizer with params=None and expects these errors)
        if isinstance(lr, Tensor):
            if foreach and not capturable:
                raise ValueError(
                    "lr as a Tensor is not supported for capturable=False and foreach=True")
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        try:
            n_betas = len(betas)
        except TypeError:  # a number, None: torch's 'float' object is not subscriptable
            raise TypeError(f"betas = {betas!r}: expected a pair of numbers (beta1, beta2)") \
                from None
        for i in range(min(n_betas, 2)):
            if not 0.0 <= betas[i] < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
        if n_betas != 2:  # torch raises at the first step (unpacking them)
            raise ValueError(f"betas: expected 2 values, got {n_betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (all(isinstance(b, float) for b in betas)
                or all(isinstance(b, Tensor) for b in betas)):
            raise ValueError("betas must be either both floats or both Tensors")
        for i, beta in enumerate(betas):
            if isinstance(beta, Tensor):
                if foreach and not capturable:
                    raise ValueError(f"betas[{i}] as a Tensor is not supported for "
                                     "capturable=False and foreach=True")
                if beta.numel() != 1:
                    raise ValueError(f"Tensor betas[{i}] must be 1-element")
        # tensors stay tensors in the groups, as torch keeps them (0-d), and are read at every
        # step: a schedule may change them in place
        betas = tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() else b for b in betas)
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
        if fused:
            if differentiable:
                raise RuntimeError("`fused` does not support `differentiable`")
            if foreach:
                raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        self._init_caches()

    def _init_caches(self):
        self._scratch = Scratch()
        self._scratch_bytes = {}  # (device, amsgrad, count) -> bytes the C core asked for
        # (the bookkeeping of the C call in progress, completed_calls() before it): see _run
        self._pending_finish = None
        self._hparams = Hyperparameters()  # the groups' values as each step hands them over
        self._pending_clip = PendingClip()  # clip_grad_norm_'s coefficient for the next step()
        self._plan = None  # batching.Plan of the last full step, when it can be reused
        # GradScaler hands grad_scale and found_inf to step() (AmpScaling) instead of unscaling
        # and reading found_inf on the host only for an optimizer that says so: as torch's, one
        # built with fused=True. Frameworks that refuse to clip such an optimizer under mixed
        # precision (Lightning) then treat ours as torch's of the same arguments
        self._step_supports_amp_scaling = bool(self.defaults.get("fused"))

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None),
                               ("capturable", False), ("differentiable", False),
                               ("fused", None)):
                group.setdefault(key, value)
            group["decoupled_weight_decay"] = True
        self._init_caches()
        normalize_steps(self)

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
        check_loaded_state(self.param_groups, state_dict)
        if hooks:
            self._optimizer_load_state_dict_pre_hooks = type(hooks)()
        # a pending clip_grad_norm_ coefficient stays: its gradients are unchanged, as torch's
        # clipped-in-place gradients survive a load (torch's load resets the caches through
        # __setstate__)
        pending_clip = self._pending_clip  # the object itself: wrappers share it (PendingClip)
        try:
            super().load_state_dict(state_dict)
        finally:
            if hooks:
                self._optimizer_load_state_dict_pre_hooks = hooks
        normalize_steps(self, copy=True)
        self._pending_clip = pending_clip
        self._plan = None

    # ------------------------------------------------------------------ stepping

    def zero_grad(self, set_to_none: bool = True):
        self._pending_clip.clear()
        super().zero_grad(set_to_none)

    @eager_only
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        total_norm=None):
        """Total norm of all gradients of this optimizer's parameters (a tensor); the next step()
        multiplies each gradient by min(1, max_norm / (norm + 1e-6)) as it loads it.

        total_norm: the norm already computed (e.g. group_norms().total_grad, or what
        get_total_norm returned): a one-element floating tensor or a number; then no pass over
        the gradients is made here, and the result has its dtype. The gradients themselves are not
        modified. The coefficient serves only these gradients: this optimizer's zero_grad()
        drops it; a gradient set to None or set anew before the step (the model's zero_grad()
        included) is taken unclipped, as torch's clipped one goes with it, while the others stay
        clipped; a gradient it did not see (a parameter added, or given its gradient, after it)
        steps unclipped; one changed in place (another backward, an in-place
        edit) steps unclipped with a warning, where torch's keeps its clipped part: clip after
        the last backward. A second call before the step first scales the gradients by the
        pending coefficient, in place, as torch's first clip left them, and measures them so.
        The coefficient serves one step: a second step() on the same gradients takes them
        unclipped, where torch's stay clipped. load_state_dict() keeps it; a copy of the
        optimizer (deepcopy, pickle) holds none. Under a GradScaler, call scaler.unscale_(self)
        first, as for torch's clip: a norm of still-scaled gradients clips them to max_norm
        times the scale (a step given the scale warns of it).
        """
        if self._pending_clip.watched:
            self._pending_clip.apply_to_kept_gradients()
        result, coef, planned = folded_clip(self, max_norm, norm_type, error_if_nonfinite,
                                            total_norm)
        if coef is None:  # no gradient
            self._pending_clip.clear()
            return result
        # the plan's gradients, read once for the norm and the mark (~65 ns a gradient each)
        mark = None if planned is None else GradientMark.of_planned(self._plan.owners, planned)
        self._pending_clip.set(coef, mark or GradientMark.of(self.param_groups))
        return result

    @eager_only
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient (one C call per device)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            differentiable = [g for g in self.param_groups if is_differentiable(g)]
            if differentiable:
                self._plan = None  # the fused step covers only the other groups
                for group in differentiable:
                    differentiable_group_step(self, group)
                if len(differentiable) == len(self.param_groups):
                    return loss
            amp = AmpScaling.of(self)
            if amp is not None:
                self._pending_clip.warn_if_loss_scaled(amp)
            adamw_step(self, amp=amp)
        except BaseException:  # a KeyboardInterrupt too
            # GradScaler removes its attributes only after a step that returned; left in place,
            # its next step would multiply the next loss scale into this one
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise
        return loss

    def _fused_step(self, lr=None, grad_scale=None, skip=None, zero_grads_on_skip=False,
                    amp=None, planned_grads=None):
        """The step itself. lr: None (the groups' "lr" values), or a float32 tensor with one
        learning rate per param group on the parameters' device; grad_scale / skip: None or
        float32 [1] device tensors (see titanmac.h tm_adamw_step; lr and grad_scale may also
        be float64). The DeepNestedOptimizer calls this with values its control step computed
        on the device. amp: the AmpScaling of a GradScaler's step, or None. planned_grads: the
        gradients _planned_flat returned to the caller within this step (nothing between could
        have replaced one), so the plan need not read them again."""
        self._pending_finish = None
        try:
            with prof.step_range(prof.UPDATE):
                self._fused_step_impl(lr, grad_scale, skip, zero_grads_on_skip, amp,
                                      planned_grads)
        except BaseException:
            self._finish_pending()
            raise
        self._pending_finish = None  # (holds the step's tensors)

    def _finish_pending(self):
        """After an interrupt: the bookkeeping of a C call that completed (it may surface as the
        call returns, or stop the bookkeeping half way), done now."""
        pending, self._pending_finish = self._pending_finish, None
        if pending is not None and _C.completed_calls() != pending[1]:
            run_to_completion(pending[0])

    def _fused_step_impl(self, lr, grad_scale, skip, zero_grads_on_skip, amp, planned_grads):
        marked = None  # the gradients the clip coefficient is for, as read now
        pending = self._pending_clip
        if pending.watched:
            marked = pending.mark.current()
            if marked is None:
                pending.apply_to_kept_gradients()
        args = (lr, grad_scale, skip, zero_grads_on_skip, amp)
        if self._planned_step(*args, marked=marked, planned_grads=planned_grads):
            return
        batches, new_state, groups, lrs = self._collect()
        if len(batches) > 1:
            grads_written = (amp is not None and amp.loss_scale is not None
                             or zero_grads_on_skip and skip is not None)
            for batch in batches:
                batch.precheck(grads_written)
                if lr is None:  # refuses a learning rate out of the batch's range before any call
                    self._hparams.lr_tensor(batch.device, lrs, batch.lr_dtype)
        if amp is not None and amp.loss_scale is not None:
            for batch in batches:
                batch.check_grads_storable()
        self._pending_clip.keep_to([p for batch in batches for p in batch.owners])
        committed = CommittedNewState(self.state, new_state)
        start = _C.completed_calls()  # each batch's call completed counts one

        def run_batches():
            while (done := _C.completed_calls() - start) < len(batches):
                self._run_batch(batches[done], groups, lrs, *args)

        try:
            committed.commit()
            run_batches()
            self._pending_clip.clear()
            n_params = sum(len(g["params"]) for g in self.param_groups)
            if (len(batches) == 1 and len(batches[0].params) == n_params
                    and not batches[0].no_plan):
                self._plan = Plan(self, batches[0])
        except Exception:  # refused before any write (the prechecks refuse a later call's
            # tensors before the first call); one after every call wrote keeps the state
            done = _C.completed_calls() - start
            if done < len(batches):
                committed.take_back(batches[done], batches)
            raise
        except BaseException:
            self._finish_pending()
            done = _C.completed_calls() - start
            # An interrupt (a KeyboardInterrupt, also one surfacing as a call returns: the count
            # of completed calls tells). Before any write the step did not happen; once a call
            # wrote, the step is completed, so no device is left a step behind the others, and
            # the clip coefficient is spent.
            if not done:
                committed.take_back(batches[0], batches)
                raise
            run_to_completion(run_batches)
            self._pending_clip.clear()
            raise

    def _run_batch(self, batch, groups, lrs, lr, grad_scale, skip, zero_grads_on_skip, amp):
        if lr is None:
            lr = self._hparams.lr_tensor(batch.device, lrs, batch.lr_dtype)
        scale = grad_scale if grad_scale is not None else self._pending_clip.coef.get(batch.device)
        loss_scale = None
        if amp is not None:
            loss_scale, found_inf = amp.inputs(batch.device)
            skip = found_inf if found_inf is not None else skip
        self._run(batch, groups, lr, scale, skip, zero_grads_on_skip, loss_scale)

    def _planned_grads(self):
        """Every parameter's gradient (one device) through the cached plan, or None."""
        flat = self._planned_flat()
        return None if flat is None else flat[0]

    def _planned_flat(self):
        """(grads, params, group_of) of every parameter in group order through the cached plan
        (read-only lists), or None when there is no valid plan, a gradient is missing or the
        parameters are DTensors (whose norms the full listing reduces over the mesh)."""
        plan = self._plan
        grads = (plan.grads() if plan is not None and not plan.sharded and plan.matches(self)
                 else None)
        return None if grads is None else (grads, plan.params, plan.batch.group_of)

    def _planned_step(self, lr, grad_scale, skip, zero_grads_on_skip, amp, marked=None,
                      planned_grads=None):
        """The step through the cached plan; False (nothing written) when there is none, it no
        longer matches, a gradient is missing or the C core refused the call (the full path then
        runs and names the problem). marked: the clip mark's gradients as just read, taken
        when the mark is of the plan's parameters (GradientMark.of_planned); planned_grads: as
        _fused_step's."""
        plan, self._plan = self._plan, None
        grads = None
        if plan is not None and plan.matches(self):
            if planned_grads is not None:
                grads = planned_grads
            elif marked is not None and self._pending_clip.mark.params is plan.owners:
                grads = marked
            else:
                grads = plan.grads()
        if grads is None:
            return False
        self._pending_clip.keep_to(plan.owners)
        calls = _C.completed_calls()
        try:
            batch = plan.refresh(grads)
            if batch is None:
                return False
            groups = [self._hparams.of_group(gi, g) for gi, g in enumerate(self.param_groups)]
            lrs = [g["lr"] for g in self.param_groups]
            self._run_batch(batch, groups, lrs, lr, grad_scale, skip, zero_grads_on_skip, amp)
        except (ValueError, TypeError, BufferError, RuntimeError, KeyError):
            return False  # validated before any write: the full path repeats it with names
        except BaseException:  # an interrupt: after the call's write, the step is taken
            if _C.completed_calls() != calls:
                self._pending_clip.clear()
                self._plan = plan
            raise
        finally:
            plan.batch.release()
        self._pending_clip.clear()
        self._plan = plan
        return True

    def _collect(self):
        """Flat lists per (device, amsgrad), each tensor tagged with its param_groups index, plus
        every group's validated hyperparameters and lr. State for parameters seen for the first
        time is created in new_state, which the step commits before its C calls and takes back
        from a refused one (CommittedNewState)."""
        batches = {}
        new_state = {}
        groups = [self._hparams.of_group(gi, g) for gi, g in enumerate(self.param_groups)]
        lrs = [g["lr"] for g in self.param_groups]
        dtensor = dtensor_type()
        for gi, group in enumerate(self.param_groups):
            if is_differentiable(group):
                continue  # stepped by torch's ops (AdamW.step)
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                name = f"param_groups[{gi}]['params'][{pi}]"
                if grad.is_sparse:
                    raise RuntimeError(f"{name}: AdamW does not support sparse gradients")
                if p.dtype not in SUPPORTED_DTYPES and p.dtype not in COMPLEX_DTYPES:
                    check_supported_dtype(name, p)  # raises; also for state loaded elsewhere
                state = self.state.get(p)
                if state is not None and not isinstance(state, dict):
                    # set by hand; torch's AdamW fails on it too, naming no parameter
                    raise TypeError(f"{name}: its state is a {type(state).__name__}, "
                                    "expected a dict")
                if not state:
                    state = new_state.get(p)
                    if state is None:
                        if group["fused"]:
                            check_fused_supported(p)
                        state = init_state(p, group["amsgrad"])
                        new_state[p] = state
                if p.device.type == "meta":
                    continue  # no values to step: its state is made (meta), as torch's
                key = (p.device, bool(group["amsgrad"]))
                batch = batches.get(key)
                if batch is None:
                    batch = batches[key] = Batch(*key)
                batch.add(gi, name, p, grad, state, dtensor)
        return list(batches.values()), new_state, groups, lrs

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
        # the tensors autograd may hold: parameters, and gradients the call may write (the
        # state's versions are left alone: no graph saves optimizer state)
        written = (batch.params, batch.wrappers,
                   batch.grads if zero_grads_on_skip or loss_scale is not None else ())
        before_write(*written)

        def finish():  # after the write; run again if interrupted, so it is all done
            batch.store_params()
            if loss_scale is not None:
                # a gradient taken as a copy in its parameter's layout: the copy holds what the
                # C core stored (unscaled, or the scaled values of a skipped step). Inference
                # mode: an inference tensor's gradient takes the write too, as the C core's.
                with torch.inference_mode():
                    for _, grad, copy in batch.grad_copies:
                        grad.copy_(copy)
            mark_written(*written)

        # an interrupt once the call completed (it may surface as the call returns) finishes
        # this in _fused_step: the parameters get what their state says
        self._pending_finish = (finish, _C.completed_calls())
        try:
            _C.adamw_step(*lists, lr, groups, batch.group_of, amsgrad=batch.amsgrad,
                          grad_scale=grad_scale, skip=skip, scratch=scratch,
                          zero_grads_on_skip=zero_grads_on_skip, loss_scale=loss_scale, **kwargs)
        except (ValueError, TypeError, BufferError) as exc:  # refused: nothing written
            twice = batch.listed_twice() if "shares memory" in str(exc) else None
            if twice is not None:
                raise ValueError(twice) from None
            group_names = [f"param_groups[{i}]" for i in range(len(groups))]
            reraise_with_names(exc, batch.names, group_names)
        finish()


# ---------------------------------------------------------------------------------------- entries
# What a caller that drives an AdamW from values it computed on the device (the
# DeepNestedOptimizer) uses instead of the optimizer's private members.

def adamw_step(optimizer, *, lr=None, grad_scale=None, skip=None, zero_grads_on_skip=False,
               amp=None, planned_grads=None):
    """One AdamW step of `optimizer` (a titanmac_c.AdamW) over every parameter with a gradient:
    what AdamW.step() runs, with the inputs a caller may compute on the device.

    lr: None (each group's "lr"), or a float32/float64 tensor with one learning rate per param
    group on the parameters' device. grad_scale: None, or a float32/float64 [1] device tensor
    multiplied into each gradient as it is loaded (a clip coefficient; without it a pending
    clip_grad_norm_ coefficient is used). skip: None, or a float32 [1] device tensor; nonzero
    skips the step on the device (no state advances; with zero_grads_on_skip the gradients are
    zeroed). amp: a GradScaler's AmpScaling, or None. planned_grads: the gradients
    planned_gradients() returned within this step, so they are not read again.
    See titanmac.h tm_adamw_step for the C contract. No host sync."""
    optimizer._fused_step(lr=lr, grad_scale=grad_scale, skip=skip,
                          zero_grads_on_skip=zero_grads_on_skip, amp=amp,
                          planned_grads=planned_grads)


def planned_gradients(optimizer):
    """(grads, params, group_of) of every parameter in group order, read through the optimizer's
    cached plan of its last full step (read-only lists), or None when there is no valid plan, a
    gradient is missing or the parameters are DTensors."""
    return optimizer._planned_flat()


def plan_token(optimizer):
    """An object that stays the same (by identity) while the optimizer's cached plan is: a cheap
    "are the groups as at my last look" check for a caller that saw planned_gradients() succeed."""
    return optimizer._plan


def group_hyperparameters(optimizer):
    """Each group's hyperparameters as the step hands them to the C core (betas, eps, weight
    decay, maximize), validated as the step validates them, with its amsgrad flag: a value the
    step would refuse raises here, before anything is written."""
    read = optimizer._hparams.of_group
    return tuple((read(gi, g), bool(g.get("amsgrad", False)))
                 for gi, g in enumerate(optimizer.param_groups))
