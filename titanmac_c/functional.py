"""Functional drop-ins for torch.nn.utils (get_total_norm, clip_grad_norm_) and the group norm
statistics, each a constant number of calls into the C core per device.

Differences from torch (also listed in the README):
- norm types: p > 0 and inf. torch also accepts 0, -inf and negative p; we raise ValueError.
- complex tensors: the 2-norm only (that of their real view, which is theirs); other p raise
  ValueError, where torch takes |z| element by element.
- the norm is reduced in double and returned in the promoted dtype of the tensors (as torch
  returns it); for bf16/fp16 gradients torch sums in that dtype, so ours is the more accurate one.
- clip_grad_norm_ computes the clip coefficient from the float32 norm (the float64 norm, in
  double, when a gradient is float64: torch's arithmetic for those).
- get_total_norm and clip_grad_norm_ never wait on the GPU unless error_if_nonfinite=True.
- non-contiguous tensors are taken in place when dense in another order (transposed,
  channels_last); others (strided slices, expanded tensors) are read through a contiguous copy
  (_runtime.call_dense), and gradients of that kind are scaled by torch's mul_.
- DTensors (FSDP2, tensor parallel): the local shards' norms are reduced over the device mesh
  (_distributed.ShardedNorms); the norm is returned as a replicated DTensor, as torch's.
"""

import types
import warnings
from collections import namedtuple

import torch

from . import _C
from . import _profiling as prof
from ._distributed import ShardedNorms, any_dtensor, local_of
from ._runtime import (
    as_number,
    before_write,
    call_dense,
    compute_dtype,
    eager_only,
    exec_kwargs,
    is_expanded,
    is_strided_only,
    mark_written,
    memory_real_view,
    norms_scratch,
    reraise_with_names,
    user_stacklevel,
)

GroupNorms = namedtuple("GroupNorms", "grad param total_grad total_param nonfinite")
GroupNorms.__doc__ = """Per-group and global norms from one fused pass.

grad, param: [num_groups]; total_grad, total_param, nonfinite: 0-d tensors (nonfinite is 1.0
when any gradient element is NaN or infinite); float32, or float64 when a tensor is float64.
param and total_param are None when no parameters were given."""

_NONFINITE_MESSAGE = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


def _raise_if_nonfinite(total, norm_type):
    """error_if_nonfinite's check (a host read of the norm), with torch's message."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(_NONFINITE_MESSAGE.format(norm_type))


def _as_parsed_number(name, value) -> float:
    """as_number, but a string is parsed as torch's clip_grad_norm_ parses its max_norm and
    norm_type (float(); its docs name 'inf')."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name} = {value!r}: expected a number") from None
    return as_number(name, value)


def _check_norm_type(norm_type) -> float:
    norm_type = _as_parsed_number("norm_type", norm_type)
    if not (norm_type > 0.0):
        raise ValueError(f"norm_type = {norm_type}: titanmac_c supports p > 0 and inf")
    return norm_type


def _check_max_norm(max_norm) -> float:
    """>= 0; inf is torch's idiom for measuring without clipping (the coefficient is then 1)."""
    max_norm = _as_parsed_number("max_norm", max_norm)
    if not max_norm >= 0.0:
        raise ValueError(f"max_norm = {max_norm}: must be >= 0 (inf: no clipping)")
    return max_norm


def _check_is_tensor(label, i, t):
    """A torch tensor, as torch's functions take: another library's array (NumPy's has a .device
    too, a string) has no torch device to put the outputs on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{label}[{i}]: expected a torch.Tensor, got {type(t).__name__}")


def _by_device(label, tensors):
    """The tensors that are not None grouped by device, in first-seen order, each group as
    (their positions in tensors, the tensors): the C core numbers each call's own list, and an
    error names the user's position instead (_call_named)."""
    groups = {}
    for i, t in enumerate(tensors):
        if t is not None:
            _check_is_tensor(label, i, t)
            positions, ts = groups.setdefault(t.device, ([], []))
            positions.append(i)
            ts.append(t)
    return groups


def _call_named(label, positions, fn, tensors, read_only=False):
    """call_dense(fn, tensors) with a refused tensor's message naming it as the user does
    ("parameters[4]"; the names are made only on an error)."""
    try:
        return call_dense(fn, tensors, read_only=read_only)
    except (ValueError, TypeError, BufferError, RuntimeError) as exc:
        # torch's own error on a sparse tensor (its DLPack export's) says only that it has no
        # storage: say what it is (checked only here, on the error path: no cost to a step)
        for i, t in zip(positions, tensors):
            if t.layout != torch.strided:
                raise NotImplementedError(f"{label}[{i}]: {t.layout} tensors are not supported "
                                          "(nor by torch's norm)") from None
        if isinstance(exc, RuntimeError):
            raise
        reraise_with_names(exc, [f"{label}[{i}]" for i in positions])


def _total_on_device(label, positions, tensors, norm_type, device, max_norm=None):
    """[3] tensor: [0] the group output (unused), [1] the p-norm of tensors, [2] the clip
    coefficient for max_norm (when given: written by the same call); float32, float64 when a
    tensor is (_compute_dtype)."""
    out = torch.empty(3, dtype=_compute_dtype(tensors), device=device)
    clip = {} if max_norm is None else dict(coef=out[2:3], max_norm=max_norm)

    def run(ts):
        _C.norms(ts, None, out[0:1], out[1:2], norm_type=norm_type,
                 scratch=norms_scratch(device, ts), **clip, **exec_kwargs(device))

    _call_named(label, positions, run, tensors, read_only=True)
    return out


def _sharded(label, tensors, names=None):
    """ShardedNorms of the tensors (None entries skipped) when any is a DTensor, else None."""
    if not any_dtensor(tensors):
        return None
    positions = [i for i, t in enumerate(tensors) if t is not None]
    return ShardedNorms(label, positions, [tensors[i] for i in positions], names)


def _local_norm(label, norm_type):
    """For ShardedNorms.total: the 0-d norm of local shards (one C call)."""
    return lambda positions, tensors: _total_on_device(
        label, positions, tensors, norm_type, tensors[0].device)[1]


def _scale_grads(device, positions, grads, coef, *written):
    """grads *= coef (a float32 or float64 [1] tensor on device), in one C call; gradients the C
    core cannot take in place (strided slices) by torch's mul_ after it."""
    kwargs = exec_kwargs(device)
    before_write(grads, *written)
    try:
        _call_named("parameters", positions, lambda ts: _C.scale_(ts, coef, **kwargs), grads)
    except BufferError:
        strided = [i for i, g in enumerate(grads) if is_strided_only(g)]
        if not strided:
            raise
        _refuse_expanded([positions[i] for i in strided], [grads[i] for i in strided])
        dense = [i for i in range(len(grads)) if i not in strided]
        _call_named("parameters", [positions[i] for i in dense],
                    lambda ts: _C.scale_(ts, coef, **kwargs), [grads[i] for i in dense])
        with torch.no_grad():  # as torch's clip: a gradient may be a leaf requiring grad
            for i in strided:  # one rounding, as the C core scales: float32 math but float64
                factor = coef[0].to(compute_dtype(grads[i].dtype))
                grads[i].copy_(grads[i].to(factor.dtype) * factor)
    mark_written(grads, *written)


def _refuse_expanded(positions, grads):
    """torch's own refusal of an in-place scale, by name: a gradient with several elements on one
    memory location (an expanded tensor)."""
    for i, g in zip(positions, grads):
        if is_expanded(g):
            raise RuntimeError(f"parameters[{i}]: its gradient is an expanded tensor (several "
                               "elements on one memory location) and cannot be scaled in "
                               "place, as with torch") from None


def _real_views(label, tensors, norm_type):
    """tensors with complex ones as their real views (the rest as given): the 2-norm of a
    complex tensor is that of its real and imaginary parts, and scaling them scales it. Other
    norms are refused by name (torch's take |z| element by element)."""
    complex_at = [i for i, t in enumerate(tensors)
                  if isinstance(t, torch.Tensor) and t.is_complex()]
    if not complex_at:
        return tensors
    if norm_type != 2.0:
        i = complex_at[0]
        raise ValueError(f"{label}[{i}]: complex ({tensors[i].dtype}); titanmac_c takes complex "
                         f"tensors for the 2-norm only, not norm_type = {norm_type}")
    tensors = list(tensors)
    for i in complex_at:
        tensors[i] = memory_real_view(tensors[i])
    return tensors


def _result_dtype(tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _compute_dtype(tensors):
    """The dtype of the norms and coefficients the C core computes for these tensors."""
    return compute_dtype(_result_dtype(tensors))


def _combine_totals(totals, devices, norm_type):
    """The norm over several devices' norms, on the first device (torch does the same)."""
    if len(totals) == 1:
        return totals[0]
    stacked = torch.stack([t.to(devices[0]) for t in totals])
    return torch.linalg.vector_norm(stacked, norm_type)


@eager_only
def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """The norm of all tensors as one vector, like torch.nn.utils.get_total_norm.

    `foreach` is accepted for signature compatibility and ignored: there is one fused path.
    """
    del foreach
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = _check_norm_type(norm_type)
    if len(tensors) == 0:
        return torch.tensor(0.0)
    return _with_real_views("tensors", tensors, norm_type,
                            lambda ts: _total_norm(ts, norm_type, error_if_nonfinite))


def _with_real_views(label, tensors, norm_type, run):
    """run(tensors), or when the C core refused a tensor and some are complex, run(tensors with
    the complex ones as their real views) (_real_views): found on the error path, so that a call
    without complex tensors pays nothing for them. A refusal comes from a norm pass, before
    anything is written."""
    try:
        return run(tensors)
    except BufferError as exc:
        refused = exc
    real = _real_views(label, tensors, norm_type)
    if real is tensors:
        raise refused
    return run(real)


def _total_norm(tensors, norm_type, error_if_nonfinite):
    sharded = _sharded("tensors", tensors)
    if sharded is not None:
        total = sharded.total(_local_norm("tensors", norm_type), norm_type)
    else:
        by_device = _by_device("tensors", tensors)
        totals = [_total_on_device("tensors", *placed, norm_type, dev)[1]
                  for dev, placed in by_device.items()]
        total = _combine_totals(totals, list(by_device), norm_type)
    dtype = _result_dtype(tensors)
    if dtype != total.dtype:
        total = total.to(dtype)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, norm_type)
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
    max_norm = _check_max_norm(max_norm)
    norm_type = _check_norm_type(norm_type)
    all_grads = [p.grad for p in params]
    if all(g is None for g in all_grads):
        return torch.tensor(0.0)
    return _with_real_views("parameters", all_grads, norm_type, lambda gs: _clip(
        gs, max_norm, norm_type, error_if_nonfinite))


def _clip(all_grads, max_norm, norm_type, error_if_nonfinite):
    grads = [g for g in all_grads if g is not None]
    sharded = _sharded("parameters", all_grads)
    if sharded is not None:
        return _clip_sharded(sharded, max_norm, norm_type, error_if_nonfinite,
                             _result_dtype(grads))
    by_device = _by_device("parameters", all_grads)
    devices = list(by_device)
    single = len(devices) == 1
    with prof.step_range(prof.STATS):
        buffers = [_total_on_device("parameters", *placed, norm_type, dev,
                                    max_norm if single else None)
                   for dev, placed in by_device.items()]
    total = _combine_totals([b[1] for b in buffers], devices, norm_type)
    dtype = _result_dtype(grads)  # returned in the gradients' dtype, as torch's
    result = total if dtype == total.dtype else total.to(dtype)
    if error_if_nonfinite:  # on the norm as returned: an fp16 one is inf where the float32 one
        _raise_if_nonfinite(result, norm_type)  # is finite, and torch raises there
    if not single:  # one C call per device: what one would refuse, refused before any
        for positions, device_grads in by_device.values():
            _refuse_expanded(positions, device_grads)
    with prof.step_range(prof.CLIP):
        for (device, (positions, device_grads)), buf in zip(by_device.items(), buffers):
            coef = buf[2:3]
            if not single:  # the coefficient of the norm over all devices
                _C.clip_coef(total.reshape(1).to(device), max_norm, coef,
                             stream=exec_kwargs(device).get("stream"))
            _scale_grads(device, positions, device_grads, coef)
    return result


def _clip_sharded(sharded, max_norm, norm_type, error_if_nonfinite, dtype):
    """clip_grad_norm_ of DTensor gradients: the norm over all ranks, then every rank scales
    its local shards by the same coefficient."""
    with prof.step_range(prof.STATS):
        total = sharded.total(_local_norm("parameters", norm_type), norm_type)
    if error_if_nonfinite:
        _raise_if_nonfinite(total.to(dtype), norm_type)
    device = total.device
    coef = torch.empty(1, dtype=total.dtype, device=device)
    _C.clip_coef(total.reshape(1), max_norm, coef, stream=exec_kwargs(device).get("stream"))
    with prof.step_range(prof.CLIP):  # one call: a refused gradient stops all before any write
        _scale_grads(device, sharded.positions, [local_of(t) for t in sharded.tensors], coef,
                     sharded.tensors)
    return sharded.replicated(total if dtype == total.dtype else total.to(dtype))


@eager_only
def group_norms(grads, params=None, group_of=None, num_groups=1, norm_type=2.0):
    """Per-group and global norms of `grads` (and of `params`) in one pass over memory.

    group_of[i] is the group of tensor i (None: all in group 0). All tensors on one device.
    Returns GroupNorms(grad, param, total_grad, total_param, nonfinite).
    """
    grads = list(grads)
    params = None if params is None else list(params)
    norm_type = _check_norm_type(norm_type)
    num_groups = int(num_groups)
    if num_groups < 1:
        raise ValueError(f"num_groups = {num_groups}: must be >= 1")
    if len(grads) == 0:
        raise ValueError("grads: at least one tensor is needed to know the device")
    for label, tensors in (("grads", grads), ("params", params or ())):
        for i, t in enumerate(tensors):
            _check_is_tensor(label, i, t)
    device = grads[0].device
    n_out = 2 * num_groups + 3
    out = torch.empty(n_out, dtype=_compute_dtype(grads + (params or [])), device=device)
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
