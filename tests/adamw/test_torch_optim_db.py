"""titanmac_c.AdamW against torch's own optimizer test inputs: the AdamW entry of optim_db
(torch.testing._internal.common_optimizers, shipped in torch's wheel), which torch's generic
optimizer suite (test/test_optim.py, TestOptimRenewed) runs every optimizer over.

- every input of the entry, with torch's global flag combinations (foreach, fused, maximize,
  capturable, differentiable), steps parameters of any strides as torch.optim.AdamW steps them;
- every error input raises the type and message torch's does, at construction or at the step;
- differentiable=True records the step for autograd as torch's differentiable AdamW does
  (gradients equal to torch's, gradcheck);
- parameters without gradients, or with zero ones, and parameters on the meta device, as torch.

torch's suite itself (its test file is not in the wheel) was run against ours with the entry's
class replaced; these are its checks restated, written for this package.
"""

import copy

import pytest
import torch

import titanmac_c
from conftest import DEVICES, REAL_OF, tol

common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers",
    reason="torch's test helpers need the expecttest package (the README's test command "
           "installs it)")
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum
ADAMW_INFO = next(info for info in common_optimizers.optim_db
                  if info.optim_cls is torch.optim.AdamW)


def optim_inputs(device, dtype=torch.float32):
    """The entry's inputs with torch's global flag combinations, as TestOptimRenewed takes them
    (capturable only where torch supports it: CUDA)."""
    return common_optimizers._get_optim_inputs_including_global_cliquey_kwargs(
        device, dtype, ADAMW_INFO)


def input_id(optim_input):
    return optim_input.desc.replace(" ", "_")


def strided_params(device, dtype):
    """Parameters of every layout a model can hand an optimizer: contiguous, transposed (dense
    in another order), and strided slices with gaps between their elements (views into larger
    tensors, whose other elements the step must leave alone)."""
    g = torch.Generator().manual_seed(5)
    bases = [torch.randn(10, 10, generator=g), torch.randn(6, 8, generator=g),
             torch.randn(4, 6, 5, generator=g), torch.randn(7, generator=g)]
    bases = [b.to(device=device, dtype=dtype) for b in bases]
    views = [bases[0][:, ::2], bases[1].t(), bases[2][1:3, ::2, 1:], bases[3]]
    return bases, views


def torch_for_loop(kwargs):
    """kwargs for torch's for-loop AdamW: its foreach and fused implementations compute the same
    step, but torch 2.13's fused CPU one writes a strided slice's step into the wrong elements
    (those of a contiguous tensor at the slice's address)."""
    return dict(kwargs, foreach=False, fused=False)


def run_both(kwargs, device, dtype, steps=4):
    """ours (with kwargs) and torch's for-loop AdamW on the same parameters of every layout,
    `steps` steps with the same gradients: (their bases, their parameters, the two
    optimizers)."""
    results = []
    for cls in (titanmac_c.AdamW, torch.optim.AdamW):
        bases, params = strided_params(device, dtype)
        opt = cls(params, **copy.deepcopy(kwargs if cls is titanmac_c.AdamW
                                          else torch_for_loop(kwargs)))
        g = torch.Generator().manual_seed(11)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype)
            opt.step()
        results.append((bases, params, opt))
    return results


@pytest.mark.parametrize("device", DEVICES)
def test_every_optim_db_input_steps_parameters_of_any_strides_as_torch(device):
    inputs = optim_inputs(device)
    checked = 0
    for optim_input in inputs:
        kwargs = optim_input.kwargs
        (ours_bases, ours_params, ours), (bases, params, theirs) = run_both(
            kwargs, device, torch.float32)
        what = f"{optim_input.desc}: {kwargs}"
        t = tol(torch.float32, device)
        for a, b in zip(ours_bases, bases):  # the elements between the slices' too
            torch.testing.assert_close(a, b, **t, msg=lambda m: f"{what}: {m}")
        for pa, pb in zip(ours_params, params):
            sa, sb = ours.state[pa], theirs.state[pb]
            assert sa.keys() == sb.keys(), what
            assert float(sa["step"]) == float(sb["step"]) == 4.0, what
            for key in sa.keys() - {"step"}:
                torch.testing.assert_close(sa[key], sb[key], **t,
                                           msg=lambda m: f"{what} {key}: {m}")
        checked += 1
    # 5 inputs, each also with fused and with differentiable (and capturable on CUDA)
    assert checked == len(inputs) >= 15


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.complex64])
def test_strided_parameters_of_other_dtypes_step_as_torch(dtype):
    """A slice with gaps of a float64, bfloat16 or complex parameter: stepped in place as torch's
    for-loop steps it, the elements between left alone."""
    for kwargs in ({"lr": 0.01}, {"amsgrad": True, "maximize": True, "weight_decay": 0.1}):
        (ours_bases, _, _), (bases, _, _) = run_both(kwargs, "cpu", dtype)
        t = tol(REAL_OF.get(dtype, dtype), "cpu")
        for a, b in zip(ours_bases, bases):
            torch.testing.assert_close(a, b, **t)


def test_an_expanded_parameter_is_refused_before_anything_changes():
    """Several elements on one memory location cannot be stepped in place: RuntimeError, as
    torch's in-place ops raise, with the state and the parameter as they were."""
    p = torch.randn(1, 4).expand(3, 4)
    p.grad = torch.randn(3, 4)
    before = p.clone()
    opt = titanmac_c.AdamW([p])
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\]: an expanded"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


@pytest.mark.parametrize("error_input", ADAMW_INFO.optim_error_inputs_func(
    device="cpu", dtype=torch.float32), ids=lambda e: e.optimizer_error_input.desc)
def test_every_optim_db_error_input_raises_as_torch(error_input):
    """torch's error inputs, with ours in place of torch's AdamW: the same exception type and
    message, at the same point (construction or step)."""
    optim_input = error_input.optimizer_error_input
    params, kwargs = optim_input.params, optim_input.kwargs

    def construct():
        return titanmac_c.AdamW(params, **kwargs)

    if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        if issubclass(error_input.error_type, Warning):
            with pytest.warns(error_input.error_type, match=error_input.error_regex):
                construct()
        else:
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                construct()
    else:
        opt = construct()
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            opt.step()


@pytest.mark.parametrize("kwargs, match", [
    ({"betas": (0, 0.99)}, "betas must be either both floats or both Tensors"),
    ({"betas": (torch.tensor([0.9]), torch.tensor(0.99)), "foreach": True},
     r"betas\[0\] as a Tensor is not supported"),
    ({"betas": (torch.tensor(0.9), torch.tensor([0.9, 0.9]))}, "more than one value is ambig"),
    ({"lr": 1e-3, "fused": True, "foreach": True}, "`fused` and `foreach` cannot be"),
    ({"fused": True, "differentiable": True}, "`fused` does not support `differentiable`"),
])
def test_constructor_refuses_what_torchs_refuses(kwargs, match):
    for cls in (torch.optim.AdamW, titanmac_c.AdamW):
        with pytest.raises((ValueError, RuntimeError), match=match) as caught:
            cls([torch.nn.Parameter(torch.ones(2))], **kwargs)
        if cls is torch.optim.AdamW:
            torch_type = caught.type
        else:
            assert caught.type is torch_type


def test_fused_refuses_complex_and_meta_parameters_at_their_first_step_as_torch():
    for p in (torch.randn(3, dtype=torch.complex64), torch.randn(3, device="meta")):
        p = torch.nn.Parameter(p)
        p.grad = torch.randn_like(p)
        for cls in (torch.optim.AdamW, titanmac_c.AdamW):
            with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be "
                                                   f"floating point Tensors.*{p.device.type}"):
                cls([p], fused=True).step()


def test_meta_parameters_step_as_torchs_without_values():
    """Meta tensors hold no values: the step makes their state (on the meta device) and
    refuses nothing, as torch's default AdamW; parameters beside them are stepped."""
    meta = torch.nn.Parameter(torch.randn(3, 4, device="meta"))
    real_ours = torch.nn.Parameter(torch.randn(5))
    real_torch = torch.nn.Parameter(real_ours.detach().clone())
    ours = titanmac_c.AdamW([meta, real_ours], lr=0.1)
    theirs = torch.optim.AdamW([meta, real_torch], lr=0.1, foreach=False)
    for step in range(3):
        g = torch.randn(5)
        meta.grad = torch.randn(3, 4, device="meta")
        real_ours.grad, real_torch.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(real_ours, real_torch, **tol(torch.float32, "cpu"))
    assert ours.state[meta]["exp_avg"].device.type == "meta"
    assert ours.state[meta]["exp_avg"].shape == meta.shape


# ------------------------------------------------------------------ differentiable=True


def differentiable_run(cls, dtype=torch.float64, steps=3, **kwargs):
    """A differentiable AdamW run over a non-leaf parameter (a function of p0), gradients that
    require grad: the gradients of parameter and state after `steps` steps with respect to p0
    and every step's gradient."""
    g = torch.Generator().manual_seed(3)
    p0 = torch.randn(6, generator=g, dtype=dtype, requires_grad=True)
    p = p0 * 1.0
    opt = cls([p], **dict({"lr": 0.1, "differentiable": True}, **kwargs))
    grads = []
    for _ in range(steps):
        grad = torch.randn(6, generator=g, dtype=dtype, requires_grad=True)
        grads.append(grad)
        p.grad = grad
        opt.step()
    state = opt.state[p]
    out = (p * torch.arange(6, dtype=dtype)).sum() + state["exp_avg"].sum() \
        + state["exp_avg_sq"].sum()
    return p.detach(), torch.autograd.grad(out, [p0, *grads])


@pytest.mark.parametrize("kwargs", [{}, {"weight_decay": 0.1, "maximize": True},
                                    {"amsgrad": True}, {"lr": torch.tensor(0.05)},
                                    {"betas": (torch.tensor(0.8), torch.tensor(0.99))}],
                         ids=["default", "wd_maximize", "amsgrad", "tensor_lr", "tensor_betas"])
def test_differentiable_step_has_torchs_values_and_gradients(kwargs):
    """differentiable=True: the step is torch's differentiable AdamW, so the values and the
    gradients through it (with respect to the parameter before the steps and to every
    gradient) are torch's, bit for bit."""
    steps = 1 if "amsgrad" in kwargs else 3  # torch's own amsgrad path cannot be differentiated
    # through more than one step (it writes max_exp_avg_sq in place)
    ours_p, ours_grads = differentiable_run(titanmac_c.AdamW, steps=steps, **kwargs)
    torch_p, torch_grads = differentiable_run(torch.optim.AdamW, steps=steps, **kwargs)
    assert torch.equal(ours_p, torch_p)
    for a, b in zip(ours_grads, torch_grads):
        assert torch.equal(a, b)
    assert any(g.abs().sum() > 0 for g in ours_grads[1:])


def test_differentiable_step_passes_gradcheck():
    """The derivatives autograd records through one step of a differentiable AdamW, checked
    against finite differences (float64), with respect to the parameter, the gradient and both
    moments."""
    def one_step(p, grad, exp_avg, exp_avg_sq):
        p = p.clone()
        opt = titanmac_c.AdamW([p], lr=0.1, weight_decay=0.05, differentiable=True)
        opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": exp_avg.clone(),
                        "exp_avg_sq": exp_avg_sq.clone()}
        p.grad = grad
        opt.step()
        return p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]

    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3)]
    inputs.append(torch.rand(5, generator=g, dtype=torch.float64) + 0.1)
    inputs = [t.requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(one_step, inputs)


def test_differentiable_and_fused_groups_in_one_optimizer():
    """A differentiable group beside an ordinary one: each stepped as torch steps it (the
    ordinary one by the C core). torch refuses a non-leaf parameter unless the optimizer's
    default is differentiable, and steps every group with grad mode on then, so the ordinary
    group holds a tensor that does not require grad."""
    def run(cls):
        g = torch.Generator().manual_seed(8)
        a = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) * 1.0
        b = torch.randn(5, generator=g, dtype=torch.float64)
        opt = cls([{"params": [a]}, {"params": [b], "differentiable": False}], lr=0.1,
                  differentiable=True)
        for _ in range(3):
            a.grad = torch.randn(4, generator=g, dtype=torch.float64)
            b.grad = torch.randn(5, generator=g, dtype=torch.float64)
            opt.step()
        return a.detach(), b.detach(), a.grad_fn is not None

    ours, theirs = run(titanmac_c.AdamW), run(torch.optim.AdamW)
    assert torch.equal(ours[0], theirs[0]) and ours[2]
    torch.testing.assert_close(ours[1], theirs[1], **tol(torch.float64, "cpu"))


@pytest.mark.parametrize("optim_input", optim_inputs("cpu"), ids=input_id)
def test_no_gradient_or_zero_gradients_as_torch(optim_input):
    """torch's test_step_is_noop_when_params_have_no_grad and ..._for_zero_grads: with no
    gradient nothing moves; with zero gradients AdamW's weight decay (and nothing else) does,
    as torch's; the optimizer prints."""
    kwargs = optim_input.kwargs
    results = []
    for cls in (titanmac_c.AdamW, torch.optim.AdamW):
        g = torch.Generator().manual_seed(2)
        # torch's differentiable step cannot write a leaf that requires grad
        requires_grad = not kwargs.get("differentiable", False)
        params = [torch.nn.Parameter(torch.randn(3, 4, generator=g), requires_grad),
                  torch.nn.Parameter(torch.randn(4, generator=g), requires_grad)]
        before = [p.detach().clone() for p in params]
        opt = cls(params, **copy.deepcopy(kwargs if cls is titanmac_c.AdamW
                                          else torch_for_loop(kwargs)))
        assert "AdamW" in repr(opt)
        opt.step()  # no gradients
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tol(torch.float32, "cpu"))
