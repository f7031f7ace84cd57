"""Bad input: each case raises an exception that names the tensor and the problem, and leaves
parameters and optimizer state bitwise unchanged."""

import copy
import math
import re

import numpy as np
import pytest
import torch

import titanmac_c
from conftest import child_env, expect_refused
from titanmac_c import _C


def _setup(n_groups=2, amsgrad=False):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 9, 11)]
    groups = [{"params": params[k::n_groups]} for k in range(n_groups)]
    opt = titanmac_c.AdamW(groups, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    for step in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    return opt, params


# --------------------------------------------------------------- corrupted state


def test_state_dtype_mismatch():
    opt, params = _setup()
    opt.state[params[2]]["exp_avg"] = opt.state[params[2]]["exp_avg"].to(torch.bfloat16)
    expect_refused(opt, params, ValueError,
            r"exp_avg\[\d\]: dtype bfloat16 does not match params\[\d\] dtype float32 "
            r"\(param_groups\[0\]\['params'\]\[1\]\)")


def test_state_unsupported_dtype():
    opt, params = _setup()
    opt.state[params[1]]["exp_avg_sq"] = opt.state[params[1]]["exp_avg_sq"].to(torch.int32)
    expect_refused(opt, params, BufferError, r"exp_avg_sq\[\d\]: dtype int32 is not supported")


def test_state_of_another_precision():
    """float64 state of a float32 parameter (both dtypes the C core takes) is a mismatch, named."""
    opt, params = _setup()
    opt.state[params[1]]["exp_avg_sq"] = opt.state[params[1]]["exp_avg_sq"].double()
    expect_refused(opt, params, ValueError,
                   r"exp_avg_sq\[\d\]: dtype float64 does not match params\[\d\] dtype float32")


def test_state_size_mismatch():
    opt, params = _setup()
    opt.state[params[3]]["exp_avg_sq"] = torch.zeros(12)
    expect_refused(opt, params, ValueError,
            r"exp_avg_sq\[\d\]: numel 12 does not match params\[\d\] numel 11 "
            r"\(param_groups\[1\]\['params'\]\[1\]\)")


def test_step_tensor_corrupted():
    opt, params = _setup()
    opt.state[params[0]]["step"] = torch.zeros(3)
    expect_refused(opt, params, ValueError, r"step\[0\]: expected float32 with 1 element")


def test_state_aliasing_param():
    opt, params = _setup()
    opt.state[params[1]]["exp_avg"] = params[1].data
    expect_refused(opt, params, ValueError, r"exp_avg\[\d\]: shares memory with params\[\d\]")


def test_state_on_meta_device():
    opt, params = _setup()
    opt.state[params[0]]["exp_avg"] = torch.zeros(5, device="meta")
    expect_refused(opt, params, BufferError, r"exp_avg\[0\]")


def test_corrupted_state_through_load_state_dict():
    opt, params = _setup()
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the entries with opt.state
    sd["state"][2]["exp_avg"] = torch.zeros(4)  # params[2] has 9 elements
    expect_refused(opt, params, ValueError,
            r"load_state_dict: param_groups\[1\]\['params'\]\[0\]: exp_avg has shape \(4,\), "
            r"but the parameter has shape \(7,\)|load_state_dict: .*exp_avg has shape \(4,\)",
            lambda: opt.load_state_dict(sd))


def test_load_state_dict_missing_amsgrad_state():
    opt, params = _setup(amsgrad=True)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the entries with opt.state
    del sd["state"][1]["max_exp_avg_sq"]
    expect_refused(opt, params, ValueError, r"has no 'max_exp_avg_sq'",
                   lambda: opt.load_state_dict(sd))


def test_load_state_dict_wrong_step_shape():
    opt, params = _setup()
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the entries with opt.state
    sd["state"][0]["step"] = torch.zeros(2)
    expect_refused(opt, params, ValueError, r"step has 2 elements", lambda: opt.load_state_dict(sd))


def test_load_state_dict_entry_without_step():
    """A checkpoint whose state entry lacks 'step' is refused, naming the parameter, with nothing
    changed (torch's load raises a bare KeyError('step') after it has replaced the state)."""
    opt, params = _setup()
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the entries with opt.state
    del sd["state"][2]["step"]  # params[1], the first of the second group
    expect_refused(opt, params, ValueError,
                   r"^load_state_dict: param_groups\[1\]\['params'\]\[0\]: state has no 'step'$",
                   lambda: opt.load_state_dict(sd))
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


@pytest.mark.parametrize("step", ["12", [2.0], None, torch.zeros(1, device="meta")])
def test_load_state_dict_step_that_is_no_number(step):
    """torch's load keeps any step object, and a later step fails on it: refused at the load
    instead, naming the parameter, with nothing loaded (the optimizer steps on afterwards)."""
    opt, params = _setup()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["step"] = step
    expect_refused(opt, params, ValueError, r"^load_state_dict: param_groups\[1\]\['params'\]"
                   r"\[0\]: (step|state has no 'step')", lambda: opt.load_state_dict(sd))
    sd["state"][2] = [1, 2]
    expect_refused(opt, params, ValueError, r"param_groups\[1\]\['params'\]\[0\]: state is a "
                   r"list, not a dict", lambda: opt.load_state_dict(sd))
    opt.step()
    assert all(float(opt.state[p]["step"]) == 3.0 for p in params)


@pytest.mark.parametrize("key, value, match", [
    ("step", -1.0, r"step = -1.0, must be >= 0"),  # the bias correction would divide by zero
    ("step", float("inf"), r"step = inf, must be >= 0 and finite"),
    ("step", float("nan"), r"step = nan, must be >= 0 and finite"),
    ("exp_avg", None, r"exp_avg is a NoneType, not a tensor"),
    ("exp_avg_sq", torch.zeros(7, device="meta"), r"exp_avg_sq is on the meta device"),
])
def test_load_state_dict_values_a_step_could_not_use(key, value, match):
    opt, params = _setup()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2][key] = value
    expect_refused(opt, params, ValueError, r"^load_state_dict: param_groups\[1\]\['params'\]"
                   r"\[0\]: " + match, lambda: opt.load_state_dict(sd))


def test_a_group_without_a_hyperparameter_is_named():
    """torch's load takes a group without 'lr' (its step then fails on a bare KeyError)."""
    opt, params = _setup()
    del opt.param_groups[1]["lr"]
    expect_refused(opt, params, ValueError, r"^param_groups\[1\]: no 'lr'")


def test_a_state_entry_that_is_no_tensor_is_named_with_several_c_calls():
    """Groups with and without amsgrad make two C calls, checked in Python first: a state entry
    that is no tensor is named there too (one call: the C core names it)."""
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = titanmac_c.AdamW([{"params": [a]}, {"params": [b], "amsgrad": True}])
    a.grad, b.grad = torch.randn(3), torch.randn(2)
    opt.step()
    opt.state[a]["exp_avg_sq"] = None
    expect_refused(opt, [a, b], TypeError, r"^param_groups\[0\]\['params'\]\[0\]: a state "
                   r"entry is a NoneType, not a tensor")


@pytest.mark.parametrize("fn", ["clip", "total", "method"])
@pytest.mark.parametrize("kw, err, match", [
    # torch: float(None) raises TypeError, float("abc") ValueError
    (dict(max_norm=None), TypeError, r"^max_norm = None: expected a number$"),
    (dict(norm_type="abc"), ValueError, r"^norm_type = 'abc': expected a number$"),
])
def test_clip_arguments_that_are_no_numbers_are_named(fn, kw, err, match):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    if fn == "total" and "max_norm" in kw:
        return  # get_total_norm takes no max_norm
    args = dict(dict(max_norm=1.0), **kw)
    with pytest.raises(err, match=match):
        if fn == "clip":
            titanmac_c.clip_grad_norm_([p], **args)
        elif fn == "total":
            titanmac_c.get_total_norm([p.grad], norm_type=kw["norm_type"])
        else:
            titanmac_c.AdamW([p]).clip_grad_norm_(**args)
    assert torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("spoil, match", [
    (lambda s: s.pop("exp_avg"), r"its state has no 'exp_avg' \(keys: \['exp_avg_sq', 'step'\]\)"),
    (lambda s: s.pop("step"), r"its state has no 'step'"),
    (lambda s: s.__setitem__("step", "x"), r"state\['step'\] = 'x': expected a number"),
    (lambda s: s.__setitem__("step", None), r"state\['step'\] = None: expected a number"),
])
def test_a_state_entry_edited_into_nonsense_is_named(spoil, match):
    """optimizer.state edited by hand: the step names the parameter (torch: a bare KeyError or
    float() error), nothing written."""
    opt, params = _setup()
    spoil(opt.state[params[1]])
    expect_refused(opt, params, ValueError, r"^param_groups\[1\]\['params'\]\[0\]: " + match)


@pytest.mark.parametrize("key, value, err, match", [
    # no number: a TypeError, as torch's arithmetic on it raises
    ("lr", "0.1", TypeError, r"\['lr'\] = '0.1': expected a number"),
    ("betas", (0.9, "x"), TypeError, r"\['betas'\]\[1\] = 'x': expected a number"),
    ("eps", None, TypeError, r"\['eps'\] = None: expected a number"),
    ("lr", torch.ones(2), ValueError, r"\['lr'\]: a tensor of 2 elements, not 1"),
    ("betas", (0.9,), ValueError, r"\['betas'\] = \(0.9,\): expected two numbers"),
    ("betas", None, TypeError, r"\['betas'\] = None: expected two numbers"),
])
def test_hyperparameters_of_the_wrong_kind_are_named(key, value, err, match):
    opt, params = _setup()
    opt.param_groups[1][key] = value
    expect_refused(opt, params, err, r"^param_groups\[1\]" + match)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_optimizer_clip_error_if_nonfinite_like_torch(bad):
    """AdamW.clip_grad_norm_(..., error_if_nonfinite=True) raises torch's RuntimeError, with
    torch's message, for an infinite total norm as for a NaN one (computed, or given as
    total_norm), leaving gradients, parameters and state unchanged."""
    opt, params = _setup()
    params[2].grad[4] = bad
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params):
        t.grad = p.grad.clone()
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_(twins, 1.0, error_if_nonfinite=True)
    grads = [p.grad.clone() for p in params]
    for action in (lambda: opt.clip_grad_norm_(1.0, error_if_nonfinite=True),
                   lambda: opt.clip_grad_norm_(1.0, error_if_nonfinite=True,
                                               total_norm=torch.tensor(abs(bad)))):
        expect_refused(opt, params, type(theirs.value), f"^{re.escape(str(theirs.value))}$",
                       action)
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    for t, g in zip(twins, grads):  # torch's are untouched too
        torch.testing.assert_close(t.grad, g, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------- bad tensors


def test_sparse_gradient():
    opt, params = _setup()
    params[3].grad = params[3].grad.to_sparse()
    expect_refused(opt, params, RuntimeError,
            r"param_groups\[1\]\['params'\]\[1\]: AdamW does not support sparse gradients")


def test_norm_functions_name_a_sparse_gradient_and_scale_nothing():
    """torch's clip_grad_norm_ and get_total_norm fail on a sparse gradient with a dispatcher
    message naming no tensor; ours name it (NotImplementedError, as torch's type), before any
    gradient is scaled."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 4)]
    grads = [torch.randn(n) * 10 for n in (5, 300, 4)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params[1].grad = params[1].grad.to_sparse()
    with pytest.raises(NotImplementedError):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    with pytest.raises(NotImplementedError,
                       match=r"^parameters\[1\]: torch.sparse_coo tensors are not supported"):
        titanmac_c.clip_grad_norm_(params, 1.0)
    with pytest.raises(NotImplementedError,
                       match=r"^tensors\[1\]: torch.sparse_coo tensors are not supported"):
        titanmac_c.get_total_norm([p.grad for p in params])
    opt = titanmac_c.AdamW(params)
    with pytest.raises(NotImplementedError, match=r"^param_groups\[0\]\['params'\]\[1\]: "
                                                  r"torch.sparse_coo gradients are not supported"):
        opt.clip_grad_norm_(1.0)
    assert torch.equal(params[0].grad, grads[0]) and torch.equal(params[2].grad, grads[2])


def test_complex32_parameter():
    """complex64 and complex128 step through their real views (tests/adamw/test_complex.py);
    complex32, whose real view is float16 and which torch's AdamW steps its own way, is refused
    before any write."""
    opt, params = _setup()
    z = torch.nn.Parameter(torch.randn(3, dtype=torch.complex32))
    opt.add_param_group({"params": [z]})
    z.grad = torch.randn(3, dtype=torch.complex32)
    expect_refused(opt, params, TypeError,
            r"param_groups\[2\]\['params'\]\[0\]: dtype complex32 is not supported")


def test_an_expanded_parameter_refused_without_state():
    """A parameter with several elements on one memory location cannot be written in place
    (torch's in-place ops raise too); one dense in no order is stepped through a copy
    (tests/capi/test_layouts.py)."""
    opt, params = _setup()
    nc = torch.nn.Parameter(torch.randn(4, 1).expand(4, 6))
    opt.add_param_group({"params": [nc]})
    nc.grad = torch.randn(4, 6)
    expect_refused(opt, params + [nc], RuntimeError, r"\['params'\]\[0\]: an expanded tensor")
    assert nc not in opt.state


def test_read_only_output_through_the_c_api():
    p = np.ones(4, dtype=np.float32)
    p.flags.writeable = False
    g = np.ones(4, dtype=np.float32)
    m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
    step = np.zeros(1, np.float32)
    lr = np.full(1, 0.1, np.float32)
    with pytest.raises(BufferError, match=r"params\[0\]: read-only"):
        _C.adamw_step([p], [g], [m], [v], [], [step], lr, [(0.9, 0.999, 1e-8, 0.0, False)])
    assert (p == 1).all() and (m == 0).all() and (step == 0).all()


def test_wrong_python_types():
    t = torch.zeros(3)
    step = torch.zeros(())
    lr = torch.full((1,), 0.1)
    hp = [(0.9, 0.999, 1e-8, 0.0, False)]
    with pytest.raises(TypeError, match=r"params\[1\]"):
        _C.adamw_step([t, "oops"], [t, t], [t, t], [t, t], [], [step, step], lr, hp)
    with pytest.raises(TypeError, match="params"):
        _C.adamw_step(3, [t], [t], [t], [], [step], lr, hp)
    assert torch.equal(t, torch.zeros(3))


def test_lr_tensor_of_wrong_size():
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    step = torch.zeros(())
    with pytest.raises(ValueError, match=r"lr: expected float32 or float64 with 2 elements"):
        _C.adamw_step([p], [g], [m], [v], [], [step], torch.ones(1),
                      [(0.9, 0.999, 1e-8, 0.0, False)] * 2)
    assert torch.equal(p, torch.ones(3)) and float(step) == 0.0


def test_group_index_out_of_range():
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    step = torch.zeros(())
    with pytest.raises(ValueError, match=r"group_of\[0\] = 3 is not in \[0, 1\)"):
        _C.adamw_step([p], [g], [m], [v], [], [step], torch.ones(1),
                      [(0.9, 0.999, 1e-8, 0.0, False)], [3])
    assert torch.equal(p, torch.ones(3))


@pytest.mark.parametrize("hp, vmax, match", [
    ((1.0, 0.999, 1e-8, 0.0, False), [], r"groups\[0\]: beta1 = 1 is not in \[0, 1\)"),
    ((0.9, 0.999, 1e-8, 0.0, False), [torch.zeros(3)],
     r"max_exp_avg_sq: amsgrad is off, expected 0 tensors, got 1"),
], ids=["beta1_one", "max_exp_avg_sq_without_amsgrad"])
def test_c_api_refuses_bad_group_exactly_and_writes_nothing(hp, vmax, match):
    """_C.adamw_step refuses beta1 = 1 and a max_exp_avg_sq tensor with amsgrad off, exactly."""
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    step = torch.zeros(())
    written = [p, m, v, step] + vmax
    snap = [t.clone() for t in written]
    with pytest.raises(ValueError, match="^" + match + "$"):
        _C.adamw_step([p], [g], [m], [v], vmax, [step], torch.full((1,), 0.1), [hp])
    assert all(torch.equal(a, b) for a, b in zip(written, snap)), "a tensor was written"


# --------------------------------------------------------------- bad hyperparameters


@pytest.mark.parametrize("kw, match", [
    (dict(lr=-1.0), "Invalid learning rate"),
    (dict(lr=math.nan), "Invalid learning rate"),
    (dict(eps=-1e-8), "Invalid epsilon"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0"),
    (dict(betas=(0.9, math.nan)), "Invalid beta parameter at index 1"),
    (dict(betas=(0.9, 0.99, 0.5)), "betas: expected 2 values"),  # torch: at the first step
    (dict(weight_decay=-0.1), "Invalid weight_decay"),
])
def test_constructor_rejects_like_torch(kw, match):
    with pytest.raises(ValueError, match=match):
        titanmac_c.AdamW([torch.nn.Parameter(torch.ones(2))], **kw)


@pytest.mark.parametrize("key, value, match", [
    ("lr", math.nan, r"param_groups\[1\]\['lr'\] = nan"),
    ("lr", math.inf, r"param_groups\[1\]\['lr'\] = inf: must be finite"),
    ("lr", 1e40, r"param_groups\[1\]\['lr'\] = 1e\+40: beyond float32's range"),
    ("betas", (0.9, math.nan), r"param_groups\[1\]\['betas'\]\[1\] = nan"),
    ("eps", math.inf, r"param_groups\[1\]\['eps'\] = inf: must be finite and >= 0"),
    ("weight_decay", -1.0, r"param_groups\[1\]\['weight_decay'\] = -1.0"),
])
def test_hyperparameters_changed_after_construction(key, value, match):
    opt, params = _setup()
    opt.param_groups[1][key] = value
    expect_refused(opt, params, ValueError, match)


def test_lr_beyond_float32_refused_before_a_float64_batch_writes():
    """A float64 group (its own C call, float64 learning rates) beside an amsgrad float32 group
    whose lr rounds to inf in float32: refused before the first call writes (torch raises
    too, after writing some parameters)."""
    a = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(2)]
    b = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = titanmac_c.AdamW([{"params": a}, {"params": b, "amsgrad": True}], lr=0.1)
    for p in a + b:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[1]["lr"] = 1e40
    expect_refused(opt, a + b, ValueError, r"param_groups\[1\]\['lr'\] = 1e\+40")


def test_bad_state_in_second_group_changes_first_group_neither():
    """One C call per device validates all groups before writing anything."""
    opt, params = _setup(n_groups=2)
    opt.state[params[3]]["exp_avg"] = torch.zeros(3)
    expect_refused(opt, params, ValueError, r"exp_avg\[3\]: numel 3")


def test_mixed_amsgrad_groups_precheck_keeps_everything():
    """Groups that differ in amsgrad need two C calls; a bad tensor in the second must stop the
    first as well."""
    a = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    b = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = titanmac_c.AdamW([{"params": a}, {"params": b, "amsgrad": True}], lr=0.1)
    for p in a + b:
        p.grad = torch.randn(4)
    opt.step()
    opt.state[b[1]]["exp_avg_sq"] = torch.zeros(4, dtype=torch.float16)
    expect_refused(opt, a + b, ValueError, r"param_groups\[1\]\['params'\]\[1\]")


def _wrapper_subclass_grad(p):
    from torch.testing._internal.two_tensor import TwoTensor  # a tensor wrapping two others
    p.grad = TwoTensor(torch.zeros(p.shape), torch.zeros(p.shape))


def _misaligned_param(p):
    raw = bytearray(4 * p.numel() + 1)  # kept alive by the tensor
    p.data = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=p.numel()).view(p.shape)


@pytest.mark.parametrize("spoil, exc, match", [
    (lambda p: setattr(p, "grad", p.detach()), ValueError, "shares memory"),
    (_misaligned_param, BufferError,
     r"^params\[1\]: data address 0x[0-9a-f]+ is not aligned to its 4-byte elements \("),
    # no memory of its own (data_ptr() 0): was refused as sharing the parameter's memory
    (_wrapper_subclass_grad, BufferError, r"^grads\[1\]: data is NULL for 12 elements \("),
])
def test_mixed_amsgrad_groups_precheck_covers_what_the_c_core_refuses(spoil, exc, match):
    """What the C core refuses in the second call (a gradient that is the parameter's own memory,
    one without memory, a parameter not aligned to its elements) is refused before the first call
    writes: the first group's parameters and steps, and a first step's new state, stay as they
    were."""
    for first_step in (True, False):
        a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
        b = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
        opt = titanmac_c.AdamW([{"params": a}, {"params": b, "amsgrad": True}], lr=0.1)
        for p in a + b:
            p.grad = torch.randn(4, 3)
        if not first_step:
            opt.step()
        spoil(b[1])
        expect_refused(opt, a + b, exc,
                       match if match.startswith("^") else
                       rf"param_groups\[1\]\['params'\]\[1\]: .*{match}")


def test_a_refused_first_step_puts_back_the_state_entries_it_found():
    """A first step commits its new state before the C call (a KeyboardInterrupt after the call
    must not lose it); refused, it puts back exactly what it found: no entry, an empty dict, or
    None set by hand."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    opt = titanmac_c.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(3)
    opt.state[params[1]] = {}
    opt.state[params[2]] = None
    params[0].grad = params[0].detach()  # refused by the C core: shares the parameter's memory
    with pytest.raises(ValueError, match="shares memory"):
        opt.step()
    assert params[0] not in opt.state
    assert opt.state[params[1]] == {} and opt.state[params[2]] is None
    assert all(torch.equal(p, torch.ones(3)) for p in params)


def _alias(key, other):
    def spoil(opt, p):
        opt.state[p][key] = opt.state[p][other] if other != "grad" else p.grad
    return spoil


def test_a_state_entry_that_is_no_dict_is_named():
    """optimizer.state[p] set by hand to a list: torch's AdamW fails with a TypeError naming no
    parameter; ours names it, before anything is written."""
    opt, params = _setup()
    opt.state[params[1]] = [1, 2]
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=r"^param_groups\[1\]\['params'\]\[0\]: its state is a "
                                        r"list, expected a dict$"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"].item() == 2 for p in params if p is not params[1])


@pytest.mark.parametrize("spoil, exc, match", [
    (_alias("exp_avg_sq", "exp_avg"), ValueError, "shares memory"),
    (_alias("max_exp_avg_sq", "exp_avg_sq"), ValueError, "shares memory"),
    (_alias("exp_avg", "grad"), ValueError, "shares memory"),
    (lambda opt, p: opt.state[p].__setitem__("step", torch.ones(2)), ValueError,
     "step must be a float32"),
    (lambda opt, p: opt.state[p].__setitem__("step", torch.ones(3, dtype=torch.float64)),
     ValueError, "step must be a float32"),
])
def test_mixed_amsgrad_groups_precheck_covers_corrupted_state(spoil, exc, match):
    """State tensors that alias each other or the gradient, or a step of two elements, in the
    second call's group: refused before the first call writes."""
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    b = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    opt = titanmac_c.AdamW([{"params": a}, {"params": b, "amsgrad": True}], lr=0.1)
    for p in a + b:
        p.grad = torch.randn(4, 3)
    opt.step()
    spoil(opt, b[1])
    expect_refused(opt, a + b, exc, rf"param_groups\[1\]\['params'\]\[1\]: .*{match}")


# --------------------------------------------------------------- tensors sharing memory


def _share_with_first(what):
    """Puts one tensor of the second parameter's entry into the first parameter's memory: the C
    core would update (or read) it while another thread writes the first."""
    def spoil(opt, params):
        p0, p1 = params[0], params[1]
        if what == "exp_avg":  # shared state tensors (e.g. a checkpoint saved with them shared)
            opt.state[p1]["exp_avg"] = opt.state[p0]["exp_avg"]
        elif what == "grad":
            p1.grad = p0.detach()
        elif what == "step":
            opt.state[p1]["step"] = p0.detach().view(-1)[3]
        elif what == "exp_avg_sq_overlap":
            buf = torch.zeros(2 * p0.numel())
            opt.state[p0]["exp_avg_sq"] = buf[:p0.numel()].view_as(p0)
            opt.state[p1]["exp_avg_sq"] = buf[1:p0.numel() + 1].view_as(p0)
    return spoil


@pytest.mark.parametrize("what, match", [
    ("exp_avg", r"^exp_avg\[1\]: shares memory with exp_avg\[0\]"),
    ("grad", r"^grads\[1\]: shares memory with params\[0\]"),
    ("step", r"^step\[1\]: shares memory with params\[0\]"),
    ("exp_avg_sq_overlap", r"^exp_avg_sq\[1\]: shares memory with exp_avg_sq\[0\]"),
])
@pytest.mark.parametrize("mixed_amsgrad", [False, True], ids=["one_call", "two_calls"])
def test_tensors_of_different_parameters_sharing_memory_are_refused(what, match, mixed_amsgrad):
    """Not only the tensors of one parameter: any tensor the step writes must not share memory
    with another tensor of the call (torch's for-loop would update them one after the other; the
    C core's threads at once, by timing). Refused before any write; with a second group of
    another amsgrad (two C calls) the first call's group is left as it was too."""
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    first = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    groups = [{"params": params}]
    if mixed_amsgrad:
        groups.insert(0, {"params": first, "amsgrad": True})
    opt = titanmac_c.AdamW(groups, lr=0.1)
    every = params + (first if mixed_amsgrad else [])
    for p in every:
        p.grad = torch.randn(p.shape)
    opt.step()
    _share_with_first(what)(opt, params)
    if mixed_amsgrad:  # the Python precheck names the parameters and roles
        match = (r"^param_groups\[1\]\['params'\]\[1\]: its \w+ shares memory with the \w+ of "
                 r"param_groups\[1\]\['params'\]\[0\]$")
    expect_refused(opt, every, ValueError, match)



@pytest.mark.parametrize("mixed_amsgrad", [False, True], ids=["one_call", "two_calls"])
def test_a_parameter_listed_twice_is_named_as_such(mixed_amsgrad):
    """The same Parameter twice in a group (torch warns and steps it twice): its one state
    would be written twice by one call, refused as shared memory by the C core (one call) or
    the Python precheck (two calls); the message says what the user did, naming both entries,
    and the first step writes nothing, state entries included."""
    a, b = (torch.nn.Parameter(torch.randn(n)) for n in (5, 3))
    groups = [{"params": [a, b, a]}]
    every = [a, b]
    if mixed_amsgrad:
        c = torch.nn.Parameter(torch.randn(4))
        groups.append({"params": [c], "amsgrad": True})
        every.append(c)
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's, at construction
        opt = titanmac_c.AdamW(groups, lr=0.1)
    for p in every:
        p.grad = torch.randn_like(p)
    expect_refused(opt, every, ValueError,
                   r"^param_groups\[0\]\['params'\]\[2\]: the same Parameter as "
                   r"param_groups\[0\]\['params'\]\[0\], listed twice")


@pytest.mark.parametrize("betas", [0.9, None])
def test_betas_that_are_no_pair_are_named_at_construction(betas):
    """A TypeError, as torch's (which says "'float' object is not subscriptable"), that names
    betas."""
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(TypeError):
        torch.optim.AdamW(p, betas=betas)
    with pytest.raises(TypeError, match=rf"^betas = {betas}: expected a pair of numbers"):
        titanmac_c.AdamW(p, betas=betas)


def test_fused_and_foreach_together_refused_as_torch_refuses_them():
    p = [torch.nn.Parameter(torch.ones(2))]
    for cls in (torch.optim.AdamW, titanmac_c.AdamW):
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
            cls(p, fused=True, foreach=True)
    for fused, foreach in ((True, False), (False, True), (True, None), (None, True)):
        titanmac_c.AdamW(p, fused=fused, foreach=foreach)

def test_a_written_tensor_inside_a_long_read_span_past_a_shorter_one_is_refused():
    """The overlap sweep goes through the tensors in address order and must compare each with
    the furthest-reaching one so far, not the one before it: a gradient spanning a buffer,
    another gradient inside its start, then a state tensor (written) further inside the first.
    Refused, naming the state tensor and the long gradient, before anything is written."""
    params = [torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(10)),
              torch.nn.Parameter(torch.randn(10))]
    opt = titanmac_c.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    buf = torch.randn(1000)
    params[0].grad = buf
    params[1].grad = buf[10:20]  # read only, as gradients are: sharing with buf is fine
    opt.state[params[2]]["exp_avg"] = buf[50:60]
    expect_refused(opt, params, ValueError, r"^exp_avg\[2\]: shares memory with grads\[0\] "
                                            r"\(param_groups\[0\]\['params'\]\[2\]; grads\[0\] is "
                                            r"param_groups\[0\]\['params'\]\[0\]\)$")


def test_parameters_sharing_memory_are_refused_views_of_one_buffer_are_not():
    """Two Parameters on one memory (nn.Parameter(w) instead of reusing w: a mistaken tie) would
    be updated at once by different threads; torch updates them one after the other. Refused,
    naming both by their places in the group (a parameter without a gradient before them does
    not shift the names), before anything is written. Disjoint views of one flat buffer
    (flat-parameter schemes) are fine and match torch with any thread count."""
    w = torch.nn.Parameter(torch.randn(1000))
    tied = torch.nn.Parameter(w)
    other = torch.nn.Parameter(torch.randn(10))
    no_grad = torch.nn.Parameter(torch.randn(10))
    opt = titanmac_c.AdamW([no_grad, w, other, tied], lr=0.1)
    for p in (w, other, tied):
        p.grad = torch.randn(p.shape)
    expect_refused(opt, [no_grad, w, other, tied], ValueError,
                   r"^params\[2\]: shares memory with params\[0\] "
                   r"\(param_groups\[0\]\['params'\]\[3\]; "
                   r"params\[0\] is param_groups\[0\]\['params'\]\[1\]\)$")
    flat = torch.randn(3000)
    theirs_flat = flat.clone()
    ours = [torch.nn.Parameter(flat[i * 1000:(i + 1) * 1000]) for i in (2, 0, 1)]
    theirs = [torch.nn.Parameter(theirs_flat[i * 1000:(i + 1) * 1000]) for i in (2, 0, 1)]
    opt, opt_t = titanmac_c.AdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1)
    with torch.random.fork_rng(devices=[]):
        for _ in range(3):
            for a, b in zip(ours, theirs):
                a.grad = torch.randn(1000)
                b.grad = a.grad.clone()
            opt.step()
            opt_t.step()
    torch.testing.assert_close(flat, theirs_flat, rtol=1e-6, atol=1e-7)


def test_clip_refuses_gradients_sharing_memory_and_names_parameters():
    """clip_grad_norm_ scales gradients in place, tensors at once: two on one memory are
    refused (nothing scaled). Refused tensors, both of a pair, are named by their place in the
    user's parameters, parameters without gradients counted."""
    z, a, b, c = (torch.nn.Parameter(torch.randn(6)) for _ in range(4))
    a.grad = torch.full((6,), 3.0)
    c.grad = a.grad
    with pytest.raises(ValueError, match=r"^tensors\[1\]: shares memory with tensors\[0\] "
                                         r"\(parameters\[3\]; tensors\[0\] is "
                                         r"parameters\[1\]\)$"):
        titanmac_c.clip_grad_norm_([z, a, b, c], 1.0)
    assert torch.equal(a.grad, torch.full((6,), 3.0))
    c = torch.nn.Parameter(torch.randn(6, device="meta"))
    c.grad = torch.randn(6, device="meta")
    with pytest.raises(BufferError, match=r"^grads\[0\]: .*meta.*\(parameters\[2\]\)$"):
        titanmac_c.clip_grad_norm_([a, b, c], 1.0)
    assert torch.equal(a.grad, torch.full((6,), 3.0))


def test_errors_name_the_tensor_under_titanmac_debug(tmp_path):
    """TITANMAC_DEBUG=1 (read once per process) puts "file.c:line: " before the C core's message;
    the user's name of the tensor is still appended."""
    import subprocess
    import sys

    script = (
        "import torch, titanmac_c\n"
        "ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(11))]\n"
        "for p in ps: p.grad = torch.ones_like(p)\n"
        "opt = titanmac_c.AdamW([{'params': [ps[0]]}, {'params': [ps[1]]}]); opt.step()\n"
        "opt.state[ps[1]]['exp_avg_sq'] = torch.zeros(12)\n"
        "try: opt.step()\n"
        "except ValueError as e: print(e)\n")
    env = dict(child_env(), TITANMAC_DEBUG="1")
    # cwd: not the repository root, whose unbuilt titanmac_c/ would shadow the installed one
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.strip()
    assert re.fullmatch(r"tm_\w+\.c:\d+: exp_avg_sq\[1\]: numel 12 does not match params\[1\] "
                        r"numel 11 \(param_groups\[1\]\['params'\]\[0\]\)", out), out


# --------------------------------------------------------------- shapes through the C API

_HP = [(0.9, 0.999, 1e-8, 0.0, False)]


def _as(kind, t):
    """t as the C core's intake gets it: a torch tensor (exchange table), a DLPack capsule, a
    NumPy array (its __dlpack__: the protocol) sharing t's memory."""
    if kind == "capsule":
        return torch.utils.dlpack.to_dlpack(t)
    if kind == "numpy":
        return t.numpy()
    return t


@pytest.mark.parametrize("kind", ["torch", "capsule", "numpy"])
@pytest.mark.parametrize("shapes, message", [
    (((4, 6), (6, 4)), r"exp_avg\[0\]: shape \[6, 4\] does not match params\[0\] shape \[4, 6\]"),
    (((4, 6), (24,)), r"exp_avg\[0\]: shape \[24\] does not match params\[0\] shape \[4, 6\]"),
    (((4, 1, 6), (4, 6, 1)),
     r"exp_avg\[0\]: shape \[4, 6, 1\] does not match params\[0\] shape \[4, 1, 6\]"),
    (((), (1,)), r"exp_avg\[0\]: shape \[1\] does not match params\[0\] shape \[\]"),
])
def test_a_state_of_the_numel_but_not_the_shape_is_refused_by_the_c_core(kind, shapes, message):
    """_C.adamw_step with exp_avg of the parameter's numel in another shape (size-1 dimensions
    and 0-d tensors included), through each way a tensor comes in: ValueError naming both
    shapes, nothing written. The same tensors reshaped to match step."""
    p_shape, m_shape = shapes
    torch.manual_seed(0)
    p, g, v = torch.randn(p_shape), torch.randn(p_shape), torch.rand(p_shape)
    m, step, lr = torch.randn(m_shape), torch.zeros(1), torch.full((1,), 0.1)
    written = [p, m, v, step]
    before = [t.clone() for t in written]
    with pytest.raises(ValueError, match="^" + message + "$"):
        _C.adamw_step([_as(kind, p)], [_as(kind, g)], [_as(kind, m)], [_as(kind, v)], [],
                      [_as(kind, step)], lr, _HP)
    for t, b in zip(written, before):
        assert torch.equal(t, b)
    _C.adamw_step([_as(kind, p)], [_as(kind, g)], [_as(kind, m.view(p_shape))], [_as(kind, v)],
                  [], [_as(kind, step)], lr, _HP)
    assert float(step) == 1.0 and not torch.equal(p, before[0])


def test_a_gradient_of_another_shape_is_refused_by_the_c_core():
    p, m, v = torch.randn(3, 4), torch.zeros(3, 4), torch.zeros(3, 4)
    step, lr = torch.zeros(1), torch.full((1,), 0.1)
    before = [t.clone() for t in (p, m, v, step)]
    for g, shape in ((torch.randn(4, 3), r"\[4, 3\]"), (torch.randn(12), r"\[12\]")):
        with pytest.raises(ValueError, match=rf"^grads\[0\]: shape {shape} does not match "
                           r"params\[0\] shape \[3, 4\]$"):
            _C.adamw_step([p], [g], [m], [v], [], [step], lr, _HP)
    for t, b in zip((p, m, v, step), before):
        assert torch.equal(t, b)
