"""The optimizer API: state_dict both ways with torch.optim.AdamW, param groups, the step
running in C (no per-parameter aten arithmetic)."""

import copy
import math
import gc
import io
import pickle
import weakref
from contextlib import nullcontext

import pytest
import torch

import titanmac_c
from conftest import DEVICES, SIZES, clone_params, make_params, set_grads, tol
from dno_models import loss_fn, make_mlp_10_32_5, synthetic_batches


def _train(opt, params, start, steps):
    for step in range(start, start + steps):
        set_grads(params, params, step)
        opt.step()


def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def test_param_group_keys_match_torch():
    p = [torch.nn.Parameter(torch.ones(2))]
    ours = titanmac_c.AdamW(p).param_groups[0]
    theirs = torch.optim.AdamW(clone_params(p)).param_groups[0]
    assert set(ours) == set(theirs)
    for key in theirs:
        if key != "params":
            assert ours[key] == theirs[key], key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_loads_both_ways_and_continues_identically(device, amsgrad, direction):
    """Train k steps with one implementation, save, load into the other, continue; compare with
    an uninterrupted run of the second implementation."""
    kinds = {"ours": titanmac_c.AdamW, "torch": torch.optim.AdamW}
    first, second = direction.split("_to_")
    kw = dict(lr=1e-2, weight_decay=0.01, amsgrad=amsgrad)
    params_1 = make_params(SIZES[:4], device, misaligned=False)
    initial = clone_params(params_1)
    params_ref = clone_params(params_1)
    opt_1 = kinds[first](params_1, **kw)
    _train(opt_1, params_1, 0, 5)
    ref = kinds[first](params_ref, **kw)
    _train(ref, params_ref, 0, 5)
    # Continue: the loaded optimizer vs the uninterrupted reference run, both as `second`.
    params_2 = clone_params(params_1)
    opt_2 = kinds[second](params_2, **kw)
    opt_2.load_state_dict(_roundtrip(opt_1.state_dict()))
    params_3 = clone_params(params_ref)
    opt_3 = kinds[second](params_3, **kw)
    opt_3.load_state_dict(_roundtrip(ref.state_dict()))
    _train(opt_2, params_2, 5, 10)
    _train(opt_3, params_3, 5, 10)
    for a, b in zip(params_2, params_3):
        assert torch.equal(a, b)
    for a in params_2:
        assert float(opt_2.state[a]["step"]) == 15.0
    # And the continuation agrees with an uninterrupted run of the other implementation.
    params_u = clone_params(initial)
    uninterrupted = kinds[second](params_u, **kw)
    _train(uninterrupted, params_u, 0, 15)
    for a, b in zip(params_2, params_u):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_resume_is_bitwise_identical():
    params = make_params(SIZES, "cpu", misaligned=False)
    full = clone_params(params)
    opt_full = titanmac_c.AdamW(full, lr=3e-3, weight_decay=0.1)
    _train(opt_full, full, 0, 12)
    part = clone_params(params)
    opt_part = titanmac_c.AdamW(part, lr=3e-3, weight_decay=0.1)
    _train(opt_part, part, 0, 6)
    saved = _roundtrip(opt_part.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in part]
    opt_resumed = titanmac_c.AdamW(resumed, lr=3e-3, weight_decay=0.1)
    opt_resumed.load_state_dict(saved)
    _train(opt_resumed, resumed, 6, 6)
    for a, b in zip(resumed, full):
        assert torch.equal(a, b)


def test_state_keys_and_step_tensor():
    p = torch.nn.Parameter(torch.ones(3))
    opt = titanmac_c.AdamW([p], amsgrad=True)
    p.grad = torch.ones(3)
    opt.step()
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0
    assert float(state["step"]) == 1.0


def test_old_checkpoint_with_python_number_step_loads():
    p = torch.nn.Parameter(torch.ones(3))
    theirs = torch.optim.AdamW([clone_params([p])[0]])
    sd = theirs.state_dict()
    sd["state"] = {0: {"step": 4, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}
    opt = titanmac_c.AdamW([p])
    opt.load_state_dict(sd)
    p.grad = torch.ones(3)
    opt.step()
    assert float(opt.state[p]["step"]) == 5.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("written", ["python_int", "cpu_float64", "one_element"])
def test_a_step_count_written_into_the_state_is_taken(device, written):
    """Code that writes optimizer.state itself may leave the step count as another kind of value
    (ZeroRedundancyOptimizer.load_state_dict moves 0-d state tensors to the CPU, where torch's
    AdamW keeps them): the next step takes it, as torch's does, and continues like torch's."""
    params = make_params([3, 4097], device, misaligned=False)
    theirs_params = clone_params(params)
    ours = titanmac_c.AdamW(params, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(6):
        set_grads(params, theirs_params, step)
        if step == 3:
            for p in params:
                count = float(ours.state[p]["step"])
                ours.state[p]["step"] = {"python_int": int(count),
                                         "cpu_float64": torch.tensor(count, dtype=torch.float64),
                                         "one_element": torch.tensor([count])}[written]
        ours.step()
        theirs.step()
    for p, q in zip(params, theirs_params):
        torch.testing.assert_close(p, q, **tol(torch.float32, device))
        assert float(ours.state[p]["step"]) == 6.0
        assert ours.state[p]["step"].device == p.device


def test_add_param_group_and_deepcopy():
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(2))
    opt = titanmac_c.AdamW([a], lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.2})
    a.grad, b.grad = torch.ones(4), torch.ones(2)
    opt.step()
    clone = copy.deepcopy(opt)
    assert len(clone.param_groups) == 2 and clone.param_groups[1]["lr"] == 0.2
    ref_a = torch.nn.Parameter(torch.ones(4))
    ref_b = torch.nn.Parameter(torch.ones(2))
    ref = torch.optim.AdamW([{"params": [ref_a], "lr": 0.1}, {"params": [ref_b], "lr": 0.2}])
    ref_a.grad, ref_b.grad = torch.ones(4), torch.ones(2)
    ref.step()
    assert torch.equal(a, ref_a) and torch.equal(b, ref_b)


def test_step_runs_in_c_no_aten_arithmetic():
    """torch.profiler sees no per-parameter aten arithmetic inside titanmac_c.AdamW.step(), while
    it does see it inside torch.optim.AdamW.step() (so the probe can fail)."""
    arithmetic = {"aten::add_", "aten::mul_", "aten::addcdiv_", "aten::addcmul_", "aten::lerp_",
                  "aten::sqrt", "aten::div_", "aten::div", "aten::mul", "aten::add", "aten::sub",
                  "aten::maximum", "aten::pow", "aten::_foreach_add_", "aten::_foreach_mul_",
                  "aten::_foreach_lerp_", "aten::_fused_adamw_", "aten::addcdiv", "aten::sqrt_"}

    def ops_in_step(cls, **kw):
        params = make_params([100, 200, 300], "cpu", misaligned=False)
        opt = cls(params, weight_decay=0.1, amsgrad=True, **kw)
        set_grads(params, params, 0)
        opt.step()  # state creation (zeros_like) happens here, outside the profiled step
        set_grads(params, params, 1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        return {e.name for e in prof.events()}

    ours = ops_in_step(titanmac_c.AdamW)
    assert not (ours & arithmetic), sorted(ours & arithmetic)
    theirs = ops_in_step(torch.optim.AdamW, foreach=False)
    assert theirs & arithmetic


def test_zero_grad_forgets_pending_clip():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    ours, ref = titanmac_c.AdamW([p], lr=0.1), titanmac_c.AdamW([q], lr=0.1)
    p.grad = torch.full((3,), 100.0)
    ours.clip_grad_norm_(0.001)
    ours.zero_grad()
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    ours.step()
    ref.step()
    assert torch.equal(p, q)


def _assert_models_match(pairs, step):
    """pairs: [(model, torch's AdamW), (model, ours)]: parameters and moments alike."""
    (model_t, opt_t), (model_o, opt_o) = pairs
    for (name, pt), po in zip(model_t.named_parameters(), model_o.parameters()):
        torch.testing.assert_close(po, pt, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"step {step} {name}: {m}")
        assert (po in opt_o.state) == (pt in opt_t.state)  # never stepped: no state in either
        for key in ("exp_avg", "exp_avg_sq") if pt in opt_t.state else ():
            torch.testing.assert_close(opt_o.state[po][key], opt_t.state[pt][key],
                                       rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("clear", ["model_zero_grad", "model_zero_grad_in_place",
                                   "grads_to_none", "grads_assigned", "bias_assigned",
                                   "weight_assigned", "bias_to_none"])
def test_a_pending_clip_goes_with_its_gradients_like_torchs(clear):
    """torch's clip scales the gradients in place, so its effect goes with them: clip, skip the
    step, clear the gradients some other way than the optimizer's zero_grad(), then a backward
    and a step: the new gradients are not clipped. Ours dropped the pending coefficient only in
    its own zero_grad() and applied the stale one (a batch skipped for its huge norm left a tiny
    coefficient on the next step). Several steps, first through the full path then the plan's.
    Some gradients replaced, the others kept: those stay clipped, as torch's do, and the new
    ones are not (ours watched only the first gradient and applied the stale coefficient to a
    new second one)."""
    pairs = []
    for cls in (torch.optim.AdamW, titanmac_c.AdamW):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        pairs.append((model, cls(model.parameters(), lr=0.1)))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for step in range(4):
        for kind, (model, opt) in enumerate(pairs):
            ((model(x) - 100 * y) ** 2).mean().backward()  # the batch to skip
            if kind == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            else:
                opt.clip_grad_norm_(0.01)
            if clear == "model_zero_grad":
                model.zero_grad()
            elif clear == "model_zero_grad_in_place":
                model.zero_grad(set_to_none=False)
            elif clear == "grads_to_none":
                for p in model.parameters():
                    p.grad = None
            elif clear == "bias_to_none":
                model.bias.grad = None
            if clear == "grads_assigned":
                for p in model.parameters():
                    p.grad = torch.full_like(p, 0.5)
            elif clear in ("bias_assigned", "weight_assigned"):
                p = model.bias if clear == "bias_assigned" else model.weight
                p.grad = torch.full_like(p, 0.5)
            elif clear != "bias_to_none":
                ((model(x) - y) ** 2).mean().backward()
            # zeroed in place: the same gradient objects changed, which ours cannot tell from an
            # accumulation (where its result differs from torch's), so it warns
            warns = kind == 1 and clear == "model_zero_grad_in_place"
            with pytest.warns(UserWarning, match="changed in place") if warns else nullcontext():
                opt.step()
            opt.zero_grad()
        _assert_models_match(pairs, step)


def _alive(refs):
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("clip", [False, True])
def test_no_gradient_or_dropped_state_kept_alive_between_steps(clip):
    """torch's optimizers keep no reference to a step's gradients, so zero_grad() frees them
    before the next backward; ours kept the last step's in its cached plan (a whole extra set of
    gradients held through the next backward), and old state tensors after state.clear()."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = titanmac_c.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 32)
    for step in range(4):  # the full path, then the plan's
        model(x).square().sum().backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        assert _alive(grads) == 0, f"step {step}: gradients kept alive"
    model(x).square().sum().backward()
    if clip:  # a pending coefficient whose gradients are dropped without a step
        opt.clip_grad_norm_(1.0)
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        model.zero_grad()
        assert _alive(grads) == 0, "clipped gradients kept alive"
        model(x).square().sum().backward()
    opt.step()
    state = [weakref.ref(t) for entry in opt.state.values() for t in entry.values()]
    opt.state.clear()
    assert _alive(state) == 0, "state tensors kept alive after state.clear()"


def test_a_pending_clip_survives_load_state_dict_as_torchs_clipped_gradients():
    """torch clips the gradients in place, so clip, reload a checkpoint, step uses the clipped
    ones; ours keeps the pending coefficient across the load (torch's load resets the caches)."""
    pairs = []
    for cls in (torch.optim.AdamW, titanmac_c.AdamW):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        pairs.append((model, cls(model.parameters(), lr=0.1)))
    x, y = torch.randn(16, 8), torch.randn(16, 4) * 100
    for step in range(4):
        for kind, (model, opt) in enumerate(pairs):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            if kind == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            else:
                opt.clip_grad_norm_(0.01)
            if step >= 2:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            opt.step()
        _assert_models_match(pairs, step)


def test_loading_does_not_alias_the_checkpoint():
    """torch's load_state_dict keeps step tensors by reference; ours copies them, so stepping
    never writes into the checkpoint or into another optimizer loaded from it."""
    params = make_params([4], "cpu", misaligned=False)
    opt = titanmac_c.AdamW(params)
    set_grads(params, params, 0)
    opt.step()
    saved = opt.state_dict()
    a = titanmac_c.AdamW(clone_params(params))
    b = titanmac_c.AdamW(clone_params(params))
    a.load_state_dict(saved)
    b.load_state_dict(saved)
    for opt_x in (a, b):
        p = opt_x.param_groups[0]["params"][0]
        p.grad = torch.ones(4)
        opt_x.step()
        assert float(opt_x.state[p]["step"]) == 2.0
    assert float(saved["state"][0]["step"]) == 1.0


def test_load_pre_hook_adapts_a_foreign_checkpoint_before_the_check():
    """torch's documented way to load a checkpoint of another layout is a load_state_dict
    pre-hook; ours checks the checkpoint as the hooks leave it, runs each hook once per load (as
    torch does) and keeps them registered."""
    calls = []

    def rename(opt, sd):
        calls.append(opt)
        for entry in sd["state"].values():
            entry["exp_avg"], entry["exp_avg_sq"] = entry.pop("m"), entry.pop("v")
        return sd

    def foreign():
        p = torch.nn.Parameter(torch.randn(6))
        t = torch.optim.AdamW([p], lr=0.01)
        p.grad = torch.randn(6)
        t.step()
        sd = copy.deepcopy(t.state_dict())
        for entry in sd["state"].values():
            entry["m"], entry["v"] = entry.pop("exp_avg"), entry.pop("exp_avg_sq")
        return t, sd

    for cls in (torch.optim.AdamW, titanmac_c.AdamW):
        t, sd = foreign()
        opt = cls([torch.nn.Parameter(torch.randn(6))], lr=0.01)
        opt.register_load_state_dict_pre_hook(rename)
        opt.load_state_dict(sd)
        (p,) = opt.param_groups[0]["params"]
        (pt,) = t.param_groups[0]["params"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], t.state[pt][key]), (cls, key)
        assert float(opt.state[p]["step"]) == 1.0
        opt.load_state_dict(foreign()[1])  # the hook is still there
    assert len(calls) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_writes_bump_version_counters_like_torch(device):
    """torch's in-place updates bump the version counter, so a backward through a graph that
    saved a parameter (or a gradient) before the step raises instead of using the new values.
    The C core writes through DLPack; the shim bumps the counters: the same error as torch's."""
    for make in (torch.optim.AdamW, titanmac_c.AdamW):
        w = torch.nn.Parameter(torch.randn(4, 3, device=device))
        x = torch.randn(2, 4, device=device, requires_grad=True)
        opt = make([w], lr=0.1)
        (x @ w).sum().backward()
        saved = (x @ w).pow(2).sum()  # saves w for its backward
        for _ in range(2):  # the full path, then the cached plan's
            before = w._version
            opt.step()
            assert w._version > before, make
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()
    for clip in (torch.nn.utils.clip_grad_norm_, titanmac_c.clip_grad_norm_):
        w = torch.nn.Parameter(torch.randn(5, device=device))
        w.grad = torch.full((5,), 3.0, device=device)
        before = w.grad._version
        clip([w], 1.0)
        assert w.grad._version > before, clip


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_the_c_core_writes_get_version_bumps(device):
    """The gradients the C core writes in place bump their version counters too, so a graph
    that saved one raises on backward instead of using the new values: those a GradScaler's
    scale divides as fused=True loads them (stored back unscaled), and those the
    DeepNestedOptimizer zeroes on a step its guard skips (a NaN gradient; the reference drops
    them, which needs the skip read on the host). The values: unscaled, and zero."""
    w = torch.nn.Parameter(torch.randn(4, 3, device=device))
    opt = titanmac_c.AdamW([w], lr=0.1, fused=True)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=1024.0)
    scaler.scale(torch.ones((), device=device))
    w.grad = torch.randn(4, 3, device=device) * 1024.0
    expected = w.grad / 1024.0
    x = torch.randn(4, 3, device=device, requires_grad=True)
    saved = (x * w.grad).sum()  # saves the gradient for x's backward
    before = w.grad._version
    scaler.step(opt)
    assert w.grad._version > before
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()

    model = make_mlp_10_32_5(seed=0).to(device)
    dno = titanmac_c.DeepNestedOptimizer(model)
    batch = next(iter(synthetic_batches("mlp", 1, seed=2, device=device)))
    loss_fn(model, batch).backward()
    grads = [p.grad for p in model.parameters()]
    grads[0].view(-1)[0] = math.nan
    versions = [g._version for g in grads]
    dno.step(1.0)
    assert float(dno.skipped) == 1.0
    for g, v in zip(grads, versions):
        assert g._version > v
        assert not g.any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_after_the_step_under_allow_mutation_on_saved_tensors_as_torch(device):
    """Under torch.autograd.graph.allow_mutation_on_saved_tensors(), torch clones a tensor saved
    for backward before an in-place op changes it, so a backward after the step takes the values
    of before it. It sees torch's ops, not the C core's writes: the shim lets it clone first.
    A weight saved by the forward, then the step (full path, then the cached plan's), the clip of
    a gradient a double-backward graph saved, and the backward: the same gradients as torch's."""
    results = []
    for make, clip in ((torch.optim.AdamW, torch.nn.utils.clip_grad_norm_),
                       (titanmac_c.AdamW, titanmac_c.clip_grad_norm_)):
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(device))
        x = torch.randn(2, 4, generator=gen).to(device).requires_grad_()
        opt = make([w], lr=0.5)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            out = (x @ w).pow(2).sum()
            grads = []
            for _ in range(2):
                w.grad = torch.ones_like(w)
                opt.step()
                grads.append(torch.autograd.grad(out, x, retain_graph=True)[0])
            g = torch.full((3,), 2.0, device=device, requires_grad=True)
            v = torch.nn.Parameter(torch.zeros(3, device=device))
            v.grad = g * 1.0
            saved_grad = (v.grad * g).sum()  # saves v.grad
            clip([v], 1.0)
            grads.append(torch.autograd.grad(saved_grad, g)[0])
        results.append((grads, w.detach().clone()))
    (ours, w_ours), (theirs, w_theirs) = results[1], results[0]
    w_start = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).to(device)
    assert not torch.equal(w_ours, w_start)  # the steps moved it
    torch.testing.assert_close(w_ours, w_theirs, rtol=1e-6, atol=1e-7)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_keyboard_interrupt_after_the_first_steps_write_keeps_the_state(device, monkeypatch):
    """Ctrl-C during a first step (a large model's takes a while): Python raises the
    KeyboardInterrupt at the first instruction after the C call returns, here made to happen in
    the version bump that follows it. The parameters are stepped; their new state must be there
    too (the step commits new state before its C calls, not after them), as torch's fused
    AdamW leaves both, so the next step (or a checkpoint in a signal handler) goes on from
    step 1 instead of restarting."""
    params_a = make_params(SIZES[:3], device, misaligned=False)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.01)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.01)
    real = titanmac_c.optim.adamw.mark_written

    def interrupted(*lists):
        monkeypatch.setattr(titanmac_c.optim.adamw, "mark_written", real)
        raise KeyboardInterrupt
    monkeypatch.setattr(titanmac_c.optim.adamw, "mark_written", interrupted)
    for step in range(3):
        set_grads(params_a, params_b, step)
        if step == 0:
            with pytest.raises(KeyboardInterrupt):
                ours.step()
        else:
            ours.step()
        theirs.step()
        for a, b in zip(params_a, params_b):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[a][key], theirs.state[b][key],
                                           **tol(torch.float32, device))
            torch.testing.assert_close(a, b, **tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_clip_coefficient_applies_to_the_next_step_only(device):
    """clip_grad_norm_ at steps 1 and 3 of 5 (gradients re-assigned each step, no zero_grad)
    matches torch's clip_grad_norm_ + AdamW after every step: a coefficient is used by the step
    after it, on the first full step and on later steps through the cached plan, and then dropped,
    where a leftover one would scale the next, unclipped, step."""
    params_a = make_params(SIZES[:4], device, misaligned=False)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.01)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.01)
    for step in range(5):
        set_grads(params_a, params_b, step)  # norm ~ sqrt(4356): clipped to 1
        if step in (0, 2):
            norm = ours.clip_grad_norm_(1.0)
            torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(params_b, 1.0),
                                       rtol=1e-6, atol=0)
        ours.step()
        theirs.step()
        for i, (a, b) in enumerate(zip(params_a, params_b)):
            torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(),
                                       **tol(torch.float32, device),
                                       msg=lambda m: f"step {step} params[{i}]: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[a][key].cpu(), theirs.state[b][key].cpu(),
                                           **tol(torch.float32, device),
                                           msg=lambda m: f"step {step} {key}[{i}]: {m}")


class _DictCopyingWrapper:
    """An optimizer wrapper as Lightning's LightningOptimizer and Fabric's optimizer build one:
    a subclass of the optimizer's class holding a shallow copy of its __dict__, whose step()
    calls the wrapped optimizer's; other methods (clip_grad_norm_, zero_grad) run on the
    wrapper itself."""

    def __init__(self, optimizer):
        self.__class__ = type("Wrapped" + type(optimizer).__name__,
                              (type(self), type(optimizer)), {})
        self.__dict__ = dict(optimizer.__dict__)
        self._wrapped = optimizer

    def step(self, closure=None):
        return self._wrapped.step(closure)


def test_a_clip_through_a_wrapper_that_copies_the_optimizers_dict_is_applied():
    """clip_grad_norm_ and zero_grad called on such a wrapper act on the wrapped optimizer's
    pending coefficient (such wrappers, e.g. Lightning's under manual optimization, would
    otherwise drop the folded clip and train unclipped), matching torch's clip + AdamW: clipped at
    steps 0, 1 (the cached plan's) and 3, at step 2 clipped then zeroed through the wrapper and
    given new gradients (unclipped, as torch's clipped ones are gone), and across a load of a
    checkpoint."""
    params_a = make_params(SIZES[:4], "cpu", misaligned=False)
    params_b = clone_params(params_a)
    # eps near the clipped gradients' size: Adam's update is then far from scale-invariant, so
    # an unclipped step lands far off
    inner = titanmac_c.AdamW(params_a, lr=1e-2, eps=1e-2, weight_decay=0.01)
    ours = _DictCopyingWrapper(inner)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, eps=1e-2, weight_decay=0.01)
    for step in range(5):
        set_grads(params_a, params_b, step)  # norm ~ sqrt(4356): clipped to 0.5
        if step != 4:
            ours.clip_grad_norm_(0.5)
            torch.nn.utils.clip_grad_norm_(params_b, 0.5)
        if step == 2:
            ours.zero_grad()
            theirs.zero_grad()
            set_grads(params_a, params_b, 10 + step)
        if step == 3:
            inner.load_state_dict(inner.state_dict())
        ours.step()
        theirs.step()
        for i, (a, b) in enumerate(zip(params_a, params_b)):
            torch.testing.assert_close(a, b, **tol(torch.float32, "cpu"),
                                       msg=lambda m: f"step {step} params[{i}]: {m}")


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_pickled_or_deep_copied_optimizer_keeps_stepping_like_torch(how):
    """A copy of a stepped optimizer (pickle round trip or copy.deepcopy, which rebuild it
    through __setstate__) steps its own copies of the parameters as torch's copied AdamW does;
    the original is not touched."""
    dup = (lambda o: pickle.loads(pickle.dumps(o))) if how == "pickle" else copy.deepcopy
    params_a = make_params([10, 255, 4097], "cpu", misaligned=False)
    params_b = clone_params(params_a)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "amsgrad": True}]
    ours = titanmac_c.AdamW(groups(params_a), lr=1e-2, weight_decay=0.05)
    theirs = torch.optim.AdamW(groups(params_b), lr=1e-2, weight_decay=0.05)
    _train(ours, params_a, 0, 3)
    _train(theirs, params_b, 0, 3)
    before = [p.detach().clone() for p in params_a]
    ours_2, theirs_2 = dup(ours), dup(theirs)
    copy_a = [p for g in ours_2.param_groups for p in g["params"]]
    copy_b = [p for g in theirs_2.param_groups for p in g["params"]]
    assert all(a is not b for a, b in zip(copy_a, params_a))
    for step in range(3, 5):
        set_grads(copy_a, copy_b, step)
        ours_2.step()
        theirs_2.step()
    for i, (a, b) in enumerate(zip(copy_a, copy_b)):
        torch.testing.assert_close(a, b, **tol(torch.float32, "cpu"),
                                   msg=lambda m: f"params[{i}]: {m}")
        for key in theirs_2.state[b]:
            torch.testing.assert_close(ours_2.state[a][key], theirs_2.state[b][key].float(),
                                       **tol(torch.float32, "cpu"),
                                       msg=lambda m: f"{key}[{i}]: {m}")
        assert float(ours_2.state[a]["step"]) == 5.0
    for p, b in zip(params_a, before):
        assert torch.equal(p.detach(), b)
        assert float(ours.state[p]["step"]) == 3.0
