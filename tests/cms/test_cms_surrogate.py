"""Phase 1 of the CMS step, both implementations: _C.cms_surrogate (tm_cms_surrogate, on the CPU
and on CUDA) and surrogate.surrogate_gradient (its algorithm in torch ops, CUDA's default; run here
on every device, also with chunks small enough to split tensors), against autograd of the
reference in float64:
the gradient of mean_i compute_surrogate_loss(MLP(g_i, m_i), g_i, prev_i) over the
DirectUpdateMLP's weights (docs/deep_nested_optimizer.md sections 7.2, 7.4; the
reference's preprocess_gradient, net and loss, evaluated in double), element by element, over
several Phase 1 steps (each step's outputs are the next step's prev, and the MLP takes an Adam
step between them); the temporal term's gradient on its own (the difference of two calls, with
and without prev); plus the C op's argument checks. On CUDA the C op is also checked against the
CPU's bit for bit (the same blocks, lanes and sums: common/tm_cms_surrogate.h), run to run, in a
CUDA graph's replays and without a host sync. Section numbers (spec N) and bug ids (B1, its
section 14) refer to that document.

Tolerance: every entry of a gradient tensor within GRAD_RTOL of that tensor's largest entry
(measured <= 9e-7 for the C op, which sums the weights' gradients in double, 5.8e-7 for the
torch ops, which sum 64 rows in float32 and those sums in double; torch's float32 autograd itself
is up to 1.6e-4 off here, its matmul summing 65,537 rows in float), outputs within 1e-5 of their
max, losses 1e-5 relative.
"""

import copy

import pytest
import torch

from conftest import DEVICES, RecordHostReads
from titanmac_c import _C
from titanmac_c._internal.runtime import exec_kwargs
from titanmac_c.deep_nested.surrogate import SurrogatePlan, surrogate_gradient
from titanmac_c.testing.reference_dno import (DirectUpdateMLP, compute_surrogate_loss,
                                       preprocess_gradient)

GRAD_RTOL = 1e-6
TEMPORAL_RTOL = 1e-5
SIZES = [1, 3, 300, 4097, (33, 65), 65537]


def _mlp(hidden, layers, seed=0):
    torch.manual_seed(seed)
    mlp = DirectUpdateMLP(hidden_dim=hidden, num_layers=layers)
    with torch.no_grad():  # away from the init (zero output layer) so every weight has a gradient
        for p in mlp.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return mlp


def _inputs(kind, gen, dtype=torch.float32):
    """targets and momenta per size; kind 'zero': A_0 as the reference has it (B1), 'grad': a
    gradient (one tensor's zero: both of the op's paths, with and without the norms pass, in one
    call), 'tiny': ||g|| below the 1e-8 threshold."""
    scale = {"zero": 0.0, "grad": 1e-3, "tiny": 1e-12}[kind]
    targets = [(torch.randn(s, generator=gen) * scale).to(dtype) for s in SIZES]
    if kind == "grad":
        targets[3].zero_()
    moms = [torch.randn(s, generator=gen) * 10 ** float(torch.empty(1).uniform_(-5, -1,
                                                                          generator=gen))
            for s in SIZES]
    return targets, moms


def _reference(mlp, targets, moms, prevs, scale, divisor, grad_dtype=torch.float32):
    """The reference's Phase 1 loss, its gradient (returned in grad_dtype) and outputs, in
    float64: g0 is formed in float32 as the reference forms it, then DirectUpdateMLP.forward's
    steps run in double."""
    net = copy.deepcopy(mlp.net).double()
    losses, outs = [], []
    for t, m, prev in zip(targets, moms, prevs):
        g0 = t.float()
        g0 = ((g0 * scale if scale is not None else g0) / divisor).double()
        log_g, sign_g = preprocess_gradient(g0)
        log_m, sign_m = preprocess_gradient(m.double())
        features = torch.stack([log_g.reshape(-1), sign_g.reshape(-1), log_m.reshape(-1),
                                sign_m.reshape(-1)], dim=-1)
        out = net(features).reshape(g0.shape)
        losses.append(compute_surrogate_loss(out, g0, None if prev is None else prev.double()))
        outs.append(out.detach().float())
    torch.stack(losses).mean().backward()
    return ([p.grad.to(grad_dtype) for p in net.parameters()],
            torch.stack(losses).detach().float(), outs)


# The implementations: the C op on the CPU; the torch ops on every device, with their default
# chunks (each tensor here in one) and with 1,000-element chunks (tensors split across chunks,
# chunks holding pieces of several tensors).
IMPLS = [
    pytest.param(("c", "cpu", None), id="c_op"),
    pytest.param(("c", "cuda", None), id="c_op-cuda", marks=DEVICES[1].marks),
    pytest.param(("torch", "cpu", None), id="torch-cpu"),
    pytest.param(("torch", "cpu", 1000), id="torch-cpu-chunk1000"),
    pytest.param(("torch", "cuda", None), id="torch-cuda", marks=DEVICES[1].marks),
    pytest.param(("torch", "cuda", 1000), id="torch-cuda-chunk1000", marks=DEVICES[1].marks),
]


def _ours(mlp, targets, moms, outputs, has_prev, scale, divisor, hidden, layers,
          impl=("c", "cpu", None), **kw):
    """One call of the implementation; returns (weight gradients, losses) on the CPU, outputs
    written in place (copied back from the device)."""
    kind, device, chunk = impl
    if kind == "c" and device == "cpu":
        grads = [torch.full_like(p, float("nan")) for p in mlp.parameters()]
        losses = torch.full((len(targets),), float("nan"))
        _C.cms_surrogate(targets, moms, outputs, [p.detach() for p in mlp.parameters()], grads,
                         losses, divisor=divisor, hidden=hidden, layers=layers,
                         has_prev=has_prev, scale=scale, **kw)
        return grads, losses
    if kind == "c":
        return _c_op_on(device, mlp, targets, moms, outputs, has_prev, scale, divisor, hidden,
                        layers)
    weights = [p.detach().to(device) for p in mlp.parameters()]
    grads = [torch.full_like(w, float("nan")) for w in weights]
    losses = torch.full((len(targets),), float("nan"), device=device)
    on_device = [o.to(device) for o in outputs]
    plan = SurrogatePlan([t.numel() for t in targets], torch.device(device), chunk=chunk)
    surrogate_gradient(
        [t.to(device) for t in targets], [m.to(device) for m in moms], on_device, weights, grads,
        losses, divisor=divisor, scale=None if scale is None else scale.to(device),
        has_prev=has_prev if has_prev is not None else [False] * len(targets), plan=plan)
    for o, d in zip(outputs, on_device):
        o.copy_(d)
    return [g.cpu() for g in grads], losses.cpu()


def _nan_scratch(targets, layers):
    """Scratch for the CUDA op filled with NaN doubles (every byte 0xff): a record the op reads
    before writing it would show in the results."""
    nbytes = _C.cms_surrogate_scratch_bytes(targets, layers=layers)
    return torch.full((max(nbytes, 8),), 255, dtype=torch.uint8, device=targets[0].device
                      if targets else "cuda")


def _c_op_on(device, mlp, targets, moms, outputs, has_prev, scale, divisor, hidden, layers):
    """_C.cms_surrogate on the device's copies (scratch as the optimizer passes it); returns
    (weight gradients, losses) on the CPU, outputs copied back into `outputs`."""
    dev = [o.to(device) for o in outputs]
    grads = [torch.full_like(p, float("nan"), device=device) for p in mlp.parameters()]
    losses = torch.full((len(targets),), float("nan"), device=device)
    targets = [t.to(device) for t in targets]
    _C.cms_surrogate(targets, [m.to(device) for m in moms], dev,
                     [p.detach().to(device) for p in mlp.parameters()], grads, losses,
                     divisor=divisor, hidden=hidden, layers=layers, has_prev=has_prev,
                     scale=None if scale is None else scale.to(device),
                     scratch=_nan_scratch(targets, layers), **exec_kwargs(torch.device(device)))
    for o, d in zip(outputs, dev):
        o.copy_(d)
    return [g.cpu() for g in grads], losses.cpu()


def _assert_grads(ours, ref, names, step):
    for name, a, b in zip(names, ours, ref):
        tol = GRAD_RTOL * float(b.abs().max()) + 1e-30
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=lambda m: f"step {step} {name}: {m}")


@pytest.mark.parametrize("hidden,layers", [(20, 2), (7, 1), (20, 3), (13, 2), (20, 8)])
@pytest.mark.parametrize("kind", ["zero", "grad", "tiny"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_matches_autograd_over_steps(hidden, layers, kind, impl):
    gen = torch.Generator().manual_seed(hidden * 10 + layers)
    mlp = _mlp(hidden, layers)
    names = [n for n, _ in mlp.named_parameters()]
    adam = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    scale = torch.tensor([0.7]) if kind == "grad" else None
    divisor = 1.0 if kind != "grad" else 5.0
    outputs = [torch.empty(s) for s in SIZES]
    prevs = [None] * len(SIZES)
    for step in range(4):
        targets, moms = _inputs(kind, gen)
        # from step 1 on, every other tensor has a previous output (the others start over)
        has_prev = [step > 0 and i % 2 == 0 for i in range(len(SIZES))]
        prev_in = [prevs[i] if has_prev[i] else None for i in range(len(SIZES))]
        g_ref, l_ref, o_ref = _reference(mlp, targets, moms, prev_in, scale, divisor)
        g_ours, l_ours = _ours(mlp, targets, moms, outputs, has_prev, scale, divisor,
                               hidden, layers, impl)
        _assert_grads(g_ours, g_ref, names, step)
        torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-12)
        for i, (o, r) in enumerate(zip(outputs, o_ref)):
            torch.testing.assert_close(o, r, rtol=0, atol=1e-5 * float(r.abs().max()) + 1e-12,
                                       msg=lambda m: f"step {step} outputs[{i}]: {m}")
        # an Adam step of the MLP, and the same prev on both sides (the reference's outputs)
        for p, g in zip(mlp.parameters(), g_ref):
            p.grad = g
        adam.step()
        prevs = o_ref
        for o, r in zip(outputs, o_ref):
            o.copy_(r)


@pytest.mark.parametrize("hidden,layers", [(20, 2), (7, 1), (20, 3), (13, 2), (20, 8)])
@pytest.mark.parametrize("offset", [0.01, 2.0])
@pytest.mark.parametrize("impl", IMPLS)
def test_temporal_term_gradient_in_isolation(hidden, layers, offset, impl):
    """The temporal term T = 0.1 mean((o - prev)^2) (spec 7.4) adds 0.2 (o - prev) / numel to
    d loss / d o: in the test above it sits below the float32 rounding of the whole gradient (R
    and M summed over 65,537 elements), where a 50% error in it passes. Only T depends on prev,
    so the op's gradient with a prev on every other tensor minus the same call with none is T's
    gradient alone; it must match the same difference of the float64 reference, relative to
    that difference's size. Targets of about the outputs' norm keep R and M's gradients O(1);
    prev = o - offset (o + max|o| u), u ~ U(0, 1): a prev a small step away (as in Phase 1) and
    one far off (T's gradient a few % of the whole in every weight tensor).

    Tolerance: TEMPORAL_RTOL of the difference's largest entry (measured <= 2e-6 of it where it
    is a few % of the gradient: float32 rounding of T's own terms) plus GRAD_RTOL of the whole
    gradient's largest entry (the rounding of the two calls, measured <= 2.3e-7 of it, which
    dominates where T's gradient is 1e-7 of the whole); measured <= 0.16 of the tolerance. A 1%
    error in T's coefficient exceeds it 6 to 250 times in the offset = 2 cases."""
    gen = torch.Generator().manual_seed(hidden + layers)
    mlp = _mlp(hidden, layers)
    names = [n for n, _ in mlp.named_parameters()]
    targets = [torch.randn(s, generator=gen) * 0.3 for s in SIZES]
    moms = [torch.randn(s, generator=gen) * 1e-2 for s in SIZES]
    none = [None] * len(SIZES)
    ref_without, _, outs = _reference(mlp, targets, moms, none, None, 1.0,
                                      grad_dtype=torch.float64)
    prevs = [o - offset * (o + float(o.abs().max()) * torch.rand(o.shape, generator=gen))
             for o in outs]
    has_prev = [i % 2 == 0 for i in range(len(SIZES))]
    prev_in = [p if h else None for p, h in zip(prevs, has_prev)]
    ref_with, _, _ = _reference(mlp, targets, moms, prev_in, None, 1.0, grad_dtype=torch.float64)
    ours_with, _ = _ours(mlp, targets, moms, [p.clone() for p in prevs], has_prev, None, 1.0,
                         hidden, layers, impl)
    ours_without, _ = _ours(mlp, targets, moms, [p.clone() for p in prevs], [False] * len(SIZES),
                            None, 1.0, hidden, layers, impl)
    for name, a1, a0, b1, b0 in zip(names, ours_with, ours_without, ref_with, ref_without):
        diff = b1 - b0
        assert diff.abs().max() > 0, f"{name}: T has no gradient here, the check is void"
        tol = TEMPORAL_RTOL * float(diff.abs().max()) + GRAD_RTOL * float(b1.abs().max())
        torch.testing.assert_close(a1.double() - a0.double(), diff, rtol=0, atol=tol,
                                   msg=lambda m: f"offset {offset} {name}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_targets_and_tiny_norms(impl):
    """bf16 gradients as targets (the corrected B1), and a tensor whose norms are each above the
    1e-8 threshold while their product is below it (F.cosine_similarity clamps each norm, not
    the product)."""
    gen = torch.Generator().manual_seed(5)
    mlp = _mlp(20, 2)
    targets = [(torch.randn(s, generator=gen) * 1e-3).bfloat16() for s in SIZES]
    targets[1] = torch.full((3,), 2e-8).bfloat16()  # ||g|| ~ 3.5e-8, ||o|| < 0.3: product < 1e-8
    moms = [torch.randn(s, generator=gen) * 1e-3 for s in SIZES]
    with torch.no_grad():  # a small output for that tensor: scale the output layer down
        mlp.net[-1].weight.mul_(1e-3)
        mlp.net[-1].bias.mul_(1e-3)
    scale = torch.tensor([0.5])
    g_ref, l_ref, _ = _reference(mlp, targets, moms, [None] * len(SIZES), scale, 1.0)
    outputs = [torch.empty(s) for s in SIZES]
    g_ours, l_ours = _ours(mlp, targets, moms, outputs, None, scale, 1.0, 20, 2, impl)
    _assert_grads(g_ours, g_ref, [n for n, _ in mlp.named_parameters()], 0)
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_tensors_as_the_reference(impl):
    """Tensors of no elements among the selected: their loss is 0 the first time and NaN once
    they have a previous output (the reference's temporal mean over no elements), and they add
    nothing to the gradient."""
    gen = torch.Generator().manual_seed(6)
    mlp = _mlp(20, 2)
    sizes = [0, 300, 0, 5]
    targets = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    moms = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    names = [n for n, _ in mlp.named_parameters()]
    outputs = [torch.empty(n) for n in sizes]
    prevs = [None] * len(sizes)
    for step in range(2):
        g_ref, l_ref, o_ref = _reference(mlp, targets, moms, prevs, None, 1.0)
        g_ours, l_ours = _ours(mlp, targets, moms, outputs, [p is not None for p in prevs], None,
                               1.0, 20, 2, impl)
        _assert_grads(g_ours, g_ref, names, step)
        assert torch.equal(l_ours.isnan(), l_ref.isnan()) and l_ref.isnan().sum() == 2 * step
        torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-12, equal_nan=True)
        prevs = o_ref
        for o, r in zip(outputs, o_ref):
            o.copy_(r)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_momentum_poisons_the_gradient_as_in_autograd(impl):
    gen = torch.Generator().manual_seed(2)
    mlp = _mlp(20, 2)
    targets, moms = _inputs("zero", gen)
    moms[2][7] = float("nan")
    g_ref, l_ref, _ = _reference(mlp, targets, moms, [None] * len(SIZES), None, 1.0)
    g_ours, l_ours = _ours(mlp, targets, moms, [torch.empty(s) for s in SIZES], None, None, 1.0,
                           20, 2, impl)
    for a, b in zip(g_ours, g_ref):
        assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(l_ours.isnan(), l_ref.isnan())


@pytest.mark.parametrize("zero_scale", [False, True], ids=["nan-inf-elements", "scale-0"])
@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_targets_count_as_zero(impl, zero_scale):
    """A NaN or Inf gradient element (the corrected B1's target is the gradient) counts as 0:
    the reference's loss would be NaN and its Adam step would turn the MLP's weights NaN for good.
    With scale 0 (the optimizer's way to train a skipped step on zero targets without a host
    read) every g is 0, NaNs included. Expected: the reference on the targets with those
    elements 0, each tensor with and without a previous output over two calls."""
    gen = torch.Generator().manual_seed(11)
    mlp = _mlp(20, 2)
    names = [n for n, _ in mlp.named_parameters()]
    targets, moms = _inputs("grad", gen)
    targets[2][[0, 7, 299]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    targets[5][1000] = float("nan")
    scale = torch.tensor([0.0 if zero_scale else 0.7])
    clean = [torch.zeros_like(t) if zero_scale else t.nan_to_num(0.0, 0.0, 0.0) for t in targets]
    outputs = [torch.empty(s) for s in SIZES]
    prevs = [None] * len(SIZES)
    for step in range(2):
        g_ref, l_ref, o_ref = _reference(mlp, clean, moms, prevs, scale, 5.0)
        g_ours, l_ours = _ours(mlp, targets, moms, outputs, [p is not None for p in prevs],
                               scale, 5.0, 20, 2, impl)
        _assert_grads(g_ours, g_ref, names, step)
        torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-12)
        prevs = o_ref
        for o, r in zip(outputs, o_ref):
            o.copy_(r)


@pytest.mark.parametrize("output_scale", [0.0, 1e-12], ids=["o-zero", "o-below-eps"])
@pytest.mark.parametrize("impl", IMPLS)
def test_outputs_at_and_below_the_threshold(impl, output_scale):
    """||o|| = 0 (the reference's initialisation: a zero output layer) and 0 < ||o|| < 1e-8 with
    ||g|| above it: the cosine term is off and M = (||o|| / ||g|| - 1)^2, whose gradient at
    o = 0 is 0 (torch's norm at 0); finite, as the reference's."""
    gen = torch.Generator().manual_seed(12)
    mlp = _mlp(20, 2)
    with torch.no_grad():
        mlp.net[-1].weight.mul_(output_scale)
        mlp.net[-1].bias.mul_(output_scale)
    targets, moms = _inputs("grad", gen)
    g_ref, l_ref, _ = _reference(mlp, targets, moms, [None] * len(SIZES), None, 1.0)
    g_ours, l_ours = _ours(mlp, targets, moms, [torch.empty(s) for s in SIZES], None, None, 1.0,
                           20, 2, impl)
    assert all(torch.isfinite(g).all() for g in g_ours)
    _assert_grads(g_ours, g_ref, [n for n, _ in mlp.named_parameters()], 0)
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_target_norm_exactly_at_the_threshold(impl):
    """||g|| = 1e-8 exactly (in double, as both implementations and torch's norm compute it):
    not above the threshold, so M = ||o||^2 and no cosine term, as in the reference."""
    mlp = _mlp(20, 2)
    g = torch.tensor([1e-8, 1.1024945e-12, 2.4145378e-16, 9.83672e-20])
    assert float(g.double().norm()) == 1e-8
    moms = [torch.full((4,), 1e-3)]
    g_ref, l_ref, _ = _reference(mlp, [g], moms, [None], None, 1.0)
    g_ours, l_ours = _ours(mlp, [g], moms, [torch.empty(4)], None, None, 1.0, 20, 2, impl)
    _assert_grads(g_ours, g_ref, [n for n, _ in mlp.named_parameters()], 0)
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_ops_read_nothing_back(device):
    """CUDA's Phase 1 adds no host sync (a CMS step must not wait on the host): on every device
    no op of surrogate_gradient reads a value back or copies host data in (with the plan made
    before, as the optimizer keeps it), with tensors split across chunks and both kinds of
    tensors (with and without a previous output, g zero and not); on CUDA also under sync debug
    mode "error"."""
    gen = torch.Generator().manual_seed(4)
    mlp = _mlp(20, 2)
    targets, moms = _inputs("grad", gen)
    args = ([t.to(device) for t in targets], [m.to(device) for m in moms],
            [torch.randn(s, generator=gen).to(device) for s in SIZES],
            [p.detach().to(device) for p in mlp.parameters()],
            [torch.empty_like(p, device=device) for p in mlp.parameters()],
            torch.empty(len(SIZES), device=device))
    plan = SurrogatePlan([t.numel() for t in targets], torch.device(device), chunk=1000)
    has_prev = [i % 2 == 0 for i in range(len(SIZES))]
    scale = torch.tensor([0.5], device=device)
    record = RecordHostReads()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with record:
            surrogate_gradient(*args, divisor=2.0, has_prev=has_prev, scale=scale, plan=plan)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert record.ops > 100, "the mode saw no ops: the check is void"
    assert not record.host_reads, record.host_reads
    assert all(torch.isfinite(g).all() for g in args[4])


def _run_bits(num_threads):
    gen = torch.Generator().manual_seed(9)
    mlp = _mlp(20, 2)
    targets, moms = _inputs("grad", gen)
    outputs = [torch.randn(s, generator=gen) for s in SIZES]
    grads, losses = _ours(mlp, targets, moms, outputs, [True] * len(SIZES), torch.tensor([0.9]),
                          2.0, 20, 2, num_threads=num_threads)
    return grads + [losses] + outputs


def test_same_bits_for_any_thread_count_and_instruction_set():
    base = _run_bits(1)
    for a, b in zip(base, _run_bits(2)):
        assert torch.equal(a, b)
    isa = _C.cpu_isa()
    try:
        _C._select_cpu_isa("generic")
        generic = _run_bits(2)
    finally:
        _C._select_cpu_isa(isa)
    for a, b in zip(base, generic):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the CUDA op ----

CUDA_ONLY = DEVICES[1].marks
# every block edge: a partial tile, a block and one more, two chunks of 65,536, a tensor of none
BIT_SIZES = [0, 1, 3, 31, 33, 4096, 4097, 70000, 65536 + 3 * 4096 + 5, (33, 65)]


def _bits(t):
    """t's bits, for an equality that NaN does not spoil."""
    return t.contiguous().view(torch.int32)


def _assert_same_bits(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (
            f"{what}[{i}]: {int((_bits(a) != _bits(b)).sum())} of {a.numel()} elements differ, "
            f"max |diff| {float((a.double() - b.double()).abs().nan_to_num().max())}")


@pytest.mark.parametrize("hidden,layers", [(20, 2), (7, 1), (20, 3), (13, 2), (20, 8)],
                         ids=["h20-l2", "h7-l1", "h20-l3", "h13-l2", "h20-l8"])
@pytest.mark.parametrize("kind,dtype", [
    ("zero", torch.float32), ("grad", torch.float32), ("grad", torch.bfloat16),
    ("grad", torch.float16), ("grad", torch.float64), ("tiny", torch.float32)],
    ids=["zero", "grad-f32", "grad-bf16", "grad-f16", "grad-f64", "tiny"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA_ONLY, id="cuda")])
def test_cuda_op_matches_the_cpu_op_bit_for_bit(hidden, layers, kind, dtype, _):
    """tm_cms_surrogate on CUDA runs the CPU's blocks, lanes and sums with the same element math
    (common/tm_cms_surrogate.h): weight gradients, losses and outputs bit for bit, over three
    calls (each call's outputs the next one's prev on every other tensor, the others starting
    over), the gradient targets with a NaN and an Inf (counted as 0), at every block edge."""
    gen = torch.Generator().manual_seed(hidden * 10 + layers)
    mlp = _mlp(hidden, layers)
    scale = torch.tensor([0.7]) if kind != "zero" else None
    shapes = [s if isinstance(s, tuple) else (s,) for s in BIT_SIZES]
    prev_cpu = [torch.randn(s, generator=gen) for s in shapes]
    prev_cuda = [o.clone() for o in prev_cpu]
    for step in range(3):
        size = {"zero": 0.0, "grad": 1e-3, "tiny": 1e-12}[kind]
        targets = [(torch.randn(s, generator=gen) * size).to(dtype) for s in shapes]
        if kind == "grad":
            targets[7].view(-1)[[5, 66000]] = torch.tensor([float("nan"), float("inf")],
                                                          dtype=dtype)
            targets[4].zero_()  # a tensor below the threshold among the others
        moms = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
        has_prev = [step > 0 and i % 2 == 0 for i in range(len(shapes))]
        g_cpu, l_cpu = _ours(mlp, targets, moms, prev_cpu, has_prev, scale, 3.0, hidden, layers)
        g_cuda, l_cuda = _c_op_on("cuda", mlp, targets, moms, prev_cuda, has_prev, scale, 3.0,
                                  hidden, layers)
        _assert_same_bits(g_cuda, g_cpu, f"step {step} weight_grads")
        _assert_same_bits([l_cuda], [l_cpu], f"step {step} losses")
        _assert_same_bits(prev_cuda, prev_cpu, f"step {step} outputs")
        assert all(torch.isfinite(g).all() for g in g_cuda)


def _cuda_call(hidden=20, layers=2, seed=7):
    """The arguments of one CUDA call with a prev on every other tensor, and the gradient
    targets (fix_reference_bugs' Phase 1)."""
    gen = torch.Generator().manual_seed(seed)
    mlp = _mlp(hidden, layers)
    targets = [(torch.randn(s, generator=gen) * 1e-3).cuda() for s in SIZES]
    args = dict(targets=targets, momentum=[(torch.randn(s, generator=gen) * 1e-3).cuda()
                                           for s in SIZES],
                outputs=[torch.randn(s, generator=gen).cuda() for s in SIZES],
                weights=[p.detach().cuda() for p in mlp.parameters()],
                weight_grads=[torch.zeros_like(p, device="cuda") for p in mlp.parameters()],
                losses=torch.zeros(len(SIZES), device="cuda"))
    kw = dict(divisor=2.0, hidden=hidden, layers=layers,
              has_prev=[i % 2 == 0 for i in range(len(SIZES))],
              scale=torch.tensor([0.5], device="cuda"), scratch=_nan_scratch(targets, layers))
    return args, kw


def _results(args):
    return [t.clone() for t in args["weight_grads"] + [args["losses"]] + args["outputs"]]


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA_ONLY, id="cuda")])
def test_cuda_op_same_bits_every_run_in_a_graph_and_without_a_host_sync(_):
    """The CUDA op is deterministic (no atomics: two runs give the same bits), runs without a
    host sync (torch's sync debug mode "error" around it; a capture fails on any sync of the
    stream), and a CUDA graph that captured it replays it on the inputs of the replay: new
    targets, momenta and previous outputs copied into the captured tensors give the bits of an
    eager call on them."""
    args, kw = _cuda_call()
    prev = [o.clone() for o in args["outputs"]]
    _C.cms_surrogate(*args.values(), **kw)
    first = _results(args)
    for o, p in zip(args["outputs"], prev):
        o.copy_(p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _C.cms_surrogate(*args.values(), **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _assert_same_bits(_results(args), first, "second run")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C.cms_surrogate(*args.values(), **kw)  # recorded, not run
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):
        new = {name: [torch.randn(t.shape, generator=gen).cuda() * 1e-3 for t in args[name]]
               for name in ("targets", "momentum", "outputs")}
        for name, tensors in new.items():
            for t, v in zip(args[name], tensors):
                t.copy_(v)
        graph.replay()
        replayed = _results(args)
        eager = dict(args, outputs=[v.clone() for v in new["outputs"]],
                     weight_grads=[torch.full_like(g, float("nan")) for g in args["weight_grads"]],
                     losses=torch.full_like(args["losses"], float("nan")))
        _C.cms_surrogate(*eager.values(), **kw)
        _assert_same_bits(replayed, _results(eager), "replay")


def _cpu_scale(a, k):
    k["scale"] = k["scale"].cpu()


def _cpu_momentum(a, k):
    a["momentum"][1] = a["momentum"][1].cpu()


def _cpu_weight_grad(a, k):
    a["weight_grads"][3] = a["weight_grads"][3].cpu()


def _cpu_losses(a, k):
    a["losses"] = a["losses"].cpu()


def _no_scratch(a, k):
    k["scratch"] = None


def _small_scratch(a, k):
    k["scratch"] = k["scratch"][:-8]


def _cpu_scratch(a, k):
    k["scratch"] = k["scratch"].cpu()


def _scratch_in_an_output(a, k):
    big = torch.zeros(65537 + k["scratch"].numel() // 4, device="cuda")
    a["outputs"][5] = big[:65537]
    k["scratch"] = big.view(torch.uint8)


@pytest.mark.parametrize("mutate,exc,match", [
    (_cpu_scale, ValueError, r"scale: on cpu, but targets\[0\] is on cuda"),
    (_cpu_momentum, ValueError, r"momentum\[1\]: on cpu, but targets\[0\] is on cuda"),
    (_cpu_weight_grad, ValueError, r"weight_grads\[3\]: on cpu, but targets\[0\] is on cuda"),
    (_cpu_losses, ValueError, r"losses: on cpu, but targets\[0\] is on cuda"),
    (_no_scratch, ValueError, r"scratch: CUDA needs \d+ bytes"),
    (_small_scratch, ValueError, r"scratch: CUDA needs \d+ bytes, got"),
    (_cpu_scratch, BufferError, r"scratch: on cpu, but the tensors are on cuda"),
    (_scratch_in_an_output, ValueError, r"scratch: shares memory with outputs\[5\]"),
], ids=["cpu-scale", "cpu-momentum", "cpu-weight-grad", "cpu-losses", "no-scratch",
        "small-scratch", "cpu-scratch", "scratch-in-an-output"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA_ONLY, id="cuda")])
def test_cuda_op_refuses_mixed_devices_and_bad_scratch_writing_nothing(mutate, exc, match, _):
    """A tensor on another device than the targets, scratch missing, too small, on the CPU or
    inside a written tensor: refused before the first write, named."""
    args, kw = _cuda_call()
    mutate(args, kw)
    before = _written(args)
    with pytest.raises(exc, match=match):
        _C.cms_surrogate(*args.values(), **kw)
    torch.cuda.synchronize()
    for a, b in zip(_written(args), before):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- argument checks ----

def _call_args():
    mlp = _mlp(20, 2)
    n = [5, 300]
    args = dict(targets=[torch.zeros(k) for k in n], momentum=[torch.randn(k) for k in n],
                outputs=[torch.randn(k) for k in n],
                weights=[p.detach() for p in mlp.parameters()],
                weight_grads=[torch.zeros_like(p) for p in mlp.parameters()],
                losses=torch.zeros(2))
    kw = dict(divisor=1.0, hidden=20, layers=2, has_prev=[True, False])
    return args, kw


def _written(args):
    return [t.clone() for t in args["outputs"] + args["weight_grads"] + [args["losses"]]]


def _bad_weight_count(a, k):
    a["weights"] = a["weights"][:-1]


def _bad_momentum_numel(a, k):
    a["momentum"][1] = torch.zeros(299)


def _momentum_of_another_shape(a, k):
    a["momentum"][1] = torch.zeros(10, 30)


def _output_of_another_shape(a, k):
    a["outputs"][1] = torch.zeros(300, 1)


def _weight_grad_transposed(a, k):
    a["weight_grads"][0] = torch.zeros(a["weights"][0].shape[::-1])


def _bad_output_dtype(a, k):
    a["outputs"][0] = torch.zeros(5, dtype=torch.float16)


def _bad_weight_grad_numel(a, k):
    a["weight_grads"][2] = torch.zeros(19, 20)


def _bad_losses(a, k):
    a["losses"] = torch.zeros(3)


def _bad_hidden(a, k):
    k["hidden"] = 21


def _bad_layers(a, k):
    k["layers"] = 0


def _bad_divisor(a, k):
    k["divisor"] = float("nan")


def _bad_has_prev(a, k):
    k["has_prev"] = [True]


def _aliased_output(a, k):
    a["outputs"][1] = a["momentum"][1]


def _non_float_weight(a, k):
    a["weights"][0] = a["weights"][0].half()


def _bad_scale(a, k):
    k["scale"] = torch.ones(2)


@pytest.mark.parametrize("mutate,match", [
    (_bad_weight_count, r"weights: 5 tensors, the direct network \(layers = 2\) has 6"),
    (_bad_momentum_numel, r"momentum\[1\]: numel 299 does not match targets\[1\] numel 300"),
    (_momentum_of_another_shape,
     r"momentum\[1\]: shape \[10, 30\] does not match targets\[1\] shape \[300\]"),
    (_output_of_another_shape,
     r"outputs\[1\]: shape \[300, 1\] does not match targets\[1\] shape \[300\]"),
    (_weight_grad_transposed,
     r"weight_grads\[0\]: shape \[4, 20\] does not match weights\[0\] shape \[20, 4\]"),
    (_bad_output_dtype, r"outputs\[0\]: dtype float16, must be float32"),
    (_bad_weight_grad_numel, r"weight_grads\[2\]: numel 380 does not match weights\[2\]"),
    (_bad_losses, r"losses: expected float32 with 2 elements"),
    (_bad_hidden, r"hidden = 21: must be in \[1, 20\]"),
    (_bad_layers, r"layers = 0: must be in \[1, 8\]"),
    (_bad_divisor, r"divisor = nan: must be finite and >= 1"),
    (_bad_has_prev, r"has_prev: 1 entries for 2 targets"),
    (_aliased_output, r"outputs\[1\]: shares memory with momentum\[1\]"),
    (_non_float_weight, r"weights\[0\]: expected float32, got float16"),
    (_bad_scale, r"scale: expected float32 with 1 element"),
])
def test_bad_arguments_raise_and_write_nothing(mutate, match):
    args, kw = _call_args()
    mutate(args, kw)
    before = _written(args)
    with pytest.raises((ValueError, TypeError), match=match):
        _C.cms_surrogate(*args.values(), **kw)
    for a, b in zip(_written(args), before):
        assert torch.equal(a, b)
