"""The DeepNestedOptimizer's constructor arguments and model, checked when the optimizer is built
(and the loss each step is given): what the reference would take and then fail on (or train with
torch ops, which the C core does not run) is refused here with the argument's or the parameter's
name.

Bug ids (B7, its section 14) refer to docs/deep_nested_optimizer.md."""

import math
import numbers
from typing import NamedTuple

import torch

from .. import _C
from .cms_state import level_frequencies
from .._internal.distributed import is_dtensor
from .._internal.runtime import COMPLEX_DTYPES, SUPPORTED_DTYPES, as_number, dense_order
from .nets import MAX_LR_MULT

# the CMS update's parameter dtypes (its buffers and update are float32, as the reference's, for
# every model); AdamW mode takes what titanmac_c.AdamW takes: complex too. A complex model fails
# the reference's CMS update (a complex gradient added into a float32 buffer)
DNO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ADAMW_MODE_DTYPES = SUPPORTED_DTYPES + COMPLEX_DTYPES
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def as_int(value):
    """value as an int when it is a whole number (int, numpy integer, 100.0 from a JSON or
    argparse config, a 1-element tensor), else None; bools are not numbers here."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() and not value.isfinite().all():
            return None
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return None


def check_int(name, value, low):
    """An int >= low; any whole number is accepted (the reference uses these in arithmetic)."""
    whole = as_int(value)
    if whole is None or whole < low:
        raise ValueError(f"{name} = {value!r}: must be a whole number >= {low}")
    return whole


def check_frequencies(cms_frequencies, consistent):
    """CMS mode: a non-empty sequence of whole numbers (a list, tuple, numpy array or tensor),
    as a list of ints, whose levels fire at periods >= 1: level l every
    cms_frequencies[1] ** l steps (B7; cms_frequencies[0] only divides level 0's sum, and may be
    0 as in the reference), or every cms_frequencies[l] steps with consistent (B7 corrected)."""
    try:
        freqs = [as_int(f) for f in cms_frequencies]
    except TypeError:
        freqs = []
    if not freqs or any(f is None or f < 0 for f in freqs):
        raise ValueError(f"cms_frequencies = {cms_frequencies!r}: a non-empty list of whole "
                         "numbers >= 0")
    periods = level_frequencies(freqs, consistent)
    if min(periods) < 1:
        raise ValueError(f"cms_frequencies = {cms_frequencies!r}: level periods {periods}; each "
                         "must be >= 1")
    return freqs


def check_c_limits(opt):
    """The sizes the C core's fixed arrays take, checked when the optimizer is built (the
    reference takes any). The momentum network runs only in CMS mode; the controller always."""
    limits = [("controller_hidden_dim", opt.controller_hidden_dim, _C.DNO_MAX_HIDDEN),
              ("controller_num_layers", opt.controller_num_layers, _C.DNO_MAX_LAYERS)]
    if opt.use_cms_updates:
        limits += [("len(cms_frequencies)", len(opt.cms_frequencies), _C.CMS_MAX_LEVELS),
                   ("momentum_num_layers", opt.momentum_num_layers, _C.CMS_MAX_LAYERS)]
        if not opt.use_preprocessing:  # the DirectUpdateMLP is capped at 20 as in the reference
            limits.append(("momentum_hidden_dim", opt.momentum_hidden_dim,
                           _C.CMS_LEGACY_MAX_HIDDEN))
    for name, value, most in limits:
        if value > most:
            raise ValueError(f"{name} = {value}: titanmac_c takes at most {most} (the size of "
                             "the C core's fixed arrays; the reference takes any)")


def check_float(name, value, low=0.0):
    value = as_number(name, value)  # None or a string: a TypeError naming the argument
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{name} = {value}: must be finite and >= {low}")
    return value


def check_rate_range(base_lr):
    """The rates base_lr * mu live in a float32 device tensor (the C core refuses a step whose
    rate would be inf there; the reference's Python double would step the model to inf/NaN)."""
    top = base_lr * MAX_LR_MULT
    if top > FLOAT32_MAX:
        raise ValueError(f"base_lr = {base_lr}: base_lr * mu_max = {top} is beyond float32's "
                         "range")


def loss_in_float32_range(loss):
    """A finite loss beyond float32's range (where the device keeps it) as float32's largest
    value, not inf, which the device guard would skip as a non-finite loss: a float, or a
    float64 tensor; NaN and inf kept."""
    if not isinstance(loss, torch.Tensor):
        return max(-FLOAT32_MAX, min(loss, FLOAT32_MAX))
    if loss.dtype != torch.float64:
        return loss
    return torch.where(loss.isfinite(), loss.clamp(-FLOAT32_MAX, FLOAT32_MAX), loss)


def model_device(model):
    """The reference's device: the first parameter's, frozen or not (a model with every
    parameter frozen gets empty groups and steps nothing, as the reference's)."""
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("model has no parameters")
    return first.device


def _supported(cms):
    return "float32, bfloat16, float16, float64" + ("" if cms else ", complex64, complex128")


def check_grouped(groups, group_names, device, cms):
    """What the C core would refuse at the first step(), refused here with the parameter's name
    (the reference accepts these and trains them with torch ops). AdamW mode takes what
    titanmac_c.AdamW takes besides: complex parameters. Both modes take parameters dense in
    some order (channels_last, transposed: the statistics read any layout, the updates pair a
    parameter's tensors in its layout); the CMS update computes in float32 math, a float64
    parameter stepped in double as the reference steps it."""
    for group, names in zip(groups, group_names):
        for p, name in zip(group["params"], names):
            if is_dtensor(p):
                raise TypeError(f"parameter {name!r}: a DTensor (FSDP2 / tensor parallel); the "
                                "DeepNestedOptimizer's statistics, controller and CMS state are "
                                "per model, so it takes plain parameters (DDP works); "
                                "titanmac_c.AdamW steps sharded models")
            if p.dtype not in (DNO_DTYPES if cms else ADAMW_MODE_DTYPES):
                raise BufferError(f"parameter {name!r}: dtype {p.dtype} is not supported "
                                  f"({_supported(cms)}; e.g. model.float())"
                                  + ("; AdamW mode also trains complex models" if cms
                                     else ""))
            if p.device != device:
                raise ValueError(f"parameter {name!r}: on {p.device}, the first parameter on "
                                 f"{device}: the optimizer needs one device")
            if p.layout != torch.strided or not (p.is_contiguous() or dense_order(p) is not None):
                raise BufferError(f"parameter {name!r}: not dense in any order (a strided "
                                  "slice: e.g. p.data = p.data.contiguous())")


def check_loss_value(loss):
    """step()'s loss: a one-element real tensor (read on the device) or a number."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"loss_value: a tensor loss must have 1 element, "
                             f"got shape {tuple(loss.shape)}")
        if loss.is_complex() or loss.device.type == "meta":
            raise ValueError(f"loss_value: a {loss.dtype} tensor on {loss.device}: expected "
                             "a real value")
        return loss
    # a string, a list, a complex: TypeError, as the reference's float() of it
    return as_number("loss_value", loss, "a number or a one-element tensor")


class StepInputs(NamedTuple):
    """What the parts of one step read of the optimizer's public attributes, taken once when the
    step starts: a user may assign any of them between steps (a base_lr schedule, a new
    max_grad_norm, a replaced network), and every part of the step then sees the same values."""

    t: int                   # this step's number (global_step after it)
    update: bool             # the controller is evaluated at this step
    base_lr: float
    max_grad_norm: float     # <= 0: no clipping
    weight_decay: float      # the CMS update's (AdamW mode: the groups' own)
    controller: torch.nn.Module
    momentum_mlp: torch.nn.Module
    mlp_optimizer: object    # torch.optim.Adam of the DirectUpdateMLP, or None
    mlp_train_freq: int      # Phase 1 every mlp_train_freq steps
