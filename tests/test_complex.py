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


def test_deep_nested_optimizer_refuses_complex():
    model = torch.nn.Linear(4, 3).to(torch.complex64)
    with pytest.raises(BufferError, match=r"parameter 'weight': dtype torch.complex64 is not "
                                          r"supported \(float32, bfloat16, float16, float64; .*"
                                          r"titanmac_c.AdamW also steps complex models"):
        titanmac_c.DeepNestedOptimizer(model)
    with pytest.raises(BufferError, match=r"supported \(float32, bfloat16, float16; .*"
                                          r"also steps float64 and complex models"):
        titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True)
