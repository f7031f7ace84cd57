"""The DeepNestedOptimizer as a torch.optim.Optimizer: torch's LR schedulers on it (or on its
base_optimizer) drive base_lr, checked against the reference with its base_lr set by hand at
every step; step(closure); hooks; checkpoints that carry the scheduled rate; pickles."""

import copy
import io
import math

import pytest
import torch

import titanmac_c
from conftest import reference_and_ours
from dno_models import loss_fn, make_mlp_10_32_5, synthetic_batches

BASE_LR = 3e-3
STEPS = 12

SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=3 * BASE_LR, total_steps=STEPS, cycle_momentum=False),
    "warmup_then_cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)], milestones=[4]),
}


def schedule_values(make_scheduler, steps=STEPS):
    """The lr a scheduler gives a plain torch optimizer before each of `steps` steps."""
    plain = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE_LR)
    sched = make_scheduler(plain)
    values = []
    for _ in range(steps):
        values.append(plain.param_groups[0]["lr"])
        plain.step()
        sched.step()
    return values


def train(model, opt, batches, before_step=None, after_step=None):
    losses = []
    for t, batch in enumerate(batches):
        if before_step is not None:
            before_step(t)
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(loss.detach())
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(t)
    return losses


def test_it_is_a_torch_optimizer_over_its_base_optimizers_groups():
    opt = titanmac_c.DeepNestedOptimizer(make_mlp_10_32_5(), base_lr=BASE_LR)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.base_optimizer.param_groups
    assert [g["lr"] for g in opt.param_groups] == [BASE_LR, BASE_LR]
    opt.base_lr = 1e-4
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 1e-4] and opt.base_lr == 1e-4
    with pytest.raises(ValueError, match="add_param_group: its groups are the model's core"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert "DeepNestedOptimizer" in repr(opt)


@pytest.mark.parametrize("on", ["optimizer", "base_optimizer"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_torch_scheduler_drives_base_lr_as_the_reference_given_it_by_hand(name, on):
    """A scheduler attached to the optimizer (or to its base_optimizer: the same groups) sets
    base_lr at every step: the losses and parameters are the reference's with its base_lr
    assigned the scheduler's value before each step."""
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(), base_lr=BASE_LR)
    values = schedule_values(SCHEDULERS[name])
    assert len(set(values)) > 3  # the schedule moves
    batches = synthetic_batches("mlp", STEPS, seed=4)

    def set_by_hand(t):
        ref.base_lr = values[t]

    ref_losses = train(model_r, ref, batches, before_step=set_by_hand)
    sched = SCHEDULERS[name](ours if on == "optimizer" else ours.base_optimizer)
    seen = []

    def record(t):
        seen.append(ours.get_effective_lrs())
        sched.step()

    ours_losses = train(model_o, ours, batches, after_step=record)
    assert ours_losses == pytest.approx(ref_losses, rel=1e-5)
    for a, b in zip(model_o.parameters(), model_r.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the rates each step used: the scheduled base_lr times the multipliers
    for t, lrs in enumerate(seen):
        if values[t] == 0.0:  # the cosine's end: rates 0
            assert lrs == [0.0, 0.0]
            continue
        mus = [lr / values[t] for lr in lrs]
        assert all(0.1 - 1e-6 <= mu <= 2.0 + 1e-6 for mu in mus), (t, mus)


def test_groups_given_different_rates_are_refused_before_anything_changes():
    """One base learning rate scales both groups' multipliers: a scheduler that gives the groups
    different rates (a lambda each) is refused at the step it takes effect, naming the groups,
    with nothing stepped."""
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=BASE_LR)
    torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: 0.5])
    batch = synthetic_batches("mlp", 1, seed=1)[0]
    loss = loss_fn(model, batch)
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] = 0.0015 differs from "
                                         r"param_groups\[0\]\['lr'\] = 0.003"):
        opt.step(loss.detach())
    assert opt.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_step_with_a_closure_steps_with_the_loss_it_returns():
    """step(closure), positionally or by keyword (Lightning's call): the closure runs with grad
    enabled, its loss drives the step exactly as step(loss) does, and step returns it."""
    runs = []
    for how in ("loss", "closure", "closure_keyword"):
        model = make_mlp_10_32_5()
        torch.manual_seed(7)
        opt = titanmac_c.DeepNestedOptimizer(model, base_lr=BASE_LR)
        returned = []
        for batch in synthetic_batches("mlp", 6, seed=5):
            def closure():
                opt.zero_grad()
                loss = loss_fn(model, batch)
                loss.backward()
                return loss
            if how == "loss":
                with torch.enable_grad():
                    loss = closure()
                opt.step(loss.detach())
                returned.append(loss)
            else:
                with torch.no_grad():  # the closure still records its graph
                    out = opt.step(closure) if how == "closure" else opt.step(closure=closure)
                assert isinstance(out, torch.Tensor)
                returned.append(out)
        runs.append(([float(v) for v in returned], [p.detach().clone() for p in model.parameters()],
                     opt.ema_loss.clone()))
    for losses, params, ema in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(params, runs[0][1]))
        assert torch.equal(ema, runs[0][2]) and float(ema.sum()) > 0
    with pytest.raises(TypeError, match="a loss or a closure, not both"):
        opt.step(1.0, closure=lambda: 1.0)


def test_step_hooks_on_the_optimizer_run_around_its_step():
    opt = titanmac_c.DeepNestedOptimizer(model := make_mlp_10_32_5(), base_lr=BASE_LR)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o.global_step)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o.global_step)))
    loss = loss_fn(model, synthetic_batches("mlp", 1)[0])
    loss.backward()
    opt.step(loss.detach())
    assert calls == [("pre", 0), ("post", 1)]


def resume_run(make_scheduler, interrupt_at=None):
    """STEPS steps under a scheduler; with interrupt_at, a checkpoint of model, optimizer and
    scheduler is taken there and loaded into fresh ones that finish the run."""
    torch.manual_seed(3)
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=BASE_LR)
    sched = make_scheduler(opt)
    batches = synthetic_batches("mlp", STEPS, seed=6)
    for t, batch in enumerate(batches):
        if t == interrupt_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            torch.manual_seed(99)  # the fresh networks start elsewhere: the load sets them
            model = make_mlp_10_32_5(seed=1)
            model.load_state_dict(saved["model"])
            opt = titanmac_c.DeepNestedOptimizer(model, base_lr=BASE_LR)
            sched = make_scheduler(opt)
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(loss.detach())
        sched.step()
    return [p.detach() for p in model.parameters()], opt


@pytest.mark.parametrize("name", ["cosine", "warmup_then_cosine"])
def test_a_resume_carries_the_scheduled_rate_and_is_bitwise(name):
    """The checkpoint holds the groups' base learning rate (base_lrs: the saved groups hold
    base_lr * mu_g, as the reference's), so a run resumed from it, scheduler included, is the
    uninterrupted run, bit for bit."""
    whole, whole_opt = resume_run(SCHEDULERS[name])
    resumed, resumed_opt = resume_run(SCHEDULERS[name], interrupt_at=5)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    assert resumed_opt.base_lr == whole_opt.base_lr


def test_a_reference_checkpoint_keeps_the_current_base_lr():
    """The reference's checkpoint holds no base learning rate (its groups hold base_lr * mu_g):
    loading it leaves ours at its current base_lr, as the reference's load keeps its own."""
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(), base_lr=BASE_LR)
    train(model_r, ref, synthetic_batches("mlp", 3, seed=2))
    saved = ref.state_dict()
    assert "base_lrs" not in saved
    assert saved["base_optimizer"]["param_groups"][0]["lr"] != BASE_LR
    ours.base_lr = 1e-4
    ours.load_state_dict(saved)
    assert [g["lr"] for g in ours.param_groups] == [1e-4, 1e-4]
    assert ours.global_step == 3


@pytest.mark.parametrize("bad", [[1e-3], [1e-3, math.nan], [1e-3, -1.0], "lr", [1e-3, None]])
def test_a_checkpoint_with_bad_base_lrs_is_refused_before_anything_changes(bad):
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=BASE_LR)
    train(model, opt, synthetic_batches("mlp", 2, seed=2))
    saved = copy.deepcopy(opt.state_dict())
    saved["base_lrs"] = bad
    saved["global_step"] = 50
    with pytest.raises(ValueError, match=r"state_dict\['base_lrs'\]"):
        opt.load_state_dict(saved)
    assert opt.global_step == 2 and opt.base_lr == BASE_LR


def test_pickles_and_deep_copies_with_a_scheduler_attached():
    """A scheduler wraps the optimizer's step on the instance (a closure, which pickle cannot
    take): copies leave it out and step on as the original does, hooks and all."""
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=BASE_LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    train(model, opt, synthetic_batches("mlp", 2, seed=2), after_step=lambda t: sched.step())
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    copies = [torch.load(buf, weights_only=False), copy.deepcopy((model, opt))]
    batches = synthetic_batches("mlp", 3, seed=8)
    train(model, opt, batches)
    for model_c, opt_c in copies:
        assert isinstance(opt_c, torch.optim.Optimizer)
        assert opt_c.base_lr == sched.get_last_lr()[0] != BASE_LR
        train(model_c, opt_c, batches)
        assert all(torch.equal(a, b) for a, b in zip(model_c.parameters(), model.parameters()))
