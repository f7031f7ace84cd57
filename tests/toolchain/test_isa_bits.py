"""Every CPU instruction set's loop body against the generic one, bit for bit.

The CPU loops are compiled three times (generic x86-64, AVX2, AVX-512) and picked at run time;
the project guarantees the same bits from each (no FMA contraction, reductions in a fixed
order). The parity tests against torch and the references run on the machine's default body
only, so here each public path runs once per supported body (_C._select_cpu_isa) on the same
inputs, and every output (parameters, each state tensor, gradients written back, norms, flags)
must equal the generic body's in its bits (compared as integers: NaN, inf and -0.0 included).
With the default body checked against torch elsewhere, that pins every body.

Sizes put elements in every kind of SIMD tail: below one vector (1, 7), exactly one (8), one
short of and past a vector multiple (15, 17, 31, 33), one short of and past a 4096-element block
(4095, 4097), and many blocks with a short last one (70001 = 17 * 4096 + 369). The inputs come
from a seeded generator inside each run, so every body sees the same values.
"""

import itertools
import math

import pytest
import torch

import titanmac_c
from titanmac_c import _C
from test_cms_op import Ours, make_case, make_grads
from test_norms import _supported_isas

SIZES = [1, 7, 8, 15, 17, 31, 33, 4095, 4097, 70001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["f32", "f16", "bf16", "f64"]
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def on_every_isa(run):
    """run() once under each instruction set the CPU supports (generic first), each selection
    asserted; the ISA in use before is restored whatever happens. Returns {isa: run()}."""
    isas = _supported_isas()
    assert isas[0] == "generic"
    if len(isas) < 2:
        pytest.skip("this CPU has the generic loop body only")
    current = _C.cpu_isa()
    outputs = {}
    try:
        for name in isas:
            _C._select_cpu_isa(name)
            assert _C.cpu_isa() == name
            outputs[name] = run()
            assert _C.cpu_isa() == name
    finally:
        _C._select_cpu_isa(current)
    assert _C.cpu_isa() == current
    return outputs


def assert_same_bits(outputs):
    """Every ISA's {name: tensor} equal to generic's, bit for bit (NaN positions and payloads,
    infinities and signed zeros too)."""
    base = outputs["generic"]
    for isa, out in outputs.items():
        assert out.keys() == base.keys(), isa
        for key, want in base.items():
            got = out[key]
            assert got.dtype == want.dtype and got.shape == want.shape, f"{isa} {key}"
            a = want.detach().contiguous().view(BITS[want.element_size()])
            b = got.detach().contiguous().view(BITS[got.element_size()])
            if not torch.equal(a, b):
                bad = (a != b).reshape(-1).nonzero().reshape(-1)
                i = int(bad[0])
                raise AssertionError(
                    f"{isa} {key}: {bad.numel()} of {a.numel()} elements differ from generic, "
                    f"first at {i}: {want.reshape(-1)[i].item()!r} (generic) vs "
                    f"{got.reshape(-1)[i].item()!r}")


def randn(n, gen, dtype, scale=1.0):
    return (torch.randn(n, generator=gen) * scale).to(dtype)


def adamw_outputs(opt, grads=True):
    """Parameters, every state tensor and (grads=True) the gradients of an AdamW, by place."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            name = f"groups[{gi}][{pi}] (numel {p.numel()})"
            out[f"{name} param"] = p.detach().clone()
            if grads:
                out[f"{name} grad"] = p.grad.clone()
            for key in STATE_KEYS:
                if key in opt.state[p]:
                    out[f"{name} {key}"] = opt.state[p][key].clone()
    return out


def flag_groups(dtype, gen, lrs=(1e-2, 2e-2, 3e-2, 5e-2), wds=(0.1, 0.3, 0.5, 0.8)):
    """Four groups over SIZES, one per (maximize, amsgrad), with lr * weight_decay from 1e-3 to
    0.04 (a skipped decay moves float16 and bfloat16 parameters by more than their rounding)."""
    groups = []
    for (maximize, amsgrad), lr, wd in zip(itertools.product((False, True), repeat=2), lrs, wds):
        params = [torch.nn.Parameter(randn(n, gen, dtype)) for n in SIZES]
        groups.append(dict(params=params, maximize=maximize, amsgrad=amsgrad, lr=lr,
                           weight_decay=wd))
    return groups


def set_grads(opt, gen, dtype, scale=1.0):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = randn(p.shape, gen, dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_adamw_steps(dtype):
    """titanmac_c.AdamW, three steps of fresh gradients over four groups (maximize and amsgrad
    on and off, weight decay > 0) and a fifth with beta1 = 0.3 (the loops are specialised on
    1 - beta1 < 0.5, tm_lerp's formula): parameters, step counts, exp_avg, exp_avg_sq and
    max_exp_avg_sq of every tensor, and the gradients (read, not written), the same bits on
    every ISA."""
    def run():
        gen = torch.Generator().manual_seed(10)
        groups = flag_groups(dtype, gen)
        groups.append(dict(params=[torch.nn.Parameter(randn(n, gen, dtype)) for n in SIZES],
                           betas=(0.3, 0.9), amsgrad=True, maximize=True, weight_decay=0.2))
        opt = titanmac_c.AdamW(groups, lr=1e-2)
        for _ in range(3):
            set_grads(opt, gen, dtype)
            opt.step()
        return adamw_outputs(opt)

    assert_same_bits(on_every_isa(run))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grad_scaler_fused_steps(dtype):
    """AdamW(fused=True) under torch.amp.GradScaler without unscale_: the scaler hands the loss
    scale to step(), whose loop divides each gradient by it on load and stores the unscaled
    gradient back (float16 gradients included: only unscale_ refuses them). A scale that is no
    power of two (3000, then grown), three steps: parameters, state and the gradients left
    after every step the same bits on every ISA."""
    def run():
        gen = torch.Generator().manual_seed(11)
        opt = titanmac_c.AdamW(flag_groups(dtype, gen), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=3000.0, growth_interval=2)
        out = {}
        for step in range(3):
            scaler.scale(torch.ones(()))  # what scaling the loss starts
            set_grads(opt, gen, dtype, scale=scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            for group in opt.param_groups:
                for p in group["params"]:
                    out[f"step {step} grad (numel {p.numel()}, {len(out)})"] = p.grad.clone()
        assert scaler.get_scale() == 6000.0  # no step overflowed: all three were taken
        return {**out, **adamw_outputs(opt, grads=False)}

    assert_same_bits(on_every_isa(run))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_folded_clip_then_step(dtype):
    """AdamW.clip_grad_norm_ (the coefficient folded into the next step, applied as each
    gradient is loaded) and step(), three times with the 2-, inf- and 1-norm, each clipping
    (coefficient < 1): the returned norms, parameters, state and the gradients (left unscaled)
    the same bits on every ISA."""
    def run():
        gen = torch.Generator().manual_seed(12)
        opt = titanmac_c.AdamW(flag_groups(dtype, gen), lr=1e-2)
        out = {}
        for step, norm_type in enumerate((2.0, math.inf, 1.0)):
            set_grads(opt, gen, dtype)
            norm = opt.clip_grad_norm_(1.0, norm_type=norm_type)
            assert float(norm) > 1.0
            out[f"step {step} norm ({norm_type})"] = norm.clone()
            opt.step()
        return {**out, **adamw_outputs(opt)}

    assert_same_bits(on_every_isa(run))


# tensors whose last element the non-finite cases set: sizes 17, 33, 4097, 31 and 70001, none
# a multiple of 8 (the vectors' width in floats), so the element lies in a loop's tail
NORM_CASES = {
    "finite": [],
    "max at a tail": [("grads", 6, 100.0), ("params", 9, -300.0)],
    "nan at a tail": [("grads", 4, math.nan)],
    "inf at a tail": [("grads", 8, math.inf), ("grads", 5, -math.inf)],
    "nan and inf": [("grads", 4, math.nan), ("grads", 8, math.inf), ("params", 9, math.nan)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_norms_and_clip(dtype):
    """functional.group_norms (per-group and total norms of gradients and parameters, the
    non-finite flag), get_total_norm and titanmac_c.clip_grad_norm_ (the returned norm and
    the gradients it scaled in place), for norm types 1, 2, inf and 3, on finite tensors, with
    the largest element last in a tensor, and with NaN / +-inf as the last element of tensors
    whose sizes are no multiple of the vector width: the same bits on every ISA, NaN results
    included."""
    group_of = [k % 3 for k in range(len(SIZES))]

    def run():
        out = {}
        for (case, edits), norm_type in itertools.product(NORM_CASES.items(),
                                                          (1.0, 2.0, math.inf, 3.0)):
            gen = torch.Generator().manual_seed(13)
            tensors = {"grads": [randn(n, gen, dtype) for n in SIZES],
                       "params": [randn(n, gen, dtype, 3.0) for n in SIZES]}
            for which, i, value in edits:
                tensors[which][i][-1] = value
            grads, params = tensors["grads"], tensors["params"]
            tag = f"{case}, norm {norm_type}:"
            r = titanmac_c.group_norms(grads, params, group_of, num_groups=3,
                                       norm_type=norm_type)
            for field in ("grad", "param", "total_grad", "total_param", "nonfinite"):
                out[f"{tag} group_norms.{field}"] = getattr(r, field).clone()
            out[f"{tag} get_total_norm"] = titanmac_c.get_total_norm(grads, norm_type)
            holders = [torch.nn.Parameter(p.clone()) for p in params]
            for h, g in zip(holders, grads):
                h.grad = g.clone()
            out[f"{tag} clip_grad_norm_"] = titanmac_c.clip_grad_norm_(holders, 1.0, norm_type)
            for i, h in enumerate(holders):
                out[f"{tag} clipped grads[{i}]"] = h.grad
            nan_grads = any(math.isnan(v) for which, _, v in edits if which == "grads")
            assert math.isnan(float(r.total_grad)) == nan_grads, tag
            assert float(r.nonfinite) == float(case in ("nan at a tail", "inf at a tail",
                                                        "nan and inf")), tag
        return out

    assert_same_bits(on_every_isa(run))


CMS_SIZES = SIZES + [(33, 65)]  # the 2-D tensor lands in the reference's second group


@pytest.mark.parametrize("net", ["direct", "legacy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cms_steps(net, dtype):
    """_C.cms_step (the CMS update of the DeepNestedOptimizer) from test_cms_op's randomized
    state, weight decay 0.05, over steps t = 99 (level 0 fires), 100 (all three fire) and 101,
    with a clip coefficient on two of them: parameters, momenta, accumulators, EMAs, v_sq and
    step counts of every level the same bits on every ISA."""
    def run():
        ref, params, group_of = make_case(net, (1, 10, 100), 0.05, dtype, sizes=CMS_SIZES)
        ours = Ours(ref, params, group_of, "cpu")
        gen = torch.Generator().manual_seed(14)
        for t, coef in ((99, 0.75), (100, None), (101, 0.5)):
            ours.step(make_grads(params, gen, dtype), t, coef)
        out = {f"params[{i}]": p for i, p in enumerate(ours.params)}
        out.update({f"steps[{i}]": s for i, s in enumerate(ours.steps)})
        for key, levels in ours.state.items():
            for lvl, tensors in enumerate(levels):
                out.update({f"{key}[{lvl}][{i}]": x for i, x in enumerate(tensors)})
        return out

    assert_same_bits(on_every_isa(run))
