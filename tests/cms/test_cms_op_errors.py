"""_C.cms_step's argument checks: each bad call raises the exact message, naming the tensor (list,
level and index: "momentum[1][3]" is level 1 of tensor 3) or the number, and writes nothing."""

import pytest
import torch

from titanmac_c import _C

SIZES = [5, 7, 3, 12]
K = 3


def _valid(net="direct", H=4, L=2):
    f32 = dict(dtype=torch.float32)
    params = [torch.randn(n) for n in SIZES]
    shapes = [(H * (4 if net == "direct" else 9),), (H,)] + [(H * H,), (H,)] * (L - 1)
    shapes += [(H,), (1,)] if net == "direct" else [(3 * H,), (3,)]
    weights = ([torch.ones(1)] if net == "legacy" else []) + [torch.randn(s) * 0.3 for s in shapes]
    args = {
        "params": params,
        "grads": [torch.randn(n) for n in SIZES],
        "momentum": [[torch.zeros(n) for n in SIZES] for _ in range(K)],
        "accumulated": [[torch.zeros(n) for n in SIZES] for _ in range(K)],
        "ema": [[torch.zeros(n) for n in SIZES] for _ in range(K)],
        "v_sq": [[torch.zeros(n) for n in SIZES] for _ in range(K)],
        "step_counts": [torch.zeros(K) for _ in SIZES],
        "lr": torch.full((2,), 0.1, **f32),
        "group_of": [0, 1, 0, 1],
        "weights": weights,
    }
    kw = dict(fires=[True, True, False], divisors=[1.0, 10.0, 100.0],
              ema_decays=[0.99, 0.999, 0.9999], net=net, hidden=H, layers=L, weight_decay=0.01,
              t=10, base_lr=0.1, loss=torch.ones(1), grad_scale=torch.ones(1), skip=None)
    return args, kw


ORDER = ["params", "grads", "momentum", "accumulated", "ema", "v_sq", "step_counts", "lr",
         "group_of", "weights"]


def _written(args):
    lists = args["params"] + args["step_counts"]
    lists += [t for k in ("momentum", "accumulated", "ema", "v_sq") for lv in args[k] for t in lv]
    return lists


def _expect_error(args, kw, exc, message):
    snap = [t.clone() for t in _written(args)]
    with pytest.raises(exc, match="^" + message + "$"):
        _C.cms_step(*[args[k] for k in ORDER], **kw)
    assert all(torch.equal(a, b) for a, b in zip(_written(args), snap)), "a tensor was written"


def test_a_valid_call_runs():
    args, kw = _valid()
    _C.cms_step(*[args[k] for k in ORDER], **kw)
    assert args["step_counts"][0].tolist() == [1.0, 1.0, 0.0]


def _state_numel(args, kw):
    args["momentum"][1][3] = torch.zeros(10)
    return ValueError, "momentum\\[1\\]\\[3\\]: numel 10 does not match params\\[3\\] numel 12"


def _state_shape(args, kw):
    # the numel of params[3] (12) in another shape: the state of another parameter, or of this
    # one before `p.data = p.data.reshape(...)`; element k would no longer be element k's
    args["momentum"][1][3] = torch.zeros(3, 4)
    return ValueError, ("momentum\\[1\\]\\[3\\]: shape \\[3, 4\\] does not match params\\[3\\] "
                        "shape \\[12\\]")


def _grad_shape(args, kw):
    args["grads"][1] = torch.randn(7, 1)
    return ValueError, "grads\\[1\\]: shape \\[7, 1\\] does not match params\\[1\\] shape \\[7\\]"


def _param_reshaped(args, kw):
    # the parameter reshaped, its gradient with it, the state as it was made
    args["params"][3] = args["params"][3].reshape(2, 6)
    args["grads"][3] = args["grads"][3].reshape(2, 6)
    return ValueError, ("momentum\\[0\\]\\[3\\]: shape \\[12\\] does not match params\\[3\\] "
                        "shape \\[2, 6\\]")


def _state_dtype(args, kw):
    args["ema"][0][1] = torch.zeros(7, dtype=torch.bfloat16)
    return ValueError, "ema\\[0\\]\\[1\\]: dtype bfloat16, CMS state must be float32"


def _state_count(args, kw):
    args["v_sq"][2].pop()
    return ValueError, "v_sq\\[2\\]: 3 tensors, params has 4"


def _grad_dtype(args, kw):
    args["grads"][0] = args["grads"][0].bfloat16()
    return ValueError, "grads\\[0\\]: dtype bfloat16 does not match params\\[0\\] dtype float32"


def _steps_numel(args, kw):
    args["step_counts"][2] = torch.zeros(1)
    return ValueError, "step_counts\\[2\\]: expected float32 with 3 elements, got float32 with 1"


def _weights_count(args, kw):
    args["weights"].pop()
    return ValueError, "weights: 5 tensors, the direct network \\(layers = 2\\) has 6"


def _weights_numel(args, kw):
    args["weights"][2] = torch.zeros(10)
    return ValueError, "weights\\[2\\]: numel 10 does not match the direct network's H\\*H = 16"


def _levels_mismatch(args, kw):
    args["accumulated"].pop()
    return ValueError, "accumulated: 2 levels, momentum has 3"


def _too_many_levels(args, kw):
    for k in ("momentum", "accumulated", "ema", "v_sq"):
        args[k] += [[torch.zeros(n) for n in SIZES] for _ in range(2)]
    return ValueError, "momentum: 5 levels, must be in \\[1, 4\\]"


def _group_of(args, kw):
    args["group_of"] = [0, 2, 0, 1]
    return ValueError, "group_of\\[1\\] = 2 is not in \\[0, 2\\)"


def _alias(args, kw):
    args["momentum"][0][2] = args["params"][2]
    return ValueError, "momentum\\[0\\]\\[2\\]: shares memory with params\\[2\\]"


def _params_overlap(args, kw):
    # threads update different tensors at once: overlapping parameters would race
    flat = torch.randn(20)
    args["params"][1], args["params"][3] = flat[0:7], flat[5:17]
    return ValueError, "params\\[3\\]: shares memory with params\\[1\\]"


def _lr_dtype(args, kw):
    args["lr"] = torch.ones(2, dtype=torch.float16)
    return ValueError, "lr: expected float32 with 2 elements, got float16 with 2"


def _scratch_in_a_state_tensor(args, kw):
    """The scratch a call writes, over memory the call also steps (a state tensor here)."""
    need = _C.cms_scratch_bytes(args["params"], levels=K, net="direct")
    buf = torch.zeros(need // 4 + 16)
    args["momentum"][0][3] = buf[4:16]
    kw["scratch"] = buf.view(torch.uint8)[:need]
    return ValueError, "scratch: shares memory with momentum\\[0\\]\\[3\\]"


def _scratch(args, kw):
    kw["scratch"] = torch.empty(8, dtype=torch.uint8)
    need = _C.cms_scratch_bytes(args["params"], levels=K, net="direct")
    return ValueError, f"scratch: CPU needs {need} bytes, got 8 \\(see cms_scratch_bytes\\)"


def _vsq_dtype(args, kw):
    # v_sq state (level 1, tensor 2) must be float32, like the other CMS state lists
    args["v_sq"][1][2] = torch.zeros(3, dtype=torch.bfloat16)
    return ValueError, "v_sq\\[1\\]\\[2\\]: dtype bfloat16, CMS state must be float32"


def _accumulated_empty(args, kw):
    # an empty level list is a count mismatch, not a skipped level
    args["accumulated"][0] = []
    return ValueError, "accumulated\\[0\\]: 0 tensors, params has 4"


def _alias_index0(args, kw):
    # aliasing is caught at index 0 too (the first tensor of the first level)
    args["momentum"][0][0] = args["params"][0]
    return ValueError, "momentum\\[0\\]\\[0\\]: shares memory with params\\[0\\]"


def _grads_alias_params(args, kw):
    # a gradient that is its own parameter would be overwritten mid-step
    args["grads"][2] = args["params"][2]
    return ValueError, "grads\\[2\\]: shares memory with params\\[2\\]"


def _bad_keyword(name, key, value, message):
    """A case giving one keyword argument a value the op refuses with ValueError (message)."""
    def case(args, kw):
        kw[key] = value
        return ValueError, message
    case.__name__ = "_" + name
    return case


# One keyword argument out of its range or of the wrong kind (host hyperparameters, the level
# lists' lengths and values, the network, the optional one-element tensors).
KEYWORD_CASES = [
    _bad_keyword("hidden", "hidden", 21,
                 "hidden = 21: must be in \\[1, 20\\] for the direct network"),
    _bad_keyword("fires_length", "fires", [True, False],
                 "fires: 2 levels, momentum has 3"),
    _bad_keyword("divisor", "divisors", [1.0, 0.5, 100.0],
                 "divisors\\[1\\] = 0.5: must be finite and >= 1"),
    _bad_keyword("net_name", "net", "lstm",
                 "net: expected 'direct' or 'legacy', got 'lstm'"),
    _bad_keyword("net_name_with_nul", "net", "direct\0x",
                 "net: expected 'direct' or 'legacy', got 'direct\\\\x00x'"),
    _bad_keyword("ema_decay", "ema_decays", [1.5, 0.999, 0.9999],
                 "ema_decays\\[0\\] = 1.5: must be in \\[0, 1\\]"),
    _bad_keyword("beta2", "beta2", 1.5,
                 "beta2 = 1.5: must be in \\[0, 1\\]"),
    _bad_keyword("clamp_ratio", "clamp_ratio", 0.0,
                 "clamp_ratio = 0: must be finite and > 0"),
    _bad_keyword("weight_decay", "weight_decay", -0.1,
                 "weight_decay = -0.1: must be finite and >= 0"),
    _bad_keyword("momentum_coef", "momentum_coef", 1.5,
                 "momentum_coef = 1.5: must be in \\[0, 1\\]"),
    _bad_keyword("negative_t", "t", -1,
                 "t = -1: must be finite and >= 0"),
    _bad_keyword("base_lr_inf", "base_lr", float("inf"),
                 "base_lr = inf: must be finite"),
    _bad_keyword("grad_scale_numel", "grad_scale", torch.ones(2),
                 "grad_scale: expected float32 with 1 element, got float32 with 2"),
    _bad_keyword("skip_dtype", "skip", torch.zeros(1, dtype=torch.float16),
                 "skip: expected float32 with 1 element, got float16 with 1"),
    _bad_keyword("context_dtype", "context", torch.zeros(2),
                 "context: expected float64 with 2 elements \\(t, base_lr\\), got float32 with 2"),
    _bad_keyword("context_numel", "context", torch.zeros(3, dtype=torch.float64),
                 "context: expected float64 with 2 elements \\(t, base_lr\\), got float64 with 3"),
    _bad_keyword("context_empty", "context", torch.zeros(0, dtype=torch.float64),
                 "context: an empty tensor \\(give None to leave it out\\)"),
]


CASES = [_state_numel, _state_shape, _grad_shape, _param_reshaped, _state_dtype, _state_count,
         _grad_dtype, _steps_numel, _weights_count, _weights_numel, _levels_mismatch,
         _too_many_levels, _group_of, _alias, _params_overlap, _lr_dtype, _scratch,
         _scratch_in_a_state_tensor, _vsq_dtype, _accumulated_empty, _alias_index0,
         _grads_alias_params] + KEYWORD_CASES


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[1:] for c in CASES])
def test_bad_call_raises_and_writes_nothing(case):
    args, kw = _valid()
    exc, message = case(args, kw)
    _expect_error(args, kw, exc, message)


def test_legacy_residual_weight_and_loss():
    args, kw = _valid("legacy")
    args["weights"][0] = torch.ones(2)
    _expect_error(args, kw, ValueError,
                  "weights\\[0\\]: numel 2 does not match the legacy network's "
                  "residual_weight = 1")
    args, kw = _valid("legacy")
    kw["loss"] = None
    _expect_error(args, kw, ValueError, "loss: required by the legacy network \\(its context\\)")


def test_missing_keyword():
    args, kw = _valid()
    del kw["t"]
    with pytest.raises(TypeError, match="missing required keyword-only argument: 't'"):
        _C.cms_step(*[args[k] for k in ORDER], **kw)


class _Refused(Exception):
    pass


class _RaisesOnConversion:
    def __bool__(self):
        raise _Refused("no truth value")

    def __float__(self):
        raise _Refused("no float")


class _ConvertsInPython:
    """A value whose conversion runs Python code: after a failed conversion it would run with
    an exception set, which CPython turns into a SystemError."""

    def __bool__(self):
        return True

    def __float__(self):
        return 1.0


@pytest.mark.parametrize("key", ["fires", "divisors", "ema_decays"])
def test_a_level_value_that_raises_is_reported_as_it_raised(key):
    args, kw = _valid()
    kw[key] = [kw[key][0], _RaisesOnConversion(), _ConvertsInPython()]
    snap = [t.clone() for t in _written(args)]
    with pytest.raises(_Refused):
        _C.cms_step(*[args[k] for k in ORDER], **kw)
    assert all(torch.equal(a, b) for a, b in zip(_written(args), snap)), "a tensor was written"
