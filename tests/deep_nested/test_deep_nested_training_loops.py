"""The DeepNestedOptimizer in the loops frameworks run: a step() without arguments (Hugging Face
Trainer's, accelerate's wrapper) takes the loss the model's last training forward returned; the
schedulers those frameworks build by default drive it (a Trainer-like loop and an accelerate-like
wrapper, checked against the plain loop that hands the loss over)."""

import copy
import io
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import titanmac_c
from dno_models import make_mlp_10_32_5, synthetic_batches


class ModelOutput(OrderedDict):
    """Hugging Face's ModelOutput in brief: a dict whose entries are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class WithLoss(torch.nn.Module):
    """A model that computes its loss when given labels, as Hugging Face models do."""

    def __init__(self, output="mapping"):
        super().__init__()
        self.net = make_mlp_10_32_5()
        self.output = output

    def forward(self, x, y=None):
        out = self.net(x)
        loss = None if y is None else F.mse_loss(out, y)
        if self.output == "mapping":
            return ModelOutput(loss=loss, logits=out) if loss is not None else \
                ModelOutput(logits=out)
        return type("Out", (), {"loss": loss, "logits": out})()


def run(model, opt, batches, hand_over, sched=None):
    """Training steps; hand_over: step(loss) (the plain loop), else step() as Trainer calls it."""
    for batch in batches:
        opt.zero_grad()
        loss = model(batch["x"], batch["y"]).loss
        loss.backward()
        if hand_over:
            opt.step(loss.detach())
        else:
            opt.step()
        if sched is not None:
            sched.step()
    ema = getattr(opt, "optimizer", opt).ema_loss  # (through a wrapper)
    return [p.detach().clone() for p in model.parameters()], ema.clone()


def fresh(output="mapping", **kw):
    torch.manual_seed(0)
    model = WithLoss(output)
    return model, titanmac_c.DeepNestedOptimizer(model, base_lr=3e-3, **kw)


@pytest.mark.parametrize("output", ["mapping", "attribute"])
@pytest.mark.parametrize("kw", [{}, {"use_cms_updates": True}, {"meta_update_freq": 3}],
                         ids=["adamw", "cms", "meta"])
def test_step_without_a_loss_takes_the_models_loss_as_a_step_given_it(output, kw):
    batches = synthetic_batches("mlp", 7, seed=2)
    handed = run(*fresh(output, **kw), batches, hand_over=True)
    taken = run(*fresh(output, **kw), batches, hand_over=False)
    for a, b in zip(handed[0], taken[0]):
        assert torch.equal(a, b)
    assert torch.equal(handed[1], taken[1]) and float(handed[1].sum()) > 0


def test_only_a_training_forward_gives_the_loss_and_each_serves_one_step():
    """An evaluation forward under no_grad does not replace the training forward's loss; a step
    forgets the forward's loss, so a second step() without a forward warns and takes 0.0 as the
    reference's; a loss handed over wins."""
    model, opt = fresh()
    batch, other = synthetic_batches("mlp", 2, seed=3)
    loss = model(batch["x"], batch["y"]).loss
    loss.backward()
    with torch.no_grad():
        model(other["x"], other["y"] * 100)  # evaluation
    opt.step()
    # the EMA starts from the first loss (spec 5: ema = loss at step 1)
    torch.testing.assert_close(opt.ema_loss, loss.detach().expand(2), rtol=0, atol=0)
    with pytest.warns(UserWarning, match="without a loss value; using 0.0"):
        opt.step()
    model(batch["x"], batch["y"])
    opt.step(5.0)
    assert opt._model_loss.loss is None


def test_a_model_without_a_loss_in_its_output_steps_with_the_references_warning():
    torch.manual_seed(0)
    model = make_mlp_10_32_5()
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=3e-3)
    model(torch.randn(4, 10)).sum().backward()
    with pytest.warns(UserWarning, match="without a loss value; using 0.0"):
        opt.step()


def test_copies_of_the_model_do_not_feed_the_optimizer():
    """deepcopy and pickle of the model copy the hook without the optimizer: a copy's forward
    gives the optimizer no loss."""
    model, opt = fresh()
    batch = synthetic_batches("mlp", 1, seed=4)[0]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        copied(batch["x"], batch["y"])
        assert opt._model_loss.loss is None


def test_the_hook_costs_a_compiled_model_no_graph_break():
    """torch.compile traces the model's forward hooks with its forward: ours adds no graph break
    (and the compiled forward's loss reaches the step)."""
    batch = synthetic_batches("mlp", 1, seed=4)[0]
    counts = []
    for hooked in (False, True):
        model, opt = fresh()
        if not hooked:
            model._forward_hooks.clear()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(batch["x"], batch["y"])
        counts.append(explained.graph_break_count)
    assert counts[1] == counts[0], counts
    assert opt._model_loss.loss is not None


def test_a_trainer_like_loop_with_its_default_scheduler_and_an_accelerate_like_wrapper():
    """What Hugging Face Trainer does around the optimizer, without the framework: its default
    scheduler (get_scheduler("linear"): a LambdaLR with warm-up and linear decay) built on the
    optimizer itself, a wrapper that passes step(closure=None) on as accelerate's does, step()
    without a loss, the scheduler stepped after. The same run as the plain loop that hands the
    loss over and sets base_lr by hand."""
    warmup, total = 3, 10

    def linear(t):
        return t / warmup if t < warmup else max(0.0, (total - t) / (total - warmup))

    class Wrapper:  # accelerate's AcceleratedOptimizer passes step(closure) on
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, closure=None):
            self.optimizer.step(closure)

        def zero_grad(self, set_to_none=True):
            self.optimizer.zero_grad(set_to_none)

    batches = synthetic_batches("mlp", total, seed=6)
    model_t, opt_t = fresh()
    sched = torch.optim.lr_scheduler.LambdaLR(opt_t, linear)
    params_t = run(model_t, Wrapper(opt_t), batches, hand_over=False, sched=sched)
    model_p, opt_p = fresh()
    for t, batch in enumerate(batches):
        opt_p.base_lr = 3e-3 * linear(t)
        opt_p.zero_grad()
        loss = model_p(batch["x"], batch["y"]).loss
        loss.backward()
        opt_p.step(loss.detach())
    for a, b in zip(params_t[0], model_p.parameters()):
        assert torch.equal(a, b)
