"""_C.dno_control (tm_dno_control) against a pure-torch control step written here from the spec
(docs/deep_nested_optimizer.md sections 3-6 and 8; "spec N" below is a section of it). Its
argument checks are in
test_dno_control_errors.py, adamw_step's zero_grads_on_skip (the DNO's NaN guard) in
tests/adamw/test_adamw_zero_grads.py.

The reference below is the eager DeepNestedOptimizer's own arithmetic: a torch.nn.Linear/ReLU
stack, sigmoid, clamp, torch.where for the non-finite substitutions, Python floats for base_lr * mu
and for the EMA's scalars. Every result is compared element by element."""

import math

import pytest
import torch

from conftest import DEVICES
from titanmac_c import _C

CONTROLLERS = [(32, 2), (32, 5), (7, 1), (13, 3), (1024, 2)]  # (hidden H, hidden layers L);
# 13 and 1024: units summed in 8 lanes with a tail of 5 and without one
REL = dict(rtol=1e-6, atol=0)  # the controller's float32 sums are ordered differently in torch
F32 = torch.float32


# --------------------------------------------------------------- the pure-torch reference


def make_controller(hidden, layers, seed, bias_scale=0.1):
    """NestedController's layer stack (spec 4), Xavier weights and random (nonzero) biases."""
    gen = torch.Generator().manual_seed(seed)
    mods = [torch.nn.Linear(3, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 1))
    net = torch.nn.Sequential(*mods)
    with torch.no_grad():
        for m in net:
            if isinstance(m, torch.nn.Linear):
                bound = math.sqrt(6.0 / (m.in_features + m.out_features))
                m.weight.copy_((torch.rand(m.weight.shape, generator=gen) * 2 - 1) * bound)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * bias_scale)
    return net


def flat_weights(net, device):
    """W0, b0, (W_i, b_i) x (L - 1), W_out, b_out in the row-major [out, in] layout of Linear."""
    return [t.detach().to(device).contiguous() for m in net if isinstance(m, torch.nn.Linear)
            for t in (m.weight, m.bias)]


def controller_forward(net, S):
    """Spec 4 steps 1-5 (the reference's NestedController.forward)."""
    bad = ~torch.isfinite(S)
    any_bad = bad.any()
    clean = torch.where(bad, torch.ones_like(S), S)
    with torch.no_grad():
        raw = net(clean).squeeze(-1)
    mult = 0.1 + (2.0 - 0.1) * torch.sigmoid(raw)
    mult = torch.clamp(mult, 0.1, 2.0)
    ones = torch.ones_like(mult)
    mult = torch.where(torch.isfinite(mult), mult, ones)
    return torch.where(any_bad, ones, mult)


def reference_step(st, inp, net, *, update_controller, first_step, check_loss, base_lr,
                   max_grad_norm, ema_beta=0.1):
    """One control step on CPU float32 tensors: returns the new st (mu, ema) and the outputs."""
    mu, ema = st["mu"].clone(), st["ema"].clone()
    loss = float(inp["loss"])
    total = inp["total_grad"]
    if check_loss and not math.isfinite(loss):  # spec 5 step 3: only the skip flag changes
        coef, skip = torch.ones(1), torch.ones(1)
    else:
        if first_step:  # spec 3: ema starts at L_1, then ema <- 0.9 ema + 0.1 L
            ema = torch.full((2,), loss, dtype=F32)
        else:
            ema = (1.0 - ema_beta) * ema + ema_beta * loss
        if update_controller:
            depths = inp["depths"]
            S = torch.stack([inp["group_grad"], inp["group_param"], depths], dim=1)
            repl = torch.stack([torch.ones_like(depths), torch.ones_like(depths), depths], dim=1)
            mu = controller_forward(net, torch.where(torch.isfinite(S), S, repl))
        if max_grad_norm > 0:  # torch's clip_grad_norm_ coefficient, spec 8
            coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
            skip = torch.ones(1) if not math.isfinite(float(total)) else torch.zeros(1)
        else:
            coef, skip = torch.ones(1), torch.zeros(1)
    lr = torch.tensor([base_lr * m for m in mu.tolist()], dtype=F32)  # Python floats, as AdamW
    return {"mu": mu, "ema": ema}, {"lr": lr, "coef": coef, "skip": skip}


# --------------------------------------------------------------- running ours


def random_inputs(G, gen, param_scale=10.0):
    return {
        "group_grad": torch.rand(G, generator=gen) * 3.0 + 0.01,
        "group_param": torch.rand(G, generator=gen) * param_scale + 0.1,
        "total_grad": torch.rand(1, generator=gen) * 3.0 + 0.01,
        "depths": torch.rand(G, generator=gen),
        "loss": torch.rand(1, generator=gen) * 5.0,
    }


def run_ours(st, inp, weights, device, previous=False, **kw):
    """Our control step on device; st (CPU) is updated in place, outputs returned on the CPU
    (with previous, also the op's undo record)."""
    d = {k: v.to(device) for k, v in inp.items()}
    mu, ema = st["mu"].to(device), st["ema"].to(device)
    G = mu.numel()
    lr = torch.full((G,), -7.0, device=device)
    coef = torch.full((1,), -7.0, device=device)
    skip = torch.full((1,), -7.0, device=device)
    if previous:
        kw["previous"] = torch.full((2 * G + 4,), -9.0, device=device)
    _C.dno_control(d["group_grad"], d["group_param"], d["total_grad"], d["depths"], d["loss"],
                   weights, mu, ema, lr, coef, skip, **kw)
    st["mu"], st["ema"] = mu.cpu(), ema.cpu()
    out = {"lr": lr.cpu(), "coef": coef.cpu(), "skip": skip.cpu()}
    if previous:
        out["previous"] = kw["previous"].cpu()
    return out


def ctrl_kwargs(hidden, layers, **kw):
    base = dict(hidden=hidden, layers=layers, update_controller=True, first_step=False,
                check_loss=True, base_lr=1e-3, max_grad_norm=1.0)
    base.update(kw)
    return base


def ref_kwargs(kw):
    return {k: kw[k] for k in ("update_controller", "first_step", "check_loss", "base_lr",
                               "max_grad_norm")}


def assert_step(ours_st, ours_out, ref_st, ref_out, exact_state=False):
    for k in ("mu", "ema"):
        if exact_state:
            assert torch.equal(ours_st[k], ref_st[k]), k
        else:
            torch.testing.assert_close(ours_st[k], ref_st[k], **REL, equal_nan=True, msg=k)
    torch.testing.assert_close(ours_out["lr"], ref_out["lr"], **REL, equal_nan=True)
    torch.testing.assert_close(ours_out["coef"], ref_out["coef"], **REL, equal_nan=True)
    assert torch.equal(ours_out["skip"], ref_out["skip"])


def fresh_state(G):
    return {"mu": torch.ones(G), "ema": torch.zeros(2)}


# --------------------------------------------------------------- parity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden,layers", CONTROLLERS)
@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("param_scale", [2.0, 60.0])  # 60: a real model's norm, mu saturates
def test_steps_match_reference(device, hidden, layers, G, param_scale):
    net = make_controller(hidden, layers, seed=hidden * 10 + layers)
    weights = flat_weights(net, device)
    gen = torch.Generator().manual_seed(G)
    ours, ref = fresh_state(G), fresh_state(G)
    for t in range(1, 9):  # controller every 3 steps (F_c = 3) and on t == 1
        kw = ctrl_kwargs(hidden, layers, update_controller=t % 3 == 0 or t == 1,
                         first_step=t == 1, base_lr=3e-4 * t)
        inp = random_inputs(G, gen, param_scale)
        out = run_ours(ours, inp, weights, device, **kw)
        ref, ref_out = reference_step(ref, inp, net, **ref_kwargs(kw))
        assert_step(ours, out, ref, ref_out)
        ours = {k: ref[k].clone() for k in ref}  # next step from the same state


@pytest.mark.parametrize("device", DEVICES)
def test_ema_and_lr_use_the_reference_float_ops(device):
    """ema: float32 (0.9 * ema) + (float)(0.1 * L) (no FMA); lr: (float)(base_lr * mu) in
    double. Both are exact, so many random values must agree bit for bit."""
    G = 3
    net = make_controller(7, 1, seed=3)
    weights = flat_weights(net, device)
    gen = torch.Generator().manual_seed(5)
    for t in range(20):
        st = {"mu": torch.rand(G, generator=gen) * 1.9 + 0.1,
              "ema": torch.randn(1, generator=gen).repeat(2) * 10 ** (t % 7 - 3)}
        inp = random_inputs(G, gen)
        inp["loss"] = torch.randn(1, generator=gen) * 10 ** (t % 5 - 2)
        base_lr = 10 ** (-5 + 4 * torch.rand((), generator=gen).item())  # 1e-5 .. 1e-1
        kw = ctrl_kwargs(7, 1, update_controller=False, base_lr=base_lr)
        ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
        out = run_ours(st, inp, weights, device, **kw)
        assert torch.equal(st["ema"], ref["ema"]) and torch.equal(st["mu"], ref["mu"])
        assert torch.equal(out["lr"], ref_out["lr"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("G", [2, 3])
def test_previous_receives_mu_and_ema_from_before_the_call(device, G):
    """The optional undo record (the DeepNestedOptimizer restores its control state from it
    when a later call refuses the step): mu, ema, lr, coef and skip exactly as the call found
    them, on the first step, controller and other steps and a skipped one; the call's results
    are the same bits as without it."""
    net = make_controller(32, 2, seed=3)
    weights = flat_weights(net, device)
    gen = torch.Generator().manual_seed(5)
    with_record, without = fresh_state(G), fresh_state(G)
    for t in range(1, 8):
        kw = dict(update_controller=t % 3 == 0 or t == 1, first_step=t == 1, base_lr=1e-3)
        inp = random_inputs(G, gen)
        if t == 5:
            inp["loss"] = torch.tensor([math.nan])
        # lr, coef and skip as run_ours hands them to the op
        before = torch.cat([with_record["mu"], with_record["ema"], torch.full((G + 2,), -7.0)])
        out = run_ours(with_record, inp, weights, device, previous=True,
                       **ctrl_kwargs(32, 2, **kw))
        out_plain = run_ours(without, inp, weights, device, **ctrl_kwargs(32, 2, **kw))
        assert torch.equal(out.pop("previous"), before), t
        assert torch.equal(out["skip"], torch.tensor([1.0 if t == 5 else 0.0])), t
        for k in ("mu", "ema"):
            assert torch.equal(with_record[k], without[k]), (t, k)
        for k, v in out.items():
            assert torch.equal(v, out_plain[k]), (t, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_loss_skips_and_keeps_mu_and_ema(device, bad):
    net = make_controller(32, 2, seed=1)
    weights = flat_weights(net, device)
    st = {"mu": torch.tensor([0.5, 1.5]), "ema": torch.tensor([3.25, 3.25])}
    inp = random_inputs(2, torch.Generator().manual_seed(0))
    inp["loss"] = torch.tensor([bad])
    before = {k: v.clone() for k, v in st.items()}
    kw = ctrl_kwargs(32, 2, first_step=True, base_lr=2e-3)
    out = run_ours(st, inp, weights, device, **kw)
    assert torch.equal(st["mu"], before["mu"]) and torch.equal(st["ema"], before["ema"])
    assert out["skip"].item() == 1.0 and out["coef"].item() == 1.0
    assert torch.equal(out["lr"], torch.tensor([2e-3 * 0.5, 2e-3 * 1.5], dtype=F32))


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_loss_without_check_goes_into_the_ema(device):
    net = make_controller(7, 1, seed=2)
    weights = flat_weights(net, device)
    st = fresh_state(2)
    inp = random_inputs(2, torch.Generator().manual_seed(1))
    inp["loss"] = torch.tensor([math.nan])
    kw = ctrl_kwargs(7, 1, check_loss=False)
    ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
    out = run_ours(st, inp, weights, device, **kw)
    assert torch.isnan(st["ema"]).all()
    assert_step(st, out, ref, ref_out)
    assert out["skip"].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("column", ["group_grad", "group_param"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_group_norms_become_one(device, column, bad):
    net = make_controller(32, 5, seed=4)
    weights = flat_weights(net, device)
    inp = random_inputs(3, torch.Generator().manual_seed(2))
    inp[column][1] = bad
    kw = ctrl_kwargs(32, 5)
    st = fresh_state(3)
    ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
    out = run_ours(st, inp, weights, device, **kw)
    assert_step(st, out, ref, ref_out)
    # The same bits as passing 1.0 in its place.
    inp[column][1] = 1.0
    st_one = fresh_state(3)
    run_ours(st_one, inp, weights, device, **kw)
    assert torch.equal(st["mu"], st_one["mu"])


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_depth_sets_every_mu_to_one(device):
    net = make_controller(32, 2, seed=5)
    weights = flat_weights(net, device)
    inp = random_inputs(3, torch.Generator().manual_seed(3))
    inp["depths"][2] = math.nan
    kw = ctrl_kwargs(32, 2)
    st = fresh_state(3)
    ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
    out = run_ours(st, inp, weights, device, **kw)
    assert torch.equal(st["mu"], torch.ones(3))
    assert_step(st, out, ref, ref_out)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_controller_output_gives_one(device):
    net = make_controller(7, 1, seed=6)
    with torch.no_grad():  # units 3 and 4 are +inf (param norms are > 0); r = inf - inf = NaN
        net[0].weight[3:5, 1] = math.inf
        net[2].weight[0, 3:5] = torch.tensor([1.0, -1.0])
    weights = flat_weights(net, device)
    inp = random_inputs(2, torch.Generator().manual_seed(4))
    kw = ctrl_kwargs(7, 1)
    st = fresh_state(2)
    ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
    out = run_ours(st, inp, weights, device, **kw)
    assert torch.equal(st["mu"], torch.ones(2))
    assert_step(st, out, ref, ref_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_total_norm_skips_after_updating_mu_and_ema(device, bad):
    net = make_controller(32, 2, seed=7)
    weights = flat_weights(net, device)
    inp = random_inputs(2, torch.Generator().manual_seed(5))
    inp["total_grad"] = torch.tensor([bad])
    kw = ctrl_kwargs(32, 2, first_step=True)
    st = fresh_state(2)
    ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
    out = run_ours(st, inp, weights, device, **kw)
    assert out["skip"].item() == 1.0
    assert not torch.equal(st["mu"], torch.ones(2)) and st["ema"][0] == inp["loss"][0]
    assert_step(st, out, ref, ref_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [0.0, -1.0])
def test_no_clipping_means_coef_one_and_no_guard(device, max_grad_norm):
    net = make_controller(7, 1, seed=8)
    weights = flat_weights(net, device)
    for total in (math.nan, 123.0):
        inp = random_inputs(2, torch.Generator().manual_seed(6))
        inp["total_grad"] = torch.tensor([total])
        kw = ctrl_kwargs(7, 1, max_grad_norm=max_grad_norm)
        st = fresh_state(2)
        ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
        out = run_ours(st, inp, weights, device, **kw)
        assert out["coef"].item() == 1.0 and out["skip"].item() == 0.0
        assert_step(st, out, ref, ref_out)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_coefficient_matches_torch(device):
    net = make_controller(7, 1, seed=9)
    weights = flat_weights(net, device)
    for total in (0.0, 0.25, 0.999999, 1.0, 7.5, 1e30):
        inp = random_inputs(2, torch.Generator().manual_seed(7))
        inp["total_grad"] = torch.tensor([total])
        kw = ctrl_kwargs(7, 1, max_grad_norm=1.0, update_controller=False)
        st = fresh_state(2)
        ref, ref_out = reference_step(st, inp, net, **ref_kwargs(kw))
        out = run_ours(st, inp, weights, device, **kw)
        assert torch.equal(out["coef"], ref_out["coef"]), total
