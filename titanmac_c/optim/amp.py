"""What torch.amp.GradScaler hands the step of an optimizer that declares
_step_supports_amp_scaling (titanmac_c.AdamW does, as torch's fused AdamW): the loss scale the
gradients still carry and the found-inf flag, both read on the device only."""

import numbers

import torch
from torch import Tensor


class AmpScaling:
    """The attributes grad_scale (the loss scale the gradients still carry, None once unscale_
    ran) and found_inf (nonzero when a gradient was not finite) that GradScaler sets on the
    optimizer, tensors on the scaler's device. As torch's fused AdamW: a found_inf step changes
    nothing; otherwise each gradient is divided by grad_scale as the update loads it and stored
    back so divided."""

    def __init__(self, grad_scale, found_inf):
        self.loss_scale = None if grad_scale is None else self._one("grad_scale", grad_scale)
        self.found_inf = None if found_inf is None else self._one("found_inf", found_inf)
        self._per_device = {}

    @classmethod
    def of(cls, optimizer):
        """The optimizer's scaling for this step, or None without a GradScaler."""
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        if grad_scale is None and found_inf is None:
            return None
        return cls(grad_scale, found_inf)

    @staticmethod
    def _one(name, value):
        """value as a float32 [1] tensor, or a number (GradScaler's sum of no flags) as a float
        that inputs() fills in on the device."""
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.is_complex():
                raise ValueError(f"optimizer.{name}: expected one real value, got a tensor of "
                                 f"shape {tuple(value.shape)} and dtype {value.dtype}")
            return value.detach().reshape(1).to(torch.float32)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"optimizer.{name}: expected a tensor or a number, got "
                            f"{type(value).__name__}")
        return float(value)

    def inputs(self, device):
        """(loss_scale, skip) of tm_adamw_step for the tensors on device (a number as a fill
        there: a copy from host memory would wait for the GPU)."""
        cached = self._per_device.get(device)
        if cached is None:
            cached = self._per_device[device] = tuple(
                None if t is None else t.to(device) if isinstance(t, Tensor)
                else torch.full((1,), t, dtype=torch.float32, device=device)
                for t in (self.loss_scale, self.found_inf))
        return cached
