"""Complex parameters (complex64, complex128): AdamW steps them as torch does, through the real
views of parameter, gradient and state, element by element against torch over 20 steps; the
2-norm clip of complex gradients; checkpoints both ways; what is refused, by name."""

import copy

import pytest
import torch

import titanmac_c
from conftest import (DEVICES, REAL_OF, assert_adamw_runs_agree, clone_params, run_pair,
                      set_grads)

STEPS = 20  # the clip loops' steps
SEED = 3000  # set_grads' first seed: this file's gradients


def complex_params(device, dtype, sizes=(3, 255, 4097)):
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype, device=device)) for n in sizes]
    # a complex matrix and a real parameter beside them, as a model mixing both has
    return params + [torch.nn.Parameter(torch.randn(16, 8, dtype=dtype, device=device)),
                     torch.nn.Parameter(torch.randn(65, device=device))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True)])
def test_adamw_matches_torch(device, dtype, amsgrad, maximize):
    params_a = complex_params(device, dtype)
    params_b = clone_params(params_a)
    kw = dict(lr=3e-3, weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    ours = titanmac_c.AdamW([{"params": params_a[:2]}, {"params": params_a[2:], "lr": 1e-2}],
                            **kw)
    theirs = torch.optim.AdamW([{"params": params_b[:2]}, {"params": params_b[2:], "lr": 1e-2}],
                               foreach=False, **kw)
    run_pair(ours, theirs, params_a, params_b, first_seed=SEED)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b)


@pytest.mark.parametrize("device", DEVICES)
def test_folded_clip_and_step_match_torch(device):
    """AdamW.clip_grad_norm_ over complex and real gradients: the 2-norm of them all (a complex
    gradient's is that of its real and imaginary parts), folded into the step."""
    params_a = complex_params(device, torch.complex64)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, foreach=False)
    for step in range(STEPS):
        set_grads(params_a, params_b, step, first_seed=SEED)
        n_ours = ours.clip_grad_norm_(1.0)
        n_theirs = torch.nn.utils.clip_grad_norm_(params_b, 1.0)
        assert n_ours.dtype == n_theirs.dtype == torch.float32
        torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
        assert float(n_ours) > 1.0  # the clip acts
        ours.step()
        theirs.step()
    assert_adamw_runs_agree(ours, theirs, params_a, params_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_clip_grad_norm_and_get_total_norm(device, dtype):
    params_a = complex_params(device, dtype)
    params_b = clone_params(params_a)
    set_grads(params_a, params_b, 0, first_seed=SEED)
    grads = [p.grad.clone() for p in params_a]
    n_ours = titanmac_c.get_total_norm(grads)
    torch.testing.assert_close(n_ours, torch.nn.utils.get_total_norm(grads), rtol=1e-6, atol=0)
    assert n_ours.dtype == REAL_OF[dtype]  # the promoted real dtype, as torch's
    n_ours = titanmac_c.clip_grad_norm_(params_a, 0.5)
    n_theirs = torch.nn.utils.clip_grad_norm_(params_b, 0.5)
    torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
    for a, b in zip(params_a, params_b):
        assert a.grad.dtype == b.grad.dtype
        # torch takes the float32 parameter's norm in float32, so its coefficient, and every
        # gradient scaled by it, is float32-exact only
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def _conjugate_bit_grads(params, step):
    """Gradients as autograd leaves them for a loss through x.conj(): tensors with the lazy
    conjugate bit (their memory holds the conjugates of their values)."""
    gen = torch.Generator().manual_seed(SEED + 500 + step)
    for p in params:
        p.grad = None
        y = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        (p.conj() * y).real.sum().backward()
        assert p.grad.is_conj() == p.is_complex()


def test_gradients_with_the_conjugate_bit():
    """torch's get_total_norm and clip_grad_norm_ (foreach=False) take them, and so do ours;
    torch's AdamW refuses them, ours steps their values (against torch given resolved copies)."""
    params_a = complex_params("cpu", torch.complex64)
    params_b = clone_params(params_a)
    _conjugate_bit_grads(params_a, 0)
    for a, b in zip(params_a, params_b):
        b.grad = a.grad.clone()
    grads = [p.grad for p in params_a]
    torch.testing.assert_close(titanmac_c.get_total_norm(grads),
                               torch.nn.utils.get_total_norm(grads), rtol=1e-6, atol=0)
    n_ours = titanmac_c.clip_grad_norm_(params_a, 0.5)
    n_theirs = torch.nn.utils.clip_grad_norm_(params_b, 0.5, foreach=False)
    torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
    for a, b in zip(params_a, params_b):
        assert a.grad.is_conj() == a.is_complex()  # scaled where it lies
        torch.testing.assert_close(a.grad.resolve_conj(), b.grad.resolve_conj(), rtol=1e-6,
                                   atol=1e-7)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.05)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(STEPS):
        _conjugate_bit_grads(params_a, step)
        for a, b in zip(params_a, params_b):
            b.grad = a.grad.resolve_conj().clone()
        assert float(ours.clip_grad_norm_(1.0)) > 1.0  # folded, over the memory's values
        torch.nn.utils.clip_grad_norm_(params_b, 1.0)
        ours.step()
        theirs.step()
    assert_adamw_runs_agree(ours, theirs, params_a, params_b)


def test_other_norms_of_complex_tensors_are_refused_by_name():
    """torch's 1-norm and inf-norm of a complex tensor take |z| per element, which is not a norm
    of the real view: refused, nothing scaled."""
    params = complex_params("cpu", torch.complex64)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"^parameters\[0\]: complex \(torch.complex64\); "
                                         r"titanmac_c takes complex tensors for the 2-norm only, "
                                         r"not norm_type = 1.0$"):
        titanmac_c.clip_grad_norm_(params, 0.5, norm_type=1)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
    with pytest.raises(ValueError, match=r"^tensors\[1\]: complex"):
        titanmac_c.get_total_norm([torch.ones(3), torch.ones(3, dtype=torch.complex64)],
                                  float("inf"))
    opt = titanmac_c.AdamW(params)
    with pytest.raises(ValueError, match=r"^grads\[0\]: complex"):
        opt.clip_grad_norm_(0.5, norm_type=3)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_between_torch_and_ours(device):
    """torch.optim.AdamW's checkpoint of complex128, float64 and float32 parameters loads into
    ours and the runs go on together; ours (complex state for complex parameters) loads into
    torch the same way."""
    params_a = complex_params(device, torch.complex128)
    params_a += [torch.nn.Parameter(torch.randn(n, dtype=torch.float64, device=device))
                 for n in (255, 4097)]
    params_b = clone_params(params_a)
    first = titanmac_c.AdamW(params_a, lr=1e-2, amsgrad=True)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, amsgrad=True, foreach=False)
    for step in range(3):
        set_grads(params_a, params_b, step, first_seed=SEED)
        first.step()
        theirs.step()
    ours = titanmac_c.AdamW(params_a, lr=1e-2, amsgrad=True)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    back = torch.optim.AdamW(params_b, lr=1e-2, amsgrad=True, foreach=False)
    back.load_state_dict(copy.deepcopy(first.state_dict()))
    for step in range(3, 10):
        set_grads(params_a, params_b, step, first_seed=SEED)
        ours.step()
        back.step()
    assert_adamw_runs_agree(ours, back, params_a, params_b)


class _ComplexNet(torch.nn.Module):
    """Two complex linear maps and a real bias; with conj the second map reads its weight
    through conj(), so autograd leaves that gradient with the lazy conjugate bit."""

    def __init__(self, dtype, conj=False):
        super().__init__()
        self.conj = conj
        self.first = torch.nn.Linear(6, 8, dtype=dtype)
        self.second = torch.nn.Parameter(torch.randn(3, 8, dtype=dtype) * 0.3)
        self.shift = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        second = self.second.conj() if self.conj else self.second
        return self.first(x) @ second.t() + self.shift


def _complex_batch(step, dtype, device):
    gen = torch.Generator().manual_seed(SEED + step)
    return torch.randn(5, 6, generator=gen, dtype=dtype).to(device)


def _step(model, opt, step, resolve=False):
    opt.zero_grad()
    loss = model(_complex_batch(step, model.second.dtype, model.shift.device)).abs().square()
    loss.mean().backward()
    if resolve:
        for p in model.parameters():
            p.grad = p.grad.resolve_conj()
    opt.step(loss.mean().item())


DNO_KW = dict(max_grad_norm=0.05, weight_decay=0.01, meta_update_freq=5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("hooks", [False, True], ids=["fused", "step-hook"])
def test_deep_nested_optimizer_trains_a_complex_model_as_the_reference(device, dtype, hooks):
    """AdamW mode: the statistics take the complex tensors' 2-norms (of their real views, as
    torch's norm), the clip (folded, or in memory before a step hook) scales both parts, and
    AdamW steps them as torch's; every parameter and the multipliers against the reference over
    15 steps with the clip active and a meta-update. CMS mode refuses complex models."""
    from conftest import reference_and_ours
    torch.manual_seed(0)
    (model_r, ref), (model_o, ours) = reference_and_ours(_ComplexNet(dtype).to(device), **DNO_KW)
    if hooks:
        for opt in (ref, ours):
            opt.base_optimizer.register_step_pre_hook(lambda *args: None)
    rtol = 1e-5 if dtype == torch.complex64 else 1e-6  # the rates are float32 (docs/adamw.md)
    for step in range(1, 16):
        _step(model_r, ref, step)
        _step(model_o, ours, step)
        for (name, pr), po in zip(model_r.named_parameters(), model_o.parameters()):
            torch.testing.assert_close(po.detach(), pr.detach(), rtol=rtol, atol=1e-7,
                                       msg=lambda m: f"step {step} {name}: {m}")
        torch.testing.assert_close(ours.get_lr_multipliers(), ref.get_lr_multipliers(),
                                   rtol=1e-5, atol=1e-7)
    assert float(ours._control.coef) < 1.0  # the clip mattered
    with pytest.raises(BufferError, match=r"parameter 'second': dtype torch.complex\d+ "
                                          r"is not supported \(float32, bfloat16, float16, "
                                          r"float64; .*AdamW mode also trains complex models"):
        titanmac_c.DeepNestedOptimizer(_ComplexNet(dtype), use_cms_updates=True)


@pytest.mark.parametrize("hooks", [False, True], ids=["fused", "step-hook"])
def test_deep_nested_optimizer_takes_gradients_with_the_conjugate_bit(hooks):
    """Gradients with the lazy conjugate bit (the reference's foreach clip raises on them) train
    bitwise as the same gradients materialized."""
    runs = []
    for resolve in (False, True):
        torch.manual_seed(0)
        model = _ComplexNet(torch.complex64, conj=True)
        opt = titanmac_c.DeepNestedOptimizer(model, **DNO_KW)
        if hooks:
            opt.base_optimizer.register_step_pre_hook(lambda *args: None)
        for step in range(1, 11):
            _step(model, opt, step, resolve)
            assert model.second.grad.is_conj() != resolve
        runs.append(model)
    for pa, pb in zip(*(m.parameters() for m in runs)):
        assert torch.equal(pa, pb)
