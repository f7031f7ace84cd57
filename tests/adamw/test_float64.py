"""float64 parameters (scientific models, gradient checks): AdamW, clipping and the norms compute
them in double, as torch does, element by element against torch over 20 steps; float64 mixed with
float32 in one optimizer; checkpoints both ways (tests/adamw/test_complex.py, with complex128
ones). The DeepNestedOptimizer trains float64 models in both modes (AdamW mode:
tests/deep_nested/test_deep_nested_layouts.py; CMS mode, whose buffers and update are float32 as
the reference's: tests/cms/test_deep_nested_cms.py and, op by op, tests/cms/test_cms_op.py)."""

import pytest
import torch

import titanmac_c
from conftest import (DEVICES, SIZES, assert_adamw_runs_agree, clone_params, run_pair,
                      set_grads)

STEPS = 20  # the clip loops' steps
SEED = 2000  # set_grads' first seed: this file's gradients
F64 = torch.float64


def float64_params(device, sizes=SIZES):
    """Parameters of true float64 values (not float32 ones widened), one a misaligned view."""
    params = [torch.nn.Parameter(torch.randn(n, dtype=F64, device=device)) for n in sizes]
    base = torch.randn(1 + 1000, dtype=F64, device=device)
    return params + [torch.nn.Parameter(base[1:])]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_matches_torch_in_double(device, amsgrad, maximize):
    params_a = float64_params(device)
    params_b = clone_params(params_a)
    groups = [dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999)),
              dict(lr=3e-3, weight_decay=0.01, betas=(0.8, 0.99)),
              dict(lr=2.5e-2, weight_decay=0.1, betas=(0.95, 0.9999))]
    kw = dict(amsgrad=amsgrad, maximize=maximize, eps=1e-8)
    ours = titanmac_c.AdamW([dict(g, params=params_a[k::3]) for k, g in enumerate(groups)], **kw)
    theirs = torch.optim.AdamW([dict(g, params=params_b[k::3]) for k, g in enumerate(groups)],
                               foreach=False, **kw)
    run_pair(ours, theirs, params_a, params_b, first_seed=SEED)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b)
    # the learning rate is not rounded to float32: a float32 lr of 2.5e-2 would move every
    # step's update by 5.6e-10 relative, far outside the float64 tolerance
    assert float(torch.tensor(2.5e-2, dtype=torch.float32)) != 2.5e-2


@pytest.mark.parametrize("device", DEVICES)
def test_float64_and_float32_in_one_optimizer(device):
    """One C call takes both: each parameter is computed in its own precision (the float32 ones
    reading the learning rate of the float64 call as torch's Python float). Clipping over both
    gives the float64 norm of all gradients (torch's clip_grad_norm_ takes each float32
    gradient's norm in float32 first, ours sums every square in double) and scales with torch's
    arithmetic for a float64 norm (clip_grads_with_norm_): the coefficient in double, cast to
    float32 for the float32 gradients."""
    params_a = float64_params(device, [3, 4097])
    params_a += [torch.nn.Parameter(torch.randn(n, device=device)) for n in (255, 65537)]
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.05)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(STEPS):
        set_grads(params_a, params_b, step, 0.05, SEED)
        n_ours = ours.clip_grad_norm_(1.0)
        n_exact = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1).to(F64)
                                                      for p in params_b]))
        torch.nn.utils.clip_grads_with_norm_(params_b, 1.0, n_exact, foreach=False)
        assert n_ours.dtype == F64
        torch.testing.assert_close(n_ours, n_exact, rtol=1e-13, atol=0)
        assert 1.0 / float(n_exact) < 0.5  # the clip is active
        ours.step()
        theirs.step()
    assert_adamw_runs_agree(ours, theirs, params_a, params_b)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_in_double(device):
    """titanmac_c.clip_grad_norm_ against torch's on float64 gradients: the norm in float64 and
    the gradients scaled in double (a coefficient rounded to float32 would move them by ~1e-8)."""
    params_a = float64_params(device)
    params_b = clone_params(params_a)
    for step in range(5):
        set_grads(params_a, params_b, step, first_seed=SEED)
        ours = titanmac_c.clip_grad_norm_(params_a, 0.5)
        theirs = torch.nn.utils.clip_grad_norm_(params_b, 0.5)
        assert ours.dtype == F64
        torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=0)
        for a, b in zip(params_a, params_b):
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-15, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_get_total_norm_in_double(device, norm_type):
    """The float64 norm is summed in double without a float32 rounding anywhere: against torch's
    (its own summation order, so within a few ulps), and an inf-norm exactly."""
    tensors = [p.detach() for p in float64_params(device)]
    tensors[2][7] = 1.0 + 2.0 ** -40  # a value float32 cannot hold
    ours = titanmac_c.get_total_norm(tensors, norm_type)
    theirs = torch.nn.utils.get_total_norm(tensors, norm_type)
    assert ours.dtype == F64
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=0)
    if norm_type == float("inf"):
        assert float(ours) == float(theirs)


def test_group_norms_in_double():
    grads = [p.detach() for p in float64_params("cpu", [3, 255, 4097])]
    params = [g * 2 for g in grads]
    out = titanmac_c.group_norms(grads, params, group_of=[0, 1, 1, 0], num_groups=2)
    assert out.grad.dtype == out.total_grad.dtype == out.nonfinite.dtype == F64
    for k, members in enumerate(([0, 3], [1, 2])):
        want = torch.linalg.vector_norm(torch.cat([grads[i] for i in members]))
        torch.testing.assert_close(out.grad[k], want, rtol=1e-13, atol=0)
        torch.testing.assert_close(out.param[k], 2 * want, rtol=1e-13, atol=0)
    assert float(out.nonfinite) == 0.0
    grads[1][0] = float("nan")
    assert float(titanmac_c.group_norms(grads).nonfinite) == 1.0


def test_deep_nested_optimizer_refuses_complex_in_cms_mode():
    """Both modes train float64 models (tests/deep_nested/test_deep_nested_layouts.py,
    tests/cms/test_deep_nested_cms.py); CMS mode refuses complex ones, which fail the reference's
    CMS update too (a complex gradient added into its float32 buffers)."""
    model = torch.nn.Linear(4, 3)
    model.weight = torch.nn.Parameter(model.weight.detach().to(torch.complex64))
    with pytest.raises(BufferError, match=r"parameter 'weight': dtype torch.complex64 is not "
                                          r"supported .*AdamW mode also trains complex"):
        titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True)

