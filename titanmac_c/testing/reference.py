"""Readable pure-PyTorch implementations of every op of the C core: the executable specification.

Tests compare the C core against these (and against torch itself where torch has the op);
benchmarks use them as the unfused baseline. Nothing here is fast, and nothing here is used by
titanmac_c's own code paths: there is no fallback from C to Python.

Each function takes the arguments of its titanmac_c._C counterpart.
"""

import math

import torch

from .._internal.norm_calls import compute_dtype_of
from ..functional import GroupNorms


def _reduce(t: torch.Tensor, p: float) -> torch.Tensor:
    """sum |t|^p (or max |t| for p = inf) in float64, on the CPU (the spec's results live there,
    whatever the inputs' device)."""
    a = t.detach().cpu().double().abs().flatten()
    if math.isinf(p):
        if a.numel() == 0:
            return torch.zeros((), dtype=torch.float64)
        return torch.where(a.isnan().any(), torch.tensor(math.nan, dtype=torch.float64), a.max())
    return (a ** p).sum()


def _finish(reduced: torch.Tensor, p: float, dtype=torch.float32) -> torch.Tensor:
    if math.isinf(p) or p == 1.0:
        return reduced.to(dtype)
    return (reduced ** (1.0 / p)).to(dtype)


def _combine(values, p):
    if not values:
        return torch.zeros((), dtype=torch.float64)
    stacked = torch.stack(values)
    if math.isinf(p):
        return torch.where(stacked.isnan().any(), torch.tensor(math.nan, dtype=torch.float64),
                           stacked.max())
    return stacked.sum()


def norms(grads, params=None, group_of=None, num_groups=1, norm_type=2.0) -> GroupNorms:
    """Per-group and total p-norms of grads (and params), and whether any grad is non-finite;
    float32, float64 when a tensor is float64."""
    group_of = group_of if group_of is not None else [0] * len(grads)
    dtype = compute_dtype_of(list(grads) + list(params or []))  # float64 when a tensor is
    per_group_g = [[] for _ in range(num_groups)]
    per_group_p = [[] for _ in range(num_groups)]
    for i, g in enumerate(grads):
        per_group_g[group_of[i]].append(_reduce(g, norm_type))
        if params is not None:
            per_group_p[group_of[i]].append(_reduce(params[i], norm_type))
    group_g = [_combine(v, norm_type) for v in per_group_g]
    group_p = [_combine(v, norm_type) for v in per_group_p]
    nonfinite = any(not torch.isfinite(g.detach()).all() for g in grads)
    return GroupNorms(
        grad=torch.stack([_finish(v, norm_type, dtype) for v in group_g]),
        param=(torch.stack([_finish(v, norm_type, dtype) for v in group_p])
               if params is not None else None),
        total_grad=_finish(_combine(group_g, norm_type), norm_type, dtype),
        total_param=(_finish(_combine(group_p, norm_type), norm_type, dtype)
                     if params is not None else None),
        nonfinite=torch.tensor(1.0 if nonfinite else 0.0, dtype=dtype),
    )


def clip_coef(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (total_norm + 1e-6)), in
    float32, or in float64 for a float64 norm."""
    return torch.clamp(max_norm / (total_norm.to(compute_dtype_of([total_norm])) + 1e-6), max=1.0)


def scale_(tensors, scale: torch.Tensor) -> None:
    """t *= scale: a float64 tensor in double, the others by the scale cast to float32."""
    for t in tensors:
        dtype = compute_dtype_of([t])
        t.copy_((t.to(dtype) * scale.to(dtype)).to(t.dtype))


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, groups,
               group_of=None, *, amsgrad=False, grad_scale=None, skip=None) -> None:
    """One AdamW step as torch.optim.AdamW computes it (for-loop form), element math in float32
    (in float64 for float64 parameters).

    groups[k] = (beta1, beta2, eps, weight_decay, maximize); lr: float32 or float64 [num_groups];
    grad_scale multiplies every gradient; a nonzero skip makes the call a no-op.
    """
    if skip is not None and float(skip) != 0.0:
        return
    for i, p in enumerate(params):
        k = group_of[i] if group_of is not None else 0
        beta1, beta2, eps, weight_decay, maximize = groups[k]
        lr_k = float(lr[k])
        dtype = compute_dtype_of([p])
        grad = grads[i].to(dtype)
        if grad_scale is not None:
            grad = grad * grad_scale.to(dtype)
        if maximize:
            grad = -grad
        steps[i] += 1
        step = float(steps[i])
        param, m, v = p.detach().to(dtype), exp_avgs[i].to(dtype), exp_avg_sqs[i].to(dtype)
        param.mul_(1 - lr_k * weight_decay)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
        if amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i].to(dtype), v)
            max_exp_avg_sqs[i].copy_(vmax)
            denom = vmax.sqrt() / bias_correction2_sqrt + eps
        else:
            denom = v.sqrt() / bias_correction2_sqrt + eps
        param.addcdiv_(m, denom, value=-lr_k / bias_correction1)
        p.detach().copy_(param)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
