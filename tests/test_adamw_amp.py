"""titanmac_c.AdamW under torch.amp.GradScaler against torch's fused AdamW, which also takes the
scaler's grad_scale and found_inf (_step_supports_amp_scaling): parameters, state, step counts,
the gradients left after each step and the scaler's scale, step by step, with overflowing
steps skipped on the device. And the C core's store_scaled_grads, which carries it."""

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
    scalers = [torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 12,
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
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.detach(), pb.detach(), **tolerance)
        # the gradients as torch leaves them: unscaled, or untouched on a skipped step
        assert torch.equal(pa.grad, pb.grad)
        sa, sb = ours.state[pa], theirs.state[pb]
        assert float(sa["step"]) == float(sb["step"])
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in sb:
                torch.testing.assert_close(sa[key], sb[key], **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, unscale", [
    (torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
    (torch.float32, True), (torch.bfloat16, True),  # unscale_ refuses fp16 gradients
])
def test_grad_scaler_matches_torch_fused(device, dtype, unscale):
    """Without unscale_ the gradients reach step() scaled (GradScaler passes grad_scale); after
    unscale_ only found_inf. Two groups, amsgrad in one."""
    params_a = make_params([1, 255, 4097, 65537], device, dtype)
    params_b = clone_params(params_a)

    def groups(ps):
        return [{"params": ps[::2], "lr": 1e-2}, {"params": ps[1::2], "amsgrad": True}]

    ours = titanmac_c.AdamW(groups(params_a), lr=3e-3, weight_decay=0.1)
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
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
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


def test_grad_scaler_step_reads_nothing_on_the_host():
    """The whole scaler.step + update reads no device value on the host (recorded on the CPU,
    where it costs nothing, for the CUDA path it stands for); torch's non-fused AdamW, which
    takes GradScaler's ordinary path, reads found_inf."""
    counts = []
    for opt_class, kw in ((titanmac_c.AdamW, {}), (torch.optim.AdamW, {"foreach": True})):
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
def test_gradient_in_another_layout_is_left_unscaled(device):
    """A gradient in another memory layout than its parameter is taken as a copy; the unscaled
    values reach .grad all the same. Against torch's foreach AdamW (GradScaler's ordinary path):
    torch 2.13's fused CPU kernel pairs such a gradient with the parameter by memory order."""
    w_a = torch.nn.Parameter(torch.randn(4, 6, 5, 5, device=device))
    w_b = torch.nn.Parameter(w_a.detach().clone())
    ours = titanmac_c.AdamW([w_a], lr=1e-2)
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
    opt = titanmac_c.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.grad_scale = torch.ones(2)
    with pytest.raises(ValueError, match=r"^optimizer\.grad_scale: expected one real value, "
                                         r"got a tensor of shape \(2,\)"):
        opt.step()
    del opt.grad_scale
    opt.found_inf = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"^optimizer\.found_inf: expected one real value"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params)) and not opt.state
    del opt.found_inf
    opt.step()  # the attributes gone, an ordinary step
    assert float(opt.state[params[0]]["step"]) == 1.0


# ---------------------------------------------------------------------------- the C core


def adamw_lists(device, dtype, n=4099):
    gen = torch.Generator().manual_seed(21)

    def rnd():
        return torch.randn(n, generator=gen).to(device=device, dtype=dtype)

    return [[rnd()], [rnd() * 64], [rnd() * 0.1], [rnd().abs() * 0.01], [],
            [torch.full((), 2.0, device=device)]]


def adamw_call(lists, device, grad_scale, skip=None, store=False):
    device = torch.device(device)
    scratch = None
    if device.type == "cuda":
        scratch = torch.zeros(max(_C.adamw_scratch_bytes(*lists), 1), dtype=torch.uint8,
                              device=device)
    _C.adamw_step(*lists, torch.full((1,), 1e-2, device=device),
                  [(0.9, 0.999, 1e-8, 0.01, True)], grad_scale=grad_scale, skip=skip,
                  store_scaled_grads=store, scratch=scratch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_scaled_grads_writes_the_scaled_gradient_and_changes_nothing_else(device, dtype):
    """The same step as without the option (maximize on: the stored value is before the sign
    flip), and each grad element becomes grad * grad_scale rounded once to its dtype; a scale
    that is no power of two too. A skipped step stores nothing."""
    a = adamw_lists(device, dtype)
    b = [[t.clone() for t in lst] for lst in a]
    grad = a[1][0].clone()
    scale = torch.full((1,), 0.3, device=device)
    adamw_call(a, device, scale, store=True)
    adamw_call(b, device, scale, store=False)
    for k in (0, 2, 3, 5):
        assert torch.equal(a[k][0], b[k][0])
    assert torch.equal(a[1][0], (grad.float() * 0.3).to(dtype))
    assert torch.equal(b[1][0], grad)
    before = [[t.clone() for t in lst] for lst in a]
    adamw_call(a, device, scale, skip=torch.ones(1, device=device), store=True)
    assert all(torch.equal(x, y) for la, lb in zip(a, before) for x, y in zip(la, lb))


def test_store_scaled_grads_refuses_read_only_grads_and_inputs_inside_a_grad():
    import numpy as np
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    g.flags.writeable = False
    m, v, step = np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(1, np.float32)
    lr, scale = np.full(1, 0.1, np.float32), np.full(1, 0.5, np.float32)
    hp = [(0.9, 0.999, 1e-8, 0.0, False)]
    with pytest.raises(BufferError, match=r"^grads\[0\]: read-only, cannot be written$"):
        _C.adamw_step([p], [g], [m], [v], [], [step], lr, hp, grad_scale=scale,
                      store_scaled_grads=True)
    assert (g == 0.5).all() and (p == 1).all() and (step == 0).all()
    for name in ("lr", "grad_scale", "skip"):
        grads = torch.full((8,), 0.25)
        q, m2, v2, s2 = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.zeros(())
        inputs = {"lr": torch.full((1,), 0.1), "grad_scale": torch.ones(1), "skip": None}
        inputs[name] = grads[5:6]
        with pytest.raises(ValueError, match=rf"^{name}: shares memory with grads\[0\], "
                                             r"which it may write$"):
            _C.adamw_step([q], [grads], [m2], [v2], [], [s2], inputs["lr"], hp,
                          grad_scale=inputs["grad_scale"], skip=inputs["skip"],
                          store_scaled_grads=True)
        assert torch.equal(grads, torch.full((8,), 0.25)) and torch.equal(q, torch.ones(8))
        assert s2.item() == 0
