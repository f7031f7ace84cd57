"""AdamW.clip_grad_norm_'s computation: the total norm of the optimizer's gradients and the clip
coefficient min(1, max_norm / (norm + 1e-6)) that its next step() multiplies into each gradient
as it loads it (the gradients themselves are not written, unless the coefficient can no longer
serve them all: PendingClip.apply_to_kept_gradients). The coefficient is that of the norm as
returned (in the gradients' dtype), as torch's clip_grad_norm_ computes it."""

import numbers
import warnings

import torch
from torch import Tensor

from .. import _C
from .._internal import profiling as prof
from .._internal.distributed import any_dtensor, is_dtensor, local_of, replicated
from .._internal.runtime import (
    call_dense,
    compute_dtype,
    exec_kwargs,
    memory_real_view,
    norms_scratch,
    user_stacklevel,
)
from .._internal.norm_calls import (
    check_max_norm,
    check_norm_type,
    coef_kwargs,
    local_norm,
    raise_if_nonfinite,
    real_views,
    result_dtype,
    returned_norm,
    scale_grads,
    sharded_norms,
)


class PendingClip:
    """The coefficient AdamW.clip_grad_norm_ leaves for the next step(): coef, {device: [1]
    coefficient tensor} (empty when none is pending), and mark, the GradientMark of the
    gradients it serves. One object per optimizer, changed in place and never replaced between
    loads: wrappers that copy the optimizer's __dict__ and call its methods on themselves
    (Lightning's LightningOptimizer, Fabric's optimizer) then set the coefficient that the
    wrapped optimizer's own step() reads, where an attribute assigned on the wrapper would be
    lost and the step would run unclipped."""

    __slots__ = ("coef", "mark")

    def __init__(self):
        self.coef, self.mark = {}, None

    def set(self, coef, mark):
        self.coef, self.mark = {coef.device: coef}, mark

    def clear(self):
        self.coef, self.mark = {}, None

    @property
    def watched(self):
        """Whether a coefficient is pending with the mark of its gradients."""
        return bool(self.coef) and self.mark is not None

    def keep_to(self, owners):
        """Before a step that multiplies the coefficient into the gradients of owners (their
        parameters): when one of them is not among the clipped gradients (its parameter was
        added, or given its gradient, after the clip), torch's clip left it unscaled, so the
        clipped gradients are scaled in place and the step takes no coefficient."""
        if self.watched and not self.mark.covers(owners):
            self.apply_to_kept_gradients()

    def warn_if_loss_scaled(self, amp):
        """GradScaler hands step() a loss scale only when unscale_ has not run, so a coefficient
        pending then was measured on gradients still multiplied by it: it clips them to max_norm
        times the scale, as torch's clip_grad_norm_ called there would. Frameworks unscale before
        their clip; a folded clip put in place of theirs (docs/frameworks.md) must too."""
        if self.coef and amp.loss_scale is not None:
            warnings.warn("AdamW.clip_grad_norm_ measured gradients still multiplied by the "
                          "GradScaler's loss scale (no scaler.unscale_(optimizer) before it), so "
                          "it clips them to max_norm times the scale, as torch's clip_grad_norm_ "
                          "would there; call scaler.unscale_(optimizer) first (accelerate: "
                          "accelerator.unscale_gradients())", stacklevel=user_stacklevel())

    def apply_to_kept_gradients(self):
        """Some of the clipped gradients are gone or changed (replaced, set to None, e.g. by
        model.zero_grad() after a skipped batch, or changed in place), the step takes one the
        clip did not see, or another clip comes first: torch's clip scaled the clipped ones in
        place, so what replaced them is not clipped, while those left as they were stay clipped
        (and a second clip measures them so). So those are scaled now, in place, and the
        coefficient is cleared. A gradient changed in place (another backward accumulated onto
        it) steps unclipped where torch's keeps its clipped part, clip(g1) + g2: the old part
        is no longer there to scale, so a warning says so."""
        (device, coef), = self.coef.items()
        kept, edited = self.mark.kept_and_edited()
        if edited:
            warnings.warn(f"AdamW.clip_grad_norm_: {edited} of the clipped gradients changed in "
                          "place before step() (another backward accumulated onto them, or an "
                          "in-place edit or zeroing) and step unclipped, where torch's clip "
                          "would have scaled their part before the change; call clip_grad_norm_ "
                          "after the last backward, or titanmac_c.clip_grad_norm_, which scales "
                          "the gradients in place", stacklevel=user_stacklevel())
        kept = [memory_real_view(local_of(g) if is_dtensor(g) else g)  # a shard's own memory
                for g in kept]
        self.clear()
        if kept:
            scale_grads(device, list(range(len(kept))), kept, coef)


def given_total_norm(total_norm, device, dtype):
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


def _gradients(optimizer, norm_type):
    """(the gradients to norm, the returned norm's dtype or None): the plan's, whose dtype the
    parameters fix while it holds (the C core refuses gradients of another dtype), so reckoned
    once per plan; else the groups' (complex ones as their real views; a plan holds none, so
    its step pays nothing for them)."""
    grads = optimizer._planned_grads()
    if grads is not None:
        return grads, optimizer._plan.norm_dtype
    grads = [g for g in (p.grad for group in optimizer.param_groups
                         for p in group["params"]) if g is not None]
    grads = real_views("grads", grads, norm_type)
    if len({g.device for g in grads}) > 1:
        raise ValueError("clip_grad_norm_: parameters on several devices; use "
                         "titanmac_c.clip_grad_norm_ instead")
    return grads, None


def _raise_if_sparse(optimizer):
    """A sparse gradient fails the norms with torch's DLPack message ("no storage"): name it
    (torch's clip_grad_norm_ raises NotImplementedError for it too)."""
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if p.grad is not None and p.grad.layout != torch.strided:
                raise NotImplementedError(f"param_groups[{gi}]['params'][{pi}]: {p.grad.layout} "
                                          "gradients are not supported (nor by torch's "
                                          "clip_grad_norm_)") from None


def folded_clip(optimizer, max_norm, norm_type, error_if_nonfinite, total_norm):
    """(the total norm as AdamW.clip_grad_norm_ returns it, the [1] coefficient tensor on the
    gradients' device or None when there is no gradient, the gradients of every grouped
    parameter when the cached plan gave them, else None). Writes nothing of the optimizer."""
    max_norm = check_max_norm(max_norm)
    norm_type = check_norm_type(norm_type)
    grads, dtype = _gradients(optimizer, norm_type)
    planned = grads if dtype is not None else None  # _gradients knows the dtype from a plan only
    if not grads:
        return torch.tensor(0.0), None, None
    sharded = mesh = None  # mesh: the result is returned replicated over it
    # the plan's gradients hold no DTensor (_planned_flat gives none of a sharded plan)
    if total_norm is None and dtype is None and any_dtensor(grads):
        names = [f"param_groups[{gi}]['params'][{pi}]"
                 for gi, group in enumerate(optimizer.param_groups)
                 for pi, p in enumerate(group["params"]) if p.grad is not None]
        sharded = sharded_norms("grads", grads, names)
        mesh = sharded.mesh
    if is_dtensor(total_norm):  # returned as it came, a replicated DTensor
        mesh, total_norm = total_norm.device_mesh, total_norm.full_tensor()
    device = grads[0].device
    if dtype is None:
        dtype = result_dtype(grads)
    # the norm and coefficient in float32, or in float64 (torch's arithmetic) for float64
    # gradients or a float64 total_norm given
    work = compute_dtype(dtype)
    if total_norm is not None:
        total_norm = given_total_norm(total_norm, device, work)
        work = compute_dtype(torch.promote_types(work, total_norm.dtype))
        dtype = total_norm.dtype  # the result's, as the norm given
    total, coef = _norm_and_coef(optimizer, grads, sharded, total_norm, norm_type, max_norm,
                                 work, dtype)
    # in the gradients' dtype, as torch's clip_grad_norm_ returns it, and the coefficient is
    # that of this value (_norm_and_coef)
    result = returned_norm(total[0], dtype)
    if error_if_nonfinite:  # the norm as returned: an fp16 one is inf where the float32 one
        raise_if_nonfinite(result, norm_type)  # is finite, and torch raises there
    return (result if mesh is None else replicated(mesh, result)), coef, planned


def _norm_and_coef(optimizer, grads, sharded, total_norm, norm_type, max_norm, work, dtype):
    """(the total norm, the clip coefficient), [1] tensors of dtype work on the gradients'
    device: over all ranks for DTensors (sharded), from total_norm when one is given, else from
    one pass over the gradients whose finishing step also writes the coefficient (one launch on
    CUDA). The coefficient is that of the norm rounded to dtype, the one returned (a given
    total_norm has that dtype already)."""
    device = grads[0].device
    buf = torch.empty(3, dtype=work, device=device)  # the norm, the coefficient, a group norm
    kwargs = exec_kwargs(device)
    if sharded is not None:
        with prof.step_range(prof.STATS):
            total = sharded.total(local_norm("grads", norm_type), norm_type).reshape(1)
    elif total_norm is not None:
        total = total_norm.reshape(1).to(work)
    else:
        def run(ts):
            _C.norms(ts, None, buf[2:3], buf[0:1], norm_type=norm_type, coef=buf[1:2],
                     scratch=norms_scratch(device, ts), **coef_kwargs(max_norm, dtype),
                     **kwargs)

        with prof.step_range(prof.STATS):
            try:
                call_dense(run, grads, read_only=True)
            except (BufferError, RuntimeError):
                _raise_if_sparse(optimizer)
                raise
        return buf[0:1], buf[1:2]
    # a total_norm given holds the value returned (its dtype is the result's) already
    returned = total if total_norm is not None else returned_norm(total, dtype)
    _C.clip_coef(returned, max_norm, buf[1:2], stream=kwargs.get("stream"))
    return total, buf[1:2]
