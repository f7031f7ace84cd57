"""DeepNestedOptimizer on what goes beyond contiguous float32: float64 models (AdamW mode; CMS
mode's: tests/cms/test_deep_nested_cms.py), channels_last parameters, gradients laid out otherwise
than their parameter, a parameter relaid out after construction (both modes). The statistics read
any layout and the updates take dense ones, a parameter's gradient and state in its layout, so
these train as the reference trains them (with torch ops)."""

import pytest
import torch

import titanmac_c
from cms_checks import cms_pair, compare_cms
from conftest import DEVICES, expect_refused, reference_and_ours, sync_cms_from_reference
from dno_models import make_mlp_10_32_5

# float32 rates (base_lr * mu rounded, docs/deep_nested.md) and float32 norms: a float64 run agrees
# with the reference's to about float32's precision, where a float32 run agrees to its rounding
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


def _step_each(pairs, step, batch, edit=None, edit_ours=None):
    """One step of each (model, optimizer) on batch(step), the loss given as a float:
    edit(model, step) before the backward, edit_ours(model) after it on the last pair (ours)."""
    for k, (m, opt) in enumerate(pairs):
        if edit is not None:
            edit(m, step)
        opt.zero_grad()
        loss = m(batch(step)).square().mean()
        loss.backward()
        if edit_ours is not None and k == len(pairs) - 1:
            edit_ours(m)
        opt.step(loss.item())


def _train_both(model, steps, batch, tol, kw=None, edit=None):
    """Reference and ours from the same state over `steps` steps of real backward passes (the
    loss given as a float); edit(model, step) runs on both models before each backward.
    Parameters and multipliers compared after every step."""
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(model, **(kw or {}))
    for step in range(1, steps + 1):
        _step_each(((model_r, ref), (model_o, ours)), step, batch, edit)
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
    assert float(ours._control.coef) < 1.0  # the clip mattered


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


def _train_cms_both(model, steps, batch, preprocessing, cpu_path=True, edit=None,
                    edit_grads=None):
    """CMS mode, reference and ours from the same state over `steps` steps (levels firing every
    1, 2, 4 steps; Phase 1 at 5 and 10; a meta-update at 6 and 12). The direct network is
    resynced from the reference before every step and each step's update compared (its path
    amplifies last bits: tests/cms_checks.py), the legacy one runs free; CMS buffers, fire
    counts and multipliers compared after every step. edit(model, step) runs on both models
    before the backward, edit_grads(model) on ours after it."""
    device = next(model.parameters()).device
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = cms_pair(
        device, model, use_preprocessing=preprocessing, cms_frequencies=[1, 2, 4],
        meta_update_freq=6, weight_decay=0.01)
    ours._cms_mode.phase1_cpu_path = cpu_path
    for step in range(1, steps + 1):
        before = None
        if preprocessing:
            sync_cms_from_reference(ref, ours, model_r, model_o)
            before = [p.detach().clone() for p in model_r.parameters()]
        _step_each(((model_r, ref), (model_o, ours)), step, batch, edit, edit_grads)
        compare_cms(ref, ours, model_r, model_o, step, before)
    return model_o, ours


CMS_NETS = pytest.mark.parametrize("preprocessing", [True, False], ids=["direct", "legacy"])
# Phase 1 the CPU's way (the C op) and CUDA's (torch ops), both on the CPU
PHASE1_PATHS = pytest.mark.parametrize("cpu_path", [True, False],
                                       ids=["cpu-phase1", "cuda-phase1"])


@pytest.mark.parametrize("device", DEVICES)
@CMS_NETS
@PHASE1_PATHS
def test_cms_mode_trains_a_channels_last_model_as_the_reference(device, preprocessing, cpu_path):
    """The CMS buffers lie in the parameters' layout (the reference's are contiguous),
    and the C core takes each parameter with its gradient and buffers as contiguous permuted
    views (Phase 1 too)."""
    model = SmallConvNet().to(device).to(memory_format=torch.channels_last)
    # 10 steps: the last one runs Phase 1 (its output history is checked below)
    model_o, ours = _train_cms_both(model, 10, _images(device), preprocessing,
                                    cpu_path=cpu_path and device == "cpu")
    weight = model_o.conv1.weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    for level in ours.state[weight].levels:
        assert level.momentum.is_contiguous(memory_format=torch.channels_last)
    if preprocessing:
        history = ours._cms_mode.output_history[ours._cms.index[weight]]
        assert history.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
@CMS_NETS
@PHASE1_PATHS
def test_cms_mode_trains_a_float64_model_as_the_reference(device, preprocessing, cpu_path):
    """Its buffers and update are float32 as the reference's; the gradient's accumulate and the
    parameter step are in double (250 steps: tests/cms/test_deep_nested_cms.py). Here with the
    Phase 1 steps and meta-updates of _train_cms_both, both Phase 1 paths."""
    model = make_mlp_10_32_5(seed=0).double().to(device)
    model_o, ours = _train_cms_both(model, 12, _vectors(device, torch.float64), preprocessing,
                                    cpu_path=cpu_path and device == "cpu")
    assert all(p.dtype == torch.float64 for p in model_o.parameters())
    for level in ours.state[model_o[0].weight].levels:
        assert level.momentum.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@CMS_NETS
def test_cms_mode_takes_gradients_laid_out_otherwise(device, preprocessing):
    """Gradients replaced by transposed copies or strided slices holding the same values: the
    update reads each as a copy in its parameter's layout, and the gradient stays as given."""
    given = []

    def relayout(m):
        given.clear()
        for p in m.parameters():
            if p.grad.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
            else:
                p.grad = torch.empty(2 * p.numel(), device=device)[::2].copy_(p.grad)
            given.append(p.grad)

    model_o, _ = _train_cms_both(make_mlp_10_32_5(seed=0).to(device), 12, _vectors(device),
                                 preprocessing, edit_grads=relayout)
    assert all(p.grad is g for p, g in zip(model_o.parameters(), given))


@CMS_NETS
@PHASE1_PATHS
def test_cms_mode_follows_a_parameter_relaid_out_after_construction(preprocessing, cpu_path):
    """A channels_last weight made contiguous at step 3 and a contiguous one made column-major
    at step 7: its CMS buffers (and Phase 1 output) are moved into the new layout, values kept,
    and training goes on as the reference's."""
    def edit(m, step):
        with torch.no_grad():
            if step == 3:
                m.conv1.weight.data = m.conv1.weight.data.contiguous()
            if step == 7:
                m.head.weight.data = m.head.weight.data.t().contiguous().t()

    model = SmallConvNet().to(memory_format=torch.channels_last)
    model_o, ours = _train_cms_both(model, 12, _images("cpu"), preprocessing, cpu_path,
                                    edit=edit)
    assert model_o.conv1.weight.is_contiguous()
    assert ours.state[model_o.conv1.weight].levels[2].momentum.is_contiguous()
    head = ours.state[model_o.head.weight].levels[0]
    assert head.accumulated_grad.stride() == model_o.head.weight.stride() == (1, 2)


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
    (docs/adamw.md): strided slices (no permutation makes them dense) by torch's mul_, the rest by
    the C core. The hook sees the reference's clipped gradients."""
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
    assert float(ours._control.coef) < 1.0  # the clip mattered


def test_an_expanded_gradient_clipped_for_step_hooks_is_refused_by_name():
    """An expanded gradient cannot be clipped in place (torch's clip refuses it too): the step
    raises naming the parameter, before the hook runs, and nothing changes."""
    model = make_mlp_10_32_5(seed=0)
    opt = titanmac_c.DeepNestedOptimizer(model, max_grad_norm=0.05)
    calls = []
    opt.base_optimizer.register_step_pre_hook(lambda o, a, k: calls.append(1))
    model(_vectors("cpu")(1)).square().mean().backward()
    opt.step(0.5)
    opt.zero_grad()
    model(_vectors("cpu")(2)).square().mean().backward()
    model[0].weight.grad = None  # the refused gradient is not the second one present
    model[2].weight.grad = torch.full((), 0.5).expand(model[2].weight.shape)
    expect_refused(opt.base_optimizer, list(model.parameters()), RuntimeError,
                   r"^parameter '2.weight': its gradient is an expanded tensor .* as with "
                   r"torch$", action=lambda: opt.step(0.5))
    assert calls == [1] and opt.global_step == 1


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


def _state_tensors(opt):
    """Every state tensor the update writes: AdamW's moments, or the CMS buffers."""
    if opt._cms is not None:
        return [b for levels in opt._cms.buffers.values() for level in levels for b in level]
    return [v for s in opt.base_optimizer.state.values() for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0]


# the static gradient keeps the old layout: torch's accumulation warns, as it should
@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("cms", [False, True], ids=["adamw", "cms"])
def test_graph_mode_moves_relaid_out_state_before_a_capture(monkeypatch, cms):
    """CUDA-graph mode's step logic on the CPU (simulated replays, as in
    tests/cms/test_deep_nested_cms.py): a parameter made column-major after the first capture has
    its state moved into its layout before the re-capture, not inside it (a copy captured would
    be replayed every step, from the old buffer); the run follows eager's."""
    from titanmac_c.deep_nested.graph import GraphState

    replaced_in_capture = []
    owners = {}  # GraphState -> its optimizer

    def graph_of(self, key, calls):
        self.captured = True
        if key in self.graphs:
            return self.graphs[key]
        self.graphs[key] = calls

        def capture_and_run():  # what a capture and its first replay do
            before = [id(t) for t in _state_tensors(owners[self])]
            calls()
            if [id(t) for t in _state_tensors(owners[self])] != before:
                replaced_in_capture.append(key)
        return capture_and_run

    monkeypatch.setattr(GraphState, "_graph_of", graph_of)

    def edit(m, step):
        if step == 6:  # not a Phase 1 step (which moves the state eagerly before Phase 2)
            with torch.no_grad():
                m[2].weight.data = m[2].weight.data.t().contiguous().t()

    runs = []
    for graph in (False, True):
        model = make_mlp_10_32_5(seed=0)
        torch.manual_seed(0)  # the networks' initialisation
        opt = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=cms,
                                             cuda_graph_warmup_steps=2)
        if cms:  # CUDA's Phase 1 (torch ops)
            opt._cms_mode.phase1_cpu_path = False
        if graph:
            opt._graph = opt._graph_state()
            owners[opt._graph] = opt
        for step in range(1, 10):
            edit(model, step)
            opt.zero_grad(set_to_none=not graph)
            loss = model(_vectors("cpu")(step)).square().mean()
            loss.backward()
            opt.step(loss.detach())
        runs.append(model)
    assert opt._graph.captured and not replaced_in_capture
    assert not runs[1][2].weight.is_contiguous()
    for pe, pg in zip(*(m.parameters() for m in runs)):
        torch.testing.assert_close(pg, pe, rtol=1e-5, atol=1e-6)
