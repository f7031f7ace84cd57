"""_C.cms_step (tm_cms_step) against the reference's CMS Phase 2: ReferenceDeepNestedOptimizer.
_cms_update_param (docs/deep_nested_optimizer.md section 7.2) called for every tensor, from the same
state, step after step, for both momentum networks (after each step's comparison our params and
momenta are reset to the reference's, see Ours.sync). Its argument checks are in
test_cms_op_errors.py. Bug ids (B4, B7) are those of that document's section 14.

Tolerances (the element math is the reference's, operation by operation; what differs is torch's
own exp/log/SiLU/matmul rounding inside the MLPs and its float32 norms and stats, which we sum in
double):
  accumulated, ema, v_sq, step counts  bitwise on the CPU (the same float ops); CUDA: 1e-6 of
                                       the value or of the tensor's max (torch's CUDA divides by a
                                       scalar as a * (1 / div))
  momentum (fp32 state)                |d| <= 2e-5 * max|m| + 1e-7 + 1e-5 * |ref|, max over the
                                       tensor before and after the step (measured <= 5e-6 max|m|)
  params fp32                          |d| <= 1e-6 * max|p| + 1e-6 * |ref|   (a few ulps)
  params bf16                          one bf16 rounding of max(|old|, |new|) per step (our params
                                       are reset to the reference's after each comparison)
  params fp64                          the step p' - p within 1e-5 of itself + 1e-6 of the largest
                                       step + 2 ulps of p (buffers and update are float32, as the
                                       reference's; the float32 rate, lr rounded, is 6e-8 of it)
NaN positions must match exactly.
"""

import pytest
import torch

from conftest import CUDA, DEVICES
from titanmac_c import _C
from titanmac_c.testing import reference_dno as R

SIZES = [1, 3, 4097, (33, 65), 65537]  # the 2-D tensor lands in the reference's 'core' group
LRS = [1e-2 * 1.3, 1e-2 * 0.7]  # base_lr * mu per group (Python floats, as _cms_step has them)
LOSS = 2.5
STEPS = {  # steps where level 0 fires; also 1 and 2 (t=100, 25, 50) and 0 and 1 (t=110, 30)
    (1, 10, 100): [98, 99, 100, 110],
    (1, 5, 50): [24, 25, 30, 50],  # B7: levels fire every 1, 5, 25 steps; divisors 1, 5, 50
}
STATE_KEYS = ("momentum", "accumulated_grad", "ema_grad", "v_sq")


class Toy(torch.nn.Module):
    def __init__(self, sizes, dtype, gen):
        super().__init__()
        for i, s in enumerate(sizes):
            shape = s if isinstance(s, tuple) else (s,)
            data = (torch.randn(shape, generator=gen) * 0.5).to(dtype)
            self.register_parameter(f"p{i}", torch.nn.Parameter(data))


def make_case(net, freqs, wd=0.0, dtype=torch.float32, device="cpu", sizes=SIZES, seed=0,
              randomize=True, momentum_scale=0.01, hidden=None, layers=2):
    """A reference optimizer over a toy model, its MLP weights and CMS state randomized (the
    reference's init zeroes the output layer; random weights make every input matter)."""
    gen = torch.Generator().manual_seed(seed)
    model = Toy(sizes, dtype, gen).to(device)
    hidden = hidden if hidden is not None else (20 if net == "direct" else 16)
    ref = R.ReferenceDeepNestedOptimizer(
        model, base_lr=1e-2, cms_frequencies=list(freqs), use_cms_updates=True,
        use_preprocessing=net == "direct", momentum_hidden_dim=hidden,
        momentum_num_layers=layers, weight_decay=wd)
    with torch.no_grad():
        for w in ref.momentum_mlp.parameters() if randomize else []:
            w.copy_(torch.randn(w.shape, generator=gen) * (0.4 if net == "direct" else 0.3))
    params = [p for g in ref.base_optimizer.param_groups for p in g["params"]]
    group_of = [k for k, g in enumerate(ref.base_optimizer.param_groups) for _ in g["params"]]
    for p in params:
        for lvl in ref.state[p].levels:
            lvl.momentum = (torch.randn(p.shape, generator=gen) * momentum_scale).to(device)
            lvl.accumulated_grad = (torch.randn(p.shape, generator=gen) * 0.1).to(device)
            lvl.ema_grad = (torch.randn(p.shape, generator=gen) * 0.1).to(device)
            lvl.v_sq = (torch.rand(p.shape, generator=gen) * 0.01).to(device)
            lvl.step_count = int(torch.randint(0, 50, (1,), generator=gen))
    return ref, params, group_of


class Ours:
    """The same state as flat tensors in cms_step's layout, and one call per step."""

    def __init__(self, ref, params, group_of, device, lrs=LRS):
        self.ref, self.group_of, self.device, self.lrs = ref, group_of, device, lrs
        self.K = len(ref.cms_frequencies)
        self.params = [p.detach().clone().reshape(-1) for p in params]
        self.state = {k: [[getattr(ref.state[p].levels[l], k).clone().reshape(-1) for p in params]
                          for l in range(self.K)] for k in STATE_KEYS}
        self.steps = [torch.tensor([float(ref.state[p].levels[l].step_count)
                                    for l in range(self.K)], device=device) for p in params]
        self.net = "direct" if ref.use_preprocessing else "legacy"
        self.weights = [w.detach().clone().reshape(-1) for w in ref.momentum_mlp.parameters()]

    def snapshot(self):
        return ([p.clone() for p in self.params],
                [[m.clone() for m in lv] for lv in self.state["momentum"]])

    def sync(self, params):
        """Take the reference's params and momenta, so that the next step starts from the same
        state: differences do not compound (m' = 0.9 m + 0.1 delta can cancel to a tiny m whose
        last-bit difference the next step's sign feature, e^10 m, multiplies by 22026)."""
        for i, p in enumerate(params):
            self.params[i].copy_(p.detach().reshape(-1))
            for l, lvl in enumerate(self.ref.state[p].levels):
                self.state["momentum"][l][i].copy_(lvl.momentum.reshape(-1))

    def step(self, grads, t, coef=None, skip=None, num_threads=2, t_arg=None, context=None):
        freqs = self.ref.cms_frequencies
        base = freqs[1] if self.K > 1 else 10
        dev = self.device
        f32 = dict(dtype=torch.float32, device=dev)
        scratch = torch.empty(_C.cms_scratch_bytes(self.params, levels=self.K, net=self.net),
                              dtype=torch.uint8, device=dev)
        _C.cms_step(
            self.params, grads, *[self.state[k] for k in STATE_KEYS], self.steps,
            torch.tensor(self.lrs, **f32), self.group_of, self.weights,
            fires=[t % int(base ** l) == 0 for l in range(self.K)],
            divisors=[float(max(f, 1)) for f in freqs],
            ema_decays=[0.99 ** (1.0 / int(base ** l)) for l in range(self.K)], net=self.net,
            hidden=self.ref.momentum_mlp.hidden_dim, layers=self.ref.momentum_mlp.num_layers,
            weight_decay=self.ref.weight_decay, t=t if t_arg is None else t_arg,
            base_lr=self.ref.base_lr, context=context,
            loss=torch.tensor([LOSS], **f32),
            grad_scale=None if coef is None else torch.tensor([coef], **f32),
            skip=None if skip is None else torch.tensor([skip], **f32),
            num_threads=num_threads, scratch=scratch)


def ref_step(ref, params, group_of, grads, t, coef=None, lrs=LRS):
    """Phase 2 of _cms_step with p.grad the clipped gradient (torch's clip multiplies the grads
    in place, in their dtype)."""
    ref.global_step = t
    context = ref._get_context(LOSS)
    with torch.no_grad():
        for p, g, k in zip(params, grads, group_of):
            g = g.reshape(p.shape)
            p.grad = (g * torch.tensor(coef, device=g.device)) if coef is not None else g.clone()
            ref._cms_update_param(p, lrs[k], context, t)


def make_grads(params, gen, dtype, scale=0.1):
    return [(torch.randn(p.shape, generator=gen) * scale).to(dtype).reshape(-1).to(p.device)
            for p in params]


def close(ours, ref, atol_scale, rtol, what, old=None, floor=0.0):
    """|ours - ref| <= atol_scale * S + floor + rtol * |ref|, S = the largest finite |value| of
    the tensor before (old) or after the step: m' = 0.9 m + 0.1 delta may cancel to a tiny value
    whose error is the size of the terms' roundings (floor: those of 0.1 delta, delta = O(1))."""
    ours, ref = ours.float().reshape(-1).cpu(), ref.float().reshape(-1).cpu()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)), f"{what}: NaN positions differ"
    both = torch.cat([ref, old.float().reshape(-1).cpu()]) if old is not None else ref
    finite = torch.isfinite(both)
    scale = both[finite].abs().max().item() if finite.any() else 0.0
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol_scale * scale + floor + 1e-30,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


def close_bf16(ours, ref, old, what):
    """Within two bfloat16 roundings of the larger of the old and new value: p + (-lr) u is
    rounded once and u differs in its last float32 bits; torch's scalar add_ path (the last
    elements of a tensor) also rounds (-lr) u to bfloat16 before adding, its vector path not."""
    ours, ref, old = (x.float().reshape(-1).cpu() for x in (ours, ref, old))
    tol = torch.maximum(ref.abs(), old.abs()) * 2.0**-6 + 1e-30
    bad = (ours - ref).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than two roundings"


def close_f64_step(ours, ref, old, what):
    """float64 params: the step (p' - p, exact in double) within 1e-5 of the reference's, plus
    1e-6 of the tensor's largest step (a step that cancels to nearly 0 keeps the float32 roundings
    of its terms), plus 2 ulps of p (the rounding of p + (-lr) u)."""
    ours, ref, old = (x.detach().reshape(-1).cpu() for x in (ours, ref, old))
    ulp = torch.nextafter(old.abs(), torch.tensor(torch.inf, dtype=old.dtype)) - old.abs()
    step = (ref - old).abs()
    tol = 1e-5 * step + 1e-6 * step.max() + 2 * ulp
    bad = (ours - ref).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max {(ours - ref).abs().max()}"


def assert_matches(ours, ref, params, device, dtype, old):
    """old: (params, momenta[level][tensor]) before the step."""
    exact = device == "cpu"
    for i, p in enumerate(params):
        if dtype == torch.float32:
            close(ours.params[i], p.detach(), 1e-6, 1e-6, f"params[{i}]", old[0][i])
        elif dtype == torch.float64:
            close_f64_step(ours.params[i], p, old[0][i], f"params[{i}]")
        else:
            close_bf16(ours.params[i], p.detach(), old[0][i], f"params[{i}]")
        for l, lvl in enumerate(ref.state[p].levels):
            close(ours.state["momentum"][l][i], lvl.momentum, 2e-5, 1e-5, f"momentum[{l}][{i}]",
                  old[1][l][i], floor=1e-7)
            for key in STATE_KEYS[1:]:
                a, b = ours.state[key][l][i].cpu(), getattr(lvl, key).reshape(-1).cpu()
                if exact:
                    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{key}[{l}][{i}]"
                else:
                    close(a, b, 1e-6, 1e-6, f"{key}[{l}][{i}]")
            assert ours.steps[i][l].item() == lvl.step_count, f"step_counts[{i}][{l}]"


def run_case(device, net, freqs, wd, dtype, coefs=(0.75, None, 0.5, 1.0), lrs=LRS, **kw):
    ref, params, group_of = make_case(net, freqs, wd, dtype, device, **kw)
    ours = Ours(ref, params, group_of, device, lrs)
    gen = torch.Generator().manual_seed(5)
    for t, coef in zip(STEPS[tuple(freqs)], coefs):
        grads = make_grads(params, gen, dtype)
        old = ours.snapshot()
        ref_step(ref, params, group_of, grads, t, coef, lrs)
        ours.step(grads, t, coef)
        assert_matches(ours, ref, params, device, dtype, old)
        ours.sync(params)
    return ref, params, ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
@pytest.mark.parametrize("freqs", [(1, 10, 100), (1, 5, 50)])
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_steps_match_reference(device, net, freqs, wd, dtype):
    run_case(device, net, freqs, wd, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
@pytest.mark.parametrize("freqs", [(1, 10, 100), (1, 5, 50)])
def test_bf16_weight_decay_above_the_tolerance(device, net, freqs):
    """In the bf16 steps above the decay term lr wd p (about 1.3e-4 p) is below the two bf16
    roundings close_bf16 allows (2^-6 max(|p|, |p'|) = 0.0156 |p|): dropping it for bf16 passes
    there. Here lr wd = 0.13 * 0.5 and 0.07 * 0.5 (the two groups): the decay moves every
    element by 0.065 |p| or 0.035 |p|, 4.2 and 2.2 times that tolerance. The 10 times larger
    lr also scales the differences in v = u + wd p (rounded to bf16 on both sides), yet the
    errors stay within one rounding of p (measured <= 0.44 of the tolerance)."""
    run_case(device, net, freqs, 0.5, torch.bfloat16, lrs=[0.13, 0.07])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buffers_not_kept_change_nothing_else(device, net, dtype):
    """Empty ema[l > 0] and v_sq lists (what the DeepNestedOptimizer passes: nothing reads them)
    give the same bits in params, momenta, accumulators, e_0 and step counts as full lists, over
    steps where every level fires; the kept e_0 matches the reference."""
    ref, params, group_of = make_case(net, (1, 10, 100), 0.01, dtype, device)
    full = Ours(ref, params, group_of, device)
    lean = Ours(ref, params, group_of, device)
    lean.state["ema_grad"][1:] = [[] for _ in range(lean.K - 1)]
    lean.state["v_sq"] = [[] for _ in range(lean.K)]
    gen = torch.Generator().manual_seed(6)
    for t, coef in zip((98, 99, 100, 110, 200), (0.75, None, 0.5, 1.0, None)):
        grads = make_grads(params, gen, dtype)
        full.step(grads, t, coef)
        lean.step(grads, t, coef)
        ref_step(ref, params, group_of, grads, t, coef)

    def same(xs, ys):
        return all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True))

    assert same(full.params, lean.params) and same(full.steps, lean.steps)
    for key in ("momentum", "accumulated_grad"):
        for l in range(full.K):
            assert same(full.state[key][l], lean.state[key][l]), f"{key}[{l}]"
    assert same(full.state["ema_grad"][0], lean.state["ema_grad"][0])
    for i, p in enumerate(params):
        e0 = ref.state[p].levels[0].ema_grad.reshape(-1)
        close(lean.state["ema_grad"][0][i], e0, 1e-6, 1e-6, f"ema_grad[0][{i}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_reference_init_networks(device, net):
    """The networks as the reference initializes them (B4's DirectUpdateMLP, H = 20; the legacy
    MLP with H = 64 and its [1.5, 3.0, -5.0] output bias)."""
    run_case(device, net, (1, 10, 100), 0.01, torch.float32, randomize=False,
             hidden=20 if net == "direct" else 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_momentum_clamp(device, net):
    """A large momentum: ||m'|| > 100 ||g^||, so every firing level is scaled to the limit."""
    ref, params, group_of = make_case(net, (1, 10, 100), 0.0, torch.float32, device,
                                      momentum_scale=50.0)
    ours = Ours(ref, params, group_of, device)
    grads = make_grads(params, torch.Generator().manual_seed(2), torch.float32)
    ghat = [a + g * 0.75 for a, g in zip(ours.state["accumulated_grad"][0], grads)]
    old = ours.snapshot()
    ref_step(ref, params, group_of, grads, 99, 0.75)
    ours.step(grads, 99, 0.75)
    assert_matches(ours, ref, params, device, torch.float32, old)
    for m, g in zip(ours.state["momentum"][0], ghat):
        assert m.norm().item() == pytest.approx(100 * g.norm().item(), rel=1e-5)


@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_zero_gradient_clamps_momentum_to_the_floor(net):
    """A zero gradient with zeroed accumulators (g^ = 0): the reference clamps ||m'|| to
    100 * max(||g^||, 1e-8) = 1e-6 rather than zeroing m, and so do we."""
    ref, params, group_of = make_case(net, (1, 10, 100), 0.0, torch.float32, sizes=[1, 3, 4097])
    for p in params:
        for lvl in ref.state[p].levels:
            lvl.accumulated_grad.zero_()
    ours = Ours(ref, params, group_of, "cpu")
    grads = [torch.zeros(p.numel()) for p in params]
    old = ours.snapshot()
    ref_step(ref, params, group_of, grads, 99, None)  # level 0 fires alone
    ours.step(grads, 99)
    assert_matches(ours, ref, params, "cpu", torch.float32, old)
    for i, m in enumerate(ours.state["momentum"][0]):
        assert abs(m.norm().item() - 1e-6) <= 1e-11, (net, i, m.norm().item())


@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_one_non_finite_level_among_finite_ones(net):
    """A NaN in accumulated[1] only, levels 0 and 2 clean, t = 100 (all fire): level 1 alone is
    dropped, the parameters stay finite and match the reference."""
    ref, params, group_of = make_case(net, (1, 10, 100), 0.01, torch.float32, sizes=[3, 70])
    for p in params:
        ref.state[p].levels[1].accumulated_grad.view(-1)[0] = float("nan")
    ours = Ours(ref, params, group_of, "cpu")
    grads = make_grads(params, torch.Generator().manual_seed(1), torch.float32)
    old = ours.snapshot()
    ref_step(ref, params, group_of, grads, 100, 0.75)
    ours.step(grads, 100, 0.75)
    assert all(torch.isfinite(p).all() for p in ours.params)
    assert all(torch.isfinite(p).all() for p in params)
    assert_matches(ours, ref, params, "cpu", torch.float32, old)


def test_bf16_param_update_matches_torch_add_bitwise():
    """DIRECT with zero weights and output bias c gives delta = c exactly, so the bf16 update
    must equal torch's p.add_(c.to(bf16), alpha=-lr) bit for bit (CPU: alpha rounded to bf16)."""
    n, lr, c = 100003, 0.013, 0.37
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(0)).bfloat16()
    p = p0.clone()
    g = torch.ones(n, dtype=torch.bfloat16)
    st = [[[torch.zeros(n)]] for _ in range(4)]
    w = [torch.zeros(8), torch.zeros(2), torch.zeros(2), torch.full((1,), c)]  # H = 2, L = 1
    scratch = torch.empty(_C.cms_scratch_bytes([p], levels=1, net="direct"), dtype=torch.uint8)
    _C.cms_step([p], [g], *st, [torch.zeros(1)], torch.tensor([lr]), None, w, fires=[True],
                divisors=[1.0], ema_decays=[0.99], net="direct", hidden=2, layers=1,
                weight_decay=0.0, t=1, base_lr=0.1, loss=None, scratch=scratch)
    want = p0.clone().add_(torch.full((n,), c).to(torch.bfloat16), alpha=-lr)
    assert torch.equal(p, want), f"{int((p != want).sum())} of {n} elements differ"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_nan_gradient_skips_levels(device, net):
    """A NaN gradient element makes that tensor's contributions non-finite: its levels are
    skipped (n = 0, p unchanged) while the state updates happen, and the NaN stays in m."""
    ref, params, group_of = make_case(net, (1, 10, 100), 0.01, torch.float32, device)
    ours = Ours(ref, params, group_of, device)
    gen = torch.Generator().manual_seed(9)
    before = [p.detach().clone() for p in params]
    for k, t in enumerate([99, 100, 101]):
        grads = make_grads(params, gen, torch.float32)
        if k == 0:
            grads[3][7] = float("nan")
        old = ours.snapshot()
        ref_step(ref, params, group_of, grads, t, 0.75)
        ours.step(grads, t, 0.75)
        assert_matches(ours, ref, params, device, torch.float32, old)
        ours.sync(params)
    assert torch.equal(params[3].detach(), before[3])
    assert not torch.equal(params[4].detach(), before[4])
    assert torch.isnan(ours.state["momentum"][0][3]).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
@pytest.mark.parametrize("skip", [1.0, -1.0, float("nan")], ids=["one", "negative", "nan"])
def test_skip_changes_nothing(device, net, skip):
    """Any nonzero skip (also -1 and NaN, not only positive values) leaves everything as it was."""
    ref, params, group_of = make_case(net, (1, 10, 100), 0.01, torch.bfloat16, device)
    ours = Ours(ref, params, group_of, device)
    snap = [t.clone() for t in ours.params + ours.steps] + [
        t.clone() for k in STATE_KEYS for lv in ours.state[k] for t in lv]
    grads = make_grads(params, torch.Generator().manual_seed(1), torch.bfloat16)
    ours.step(grads, 100, 0.75, skip=skip)
    after = ours.params + ours.steps + [t for k in STATE_KEYS for lv in ours.state[k] for t in lv]
    assert all(torch.equal(a, b) for a, b in zip(after, snap))


def test_tile_and_element_paths_agree_bitwise():
    """DIRECT on the CPU: elements in SIMD tiles (64 at a time) and the per-element function
    tm_cms_direct_delta (the CUDA code, here the tail of a block) give the same bits."""
    ref, params, group_of = make_case("direct", (1, 10, 100), 0.0, torch.float32,
                                      sizes=[320, 63], momentum_scale=0.01)
    ours = Ours(ref, params, group_of, "cpu")
    for key in STATE_KEYS:
        for lv in ours.state[key]:
            lv[1].copy_(lv[0][:63])
    ours.params[1].copy_(ours.params[0][:63])
    grads = make_grads(params, torch.Generator().manual_seed(3), torch.float32)
    grads[1] = grads[0][:63].clone()
    ours.step(grads, 100, 0.75)
    assert torch.equal(ours.params[1], ours.params[0][:63])
    for lv in ours.state["momentum"]:
        assert torch.equal(lv[1], lv[0][:63])


@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_cpu_bits_do_not_depend_on_isa_or_threads(net):
    results = []
    current = _C.cpu_isa()
    try:
        for isa in ("generic", "avx2", "avx512"):
            try:
                _C._select_cpu_isa(isa)
            except ValueError:
                continue
            for threads in (1, 2, 3):
                ref, params, group_of = make_case(net, (1, 10, 100), 0.01, torch.bfloat16,
                                                  sizes=[3, 4097, 300000])
                ours = Ours(ref, params, group_of, "cpu")
                gen = torch.Generator().manual_seed(4)
                for t in (99, 100):
                    ours.step(make_grads(params, gen, torch.bfloat16), t, 0.75, num_threads=threads)
                results.append(torch.cat([x.float() for x in ours.params] +
                                         [x for lv in ours.state["momentum"] for x in lv]))
    finally:
        _C._select_cpu_isa(current)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_context_in_memory_replaces_t_and_base_lr(device, net):
    """context = float64 (t, base_lr) on the device (what a CUDA graph's replays read): the
    same bits as the numbers given as arguments, with the arguments then ignored (given wrong
    here), over steps where levels 0-2 fire; the legacy network's (a, b, d) read t / 1000 and
    base_lr, so a wrong t or base_lr reaching them changes its momenta (checked: the arguments
    alone, wrong, give other bits)."""
    runs = {}
    for mode in ("numbers", "context", "wrong_numbers"):
        ref, params, group_of = make_case(net, (1, 10, 100), 0.01, device=device)
        ours = Ours(ref, params, group_of, device)
        gen = torch.Generator().manual_seed(6)
        for t in (99, 100, 101):
            grads = make_grads(params, gen, torch.float32)
            if mode == "numbers":
                ours.step(grads, t, 0.75)
                continue
            true_t, true_lr = t, ref.base_lr
            ref.base_lr = 0.37  # what the arguments now say
            ctx = torch.tensor([float(true_t), true_lr], dtype=torch.float64, device=device)
            ours.step(grads, t, 0.75, t_arg=5000.0,
                      context=None if mode == "wrong_numbers" else ctx)
            ref.base_lr = true_lr
        runs[mode] = torch.cat([x.reshape(-1) for x in ours.params] +
                               [x for lv in ours.state["momentum"] for x in lv])
    assert torch.equal(runs["context"], runs["numbers"])
    assert torch.equal(runs["wrong_numbers"], runs["numbers"]) == (net == "direct")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device or backend")
@pytest.mark.parametrize("net", ["direct", "legacy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_and_cuda_agree(net, dtype):
    """Both backends run the element math of tm_cms_math.h: DIRECT gives the same bits (its
    per-tensor sums, summed in other orders, only decide the clamp, inactive here); LEGACY's
    (a, b, d) come from those sums, so within the momentum tolerance."""
    results = {}
    for device in ("cpu", "cuda"):
        ref, params, group_of = make_case(net, (1, 10, 100), 0.01, dtype, device)
        ours = Ours(ref, params, group_of, device)
        gen = torch.Generator().manual_seed(4)
        for t in (99, 100):
            ours.step(make_grads(params, gen, dtype), t, 0.75)
        results[device] = torch.cat([x.float().cpu() for x in ours.params] +
                                    [x.cpu() for k in STATE_KEYS for lv in ours.state[k]
                                     for x in lv])
    if net == "direct":
        assert torch.equal(results["cpu"], results["cuda"])
        return
    n = sum(p.numel() for p in params)  # the params come first
    close(results["cuda"][n:], results["cpu"][n:], 2e-5, 1e-5, "state", floor=1e-7)
    cpu, cuda = results["cpu"][:n], results["cuda"][:n]
    if dtype != torch.bfloat16:
        # a few ulps of p' plus 1e-4 of the largest move p' - p (the state's tolerance above,
        # 2e-5 of the largest momentum, 5 times: lr v is a sum of momenta); 2^-6 |p| would pass
        # params that CUDA never updated (|p' - p| = lr |v| is about 1e-2 |p|). A CPU stand-in
        # for the other summation order (MLP weights scaled by 1 + 3e-5 N(0, 1): the state at
        # 0.69 of its tolerance) puts the params at 0.36 of this one
        start = torch.cat([p.detach().float().reshape(-1).cpu() for p in params])
        tol = 1e-6 * cpu.abs() + 1e-4 * float((cpu - start).abs().max())
    else:
        tol = 2.0**-6 * cpu.abs() + 1e-6  # two bf16 roundings of p (close_bf16)
    bad = (cuda - cpu).abs() > tol
    assert not bad.any(), f"params: {int(bad.sum())} elements off, max {(cuda - cpu).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensor_counts_its_steps(device):
    f32 = dict(dtype=torch.float32, device=device)
    p = [torch.zeros(0, **f32), torch.ones(5, **f32)]
    st = [[[torch.zeros(0, **f32), torch.zeros(5, **f32)]] for _ in range(4)]
    steps = [torch.zeros(1, **f32), torch.zeros(1, **f32)]
    w = [torch.full((n,), 0.1, **f32) for n in (8, 2, 2, 1)]  # H = 2, L = 1
    scratch = torch.empty(_C.cms_scratch_bytes(p, levels=1, net="direct"), dtype=torch.uint8,
                          device=device)
    _C.cms_step(p, [x.clone() for x in p], *st, steps, torch.tensor([0.1], **f32), None, w,
                fires=[True], divisors=[1.0], ema_decays=[0.99], net="direct", hidden=2,
                layers=1, weight_decay=0.0, t=1, base_lr=0.1, loss=None, scratch=scratch)
    assert [s.item() for s in steps] == [1.0, 1.0]
    assert not torch.equal(p[1], torch.ones(5, **f32))
