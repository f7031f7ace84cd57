"""titanmac_c.AdamW(fused=True) under torch.amp.GradScaler against torch's fused AdamW, which also
takes the scaler's grad_scale and found_inf (_step_supports_amp_scaling): parameters, state, step
counts, the gradients left after each step and the scaler's scale, step by step, with
overflowing steps skipped on the device. And the C core's store_scaled_grads, which carries it.
Without fused=True, GradScaler's ordinary path, as for torch's default AdamW."""

import copy
import warnings

import pytest
import torch

import titanmac_c
from conftest import DEVICES, RecordHostReads, clone_params, make_params, tol
from titanmac_c import _C

STEPS = 10
OVERFLOW_STEPS = (2, 6)  # an Inf gradient: the step is skipped and the scale backs off


def scaled_grads(params_a, params_b, step, scale):
    """The same gradients, multiplied by the loss scale as backward of a scaled loss gives them,
    with an Inf on the overflow steps."""
    gen = torch.Generator().manual_seed(500 + step)
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        g = torch.randn(pa.shape, generator=gen) * scale
        if step in OVERFLOW_STEPS and i == len(params_a) - 1:
            g.view(-1)[g.numel() // 2] = float("inf")
        pa.grad = g.to(device=pa.device, dtype=pa.dtype)
        pb.grad = pa.grad.clone()


def run_both(device, params_a, params_b, ours, theirs, before_step=None, steps=STEPS):
    """Both optimizers through the GradScaler flow; yields after each step."""
    # a scale that is no power of two: torch divides by it, and so must we, to the bit
    scalers = [torch.amp.GradScaler(torch.device(device).type, init_scale=3000.0,
                                    growth_interval=3) for _ in range(2)]
    for step in range(steps):
        for scaler in scalers:
            scaler.scale(torch.ones((), device=device))  # what scaling the loss starts
        scaled_grads(params_a, params_b, step, scalers[0].get_scale())
        for opt, scaler in zip((ours, theirs), scalers):
            if before_step is not None:
                before_step(opt, scaler)
            scaler.step(opt)
            scaler.update()
        yield step, scalers


def assert_same_run(ours, theirs, params_a, params_b, scalers, tolerance):
    # fp16/bf16 state: an element rounded one ulp apart (torch's CPU kernel fuses multiply-adds)
    # stays apart and, in exp_avg, walks on as it decays towards 0: within one unit of
    # rounding at 1.0, the scale of these moments
    state_tol = dict(rtol=tolerance["rtol"], atol=max(tolerance["atol"], 2.0 ** -10))
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.detach(), pb.detach(), **tolerance)
        # the gradients as torch leaves them: unscaled, or untouched on a skipped step (NaN
        # where a clip after unscale_ scaled an Inf by 0)
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0, equal_nan=True)
        sa, sb = ours.state[pa], theirs.state[pb]
        assert float(sa["step"]) == float(sb["step"])
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in sb:
                torch.testing.assert_close(sa[key], sb[key], **state_tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, unscale", [
    (torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
    (torch.float32, True), (torch.bfloat16, True),  # unscale_ refuses fp16 gradients
    (torch.float64, False), (torch.float64, True),
])
def test_grad_scaler_matches_torch_fused(device, dtype, unscale):
    """Without unscale_ the gradients reach step() scaled (GradScaler passes grad_scale); after
    unscale_ only found_inf. Two groups, amsgrad in one."""
    params_a = make_params([1, 255, 4097, 65537], device, dtype)
    params_b = clone_params(params_a)

    def groups(ps):
        return [{"params": ps[::2], "lr": 1e-2}, {"params": ps[1::2], "amsgrad": True}]

    ours = titanmac_c.AdamW(groups(params_a), lr=3e-3, weight_decay=0.1, fused=True)
    theirs = torch.optim.AdamW(groups(params_b), lr=3e-3, weight_decay=0.1, fused=True)
    before = (lambda opt, scaler: scaler.unscale_(opt)) if unscale else None
    skipped = 0
    for step, scalers in run_both(device, params_a, params_b, ours, theirs, before):
        assert_same_run(ours, theirs, params_a, params_b, scalers, tol(dtype, device))
        skipped += step in OVERFLOW_STEPS
        assert float(ours.state[params_a[0]]["step"]) == step + 1 - skipped
    assert skipped == 2


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_with_unscale_and_folded_clip(device):
    """unscale_, then our folded clip_grad_norm_, then scaler.step: the parameters torch gets
    from unscale_, clip_grad_norm_ and its step (the gradients keep their unclipped values)."""
    params_a = make_params([3, 4097], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, fused=True)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, fused=True)

    def unscale_and_clip(opt, scaler):
        scaler.unscale_(opt)
        if opt is ours:
            opt.clip_grad_norm_(5.0)
        else:
            torch.nn.utils.clip_grad_norm_(params_b, 5.0)

    for _, scalers in run_both(device, params_a, params_b, ours, theirs, unscale_and_clip):
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for pa, pb in zip(params_a, params_b):
            torch.testing.assert_close(pa.detach(), pb.detach(), **tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_folded_clip_before_unscale_is_torchs_clip_there_with_a_warning(device):
    """Our folded clip_grad_norm_ called without unscale_ measures the still-scaled gradients, as
    torch's clip_grad_norm_ there: against torch's fused AdamW after torch's clip on the scaled
    gradients, step by step, with a warning at each step that the clip saw the loss scale.
    After unscale_ the same clip warns of nothing."""
    params_a = make_params([3, 4097], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, fused=True)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler(torch.device(device).type, init_scale=3000.0,
                                    growth_interval=3) for _ in range(2)]
    for step in range(STEPS):
        for scaler in scalers:
            scaler.scale(torch.ones((), device=device))
        scaled_grads(params_a, params_b, step, scalers[0].get_scale())
        torch.nn.utils.clip_grad_norm_(params_b, 5.0)
        ours.clip_grad_norm_(5.0)
        with pytest.warns(UserWarning, match="still multiplied by the GradScaler's loss scale"):
            scalers[0].step(ours)
        scalers[1].step(theirs)
        for scaler in scalers:
            scaler.update()
        if step in OVERFLOW_STEPS:  # skipped: torch's clip left its gradients times 0, ours not
            for pa in params_a:
                pa.grad = None
            for pb in params_b:
                pb.grad = None
            continue
        for pa, pb in zip(params_a, params_b):
            torch.testing.assert_close(pa.detach(), pb.detach(), **tol(torch.float32, device))
            # a few ulps: the coefficient may differ in its last bit (the norm sums in another
            # order) and the gradient is clipped and unscaled in another order
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=0)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[pa][key], theirs.state[pb][key],
                                           **tol(torch.float32, device))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled_grads(params_a, params_b, 0, scalers[0].get_scale())
        scalers[0].unscale_(ours)
        ours.clip_grad_norm_(5.0)
        scalers[0].step(ours)


def test_grad_scaler_step_reads_nothing_on_the_host():
    """The whole scaler.step + update reads no device value on the host (recorded on the CPU,
    where it costs nothing, for the CUDA path it stands for); torch's non-fused AdamW, which
    takes GradScaler's ordinary path, reads found_inf."""
    counts = []
    for opt_class, kw in ((titanmac_c.AdamW, {"fused": True}),
                          (torch.optim.AdamW, {"foreach": True})):
        params = make_params([3, 4097])
        opt = opt_class(params, lr=1e-2, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for step in range(4):  # the first builds the state and caches, unrecorded
            scaler.scale(torch.ones(()))
            scaled_grads(params, clone_params(params), step, scaler.get_scale())
            with RecordHostReads(host_side=[s["step"] for s in opt.state.values()]) as rec:
                scaler.step(opt)
                scaler.update()
            if step:
                counts.append(len(rec.host_reads))
    assert counts[:3] == [0, 0, 0]  # overflow step 2 included
    assert min(counts[3:]) > 0  # the check is able to see the host read


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unscale", [False, True])
def test_without_fused_grad_scaler_steps_ours_as_torchs_default(device, unscale):
    """fused=None or False, as with torch's AdamW: GradScaler unscales the gradients, reads the inf
    flag and calls step() only when it is clear (its ordinary path), so a framework that clips
    under mixed precision unless the optimizer takes the scale itself (Lightning) clips ours
    too. Against torch's default AdamW, with unscale_ and torch's clip before the step or
    without; and the protocol attribute as torch sets it, also on a copy."""
    for fused in (None, False, True):
        mine = titanmac_c.AdamW(make_params([3], device), fused=fused)
        torchs = torch.optim.AdamW(make_params([3], device), fused=fused)
        for opt in (mine, copy.deepcopy(mine)):
            assert getattr(opt, "_step_supports_amp_scaling", False) == bool(fused)
        assert getattr(torchs, "_step_supports_amp_scaling", False) == bool(fused)
    params_a = make_params([1, 255, 4097], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.1)

    def unscale_and_clip(opt, scaler):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params_a if opt is ours else params_b, 5.0)

    before = unscale_and_clip if unscale else None
    for _, scalers in run_both(device, params_a, params_b, ours, theirs, before):
        assert not hasattr(ours, "grad_scale") and not hasattr(ours, "found_inf")
        assert_same_run(ours, theirs, params_a, params_b, scalers, tol(torch.float32, device))
    assert float(ours.state[params_a[0]]["step"]) == STEPS - len(OVERFLOW_STEPS)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_in_another_layout_is_left_unscaled(device):
    """A gradient in another memory layout than its parameter is taken as a copy; the unscaled
    values reach .grad all the same. Against torch's foreach AdamW (GradScaler's ordinary path):
    torch 2.13's fused CPU kernel pairs such a gradient with the parameter by memory order."""
    w_a = torch.nn.Parameter(torch.randn(4, 6, 5, 5, device=device))
    w_b = torch.nn.Parameter(w_a.detach().clone())
    ours = titanmac_c.AdamW([w_a], lr=1e-2, fused=True)
    theirs = torch.optim.AdamW([w_b], lr=1e-2, foreach=True)
    for opt, w in ((ours, w_a), (theirs, w_b)):
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 6)
        scaler.scale(torch.ones((), device=device))
        gen = torch.Generator().manual_seed(3)
        g = (torch.randn(w.shape, generator=gen) * 2.0 ** 6).to(device)
        w.grad = g.contiguous(memory_format=torch.channels_last)
        scaler.step(opt)
    assert torch.equal(w_a.grad, w_b.grad)
    assert w_a.grad.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(w_a.detach(), w_b.detach(), **tol(torch.float32, device))


def test_bad_grad_scale_is_refused_before_any_write():
    params = make_params([3, 7])
    opt = titanmac_c.AdamW(params, lr=1e-2, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.grad_scale = torch.ones(2)
    with pytest.raises(ValueError, match=r"^optimizer\.grad_scale: expected one real value, "
                                         r"got a tensor of shape \(2,\)"):
        opt.step()
    assert not hasattr(opt, "grad_scale")  # a refused step removes them (see below)
    opt.found_inf = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"^optimizer\.found_inf: expected one real value"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params)) and not opt.state
    opt.found_inf = [0.0]
    with pytest.raises(TypeError, match=r"^optimizer\.found_inf: expected a tensor or a number, "
                                        r"got list$"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params)) and not opt.state
    opt.step()  # a refused step removed the attributes: an ordinary step
    assert float(opt.state[params[0]]["step"]) == 1.0


def test_a_refused_scaler_step_leaves_no_stale_scale_behind():
    """GradScaler deletes grad_scale and found_inf only after a step that returned: a refused
    one must not leave them for the next step to multiply the next scale into."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = titanmac_c.AdamW([p], lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((4,), 2.0 ** 10)
    opt.param_groups[0]["eps"] = -1.0
    with pytest.raises(ValueError, match="eps"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert torch.equal(p.grad, torch.full((4,), 2.0 ** 10)) and not opt.state
    opt.param_groups[0]["eps"] = 1e-8
    scaler.update()
    scaler.scale(torch.ones(()))
    p.grad = torch.full((4,), scaler.get_scale() * 3.0)
    scaler.step(opt)
    assert torch.equal(p.grad, torch.full((4,), 3.0))


def test_parameters_sharing_one_gradient_are_refused_by_name():
    """Two parameters given one gradient tensor: unscaling it in place twice at once would race
    (torch divides it twice in turn). Refused, nothing written."""
    params = [torch.nn.Parameter(torch.zeros(64)) for _ in range(2)]
    opt = titanmac_c.AdamW(params, lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    grad = torch.full((64,), 8.0)
    params[0].grad = params[1].grad = grad
    with pytest.raises(ValueError, match=r"^grads\[1\]: shares memory with grads\[0\] "
                                         r"\(param_groups\[0\]\['params'\]\[1\]; grads\[0\] is "
                                         r"param_groups\[0\]\['params'\]\[0\]\)$"):
        scaler.step(opt)
    assert torch.equal(grad, torch.full((64,), 8.0)) and not opt.state
    assert all(torch.equal(q, torch.zeros(64)) for q in params)


def test_gradients_that_cannot_take_the_unscaled_values_back():
    """A gradient taken as a copy (another layout) is written back after the C call: an
    expanded one cannot be, and is refused before anything is written; an inference tensor is
    written, as the C core writes one in place."""
    w = torch.nn.Parameter(torch.randn(5, 3).t())
    v = torch.nn.Parameter(torch.randn(8))
    opt = titanmac_c.AdamW([{"params": [v]}, {"params": [w], "amsgrad": True}], lr=1e-2,
                           fused=True)
    before = [w.detach().clone(), v.detach().clone()]
    v.grad = torch.full((8,), 8.0)
    w.grad = torch.full((1, 1), 8.0).expand(3, 5)
    opt.grad_scale, opt.found_inf = torch.full((), 4.0), torch.zeros(())
    with pytest.raises(RuntimeError, match=r"^param_groups\[1\]\['params'\]\[0\]: its gradient "
                                           r"is an expanded tensor"):
        opt.step()
    assert torch.equal(before[0], w.detach()) and torch.equal(before[1], v.detach())
    assert not opt.state and torch.equal(v.grad, torch.full((8,), 8.0))
    with torch.inference_mode():
        w.grad = torch.full((3, 5), 8.0)  # contiguous, where w is transposed: taken as a copy
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    assert torch.equal(w.grad, torch.full((3, 5), 2.0))
    assert torch.equal(v.grad, torch.full((8,), 2.0))
    assert float(opt.state[w]["step"]) == 1.0 and not torch.equal(before[0], w.detach())


# ---------------------------------------------------------------------------- the C core


def adamw_lists(device, dtype, n=4099):
    gen = torch.Generator().manual_seed(21)

    def rnd():
        return torch.randn(n, generator=gen).to(device=device, dtype=dtype)

    return [[rnd()], [rnd() * 64], [rnd() * 0.1], [rnd().abs() * 0.01], [],
            [torch.full((), 2.0, device=device)]]


def adamw_call(lists, device, grad_scale=None, loss_scale=None, skip=None):
    device = torch.device(device)
    scratch = None
    if device.type == "cuda":
        scratch = torch.zeros(max(_C.adamw_scratch_bytes(*lists), 1), dtype=torch.uint8,
                              device=device)
    _C.adamw_step(*lists, torch.full((1,), 1e-2, device=device),
                  [(0.9, 0.999, 1e-8, 0.01, True)], grad_scale=grad_scale, skip=skip,
                  loss_scale=loss_scale, scratch=scratch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_scale_divides_the_gradient_and_stores_it_back(device, dtype):
    """Each grad element becomes grad * grad_scale / loss_scale in float32, rounded once to its
    dtype (maximize on: the value before the sign flip), as torch's fused AdamW divides; the
    update reads the unrounded value, so in float32 the step equals one on gradients divided
    beforehand. A skipped step stores nothing."""
    a = adamw_lists(device, dtype)
    grad = a[1][0].clone()
    clip = torch.full((1,), 0.3, device=device)
    loss_scale = torch.full((1,), 3000.0, device=device)  # GradScaler's may be no power of two
    adamw_call(a, device, grad_scale=clip, loss_scale=loss_scale)
    unscaled = (grad.float() * clip / 3000.0).to(dtype)
    assert torch.equal(a[1][0], unscaled)
    if dtype == torch.float32:
        b = adamw_lists(device, dtype)
        b[1][0] = unscaled.clone()
        adamw_call(b, device)
        for k in (0, 2, 3, 5):
            assert torch.equal(a[k][0], b[k][0])
    before = [[t.clone() for t in lst] for lst in a]
    adamw_call(a, device, grad_scale=clip, loss_scale=loss_scale,
               skip=torch.ones(1, device=device))
    assert all(torch.equal(x, y) for la, lb in zip(a, before) for x, y in zip(la, lb))


def test_loss_scale_refuses_what_it_cannot_write():
    """Read-only grads, an input inside a grad, and two grads on one memory (the second would
    be divided again, by another thread): refused, nothing written."""
    import numpy as np
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    g.flags.writeable = False
    m, v, step = np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(1, np.float32)
    lr, scale = np.full(1, 0.1, np.float32), np.full(1, 2.0, np.float32)
    hp = [(0.9, 0.999, 1e-8, 0.0, False)]
    with pytest.raises(BufferError, match=r"^grads\[0\]: read-only, cannot be written$"):
        _C.adamw_step([p], [g], [m], [v], [], [step], lr, hp, loss_scale=scale)
    assert (g == 0.5).all() and (p == 1).all() and (step == 0).all()
    for name in ("lr", "grad_scale", "skip", "loss_scale"):
        grads = torch.full((8,), 0.25)
        q, m2, v2, s2 = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.zeros(())
        inputs = {"lr": torch.full((1,), 0.1), "grad_scale": None, "skip": None,
                  "loss_scale": torch.full((1,), 2.0)}
        inputs[name] = grads[5:6]
        with pytest.raises(ValueError, match=rf"^{name}: shares memory with grads\[0\]$"):
            _C.adamw_step([q], [grads], [m2], [v2], [], [s2], inputs["lr"], hp,
                          grad_scale=inputs["grad_scale"], skip=inputs["skip"],
                          loss_scale=inputs["loss_scale"])
        assert torch.equal(grads, torch.full((8,), 0.25)) and torch.equal(q, torch.ones(8))
        assert s2.item() == 0
    shared = torch.full((8,), 0.25)
    ps = [torch.ones(8), torch.ones(8)]
    states = [[torch.zeros(8) for _ in range(2)] for _ in range(2)]
    steps = [torch.zeros(()), torch.zeros(())]
    with pytest.raises(ValueError, match=r"^grads\[1\]: shares memory with grads\[0\]$"):
        _C.adamw_step(ps, [shared, shared], [s[0] for s in states], [s[1] for s in states], [],
                      steps, torch.full((1,), 0.1), hp, loss_scale=torch.full((1,), 2.0))
    assert torch.equal(shared, torch.full((8,), 0.25)) and all(s.item() == 0 for s in steps)
