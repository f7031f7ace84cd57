"""clip_grad_norm_ and get_total_norm against torch.nn.utils, element by element."""

import copy
import math

import numpy as np
import pytest
import torch

import titanmac_c
from conftest import DEVICES, SIZES, TOL, clone_params, make_params, set_grads

NORM_TYPES = [1.0, 2.0, math.inf, 3.0]


def _norm_tol(norm_type):
    """torch accumulates |x|^p in the tensor dtype; for p other than 1, 2 and inf its float32
    result is off by up to ~2e-5 relative (p = 3; p = 1.5: 1.4e-5 with one thread, whose
    accumulation order differs), where ours, reduced in double, matches a float64 reference to
    ~1e-7 (test_general_p_is_accurate)."""
    return dict(rtol=1e-5 if float(norm_type) in (1.0, 2.0, math.inf) else 1e-4, atol=0)


def _pair(device, dtype=torch.float32, scale=1.0, step=0):
    params_a = make_params(SIZES, device, dtype)
    params_b = clone_params(params_a)
    set_grads(params_a, params_b, step, scale)
    return params_a, params_b


def _assert_grads(params_a, params_b, dtype=torch.float32, tol=None):
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.grad, pb.grad, **(tol or TOL[dtype]), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])  # inf: measure without clipping
def test_clip_grad_norm_matches_torch(device, norm_type, max_norm):
    for step in range(3):  # several different gradient draws
        params_a, params_b = _pair(device, scale=0.1 * (step + 1), step=step)
        ours = titanmac_c.clip_grad_norm_(params_a, max_norm, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(params_b, max_norm, norm_type)
        assert ours.shape == theirs.shape == ()
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, **_norm_tol(norm_type))
        # The coefficient inherits torch's p = 3 norm error.
        p3_tol = dict(rtol=1e-4, atol=1e-7) if norm_type == 3.0 else None
        _assert_grads(params_a, params_b, tol=p3_tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_get_total_norm_matches_torch(device, norm_type):
    params, _ = _pair(device)
    tensors = [p.grad for p in params]
    ours = titanmac_c.get_total_norm(tensors, norm_type)
    theirs = torch.nn.utils.get_total_norm(tensors, norm_type)
    torch.testing.assert_close(ours, theirs, **_norm_tol(norm_type))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_general_p_is_accurate(device, norm_type):
    params, _ = _pair(device)
    tensors = [p.grad for p in params]
    ours = titanmac_c.get_total_norm(tensors, norm_type)
    exact = torch.nn.utils.get_total_norm([t.double() for t in tensors], norm_type)
    torch.testing.assert_close(ours.double(), exact, rtol=3e-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradients_like_torch(device, norm_type, bad):
    params_a, params_b = _pair(device)
    for ps in (params_a, params_b):
        ps[2].grad[7] = bad
    ours = titanmac_c.clip_grad_norm_(params_a, 1.0, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(params_b, 1.0, norm_type)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    _assert_grads(params_a, params_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_error_if_nonfinite_raises_and_leaves_grads(device, bad):
    params, twins = _pair(device)
    for ps in (params, twins):
        ps[1].grad[0] = bad
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        titanmac_c.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(twins, 1.0, error_if_nonfinite=True)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        titanmac_c.get_total_norm([p.grad for p in params], error_if_nonfinite=True)


@pytest.mark.parametrize("device", DEVICES)
def test_error_if_nonfinite_on_a_norm_only_the_gradients_dtype_overflows(device):
    """Finite fp16 gradients whose norm (84853) passes fp16's max: torch returns the norm in the
    gradients' dtype and raises on it; so do we (the float32 norm we compute is finite), with
    nothing scaled and, for the folded clip, nothing left pending."""
    def grads():
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16, device=device))
        p.grad = torch.full((2,), 60000.0, dtype=torch.float16, device=device)
        return p
    theirs, ours = grads(), grads()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_([theirs], 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        titanmac_c.clip_grad_norm_([ours], 1.0, error_if_nonfinite=True)
    assert torch.equal(ours.grad, theirs.grad)
    opt = titanmac_c.AdamW([ours], lr=0.1)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    opt.step()  # unclipped: the first AdamW step moves each element by lr
    torch.testing.assert_close(ours.detach(), torch.full_like(ours, -0.1), rtol=1e-3, atol=0)
    # without the flag the fp16 norm is returned (inf, as torch's) and clips by its
    # coefficient, 0, as torch's (tests/norms_clip/test_clip_returned_norm.py)
    ours, theirs = grads(), grads()
    assert math.isinf(titanmac_c.clip_grad_norm_([ours], 1.0))
    assert math.isinf(torch.nn.utils.clip_grad_norm_([theirs], 1.0))
    assert torch.equal(ours.grad, theirs.grad) and not ours.grad.any()


@pytest.mark.parametrize("device", DEVICES)
def test_error_if_nonfinite_passes_on_finite(device):
    params_a, params_b = _pair(device)
    ours = titanmac_c.clip_grad_norm_(params_a, 0.1, error_if_nonfinite=True)
    theirs = torch.nn.utils.clip_grad_norm_(params_b, 0.1, error_if_nonfinite=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    _assert_grads(params_a, params_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads(device, dtype):
    params_a, params_b = _pair(device, dtype)
    ours = titanmac_c.clip_grad_norm_(params_a, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(params_b, 0.5)
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, **TOL[dtype])
    _assert_grads(params_a, params_b, dtype)


def test_edge_cases_like_torch():
    assert float(titanmac_c.clip_grad_norm_([], 1.0)) == 0.0
    p = torch.nn.Parameter(torch.ones(3))
    assert float(titanmac_c.clip_grad_norm_(p, 1.0)) == 0.0  # no grad: nothing to clip
    p.grad = torch.full((3,), 2.0)
    total = titanmac_c.clip_grad_norm_(p, 1.0)  # a single tensor, not a list
    torch.testing.assert_close(total, torch.tensor(math.sqrt(12.0)))
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0 / (math.sqrt(12.0) + 1e-6)))
    q = torch.nn.Parameter(torch.ones(0))
    q.grad = torch.ones(0)
    assert float(titanmac_c.clip_grad_norm_([q], 1.0)) == 0.0
    assert float(titanmac_c.get_total_norm([])) == 0.0
    gen = (x for x in [p])  # generators are accepted, as in torch
    titanmac_c.clip_grad_norm_(gen, 1.0)
    with pytest.warns(UserWarning, match="empty generator") as record:  # torch's warning: a
        titanmac_c.clip_grad_norm_(gen, 1.0)  # model.parameters() generator used up
    assert record[0].filename == __file__
    with pytest.raises(TypeError, match=r"tensors\[1\]: expected a torch.Tensor, got float"):
        titanmac_c.get_total_norm([p.grad, 3.0])  # torch: TypeError too
    # another library's array (NumPy 2's has a .device, the string 'cpu'): torch's TypeError
    array = np.ones(3, dtype=np.float32)
    for call in (lambda: titanmac_c.get_total_norm([array]),
                 lambda: titanmac_c.functional.group_norms([p.grad, array])):
        with pytest.raises(TypeError, match=r"\[[01]\]: expected a torch.Tensor, got ndarray"):
            call()


@pytest.mark.parametrize("norm_type", ["inf", "2", "1.5"])
def test_norm_type_given_as_a_string_like_torch(norm_type):
    """torch's clip functions take float(norm_type), and their docs name 'inf'."""
    params_a, params_b = _pair("cpu")
    ours = titanmac_c.clip_grad_norm_(params_a, 0.5, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(params_b, 0.5, norm_type)
    torch.testing.assert_close(ours, theirs, **_norm_tol(norm_type))
    _assert_grads(params_a, params_b)
    grads = [p.grad for p in params_a]
    tol = _norm_tol(norm_type)
    torch.testing.assert_close(titanmac_c.get_total_norm(grads, norm_type),
                               torch.nn.utils.get_total_norm(grads, norm_type), **tol)
    opt = titanmac_c.AdamW(params_a)
    torch.testing.assert_close(opt.clip_grad_norm_(0.5, norm_type),
                               torch.nn.utils.get_total_norm(grads, norm_type), **tol)


@pytest.mark.parametrize("max_norm", ["0.5", "inf"])
def test_max_norm_given_as_a_string_like_torch(max_norm):
    """torch's clip_grad_norm_ takes float(max_norm) too."""
    params_a, params_b = _pair("cpu")
    ours = titanmac_c.clip_grad_norm_(params_a, max_norm)
    theirs = torch.nn.utils.clip_grad_norm_(params_b, max_norm)
    torch.testing.assert_close(ours, theirs, **_norm_tol(2.0))
    _assert_grads(params_a, params_b)
    opt = titanmac_c.AdamW(params_a)
    torch.testing.assert_close(opt.clip_grad_norm_(max_norm),
                               torch.nn.utils.get_total_norm([p.grad for p in params_a]),
                               **_norm_tol(2.0))
    with pytest.raises(ValueError, match=r"^max_norm = 'half': expected a number$"):
        titanmac_c.clip_grad_norm_(params_a, "half")


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -math.inf, math.nan, "-inf", "nan"])
def test_unsupported_norm_types_raise(norm_type):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="norm_type"):
        titanmac_c.clip_grad_norm_([p], 1.0, norm_type)
    assert torch.equal(p.grad, torch.ones(3))


@pytest.mark.parametrize("max_norm", [math.nan, -1.0, -math.inf])
def test_bad_max_norm_raises(max_norm):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="max_norm"):
        titanmac_c.clip_grad_norm_([p], max_norm)
    assert torch.equal(p.grad, torch.ones(3))


def test_clip_then_step_method_matches_torch_clip_and_adamw():
    """AdamW.clip_grad_norm_ folds the coefficient into the next step: same result as torch's
    clip_grad_norm_ followed by AdamW.step, over several steps."""
    params_a = make_params(SIZES, "cpu")
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW(params_b, lr=1e-3, weight_decay=0.01)
    for step in range(20):
        set_grads(params_a, params_b, step, scale=0.01 * (step % 4 + 1))
        norm_a = ours.clip_grad_norm_(1.0)
        norm_b = torch.nn.utils.clip_grad_norm_(params_b, 1.0)
        torch.testing.assert_close(norm_a, norm_b, rtol=1e-5, atol=0)
        ours.step()
        theirs.step()
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.state[pa]["exp_avg"], theirs.state[pb]["exp_avg"],
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("late", ["group_added", "appended", "unfrozen"])
def test_a_gradient_the_clip_did_not_see_is_not_clipped_like_torchs(late):
    """A parameter that gets its gradient after AdamW.clip_grad_norm_ and before the step: in a
    param group added then ("group_added"), appended to a group's list then ("appended"), or
    grouped from the start but without a gradient at the clip ("unfrozen"). torch's clip scaled
    only the gradients it saw, so the late one steps unclipped; ours multiplied the pending
    coefficient into every gradient of the step. Steps 0-1 without it (the plan's path), step 2
    brings it, steps 3-5 clip it too."""
    base = make_params([7, 33, 5], misaligned=False)
    late_param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 9))
    runs = []
    for cls in (torch.optim.AdamW, titanmac_c.AdamW):
        params, extra = clone_params(base), clone_params([late_param])[0]
        grouped = params + [extra] if late == "unfrozen" else list(params)
        runs.append((cls([{"params": grouped}], lr=0.1), params, extra))
    (theirs, params_t, late_t), (ours, params_o, late_o) = runs
    for step in range(6):
        set_grads(params_t, params_o, step, scale=10.0)
        torch.nn.utils.clip_grad_norm_([p for p in params_t + [late_t] if p.grad is not None],
                                       0.5)
        ours.clip_grad_norm_(0.5)
        if step == 2:
            for opt, extra in ((theirs, late_t), (ours, late_o)):
                if late == "group_added":
                    opt.add_param_group({"params": [extra]})
                elif late == "appended":
                    opt.param_groups[0]["params"].append(extra)
        if step >= 2:
            late_t.grad = torch.full((9,), 3.0)
            late_o.grad = torch.full((9,), 3.0)
        theirs.step()
        ours.step()
        for pt, po in zip(params_t + [late_t], params_o + [late_o]):
            torch.testing.assert_close(po, pt, rtol=1e-5, atol=1e-6, msg=lambda m: f"{step}: {m}")
            if pt in theirs.state:
                torch.testing.assert_close(ours.state[po]["exp_avg"], theirs.state[pt]["exp_avg"],
                                           rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("change", ["backward", "edit"])
def test_a_clipped_gradient_changed_in_place_steps_unclipped_with_a_warning(change):
    """Another backward accumulated onto the clipped gradients before the step (clipping each
    micro-batch of an accumulation), or an in-place edit of one (the weight's): torch's clip
    scaled the part before the change, clip(g1) + g2, which is no longer there to scale. Ours
    steps the changed gradients unclipped (g1 + g2) and warns, since that differs from torch's
    result; a gradient left as it was (the bias, after the edit) stays clipped, as torch's.
    Checked against torch's AdamW given those gradients."""
    torch.manual_seed(0)
    model_t = torch.nn.Linear(4, 1)
    model_o = copy.deepcopy(model_t)
    theirs = torch.optim.AdamW(model_t.parameters(), lr=0.1)
    ours = titanmac_c.AdamW(model_o.parameters(), lr=0.1)
    x1, x2 = torch.randn(8, 4) * 10, torch.randn(8, 4)
    for step in range(3):
        for model in (model_t, model_o):
            model(x1).pow(2).mean().backward()
        ours.clip_grad_norm_(0.1)
        if change == "backward":
            for model in (model_t, model_o):  # torch's: the unclipped sum
                model(x2).pow(2).mean().backward()
        else:
            unclipped = model_t.weight.grad.clone()
            torch.nn.utils.clip_grad_norm_(model_t.parameters(), 0.1)
            model_t.weight.grad = unclipped + 0.5  # torch's: the bias clipped, the weight not
            model_o.weight.grad.add_(0.5)
        edited = 2 if change == "backward" else 1
        with pytest.warns(UserWarning, match=f"{edited} of the clipped gradients changed in place"):
            ours.step()
        theirs.step()
        for pt, po in zip(model_t.parameters(), model_o.parameters()):
            torch.testing.assert_close(po, pt, rtol=1e-6, atol=1e-7, msg=lambda m: f"{step}: {m}")
        ours.zero_grad()
        theirs.zero_grad()


@pytest.mark.parametrize("max_norms", [(0.1, 1.0), (1.0, 0.1), (0.5, 0.5)])
def test_a_second_clip_before_the_step_composes_like_torchs(max_norms):
    """Two clip_grad_norm_ calls before one step (a framework's and the user's): torch's first
    clip leaves the gradients scaled, so the second measures them so and the smaller max_norm
    wins. Ours replaced the first coefficient with the second, measured on the unscaled
    gradients (clip to 0.1 then 1.0 clipped to 1.0). The returned norms, then the steps, over
    4 steps (the plan's path after the first)."""
    params_a = make_params([7, 33, 5], misaligned=False)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=0.1)
    theirs = torch.optim.AdamW(params_b, lr=0.1)
    for step in range(4):
        set_grads(params_a, params_b, step, scale=10.0)
        for max_norm in max_norms:
            norm_a = ours.clip_grad_norm_(max_norm)
            norm_b = torch.nn.utils.clip_grad_norm_(params_b, max_norm)
            torch.testing.assert_close(norm_a, norm_b, rtol=1e-5, atol=0)
        ours.step()
        theirs.step()
        for pa, pb in zip(params_a, params_b):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=lambda m: f"{step}: {m}")


def test_clip_method_with_a_precomputed_norm():
    """Stats + clip + AdamW as three calls: group_norms gives the total norm, the clip method
    reuses it; the result equals the clip method's own norm pass."""
    params_a = make_params(SIZES, "cpu")
    params_b = clone_params(params_a)
    ours_a = titanmac_c.AdamW(params_a, lr=1e-3)
    ours_b = titanmac_c.AdamW(params_b, lr=1e-3)
    for step in range(8):
        set_grads(params_a, params_b, step, scale=0.05)
        stats = titanmac_c.group_norms([p.grad for p in params_a], [p.detach() for p in params_a])
        n_a = ours_a.clip_grad_norm_(1.0, total_norm=stats.total_grad)
        n_b = ours_b.clip_grad_norm_(1.0)
        assert torch.equal(n_a, n_b)
        ours_a.step()
        ours_b.step()
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)


def test_clip_method_takes_the_norm_as_the_functions_return_it():
    """total_norm= as get_total_norm returns it (the gradients' dtype: bf16 here), a Python or
    NumPy number, a float64 tensor: the coefficient comes from its value (in float32, in double
    for a float64 one, as torch's clip_grads_with_norm_ computes it) and the result has its dtype;
    the step equals one given the same value as a tensor of that precision."""
    import numpy as np

    norm64 = torch.tensor(0.8125, dtype=torch.float64)
    for given in (0.8125, np.float32(0.8125), norm64, norm64.to(torch.bfloat16)):
        params_a = make_params(SIZES, "cpu", dtype=torch.bfloat16)
        params_b = clone_params(params_a)
        ours_a, ours_b = (titanmac_c.AdamW(ps, lr=1e-2) for ps in (params_a, params_b))
        for step in range(3):
            set_grads(params_a, params_b, step, scale=0.05)
            n_a = ours_a.clip_grad_norm_(0.5, total_norm=given)
            ours_b.clip_grad_norm_(0.5, total_norm=torch.tensor(
                0.8125, dtype=torch.float64 if given is norm64 else torch.float32))
            want = given.dtype if isinstance(given, torch.Tensor) else torch.float32
            assert n_a.dtype == want and float(n_a) == 0.8125 and n_a.shape == ()
            ours_a.step()
            ours_b.step()
        for a, b in zip(params_a, params_b):
            assert torch.equal(a, b)
    opt = titanmac_c.AdamW(params_a)
    with pytest.raises(TypeError, match="total_norm: expected a tensor or a number, got str"):
        opt.clip_grad_norm_(1.0, total_norm="1.0")
    with pytest.raises(ValueError, match="total_norm: expected one floating-point element"):
        opt.clip_grad_norm_(1.0, total_norm=torch.ones(2))
    with pytest.raises(ValueError, match="total_norm: expected one floating-point element"):
        opt.clip_grad_norm_(1.0, total_norm=torch.tensor(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_method_returns_the_norm_in_the_gradients_dtype_like_torch(dtype):
    """torch returns the norm in the gradients' dtype (summed in that dtype: for float16 it
    overflows here, so the value is compared with the float32 norm rounded to the dtype)."""
    params_a = make_params(SIZES, "cpu", dtype=dtype)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-3)
    for step in range(3):
        set_grads(params_a, params_b, step, scale=0.05)
        norm_a = ours.clip_grad_norm_(1.0)
        norm_b = torch.nn.utils.clip_grad_norm_(params_b, 1.0)
        assert norm_a.dtype == norm_b.dtype == dtype and norm_a.shape == norm_b.shape == ()
        exact = torch.linalg.vector_norm(torch.cat([p.grad.float().reshape(-1)
                                                    for p in params_a]))
        assert norm_a == exact.to(dtype)
        ours.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
def test_empty_gradients_count_zero_towards_every_norm(device, norm_type):
    """Empty gradients (numel 0) among others: the total norm and the clip are torch's over the
    non-empty ones (for the infinity norm torch raises whenever one is empty: docs/adamw.md,
    "Differences from torch"), and gradients that are all empty have norm 0, scaled by
    nothing."""
    torch.manual_seed(4)
    shapes = [(0,), (7,), (0, 3), (300,), (2, 0)]
    grads = [torch.randn(s, device=device) * 3 for s in shapes]
    nonempty = [g for g in grads if g.numel()]
    total = titanmac_c.get_total_norm(grads, norm_type)
    torch.testing.assert_close(total, torch.nn.utils.get_total_norm(nonempty, norm_type))

    ps = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in nonempty]
    for p, g in zip(theirs, nonempty):
        p.grad = g.clone()
    torch_total = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    ours = titanmac_c.clip_grad_norm_(ps, 1.0, norm_type)
    torch.testing.assert_close(ours, torch_total)
    for got, q in zip([p.grad for p in ps if p.numel()], theirs):
        torch.testing.assert_close(got, q.grad)
    assert float(ours) > 1.0  # the gradients were clipped

    empty = [torch.zeros(s, device=device) for s in shapes if 0 in s]
    assert float(titanmac_c.get_total_norm(empty, norm_type)) == 0.0
    eps = [torch.nn.Parameter(t.clone()) for t in empty]
    for p in eps:
        p.grad = torch.zeros_like(p)
    assert float(titanmac_c.clip_grad_norm_(eps, 1.0, norm_type)) == 0.0
