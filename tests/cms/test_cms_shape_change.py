"""A DeepNestedOptimizer parameter reshaped after its state was made (`p.data =
p.data.reshape(...)`, the same element count, its gradient in the new shape): the step is
refused by the C core's shape check (CMS Phase 2's tm_cms_step and its tm_cms_check before
Phase 1, AdamW mode's tm_adamw_step) with the parameter's name and both shapes, and nothing
changes; given its shape back, the run goes on exactly as one that never saw the refused step.
The ops' own messages: tests/cms/test_cms_op_errors.py (_state_shape, _grad_shape,
_param_reshaped), tests/cms/test_cms_surrogate.py (the Phase 1 op's lists)."""

import copy

import pytest
import torch

import titanmac_c
from conftest import assert_same_state, checkpoint_roundtrip
from dno_models import (MODE_IDS, MODES, fixed_grads, make_mlp_10_32_5, set_grads_by_name,
                        step_all)

# the first state buffer the update reads of parameter 1 ('2.weight', [5, 32])
_REFUSED = {
    "adamw": r"exp_avg\[1\]: shape \[5, 32\] does not match params\[1\] shape \[32, 5\] "
             r"\(parameter '2.weight'\)$",
    "cms-direct": r"momentum\[0\]\[1\]: shape \[5, 32\] does not match params\[1\] shape "
                  r"\[32, 5\] \(parameter '2.weight'\)$",
}
_REFUSED["cms-legacy"] = _REFUSED["cms-direct"]


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], checkpoint_roundtrip(
        opt.state_dict())


@pytest.mark.parametrize("at", [7, 10], ids=["step7", "step10"])  # 10: Phase 1 in CMS-direct
@pytest.mark.parametrize("kw, mode", list(zip(MODES, MODE_IDS)), ids=MODE_IDS)
def test_a_reshaped_parameter_is_refused_and_nothing_changes(kw, mode, at):
    model = make_mlp_10_32_5(seed=0)
    twin = copy.deepcopy(model)
    opt = titanmac_c.DeepNestedOptimizer(model, **kw)
    clean = titanmac_c.DeepNestedOptimizer(twin, **kw)
    clean.load_state_dict(opt.state_dict())
    for step in range(1, at):
        step_all(step, (model, opt), (twin, clean))
    params_before, state_before = _snapshot(model, opt)
    g = fixed_grads(model, at)
    set_grads_by_name(model, g)
    weight = model[2].weight
    data, grad = weight.data, weight.grad
    weight.data, weight.grad = data.reshape(32, 5).clone(), grad.reshape(32, 5).clone()
    with pytest.raises(ValueError, match=_REFUSED[mode]):
        opt.step(0.5)
    weight.data, weight.grad = data, grad

    assert opt.global_step == at - 1
    params_after, state_after = _snapshot(model, opt)
    for a, b in zip(params_before, params_after):
        assert torch.equal(a, b)
    assert_same_state(state_before, state_after)
    set_grads_by_name(twin, g)
    for step in (at, at + 1):
        opt.step(0.5)
        clean.step(0.5)
        set_grads_by_name(model, fixed_grads(model, step + 1))
        set_grads_by_name(twin, fixed_grads(model, step + 1))
    for pa, pb in zip(model.parameters(), twin.parameters()):
        assert torch.equal(pa, pb)
