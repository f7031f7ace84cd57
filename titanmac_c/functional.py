"""Functional drop-ins for torch.nn.utils (get_total_norm, clip_grad_norm_) and the group norm
statistics, each a constant number of calls into the C core per device.

Differences from torch (also listed in docs/adamw.md):
- norm types: p > 0 and inf. torch also accepts 0, -inf and negative p; we raise ValueError.
- complex tensors: the 2-norm only (that of their real view, which is theirs); other p raise
  ValueError, where torch takes |z| element by element.
- the norm is reduced in double and returned in the promoted dtype of the tensors (as torch
  returns it); for bf16/fp16 gradients torch sums in that dtype, so ours is the more accurate one.
- clip_grad_norm_ computes the clip coefficient from the norm it returns, as torch's does: in
  float32 from the norm in the gradients' dtype (a bf16/fp16 norm is the double-reduced norm
  rounded to that dtype; a float16 one past 65504 is inf, which scales the gradients by 0), in
  double from a float64 norm. torch also rounds each step of the coefficient (the reciprocal,
  the product) to the gradients' dtype; ours stays float32, so clipped bf16/fp16 gradients may
  differ from torch's by one unit of their rounding.
- get_total_norm and clip_grad_norm_ never wait on the GPU unless error_if_nonfinite=True.
- non-contiguous tensors are taken in place when dense in another order (transposed,
  channels_last); others (strided slices, expanded tensors) are read through a contiguous copy
  (_internal/runtime.py: call_dense), and gradients of that kind are scaled by torch's mul_.
- DTensors (FSDP2, tensor parallel): the local shards' norms are reduced over the device mesh
  (_internal/distributed.py: ShardedNorms); the norm is returned as a replicated DTensor, as
  torch's.
"""

import types
import warnings
from collections import namedtuple

import torch

from . import _C
from ._internal import profiling as prof
from ._internal.distributed import local_of
from ._internal.norm_calls import (
    group_by_device,
    check_is_tensor,
    check_max_norm,
    check_norm_type,
    combine_totals,
    compute_dtype_of,
    local_norm,
    raise_if_nonfinite,
    refuse_expanded,
    result_dtype,
    returned_norm,
    scale_grads,
    sharded_norms,
    total_on_device,
    with_real_views,
)
from ._internal.runtime import call_dense, eager_only, exec_kwargs, norms_scratch, user_stacklevel

GroupNorms = namedtuple("GroupNorms", "grad param total_grad total_param nonfinite")
GroupNorms.__doc__ = """Per-group and global norms from one fused pass.

grad, param: [num_groups]; total_grad, total_param, nonfinite: 0-d tensors (nonfinite is 1.0
when any gradient element is NaN or infinite); float32, or float64 when a tensor is float64.
param and total_param are None when no parameters were given."""

@eager_only
def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """The norm of all tensors as one vector, like torch.nn.utils.get_total_norm.

    `foreach` is accepted for signature compatibility and ignored: there is one fused path.
    """
    del foreach
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = check_norm_type(norm_type)
    if len(tensors) == 0:
        return torch.tensor(0.0)
    return with_real_views("tensors", tensors, norm_type,
                            lambda ts: _total_norm(ts, norm_type, error_if_nonfinite))


def _total_norm(tensors, norm_type, error_if_nonfinite):
    sharded = sharded_norms("tensors", tensors)
    if sharded is not None:
        total = sharded.total(local_norm("tensors", norm_type), norm_type)
    else:
        by_device = group_by_device("tensors", tensors)
        totals = [total_on_device("tensors", *placed, norm_type, dev)[1]
                  for dev, placed in by_device.items()]
        total = combine_totals(totals, list(by_device), norm_type)
    dtype = result_dtype(tensors)
    if dtype != total.dtype:
        total = total.to(dtype)
    if error_if_nonfinite:
        raise_if_nonfinite(total, norm_type)
    return total if sharded is None else sharded.replicated(total)


@eager_only
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Clip the gradients of `parameters` to a total norm of `max_norm`, like
    torch.nn.utils.clip_grad_norm_: grads *= min(1, max_norm / (total_norm + 1e-6)).

    Returns the total norm (before clipping) as a tensor. No host sync unless
    error_if_nonfinite=True. `foreach` is accepted and ignored.
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
        if not params and isinstance(parameters, types.GeneratorType):
            # torch's warning: most often a model.parameters() generator already used up
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=user_stacklevel())
    max_norm = check_max_norm(max_norm)
    norm_type = check_norm_type(norm_type)
    all_grads = [p.grad for p in params]
    if all(g is None for g in all_grads):
        return torch.tensor(0.0)
    return with_real_views("parameters", all_grads, norm_type, lambda gs: _clip(
        gs, max_norm, norm_type, error_if_nonfinite))


def _clip(all_grads, max_norm, norm_type, error_if_nonfinite):
    grads = [g for g in all_grads if g is not None]
    sharded = sharded_norms("parameters", all_grads)
    if sharded is not None:
        return _clip_sharded(sharded, max_norm, norm_type, error_if_nonfinite,
                             result_dtype(grads))
    by_device = group_by_device("parameters", all_grads)
    devices = list(by_device)
    single = len(devices) == 1
    dtype = result_dtype(grads)  # returned in the gradients' dtype, as torch's
    with prof.step_range(prof.STATS):
        buffers = [total_on_device("parameters", *placed, norm_type, dev,
                                    max_norm if single else None, dtype)
                   for dev, placed in by_device.items()]
    total = combine_totals([b[1] for b in buffers], devices, norm_type)
    result = returned_norm(total, dtype)
    if error_if_nonfinite:  # on the norm as returned: an fp16 one is inf where the float32 one
        raise_if_nonfinite(result, norm_type)  # is finite, and torch raises there
    if not single:  # one C call per device: what one would refuse, refused before any
        for positions, device_grads in by_device.values():
            refuse_expanded(positions, device_grads)
    with prof.step_range(prof.CLIP):
        for (device, (positions, device_grads)), buf in zip(by_device.items(), buffers):
            coef = buf[2:3]
            if not single:  # the coefficient of the norm over all devices, as returned
                _C.clip_coef(result.reshape(1).to(device), max_norm, coef,
                             stream=exec_kwargs(device).get("stream"))
            scale_grads(device, positions, device_grads, coef)
    return result


def _clip_sharded(sharded, max_norm, norm_type, error_if_nonfinite, dtype):
    """clip_grad_norm_ of DTensor gradients: the norm over all ranks, then every rank scales
    its local shards by the same coefficient."""
    with prof.step_range(prof.STATS):
        total = sharded.total(local_norm("parameters", norm_type), norm_type)
    result = returned_norm(total, dtype)
    if error_if_nonfinite:
        raise_if_nonfinite(result, norm_type)
    device = total.device
    coef = torch.empty(1, dtype=total.dtype, device=device)
    # from the norm as returned, as in _clip
    _C.clip_coef(result.reshape(1), max_norm, coef, stream=exec_kwargs(device).get("stream"))
    with prof.step_range(prof.CLIP):  # one call: a refused gradient stops all before any write
        scale_grads(device, sharded.positions, [local_of(t) for t in sharded.tensors], coef,
                     sharded.tensors)
    return sharded.replicated(result)


@eager_only
def group_norms(grads, params=None, group_of=None, num_groups=1, norm_type=2.0):
    """Per-group and global norms of `grads` (and of `params`) in one pass over memory.

    group_of[i] is the group of tensor i (None: all in group 0). All tensors on one device.
    Returns GroupNorms(grad, param, total_grad, total_param, nonfinite).
    """
    grads = list(grads)
    params = None if params is None else list(params)
    norm_type = check_norm_type(norm_type)
    num_groups = int(num_groups)
    if num_groups < 1:
        raise ValueError(f"num_groups = {num_groups}: must be >= 1")
    if len(grads) == 0:
        raise ValueError("grads: at least one tensor is needed to know the device")
    for label, tensors in (("grads", grads), ("params", params or ())):
        for i, t in enumerate(tensors):
            check_is_tensor(label, i, t)
    device = grads[0].device
    n_out = 2 * num_groups + 3
    out = torch.empty(n_out, dtype=compute_dtype_of(grads + (params or [])), device=device)
    g = num_groups
    kwargs = dict(group_of=group_of, num_groups=g, norm_type=norm_type, nonfinite=out[2 * g + 2 :])
    if params is not None:
        kwargs.update(group_param=out[g : 2 * g], total_param=out[2 * g + 1 : 2 * g + 2])

    def run(gs, ps):
        _C.norms(gs, ps, out[0:g], out[2 * g : 2 * g + 1], scratch=norms_scratch(device, gs, ps),
                 **kwargs, **exec_kwargs(device))

    # strided tensors as contiguous copies (each tensor's norm is its own: nothing pairs)
    call_dense(run, grads, params, read_only=True)
    has_params = params is not None
    return GroupNorms(
        grad=out[0:g],
        param=out[g : 2 * g] if has_params else None,
        total_grad=out[2 * g],
        total_param=out[2 * g + 1] if has_params else None,
        nonfinite=out[2 * g + 2],
    )


__all__ = ["GroupNorms", "clip_grad_norm_", "get_total_norm", "group_norms"]
