"""The C core's contract for tensors dense in another order than C's (channels_last, transposed).

Element-wise ops (AdamW, CMS Phase 2, the surrogate's gradient, scaling) and the norms take such
tensors where they lie, reading their numel elements in memory order. A tensor paired element by
element with another (a gradient or state with its parameter, a surrogate output with its
target) must lie in the same order: else BufferError naming both, nothing written. Tensors the
ops read by shape (the momentum MLP's weights) and tensors dense in no order are refused.

Each op on such tensors is checked bitwise against the same op on their contiguous permuted
views (the same memory, read in the same order): what test_adamw, test_cms_op and
test_cms_surrogate check against torch and the reference carries over. The optimizers built on
them are checked against torch and the reference on channels_last models in test_layouts and
test_deep_nested_layouts.
"""

import copy

import pytest
import torch

import titanmac_c
from conftest import DEVICES
from titanmac_c import _C
from titanmac_c._internal.runtime import dense_order

K = 3  # CMS levels
H = 4  # MLP width


def _laid_out(t, how):
    """t's values in another memory order: 'cl' channels_last (4-d), 't' transposed storage
    (2-d: the tensor of t's shape whose memory is column-major), '' as it is."""
    if how == "cl":
        return t.clone(memory_format=torch.channels_last)
    if how == "t":
        return t.t().contiguous().t()
    return t.clone()


def _view(t):
    """t's contiguous permuted view (the same memory in the same order)."""
    return t if t.is_contiguous() else t.permute(dense_order(t))


# shapes and memory orders of the parameters (with every tensor they pair with)
LAYOUTS = [((4, 3, 2, 2), "cl"), ((5, 7), "t"), ((6,), ""), ((2, 3, 1, 5), "cl")]


def _like(params, gen, scale=1.0):
    return [torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen) * scale)
            for p in params]


# ---------------------------------------------------------------- the importer ----

@pytest.mark.parametrize("make, layout", [
    (lambda: torch.randn(3, 4), "contiguous"),
    (lambda: torch.randn(3, 4).t(), "shape [4, 3], strides [1, 4]"),
    (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
     "shape [2, 3, 4, 5], strides [60, 1, 15, 3]"),
    # the strides of size-1 dimensions say nothing about the order
    (lambda: torch.empty_strided((1, 4, 1), (7, 1, 9)), "contiguous"),
    (lambda: torch.empty_strided((3, 1, 2), (1, 5, 3)), "shape [3, 1, 2], strides [1, 5, 3]"),
], ids=["contiguous", "transposed", "channels-last", "size-1-dims", "size-1-dims-permuted"])
def test_import_reports_the_memory_order(make, layout):
    assert _C._import(make())["layout"] == layout


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 6)[:, ::2],  # a gap
    lambda: torch.randn(3, 1).expand(3, 4),  # several elements on one place
    lambda: torch.empty_strided((2, 2), (1, 1)),  # overlapping
    lambda: torch.randn(4, 6)[::2].t(),  # dense in no order once transposed either
], ids=["strided", "expanded", "overlapping", "strided-transposed"])
def test_tensors_dense_in_no_order_are_refused(make):
    with pytest.raises(BufferError, match=r"^tensor: not contiguous, nor dense in another order "
                                          r"\(shape \[.*\], strides \[.*\]\)$"):
        _C._import(make())


# ---------------------------------------------------------------- AdamW ----

def _adamw_lists(device, gen):
    params = [_laid_out(torch.randn(s, generator=gen), how).to(device) for s, how in LAYOUTS]
    steps = [torch.zeros((), device=device) for _ in params]
    return [params, _like(params, gen), _like(params, gen, 0.1),
            [v.abs() for v in _like(params, gen, 0.01)],
            [], steps]


def _adamw(lists, device, **kw):
    scratch = None
    if torch.device(device).type == "cuda":
        scratch = torch.zeros(max(_C.adamw_scratch_bytes(*lists), 1), dtype=torch.uint8,
                              device=device)
    _C.adamw_step(*lists, torch.full((1,), 1e-2, device=device),
                  [(0.9, 0.999, 1e-8, 0.1, False)], scratch=scratch, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_steps_tensors_where_they_lie(device):
    gen = torch.Generator().manual_seed(0)
    lists = _adamw_lists(device, gen)
    views = [[_view(t) for t in ts] for ts in copy.deepcopy(lists)]  # deepcopy keeps strides
    for _ in range(3):
        _adamw(lists, device)
        _adamw(views, device)
    for ts, vs in zip(lists, views):
        for t, v in zip(ts, vs):
            assert torch.equal(_view(t), v)
    assert all(p.stride() == g.stride() for p, g in zip(lists[0], lists[1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("role, index, how, message", [
    (1, 0, "", r"grads\[0\]: laid out as contiguous, params\[0\] as shape \[4, 3, 2, 2\], "
               r"strides \[12, 1, 6, 3\]"),
    (2, 1, "", r"exp_avg\[1\]: laid out as contiguous, params\[1\] as shape \[5, 7\], "
               r"strides \[1, 5\]"),
    (3, 2, "t", None),  # a 1-d tensor has one order: taken
], ids=["grad-contiguous", "exp_avg-contiguous", "one-dim"])
def test_adamw_refuses_a_tensor_in_another_order_than_its_parameter(device, role, index, how,
                                                                    message):
    gen = torch.Generator().manual_seed(1)
    lists = _adamw_lists(device, gen)
    t = lists[role][index]
    lists[role][index] = (t.contiguous() if how == "" else t)
    before = copy.deepcopy(lists)
    if message is None:
        _adamw(lists, device)
        return
    with pytest.raises(BufferError, match="^" + message + r" \(tensors paired element by element "
                                                          r"need one memory order\)$"):
        _adamw(lists, device)
    for ts, bs in zip(lists, before):
        assert all(torch.equal(t, b) for t, b in zip(ts, bs))


# ---------------------------------------------------------------- CMS Phase 2 ----

def _cms_args(net, device, gen):
    params = [_laid_out(torch.randn(s, generator=gen), how).to(device) for s, how in LAYOUTS]
    shapes = [(H * (4 if net == "direct" else 9),), (H,), (H * H,), (H,)]
    shapes += [(H,), (1,)] if net == "direct" else [(3 * H,), (3,)]
    weights = ([torch.ones(1)] if net == "legacy" else []) + [
        torch.randn(s, generator=gen) * 0.3 for s in shapes]
    return dict(
        params=params, grads=_like(params, gen, 0.1),
        momentum=[_like(params, gen, 0.01) for _ in range(K)],
        accumulated=[_like(params, gen, 0.01) for _ in range(K)],
        ema=[_like(params, gen, 0.01) for _ in range(K)],
        v_sq=[[v.abs() for v in _like(params, gen, 0.01)] for _ in range(K)],
        step_counts=[torch.zeros(K, device=device) for _ in params],
        lr=torch.full((2,), 0.1, device=device), group_of=[0, 1, 0, 1],
        weights=[w.to(device) for w in weights])


def _cms(args, net, device, t):
    scratch = None
    if torch.device(device).type == "cuda":
        scratch = torch.empty(_C.cms_scratch_bytes(args["params"], levels=K, net=net),
                              dtype=torch.uint8, device=device)
    one = torch.ones(1, device=device)
    _C.cms_step(*args.values(), fires=[True, t % 2 == 0, t % 3 == 0],
                divisors=[1.0, 2.0, 3.0], ema_decays=[0.9, 0.95, 0.99], net=net, hidden=H,
                layers=2, weight_decay=0.01, t=t, base_lr=0.1, loss=one, grad_scale=one * 0.5,
                skip=None, scratch=scratch)


def _cms_views(args):
    views = {}
    for key, value in args.items():
        if key in ("params", "grads"):
            views[key] = [_view(t) for t in value]
        elif key in ("momentum", "accumulated", "ema", "v_sq"):
            views[key] = [[_view(t) for t in level] for level in value]
        else:
            views[key] = value
    return views


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("net", ["direct", "legacy"])
def test_cms_step_takes_tensors_where_they_lie(device, net):
    """Levels firing 1/2/3, the momentum norms and the legacy network's per-tensor statistics
    (sums in memory order) included: bitwise the step on the views."""
    gen = torch.Generator().manual_seed(2)
    args = _cms_args(net, device, gen)
    views = _cms_views(copy.deepcopy(args))
    for t in range(1, 7):
        _cms(args, net, device, t)
        _cms(views, net, device, t)
    for key in ("params", "momentum", "accumulated", "ema", "v_sq"):
        ours = args[key] if key == "params" else [t for lv in args[key] for t in lv]
        seen = views[key] if key == "params" else [t for lv in views[key] for t in lv]
        for a, b in zip(ours, seen):
            assert torch.equal(_view(a), b), key


def _cms_state(args):
    return [t.clone() for key in ("params", "momentum", "accumulated", "ema", "v_sq")
            for t in (args[key] if key == "params" else [x for lv in args[key] for x in lv])]


@pytest.mark.parametrize("spoil, message", [
    (lambda a: a["momentum"][2].__setitem__(0, a["momentum"][2][0].contiguous()),
     r"momentum\[2\]\[0\]: laid out as contiguous, params\[0\] as shape \[4, 3, 2, 2\], "
     r"strides \[12, 1, 6, 3\] \(tensors paired element by element need one memory order\)"),
    (lambda a: a["grads"].__setitem__(1, a["grads"][1].contiguous()),
     r"grads\[1\]: laid out as contiguous, params\[1\] as shape \[5, 7\], strides \[1, 5\] "
     r"\(tensors paired element by element need one memory order\)"),
    (lambda a: a["weights"].__setitem__(0, torch.randn(4, H).t()),
     rf"weights\[0\]: not contiguous \(shape \[{H}, 4\], strides \[1, {H}\]\)"),
], ids=["state-buffer", "gradient", "mlp-weight"])
def test_cms_step_refuses_tensors_out_of_order(spoil, message):
    args = _cms_args("direct", "cpu", torch.Generator().manual_seed(3))
    spoil(args)
    before = _cms_state(args)
    with pytest.raises(BufferError, match="^" + message + "$"):
        _cms(args, "direct", "cpu", 1)
    assert all(torch.equal(a, b) for a, b in zip(_cms_state(args), before))


# ---------------------------------------------------------------- surrogate, norms, scale ----

def _surrogate_args(gen):
    targets = [_laid_out(torch.randn(s, generator=gen), how) for s, how in LAYOUTS]
    mlp = torch.nn.Sequential(torch.nn.Linear(4, H), torch.nn.SiLU(), torch.nn.Linear(H, H),
                              torch.nn.SiLU(), torch.nn.Linear(H, 1))
    weights = [p.detach() for p in mlp.parameters()]
    return dict(targets=targets, momentum=_like(targets, gen, 0.1),
                outputs=_like(targets, gen, 0.1), weights=weights,
                weight_grads=[torch.zeros_like(w) for w in weights],
                losses=torch.zeros(len(targets)))


def _surrogate(args):
    _C.cms_surrogate(*args.values(), divisor=2.0, hidden=H, layers=2,
                     has_prev=[True, False, True, True], scale=None)


def test_surrogate_takes_tensors_where_they_lie():
    args = _surrogate_args(torch.Generator().manual_seed(4))
    views = {k: [_view(t) for t in v] if k in ("targets", "momentum", "outputs") else v
             for k, v in copy.deepcopy(args).items()}
    _surrogate(args)
    _surrogate(views)
    for key in ("outputs", "weight_grads"):
        assert all(torch.equal(_view(a), b) for a, b in zip(args[key], views[key])), key
    assert torch.equal(args["losses"], views["losses"])


def test_surrogate_refuses_an_output_in_another_order():
    args = _surrogate_args(torch.Generator().manual_seed(5))
    args["outputs"][0] = args["outputs"][0].contiguous()
    before = [t.clone() for t in args["outputs"] + args["weight_grads"]]
    with pytest.raises(BufferError, match=r"^outputs\[0\]: laid out as contiguous, targets\[0\] "
                                          r"as shape \[4, 3, 2, 2\], strides \[12, 1, 6, 3\]"):
        _surrogate(args)
    assert all(torch.equal(a, b) for a, b in zip(args["outputs"] + args["weight_grads"], before))


@pytest.mark.parametrize("device", DEVICES)
def test_norms_take_each_tensor_in_its_own_order(device):
    """A norm pairs nothing: gradients and parameters in different orders are taken as they lie."""
    gen = torch.Generator().manual_seed(6)
    grads = [_laid_out(torch.randn(s, generator=gen), how).to(device) for s, how in LAYOUTS]
    params = [t.contiguous() if i % 2 else t.clone() for i, t in enumerate(grads)]
    norms = titanmac_c.functional.group_norms(grads, params, [0, 1, 0, 1], num_groups=2)
    for g in range(2):
        want = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in grads[g::2]]))
        torch.testing.assert_close(norms.grad[g], want, rtol=1e-6, atol=0)
    scale = torch.full((1,), 0.5, device=device)
    before = [t.clone() for t in grads]
    _C.scale_(grads, scale)
    assert all(torch.equal(a, b * 0.5) for a, b in zip(grads, before))
    assert [t.stride() for t in grads] == [t.stride() for t in before]


# ---------------------------------------------------------------- the shim ----

@pytest.mark.parametrize("shape", [(3, 5), (4, 4)], ids=["non-square", "square"])
def test_adamw_parameter_transposed_in_place_behaves_as_torch(shape):
    """`p.data = p.data.t()` after a step: a square weight keeps its state by index (laid out in
    the parameter's new order), as torch's; a non-square one no longer fits its state (same numel,
    another shape), which torch refuses too: ValueError naming the parameter and both shapes,
    nothing changed."""
    p = torch.nn.Parameter(torch.randn(shape))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = titanmac_c.AdamW([p], lr=1e-2)
    opt_ref = torch.optim.AdamW([ref], lr=1e-2)
    for step in range(4):
        if step == 2:
            p.data, ref.data = p.data.t(), ref.data.t()
        p.grad = torch.full_like(p, 0.5) + torch.arange(p.numel()).view(p.shape[::-1]).t()
        ref.grad = p.grad.clone()
        if step >= 2 and shape[0] != shape[1]:
            before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            with pytest.raises(ValueError, match=r"exp_avg\[0\]: shape \[3, 5\] does not match "
                               r"params\[0\] shape \[5, 3\] "
                               r"\(param_groups\[0\]\['params'\]\[0\]\)"):
                opt.step()
            with pytest.raises(RuntimeError):
                opt_ref.step()
            assert torch.equal(p, before[0])
            assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
            return
        opt.step()
        opt_ref.step()
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], opt_ref.state[ref]["exp_avg"],
                                   rtol=1e-6, atol=1e-7)
