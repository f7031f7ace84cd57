"""The loss of the model's last training forward, for a step() given none: training loops that
call step() without arguments (Hugging Face Trainer, accelerate's wrapper without a closure)
then step with the loss the model computed, where the reference steps with 0.0 and a warning
(its loss feeds the loss EMA, the NaN guard, the meta-update's proxy loss and CMS mode's)."""

from collections.abc import Mapping

import torch


def loss_of(output):
    """The loss a model's output carries: its "loss" entry (a dict, Hugging Face's ModelOutput)
    or attribute, when it is a one-element tensor; else None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class ModelLoss:
    """A forward hook on the optimizer's model that keeps the loss of its last forward run with
    grad enabled (a training forward: evaluation under no_grad leaves it). It keeps the tensor
    itself, detached only when a step takes it: a detach inside the hook costs a compiled
    model a graph break (torch 2.13), and the backward that follows frees what the tensor's
    graph saved. Holds no reference to the optimizer; a copy (deepcopy, pickle of the model)
    holds no loss."""

    def __init__(self):
        self.loss = None

    def __call__(self, module, args, output):
        if torch.is_grad_enabled():
            loss = loss_of(output)
            if loss is not None:
                self.loss = loss

    def take(self):
        """The kept loss, forgotten (each forward's loss serves one step), or None."""
        loss, self.loss = self.loss, None
        return None if loss is None else loss.detach()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.loss = None
