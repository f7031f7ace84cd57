"""DeepNestedOptimizer(fix_reference_bugs=True): the corrected behaviour of B1, B4, B6 and B7
(spec deep_nested_optimizer.md section 14). Off by default; these tests check each correction does
what the README says."""

import copy
import math

import torch

import titanmac_c
from titanmac_c._cms import level_frequencies
from titanmac_c._reference_dno import compute_surrogate_loss, preprocess_gradient
from dno_models import loss_fn, make_mlp_10_32_5, synthetic_batches


def _opt(**kw):
    model = make_mlp_10_32_5(seed=0)
    return model, titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True,
                                                 fix_reference_bugs=True, **kw)


def test_b4_mlp_starts_at_a_tenth_of_the_gradient_sign():
    for layers in (1, 2, 3):
        _, opt = _opt(momentum_num_layers=layers)
        g = torch.randn(1000) * 1e-2
        m = torch.randn(1000) * 1e-3
        out = opt.momentum_mlp(g, m)
        torch.testing.assert_close(out, 0.1 * preprocess_gradient(g)[1], rtol=1e-6, atol=1e-7)


def test_b7_levels_fire_at_their_own_frequency():
    assert level_frequencies([1, 5, 50]) == [1, 5, 25]  # the reference: B = list[1], B**l
    assert level_frequencies([1, 5, 50], consistent=True) == [1, 5, 50]
    _, opt = _opt(cms_frequencies=[1, 5, 50])
    assert opt._cms.fires(50) == [True, True, True]
    assert opt._cms.fires(25) == [True, True, False]
    assert opt._cms.ema_decays[2] == 0.99 ** (1 / 50)


def test_b6_controller_sees_log_scaled_norms():
    model, opt = _opt()
    batch = synthetic_batches("mlp", 1, seed=0)[0]
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step(loss.item())
    grads = [p.grad for g in opt.param_groups for p in g["params"]]
    params = [p.detach() for g in opt.param_groups for p in g["params"]]
    group_of = [i for i, g in enumerate(opt.param_groups) for _ in g["params"]]
    norms = titanmac_c.group_norms(grads, params, group_of, 2)
    stats = torch.stack([torch.log1p(norms.grad) / 10, torch.log1p(norms.param) / 10,
                         opt.group_depths], dim=1)
    with torch.no_grad():
        expected = opt.controller(stats)
    torch.testing.assert_close(opt.get_lr_multipliers(), expected, rtol=1e-5, atol=1e-6)


def test_b1_phase1_trains_on_the_current_gradient():
    """With the fix the surrogate's target is the gradient, so its direction term is active and
    the loss is not the 0.1 ||o||^2 that zero targets give."""
    model, opt = _opt()
    for step, batch in enumerate(synthetic_batches("mlp", 5, seed=1), start=1):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        result = opt.step(loss.item())
    assert "surrogate_loss" in result
    assert float(result["surrogate_loss"]) > 0.5  # 1 - cos(o, g) dominates; zeros give ~1e-3


def test_corrected_run_trains():
    for mode in ({}, {"use_cms_updates": True}):
        model = make_mlp_10_32_5(seed=0)
        opt = titanmac_c.DeepNestedOptimizer(model, fix_reference_bugs=True, base_lr=1e-2, **mode)
        losses = []
        for batch in synthetic_batches("mlp", 120, seed=2):
            opt.zero_grad()
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step(loss.item())
            losses.append(loss.item())
        assert math.isfinite(losses[-1]) and sum(losses[-10:]) < sum(losses[:10])


def test_b1_phase1_on_the_cpu_trains_like_the_autograd_path():
    """With the fix Phase 1's target is the clipped gradient (the C core's normed path, the
    cosine term active). From one state (a deep copy before each step: the DirectUpdateMLP
    dynamics would amplify rounding, spec 7), the CPU's Phase 1 (tm_cms_surrogate) and the
    autograd Phase 1 (CUDA's, with torch's bits) move the MLP alike: every weight within 1e-3 of
    the Adam step size (lr 1e-3), the surrogate losses within 1e-5."""
    model, opt = _opt(max_grad_norm=0.5)
    for step, batch in enumerate(synthetic_batches("mlp", 15, seed=4), start=1):
        model_b, opt_b = copy.deepcopy((model, opt))
        opt_b._phase1_fused = opt_b._phase1_autograd
        before = (copy.deepcopy(opt.momentum_mlp),
                  [opt.state[p]["momentum"][0].clone() for p in model.parameters()],
                  {i: o.clone() for i, o in opt._mlp_output_history.items()})
        results = []
        for m, o in ((model, opt), (model_b, opt_b)):
            o.zero_grad()
            loss = loss_fn(m, batch)
            loss.backward()
            results.append(o.step(loss.item()))
        if step % opt.mlp_train_freq == 0:
            # the spec's loss on g0 = clipped gradient / max(f_0, 1) (f_0 = 1), from the state
            # before the step (.grad keeps the unclipped values; opt._coef is the clip's)
            mlp, moms, history = before
            expected = torch.stack([
                compute_surrogate_loss(mlp(p.grad * opt._coef, m), p.grad * opt._coef,
                                       history.get(opt._cms.index[p]))
                for p, m in zip(model.parameters(), moms)]).mean()
            torch.testing.assert_close(results[0]["surrogate_loss"], expected, rtol=1e-5, atol=0)
            for (name, wa), wb in zip(opt.momentum_mlp.named_parameters(),
                                      opt_b.momentum_mlp.parameters()):
                torch.testing.assert_close(wa, wb, rtol=0, atol=1e-6,
                                           msg=lambda m: f"step {step} {name}: {m}")
            torch.testing.assert_close(results[0]["surrogate_loss"],
                                       results[1]["surrogate_loss"], rtol=1e-5, atol=0)
