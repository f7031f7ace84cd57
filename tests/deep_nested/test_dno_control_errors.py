"""_C.dno_control's argument checks: each bad call raises the exact message, naming the tensor
(list and index) or the hyperparameter, and writes nothing."""

import math

import numpy as np
import pytest
import torch

from conftest import CUDA, DEVICES
from test_dno_control import ctrl_kwargs, flat_weights, make_controller
from titanmac_c import _C

def _valid_call(G=2, H=32, L=2, device="cpu"):
    net = make_controller(H, L, seed=0)
    args = {
        "group_grad": torch.ones(G), "group_param": torch.ones(G), "total_grad": torch.ones(1),
        "depths": torch.full((G,), 0.5), "loss": torch.ones(1), "weights": flat_weights(net, "cpu"),
        "mu": torch.full((G,), 0.75), "ema": torch.full((2,), 9.0), "lr": torch.full((G,), -1.0),
        "coef": torch.full((1,), -1.0), "skip": torch.full((1,), -1.0),
    }
    args = {k: ([w.to(device) for w in v] if k == "weights" else v.to(device))
            for k, v in args.items()}
    kw = ctrl_kwargs(H, L)
    return args, kw


def _call(args, kw):
    order = ["group_grad", "group_param", "total_grad", "depths", "loss", "weights", "mu", "ema",
             "lr", "coef", "skip"]
    _C.dno_control(*[args[k] for k in order], **kw)


def _expect_error(args, kw, exc, message):
    outs = {k: args[k].clone() for k in ("mu", "ema", "lr", "coef", "skip")}
    with pytest.raises(exc, match="^" + message + "$"):
        _call(args, kw)
    for k, v in outs.items():
        assert torch.equal(args[k], v), f"{k} was written"


def _numel(args, kw, dev):
    args["weights"][2] = torch.zeros(100, device=dev)
    return "weights\\[2\\]: numel 100 does not match the controller's H\\*H = 1024"


def _count(args, kw, dev):
    args["weights"].pop()
    return "weights: 5 tensors, the controller \\(layers = 2\\) has 6"


def _w_out(args, kw, dev):
    # W_out (weights[4]) must be [1, H]; a wrong numel is named with the 1*H it should have
    args["weights"][4] = torch.zeros(5, device=dev)
    return "weights\\[4\\]: numel 5 does not match the controller's 1\\*H = 32"


def _out_bias(args, kw, dev):
    args["weights"][5] = torch.zeros(2, device=dev)
    return "weights\\[5\\]: numel 2 does not match the controller's 1 = 1"


def _weight_dtype(args, kw, dev):
    args["weights"][0] = args["weights"][0].half()
    return "weights\\[0\\]: expected float32, got float16"


def _mu_size(args, kw, dev):
    args["mu"] = torch.ones(3, device=dev)
    return "mu: expected float32 with 2 elements, got float32 with 3"


def _ema_size(args, kw, dev):
    args["ema"] = torch.ones(1, device=dev)
    return "ema: expected float32 with 2 elements, got float32 with 1"


def _depths_dtype(args, kw, dev):
    args["depths"] = torch.ones(2, dtype=torch.float16, device=dev)
    return "depths: expected float32 with 2 elements, got float16 with 2"


def _hidden(args, kw, dev):
    kw["hidden"] = 2000
    return ("hidden = 2000: must be in \\[1, 1024\\] "
            "\\(on CUDA one thread of one block per hidden unit\\)")


def _layers(args, kw, dev):
    kw["layers"] = 0
    return ("layers = 0: must be in \\[1, 128\\] "
            "\\(on CUDA every weight is a launch parameter\\)")


def _base_lr(args, kw, dev):
    kw["base_lr"] = -1.0
    return "base_lr = -1: must be finite and >= 0"


def _base_lr_beyond_float32(args, kw, dev):
    kw["base_lr"], kw["mu_max"] = 1e38, 4.0
    return "base_lr = 1e\\+38: base_lr \\* mu_max = 4e\\+38 is beyond float32's range"


def _mu_range(args, kw, dev):
    kw["mu_min"], kw["mu_max"] = 2.0, 0.1
    return "mu_min = 2, mu_max = 0.1: must be finite with mu_min < mu_max"


def _ema_beta(args, kw, dev):
    kw["ema_beta"] = 1.5
    return "ema_beta = 1.5: must be in \\[0, 1\\]"


def _max_norm(args, kw, dev):
    kw["max_grad_norm"] = math.nan
    return "max_grad_norm = nan: must be a number \\(<= 0 turns clipping off\\)"


def _alias(args, kw, dev):
    buf = torch.full((4,), 0.75, device=dev)
    args["mu"], args["lr"] = buf[0:2], buf[1:3]
    return "lr: shares memory with mu"


def _alias_weights(args, kw, dev):
    args["coef"] = args["weights"][1][4:5]
    return "coef: shares memory with weights\\[1\\]"


def _previous_size(args, kw, dev):
    kw["previous"] = torch.zeros(4, device=dev)  # mu and ema only; 2G + 4 = 8 with lr, coef, skip
    return "previous: expected float32 with 8 elements, got float32 with 4"


def _previous_alias(args, kw, dev):
    buf = torch.full((10,), 0.75, device=dev)
    args["ema"], kw["previous"] = buf[0:2], buf[1:9]
    return "previous: shares memory with ema"


CASES = [_numel, _count, _w_out, _out_bias, _weight_dtype, _mu_size, _ema_size, _depths_dtype,
         _hidden, _layers, _base_lr, _base_lr_beyond_float32, _mu_range, _ema_beta, _max_norm,
         _alias, _alias_weights, _previous_size, _previous_alias]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__.strip("_"))
def test_invalid_arguments(case, device):
    args, kw = _valid_call(device=device)
    message = case(args, kw, device)
    _expect_error(args, kw, ValueError, message)


def test_previous_size_of_a_group_count_near_int32_max():
    """2G + 4 elements for G = 2^31 - 1 is 2^32 + 2: counted in 32 bits it wrapped to 2, a
    2-element previous was accepted and the undo record was written past its end. The per-group
    tensors are allocated and never touched (no resident memory); nothing is written."""
    G = 2**31 - 1
    args, kw = _valid_call()
    big = torch.empty(G)
    for k in ("group_grad", "group_param", "depths", "mu", "lr"):
        args[k] = big if k not in ("mu", "lr") else torch.empty(G)
    kw["previous"] = torch.full((2,), 3.0)
    small = {k: args[k].clone() for k in ("ema", "coef", "skip")}
    with pytest.raises(ValueError, match="^previous: expected float32 with 4294967298 "
                                         "elements, got float32 with 2$"):
        _call(args, kw)
    assert torch.equal(kw["previous"], torch.full((2,), 3.0))
    for k, v in small.items():
        assert torch.equal(args[k], v), f"{k} was written"


@pytest.mark.parametrize("device", DEVICES)
def test_valid_call_passes(device):
    args, kw = _valid_call(device=device)
    _call(args, kw)
    assert args["skip"].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_adjacent_outputs_are_not_aliases(device):
    """mu and lr side by side in one buffer (touching, not overlapping) are accepted."""
    args, kw = _valid_call(device=device)
    buf = torch.zeros(4, device=device)
    args["mu"], args["lr"] = buf[0:2], buf[2:4]
    args["mu"].fill_(0.75)
    _call(args, kw)
    assert torch.allclose(args["lr"], kw["base_lr"] * args["mu"]), (args["lr"], args["mu"])


def test_read_only_output():
    args, kw = _valid_call()
    lr = np.zeros(2, np.float32)
    lr.flags.writeable = False
    args["lr"] = lr
    with pytest.raises(BufferError, match=r"^lr: read-only, cannot be updated$"):
        _call(args, kw)
    assert (lr == 0).all() and torch.equal(args["mu"], torch.full((2,), 0.75))


def test_missing_keyword():
    args, kw = _valid_call()
    del kw["base_lr"]
    message = r"^dno_control\(\) missing required keyword-only argument: 'base_lr'$"
    with pytest.raises(TypeError, match=message):
        _call(args, kw)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device or backend")
def test_mixed_devices():
    args, kw = _valid_call(device="cuda")
    args["loss"] = torch.ones(1)
    _expect_error(args, kw, ValueError, "loss: on cpu, but group_grad is on cuda:0")


class _Refused(Exception):
    pass


class _RaisesOnFloat:
    def __float__(self):
        raise _Refused("no float")


class _FloatInPython:
    def __float__(self):  # Python code: must not run with an exception set (SystemError)
        return 1.0


def test_a_base_lr_that_raises_is_reported_as_it_raised():
    args, kw = _valid_call()
    kw["base_lr"], kw["max_grad_norm"] = _RaisesOnFloat(), _FloatInPython()
    outs = {k: args[k].clone() for k in ("mu", "ema", "lr", "coef", "skip")}
    with pytest.raises(_Refused):
        _call(args, kw)
    for k, v in outs.items():
        assert torch.equal(args[k], v), f"{k} was written"
