"""group_norms (one pass: per-group and global norms of grads and params, non-finite flag)
against the pure-PyTorch reference; determinism across threads and instruction sets."""

import math

import pytest
import torch

import titanmac_c
from titanmac_c import _C, _reference
from conftest import DEVICES, SIZES


def _tensors(device, dtype=torch.float32):
    grads = [torch.randn(n, device=device, dtype=dtype) for n in SIZES]
    params = [torch.randn(n, device=device, dtype=dtype) * 3 for n in SIZES]
    return grads, params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_group_norms_match_reference(device, norm_type, dtype):
    grads, params = _tensors(device, dtype)
    group_of = [0, 2, 1, 2, 0, 2]
    ours = titanmac_c.group_norms(grads, params, group_of, num_groups=4, norm_type=norm_type)
    ref = _reference.norms(grads, params, group_of, num_groups=4, norm_type=norm_type)
    # float64 norms are the double sums themselves: only the summation order differs
    rtol = 1e-13 if dtype == torch.float64 else 2e-6
    for field in ("grad", "param", "total_grad", "total_param", "nonfinite"):
        torch.testing.assert_close(getattr(ours, field).cpu(), getattr(ref, field),
                                   rtol=rtol, atol=0)
    assert float(ours.grad[3]) == 0.0  # group 3 is empty


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_nonfinite_flag_and_nan_propagation(device, bad, norm_type):
    grads, params = _tensors(device)
    grads[4][100] = bad
    ours = titanmac_c.group_norms(grads, params, [0, 0, 0, 1, 1, 1], 2, norm_type)
    ref = _reference.norms(grads, params, [0, 0, 0, 1, 1, 1], 2, norm_type)
    assert float(ours.nonfinite) == 1.0
    torch.testing.assert_close(ours.grad.cpu(), ref.grad, equal_nan=True, rtol=2e-6, atol=0)
    assert math.isfinite(float(ours.grad[0]))
    assert not math.isfinite(float(ours.total_grad))


@pytest.mark.parametrize("device", DEVICES)
def test_grads_only_and_empty(device):
    grads, _ = _tensors(device)
    ours = titanmac_c.group_norms(grads)
    assert ours.param is None and ours.total_param is None
    ref = torch.linalg.vector_norm(torch.cat([g.flatten().double().cpu() for g in grads]))
    torch.testing.assert_close(ours.total_grad.cpu().double(), ref, rtol=1e-6, atol=0)
    zero = titanmac_c.group_norms([torch.zeros(0, device=device)])
    assert float(zero.total_grad) == 0.0 and float(zero.nonfinite) == 0.0


def test_result_independent_of_thread_count():
    grads, params = _tensors("cpu")
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            r = titanmac_c.group_norms(grads, params, [0, 1, 0, 1, 0, 1], 2)
            results.append(torch.cat([r.grad, r.param, r.total_grad.reshape(1)]))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(results[0], r) for r in results[1:])


def _supported_isas():
    isas = []
    current = _C.cpu_isa()
    for name in ("generic", "avx2", "avx512"):
        try:
            _C._select_cpu_isa(name)
            isas.append(name)
        except ValueError:
            pass
    _C._select_cpu_isa(current)
    return isas


def test_every_instruction_set_gives_the_same_bits():
    """The loop bodies compiled per ISA must agree bitwise (no FMA contraction, fixed-order
    reductions): norms and a few AdamW steps on each."""
    isas = _supported_isas()
    assert "generic" in isas
    current = _C.cpu_isa()
    outputs = {}
    try:
        for name in isas:
            _C._select_cpu_isa(name)
            torch.manual_seed(3)
            grads, params = _tensors("cpu")
            r = titanmac_c.group_norms(grads, params, [0, 1, 0, 1, 0, 1], 2)
            ps = [torch.nn.Parameter(p.clone()) for p in params]
            bf = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in params]
            opt = titanmac_c.AdamW(ps + bf, lr=1e-2, weight_decay=0.1, amsgrad=True)
            for _ in range(3):
                for p, g in zip(ps + bf, grads + grads):
                    p.grad = g.to(p.dtype)
                opt.step()
            outputs[name] = [r.grad, r.param] + [p.detach().float() for p in ps + bf]
    finally:
        _C._select_cpu_isa(current)
    base = outputs["generic"]
    for name, out in outputs.items():
        for a, b in zip(base, out):
            assert torch.equal(a, b), f"{name} differs from generic"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e9, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coefficient_from_the_norm_pass_equals_clip_coef(device, bad, max_norm, dtype):
    """tm_norms can write the clip coefficient in its finishing step; it must be bit for bit what
    tm_clip_coef computes from the total (NaN included), in float32, or in double for float64
    outputs."""
    grads, _ = _tensors(device, dtype)
    if bad is not None:
        grads[2][5] = bad
    out = torch.empty(3, device=device, dtype=dtype)
    scratch = torch.empty(_C.norms_scratch_bytes(grads), dtype=torch.uint8, device=device)
    _C.norms(grads, None, out[0:1], out[1:2], coef=out[2:3], max_norm=max_norm, scratch=scratch)
    separate = torch.empty(1, device=device, dtype=dtype)
    _C.clip_coef(out[1:2], max_norm, separate)
    torch.testing.assert_close(out[2:3], separate, rtol=0, atol=0, equal_nan=True)
    expected = _reference.clip_coef(out[1].cpu(), max_norm)
    torch.testing.assert_close(out[2].cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_follows_each_tensors_precision(device):
    """_C.scale_ with a float64 factor: a float64 tensor multiplied in double, a float32 and a
    bfloat16 one by the factor cast to float32 (torch casts the clip coefficient to each
    gradient's dtype), as the reference's scale_."""
    tensors = [torch.randn(n, device=device, dtype=dt)
               for n, dt in ((4097, torch.float64), (255, torch.float32), (3, torch.bfloat16))]
    expected = [t.clone() for t in tensors]
    factor = torch.tensor([1.0 / 3.0 + 2.0 ** -40], dtype=torch.float64, device=device)
    _C.scale_(tensors, factor)
    _reference.scale_(expected, factor)
    for t, e in zip(tensors, expected):
        assert torch.equal(t, e)
    assert float(factor.float()) != float(factor)  # the float64 path is not the float32 one


def test_coefficient_output_is_validated_before_any_write():
    grads = [torch.randn(10)]
    out = torch.zeros(3)
    with pytest.raises(ValueError, match=r"max_norm = -1: must be >= 0 \(inf: no clipping\)"):
        _C.norms(grads, None, out[0:1], out[1:2], coef=out[2:3], max_norm=-1.0)
    with pytest.raises(ValueError, match=r"coef: expected float32 or float64 with 1 element"):
        _C.norms(grads, None, out[0:1], out[1:2], coef=torch.zeros(2), max_norm=1.0)
    assert torch.equal(out, torch.zeros(3))
