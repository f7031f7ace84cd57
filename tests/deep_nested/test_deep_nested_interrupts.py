"""A KeyboardInterrupt (any BaseException) raised inside a step before its update writes the
parameters leaves everything as before the step, as a refusal (an Exception) does: parameters,
gradients, AdamW and CMS state, global_step, the multipliers, the loss EMA, Phase 1's network,
its Adam state and its output history."""

import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import titanmac_c
from dno_models import loss_fn, make_mlp_10_32_5, synthetic_batches


def trained(kw, steps):
    """An optimizer after `steps` steps, with the next step's gradients in place, and that loss."""
    torch.manual_seed(0)
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=3e-3, **kw)
    batches = synthetic_batches("mlp", steps + 1, seed=1)
    for batch in batches[:steps]:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(loss.detach())
    opt.zero_grad()
    loss = loss_fn(model, batches[steps])
    loss.backward()
    return model, opt, loss.detach()


def everything(model, opt):
    """What a step may change, copied: parameters, gradients, the whole state_dict (histories
    included), Phase 1's network and its gradients."""
    return ([p.detach().clone() for p in model.parameters()],
            [p.grad.clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()),
            [(w.detach().clone(), None if w.grad is None else w.grad.clone())
             for w in opt.momentum_mlp.parameters()],
            opt.global_step)


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def finish_as_uninterrupted(model, opt, loss, kw, steps):
    """The interrupted optimizer steps on as one that never saw the interrupt."""
    model_c, opt_c, loss_c = trained(kw, steps)
    for m, o, l in ((model, opt, loss), (model_c, opt_c, loss_c)):
        o.step(l)
    assert_same(everything(model, opt), everything(model_c, opt_c))


class InterruptingLoss:
    """A loss whose value cannot be read: float() raises KeyboardInterrupt."""

    def __float__(self):
        raise KeyboardInterrupt


MODES = [{}, {"use_cms_updates": True}, {"use_cms_updates": True, "use_preprocessing": False}]
MODE_IDS = ["adamw", "cms_direct", "cms_legacy"]


@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_an_interrupt_reading_the_loss_changes_nothing(kw):
    model, opt, loss = trained(kw, 4)
    before = everything(model, opt)
    with pytest.raises(KeyboardInterrupt):
        opt.step(InterruptingLoss())
    assert_same(everything(model, opt), before)
    finish_as_uninterrupted(model, opt, loss, kw, 4)


def test_an_interrupt_in_phase_1s_adam_step_changes_nothing():
    """torch's global optimizer pre-hooks run in Phase 1's Adam step of the DirectUpdateMLP (step
    5): one that raises KeyboardInterrupt there, after the control op and the surrogate
    gradient, leaves the step undone, the multipliers, the loss EMA, the MLP, its Adam state
    and its output history included."""
    kw = {"use_cms_updates": True}
    model, opt, loss = trained(kw, 4)
    before = everything(model, opt)
    history = {i: t.clone() for i, t in opt._cms_mode.output_history.items()}
    seen = []

    def interrupt(optimizer, args, kwargs):
        if optimizer is opt.mlp_optimizer:
            seen.append(optimizer)
            raise KeyboardInterrupt

    handle = register_optimizer_step_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.step(loss)
    finally:
        handle.remove()
    assert seen, "Phase 1 did not run"
    assert_same(everything(model, opt), before)
    assert_same(opt._cms_mode.output_history, history)
    finish_as_uninterrupted(model, opt, loss, kw, 4)


def test_an_interrupt_from_a_hook_on_the_optimizer_changes_nothing():
    """The optimizer is a torch Optimizer: its step pre-hooks run before the step."""
    model, opt, loss = trained({}, 3)
    before = everything(model, opt)

    def interrupt(optimizer, args, kwargs):
        raise KeyboardInterrupt

    handle = opt.register_step_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.step(loss)
    handle.remove()
    assert_same(everything(model, opt), before)


def test_adamw_an_interrupt_reading_a_learning_rate_changes_nothing():
    """A group's lr read at the step (a scheduler's object) whose float() raises: no state is
    made and no parameter moves."""
    class Rate:
        def __float__(self):
            raise KeyboardInterrupt

    p = torch.nn.Parameter(torch.randn(5))
    opt = titanmac_c.AdamW([p], lr=0.1)
    p.grad = torch.randn(5)
    opt.step()
    before = (p.detach().clone(), copy.deepcopy(opt.state_dict()))
    opt.param_groups[0]["lr"] = Rate()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert torch.equal(p, before[0])
    assert_same(opt.state_dict()["state"], before[1]["state"])
