"""titanmac_c.AdamW, the drop-in for torch.optim.AdamW, and adamw_step, the functional entry its
step() and the DeepNestedOptimizer both call."""

from .adamw import AdamW, adamw_step

__all__ = ["AdamW", "adamw_step"]
