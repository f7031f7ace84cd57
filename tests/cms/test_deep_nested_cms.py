"""CMS mode (use_cms_updates=True) of titanmac_c.DeepNestedOptimizer against the pure-PyTorch
reference, step by step over 250+ steps (crossing level-2 firings), both momentum networks,
cms_frequencies [1,10,100] and [1,5,50], with and without weight decay, with an injected NaN
gradient; and an exact resume from a checkpoint taken mid-period. The comparison and its
tolerances: tests/cms_checks.py.
"""

import copy
import math

import pytest
import torch

import titanmac_c
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer
from cms_checks import NAN_GRAD_STEP, cms_pair, cms_step, compare_cms, set_phase1_path
from conftest import (DEVICES, STATE_NMSE, RecordHostReads, assert_same_state,
                      checkpoint_roundtrip, sync_cms_from_reference)
from dno_models import loss_fn, make_mlp_10_32_5, synthetic_batches


def _deep_mlp(seed=0, hidden_layers=10):
    """10 -> 8 -> ... -> 5 with hidden_layers Linear(8, 8): 24 tensors by default, more than the
    20 that Phase 1 trains on and the 10 that the meta proxy loss samples."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(10, 8), torch.nn.ReLU()]
        for _ in range(hidden_layers):
            layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(8, 5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preprocessing", [True, False], ids=["direct", "legacy"])
@pytest.mark.parametrize("freqs", [[1, 10, 100], [1, 5, 50]], ids=["f1-10-100", "f1-5-50"])
@pytest.mark.parametrize("wd", [0.0, 0.01], ids=["wd0", "wd0.01"])
def test_cms_parity_250_steps(device, preprocessing, freqs, wd):
    _parity_250_steps(device, preprocessing, freqs, wd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preprocessing", [True, False], ids=["direct", "legacy"])
def test_a_float64_model_matches_the_reference_250_steps(device, preprocessing):
    """The reference trains float64 models with float32 buffers and a float32 update; only the
    accumulate (the float64 gradient added in double, rounded into the buffer) and the parameter
    step (in double) see float64, and ours computes those two the same way (tm_cms_math.h)."""
    model_o = _parity_250_steps(device, preprocessing, [1, 5, 50], 0.01, torch.float64)
    assert all(p.dtype == torch.float64 for p in model_o.parameters())


def _parity_250_steps(device, preprocessing, freqs, wd, dtype=torch.float32,
                      core_phase1=False):
    """Reference and ours over 250 steps, compared after each (the direct network resynced
    before each step, see cms_checks); returns our model. core_phase1: ours runs Phase 1 by the
    C core's path (TITANMAC_CUDA_PHASE1=core, set by the caller, on a CUDA model; set on
    CMSMode on a CPU model, which ignores the switch), and after each Phase 1 step the
    surrogate loss (1e-5 relative) and every MLP weight (1e-3 of the Adam step, lr 1e-3) are
    the reference's."""
    steps = 250
    (model_r, ref), (model_o, ours) = cms_pair(
        device, model=make_mlp_10_32_5(seed=0).to(dtype), cms_frequencies=freqs,
        use_preprocessing=preprocessing, weight_decay=wd, meta_update_freq=50)
    if core_phase1:
        if device == "cpu":
            set_phase1_path(ours, "core")
        assert ours._cms_mode.phase1_core and not ours._cms_mode.phase1_cpu_path
    batches = [{k: v.to(dtype) for k, v in batch.items()}
               for batch in synthetic_batches("mlp", steps, seed=7, device=device)]
    for step, batch in enumerate(batches, start=1):
        before = None
        if preprocessing:
            sync_cms_from_reference(ref, ours, model_r, model_o)
            before = [p.detach().clone() for p in model_r.parameters()]
        res_r = cms_step(model_r, ref, batch, step)
        res_o = cms_step(model_o, ours, batch, step)
        if step == NAN_GRAD_STEP:  # the clip norm is NaN: the whole step is skipped
            assert res_r.get("skipped") and float(ours.skipped) == 1.0
        else:
            assert set(res_o) == set(res_r), step
        compare_cms(ref, ours, model_r, model_o, step, before)
        if core_phase1 and step % ours.mlp_train_freq == 0:
            torch.testing.assert_close(res_o["surrogate_loss"], res_r["surrogate_loss"],
                                       rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")
            for (name, wr), wo in zip(ref.momentum_mlp.named_parameters(),
                                      ours.momentum_mlp.parameters()):
                torch.testing.assert_close(wo, wr, rtol=0, atol=1e-3 * 1e-3,
                                           msg=lambda m: f"step {step} {name}: {m}")
    return model_o


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("freqs", [[1, 10, 100], [1, 5, 50]], ids=["f1-10-100", "f1-5-50"])
def test_cms_parity_250_steps_with_the_core_phase1(monkeypatch, device, freqs):
    """TITANMAC_CUDA_PHASE1=core (on a CUDA model the switch itself; on a CPU model, which
    ignores it, the same path set on CMSMode): Phase 1 by the C core's op and its AdamW on the
    MLP's torch Adam, against the reference over 250 steps as test_cms_parity_250_steps (state
    resynced before each step), and after each Phase 1 step the surrogate loss (1e-5 relative)
    and every MLP weight (1e-3 of the Adam step, lr 1e-3) as the reference's. The NaN step
    is not a Phase 1 step, so the device-side skip (zero targets, where the reference does not
    train) is not reached here: test_a_skipped_phase1_step."""
    monkeypatch.setenv("TITANMAC_CUDA_PHASE1", "core")
    _parity_250_steps(device, True, freqs, 0.01, core_phase1=True)


def test_the_phase1_switch(monkeypatch):
    """TITANMAC_CUDA_PHASE1, read when the optimizer is built: unset, empty or "torch" keep
    CUDA's torch ops; "core" takes the C core's path on a CUDA model only (a CPU model's Phase
    1 is the C core's anyway, with torch's Adam as the reference's); any other value is refused
    by name, on every device, before anything is built."""
    def built(value):
        if value is None:
            monkeypatch.delenv("TITANMAC_CUDA_PHASE1", raising=False)
        else:
            monkeypatch.setenv("TITANMAC_CUDA_PHASE1", value)
        return titanmac_c.DeepNestedOptimizer(make_mlp_10_32_5(seed=0), use_cms_updates=True)

    for value in (None, "", "torch", "core", " Core "):
        cms = built(value)._cms_mode
        assert cms.phase1_cpu_path and not cms.phase1_core, value
    for value in ("cuda", "1", "C"):
        with pytest.raises(ValueError, match=rf"TITANMAC_CUDA_PHASE1='{value}': must be 'torch' "
                                             r"\(the default\) or 'core'"):
            built(value)
    from titanmac_c.deep_nested.phase1 import cuda_phase1_path
    monkeypatch.setenv("TITANMAC_CUDA_PHASE1", " Core ")
    assert cuda_phase1_path() == "core"


def _core_run(steps, fix=False, state=None, **kw):
    """The 10-32-5 MLP in CMS mode with Phase 1 on the core path, trained `steps` steps, from a
    state_dict when given; returns (model, optimizer)."""
    model = make_mlp_10_32_5(seed=0)
    torch.manual_seed(0)
    opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True, fix_reference_bugs=fix,
                                         **kw)
    set_phase1_path(opt, "core")
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(checkpoint_roundtrip(state[1]))
    for batch in synthetic_batches("mlp", steps, seed=9):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(loss.detach())
    return model, opt


def test_core_phase1_keeps_torchs_adam_and_its_checkpoints():
    """The core path steps mlp_optimizer (a torch.optim.Adam) through the C core on the Adam's
    own state: after three Phase 1 steps its state_dict is torch's (keys, step counts as CPU
    tensors, moments of the weights' shapes, the same param_groups) and within rounding of the
    torch path's (the same run with torch's Adam: 1e-6 relative); it loads into a
    torch.optim.Adam that steps on, and a checkpoint saved at step 10 and loaded into a new
    optimizer goes on as the uninterrupted run (step 20: every state entry bit for bit)."""
    _, opt = _core_run(15)
    model_t = make_mlp_10_32_5(seed=0)
    torch.manual_seed(0)
    opt_t = titanmac_c.DeepNestedOptimizer(model_t, use_cms_updates=True)
    set_phase1_path(opt_t, "torch")
    for batch in synthetic_batches("mlp", 15, seed=9):
        opt_t.zero_grad()
        loss = loss_fn(model_t, batch)
        loss.backward()
        opt_t.step(loss.detach())
    sd, sd_t = opt.mlp_optimizer.state_dict(), opt_t.mlp_optimizer.state_dict()
    assert sd["param_groups"] == sd_t["param_groups"]
    assert sd["state"].keys() == sd_t["state"].keys() == set(range(6))
    for k, entry in sd["state"].items():
        assert list(entry) == list(sd_t["state"][k]) == ["step", "exp_avg", "exp_avg_sq"]
        assert entry["step"].device.type == "cpu" and entry["step"].dtype == torch.float32
        assert float(entry["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(entry[key], sd_t["state"][k][key], rtol=1e-4,
                                       atol=1e-6 * float(sd_t["state"][k][key].abs().max()))
    adam = torch.optim.Adam([torch.nn.Parameter(w.detach().clone())
                             for w in opt.momentum_mlp.parameters()], lr=1e-3)
    adam.load_state_dict(checkpoint_roundtrip(sd))
    for p in adam.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    adam.step()
    assert float(adam.state_dict()["state"][0]["step"]) == 4.0

    full_model, full = _core_run(20)
    half_model, half = _core_run(10)
    saved = (copy.deepcopy(half_model.state_dict()), copy.deepcopy(half.state_dict()))
    model_b = make_mlp_10_32_5(seed=0)
    torch.manual_seed(0)
    resumed = titanmac_c.DeepNestedOptimizer(model_b, use_cms_updates=True)
    set_phase1_path(resumed, "core")
    model_b.load_state_dict(saved[0])
    resumed.load_state_dict(checkpoint_roundtrip(saved[1]))
    resumed._cms_mode.output_history = {  # not in checkpoints (the reference's either)
        i: o.clone() for i, o in half._cms_mode.output_history.items()}
    for batch in synthetic_batches("mlp", 20, seed=9)[10:]:
        resumed.zero_grad()
        loss = loss_fn(model_b, batch)
        loss.backward()
        resumed.step(loss.detach())
    assert_same_state(resumed.mlp_optimizer.state_dict(), full.mlp_optimizer.state_dict())
    for a, b in zip(model_b.parameters(), full_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("option,value,match", [
    ("weight_decay", 0.1,
     r"mlp_optimizer.param_groups\[0\]\['weight_decay'\] = 0.1: .*decoupled"),
    ("fused", True, r"mlp_optimizer.param_groups\[0\]\['fused'\] = True"),
    ("capturable", True, r"mlp_optimizer.param_groups\[0\]\['capturable'\] = True"),
    ("eps", -1.0, r"mlp_optimizer.param_groups\[0\]\['eps'\] = -1.0"),
])
def test_core_phase1_refuses_adam_options_it_cannot_take_writing_nothing(option, value, match):
    """mlp_optimizer options the C core's AdamW does not take (coupled weight decay; capturable,
    fused: step counts on the device) or a value it refuses: the Phase 1 step raises, named,
    and the step did not happen (the MLP, its Adam state and output history, the parameters,
    global_step as before); with the option put back, training goes on."""
    model, opt = _core_run(4)
    opt.zero_grad()
    loss = loss_fn(model, synthetic_batches("mlp", 5, seed=9)[4])
    loss.backward()
    kept = opt.mlp_optimizer.param_groups[0][option]
    opt.mlp_optimizer.param_groups[0][option] = value
    before = (_phase1_state(opt), [p.detach().clone() for p in model.parameters()],
              opt.global_step)
    with pytest.raises(ValueError, match=match):
        opt.step(loss.detach())
    _assert_same_phase1_state(_phase1_state(opt), before[0])
    for a, b in zip(model.parameters(), before[1]):
        assert torch.equal(a, b)
    assert opt.global_step == before[2] == 4
    opt.mlp_optimizer.param_groups[0][option] = kept
    opt.step(loss.detach())
    assert opt.global_step == 5 and float(opt.mlp_optimizer.state_dict()["state"][0]["step"]) == 1


@pytest.mark.parametrize("freqs", [[1, 10, 100], [1, 5, 50]], ids=["f1-10-100", "f1-5-50"])
def test_cms_direct_parity_without_resync_50_steps(freqs):
    (model_r, ref), (model_o, ours) = cms_pair("cpu", cms_frequencies=freqs, weight_decay=0.01,
                                            meta_update_freq=25)
    for step, batch in enumerate(synthetic_batches("mlp", 50, seed=7), start=1):
        cms_step(model_r, ref, batch, step)
        cms_step(model_o, ours, batch, step)
        compare_cms(ref, ours, model_r, model_o, step, elementwise=False)


def _phase1_steps(device, ours_setup, check, model=None):
    """15 steps from the reference's state (synced every step); after each Phase 1 step the
    surrogate loss against the reference's, and check(step, name, ours, ref) on the MLP's
    weights (6 tensors here)."""
    (model_r, ref), (model_o, ours) = cms_pair(device, model)
    ours_setup(ours)
    batches = synthetic_batches("mlp", 15, seed=3, device=device)
    for step, batch in enumerate(batches, start=1):
        sync_cms_from_reference(ref, ours, model_r, model_o)
        cms_step(model_r, ref, batch, step, inject=False)
        cms_step(model_o, ours, batch, step, inject=False)
        if step % ours.mlp_train_freq == 0:
            torch.testing.assert_close(ours._cms_mode.last_surrogate_loss, ref._last_surrogate_loss,
                                       rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")
            for (name, wr), wo in zip(ref.momentum_mlp.named_parameters(),
                                      ours.momentum_mlp.parameters()):
                check(step, name, wo, wr)


# How Phase 1 runs (cms_checks.set_phase1_path): the CPU's way (the C op, the skip flag read on
# the host), CUDA's default (torch ops, the skip applied on the device) and CUDA's with
# TITANMAC_CUDA_PHASE1=core (the C op and the C core's AdamW), the last two on the CPU too.
PHASE1_IMPLS = [
    pytest.param(("cpu", "cpu"), id="cpu-path"),
    pytest.param(("cpu", "torch"), id="cuda-path-on-cpu"),
    pytest.param(("cpu", "core"), id="core-path-on-cpu"),
    pytest.param(("cuda", "torch"), id="cuda", marks=DEVICES[1].marks),
    pytest.param(("cuda", "core"), id="cuda-core", marks=DEVICES[1].marks),
]


@pytest.mark.parametrize("model", ["mlp", "deep"], ids=["4-tensors", "24-tensors"])
@pytest.mark.parametrize("impl", PHASE1_IMPLS)
def test_phase1_trains_the_mlp_like_the_reference(impl, model):
    """Phase 1's gradient from the C core or from its algorithm in torch ops
    (tests/cms/test_cms_surrogate.py checks both against float64), the MLP's Adam step torch's
    or (core path) the C core's AdamW on the Adam's state: from the same state, each Phase 1
    step moves every MLP weight as the reference's does to 1e-3 of the step size (lr = 1e-3;
    measured <= 3e-5 of it: the gradients differ in rounding only). With 24 tensors it trains
    on the first 20, as the reference."""
    device, path = impl

    def check(step, name, wo, wr):
        torch.testing.assert_close(wo, wr, rtol=0, atol=1e-3 * 1e-3,
                                   msg=lambda m: f"step {step} momentum_mlp.{name}: {m}")
    _phase1_steps(device, lambda ours: set_phase1_path(ours, path), check,
                  model=_deep_mlp() if model == "deep" else None)


def test_reference_itself_is_this_sensitive():
    """Why sync_cms_from_reference exists: one MLP weight moved by 1 ulp makes the reference
    diverge from itself far beyond rounding within 100 steps."""
    model_a = make_mlp_10_32_5(seed=0)
    model_b = copy.deepcopy(model_a)
    a = ReferenceDeepNestedOptimizer(model_a, use_cms_updates=True, weight_decay=0.01)
    b = ReferenceDeepNestedOptimizer(model_b, use_cms_updates=True, weight_decay=0.01)
    b.controller.load_state_dict(a.controller.state_dict())
    b.momentum_mlp.load_state_dict(a.momentum_mlp.state_dict())
    with torch.no_grad():
        w = b.momentum_mlp.net[0].weight.view(-1)
        w[0] = torch.nextafter(w[0], torch.tensor(10.0))
    for step, batch in enumerate(synthetic_batches("mlp", 100, seed=7), start=1):
        cms_step(model_a, a, batch, step, inject=False)
        cms_step(model_b, b, batch, step, inject=False)
    ma = a.state[next(model_a.parameters())].levels[0].momentum.double()
    mb = b.state[next(model_b.parameters())].levels[0].momentum.double()
    assert float((ma - mb).pow(2).sum() / ma.pow(2).sum()) > 100 * STATE_NMSE


EDIT_STEP = 10  # a Phase 1 step (every 5)


def _phase1_state(opt):
    """What Phase 1 changes: the MLP's weights, its Adam state, the output history, the loss."""
    return ([w.detach().clone() for w in opt.momentum_mlp.parameters()],
            copy.deepcopy(opt.mlp_optimizer.state_dict()["state"]),
            {i: o.clone() for i, o in opt._cms_mode.output_history.items()},
            opt._cms_mode.last_surrogate_loss)


def _run_with_an_edited_step(impl, fix, edit, steps=20, **kw):
    """CMS mode with the DirectUpdateMLP on the 10-32-5 MLP; at step EDIT_STEP, edit(model,
    loss) may change the gradients and returns the loss given to step(). Returns the model, the
    optimizer, and the Phase 1 state before and after that step, its skip flag and the
    parameters after it."""
    device, path = impl
    model = make_mlp_10_32_5(seed=0).to(device)
    torch.manual_seed(0)  # the same networks in every run
    opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True, fix_reference_bugs=fix,
                                         **kw)
    set_phase1_path(opt, path)
    out = {}
    for step, batch in enumerate(synthetic_batches("mlp", steps, seed=9, device=device), start=1):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        loss = loss.detach()
        if step == EDIT_STEP:
            out["before"] = _phase1_state(opt)
            loss = edit(model, loss)
        opt.step(loss)
        if step == EDIT_STEP:
            out["after"] = _phase1_state(opt)
            out["skipped"] = float(opt.skipped)
            out["params"] = [p.detach().clone() for p in model.parameters()]
    return model, opt, out


def _assert_same_phase1_state(a, b):
    weights_a, adam_a, history_a, loss_a = a
    weights_b, adam_b, history_b, loss_b = b
    for x, y in zip(weights_a, weights_b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(adam_a, adam_b, rtol=0, atol=0)
    torch.testing.assert_close(history_a, history_b, rtol=0, atol=0)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)


def _assert_training_goes_on(model, opt, out):
    for w in opt.momentum_mlp.parameters():
        assert torch.isfinite(w).all()
    for p, at_edit in zip(model.parameters(), out["params"]):
        assert torch.isfinite(p).all() and not torch.equal(p, at_edit)


def _nan_in_first_gradient(model, loss):
    next(model.parameters()).grad.view(-1)[3] = math.nan
    return loss


def _nan_loss(model, loss):
    return torch.full_like(loss, math.nan)


def _zero_gradients(model, loss):
    for p in model.parameters():
        p.grad.zero_()
    return loss


@pytest.mark.parametrize("skip_by", [_nan_in_first_gradient, _nan_loss],
                         ids=["nan-gradient", "nan-loss-tensor"])
@pytest.mark.parametrize("fix", [False, True], ids=["reference-bugs", "fixed"])
@pytest.mark.parametrize("impl", PHASE1_IMPLS)
def test_a_skipped_phase1_step(impl, fix, skip_by):
    """A NaN gradient (the clip norm is NaN) or a NaN loss given as a tensor on a Phase 1 step:
    the step is skipped on the device. The CPU's way reads the skip flag on the host (free
    there) and, as the reference's guard, does not run Phase 1: the MLP, its Adam state, the
    output history and the surrogate loss are as before. CUDA's way cannot look: Phase 1 trains
    on zero targets, exactly as a run whose gradients are zero at that step (no skip there).
    With the fixes Phase 1's targets are the gradients: the NaN reaching them would turn the
    MLP's weights NaN for good, and a NaN loss would train on gradients the step refused. In
    every case training goes on afterwards."""
    model, opt, out = _run_with_an_edited_step(impl, fix, skip_by)
    assert out["skipped"] == 1.0
    if impl[1] == "cpu":
        _assert_same_phase1_state(out["after"], out["before"])
    else:
        _, _, zeros = _run_with_an_edited_step(impl, fix, _zero_gradients)
        assert zeros["skipped"] == 0.0
        _assert_same_phase1_state(out["after"], zeros["after"])
    _assert_training_goes_on(model, opt, out)


@pytest.mark.parametrize("net,path", [("direct", "torch"), ("direct", "core"), ("legacy", "torch")])
@pytest.mark.parametrize("fix", [False, True], ids=["reference-bugs", "fixed"])
def test_cuda_path_reads_nothing_back_checked_on_the_cpu(net, path, fix):
    """No host sync in a CMS step (a requirement of the CUDA path), watched without a GPU: CUDA's
    way of stepping, run on CPU tensors, executes no ATen op that would read a value back or copy
    host data in on CUDA (tests/deep_nested/test_deep_nested_cuda.py checks the real thing under
    sync debug mode "error" on a GPU). Steps 6-12, step 10 with Phase 1 for the DirectUpdateMLP. The
    C core's calls are not ATen ops: this watches the Python around them. Reads of the MLP Adam's
    step counts are allowed: torch keeps them on the CPU on CUDA too."""
    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True,
                                         use_preprocessing=net == "direct",
                                         fix_reference_bugs=fix, max_grad_norm=1.0,
                                         weight_decay=0.01, meta_update_freq=1000)
    set_phase1_path(opt, path)
    ops = {}
    for step, batch in enumerate(synthetic_batches("mlp", 12, seed=3), start=1):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        if step <= 5:
            opt.step(loss.detach())
            continue
        record = RecordHostReads(host_side=[s["step"] for s in opt.mlp_optimizer.state.values()]
                                 if opt.mlp_optimizer is not None else [])
        with record:
            opt.step(loss.detach())
        assert not record.host_reads, (step, record.host_reads)
        ops[step] = record.ops
    if net == "direct":  # the mode saw Phase 1 (tens of ops through the C core, hundreds
        # through torch's), or the check is void
        assert ops[10] > ops[9] + 10 and opt._cms_mode.last_surrogate_loss is not None, ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preprocessing", [True, False], ids=["direct", "legacy"])
def test_nan_gradient_without_clipping_skips_the_level_contribution(device, preprocessing):
    """With clipping off the NaN reaches the CMS update: the level contributions of that tensor
    are skipped (its level accumulators hold the NaN until they fire), the other tensors update
    normally; every step compared, NaN positions included (the direct network resynced)."""
    (model_r, ref), (model_o, ours) = cms_pair(device, max_grad_norm=0.0,
                                            use_preprocessing=preprocessing)
    batches = synthetic_batches("mlp", 45, seed=8, device=device)
    for step, batch in enumerate(batches, start=1):
        before = None
        if preprocessing:
            sync_cms_from_reference(ref, ours, model_r, model_o)
            before = [p.detach().clone() for p in model_r.parameters()]
        cms_step(model_r, ref, batch, step)
        cms_step(model_o, ours, batch, step)
        compare_cms(ref, ours, model_r, model_o, step, before)
        if step == NAN_GRAD_STEP:  # the NaN did reach the CMS state (until level 1 fires)
            poisoned = ours.state[next(model_o.parameters())].levels[1].accumulated_grad
            assert not torch.isfinite(poisoned).all()
    for po in model_o.parameters():
        assert torch.isfinite(po).all()


@pytest.mark.parametrize("model", ["mlp", "deep"], ids=["4-tensors", "24-tensors"])
@pytest.mark.parametrize("preprocessing", [True, False], ids=["direct", "legacy"])
def test_meta_proxy_loss_in_cms_mode(preprocessing, model):
    """Spec 9.3: from the 10th meta-update on, the meta loss adds the momentum network's proxy
    loss on the level-0 gradient EMA (the history holds meta_update_freq entries, so at least
    10). Meta-updates every 10 steps over 140: last_meta_loss and the controller (which the
    meta-update trains) against the reference's. With 24 tensors the proxy samples the first 5
    with a gradient of each group, at most 10."""
    (model_r, ref), (model_o, ours) = cms_pair("cpu", _deep_mlp() if model == "deep" else None,
                                            use_preprocessing=preprocessing,
                                            meta_update_freq=10, weight_decay=0.01)
    compared = 0
    for step, batch in enumerate(synthetic_batches("mlp", 140, seed=12), start=1):
        if preprocessing:
            sync_cms_from_reference(ref, ours, model_r, model_o)
        cms_step(model_r, ref, batch, step, inject=False)
        cms_step(model_o, ours, batch, step, inject=False)
        if step % 10 == 0:
            torch.testing.assert_close(ours.last_meta_loss, ref.last_meta_loss, rtol=1e-4,
                                       atol=1e-7, msg=lambda m: f"step {step}: {m}")
            for (name, wr), wo in zip(ref.controller.named_parameters(),
                                      ours.controller.parameters()):
                torch.testing.assert_close(wo, wr, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"step {step} controller.{name}: {m}")
            compared += len(ref.meta_trainer.loss_history) >= 10
    assert compared >= 4  # meta-updates with the proxy loss active


@pytest.mark.parametrize("preprocessing", [True, False], ids=["direct", "legacy"])
def test_resume_mid_period_is_bitwise(preprocessing):
    """state_dict at step 55 (between level-1 and level-2 firings), reload, continue: bitwise
    equal to the uninterrupted run, meta-updates (every 20 steps) and Phase 1 steps (every 5)
    included: the checkpoint holds their histories (the reference's does not)."""
    kw = dict(use_cms_updates=True, use_preprocessing=preprocessing, weight_decay=0.01,
              meta_update_freq=20)
    batches = synthetic_batches("mlp", 90, seed=9)
    model_a = make_mlp_10_32_5(seed=0)
    model_b = copy.deepcopy(model_a)
    full = titanmac_c.DeepNestedOptimizer(model_a, **kw)
    part = titanmac_c.DeepNestedOptimizer(model_b, **kw)
    part.controller.load_state_dict(full.controller.state_dict())
    part.momentum_mlp.load_state_dict(full.momentum_mlp.state_dict())
    for step, batch in enumerate(batches, start=1):
        cms_step(model_a, full, batch, step, inject=False)
        if step <= 55:
            cms_step(model_b, part, batch, step, inject=False)
    saved = checkpoint_roundtrip(part.state_dict())
    model_c = copy.deepcopy(model_b)
    resumed = titanmac_c.DeepNestedOptimizer(model_c, **kw)
    resumed.load_state_dict(saved)
    for step, batch in enumerate(batches[55:], start=56):
        cms_step(model_c, resumed, batch, step, inject=False)
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(pa, pc)
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        for la, lc in zip(full.state[pa].levels, resumed.state[pc].levels):
            for name in ("momentum", "accumulated_grad", "ema_grad"):
                assert torch.equal(getattr(la, name), getattr(lc, name)), name


def test_a_state_dict_loaded_in_memory_is_copied():
    """load_state_dict of another optimizer's state_dict() (no torch.save between): no tensor of
    the two optimizers is shared (torch's Optimizer.load_state_dict keeps tensors already on the
    right device, which would leave both stepping one Adam state of the MLP and the
    controller), so training the source further leaves the loaded one as loaded."""
    kw = dict(use_cms_updates=True, meta_update_freq=5)
    model_a = make_mlp_10_32_5(seed=0)
    model_b = copy.deepcopy(model_a)
    source = titanmac_c.DeepNestedOptimizer(model_a, **kw)
    loaded = titanmac_c.DeepNestedOptimizer(model_b, **kw)
    batches = synthetic_batches("mlp", 16, seed=2)
    for step, batch in enumerate(batches[:6], start=1):
        cms_step(model_a, source, batch, step, inject=False)
    loaded.load_state_dict(source.state_dict())
    as_loaded = checkpoint_roundtrip(loaded.state_dict())
    for step, batch in enumerate(batches[6:], start=7):  # Phase 1 and meta-updates at 10, 15
        cms_step(model_a, source, batch, step, inject=False)
    now = loaded.state_dict()
    for part in ("mlp_optimizer", "meta_optimizer"):
        assert as_loaded[part]["state"], part  # the check sees tensors
        torch.testing.assert_close(now[part]["state"], as_loaded[part]["state"], rtol=0, atol=0)


def test_checkpoints_load_both_ways_with_the_reference():
    (model_r, ref), (model_o, ours) = cms_pair("cpu", weight_decay=0.01)
    batches = synthetic_batches("mlp", 30, seed=10)
    for step, batch in enumerate(batches[:15], start=1):
        cms_step(model_r, ref, batch, step, inject=False)
    saved = ref.state_dict()
    model_o.load_state_dict(model_r.state_dict())
    ours.load_state_dict(checkpoint_roundtrip(saved))
    # not in checkpoints (the reference's either): carried over, keyed as ours keys it
    ours._cms_mode.output_history = {
        ours._cms.index[po]: ref._mlp_output_history[id(pr)].clone()
        for pr, po in zip(model_r.parameters(), model_o.parameters())
        if id(pr) in ref._mlp_output_history}
    for step, batch in enumerate(batches[15:], start=16):
        cms_step(model_r, ref, batch, step, inject=False)
        cms_step(model_o, ours, batch, step, inject=False)
        compare_cms(ref, ours, model_r, model_o, step)
    back = ReferenceDeepNestedOptimizer(copy.deepcopy(model_o), use_cms_updates=True)
    back.load_state_dict(checkpoint_roundtrip(ours.state_dict()))
    assert back.global_step == 30
    for p_back, p_ours in zip(back.model.parameters(), model_o.parameters()):
        for level, lvl in enumerate(back.state[p_back].levels):
            assert torch.equal(lvl.momentum, ours.state[p_ours].levels[level].momentum)


def test_an_older_checkpoint_without_ema_grad_and_v_sq_loads_them_as_zeros():
    """Checkpoints written before the reference kept ema_grad and v_sq lack them: they load as
    zeros, as in the reference, not as the values the buffers held before the load."""
    (model_r, ref), (model_o, ours) = cms_pair("cpu", weight_decay=0.01)
    batches = synthetic_batches("mlp", 8, seed=10)
    for step, batch in enumerate(batches[:3], start=1):
        cms_step(model_r, ref, batch, step, inject=False)
        cms_step(model_o, ours, batch, step, inject=False)
    old = checkpoint_roundtrip(ours.state_dict())
    for levels in old["cms_state"].values():
        for saved in levels.values():
            del saved["ema_grad"], saved["v_sq"]
    for step, batch in enumerate(batches[3:], start=4):
        cms_step(model_r, ref, batch, step, inject=False)
        cms_step(model_o, ours, batch, step, inject=False)
    assert any(bool(ours.state[p].levels[0].ema_grad.any()) for p in model_o.parameters())
    ref.load_state_dict(copy.deepcopy(old))
    ours.load_state_dict(copy.deepcopy(old))
    for pr, po in zip(model_r.parameters(), model_o.parameters()):
        for level, (lr_, lo) in enumerate(zip(ref.state[pr].levels, ours.state[po].levels)):
            for name in ("ema_grad", "v_sq", "momentum", "accumulated_grad"):
                assert torch.equal(getattr(lo, name), getattr(lr_, name)), (level, name)
            if level == 0:
                assert not lo.ema_grad.any()


def test_state_keeps_2k_plus_1_buffers_and_checkpoints_keep_the_reference_layout():
    """Of the reference's 4K full-size CMS buffers per tensor only m_l, A_l and e_0 are kept;
    state_dict() still has every key (the others as zeros), and the reference, loading it,
    continues exactly as ours does (legacy network: the two run in lockstep)."""
    kw = dict(use_preprocessing=False, weight_decay=0.01)
    (model_r, ref), (model_o, ours) = cms_pair("cpu", **kw)
    k = len(ours.cms_frequencies)
    numel = sum(p.numel() for p in model_o.parameters())
    kept = [t for name in ("momentum", "accumulated_grad", "ema_grad", "v_sq")
            for level in ours._cms.buffers[name] for t in level]
    assert sum(t.numel() for t in kept) == (2 * k + 1) * numel
    # optimizer.state shows the reference's layout; a buffer not kept reads as zeros and
    # refuses writes
    lvl = ours.state[next(model_o.parameters())].levels[1]
    assert not lvl.v_sq.any() and not lvl.ema_grad.any()
    with pytest.raises(RuntimeError):
        lvl.v_sq.add_(1.0)
    batches = synthetic_batches("mlp", 25, seed=11)
    for step, batch in enumerate(batches[:15], start=1):
        cms_step(model_o, ours, batch, step, inject=False)
    saved = checkpoint_roundtrip(ours.state_dict())
    grouped = [p for g in ours.base_optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(grouped):  # cms_state is indexed in group order
        for level in range(k):
            entry = saved["cms_state"][i][level]
            assert set(entry) == {"momentum", "step_count", "accumulated_grad", "ema_grad",
                                  "v_sq"}
            assert all(entry[name].shape == p.shape for name in entry if name != "step_count")
            assert not entry["v_sq"].any() and (level == 0 or not entry["ema_grad"].any())
    model_r.load_state_dict(model_o.state_dict())
    back = ReferenceDeepNestedOptimizer(model_r, use_cms_updates=True, **kw)
    back.load_state_dict(saved)
    for step, batch in enumerate(batches[15:], start=16):
        cms_step(model_r, back, batch, step, inject=False)
        cms_step(model_o, ours, batch, step, inject=False)
        compare_cms(back, ours, model_r, model_o, step)


@pytest.mark.parametrize("path", ["torch", "core"])
@pytest.mark.parametrize("fixes", [False, True])
def test_graph_mode_step_logic_with_simulated_replays(monkeypatch, fixes, path):
    """CUDA-graph mode's step logic on the CPU: GraphState._graph_of replaced by one that keeps the
    calls of a kind of step the first time (as a capture freezes the Python values it saw, t
    among them) and runs those on every replay. Covers the kinds of step and their keys, the
    Phase 1 step (torch ops: two graphs, statistics and control, Phase 1 eagerly, then Phase 2;
    TITANMAC_CUDA_PHASE1=core: one graph, Phase 1 and the MLP's Adam step captured between
    them, every step one replay), static gradients zeroed in place, base_lr through a tensor
    and a NaN loss on a Phase 1 step, against eager steps. Not covered: what only a real
    capture does (memory fixed at capture, Python side effects of the calls happening once)."""
    from titanmac_c.deep_nested.graph import GraphState

    replayed = []

    def graph_of(self, key, calls):
        kept = self.graphs.setdefault(key, calls)
        self.captured = True
        replayed.append((now[0], key))
        return kept

    now = [0]

    monkeypatch.setattr(GraphState, "_graph_of", graph_of)
    runs = []
    batches = synthetic_batches("mlp", 16, seed=5)
    for graph in (False, True):
        model = make_mlp_10_32_5()
        torch.manual_seed(0)  # the networks' initialisation
        opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True,
                                             fix_reference_bugs=fixes,
                                             cms_frequencies=[1, 3, 7],  # kinds of step
                                             cuda_graph_warmup_steps=2)
        set_phase1_path(opt, path)  # CUDA's Phase 1 (no host read of the skip)
        if graph:
            opt._graph = opt._graph_state()
        for step, batch in enumerate(batches, 1):
            now[0] = step
            opt.zero_grad(set_to_none=not graph)
            loss = loss_fn(model, batch)
            loss.backward()
            if step == 12:
                opt.base_lr = opt.base_lr * 0.5  # a schedule, through the base_lr tensor
            opt.step(loss.detach() * float("nan") if step == 10 else loss.detach())
        runs.append((model, opt))
    (model_e, eager), (model_g, graphed) = runs
    kinds = {key for _, key in replayed}
    heads = [step for step, key in replayed if key[0] == "head"]
    if path == "torch":
        assert {k for k in kinds if k[0] in ("head", "tail")} and len(kinds) >= 4, kinds
        assert heads == [5, 10, 15]
    else:
        assert not heads and len(kinds) >= 4, kinds
        assert [step for step, key in replayed if key[0] == "phase1"] == [5, 10, 15]
        steps = [step for step, _ in replayed]
        assert steps == sorted(set(steps)) == list(range(3, 17)), steps  # one replay a step
        for we, wg in zip(eager.mlp_optimizer.state_dict()["state"].values(),
                          graphed.mlp_optimizer.state_dict()["state"].values()):
            assert float(wg["step"]) == float(we["step"]) == 3.0 and wg["step"].device.type == "cpu"
        torch.testing.assert_close(graphed._cms_mode.last_surrogate_loss,
                                   eager._cms_mode.last_surrogate_loss, rtol=1e-6, atol=0)
        for w in graphed.momentum_mlp.parameters():  # the reference leaves the clipped gradient
            assert w.grad is not None and torch.isfinite(w.grad).all()
    assert graphed.global_step == eager.global_step == 16
    for pe, pg in zip(model_e.parameters(), model_g.parameters()):
        torch.testing.assert_close(pg, pe, rtol=1e-5, atol=1e-6)
    for we, wg in zip(eager.momentum_mlp.parameters(), graphed.momentum_mlp.parameters()):
        torch.testing.assert_close(wg, we, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed._control.lr, eager._control.lr)


def _host_numbers(opt):
    """What a capture of a step freezes besides t: the numbers its calls take from the host."""
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in opt.base_optimizer.param_groups]
    return opt.max_grad_norm, opt.weight_decay, opt.base_lr, groups


def _set_host_numbers(opt, numbers):
    opt.max_grad_norm, opt.weight_decay, opt.base_lr, groups = numbers
    for group, values in zip(opt.base_optimizer.param_groups, groups):
        group.update(values)


@pytest.mark.parametrize("mode", ["adamw", "cms", "cms_legacy"])
def test_graph_replays_see_the_numbers_of_their_step(monkeypatch, mode):
    """A CUDA graph replays the numbers its calls took from the host at the capture, t among
    them. Simulated replays on the CPU that do the same (each kind of step keeps its calls,
    which hold the t of the capture, with max_grad_norm, the weight decay, base_lr and the
    AdamW groups' hyperparameters as they were then, and runs them under those), against eager
    steps, with max_grad_norm changed at step 6, the weight decay at 8 (CMS mode:
    opt.weight_decay; AdamW mode: a group's), base_lr at 9, and in AdamW mode betas at 10 and
    eps at 12: parameters and state after every step as eager's, to the rounding of the
    graph's learning rates (mu, then times base_lr's tensor). A replay that kept the capture's
    values of all but base_lr fails this (a change of such a number must capture again, not
    only new addresses); the legacy network's context [t / 1000, base_lr, ...] reads t and
    base_lr from a device tensor, so a replay does not reuse the capture's t."""
    from titanmac_c.deep_nested.graph import GraphState

    captures = []
    owners = {}  # GraphState -> its optimizer

    def graph_of(self, key, calls):
        opt = owners[self]
        if key not in self.graphs:
            self.graphs[key] = (calls, copy.deepcopy(_host_numbers(opt)))
            captures.append(key)
        kept, frozen = self.graphs[key]
        self.captured = True

        def replay():
            live = _host_numbers(opt)
            _set_host_numbers(opt, frozen)
            try:
                kept()
            finally:
                _set_host_numbers(opt, live)
        return replay

    monkeypatch.setattr(GraphState, "_graph_of", graph_of)
    cms = mode != "adamw"
    changes = {6: lambda opt: setattr(opt, "max_grad_norm", 0.05),
               9: lambda opt: setattr(opt, "base_lr", opt.base_lr * 0.5)}
    if cms:
        changes[8] = lambda opt: setattr(opt, "weight_decay", 0.2)
    else:
        changes[8] = lambda opt: opt.base_optimizer.param_groups[1].update(weight_decay=0.2)
        changes[10] = lambda opt: opt.base_optimizer.param_groups[0].update(betas=(0.8, 0.99))
        changes[12] = lambda opt: opt.base_optimizer.param_groups[1].update(eps=1e-3)
    batches = synthetic_batches("mlp", 16, seed=9)
    models, opts = [], []
    for graph in (False, True):
        model = make_mlp_10_32_5()
        torch.manual_seed(0)
        opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=cms, cms_frequencies=[1, 3],
                                             use_preprocessing=mode != "cms_legacy",
                                             weight_decay=0.01, max_grad_norm=1.0,
                                             cuda_graph_warmup_steps=2)
        if cms:  # CUDA's Phase 1 (torch ops, no host read of the skip)
            opt._cms_mode.phase1_cpu_path = False
        if mode == "cms_legacy":  # its output layer starts at 0: make the context matter
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for w in opt.momentum_mlp.parameters():
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
        if graph:
            opt._graph = opt._graph_state()
            owners[opt._graph] = opt
        models.append(model)
        opts.append(opt)

    def close(got, want, where):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8,
                                   msg=lambda m: f"{where}: {m}")

    for step, batch in enumerate(batches, 1):
        for model, opt in zip(models, opts):
            if step in changes:
                changes[step](opt)
            opt.zero_grad(set_to_none=opt._graph is None)
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step(loss.detach())
        for (name, pe), pg in zip(models[0].named_parameters(), models[1].parameters()):
            close(pg, pe, f"step {step}: {name}")
            if cms:
                for level, (le, lg) in enumerate(zip(opts[0].state[pe].levels,
                                                     opts[1].state[pg].levels)):
                    close(lg.momentum, le.momentum, f"step {step}: {name} momentum[{level}]")
            else:
                for key in ("exp_avg", "exp_avg_sq"):
                    close(opts[1].base_optimizer.state[pg][key],
                          opts[0].base_optimizer.state[pe][key], f"step {step}: {name} {key}")
    assert opts[1]._graph.captured
    # each change captured the kinds of step again (one capture a kind, else)
    assert len(captures) > len(set(captures)), captures


def test_graph_mode_binds_the_gradients_of_the_parameters_it_steps(monkeypatch):
    """The graphs read each parameter's gradient from a static buffer that step() makes its
    .grad. AdamW mode over the CPU with simulated replays, against eager after every step: at
    step 3 (the first graph step) a parameter has no gradient (eager step; the next graph step
    binds the buffers: one bound as None made the next step fail), at step 6 a frozen model
    parameter is unfrozen and appended to a group (its gradient was left out of the buffers,
    which were paired with the parameters by zip), at step 10 it is taken out again (the
    buffers then paired with the wrong parameters, and every later step ran eagerly). After
    every graph step each grouped parameter's .grad is its buffer, and steps 4-14 were replayed
    (6 and 10 captured anew, on the new buffers)."""
    from titanmac_c.deep_nested.graph import GraphState

    replayed, now = [], [0]

    def graph_of(self, key, calls):
        kept = self.graphs.setdefault(key, calls)
        self.captured = True
        replayed.append(now[0])
        return kept

    monkeypatch.setattr(GraphState, "_graph_of", graph_of)
    batches = synthetic_batches("mlp", 14, seed=21)
    runs = []
    for graph in (False, True):
        model = make_mlp_10_32_5()
        model.extra = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5), requires_grad=False)
        torch.manual_seed(0)
        opt = titanmac_c.DeepNestedOptimizer(model, weight_decay=0.01, max_grad_norm=1.0,
                                             cuda_graph_warmup_steps=2)
        if graph:
            opt._graph = opt._graph_state()
        runs.append((model, opt))
    first = None
    for step, batch in enumerate(batches, 1):
        now[0] = step
        for model, opt in runs:
            group = opt.base_optimizer.param_groups[0]["params"]
            if step == 6:
                model.extra.requires_grad_(True)
                group.append(model.extra)
            if step == 10:
                del group[-1]
                model.extra.requires_grad_(False)
                model.extra.grad = None
            opt.zero_grad(set_to_none=opt._graph is None)
            loss = loss_fn(model, batch)
            if model.extra.requires_grad:
                loss = loss + (model.extra * model.extra).sum() * 0.1
            loss.backward()
            if step == 3:
                first = group[0]
                first.grad = None
            opt.step(loss.detach())
            if opt._graph is not None and replayed and replayed[-1] == step:
                grouped = [p for g in opt.base_optimizer.param_groups for p in g["params"]]
                assert len(opt._graph.static_grads) == len(grouped), step
                for p, buf in zip(grouped, opt._graph.static_grads):
                    assert p.grad is buf, f"step {step}: a .grad that is not its buffer"
        (model_e, eager), (model_g, graphed) = runs
        for (name, pe), pg in zip(model_e.named_parameters(), model_g.parameters()):
            torch.testing.assert_close(pg, pe, rtol=1e-6, atol=1e-8,
                                       msg=lambda m: f"step {step}: {name}: {m}")
    assert first is not None
    assert sorted(set(replayed)) == list(range(4, 15)), replayed
