"""CUDA-only behaviour: no host syncs in clip and step, CUDA-graph capture and replay, torch's
current (non-default) stream, a second GPU, CPU/CUDA parity, lists larger than one launch.

The parity tests of the other files run on CUDA too (their `device` parameter); these are the
properties that exist only on a GPU. Skipped without CUDA.
"""

import pytest
import torch

import titanmac_c
from conftest import CUDA, SIZES, clone_params, make_params, set_grads

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device or backend")]


def _step(opt, clip):
    if clip:
        opt.clip_grad_norm_(1.0)
    opt.step()


@pytest.mark.parametrize("clip", [False, True])
def test_no_host_sync_in_clip_and_step(clip):
    params = make_params(SIZES, "cuda")
    opt = titanmac_c.AdamW(params, lr=1e-3, weight_decay=0.01, amsgrad=True)
    set_grads(params, params, 0)
    _step(opt, clip)  # first step creates state and uploads the learning rate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            for p in params:
                p.grad.mul_(0.5)
            _step(opt, clip)
            titanmac_c.clip_grad_norm_(params, 1.0)
            titanmac_c.get_total_norm([p.grad for p in params])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("unscale", [False, True])
def test_grad_scaler_step_does_not_sync(unscale):
    """scaler.step(opt) + update() of AdamW(fused=True), with an overflowing step among them: no
    host read (GradScaler's ordinary path, which it takes without fused=True as for torch's
    default AdamW, reads the inf flag on the host every step)."""
    params = make_params(SIZES, "cuda")
    opt = titanmac_c.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    before = None
    for step in range(5):
        scaler.scale(torch.ones((), device="cuda"))
        set_grads(params, params, step, scale=1024.0)
        if step == 3:
            params[-1].grad.view(-1)[7] = float("inf")
            before = [p.detach().clone() for p in params]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else 0)  # the first creates the state
        try:
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if step == 3:
            assert all(torch.equal(b, p) for b, p in zip(before, params))
    assert scaler.get_scale() == 2.0 ** 9
    assert float(opt.state[params[0]]["step"]) == 4.0


def test_numbers_given_for_tensors_do_not_sync():
    """A total_norm given to AdamW.clip_grad_norm_ as a number, and a GradScaler found_inf that
    is a number (its sum of no flags), become device tensors by a fill, not by a copy from host
    memory (which waits for the GPU)."""
    params = make_params(SIZES, "cuda")
    opt = titanmac_c.AdamW(params, lr=1e-3)
    set_grads(params, params, 0)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.clip_grad_norm_(1.0, total_norm=3.5)
        opt.grad_scale, opt.found_inf = None, 0
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_scheduler_lr_changes_do_not_sync():
    params = make_params([1000, 3], "cuda")
    opt = titanmac_c.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    set_grads(params, params, 0)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            opt.step()
            sched.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("clip", [False, True])
def test_cuda_graph_capture_matches_eager(clip):
    """clip + step captured once in a CUDA graph and replayed 12 times equals 12 eager steps."""
    params_g = make_params(SIZES, "cuda")
    params_e = clone_params(params_g)
    opt_g = titanmac_c.AdamW(params_g, lr=1e-3, weight_decay=0.01)
    opt_e = titanmac_c.AdamW(params_e, lr=1e-3, weight_decay=0.01)
    set_grads(params_g, params_e, 0, scale=3.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs ask
        for _ in range(3):
            _step(opt_g, clip)
            _step(opt_e, clip)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(opt_g, clip)
    # Capture does not run the step: both sides are at 3 steps here.
    for step in range(12):
        gen = torch.Generator().manual_seed(step)
        for pg, pe in zip(params_g, params_e):
            g = (torch.randn(pg.shape, generator=gen) * 3.0).cuda()
            pg.grad.copy_(g)  # the graph reads the gradient buffers it was captured with
            pe.grad.copy_(g)
        graph.replay()
        _step(opt_e, clip)
    torch.cuda.synchronize()
    for pg, pe in zip(params_g, params_e):
        assert torch.equal(pg, pe)
        assert float(opt_g.state[pg]["step"]) == float(opt_e.state[pe]["step"]) == 15.0


def test_current_non_default_stream_is_used():
    params_a = make_params(SIZES, "cuda")
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, fused=True)
    stream = torch.cuda.Stream()
    for step in range(10):
        set_grads(params_a, params_b, step)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            titanmac_c.clip_grad_norm_(params_a, 0.5)
            ours.step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.nn.utils.clip_grad_norm_(params_b, 0.5)
        theirs.step()
    torch.cuda.synchronize()
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_second_gpu():
    params_a = make_params([5, 4097], "cuda:1")
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, fused=True)
    with torch.cuda.device(0):  # the current device differs from the tensors'
        for step in range(5):
            set_grads(params_a, params_b, step)
            ours.step()
            theirs.step()
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_cuda_parity_all_ops(dtype):
    """The same steps on the CPU backend and the CUDA backend agree element-wise (nvcc may
    contract into FMAs, so not bitwise)."""
    close = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-15)
    params_c = make_params(SIZES, "cpu", dtype)
    params_g = [torch.nn.Parameter(p.detach().cuda()) for p in params_c]
    opt_c = titanmac_c.AdamW(params_c, lr=1e-3, weight_decay=0.1, amsgrad=True)
    opt_g = titanmac_c.AdamW(params_g, lr=1e-3, weight_decay=0.1, amsgrad=True)
    for step in range(20):
        set_grads(params_c, params_g, step)
        nc = opt_c.clip_grad_norm_(1.0)
        ng = opt_g.clip_grad_norm_(1.0)
        assert ng.dtype == nc.dtype == dtype
        torch.testing.assert_close(ng.cpu(), nc, rtol=close["rtol"] / 10, atol=0)
        opt_c.step()
        opt_g.step()
    for a, b in zip(params_c, params_g):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), **close)
    gc = titanmac_c.group_norms([p.detach() for p in params_c], None, None, 1, 3.0)
    gg = titanmac_c.group_norms([p.detach() for p in params_g], None, None, 1, 3.0)
    torch.testing.assert_close(gg.total_grad.cpu(), gc.total_grad, rtol=close["rtol"] / 10,
                               atol=0)


@pytest.mark.parametrize("count", [130, 700, 1500])
def test_more_tensors_than_one_launch_holds(count):
    params_a = [torch.nn.Parameter(torch.randn(7 + i % 50, device="cuda")) for i in range(count)]
    params_b = clone_params(params_a)
    groups_a = [{"params": params_a[k::20], "lr": 1e-3 * (k + 1)} for k in range(20)]
    groups_b = [{"params": params_b[k::20], "lr": 1e-3 * (k + 1)} for k in range(20)]
    ours = titanmac_c.AdamW(groups_a, weight_decay=0.01)
    theirs = torch.optim.AdamW(groups_b, weight_decay=0.01, fused=True)
    for step in range(7):
        set_grads(params_a, params_b, step)
        na = titanmac_c.clip_grad_norm_(params_a, 1.0)
        nb = torch.nn.utils.clip_grad_norm_(params_b, 1.0)
        torch.testing.assert_close(na, nb, rtol=1e-5, atol=0)
        ours.step()
        theirs.step()
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_results_are_deterministic_run_to_run():
    grads = [torch.randn(n, device="cuda") for n in SIZES * 3]
    first = titanmac_c.group_norms(grads, grads, [i % 5 for i in range(len(grads))], 5)
    for _ in range(5):
        again = titanmac_c.group_norms(grads, grads, [i % 5 for i in range(len(grads))], 5)
        assert torch.equal(first.grad, again.grad) and torch.equal(first.param, again.param)
