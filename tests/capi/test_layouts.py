"""Tensors that are dense but not contiguous (channels_last conv weights, transposed matrices):
AdamW, clip_grad_norm_ and get_total_norm take them where they lie (the C core reads them in
memory order), element by element against torch over several steps. A gradient or state
in another layout than its parameter's (any strides) is taken in the parameter's layout
(_flat.in_layout_of): gradients as a copy, state for good. Parameters that are not dense
(strided slices) are refused with BufferError naming the tensor, and nothing changes; the norm
functions read such tensors through a copy, and clip_grad_norm_ scales such gradients with torch.
"""

import copy

import pytest
import torch

import titanmac_c
from conftest import DEVICES, expect_refused, tol


def _conv_model(device, dtype=torch.float32):
    """A small CNN in channels_last: its 4-d weights (and their gradients) are not contiguous."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5))
    return model.to(device=device, dtype=dtype, memory_format=torch.channels_last)


def _batch(step, device, dtype):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 3, 6, 6, generator=gen).to(device=device, dtype=dtype)
    return x.contiguous(memory_format=torch.channels_last), torch.randn(4, 5, generator=gen).to(
        device=device, dtype=dtype)


def _backward(model, step):
    p0 = next(model.parameters())
    x, y = _batch(step, p0.device, p0.dtype)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _step_both(step, ref, ours, opt_ref, opt):
    """One training step of torch's model and ours on the same batch; (name, torch's parameter,
    ours) for comparing."""
    for model, optimizer in ((ref, opt_ref), (ours, opt)):
        _backward(model, step)
        optimizer.step()
    return [(name, pr, po) for (name, pr), po in zip(ref.named_parameters(), ours.parameters())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_on_a_channels_last_model_matches_torch(device, dtype, amsgrad):
    ref = _conv_model(device, dtype)
    ours = copy.deepcopy(ref)
    assert not ref[0].weight.is_contiguous()  # the case under test
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=(dtype != torch.float32), **kw)
    opt = titanmac_c.AdamW(ours.parameters(), **kw)
    for step in range(1, 9):
        for name, pr, po in _step_both(step, ref, ours, opt_ref, opt):
            assert po.stride() == pr.stride(), name  # updated in place, layout kept
            torch.testing.assert_close(po, pr, **tol(dtype, device),
                                       msg=lambda m: f"step {step} {name}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[po][key], opt_ref.state[pr][key],
                                           **tol(dtype, device),
                                           msg=lambda m: f"step {step} {name} {key}: {m}")


def _relayout_weight(model, memory_format):
    """The first conv weight's storage replaced by a copy in memory_format (`p.data = ...`)."""
    weight = model[0].weight
    weight.data = weight.data.clone(memory_format=memory_format)


def _edit_state(model, opt):
    """The first conv weight's exp_avg replaced under its key by a contiguous copy."""
    state = opt.state[model[0].weight]
    state["exp_avg"] = state["exp_avg"].contiguous()


def _transpose_grad(model):
    """The last layer's gradient replaced by a column-major copy after the backward."""
    grad = model[4].weight.grad
    model[4].weight.grad = grad.t().contiguous().t()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit, full_path_steps", [
    # new storage in the same layout: the plan reads the parameter anew, no full path
    (lambda model, opt: _relayout_weight(model, torch.channels_last), [1, 8, 9]),
    # another layout than the state's: the C core refuses the planned call (memory orders
    # differ), the full path lays the state out
    (lambda model, opt: _relayout_weight(model, torch.contiguous_format), [1, 5, 8, 9]),
    (_edit_state, [1, 5, 8, 9]),
], ids=["new-storage", "made-contiguous", "state-replaced"])
def test_planned_steps_of_a_channels_last_model_follow_edits_like_torch(device, edit,
                                                                        full_path_steps):
    """The steady state of a channels_last model runs through the cached plan, which hands the
    C core the parameters, gradients and state as they lie. A parameter's storage replaced or
    relaid out, a state tensor replaced in another layout, a gradient laid out otherwise: each
    takes effect as in torch, the parameter updated where it now lies."""
    ref = _conv_model(device)
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = titanmac_c.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    collected, collect = [], opt._collect
    opt._collect = lambda: (collected.append(step), collect())[1]  # the full path's steps
    for step in range(1, 13):
        if step == 5:
            edit(ref, opt_ref)
            edit(ours, opt)
        for model, optimizer in ((ref, opt_ref), (ours, opt)):
            _backward(model, step)
            if step == 8:
                _transpose_grad(model)
            optimizer.step()
        for (name, pr), po in zip(ref.named_parameters(), ours.parameters()):
            assert po.stride() == pr.stride(), name
            torch.testing.assert_close(po, pr, **tol(torch.float32, device),
                                       msg=lambda m: f"step {step} {name}: {m}")
            torch.testing.assert_close(opt.state[po]["exp_avg"], opt_ref.state[pr]["exp_avg"],
                                       **tol(torch.float32, device))
    # the first step, the edit's (but new storage), the transposed gradient's (a copy: no plan
    # kept) and the next
    assert collected == full_path_steps


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "full-path"])
def test_a_state_entry_that_is_no_tensor_is_named_for_a_channels_last_parameter(planned):
    model = _conv_model("cpu")
    opt = titanmac_c.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 4):
        _backward(model, step)
        opt.step()
    if not planned:
        opt._plan = None
    opt.state[model[0].weight]["exp_avg"] = 0.5
    expect_refused(opt, list(model.parameters()), TypeError,
                   r"^exp_avg\[0\]: expected a tensor .* got float "
                   r"\(param_groups\[0\]\['params'\]\[0\]\)$")


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_on_a_transposed_parameter_matches_torch(device):
    """nn.Parameter(w.t()) (e.g. a tied or imported weight): autograd gives its gradient the
    same transposed layout."""
    w = torch.randn(7, 5, device=device)
    ref = torch.nn.Parameter(w.t().clone().t().t())  # transposed storage, shape [5, 7]
    ours = torch.nn.Parameter(ref.detach().clone().t().contiguous().t())
    assert ref.stride() == ours.stride() == (1, 5) and torch.equal(ref, ours)
    opt_ref = torch.optim.AdamW([ref], lr=1e-2)
    opt = titanmac_c.AdamW([ours], lr=1e-2)
    x = torch.randn(3, 7, device=device)
    for step in range(6):
        for p, o in ((ref, opt_ref), (ours, opt)):
            o.zero_grad()
            ((x @ p.t()) ** 2).sum().backward()
            assert p.grad.stride() == p.stride()
            o.step()
        torch.testing.assert_close(ours, ref, **tol(torch.float32, device))


def _groups(params, groups):
    if groups == "one":
        return params
    # two C calls (amsgrad differs): the full path's collection runs for both
    return [{"params": params[2:]}, {"params": params[:2], "amsgrad": True}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", ["one", "mixed-amsgrad"])
def test_gradients_in_another_layout_than_the_parameter_match_torch(device, groups):
    """A gradient assigned in another layout (NCHW against a channels_last weight, a column-major
    matrix against a row-major one, a strided slice): torch's ops pair elements by index, and so
    do we (the gradient copied into the parameter's layout for the step; .grad left as given)."""
    ref = _conv_model(device)
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(_groups(list(ref.parameters()), groups), lr=1e-2)
    opt = titanmac_c.AdamW(_groups(list(ours.parameters()), groups), lr=1e-2)
    for step in range(1, 7):
        for model in (ref, ours):
            _backward(model, step)
            if step % 2 == 0:
                model[0].weight.grad = model[0].weight.grad.contiguous()  # NCHW
                g = model[4].weight.grad
                model[4].weight.grad = g.t().contiguous().t()  # column-major
                model[4].bias.grad = torch.stack([g[:, 0], g[:, 1]], dim=1)[:, 0]  # stride 2
        given = [p.grad for p in ours.parameters()]
        values = [g.clone() for g in given]
        opt_ref.step()
        opt.step()
        for p, g, v in zip(ours.parameters(), given, values):
            assert p.grad is g and torch.equal(g, v)  # the gradients as they were
        for (name, pr), po in zip(ref.named_parameters(), ours.parameters()):
            assert po.stride() == pr.stride(), name
            torch.testing.assert_close(po, pr, **tol(torch.float32, device),
                                       msg=lambda m: f"step {step} {name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("saved_as, resumed_as", [("contiguous", "channels_last"),
                                                  ("channels_last", "contiguous")])
def test_checkpoint_resumes_in_another_memory_format_like_torch(device, saved_as, resumed_as):
    """A checkpoint written by a run in one memory format loads into a model in the other (its
    state tensors keep the saved strides, as torch's load_state_dict leaves them); the next steps
    match torch's, and our state is then in the parameter's layout."""
    fmt = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    first = _conv_model(device).to(memory_format=fmt[saved_as])
    opt_first = torch.optim.AdamW(first.parameters(), lr=1e-2)
    for step in range(1, 4):
        _backward(first, step)
        opt_first.step()
    saved = copy.deepcopy(opt_first.state_dict())
    ref = copy.deepcopy(first).to(memory_format=fmt[resumed_as])
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = titanmac_c.AdamW(ours.parameters(), lr=1e-2)
    opt_ref.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))
    assert ours[0].weight.stride() != saved["state"][0]["exp_avg"].stride()  # the case
    for step in range(4, 9):
        for name, pr, po in _step_both(step, ref, ours, opt_ref, opt):
            torch.testing.assert_close(po, pr, **tol(torch.float32, device),
                                       msg=lambda m: f"step {step} {name}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[po][key], opt_ref.state[pr][key],
                                           **tol(torch.float32, device))
                assert opt.state[po][key].stride() == po.stride()


def test_a_parameter_that_is_not_dense_is_stepped_in_place_as_torch():
    """Every other column of a buffer, with a gradient of the same kind: stepped through a
    contiguous copy written back where it lies, the columns between left alone, as torch's
    for-loop steps it."""
    buffers = []
    for cls in (titanmac_c.AdamW, torch.optim.AdamW):
        gen = torch.Generator().manual_seed(4)
        base = torch.randn(4, 12, generator=gen)
        p = torch.nn.Parameter(base[:, ::2])  # every other column: no order makes it contiguous
        opt = cls([p], lr=1e-2, **({} if cls is titanmac_c.AdamW else {"foreach": False}))
        for _ in range(3):
            p.grad = torch.randn(4, 12, generator=gen)[:, ::2]
            opt.step()
        buffers.append(base)
    torch.testing.assert_close(buffers[0], buffers[1], rtol=1e-6, atol=1e-7)


def _grads_in_layouts(device, strided=False):
    """Gradients of every dense layout: contiguous, transposed, channels_last; with strided, also
    two that no order makes dense (every other column, a column block of a transposed matrix)."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(9, 4, generator=gen).to(device),
             torch.randn(6, 5, generator=gen).to(device).t(),
             torch.randn(2, 3, 4, 5, generator=gen).to(device).contiguous(
                 memory_format=torch.channels_last)]
    if strided:
        grads += [torch.randn(7, 10, generator=gen).to(device)[:, ::2],
                  torch.randn(8, 6, generator=gen).to(device).t()[1:4]]
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, float("inf")])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_norm_functions_take_any_layout_like_torch(device, norm_type, strided):
    grads = _grads_in_layouts(device, strided)
    assert [g.is_contiguous() for g in grads] == [True] + [False] * (len(grads) - 1)
    torch.testing.assert_close(titanmac_c.get_total_norm(grads, norm_type),
                               torch.nn.utils.get_total_norm(grads, norm_type),
                               rtol=1e-6, atol=0)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    # the same values in the same strides, in memory of their own (a clone of a strided slice
    # would be contiguous)
    for pr, po, g, g_ours in zip(ref, ours, grads, _grads_in_layouts(device, strided)):
        pr.grad, po.grad = g, g_ours
        assert po.grad.stride() == g.stride()
    total_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type)
    total = titanmac_c.clip_grad_norm_(ours, 0.5, norm_type)
    torch.testing.assert_close(total, total_ref, rtol=1e-6, atol=0)
    for pr, po in zip(ref, ours):
        assert po.grad.stride() == pr.grad.stride()
        torch.testing.assert_close(po.grad, pr.grad, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_scales_strided_gradients_that_require_grad(device):
    """Gradients that are leaves requiring grad (create_graph=True leaves such): torch's clip
    runs under no_grad and scales them all; so does ours, the strided ones by torch's ops."""
    grads = _grads_in_layouts(device, strided=True)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for pr, po, g, g_ours in zip(ref, ours, grads, _grads_in_layouts(device, strided=True)):
        pr.grad, po.grad = g.requires_grad_(), g_ours.requires_grad_()
    total_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    torch.testing.assert_close(titanmac_c.clip_grad_norm_(ours, 0.5), total_ref, rtol=1e-6,
                               atol=0)
    for pr, po in zip(ref, ours):
        torch.testing.assert_close(po.grad.detach(), pr.grad.detach(), rtol=2e-6, atol=1e-7)


def test_group_norms_read_strided_tensors():
    """group_norms only reads: a strided slice and an expanded tensor go through a copy."""
    base = torch.randn(6, 8)
    tensors = [base[:, ::2], torch.randn(1).expand(5), base]
    out = titanmac_c.group_norms(tensors, tensors, group_of=[0, 1, 2], num_groups=3)
    expected = torch.stack([t.norm() for t in tensors])
    torch.testing.assert_close(out.grad, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.param, expected, rtol=1e-6, atol=0)


def test_an_expanded_gradient_is_measured_but_not_scaled_as_with_torch():
    """An expanded tensor (stride 0) has a norm over its logical elements, as torch's; scaling it
    in place is refused (torch raises as well), naming it, before any gradient is scaled."""
    expanded = torch.randn(1).expand(5)
    dense = torch.randn(4)
    torch.testing.assert_close(titanmac_c.get_total_norm([dense, expanded]),
                               torch.nn.utils.get_total_norm([dense, expanded]), rtol=1e-6, atol=0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))
    a.grad, b.grad = dense.clone(), expanded
    with pytest.raises(RuntimeError, match=r"^parameters\[1\]: its gradient is an expanded"):
        titanmac_c.clip_grad_norm_([a, b], 0.1)
    assert torch.equal(a.grad, dense)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.nn.utils.clip_grad_norm_([a, b], 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_clip_then_step_on_a_channels_last_model(device):
    """AdamW.clip_grad_norm_ (the coefficient applied as the step loads each gradient) against
    torch's clip_grad_norm_ then step."""
    ref = _conv_model(device)
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = titanmac_c.AdamW(ours.parameters(), lr=1e-2)
    for step in range(1, 6):
        _backward(ref, step)
        _backward(ours, step)
        total_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        total = opt.clip_grad_norm_(0.1)
        torch.testing.assert_close(total, total_ref, rtol=1e-6, atol=0)
        opt_ref.step()
        opt.step()
        for pr, po in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(po, pr, **tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_group_norms_take_dense_layouts(device):
    """group_norms, like the other functions: gradients and parameters in any dense layout, each
    tensor's norm against torch's."""
    grads = _grads_in_layouts(device)
    params = [g.flip(0) * 2 for g in grads]  # other values, the same layouts
    params = [p.t().contiguous().t() if i == 1 else p.contiguous(memory_format=torch.channels_last)
              if p.dim() == 4 else p for i, p in enumerate(params)]
    assert [p.is_contiguous() for p in params] == [True, False, False]
    out = titanmac_c.functional.group_norms(grads, params, group_of=[0, 1, 1], num_groups=2)
    for stats, tensors in ((out.grad, grads), (out.param, params)):
        expected = torch.stack([torch.linalg.vector_norm(tensors[0]),
                                torch.linalg.vector_norm(torch.stack(
                                    [torch.linalg.vector_norm(t) for t in tensors[1:]]))])
        torch.testing.assert_close(stats, expected, rtol=1e-6, atol=0)
