"""titanmac_c.AdamW against torch.optim.AdamW, element by element, over 20+ steps."""

import copy

import numpy as np
import pytest
import torch

import titanmac_c
from conftest import (DEVICES, SIZES, assert_adamw_runs_agree, clone_params, make_params,
                      run_pair, set_grads, tol)


def groups_of(params, lrs, weight_decays, betas=None):
    """Split params round-robin into len(lrs) groups with their own lr / weight decay / betas."""
    n = len(lrs)
    groups = []
    for k in range(n):
        g = {"params": params[k::n], "lr": lrs[k], "weight_decay": weight_decays[k]}
        if betas is not None:
            g["betas"] = betas[k]
        groups.append(g)
    return groups


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_parity_fp32_groups(device, amsgrad, maximize):
    params_a = make_params(SIZES, device)
    params_b = clone_params(params_a)
    lrs, wds = [1e-3, 3e-3, 5e-4], [0.0, 0.01, 0.1]
    betas = [(0.9, 0.999), (0.8, 0.99), (0.95, 0.9999)]
    kw = dict(amsgrad=amsgrad, maximize=maximize, eps=1e-8)
    ours = titanmac_c.AdamW(groups_of(params_a, lrs, wds, betas), **kw)
    theirs = torch.optim.AdamW(groups_of(params_b, lrs, wds, betas), **kw)
    run_pair(ours, theirs, params_a, params_b)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_parity_tensor_lr_and_scheduler(device):
    params_a = make_params([3, 255, 4097], device)
    params_b = clone_params(params_a)
    lr = torch.tensor(2e-3)
    ours = titanmac_c.AdamW(params_a, lr=lr, weight_decay=0.05)
    theirs = torch.optim.AdamW(params_b, lr=lr.clone(), weight_decay=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (ours, theirs)]
    run_pair(ours, theirs, params_a, params_b, steps=25, sched=scheds)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
    assert float(ours.param_groups[0]["lr"]) == pytest.approx(2e-3 * 0.5 ** 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_lr", [np.float32, np.array], ids=["numpy_scalar", "numpy_0d"])
def test_parity_numpy_lr(device, make_lr):
    """An lr read from a numpy config (a numpy scalar or a 0-d array) steps as torch's AdamW
    steps it."""
    params_a = make_params([3, 255, 4097], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=make_lr(2e-3), weight_decay=0.05)
    theirs = torch.optim.AdamW(params_b, lr=make_lr(2e-3), weight_decay=0.05)
    run_pair(ours, theirs, params_a, params_b)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_betas_stay_tensors_and_a_schedule_changing_them_in_place_acts(device):
    """betas given as tensors stay tensors in the groups (0-d, as torch keeps them) and are read
    at every step: a momentum schedule that changes them in place acts as on torch's."""
    params_a = make_params([3, 4097], device)
    params_b = clone_params(params_a)
    betas_a = (torch.tensor([0.9]), torch.tensor(0.999))
    betas_b = tuple(b.clone() for b in betas_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, betas=betas_a, weight_decay=0.05)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, betas=betas_b, weight_decay=0.05,
                               foreach=False)
    for group in (ours.param_groups[0], theirs.param_groups[0]):
        assert all(isinstance(b, torch.Tensor) and b.dim() == 0 for b in group["betas"])
    for step in range(8):
        set_grads(params_a, params_b, step)
        ours.step()
        theirs.step()
        for group in (ours.param_groups[0], theirs.param_groups[0]):
            group["betas"][0].mul_(0.5)  # in place: the group keeps the same tensor
            group["betas"][1].sub_(0.01)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


def test_tensor_betas_on_the_cpu_changed_without_a_version_bump_act():
    """Writes through .data or NumPy bump no version counter; a CPU tensor beta is read at every
    step (no sync to save), so they act as on torch's."""
    params_a = make_params([5, 300], "cpu")
    params_b = clone_params(params_a)
    opts = [cls(ps, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)), **kw)
            for cls, ps, kw in ((titanmac_c.AdamW, params_a, {}),
                                (torch.optim.AdamW, params_b, dict(foreach=False)))]
    for step in range(6):
        set_grads(params_a, params_b, step)
        for opt in opts:
            opt.step()
            beta1, beta2 = opt.param_groups[0]["betas"]
            beta1.data.fill_(0.3 * (step % 2))
            beta2.numpy()[...] = 0.99 - 0.01 * step
    assert_adamw_runs_agree(*opts, params_a, params_b, tol(torch.float32, "cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_schedule_installing_new_tensor_betas_keeps_no_old_one_alive(device):
    """A momentum schedule that assigns fresh tensors each step: each is read, and the ones
    replaced are freed (the optimizer keeps none of them)."""
    import gc
    import weakref

    params_a = make_params([3, 1000], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, foreach=False)
    old = []
    for step in range(12):
        set_grads(params_a, params_b, step)
        for opt in (ours, theirs):
            opt.param_groups[0]["betas"] = (torch.tensor(0.9 - 0.05 * step, device=device),
                                            torch.tensor(0.999 - 0.001 * step, device=device))
        old.extend(weakref.ref(b) for b in ours.param_groups[0]["betas"])
        ours.step()
        theirs.step()
    gc.collect()
    assert sum(r() is not None for r in old) == 2  # the two the group holds now
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_parity_float_lr_cosine_schedule(device):
    params_a = make_params([65537, 7], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20) for o in (ours, theirs)]
    run_pair(ours, theirs, params_a, params_b, steps=22, sched=scheds)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule", [True, False])
def test_group_values_assigned_between_steps_act_as_on_torch(device, schedule):
    """Hyperparameters assigned anew between steps (OneCycleLR cycles betas[0] with the rate;
    eps, weight_decay and maximize changed by hand, some back to an earlier value; without the
    schedule lr and betas too, and every other value stays the same from step to step, so a
    value left out of the remembered check of a group would go unnoticed): each step uses the
    values of its groups, compared with torch's after every step."""
    params_a = make_params([3, 4097], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW([{"params": params_a[:1]}, {"params": params_a[1:]}], lr=1e-2)
    theirs = torch.optim.AdamW([{"params": params_b[:1]}, {"params": params_b[1:]}], lr=1e-2)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=30,
                                                  cycle_momentum=True) for o in (ours, theirs)]
    edits = {4: ("eps", 1e-3), 7: ("weight_decay", 0.3), 9: ("maximize", True),
             12: ("eps", 1e-8), 14: ("maximize", False), 17: ("weight_decay", 0.01)}
    if not schedule:
        scheds = None
        edits.update({2: ("lr", 3e-3), 5: ("betas", (0.8, 0.99)), 11: ("betas", (0.9, 0.999)),
                      16: ("lr", 1e-2)})
    for step in range(20):
        if step in edits:
            key, value = edits[step]
            for opt in (ours, theirs):
                opt.param_groups[step % 2][key] = value
        run_pair(ours, theirs, params_a, params_b, steps=1, sched=scheds, first_seed=step)
        assert ours.param_groups[0]["betas"] == theirs.param_groups[0]["betas"]
        assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_parity_low_precision(device, dtype, amsgrad):
    """bf16/fp16 parameters and state: math in fp32, one rounding per store, like torch's fused
    AdamW (torch's for-loop rounds after every op, so fused is the reference here)."""
    params_a = make_params([1, 255, 4097, 65537], device, dtype)
    params_b = clone_params(params_a)
    kw = dict(lr=1e-2, weight_decay=0.01, amsgrad=amsgrad)
    ours = titanmac_c.AdamW(params_a, **kw)
    theirs = torch.optim.AdamW(params_b, fused=True, **kw)
    run_pair(ours, theirs, params_a, params_b)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_optimizer(device):
    params_a = (make_params([300], device, torch.float32, misaligned=False)
                + make_params([300], device, torch.bfloat16, misaligned=False)
                + make_params([300], device, torch.float16, misaligned=False))
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, fused=True)
    run_pair(ours, theirs, params_a, params_b, steps=10)
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa.detach(), pb.detach(), **tol(pa.dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_what_torch_accepts_zero_size_no_grad_empty_group(device):
    """Zero-size parameters, parameters without gradients and empty groups behave as in torch."""
    sizes = [0, 5, 0, 17]
    params_a = make_params(sizes, device, misaligned=False)
    params_b = clone_params(params_a)
    extra_a = torch.nn.Parameter(torch.randn(4, device=device))
    extra_b = torch.nn.Parameter(extra_a.detach().clone())
    ours = titanmac_c.AdamW([{"params": params_a}, {"params": []}, {"params": [extra_a]}])
    theirs = torch.optim.AdamW([{"params": params_b}, {"params": []}, {"params": [extra_b]}])
    for step in range(7):
        set_grads(params_a, params_b, step)  # extra_* never gets a gradient
        ours.step()
        theirs.step()
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
    assert extra_a not in ours.state and extra_b not in theirs.state
    assert torch.equal(extra_a, extra_b)


@pytest.mark.parametrize("device", DEVICES)
def test_some_grads_none_some_steps(device):
    """A parameter that misses gradients on some steps keeps its own step count, as in torch."""
    params_a = make_params([10, 20, 30], device, misaligned=False)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2)
    theirs = torch.optim.AdamW(params_b, lr=1e-2)
    for step in range(12):
        set_grads(params_a, params_b, step)
        if step % 3 == 0:
            params_a[1].grad = None
            params_b[1].grad = None
        ours.step()
        theirs.step()
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


def test_closure_returns_loss():
    """step(closure) runs the closure with gradients enabled, returns its loss and steps on the
    gradients it computed: the same losses and parameters as torch's, step by step."""
    p_ours = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    p_torch = torch.nn.Parameter(p_ours.detach().clone())
    ours = titanmac_c.AdamW([p_ours], lr=0.1)
    theirs = torch.optim.AdamW([p_torch], lr=0.1)

    def closure_for(opt, p):
        def closure():
            opt.zero_grad()
            loss = (p ** 2).sum()
            loss.backward()
            return loss
        return closure

    for _ in range(5):
        with torch.no_grad():
            loss_ours = ours.step(closure_for(ours, p_ours))
            loss_torch = theirs.step(closure_for(theirs, p_torch))
        torch.testing.assert_close(loss_ours, loss_torch, **tol(torch.float32, "cpu"))
        torch.testing.assert_close(p_ours.detach(), p_torch.detach(), **tol(torch.float32, "cpu"))
    assert loss_ours.item() < 5.25


def test_fp32_mostly_bitwise_equal_to_torch():
    """The element math follows torch's for-loop order: most elements agree to the last bit."""
    params_a = make_params([65537], "cpu", misaligned=False)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW(params_b, lr=1e-3, weight_decay=0.01)
    run_pair(ours, theirs, params_a, params_b, steps=5)
    same = (params_a[0].detach() == params_b[0].detach()).float().mean().item()
    assert same > 0.9, f"only {same:.3f} of the elements are bitwise equal"


def _pair_in_steady_state(sizes, device):
    """Ours and torch's AdamW on twin parameters after 3 identical steps (ours then steps
    through its cached plan)."""
    params_a = make_params(sizes, device, misaligned=False)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.01)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.01)
    run_pair(ours, theirs, params_a, params_b, steps=3)
    return params_a, params_b, ours, theirs


@pytest.mark.parametrize("device", DEVICES)
def test_steps_follow_changes_to_groups_and_state(device):
    """step() keeps its flat lists between steps (titanmac_c.optim.batching.Plan) and re-reads the
    gradients and state tensors; a parameter replaced inside a group list, a new group, a missing
    gradient, a reloaded state and a clip must each take effect exactly as in torch."""
    params_a, params_b, ours, theirs = _pair_in_steady_state([10, 20, 30], device)
    assert ours._plan is not None  # the steady state runs through the plan

    # the same list object, one element replaced (same length)
    new_a = torch.nn.Parameter(torch.randn(20, device=device))
    new_b = torch.nn.Parameter(new_a.detach().clone())
    ours.state.pop(params_a[1])  # the old parameter's state goes too (else torch's
    theirs.state.pop(params_b[1])  # state_dict() cannot map it)
    ours.param_groups[0]["params"][1] = params_a[1] = new_a
    theirs.param_groups[0]["params"][1] = params_b[1] = new_b
    run_pair(ours, theirs, params_a, params_b, steps=3)
    assert new_a in ours.state and float(ours.state[new_a]["step"]) == 3.0

    extra_a = torch.nn.Parameter(torch.randn(7, device=device))
    extra_b = torch.nn.Parameter(extra_a.detach().clone())
    ours.add_param_group({"params": [extra_a], "lr": 3e-3})
    theirs.add_param_group({"params": [extra_b], "lr": 3e-3})
    params_a.append(extra_a)
    params_b.append(extra_b)
    run_pair(ours, theirs, params_a, params_b, steps=2)

    set_grads(params_a, params_b, 50)
    params_a[0].grad = params_b[0].grad = None  # this parameter must not move
    before = params_a[0].detach().clone()
    ours.step()
    theirs.step()
    assert torch.equal(params_a[0].detach(), before)

    saved = copy.deepcopy(theirs.state_dict())
    run_pair(ours, theirs, params_a, params_b, steps=2)
    ours.load_state_dict(copy.deepcopy(saved))  # each its own tensors: torch's loader keeps
    theirs.load_state_dict(saved)               # the given ones when device and dtype match
    for pa, pb in zip(params_a, params_b):
        with torch.no_grad():
            pa.copy_(pb)
    run_pair(ours, theirs, params_a, params_b, steps=2)

    set_grads(params_a, params_b, 60, 10.0)
    ours.clip_grad_norm_(1.0)
    torch.nn.utils.clip_grad_norm_(params_b, 1.0)
    ours.step()
    theirs.step()
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
def test_state_edits_between_planned_steps_take_effect_like_torch(device):
    """The cached plan reads state entries by their position in the state dict: an entry
    replaced under its key, a state dict whose keys were re-inserted in another order, and one
    holding an extra key must each be read as torch reads them (by parameter). One size for all:
    a mix-up of entries would not be refused by the C core's size checks."""
    params_a, params_b, ours, theirs = _pair_in_steady_state([20, 20, 20], device)
    assert ours._plan is not None

    def edit(opt, params, offset):
        # the middle entry replaced by a new dict: moments reset, the step count kept
        old = opt.state[params[1]]
        opt.state[params[1]] = {"step": old["step"].clone(),
                                "exp_avg": torch.full_like(old["exp_avg"], offset),
                                "exp_avg_sq": torch.full_like(old["exp_avg_sq"], offset ** 2)}

    edit(ours, params_a, 0.5)
    edit(theirs, params_b, 0.5)
    run_pair(ours, theirs, params_a, params_b, steps=2)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))

    for opt in (ours, theirs):  # same keys, re-inserted last to first
        entries = list(opt.state.items())
        opt.state.clear()
        opt.state.update(reversed(entries))
    assert list(ours.state) == params_a[::-1]
    run_pair(ours, theirs, params_a, params_b, steps=2)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
    edit(ours, params_a, 0.25)  # an entry replaced in the re-ordered dict
    edit(theirs, params_b, 0.25)
    run_pair(ours, theirs, params_a, params_b, steps=2)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))

    stray = torch.zeros(3, device=device)  # a key no group holds: ignored by both
    ours.state[stray] = {"note": 1}
    theirs.state[stray] = {"note": 1}
    run_pair(ours, theirs, params_a, params_b, steps=2)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
    assert ours._plan is not None and ours._plan.order is not None  # the positions are used


@pytest.mark.parametrize("device", DEVICES)
def test_zero_lr_accepted_and_moves_only_the_state_like_torch(device):
    """lr=0.0 is a valid learning rate in torch (warm-up schedules start there): construction
    accepts it, and steps with weight decay leave the parameters as they were while the moments
    and step counts move exactly as torch's do."""
    params_a = make_params([3, 255, 4097], device)
    params_b = clone_params(params_a)
    initial = [p.detach().clone() for p in params_a]
    ours = titanmac_c.AdamW(params_a, lr=0.0, weight_decay=0.1, amsgrad=True)
    theirs = torch.optim.AdamW(params_b, lr=0.0, weight_decay=0.1, amsgrad=True)
    for step in range(3):
        set_grads(params_a, params_b, step)
        ours.step()
        theirs.step()
        assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
        for pa, pb, p0 in zip(params_a, params_b, initial):
            assert torch.equal(pb, p0)  # torch's lr 0 step leaves it too
            assert torch.equal(pa, p0)
            assert float(ours.state[pa]["step"]) == step + 1
            assert ours.state[pa]["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_negative_lr_from_a_schedule_steps_as_torch(device):
    """A hand-written linear decay run past its end gives LambdaLR negative learning rates: torch
    refuses lr < 0 only at construction and steps with them (gradient ascent), so ours does too,
    value for value."""
    params_a = make_params([3, 255, 4097], device)
    params_b = clone_params(params_a)
    ours = titanmac_c.AdamW(params_a, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.1)
    decay = lambda step: 1.0 - step / 3  # noqa: E731 (negative from the fourth step on)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (ours, theirs)]
    for step in range(6):
        set_grads(params_a, params_b, step)
        ours.step()
        theirs.step()
        for s in scheds:
            s.step()
        assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
    assert ours.param_groups[0]["lr"] < 0


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_replaced_in_a_group_list_with_its_old_state_kept(device):
    """A parameter replaced inside a group's list after steps (the cached plan exists, the old
    parameter keeps its state and a gradient, so the state's size is unchanged): the new one is
    stepped from fresh state and the old one no longer moves, as in torch."""
    params_a, params_b, ours, theirs = _pair_in_steady_state([10, 20, 30], device)
    assert ours._plan is not None
    old_a, old_b = params_a[1], params_b[1]
    new_a = torch.nn.Parameter(torch.randn(20, device=device))
    new_b = torch.nn.Parameter(new_a.detach().clone())
    ours.param_groups[0]["params"][1] = params_a[1] = new_a
    theirs.param_groups[0]["params"][1] = params_b[1] = new_b
    old_values = old_a.detach().clone(), old_b.detach().clone()
    for step in range(3, 6):
        set_grads(params_a, params_b, step)
        old_a.grad = old_b.grad = torch.ones(20, device=device)  # a gradient the step must ignore
        ours.step()
        theirs.step()
        assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
        assert float(ours.state[new_a]["step"]) == step - 2
        assert torch.equal(old_a.detach(), old_values[0]), "the replaced parameter moved"
        assert torch.equal(old_b.detach(), old_values[1])  # torch's does not move either
        assert float(ours.state[old_a]["step"]) == 3.0


def _run_large_first_gradient(device, betas, amsgrad, steps=6):
    """Two parameters, a first gradient 100 times the later ones (amsgrad's max_exp_avg_sq then
    stays above exp_avg_sq), ours and torch's stepped side by side."""
    gen = torch.Generator().manual_seed(0)
    params_a = [torch.nn.Parameter(torch.randn(1000, generator=gen).to(device)) for _ in range(2)]
    params_b = clone_params(params_a)
    kw = dict(lr=1e-2, betas=betas, weight_decay=0.01, amsgrad=amsgrad)
    ours, theirs = titanmac_c.AdamW(params_a, **kw), torch.optim.AdamW(params_b, **kw)
    for step in range(steps):
        scale = 10.0 if step == 0 else 0.1
        for pa, pb in zip(params_a, params_b):
            g = (torch.randn(pa.shape, generator=gen) * scale).to(device)
            pa.grad, pb.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    return ours, theirs, params_a, params_b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta1", [0.3, 0.5])
def test_amsgrad_small_beta1_large_first_gradient(device, beta1):
    """amsgrad with beta1 <= 0.5 (the lerp's 1 - beta1 >= 0.5 arm) matches torch while
    max_exp_avg_sq stays above exp_avg_sq."""
    ours, theirs, params_a, params_b = _run_large_first_gradient(device, (beta1, 0.999), True)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, device))
    for pa in params_a:
        st = ours.state[pa]
        assert (st["max_exp_avg_sq"] > st["exp_avg_sq"]).any()


def test_exp_avg_bitwise_at_beta1_half():
    """At beta1 = 0.5 torch.lerp takes its end - (end - start) * (1 - w) arm: exp_avg must equal
    torch's to the bit (CPU)."""
    ours, theirs, params_a, params_b = _run_large_first_gradient("cpu", (0.5, 0.999), False)
    assert_adamw_runs_agree(ours, theirs, params_a, params_b, tol(torch.float32, "cpu"))
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(ours.state[pa]["exp_avg"], theirs.state[pb]["exp_avg"])
