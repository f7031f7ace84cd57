"""A parameter whose shape changed since its state was made (`p.data = p.data.reshape(...)`,
`p.data = torch.randn(...)` of another shape, the same element count) is refused by the step:
ValueError naming the parameter and both shapes, and nothing written (parameter, gradient,
state, step count). torch's AdamW refuses it too (its ops cannot pair the two shapes). The C core
compares the shapes the binding passes on (tm_tensor.shape), so the cached plan's steps are
checked as the full collection's are; a step of several C calls checks it in Python first."""

import copy

import pytest
import torch

import titanmac_c
from conftest import DEVICES, assert_adamw_runs_agree, tol


def _twins(device, shapes, amsgrad=False, groups=None):
    """Ours and torch's AdamW over twin parameters of these shapes (groups: each parameter's
    group, one group per distinct value, amsgrad alternating between groups when given)."""
    torch.manual_seed(0)
    params_a = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    groups = groups or [0] * len(shapes)

    def grouped(params):
        return [{"params": [p for p, g in zip(params, groups) if g == k],
                 "amsgrad": amsgrad if k % 2 == 0 else not amsgrad}
                for k in sorted(set(groups))]

    kw = dict(lr=1e-2, weight_decay=0.01)
    return (params_a, params_b, titanmac_c.AdamW(grouped(params_a), **kw),
            torch.optim.AdamW(grouped(params_b), **kw))


def _grads(params_a, params_b, step):
    gen = torch.Generator().manual_seed(100 + step)
    for pa, pb in zip(params_a, params_b):
        g = torch.randn(pa.shape, generator=gen)
        pa.grad, pb.grad = g.to(pa.device), g.clone().to(pb.device)


def _run(ours, theirs, params_a, params_b, steps, first=0):
    for step in range(first, first + steps):
        _grads(params_a, params_b, step)
        ours.step()
        theirs.step()
        assert_adamw_runs_agree(ours, theirs, params_a, params_b)


def _snapshot(opt, params):
    """Every tensor a refused step must leave as it was: parameters, gradients, every state
    entry (the step counts included), cloned."""
    return ([p.detach().clone() for p in params],
            [None if p.grad is None else p.grad.clone() for p in params],
            {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state})


def _assert_unchanged(opt, params, snapshot):
    values, grads, state = snapshot
    for i, (p, v, g) in enumerate(zip(params, values, grads)):
        assert p.shape == v.shape and torch.equal(p.detach(), v), f"parameter {i} changed"
        assert torch.equal(p.grad, g), f"gradient {i} changed"
    assert {id(p) for p in opt.state} == set(state), "state entries were added or removed"
    for p in opt.state:
        for k, v in state[id(p)].items():
            now = opt.state[p][k]
            assert now.shape == v.shape and torch.equal(now, v), f"state {k!r} changed"


def _new_value(p, how):
    """p's values in the shape (6, 4) of a (4, 6) parameter, as the user would make them."""
    if how == "reshape":
        return p.data.reshape(6, 4)
    if how == "transposed_copy":
        return p.data.t().contiguous()
    return torch.randn(6, 4, device=p.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["reshape", "transposed_copy", "new_tensor"])
@pytest.mark.parametrize("grad_shape", ["new", "old"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_reshaped_parameter_is_refused_and_nothing_changes(device, how, grad_shape, amsgrad):
    """Three steps against torch's AdamW (the last through the cached plan), then the (4, 6)
    parameter given (6, 4) values: both optimizers refuse the step; ours with ValueError naming
    the parameter and the two shapes, writing nothing. Given its old shape back, it steps on as
    torch's twin that never saw the refused step (torch's own raises after counting the step)."""
    params_a, params_b, ours, theirs = _twins(device, [(3,), (4, 6), (5, 2)], amsgrad)
    _run(ours, theirs, params_a, params_b, steps=3)
    assert ours._plan is not None  # the refused step would run through the cached plan
    p, q = params_a[1], params_b[1]
    kept = p.detach().clone()
    p.data, q.data = _new_value(p, how), _new_value(q, how)
    if grad_shape == "new":
        _grads(params_a, params_b, 3)
        # the state the step reads first after the gradient: the first with the old shape
        bad = r"exp_avg\[1\]: shape \[4, 6\] does not match params\[1\] shape \[6, 4\]"
    else:  # the gradient of the last step, still (4, 6)
        bad = r"grads\[1\]: shape \[4, 6\] does not match params\[1\] shape \[6, 4\]"
    with pytest.raises(RuntimeError):
        theirs.step()
    before = _snapshot(ours, params_a)
    with pytest.raises(ValueError, match=bad + r" \(param_groups\[0\]\['params'\]\[1\]\)"):
        ours.step()
    _assert_unchanged(ours, params_a, before)

    # torch's failed step counted itself: compare with a twin of ours that did not take it
    p.data = kept
    twin_b = [torch.nn.Parameter(x.detach().clone()) for x in params_a]
    twin = torch.optim.AdamW([{"params": twin_b, "amsgrad": amsgrad}], lr=1e-2, weight_decay=0.01)
    twin.load_state_dict(copy.deepcopy(ours.state_dict()))  # a load shares the moments
    _run(ours, twin, params_a, twin_b, steps=3, first=4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_reshaped_parameter_in_a_step_of_several_calls_is_refused_before_any(device):
    """Two groups of different amsgrad step through two C calls: the parameter of the second
    group reshaped is found before the first call runs, so the first group is not stepped
    either (its parameters and state as before)."""
    params_a, params_b, ours, theirs = _twins(device, [(3,), (7,), (4, 6)], groups=[0, 0, 1])
    _run(ours, theirs, params_a, params_b, steps=3)
    params_a[2].data = params_a[2].data.reshape(6, 4)
    params_b[2].data = params_b[2].data.reshape(6, 4)
    _grads(params_a, params_b, 3)
    with pytest.raises(RuntimeError):
        theirs.step()
    before = _snapshot(ours, params_a)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*shape"):
        ours.step()
    _assert_unchanged(ours, params_a, before)


@pytest.mark.parametrize("device", DEVICES)
def test_same_shape_and_numel_keeps_stepping(device):
    """The check compares shapes, not values: a parameter given new values of its own shape
    (`p.data = ...`) steps on with its state, as torch's, element by element."""
    params_a, params_b, ours, theirs = _twins(device, [(4, 6), (1, 24)])
    _run(ours, theirs, params_a, params_b, steps=2)
    new = torch.randn(4, 6, device=device)
    params_a[0].data, params_b[0].data = new.clone(), new.clone()
    _run(ours, theirs, params_a, params_b, steps=3, first=2)
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.detach(), pb.detach(), **tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_entry_of_another_shape_written_into_the_state_is_refused(device):
    """A state tensor replaced by one of the same numel and another shape (code that edits
    opt.state): refused by name, as the reshaped parameter."""
    params_a, params_b, ours, theirs = _twins(device, [(4, 6)], amsgrad=True)
    _run(ours, theirs, params_a, params_b, steps=2)
    p = params_a[0]
    ours.state[p]["max_exp_avg_sq"] = ours.state[p]["max_exp_avg_sq"].reshape(2, 12).clone()
    _grads(params_a, params_b, 2)
    before = _snapshot(ours, params_a)
    with pytest.raises(ValueError, match=r"max_exp_avg_sq\[0\]: shape \[2, 12\] does not match "
                       r"params\[0\] shape \[4, 6\] \(param_groups\[0\]\['params'\]\[0\]\)"):
        ours.step()
    _assert_unchanged(ours, params_a, before)


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"])
def test_load_state_dict_with_state_of_another_shape_is_refused(key):
    """A checkpoint whose state tensor has the parameter's numel but another shape: refused by
    load_state_dict, naming the parameter, the entry and both shapes, with the optimizer's own
    state (made by earlier steps) left as it was; the same checkpoint reshaped loads and steps
    as torch's AdamW loaded with it."""
    params_a, params_b, ours, theirs = _twins("cpu", [(3,), (4, 6)], amsgrad=True)
    _run(ours, theirs, params_a, params_b, steps=2)
    saved = copy.deepcopy(theirs.state_dict())  # a load shares the moments: each its own
    bad = copy.deepcopy(saved)
    bad["state"][1][key] = bad["state"][1][key].reshape(6, 4).clone()
    _grads(params_a, params_b, 2)
    before = _snapshot(ours, params_a)
    with pytest.raises(ValueError, match=rf"load_state_dict: param_groups\[0\]\['params'\]\[1\]: "
                       rf"{key} has shape \(6, 4\), but the parameter has shape \(4, 6\)"):
        ours.load_state_dict(bad)
    _assert_unchanged(ours, params_a, before)
    bad["state"][1][key] = bad["state"][1][key].reshape(4, 6)
    ours.load_state_dict(bad)
    theirs.load_state_dict(saved)
    _run(ours, theirs, params_a, params_b, steps=3, first=2)
