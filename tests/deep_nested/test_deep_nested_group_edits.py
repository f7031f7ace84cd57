"""DeepNestedOptimizer when the user edits base_optimizer's groups after construction: a
parameter frozen at construction, unfrozen later and appended to a group's 'params' list (the
way to start training it; add_param_group makes a third group, which the controller cannot
serve) counts once in the clip norm, as the reference counts each model parameter once, and is
named in messages by its model name. Also a model whose 'embed' group is empty, the host
reads of the meta-update (no warning for a loss that requires grad) and the type of a bad loss
argument."""

import warnings

import pytest
import torch

import titanmac_c
from conftest import DEVICES, reference_and_ours
from dno_models import MODES, PartlyFrozen, loss_fn, make_mlp_10_32_5, synthetic_batches

def _set_grads(model, step):
    """Pseudo-random gradients, the frozen layer's large: its norm dominates the clip norm, so
    counting it twice (or not at all) changes every update."""
    gen = torch.Generator().manual_seed(900 + step)
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen)
        p.grad = (g * 10 if name.startswith("frozen") else g).to(p.device)


def _append_frozen_layer(model, opt):
    """Unfreeze the frozen layer and append its parameters to the group of lin's (core)."""
    model.frozen.requires_grad_(True)
    group = next(g for g in opt.base_optimizer.param_groups
                 if any(p is model.lin.weight for p in g["params"]))
    group["params"].extend([model.frozen.weight, model.frozen.bias])


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_appended_to_a_group_counts_once_in_the_clip_norm(device):
    """Appended after 3 steps (so AdamW's cached plan and the list of parameters outside the
    groups exist): from then on it is stepped, and the clip norm counts its gradient once, as
    the reference's clip over model.parameters() does; 12 more steps agree with the
    reference's, element by element."""
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(PartlyFrozen().to(device),
                                                         max_grad_norm=1.0)
    for step in range(1, 16):
        if step == 4:
            for model, opt in ((model_r, ref), (model_o, ours)):
                _append_frozen_layer(model, opt)
        for model, opt in ((model_r, ref), (model_o, ours)):
            _set_grads(model, step)
            opt.step(0.5)
        for (name, pr), po in zip(model_r.named_parameters(), model_o.parameters()):
            torch.testing.assert_close(po.detach(), pr.detach(), rtol=2e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} {name}: {m}")
    # the norm of the last step: every model gradient once (twice, the frozen layer's would
    # dominate it)
    once = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model_o.parameters()))
    assert float(ours._control.norms[-1]) == pytest.approx(float(once), rel=1e-5)


@pytest.mark.parametrize("kw, own_memory, match", [
    (MODES[0], True,
     r"^grads\[\d+\]: shares memory with params\[\d+\] \(parameter 'frozen.weight'\)"),
    (MODES[1], False, r"^parameter 'frozen.weight': no CMS state \(appended to a group after"),
    (MODES[2], False, r"^parameter 'frozen.weight': no CMS state \(appended to a group after"),
], ids=["adamw-refusal-named", "cms-direct-no-state", "cms-legacy-no-state"])
def test_an_appended_parameter_is_named_in_errors(kw, own_memory, match):
    """A refusal about an appended parameter names it by its model name (the names were those
    of construction: naming failed with a KeyError of the tensor's repr). CMS mode keeps the
    state of the parameters it was built with (the reference fails with a KeyError on an
    appended one): refused, on a Phase 1 step and on another. Nothing changes either way."""
    for steps_before in (2, 4):  # step 5 is a Phase 1 step (mlp_train_freq 5)
        torch.manual_seed(0)
        model = PartlyFrozen()
        opt = titanmac_c.DeepNestedOptimizer(model, **kw)
        for step in range(1, steps_before + 1):
            _set_grads(model, step)
            opt.step(0.5)
        _append_frozen_layer(model, opt)
        _set_grads(model, steps_before + 1)
        if own_memory:
            model.frozen.weight.grad = model.frozen.weight.detach()  # the parameter's own memory
        before = [p.detach().clone() for p in model.parameters()]
        multipliers = opt._control.lr_multipliers.clone()
        with pytest.raises(ValueError, match=match):
            opt.step(0.5)
        assert opt.global_step == steps_before
        assert torch.equal(opt._control.lr_multipliers, multipliers)
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b)


def test_an_appended_parameter_the_model_does_not_hold_is_named_by_its_position():
    """CMS mode refuses a parameter appended to a group that the model does not hold; its name
    is its place in the groups, given once (the message read 'parameter "parameter
    "param_groups[1]['params'][1]""'). Nothing changes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True)
    extra = torch.nn.Parameter(torch.randn(3))
    extra.grad = torch.randn(3)
    opt.base_optimizer.param_groups[1]["params"].append(extra)
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in (*model.parameters(), extra)]
    with pytest.raises(ValueError, match=r"""^parameter "param_groups\[1\]\['params'\]\[1\]": """
                                         r"no CMS state \(appended"):
        opt.step(1.0)
    assert opt.global_step == 0
    for p, b in zip((*model.parameters(), extra), before):
        assert torch.equal(p.detach(), b)


def test_a_third_group_is_refused_before_anything_changes():
    """base_optimizer.add_param_group() makes a third group; the controller sets two learning
    rates. Refused with a message that says what to do, nothing changed (the C core's
    'group_of[4] = 2' was lost behind a KeyError)."""
    torch.manual_seed(0)
    model = PartlyFrozen()
    opt = titanmac_c.DeepNestedOptimizer(model)
    _set_grads(model, 1)
    opt.step(0.5)
    model.frozen.requires_grad_(True)
    opt.base_optimizer.add_param_group({"params": list(model.frozen.parameters())})
    _set_grads(model, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^base_optimizer.param_groups: 3 groups, where the "
                                         r"controller sets the learning rates of 2 .*append"):
        opt.step(0.5)
    assert opt.global_step == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_meta_update_reads_a_loss_that_requires_grad_without_a_warning():
    """meta_update() reads the validation loss as the reference does (.item()): float() of a
    tensor that requires grad warns, an error under -W error. The controllers agree after."""
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(seed=0))
    batches = synthetic_batches("mlp", 4)
    for model, opt in ((model_r, ref), (model_o, ours)):
        for batch in batches[:3]:
            opt.zero_grad()
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step(loss.detach())
    assert loss_fn(model_o, batches[3]).requires_grad
    ref.meta_update(batches[3], use_unrolled=False, loss_fn=loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.meta_update(batches[3], use_unrolled=False, loss_fn=loss_fn)
    for (name, pr), po in zip(ref.controller.named_parameters(), ours.controller.parameters()):
        torch.testing.assert_close(po.detach(), pr.detach(), rtol=1e-5, atol=1e-7, msg=name)


def test_an_empty_group_gives_the_proxy_the_references_exact_zero():
    """A model of bias-free Linears: the 'embed' group is empty, its stats row is constant, so
    in the reference the improving-loss proxy (mu~ - multiplier_history[-1])^2 is exactly 0 for
    it and the controller weights only that row reaches get no gradient. Ours recorded the C
    controller's multipliers and compared them with torch's forward: an ulp apart, which the
    meta-optimizer's Adam normalizes into a full step (controller 9e-4 off the reference's at
    the 11th meta-update, growing). float64 model, explicit meta-updates, 60 steps."""
    torch.manual_seed(426740)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(7, 3, bias=False)).double()
    kw = dict(base_lr=1e-4, meta_lr=1e-2, mode="explicit", controller_hidden_dim=32,
              controller_num_layers=3)
    (model_r, ref), (model_o, ours) = reference_and_ours(model, **kw)
    gen = torch.Generator().manual_seed(426742)
    target = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    data = [torch.randn(8, 6, generator=gen, dtype=torch.float64) for _ in range(62)]

    def mse(m, x):
        return torch.nn.functional.mse_loss(m(x), x @ target)

    for t in range(1, 61):
        for opt, m in ((ref, model_r), (ours, model_o)):
            opt.zero_grad()
            loss = mse(m, data[t])
            loss.backward()
            opt.step(loss.item())
            if t % 3 == 0:
                opt.meta_update(data[t + 1], loss_fn=mse, use_unrolled=False)
    assert len(ref.meta_trainer.loss_history) == 20
    for (name, w_r), w_o in zip(ref.controller.named_parameters(), ours.controller.parameters()):
        torch.testing.assert_close(w_o, w_r, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(ours.get_lr_multipliers(), ref.get_lr_multipliers(), rtol=0,
                               atol=1e-6)
    for p_o, p_r in zip(model_o.parameters(), model_r.parameters()):
        torch.testing.assert_close(p_o, p_r, rtol=1e-6, atol=1e-9)
