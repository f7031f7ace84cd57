"""DeepNestedOptimizer on CUDA: no host sync inside step() (eager and graph mode, AdamW and CMS
mode, Phase 1 by torch ops or, with TITANMAC_CUDA_PHASE1=core, by the C core), graph mode matching
eager over 100 steps with zero_grad(set_to_none=True) between steps (and over 30 in CMS mode; with
the core Phase 1 captured, one replay a step), graph mode resuming after load_state_dict and
capturing again after the weights, the parameters or a number it takes from the host changed.
Skipped without CUDA."""

import copy

import pytest
import torch

import titanmac_c
from conftest import CUDA, assert_nmse_close
from dno_models import loss_fn, make_titanmac_like_model, synthetic_batches

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device or backend")]

KW = dict(weight_decay=0.01, max_grad_norm=1.0, mode="simple", meta_update_freq=1000,
          controller_update_freq=3)


def _model():
    return make_titanmac_like_model(seed=0).cuda()


def _train(model, opt, batches, set_to_none=True, nan_loss_at=None):
    """nan_loss_at: the step (1-based in batches) given a NaN loss tensor, which the device-side
    guard skips."""
    losses = []
    for step, batch in enumerate(batches, start=1):
        opt.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(model, batch)
        loss.backward()
        given = loss.detach()
        opt.step(given * float("nan") if step == nan_loss_at else given)
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("mode", ["adamw", "cms", "cms_fixed", "cms_legacy", "cms_core",
                                  "cms_core_fixed"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])  # memcheck: -k "not graph"
def test_step_makes_no_host_sync(monkeypatch, graph, mode):
    """Steps 6-12: in CMS mode with the DirectUpdateMLP step 10 also runs Phase 1 (the surrogate
    training, every 5; with the fixes on the current gradients; by torch ops between two graphs
    in graph mode, or with TITANMAC_CUDA_PHASE1=core by the C core, inside the step's one
    graph); in graph mode every step from the capture on is replayed, the legacy network's
    too (t and base_lr reach its context through a device tensor filled before the replay)."""
    monkeypatch.setenv("TITANMAC_CUDA_PHASE1", "core" if "core" in mode else "torch")
    model = _model()
    opt = titanmac_c.DeepNestedOptimizer(model, use_cuda_graph=graph, cuda_graph_warmup_steps=2,
                                         use_cms_updates=mode != "adamw",
                                         use_preprocessing=mode != "cms_legacy",
                                         fix_reference_bugs=mode.endswith("fixed"), **KW)
    if opt._cms_mode is not None:
        assert opt._cms_mode.phase1_core == ("core" in mode)
    batches = synthetic_batches("titanmac", 12, seed=0, device="cuda")
    _train(model, opt, batches[:5])  # warm-up (and capture, in graph mode)
    torch.cuda.synchronize()
    for batch in batches[5:]:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step(loss.detach())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert opt._graph is None or opt._graph.captured == graph
    if graph and "core" in mode:  # step 10's Phase 1 was captured, not run between two graphs
        kinds = {key[0] for key in opt._graph.graphs if isinstance(key[0], str)}
        assert kinds == {"phase1"}, kinds


def _eager_and_graph(steps, seed, nan_loss_at=None, mlp_scale=None, **kw):
    """The same model trained eagerly and in graph mode from the same networks; returns both
    models, both optimizers and both loss curves. The optimizer's kernels are the same in both
    modes; the backward's are not bitwise repeatable (the embedding's gradient adds with
    atomics), so torch's deterministic kernels are asked for where it has them, and the
    comparisons allow the last-bit drift of what remains."""
    model_e = _model()
    model_g = copy.deepcopy(model_e)
    eager = titanmac_c.DeepNestedOptimizer(model_e, **KW, **kw)
    graph = titanmac_c.DeepNestedOptimizer(model_g, use_cuda_graph=True, **KW, **kw)
    if mlp_scale is not None:  # random momentum-network weights (e.g. the legacy output layer
        gen = torch.Generator().manual_seed(seed)  # starts at 0: make its inputs matter)
        with torch.no_grad():
            for w in eager.momentum_mlp.parameters():
                w.copy_(torch.randn(w.shape, generator=gen).cuda() * mlp_scale)
    graph.controller.load_state_dict(eager.controller.state_dict())
    graph.momentum_mlp.load_state_dict(eager.momentum_mlp.state_dict())
    batches = synthetic_batches("titanmac", steps, seed=seed, device="cuda")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        losses_e = _train(model_e, eager, batches, nan_loss_at=nan_loss_at)
        losses_g = _train(model_g, graph, batches, nan_loss_at=nan_loss_at)
    finally:
        torch.use_deterministic_algorithms(False)
    assert graph._graph is not None and graph._graph.captured
    torch.testing.assert_close(losses_g, losses_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(model_g.parameters(), model_e.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return model_e, eager, model_g, graph


def _assert_mlp_close(graph, eager):
    """The DirectUpdateMLP's weights finite and within 1% of an Adam step (lr 1e-3) of
    eager's."""
    for (name, w_g), w_e in zip(graph.momentum_mlp.named_parameters(),
                                eager.momentum_mlp.parameters()):
        assert torch.isfinite(w_g).all()
        torch.testing.assert_close(w_g, w_e, rtol=0, atol=1e-5,
                                   msg=lambda m: f"momentum_mlp.{name}: {m}")


def _assert_momenta_close(model_g, graph, model_e, eager):
    """Every level's CMS momentum by normalized squared error (the backward's last-bit drift
    reaches the momenta through the sign feature)."""
    for (name, p_g), p_e in zip(model_g.named_parameters(), model_e.parameters()):
        for level, (l_g, l_e) in enumerate(zip(graph.state[p_g].levels,
                                               eager.state[p_e].levels)):
            assert_nmse_close(l_g.momentum, l_e.momentum, f"{name} momentum[{level}]")


def test_graph_mode_matches_eager_over_100_steps():
    model_e, eager, model_g, graph = _eager_and_graph(100, seed=2)
    torch.testing.assert_close(graph.get_lr_multipliers(), eager.get_lr_multipliers())
    for p_g, p_e in zip(model_g.parameters(), model_e.parameters()):
        assert float(graph.base_optimizer.state[p_g]["step"]) == 100.0
        assert float(eager.base_optimizer.state[p_e]["step"]) == 100.0


def test_graph_mode_resumes_after_load_state_dict():
    model_a = _model()
    model_b = copy.deepcopy(model_a)
    full = titanmac_c.DeepNestedOptimizer(model_a, use_cuda_graph=True, **KW)
    part = titanmac_c.DeepNestedOptimizer(model_b, use_cuda_graph=True, **KW)
    part.controller.load_state_dict(full.controller.state_dict())
    batches = synthetic_batches("titanmac", 30, seed=5, device="cuda")
    _train(model_a, full, batches)
    _train(model_b, part, batches[:15])
    saved = copy.deepcopy(part.state_dict())
    part.load_state_dict(saved)  # a reload in place: the captured graphs must be re-captured
    _train(model_b, part, batches[15:])
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_graph_mode_matches_eager_in_cms_mode():
    """CMS mode (DirectUpdateMLP, Phase 1 every 5 steps) captured and replayed after the warm-up
    against eager: losses and parameters element-wise, every level's momentum by normalized
    squared error (the backward's last-bit drift reaches the momenta through the sign feature:
    on an H100 one element of 196,608 was 4e-6 off after 30 steps)."""
    model_e, eager, model_g, graph = _eager_and_graph(30, seed=3, use_cms_updates=True)
    _assert_momenta_close(model_g, graph, model_e, eager)


def test_graph_mode_matches_eager_with_the_fixes_and_a_skipped_phase1_step():
    """With fix_reference_bugs=True Phase 1 trains on the current clipped gradients: in graph mode
    it runs between the replays of the statistics and control (which write the clip coefficient
    and the skip flag it reads) and of Phase 2. Step 10, a Phase 1 step after the capture, gets a
    NaN loss (skipped on the device: Phase 1 on zero targets in both modes). The MLP's weights
    within 1% of an Adam step (lr 1e-3) of eager's, besides what _eager_and_graph checks."""
    model_e, eager, model_g, graph = _eager_and_graph(30, seed=5, nan_loss_at=10,
                                                      use_cms_updates=True,
                                                      fix_reference_bugs=True)
    _assert_momenta_close(model_g, graph, model_e, eager)
    _assert_mlp_close(graph, eager)


@pytest.mark.parametrize("fix", [False, True], ids=["reference-bugs", "fixed"])
def test_graph_mode_with_the_core_phase1_matches_eager_one_replay_a_step(monkeypatch, fix):
    """TITANMAC_CUDA_PHASE1=core: CMS mode's Phase 1 by the C core (tm_cms_surrogate, the
    reference's clip, the MLP's Adam step by the C core's AdamW) captured with the rest of the
    step: after the warm-up every step is one replay, Phase 1 steps included, and the run
    matches an eager one with the same path (what _eager_and_graph checks; every momentum by
    normalized squared error; the MLP's weights within 1% of an Adam step; the Adam's step
    counts, kept on the CPU, 6 after 30 steps; the surrogate loss). With the fixes step 10, a
    Phase 1 step after the capture, gets a NaN loss (skipped on the device: Phase 1 on zero
    targets in both modes)."""
    from titanmac_c.deep_nested.graph import GraphState

    monkeypatch.setenv("TITANMAC_CUDA_PHASE1", "core")
    replays = []
    original = GraphState._replay

    def replay(self, key, calls, update=False):
        replays.append(key)
        return original(self, key, calls, update)

    monkeypatch.setattr(GraphState, "_replay", replay)
    model_e, eager, model_g, graph = _eager_and_graph(
        30, seed=5, nan_loss_at=10 if fix else None, use_cms_updates=True,
        fix_reference_bugs=fix, cuda_graph_warmup_steps=2)
    assert graph._cms_mode.phase1_core and eager._cms_mode.phase1_core
    assert len(replays) == 30 - 2, replays  # steps 3-30: one replay each
    assert sum(key[0] == "phase1" for key in replays) == 6  # steps 5, 10, ..., 30
    assert not any(key[0] in ("head", "tail") for key in replays)
    _assert_momenta_close(model_g, graph, model_e, eager)
    _assert_mlp_close(graph, eager)
    for s_g, s_e in zip(graph.mlp_optimizer.state_dict()["state"].values(),
                        eager.mlp_optimizer.state_dict()["state"].values()):
        assert s_g["step"].device.type == "cpu" and float(s_g["step"]) == float(s_e["step"]) == 6
    torch.testing.assert_close(graph._cms_mode.last_surrogate_loss,
                               eager._cms_mode.last_surrogate_loss, rtol=1e-4, atol=0)


def test_graph_mode_with_the_legacy_network_matches_eager():
    """use_cuda_graph=True with the legacy L2RegressionMomentum network (random weights, so its
    context [t / 1000, base_lr, ln(loss + 1)] moves its coefficients): captured, with t and
    base_lr read from a device tensor the step fills, over 24 steps (levels 0 and 1 firing),
    and the run matches an eager one."""
    model_e, eager, model_g, graph = _eager_and_graph(24, seed=4, mlp_scale=0.3,
                                                      use_cms_updates=True,
                                                      use_preprocessing=False)
    _assert_momenta_close(model_g, graph, model_e, eager)
    assert graph._graph.context is not None and float(graph._graph.context[0]) == 24.0


@pytest.mark.parametrize("relayout", [False, True], ids=["moved", "relaid-out"])
@pytest.mark.parametrize("mode", ["adamw", "cms"])
def test_graph_mode_recaptures_after_weights_and_parameters_move(mode, relayout):
    """A graph reads the controller's and the momentum network's weights and the parameters at
    the addresses it was captured with. Replacing the controller's Parameters
    (load_state_dict(..., assign=True)) and moving a parameter's storage (p.data = ...) after the
    capture: graph mode follows eager (it re-captures), and the parameter moved is updated.
    relayout: its new storage column-major (its state is moved into that layout before the
    re-capture, not by a copy inside it, which every replay would repeat)."""
    model_e = _model()
    model_g = copy.deepcopy(model_e)
    kw = dict(use_cms_updates=mode == "cms", cuda_graph_warmup_steps=2)
    eager = titanmac_c.DeepNestedOptimizer(model_e, **KW, **kw)
    graph = titanmac_c.DeepNestedOptimizer(model_g, use_cuda_graph=True, **KW, **kw)
    graph.controller.load_state_dict(eager.controller.state_dict())
    graph.momentum_mlp.load_state_dict(eager.momentum_mlp.state_dict())
    batches = synthetic_batches("titanmac", 16, seed=6, device="cuda")
    gen = torch.Generator().manual_seed(0)
    new = {k: (torch.randn(v.shape, generator=gen) * 0.3).cuda()
           for k, v in eager.controller.state_dict().items()}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for model, opt in ((model_e, eager), (model_g, graph)):
            _train(model, opt, batches[:6])
            opt.controller.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
            first = next(model.parameters())
            first.data = first.data.t().contiguous().t() if relayout else first.data.clone()
            _train(model, opt, batches[6:])
    finally:
        torch.use_deterministic_algorithms(False)
    assert graph._graph.captured
    torch.testing.assert_close(graph.get_lr_multipliers(), eager.get_lr_multipliers())
    for a, b in zip(model_g.parameters(), model_e.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["adamw", "cms", "cms_legacy"])
def test_graph_mode_recaptures_when_a_host_number_changes(mode, monkeypatch):
    """The numbers a capture takes from the host (max_grad_norm; the weight decay: CMS mode's,
    or an AdamW group's) changed after the capture, at steps 6 and 8 of 14, and base_lr halved
    at 9 (it reaches the graphs through a device tensor): graph mode captures the graphs again
    on real CUDA graphs and follows eager (test_graph_replays_see_the_numbers_of_their_step
    checks with simulated replays on the CPU that a replay keeping the capture's numbers would
    not). The legacy network with random weights, so that its context matters."""
    from titanmac_c.deep_nested.graph import GraphState

    captures = []
    capture = GraphState._graph_of

    def counted(self, key, calls):
        if key not in self.graphs:
            captures.append(key)
        return capture(self, key, calls)

    monkeypatch.setattr(GraphState, "_graph_of", counted)
    cms = mode != "adamw"
    model_e = _model()
    model_g = copy.deepcopy(model_e)
    kw = dict(use_cms_updates=cms, use_preprocessing=mode != "cms_legacy",
              cuda_graph_warmup_steps=2)
    eager = titanmac_c.DeepNestedOptimizer(model_e, **KW, **kw)
    graph = titanmac_c.DeepNestedOptimizer(model_g, use_cuda_graph=True, **KW, **kw)
    if mode == "cms_legacy":  # its output layer starts at 0
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for w in eager.momentum_mlp.parameters():
                w.copy_(torch.randn(w.shape, generator=gen).cuda() * 0.3)
    graph.controller.load_state_dict(eager.controller.state_dict())
    graph.momentum_mlp.load_state_dict(eager.momentum_mlp.state_dict())
    changes = {6: lambda opt: setattr(opt, "max_grad_norm", 0.05),
               9: lambda opt: setattr(opt, "base_lr", opt.base_lr * 0.5)}
    if cms:
        changes[8] = lambda opt: setattr(opt, "weight_decay", 0.2)
    else:
        changes[8] = lambda opt: opt.base_optimizer.param_groups[-1].update(weight_decay=0.2)
    batches = synthetic_batches("titanmac", 14, seed=7, device="cuda")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for model, opt in ((model_e, eager), (model_g, graph)):
            for step, batch in enumerate(batches, start=1):
                if step in changes:
                    changes[step](opt)
                _train(model, opt, [batch])
    finally:
        torch.use_deterministic_algorithms(False)
    assert graph._graph.captured
    assert len(captures) > len(set(captures)), f"no kind of step captured again: {captures}"
    torch.testing.assert_close(graph.get_lr_multipliers(), eager.get_lr_multipliers())
    for a, b in zip(model_g.parameters(), model_e.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if cms:
        _assert_momenta_close(model_g, graph, model_e, eager)
