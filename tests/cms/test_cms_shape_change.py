"""A DeepNestedOptimizer parameter reshaped after its state was made (`p.data =
p.data.reshape(...)`, the same element count, its gradient in the new shape): the step is
refused by the C core's shape check (CMS Phase 2's tm_cms_step and its tm_cms_check before
Phase 1, AdamW mode's tm_adamw_step) with the parameter's name and both shapes, and nothing
changes; given its shape back, the run goes on exactly as one that never saw the refused step.
The ops' own messages: tests/cms/test_cms_op_errors.py (_state_shape, _grad_shape,
_param_reshaped), tests/cms/test_cms_surrogate.py (the Phase 1 op's lists)."""

import pytest

from dno_models import MODE_IDS, MODES, fixed_grads, set_grads_by_name, step_all
from test_deep_nested_inputs import assert_untouched_then_alike, params_and_state, twin_optimizers

# the first state buffer the update reads of parameter 1 ('2.weight', [5, 32])
_REFUSED = {
    "adamw": r"exp_avg\[1\]: shape \[5, 32\] does not match params\[1\] shape \[32, 5\] "
             r"\(parameter '2.weight'\)$",
    "cms-direct": r"momentum\[0\]\[1\]: shape \[5, 32\] does not match params\[1\] shape "
                  r"\[32, 5\] \(parameter '2.weight'\)$",
}
_REFUSED["cms-legacy"] = _REFUSED["cms-direct"]


@pytest.mark.parametrize("at", [7, 10], ids=["step7", "step10"])  # 10: Phase 1 in CMS-direct
@pytest.mark.parametrize("kw, mode", list(zip(MODES, MODE_IDS)), ids=MODE_IDS)
def test_a_reshaped_parameter_is_refused_and_nothing_changes(kw, mode, at):
    model, opt, twin, clean = twin_optimizers(kw)
    for step in range(1, at):
        step_all(step, (model, opt), (twin, clean))
    before = params_and_state(model, opt)
    g = fixed_grads(model, at)
    set_grads_by_name(model, g)
    weight = model[2].weight
    data, grad = weight.data, weight.grad
    weight.data, weight.grad = data.reshape(32, 5).clone(), grad.reshape(32, 5).clone()
    with pytest.raises(ValueError, match=_REFUSED[mode]):
        opt.step(0.5)
    weight.data, weight.grad = data, grad
    set_grads_by_name(twin, g)
    assert_untouched_then_alike(model, opt, twin, clean, before, at)
