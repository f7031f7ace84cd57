"""The param groups' hyperparameters as titanmac_c.AdamW hands them to the C core at each step:
validated on the host before any write (a scheduler or a user may have changed them since
construction), betas read as floats, learning rates as one tensor on the parameters' device."""

import math

import torch
from torch import Tensor

from .._internal.runtime import as_number, float_in_range

# values that cannot change in place: a group holding only these, as at its last check, needs no
# new check (a tensor, or a 0-d numpy array, may have changed under the same object)
_IMMUTABLE = (float, int, bool)

_FLOAT32_MAX = torch.finfo(torch.float32).max


def scalar(name, value):
    """The float value of a hyperparameter that may be a 1-element tensor (read on the host:
    a tensor on the GPU costs a sync)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value)
    return value


class Hyperparameters:
    """One optimizer's reader, with what it keeps between steps: the floats of betas given as
    device tensors, and the uploaded learning rates."""

    def __init__(self):
        # (group, 0 or 1) -> (the tensor beta there, its _version, its float): one entry a slot,
        # so a schedule that installs new tensors keeps none of the old ones alive
        self._beta_values = {}
        self._lr_cache = {}  # (device, dtype) -> (host lr values, tensor on device)
        # group index -> (its values as last checked, of_group's answer): the checks cost ~2 us
        # a group, a twentieth of a step's host time over a small model
        self._checked_values = {}

    def of_group(self, gi, group):
        """(beta1, beta2, eps, weight_decay, maximize) of param_groups[gi]."""
        try:
            values = (group["lr"], *group["betas"], group["eps"], group["weight_decay"],
                      group["maximize"])
        except (KeyError, TypeError):
            values = ()  # the checks name the problem
        plain = bool(values) and all(type(v) in _IMMUTABLE for v in values)
        cached = self._checked_values.get(gi) if plain else None
        if cached is not None and cached[0] == values:
            return cached[1]
        where = f"param_groups[{gi}]"
        try:
            result = self._checked(gi, group, where)
        except KeyError as e:  # looked for only on the error path: no cost to a step
            raise ValueError(f"{where}: no {e.args[0]!r} (e.g. a checkpoint's group without "
                             "it)") from None
        if plain:
            self._checked_values[gi] = (values, result)
        return result

    def _checked(self, gi, group, where):
        """of_group's checks; a missing key raises KeyError."""
        lr = group["lr"]
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{where}['lr']: a tensor of {lr.numel()} elements, not 1")
        elif not math.isfinite(as_number(f"{where}['lr']", lr)):
            # a negative one is stepped, as torch steps it (e.g. a LambdaLR's linear decay run
            # past its end): torch refuses it only at construction
            raise ValueError(f"{where}['lr'] = {lr}: must be finite")
        try:
            beta1, beta2 = (self._beta_value((gi, k), b) for k, b in enumerate(group["betas"]))
        except (TypeError, ValueError) as e:  # None, a number: TypeError, as torch's
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"{where}['betas'] = {group['betas']!r}: expected two numbers "
                       f"in [0, 1) ({e})") from None
        return (
            float_in_range(f"{where}['betas'][0]", beta1, 0.0, 1.0),
            float_in_range(f"{where}['betas'][1]", beta2, 0.0, 1.0),
            float_in_range(f"{where}['eps']", group["eps"], 0.0, math.inf, high_open=False),
            float_in_range(f"{where}['weight_decay']", group["weight_decay"], 0.0, math.inf,
                           high_open=False),
            bool(group["maximize"]),
        )

    def _beta_value(self, slot, beta):
        """A beta's float. A tensor on the CPU is read every step (no sync); one on a device is
        read once per version (an in-place op bumps it), so it costs a sync only when a
        schedule changed it."""
        if not isinstance(beta, Tensor):
            return beta
        if beta.device.type == "cpu":
            return scalar("betas", beta)
        cached = self._beta_values.get(slot)
        if cached is None or cached[0] is not beta or cached[1] != beta._version:
            cached = self._beta_values[slot] = (beta, beta._version, scalar("betas", beta))
        return cached[2]

    def lr_tensor(self, device, lrs, dtype):
        """The groups' learning rates as one tensor of dtype (float32; float64, torch's Python
        float, when a parameter is float64) on the device (the C core reads them from memory, so
        a tensor lr never visits the host). Float lrs are cached and re-uploaded only when a
        value changed, in place and without a host sync (pinned, non-blocking), so the tensor
        keeps its address for CUDA graphs."""
        if any(isinstance(lr, Tensor) for lr in lrs):
            return torch.stack([
                torch.as_tensor(lr, dtype=dtype, device=device).reshape(()) for lr in lrs
            ])
        values = tuple(map(float, lrs))  # a numpy scalar or 0-d array too, as torch's AdamW
        key = (device, dtype)
        cached = self._lr_cache.get(key)
        if cached is not None and cached[0] == values:
            return cached[1]
        if dtype != torch.float64:
            for gi, lr in enumerate(values):
                if abs(lr) > _FLOAT32_MAX:  # would round to inf (torch raises on it too)
                    raise ValueError(f"param_groups[{gi}]['lr'] = {lr}: beyond float32's range "
                                     "(the learning rates of a step without float64 parameters "
                                     "are float32)")
        host = torch.tensor(values, dtype=dtype)
        if device.type != "cuda":
            tensor = host
        else:
            tensor = cached[1] if cached is not None and len(cached[0]) == len(values) else \
                torch.empty(len(values), dtype=dtype, device=device)
            tensor.copy_(host.pin_memory(), non_blocking=True)
        self._lr_cache[key] = (values, tensor)
        return tensor
