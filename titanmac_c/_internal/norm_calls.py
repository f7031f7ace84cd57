"""The norm and scale calls of the C core as the public functions and the optimizers make them:
argument checks with torch's messages, tensors grouped by device, refusals renamed to the caller's
numbering, complex tensors as their real views, strided gradients scaled by torch, DTensor norms
reduced over their mesh. functional.py (the torch.nn.utils drop-ins), the AdamW folded clip and the
DeepNestedOptimizer all call through here."""

import torch

from .. import _C
from .distributed import ShardedNorms, any_dtensor
from .runtime import (
    as_number,
    before_write,
    call_dense,
    compute_dtype,
    exec_kwargs,
    is_expanded,
    is_strided_only,
    mark_written,
    memory_real_view,
    norms_scratch,
    reraise_with_names,
)

_NONFINITE_MESSAGE = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


def raise_if_nonfinite(total, norm_type):
    """error_if_nonfinite's check (a host read of the norm), with torch's message."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(_NONFINITE_MESSAGE.format(norm_type))


def as_parsed_number(name, value) -> float:
    """as_number, but a string is parsed as torch's clip_grad_norm_ parses its max_norm and
    norm_type (float(); its docs name 'inf')."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name} = {value!r}: expected a number") from None
    return as_number(name, value)


def check_norm_type(norm_type) -> float:
    norm_type = as_parsed_number("norm_type", norm_type)
    if not (norm_type > 0.0):
        raise ValueError(f"norm_type = {norm_type}: titanmac_c supports p > 0 and inf")
    return norm_type


def check_max_norm(max_norm) -> float:
    """>= 0; inf is torch's idiom for measuring without clipping (the coefficient is then 1)."""
    max_norm = as_parsed_number("max_norm", max_norm)
    if not max_norm >= 0.0:
        raise ValueError(f"max_norm = {max_norm}: must be >= 0 (inf: no clipping)")
    return max_norm


def check_is_tensor(label, i, t):
    """A torch tensor, as torch's functions take: another library's array (NumPy's has a .device
    too, a string) has no torch device to put the outputs on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{label}[{i}]: expected a torch.Tensor, got {type(t).__name__}")


def group_by_device(label, tensors):
    """The tensors that are not None grouped by device, in first-seen order, each group as
    (their positions in tensors, the tensors): the C core numbers each call's own list, and an
    error names the user's position instead (call_named)."""
    groups = {}
    for i, t in enumerate(tensors):
        if t is not None:
            check_is_tensor(label, i, t)
            positions, ts = groups.setdefault(t.device, ([], []))
            positions.append(i)
            ts.append(t)
    return groups


def call_named(label, positions, fn, tensors, read_only=False):
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


# The dtypes in which a returned norm is rounded from the one the C core computes (float32): the
# clip coefficient is computed from the norm so rounded, the one returned (coef_kwargs).
_ROUNDED_NORM_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def coef_kwargs(max_norm, norm_dtype):
    """_C.norms's arguments for a clip coefficient of max_norm computed from the total norm as
    it is returned, in norm_dtype (the gradients' dtype): torch's clip_grad_norm_ computes its
    coefficient from the norm in that dtype, so the norm returned and the scaling agree (a
    float16 norm past 65504 is inf, which scales the gradients by 0, as torch's)."""
    return dict(max_norm=max_norm, result_dtype=_ROUNDED_NORM_DTYPES.get(norm_dtype))


def returned_norm(total, dtype):
    """total (a norm the C core computed, float32 or float64) as it is returned: in dtype (the
    gradients' dtype, as torch returns it), which the clip coefficient is then computed from."""
    return total if dtype == total.dtype else total.to(dtype)


def total_on_device(label, positions, tensors, norm_type, device, max_norm=None,
                    norm_dtype=None):
    """[3] tensor: [0] the group output (unused), [1] the p-norm of tensors, [2] the clip
    coefficient for max_norm (when given: written by the same call, from the norm rounded to
    norm_dtype, the dtype it is returned in); float32, float64 when a tensor is
    (compute_dtype_of)."""
    out = torch.empty(3, dtype=compute_dtype_of(tensors), device=device)
    clip = {} if max_norm is None else dict(coef=out[2:3], **coef_kwargs(max_norm, norm_dtype))

    def run(ts):
        _C.norms(ts, None, out[0:1], out[1:2], norm_type=norm_type,
                 scratch=norms_scratch(device, ts), **clip, **exec_kwargs(device))

    call_named(label, positions, run, tensors, read_only=True)
    return out


def sharded_norms(label, tensors, names=None):
    """ShardedNorms of the tensors (None entries skipped) when any is a DTensor, else None."""
    if not any_dtensor(tensors):
        return None
    positions = [i for i, t in enumerate(tensors) if t is not None]
    return ShardedNorms(label, positions, [tensors[i] for i in positions], names)


def local_norm(label, norm_type):
    """For ShardedNorms.total: the 0-d norm of local shards (one C call)."""
    return lambda positions, tensors: total_on_device(
        label, positions, tensors, norm_type, tensors[0].device)[1]


def scale_grads(device, positions, grads, coef, *written):
    """grads *= coef (a float32 or float64 [1] tensor on device), in one C call; gradients the C
    core cannot take in place (strided slices) by torch's mul_ after it."""
    kwargs = exec_kwargs(device)
    before_write(grads, *written)
    try:
        call_named("parameters", positions, lambda ts: _C.scale_(ts, coef, **kwargs), grads)
    except BufferError:
        strided = [i for i, g in enumerate(grads) if is_strided_only(g)]
        if not strided:
            raise
        refuse_expanded([positions[i] for i in strided], [grads[i] for i in strided])
        dense = [i for i in range(len(grads)) if i not in strided]
        call_named("parameters", [positions[i] for i in dense],
                    lambda ts: _C.scale_(ts, coef, **kwargs), [grads[i] for i in dense])
        with torch.no_grad():  # as torch's clip: a gradient may be a leaf requiring grad
            for i in strided:  # one rounding, as the C core scales: float32 math but float64
                factor = coef[0].to(compute_dtype(grads[i].dtype))
                grads[i].copy_(grads[i].to(factor.dtype) * factor)
    mark_written(grads, *written)


def refuse_expanded(positions, grads):
    """torch's own refusal of an in-place scale, by name: a gradient with several elements on one
    memory location (an expanded tensor)."""
    for i, g in zip(positions, grads):
        if is_expanded(g):
            raise RuntimeError(f"parameters[{i}]: its gradient is an expanded tensor (several "
                               "elements on one memory location) and cannot be scaled in "
                               "place, as with torch") from None


def real_views(label, tensors, norm_type):
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


def result_dtype(tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def compute_dtype_of(tensors):
    """The dtype of the norms and coefficients the C core computes for these tensors."""
    return compute_dtype(result_dtype(tensors))


def combine_totals(totals, devices, norm_type):
    """The norm over several devices' norms, on the first device (torch does the same)."""
    if len(totals) == 1:
        return totals[0]
    stacked = torch.stack([t.to(devices[0]) for t in totals])
    return torch.linalg.vector_norm(stacked, norm_type)


def with_real_views(label, tensors, norm_type, run):
    """run(tensors), or when the C core refused a tensor and some are complex, run(tensors with
    the complex ones as their real views) (real_views): found on the error path, so that a call
    without complex tensors pays nothing for them. A refusal comes from a norm pass, before
    anything is written."""
    try:
        return run(tensors)
    except BufferError as exc:
        refused = exc
    real = real_views(label, tensors, norm_type)
    if real is tensors:
        raise refused
    return run(real)
