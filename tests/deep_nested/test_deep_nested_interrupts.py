"""A KeyboardInterrupt (any BaseException) raised inside a step before its update writes the
parameters leaves everything as before the step, as a refusal (an Exception) does: parameters,
gradients, AdamW and CMS state, global_step, the multipliers, the loss EMA, Phase 1's network,
its Adam state and its output history. One raised after the write leaves the whole step done
(the C core counts its completed calls, so the step tells which)."""

import copy
import sys

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import titanmac_c
from cms_checks import set_phase1_path
from conftest import assert_same_state
from dno_models import loss_fn, make_mlp_10_32_5, synthetic_batches
from interrupts import deep_copy_with_grads, sweep


def trained(kw, steps, prepare=None):
    """An optimizer after `steps` steps, with the next step's gradients in place, and that loss;
    prepare(opt) runs before the first step."""
    torch.manual_seed(0)
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=3e-3, **kw)
    if prepare is not None:
        prepare(opt)
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


def finish_as_uninterrupted(model, opt, loss, kw, steps):
    """The interrupted optimizer steps on as one that never saw the interrupt."""
    model_c, opt_c, loss_c = trained(kw, steps)
    for o, step_loss in ((opt, loss), (opt_c, loss_c)):
        o.step(step_loss)
    assert_same_state(everything(model, opt), everything(model_c, opt_c))


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
    assert_same_state(everything(model, opt), before)
    finish_as_uninterrupted(model, opt, loss, kw, 4)


def core_phase1(opt):
    """Phase 1 as TITANMAC_CUDA_PHASE1=core runs it on CUDA (the C op, the C core's AdamW)."""
    set_phase1_path(opt, "core")


@pytest.mark.parametrize("prepare", [None, core_phase1], ids=["cpu-path", "core-path"])
def test_an_interrupt_in_phase_1s_adam_step_changes_nothing(prepare):
    """torch's global optimizer pre-hooks run in Phase 1's Adam step of the DirectUpdateMLP (step
    5; on the core path around the C core's AdamW, as torch's step runs them): one that raises
    KeyboardInterrupt there, after the control op and the surrogate gradient, leaves the step
    undone, the multipliers, the loss EMA, the MLP, its Adam state and its output history
    included."""
    kw = {"use_cms_updates": True}
    model, opt, loss = trained(kw, 4, prepare)
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
    assert_same_state(everything(model, opt), before)
    assert_same_state(opt._cms_mode.output_history, history)
    if prepare is None:  # (the uninterrupted twin is built on the CPU's path)
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
    assert_same_state(everything(model, opt), before)


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
    assert_same_state(opt.state_dict()["state"], before[1]["state"])


# ------------------------------------------------------------------ at every point of a step


def dno_snapshot(pair):
    model, opt = pair
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()),
            [(w.detach().clone(), None if w.grad is None else w.grad.clone())
             for w in (*opt.momentum_mlp.parameters(), *opt.controller.parameters())],
            opt.global_step, opt.last_meta_loss is None)


@pytest.mark.parametrize("kw, steps", [
    ({}, 3),
    ({"use_cms_updates": True}, 4),  # the 5th step trains the DirectUpdateMLP (Phase 1)
    ({"use_cms_updates": True, "use_preprocessing": False}, 4),
    ({"max_grad_norm": 0.0, "controller_update_freq": 2}, 4),
    ({"use_cms_updates": True, "_prepare": core_phase1}, 4),
], ids=["adamw", "cms_direct_phase1", "cms_legacy", "no_clip_no_controller",
        "cms_direct_phase1_core"])
def test_an_interrupt_at_any_point_leaves_the_step_undone_or_done(kw, steps):
    """A KeyboardInterrupt at every line the step runs (as a signal handler or a hook raises
    it): before the update writes, everything is as before the step; once it wrote, the step is
    complete (its bookkeeping included), as an uninterrupted one leaves it. Never in between.
    (_prepare: how the optimizer is set up before its first step.)"""
    kw = dict(kw)
    model, opt, loss = trained(kw, steps, kw.pop("_prepare", None))
    before, after = sweep(lambda: deep_copy_with_grads((model, opt), model),
                          lambda pair: pair[1].step(loss), dno_snapshot)
    assert before > 100 and after > 10, (before, after)


def test_an_interrupt_in_a_meta_step_leaves_it_undone_and_the_step_done():
    """A step with a meta-update (every meta_update_freq steps): interrupted in the update
    before its write, nothing happened; after it, the step is taken and the meta-update is
    either whole or not at all (the networks, their Adam state and the meta trainer's
    histories as before it)."""
    kw = {"meta_update_freq": 4}
    model, opt, loss = trained(kw, 3)
    model_n, opt_n = deep_copy_with_grads((model, opt), model)
    opt_n.meta_update_freq = 10**6  # the same step without its meta-update
    opt_n.step(loss)
    opt_n.meta_update_freq = 4
    without_meta = dno_snapshot((model_n, opt_n))
    before, after = sweep(lambda: deep_copy_with_grads((model, opt), model),
                          lambda pair: pair[1].step(loss), dno_snapshot,
                          allowed_after=[without_meta])
    assert before > 100 and after > 100, (before, after)


@pytest.mark.parametrize("kw, steps", [
    ({}, 4),
    ({"use_cms_updates": True}, 4),  # the 5th step: head replay, Phase 1, tail replay
    ({"use_cms_updates": True}, 5),  # one replay
    ({"use_cms_updates": True, "_core": True}, 4),  # Phase 1 in the one replay
], ids=["adamw", "cms_phase1_two_replays", "cms_one_replay", "cms_phase1_one_replay_core"])
def test_a_graph_mode_step_interrupted_anywhere_is_undone_or_done(monkeypatch, kw, steps):
    """CUDA-graph mode's step (GraphState) on the CPU, its replays simulated (GraphState._graph_of
    keeps the calls of a kind of step and runs them at each replay, as
    tests/cms/test_deep_nested_cms.py does): an interrupt at any point leaves the step undone or
    done, the replays counted as the C core's calls are."""
    from titanmac_c.deep_nested.graph import GraphState

    def graph_of(self, key, calls):
        self.captured = True
        kept = self.graphs.setdefault(key, calls)

        def replay():  # one call, as a real replay: no line inside it is interrupted
            tracer = sys.gettrace()
            sys.settrace(None)
            try:
                kept()
            finally:
                sys.settrace(tracer)
        return replay

    monkeypatch.setattr(GraphState, "_graph_of", graph_of)

    kw = dict(kw)
    core = kw.pop("_core", False)

    def as_graph_mode(opt):
        if opt._cms_mode is not None:  # CUDA's Phase 1 (torch ops, or the C core's)
            set_phase1_path(opt, "core" if core else "torch")
        opt._graph = opt._graph_state()

    model, opt, loss = trained(dict(kw, cuda_graph_warmup_steps=2), steps, as_graph_mode)
    assert opt._graph.graphs, "no replay yet: the sweep would not be of a graph step"
    before, after = sweep(lambda: deep_copy_with_grads((model, opt), model),
                          lambda pair: pair[1].step(loss), dno_snapshot)
    assert before > 20 and after > 3, (before, after)
