"""AdamW and the clip functions interrupted at every point of a call (a KeyboardInterrupt at
every line they run, as a signal handler or a hook raises it): parameters, gradients, state
and the pending clip coefficient are left exactly as before the call or exactly as after it."""

import copy

import pytest
import torch

import titanmac_c
from interrupts import sweep


def make_adamw(steps, clip=None):
    """Parameters of several kinds (contiguous, a strided slice stepped through a copy, a group
    with amsgrad: two C calls), an AdamW after `steps` steps, the next gradients in place, and
    with clip a pending folded clip coefficient."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 10, generator=gen)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
              torch.nn.Parameter(base[:, ::2]),
              torch.nn.Parameter(torch.randn(7, generator=gen))]
    opt = titanmac_c.AdamW([{"params": params[:2]}, {"params": params[2:], "amsgrad": True}],
                           lr=0.01, weight_decay=0.1)
    for _ in range(steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if _ < steps:
            opt.step()
    if clip is not None:
        opt.clip_grad_norm_(clip)
    return base, params, opt


def adamw_snapshot(made):
    base, params, opt = made
    return (base.clone(), [p.detach().clone() for p in params], [p.grad.clone() for p in params],
            copy.deepcopy(opt.state_dict()["state"]),
            {str(k): v.clone() for k, v in opt._pending_clip.coef.items()})


@pytest.mark.parametrize("steps, clip", [(0, None), (3, None), (3, 0.5)],
                         ids=["first_step", "later_step", "with_folded_clip"])
def test_adamw_interrupted_anywhere_is_as_before_or_as_after_the_step(steps, clip):
    before, after = sweep(lambda: make_adamw(steps, clip), lambda made: made[2].step(),
                          adamw_snapshot)
    assert before > 50 and after > 3, (before, after)


def test_a_single_device_plan_step_interrupted_anywhere():
    """The steady state of one C call per step through the cached plan."""
    def make():
        gen = torch.Generator().manual_seed(2)
        params = [torch.nn.Parameter(torch.randn(4, 4, generator=gen)) for _ in range(3)]
        opt = titanmac_c.AdamW(params, lr=0.01)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        assert opt._plan is not None
        return None, params, opt

    def snapshot(made):
        _, params, opt = made
        return ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"]))

    before, after = sweep(make, lambda made: made[2].step(), snapshot)
    assert before > 5 and after > 0, (before, after)


def test_clip_grad_norm_interrupted_anywhere_is_as_before_or_as_after():
    """titanmac_c.clip_grad_norm_ scales the gradients in place in its C call."""
    def make():
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 300, 17)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 10
        return params

    before, after = sweep(make, lambda params: titanmac_c.clip_grad_norm_(params, 1.0),
                          lambda params: [p.grad.clone() for p in params])
    assert before > 3 and after >= 1, (before, after)
