"""The clip scales by the norm it returns. torch's clip_grad_norm_ computes its coefficient from
the norm in the gradients' dtype, so for float16 gradients whose norm passes 65504 the norm is
inf and the coefficient 0 (error_if_nonfinite=True raises); ours does the same, the functions and
the folded clip (AdamW.clip_grad_norm_) alike. For bfloat16 and float16 norms in range the
coefficient is min(1, max_norm / (returned + 1e-6)) in float32 from the returned value, element
by element."""

import math

import pytest
import torch

import titanmac_c
from conftest import DEVICES, SIZES, TOL, tol
from titanmac_c.optim import adamw_step

_HALF = 60000.0  # finite in float16 (max 65504): a few such elements overflow the norm


def _params(device, dtype, sizes, seed, scale):
    """Twin parameter lists (equal values) with equal gradients randn * scale, clamped into
    float16's range."""
    gen = torch.Generator().manual_seed(seed)
    a, b = [], []
    for n in sizes:
        g = (torch.randn(n, generator=gen) * scale).clamp(-_HALF, _HALF).to(dtype)
        value = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        for ps in (a, b):
            p = torch.nn.Parameter(value.clone())
            p.grad = g.to(device).clone()
            ps.append(p)
    return a, b


def _bits(t):
    """The stored bits of a float16/bfloat16 tensor: equal values with the sign of zeros."""
    return t.detach().cpu().view(torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])
def test_fp16_norm_past_65504_returns_inf_and_scales_as_torch(device, norm_type, max_norm):
    """Finite float16 gradients whose norm passes float16's range, several draws: both return
    inf and scale the gradients by the coefficient of inf (0, so every element is +-0 with its
    sign; NaN for max_norm = inf, as torch's 0 * inf), bit for bit as torch's clip."""
    for seed in range(3):
        ours, theirs = _params(device, torch.float16, SIZES[:4], seed, 3e4)
        exact = torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) for p in ours]),
                                         norm_type)
        assert 65504 < float(exact) < 1e30  # the float32 norm is finite: only float16 overflows
        n_ours = titanmac_c.clip_grad_norm_(ours, max_norm, norm_type)
        n_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
        assert n_ours.dtype == n_theirs.dtype == torch.float16
        assert math.isinf(float(n_ours)) and math.isinf(float(n_theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if math.isinf(max_norm):
                assert a.grad.isnan().all() and b.grad.isnan().all()
            else:
                assert torch.equal(_bits(a.grad), _bits(b.grad)), f"draw {seed}, grads[{i}]"
                assert not a.grad.any()


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_norm_past_65504_with_error_if_nonfinite_raises_as_torch(device):
    """error_if_nonfinite=True on that norm: both clips raise, ours (the function and the
    folded clip) leaving the gradients as they were and nothing pending: the next step is the
    unclipped one, bit for bit."""
    for seed in range(3):
        ours, theirs = _params(device, torch.float16, SIZES[:4], seed, 3e4)
        grads = [p.grad.clone() for p in ours]
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
        with pytest.raises(RuntimeError, match="non-finite"):
            titanmac_c.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
        opt = titanmac_c.AdamW(ours, lr=1e-2)
        with pytest.raises(RuntimeError, match="non-finite"):
            opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
        for p, g in zip(ours, grads):
            assert torch.equal(_bits(p.grad), _bits(g))
        twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for p, g in zip(twin, grads):
            p.grad = g.clone()
        opt.step()
        titanmac_c.AdamW(twin, lr=1e-2).step()
        for a, b in zip(ours, twin):
            assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("device", DEVICES)
def test_folded_clip_of_a_fp16_norm_past_65504_steps_as_torchs_clip_then_adamw(device):
    """AdamW.clip_grad_norm_ then step() over steps whose float16 norm alternately overflows
    (inf returned, coefficient 0, as torch's) and stays in range (coefficient 1): bit for bit
    titanmac_c.AdamW stepping gradients torch's clip scaled, and within float16's rounding of
    torch's fused AdamW (float32 math, one rounding per stored value, as ours) after torch's
    clip."""
    sizes = [3, 255, 4097]
    kw = dict(lr=1e-2, weight_decay=0.01)
    params_a, params_b = _params(device, torch.float16, sizes, 0, 1.0)
    params_c = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    folded = titanmac_c.AdamW(params_a, **kw)
    stepped = titanmac_c.AdamW(params_b, **kw)
    reference = torch.optim.AdamW(params_c, **kw, fused=True)
    for step in range(6):
        overflow = step % 2 == 1
        draw, _ = _params(device, torch.float16, sizes, 10 + step, 3e4 if overflow else 1e-2)
        for ps in (params_a, params_b, params_c):
            for p, d in zip(ps, draw):
                p.grad = d.grad.clone()
        n_a = folded.clip_grad_norm_(100.0)
        n_b = torch.nn.utils.clip_grad_norm_(params_b, 100.0)
        torch.nn.utils.clip_grad_norm_(params_c, 100.0)
        assert n_a.dtype == n_b.dtype == torch.float16
        if overflow:
            assert math.isinf(float(n_a)) and math.isinf(float(n_b))
        else:
            assert float(n_a) < 100.0
            torch.testing.assert_close(n_a, n_b, **TOL[torch.float16])
        folded.step()
        stepped.step()
        reference.step()
        for i, (a, b, c) in enumerate(zip(params_a, params_b, params_c)):
            assert torch.equal(_bits(a), _bits(b)), f"step {step}, params[{i}]"
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_bits(folded.state[a][key]), _bits(stepped.state[b][key]))
            torch.testing.assert_close(a.detach(), c.detach(), **tol(torch.float16, device))


def _coef_of(norm, max_norm):
    """The coefficient of a norm tensor in float32: min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_range_the_coefficient_is_that_of_the_returned_norm(device, dtype):
    """bf16/fp16 norms in range, several draws and max_norms: the gradients after the clip are
    exactly grads * min(1, max_norm / (returned + 1e-6)) computed in float32 from the value
    returned (the norm rounded to the gradients' dtype), rounded once to their dtype; and in
    some of the cases that coefficient differs from the one of the unrounded float32 norm."""
    differs = 0
    for seed in range(4):
        for max_norm in (0.5, 3.0):
            ours, theirs = _params(device, dtype, SIZES[:5], seed, 0.05 * (seed + 1))
            grads = [p.grad.clone() for p in ours]
            exact = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]))
            returned = titanmac_c.clip_grad_norm_(ours, max_norm)
            torch.nn.utils.clip_grad_norm_(theirs, max_norm)
            assert returned.dtype == dtype and returned == exact.float().to(dtype)
            coef = _coef_of(returned, max_norm).to(device)
            assert float(coef) < 1.0  # the clip scales
            differs += bool(coef.cpu() != _coef_of(exact.float(), max_norm))
            for i, (p, g, q) in enumerate(zip(ours, grads, theirs)):
                expected = (g.float() * coef).to(dtype)
                assert torch.equal(_bits(p.grad), _bits(expected)), f"{seed}, grads[{i}]"
                # torch rounds its coefficient to the dtype too: one unit of rounding apart
                torch.testing.assert_close(p.grad, q.grad, **TOL[dtype])
    assert differs > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_clip_in_range_steps_with_the_coefficient_of_the_returned_norm(device, dtype):
    """AdamW.clip_grad_norm_ then step() over several steps equals, bit for bit, a twin stepped
    by adamw_step with grad_scale = min(1, max_norm / (returned + 1e-6)) in float32 from the
    norm the clip returned."""
    sizes = SIZES[:5]
    kw = dict(lr=1e-2, weight_decay=0.01)
    params_a, params_b = _params(device, dtype, sizes, 0, 1.0)
    folded = titanmac_c.AdamW(params_a, **kw)
    twin = titanmac_c.AdamW(params_b, **kw)
    for step in range(4):
        draw, _ = _params(device, dtype, sizes, 20 + step, 0.05 * (step + 1))
        for ps in (params_a, params_b):
            for p, d in zip(ps, draw):
                p.grad = d.grad.clone()
        returned = folded.clip_grad_norm_(0.5)
        assert returned.dtype == dtype
        folded.step()
        adamw_step(twin, grad_scale=_coef_of(returned, 0.5).reshape(1).to(device))
        for i, (a, b) in enumerate(zip(params_a, params_b)):
            assert torch.equal(_bits(a), _bits(b)), f"step {step}, params[{i}]"
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_bits(folded.state[a][key]), _bits(twin.state[b][key]))
