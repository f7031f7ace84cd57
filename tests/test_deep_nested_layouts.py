"""DeepNestedOptimizer in AdamW mode on what titanmac_c.AdamW takes beyond contiguous float32:
float64 models, channels_last parameters, gradients laid out otherwise than their parameter, a
parameter made column-major after construction. The statistics read any layout and AdamW steps
dense ones, so these train as the reference trains them (with torch ops). CMS mode keeps its
state contiguous in float32 math: it refuses them, naming the parameter."""

import pytest
import torch

import titanmac_c
from conftest import DEVICES, reference_and_ours
from dno_models import make_mlp_10_32_5

# float32 rates (base_lr * mu rounded, README) and float32 norms: a float64 run agrees with the
# reference's to about float32's precision, where a float32 run agrees to its rounding
F64_TOL = dict(rtol=1e-6, atol=1e-9)
F32_TOL = dict(rtol=2e-5, atol=1e-7)


class SmallConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 4, 3)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


def _train_both(model, steps, batch, tol, kw=None, edit=None):
    """Reference and ours from the same state over `steps` steps of real backward passes (the
    loss given as a float); edit(model, step) runs on both models before each backward.
    Parameters and multipliers compared after every step."""
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(model, **(kw or {}))
    for step in range(1, steps + 1):
        for m, opt in ((model_r, ref), (model_o, ours)):
            if edit is not None:
                edit(m, step)
            opt.zero_grad()
            loss = m(batch(step)).square().mean()
            loss.backward()
            opt.step(float(loss))
        for (name, pr), po in zip(model_r.named_parameters(), model_o.parameters()):
            torch.testing.assert_close(po.detach(), pr.detach(), **tol,
                                       msg=lambda m: f"step {step} {name}: {m}")
        torch.testing.assert_close(ours.get_lr_multipliers(), ref.get_lr_multipliers(),
                                   rtol=1e-5, atol=1e-7)
    return model_o, ours


def _images(device, dtype=torch.float32):
    def batch(step):
        gen = torch.Generator().manual_seed(100 + step)
        return torch.randn(4, 3, 9, 9, generator=gen, dtype=dtype).to(device)
    return batch


def _vectors(device, dtype=torch.float32):
    def batch(step):
        gen = torch.Generator().manual_seed(200 + step)
        return torch.randn(16, 10, generator=gen, dtype=dtype).to(device)
    return batch


@pytest.mark.parametrize("device", DEVICES)
def test_a_float64_model_trains_as_the_references(device):
    model = make_mlp_10_32_5(seed=0).double().to(device)
    model_o, _ = _train_both(model, 12, _vectors(device, torch.float64), F64_TOL)
    assert all(p.dtype == torch.float64 for p in model_o.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_a_channels_last_model_trains_as_the_references(device):
    model = SmallConvNet().to(device).to(memory_format=torch.channels_last)
    model_o, ours = _train_both(model, 12, _images(device), F32_TOL)
    assert model_o.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    state = ours.base_optimizer.state[model_o.conv1.weight]
    assert state["exp_avg"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_laid_out_otherwise_count_and_step_as_the_references(device):
    """Gradients replaced by transposed copies (same values): the norms read them where they
    lie, AdamW takes them in its parameter's layout; a parameter outside the groups (frozen at
    construction, unfrozen since) with such a gradient counts in the clip norm."""
    model = make_mlp_10_32_5(seed=0).to(device)
    model[0].bias.requires_grad_(False)

    def edit(m, step):
        if step == 3:
            m[0].bias.requires_grad_(True)

    def transposed_grads(m):
        for p in m.parameters():
            if p.grad is not None and p.grad.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
            elif p.grad is not None:
                p.grad = torch.empty(2 * p.numel(), device=device)[::2].copy_(p.grad)

    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(model, max_grad_norm=0.05)
    batch = _vectors(device)
    for step in range(1, 9):
        for m, opt, relayout in ((model_r, ref, False), (model_o, ours, True)):
            edit(m, step)
            opt.zero_grad()
            m.zero_grad()  # the bias outside the groups too
            m(batch(step)).square().mean().backward()
            if relayout:
                transposed_grads(m)
            opt.step(0.5)
        for (name, pr), po in zip(model_r.named_parameters(), model_o.parameters()):
            torch.testing.assert_close(po.detach(), pr.detach(), **F32_TOL,
                                       msg=lambda m: f"step {step} {name}: {m}")
    assert float(ours._coef) < 1.0  # the clip mattered


@pytest.mark.parametrize("with_grad", [True, False], ids=["with-grad", "without-grad"])
def test_a_parameter_made_column_major_after_construction_steps_as_the_references(with_grad):
    """Its storage replaced by a column-major copy after construction: read by the controller
    step's statistics with its gradient or, without one, by the pass over parameters without
    gradients, and stepped by AdamW (its state copied into the new layout)."""
    def edit(m, step):
        if step == 2:
            with torch.no_grad():
                m[2].weight.data = m[2].weight.data.t().contiguous().t()
        if step >= 4 and not with_grad:
            m[2].weight.requires_grad_(False)

    model_o, _ = _train_both(make_mlp_10_32_5(seed=0), 8, _vectors("cpu"), F32_TOL, edit=edit)
    assert not model_o[2].weight.is_contiguous()


@pytest.mark.parametrize("make, match", [
    (lambda: make_mlp_10_32_5(seed=0).double(),
     r"parameter '0.weight': dtype torch.float64 is not supported \(float32, bfloat16, "
     r"float16; e.g. model.float\(\)\)"),
    (lambda: SmallConvNet().to(memory_format=torch.channels_last),
     r"parameter 'conv1.weight': not contiguous"),
], ids=["float64", "channels_last"])
def test_cms_mode_refuses_them_at_construction(make, match):
    with pytest.raises(BufferError, match=match):
        titanmac_c.DeepNestedOptimizer(make(), use_cms_updates=True)


def test_a_parameter_dense_in_no_order_is_refused_at_construction():
    """Every other column of a buffer: AdamW steps no such parameter, so neither does the
    optimizer (the reference's torch ops would)."""
    model = torch.nn.Linear(4, 3)
    model.weight = torch.nn.Parameter(torch.randn(3, 8)[:, ::2])
    with pytest.raises(BufferError, match=r"parameter 'weight': not dense in any order"):
        titanmac_c.DeepNestedOptimizer(model)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_gradients_are_clipped_in_memory_for_step_hooks_as_the_references(device):
    """With a step hook on base_optimizer the gradients are clipped in memory before the hooks
    (README): strided slices (no permutation makes them dense) by torch's mul_, the rest by the
    C core. The hook sees the reference's clipped gradients."""
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(
        make_mlp_10_32_5(seed=0).to(device), max_grad_norm=0.05)
    seen = {"ref": [], "ours": []}
    for key, opt in (("ref", ref), ("ours", ours)):
        opt.base_optimizer.register_step_pre_hook(
            lambda o, a, k, key=key: seen[key].append(
                [p.grad.clone() for g in o.param_groups for p in g["params"]]))
    for step in range(1, 6):
        gen = torch.Generator().manual_seed(300 + step)
        for pr, po in zip(model_r.parameters(), model_o.parameters()):
            g = torch.randn(*pr.shape[:-1], 2 * pr.shape[-1], generator=gen)[..., ::2]
            pr.grad, po.grad = g.clone().to(device), g.to(device)  # ours: a strided slice
        ref.step(0.5)
        ours.step(0.5)
        assert not model_o[0].weight.grad.is_contiguous()
        for gr, go in zip(seen["ref"][-1], seen["ours"][-1]):
            torch.testing.assert_close(go, gr, **F32_TOL)
        for pr, po in zip(model_r.parameters(), model_o.parameters()):
            torch.testing.assert_close(po.detach(), pr.detach(), **F32_TOL)
    assert float(ours._coef) < 1.0  # the clip mattered


def test_a_float64_loss_beyond_float32_is_stepped_as_the_references():
    """A finite float64 loss tensor above float32's largest value: the reference steps (its loss
    EMA becomes inf); ours takes it as float32's largest value, as it takes such a float loss,
    and steps too (rounding it to inf would have the device guard skip the step)."""
    (model_r, ref), (model_o, ours) = reference_and_ours(make_mlp_10_32_5(seed=0).double())
    batch = _vectors("cpu", torch.float64)
    for step in range(1, 4):
        for m, opt in ((model_r, ref), (model_o, ours)):
            opt.zero_grad()
            loss = m(batch(step)).square().mean()
            loss.backward()
            opt.step(loss.detach() + (1e300 if step == 3 else 0.0))
        assert float(ours.skipped) == 0.0
        for pr, po in zip(model_r.parameters(), model_o.parameters()):
            torch.testing.assert_close(po.detach(), pr.detach(), **F64_TOL)
    assert float(ours.ema_loss[0]) == pytest.approx(3.4028234663852886e+37)
