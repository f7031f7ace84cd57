"""titanmac_c under torch.compile: the steps and clip functions run eagerly inside a compiled
function (a graph break around each: _runtime.eager_only), so a compiled training step computes
what the eager one computes, bumps the parameters' version counters (autograd's check against a
backward through a graph saved before the step), drops a pending clip coefficient when another
clip scales the gradients in place, and does not recompile as a scheduler changes the learning
rate. backend="aot_eager": Dynamo and AOTAutograd are tested (AOTAutograd is where a traced
version bump is lost), not inductor's code generation."""

import pytest
import torch

import titanmac_c
from dno_models import make_mlp_10_32_5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from nothing and leaves no compiled code behind, failed or not."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _data(steps):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 10, generator=gen), torch.randn(16, 5, generator=gen))
            for _ in range(steps)]


def _train(compiled, steps=12, second_clip=None):
    """AdamW with its folded clip and a cosine schedule; second_clip: an in-place clip of the
    gradients after the folded one (the pending coefficient then serves no gradient)."""
    torch.manual_seed(0)
    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = opt.clip_grad_norm_(0.05)
        if second_clip is not None:
            titanmac_c.clip_grad_norm_(model.parameters(), second_clip)
        opt.step()
        opt.zero_grad()
        return loss.detach(), norm

    step_fn = torch.compile(train_step, backend="aot_eager") if compiled else train_step
    results = []
    for x, y in _data(steps):
        results.append(step_fn(x, y))
        sched.step()
    return model, results


@pytest.mark.parametrize("second_clip", [None, 0.01], ids=["folded_clip", "then_in_place_clip"])
def test_a_compiled_training_step_computes_what_the_eager_one_does(second_clip):
    with torch._dynamo.config.patch(error_on_recompile=True):  # the lr changes every step
        model_c, results_c = _train(True, second_clip=second_clip)
    model_e, results_e = _train(False, second_clip=second_clip)
    for (loss_c, norm_c), (loss_e, norm_e) in zip(results_c, results_e):
        assert torch.equal(loss_c, loss_e) and torch.equal(norm_c, norm_e)
    for pc, pe in zip(model_c.parameters(), model_e.parameters()):
        assert torch.equal(pc, pe)


def test_a_compiled_step_bumps_the_parameters_versions_as_torch():
    """A backward through a graph that saved a weight before the step raises, as with torch's
    AdamW compiled or not (the C core's writes bypass autograd; the shim bumps the versions)."""
    lin = torch.nn.Linear(4, 4)
    opt = titanmac_c.AdamW(lin.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend="aot_eager")
    x = torch.randn(3, 4, requires_grad=True)
    lin(x).sum().backward()
    out = lin(x).pow(2).sum()  # saves lin.weight for d(out)/dx
    before = lin.weight._version
    step()
    assert lin.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@pytest.mark.parametrize("cms", [False, True], ids=["adamw_mode", "cms_mode"])
def test_a_compiled_deep_nested_step_computes_what_the_eager_one_does(cms):
    def train(compiled):
        torch.manual_seed(0)
        model = make_mlp_10_32_5(seed=0)
        opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=cms, meta_update_freq=4)

        def train_step(x, y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step(loss.detach())
            return loss.detach()

        step_fn = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        return model, [step_fn(x, y) for x, y in _data(10)]

    model_c, losses_c = train(True)
    model_e, losses_e = train(False)
    assert all(torch.equal(a, b) for a, b in zip(losses_c, losses_e))
    for pc, pe in zip(model_c.parameters(), model_e.parameters()):
        assert torch.equal(pc, pe)


def test_fullgraph_refuses_a_step_saying_why_and_writes_nothing():
    """fullgraph=True cannot hold a graph break: the error names the reason (the C core's writes
    are invisible to a trace), and the parameters and state are as before."""
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = titanmac_c.AdamW([p], lr=0.1)
    opt.step()
    before = (p.detach().clone(), opt.state[p]["exp_avg"].clone())
    for fn in (opt.step, lambda: opt.clip_grad_norm_(1.0),
               lambda: titanmac_c.clip_grad_norm_([p], 1.0)):
        with pytest.raises(Exception, match="C core writes tensors through DLPack"):
            torch.compile(fn, backend="aot_eager", fullgraph=True)()
    assert torch.equal(p.detach(), before[0]) and torch.equal(opt.state[p]["exp_avg"], before[1])
    assert float(opt.state[p]["step"]) == 1.0
