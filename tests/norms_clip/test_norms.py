"""group_norms (one pass: per-group and global norms of grads and params, non-finite flag)
against the pure-PyTorch reference; determinism across threads and instruction sets."""

import math

import pytest
import torch

import titanmac_c
from titanmac_c import _C
from titanmac_c.testing import reference as _reference
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
@pytest.mark.parametrize("result_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 3e4, math.nan])  # 3e4: past float16's 65504
@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])
def test_coefficient_of_the_norm_rounded_to_the_returned_dtype(device, result_dtype, scale,
                                                               max_norm):
    """tm_norms with result_dtype float16 or bfloat16 (the dtype the caller returns the norm in)
    writes the float32 norm unrounded and the coefficient of the norm rounded to that dtype: bit
    for bit what tm_clip_coef computes from the rounded norm given as a tensor of that dtype,
    and the reference's coefficient of it (inf for a float16 norm past 65504: 0, or NaN for
    max_norm = inf, as torch's)."""
    torch.manual_seed(5)
    grads = [torch.randn(n, device=device) * (1.0 if math.isnan(scale) else scale)
             for n in SIZES[:4]]
    if math.isnan(scale):
        grads[2][1] = math.nan
    out = torch.empty(3, device=device)
    scratch = torch.empty(_C.norms_scratch_bytes(grads), dtype=torch.uint8, device=device)
    name = str(result_dtype).removeprefix("torch.")
    _C.norms(grads, None, out[0:1], out[1:2], coef=out[2:3], max_norm=max_norm, scratch=scratch,
             result_dtype=name)
    exact = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]))
    torch.testing.assert_close(out[1].cpu(), exact.float().cpu(), rtol=0, atol=0, equal_nan=True)
    returned = out[1:2].to(result_dtype)
    separate = torch.empty(1, device=device)
    _C.clip_coef(returned, max_norm, separate)
    torch.testing.assert_close(out[2:3], separate, rtol=0, atol=0, equal_nan=True)
    expected = _reference.clip_coef(returned[0].cpu(), max_norm)
    torch.testing.assert_close(out[2].cpu(), expected, rtol=0, atol=0, equal_nan=True)
    if scale == 3e4 and result_dtype == torch.float16:
        assert math.isinf(float(returned)) and math.isfinite(float(out[1]))
        assert (math.isnan if math.isinf(max_norm) else (0.0).__eq__)(float(out[2]))


def test_result_dtype_and_clip_coef_arguments_are_checked():
    """A bad result_dtype or clip_coef argument raises by name and writes nothing."""
    grads = [torch.randn(5)]
    out = torch.full((3,), 7.0)
    with pytest.raises(ValueError, match="result_dtype = 'int8': expected float32, float16, "
                       "bfloat16 or float64"):
        _C.norms(grads, None, out[0:1], out[1:2], coef=out[2:3], result_dtype="int8")
    with pytest.raises(TypeError, match="result_dtype: expected None or a dtype name, got "
                       "torch.dtype"):
        _C.norms(grads, None, out[0:1], out[1:2], coef=out[2:3], result_dtype=torch.float16)
    with pytest.raises(ValueError, match="total_norm: expected 1 element, got float16 with 2"):
        _C.clip_coef(torch.ones(2, dtype=torch.float16), 1.0, out[2:3])
    with pytest.raises(ValueError, match="coef: expected float32 or float64 with 1 element, got "
                       "float16 with 1"):
        _C.clip_coef(torch.ones(1), 1.0, torch.ones(1, dtype=torch.float16))
    assert torch.equal(out, torch.full((3,), 7.0))


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


# TM_CPU_BLOCK (csrc/cpu/cpu_ops.h): the CPU reduces, and scans for non-finite elements, in blocks
# of this many elements of a tensor
_CPU_BLOCK = 4096


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nonfinite_at_block_edges(device, dtype):
    """One NaN, +inf or -inf per case at the first or last element of a CPU block (index 0, 4095,
    4096 and numel - 1; tensors of 4097, 8192 and 3 blocks + 5 elements, so the last block is of
    1, 4096 and 5 elements), for p = 1, 2, inf and 3: the non-finite flag, every group's grad and
    param norm and the totals against the reference element by element (NaN where it has NaN),
    and get_total_norm(..., error_if_nonfinite=True) raising as torch's does. For general p the
    flag comes from a separate per-block scan (the sum may overflow from finite data), and a scan
    that missed a block's last element went unnoticed while index 100 was the only one tried."""
    torch.manual_seed(7)
    rtol = 1e-13 if dtype == torch.float64 else 2e-6
    fields = ("grad", "param", "total_grad", "total_param", "nonfinite")
    for numel in (_CPU_BLOCK + 1, 2 * _CPU_BLOCK, 3 * _CPU_BLOCK + 5):
        clean = [torch.randn(n, device=device, dtype=dtype) for n in (5, numel, 255)]
        params = [torch.randn_like(g) for g in clean]
        for pos in (0, _CPU_BLOCK - 1, _CPU_BLOCK, numel - 1):
            for bad in (math.nan, math.inf, -math.inf):
                grads = [g.clone() for g in clean]
                grads[1][pos] = bad
                for norm_type in (1.0, 2.0, math.inf, 3.0):
                    where = f"numel {numel}, grads[1][{pos}] = {bad}, p = {norm_type}"
                    ours = titanmac_c.group_norms(grads, params, [0, 1, 2], 3, norm_type)
                    ref = _reference.norms(grads, params, [0, 1, 2], 3, norm_type)
                    assert float(ref.nonfinite) == 1.0, where
                    for field in fields:
                        torch.testing.assert_close(
                            getattr(ours, field).cpu(), getattr(ref, field), rtol=rtol, atol=0,
                            equal_nan=True, msg=lambda m: f"{field}, {where}: {m}")
                    for get_total_norm in (titanmac_c.get_total_norm,
                                           torch.nn.utils.get_total_norm):
                        with pytest.raises(RuntimeError, match="is non-finite"):
                            get_total_norm(grads, norm_type, error_if_nonfinite=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
def test_more_groups_than_one_combine_chunk(device, norm_type):
    """130 groups over 200 tensors of varied sizes and scales, with and without params: the CPU
    combines the blocks into groups 64 at a time (CPU_GROUP_CHUNK), so here in three walks, the
    last of 2 groups. Every group's grad and param norm and the totals against the reference,
    for group_of = i % 130, the same partition relabelled by a permutation (other groups meet
    in each walk), and a random assignment that leaves some groups empty (norm 0). A walk whose
    accumulators kept the previous walk's sums or maxima goes unseen with <= 64 groups."""
    gen = torch.Generator().manual_seed(11)
    choices = (1, 3, 17, 255, _CPU_BLOCK, _CPU_BLOCK + 1, 9000)
    sizes = [choices[int(k)] for k in torch.randint(0, len(choices), (200,), generator=gen)]
    scales = torch.exp(torch.empty(200).uniform_(-3.0, 3.0, generator=gen)).tolist()
    grads = [(torch.randn(n, generator=gen) * s).to(device) for n, s in zip(sizes, scales)]
    params = [(torch.randn(n, generator=gen) / s).to(device) for n, s in zip(sizes, scales)]
    groups = 130
    perm = torch.randperm(groups, generator=gen).tolist()
    random_groups = torch.randint(0, groups, (200,), generator=gen).tolist()
    assert len(set(random_groups)) < groups  # some groups are empty
    assignments = {
        "i % 130": [i % groups for i in range(200)],
        "permuted": [perm[i % groups] for i in range(200)],
        "random": random_groups,
    }
    for name, group_of in assignments.items():
        for ps in (params, None):
            ours = titanmac_c.group_norms(grads, ps, group_of, groups, norm_type)
            ref = _reference.norms(grads, ps, group_of, groups, norm_type)
            for field in ("grad", "param", "total_grad", "total_param", "nonfinite"):
                expected = getattr(ref, field)
                if expected is None:
                    assert getattr(ours, field) is None
                    continue
                torch.testing.assert_close(
                    getattr(ours, field).cpu(), expected, rtol=2e-6, atol=0,
                    msg=lambda m: f"{field}, {name}, params {ps is not None}: {m}")
            empty = [j for j in range(groups) if j not in group_of]
            assert all(float(ours.grad[j]) == 0.0 for j in empty)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, big, norm_type", [
    (torch.float64, 1e200, 3.0),    # 1e600
    (torch.float32, 1e30, 12.0),    # 1e360
    (torch.bfloat16, 1e30, 12.0),
    (torch.float16, 60000.0, 70.0),  # 6e4 ** 70 ~ 1e334
])
def test_general_p_overflow_of_finite_grads(device, dtype, big, norm_type):
    """Finite gradients whose sum of |x|^p overflows a double: the norm is inf, and the
    non-finite flag stays 0, as the reference sets it (it says that a gradient element is NaN or
    inf, not that the sum overflowed; for general p it must come from the per-block scan, not
    from the total). Every group norm and the totals against the reference (the other group
    finite); get_total_norm and clip_grad_norm_ against torch's: both return inf, both raise with
    error_if_nonfinite=True (torch checks the total norm) leaving the gradients as they were, and
    without it both scale the gradients by 0."""
    torch.manual_seed(3)
    grads = [torch.tensor([big, 1.0], device=device, dtype=dtype),
             torch.randn(_CPU_BLOCK + 1, device=device, dtype=dtype)]
    params = [torch.randn_like(g) for g in grads]
    rtol = 1e-13 if dtype == torch.float64 else 2e-6
    ours = titanmac_c.group_norms(grads, params, [0, 1], 2, norm_type)
    ref = _reference.norms(grads, params, [0, 1], 2, norm_type)
    assert float(ref.nonfinite) == 0.0 and float(ref.total_grad) == math.inf
    assert math.isfinite(float(ref.grad[1]))
    for field in ("grad", "param", "total_grad", "total_param", "nonfinite"):
        torch.testing.assert_close(getattr(ours, field).cpu(), getattr(ref, field),
                                   rtol=rtol, atol=0, msg=lambda m: f"{field}: {m}")

    total = titanmac_c.get_total_norm(grads, norm_type)
    expected = torch.nn.utils.get_total_norm(grads, norm_type)
    assert total.dtype == expected.dtype and float(expected) == math.inf
    assert float(total) == math.inf
    for get_total_norm in (titanmac_c.get_total_norm, torch.nn.utils.get_total_norm):
        with pytest.raises(RuntimeError, match="is non-finite"):
            get_total_norm(grads, norm_type, error_if_nonfinite=True)

    for error_if_nonfinite in (True, False):
        ps, torch_ps = ([torch.nn.Parameter(p.clone()) for p in params] for _ in range(2))
        for p, q, g in zip(ps, torch_ps, grads):
            p.grad, q.grad = g.clone(), g.clone()
        results = []
        for clip, model in ((titanmac_c.clip_grad_norm_, ps),
                            (torch.nn.utils.clip_grad_norm_, torch_ps)):
            try:
                results.append(clip(model, 1.0, norm_type, error_if_nonfinite=error_if_nonfinite))
            except RuntimeError as exc:
                assert "is non-finite" in str(exc)
                results.append("raised")
        assert error_if_nonfinite == (results[1] == "raised")  # what torch does here
        if error_if_nonfinite:
            assert results[0] == "raised"
        else:
            assert results[0].dtype == results[1].dtype and float(results[0]) == math.inf
        for p, q in zip(ps, torch_ps):
            assert torch.equal(p.grad, q.grad)
        for p, g in zip(ps, grads):  # untouched when raised, else scaled by 0
            assert torch.equal(p.grad, g if error_if_nonfinite else torch.zeros_like(g))
