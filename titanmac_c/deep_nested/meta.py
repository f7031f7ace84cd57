"""The DeepNestedOptimizer's meta-learning (docs/deep_nested_optimizer.md section 9): the
controller's proxy-loss update every meta_update_freq steps (simple mode) or on meta_update()
calls, and the mark that lets a direct _update_meta_components() after step() see the clipped
gradients the reference's in-place clip would have left (ours scales them only as the update
loads them). The momentum network's proxy loss is CMS mode's (cms.py)."""

import torch

from .._internal.grad_mark import GradientMark
from .nets import EXPLICIT_META_ROWS, META_GRAD_CLIP, fused_clip_grad_norm_, meta_histories
from .undo import training_undo

CURRENT = object()  # _update_meta_components' default: the current gradients' clip


def host_float(loss):
    """A loss's value on the host: .item() of a tensor, as the reference reads it (float() of a
    tensor that requires grad warns, an error under -W error)."""
    return loss.item() if torch.is_tensor(loss) else float(loss)


def mark_clipped_gradients(max_grad_norm, param_groups):
    """The GradientMark of the gradients after a step that clips, or None: the reference clips
    .grad in place, ours scales only as the update loads it, so a later direct
    _update_meta_components applies the coefficient while these are still the step's gradients
    (no backward since). The first gradient only (of_first): this runs every step for a rare
    path whose worst case is the meta statistics of one call, where watching every gradient
    would cost every step ~0.5 us a tensor."""
    if max_grad_norm <= 0:
        return None
    return GradientMark.of_first(param_groups)


def clip_of_current_gradients(mark, control):
    """The clip coefficient the reference's in-place clip would have left on the current
    gradients, or None (no clip, a skipped step, or gradients from a backward since)."""
    if mark is None or not mark.holds() or float(control.skipped) != 0.0:
        return None
    return control.coef


def meta_step(control, cms, loss_value, grad_scale, step, meta_trainer, meta_optimizer):
    """Spec 9.2: one update of the controller (and, in name, the momentum network) by the proxy
    losses. The mean momentum norm is 0 in AdamW mode (cms None) and the MLP proxy loss is 0
    there (every sampled tensor's level-0 EMA is zero in the reference), so only the controller
    learns. grad_scale: the clip coefficient the gradients carry, or None. step: StepInputs
    (t is the global step). Returns (the total meta loss, detached; the meta gradient norm).
    An exception that stops it leaves the networks, their Adam state and the meta trainer's
    histories as they were."""
    norms = cms.momentum_norms() if cms is not None else []
    momentum_norm = torch.stack(norms).mean().item() if norms else 0.0
    loss_value = host_float(loss_value)
    meta_params = list(step.momentum_mlp.parameters()) + list(step.controller.parameters())
    undo_training = training_undo(meta_params, meta_optimizer)
    histories = meta_histories(meta_trainer)
    try:
        return _meta_step(control, cms, loss_value, grad_scale, step, meta_trainer,
                          meta_optimizer, momentum_norm, meta_params)
    except BaseException:  # an interrupt, or an exception from torch's optimizer hooks
        undo_training()
        for name, values in histories.items():
            setattr(meta_trainer, name, values)
        raise


def _meta_step(control, cms, loss_value, grad_scale, step, meta_trainer, meta_optimizer,
               momentum_norm, meta_params):
    meta_trainer.record_step(loss_value, control.lr_multipliers.clone(), momentum_norm)
    stats = control.group_stats(grad_scale)
    with torch.enable_grad():
        meta_optimizer.zero_grad()
        proposed = step.controller(stats)
        # The recorded multipliers are the C controller's, which rounds each unit's sum once
        # where torch's forward rounds as its kernels go: the proxy takes the proposal's value
        # from the C controller too (its gradient still through torch's forward), so a group
        # whose stats did not change since the step (an empty one) gives the reference's exact
        # zero, not an ulp that Adam's normalization turns into a full meta-step on the weights
        # only that group reaches.
        proposed = proposed + (control.c_controller(stats, step.controller, step.base_lr)
                               - proposed).detach()
        controller_loss = meta_trainer.compute_proxy_loss(proposed)
        if cms is not None:
            mlp_loss = cms.mlp_proxy_loss(loss_value, grad_scale, meta_trainer, step.t,
                                          step.base_lr, step.momentum_mlp)
        else:  # AdamW mode: a zero that takes part in the backward, as the reference's
            mlp_loss = torch.zeros((), device=control.device, requires_grad=True)
        total = controller_loss + mlp_loss
        total.backward()
    grad_norm = fused_clip_grad_norm_(meta_params, META_GRAD_CLIP, inplace=True)
    meta_optimizer.step()
    return total.detach(), grad_norm


def validation_batch(val_batch):
    """meta_update's batch as the reference takes it: a dict batch's tensors cut to their first
    EXPLICIT_META_ROWS rows when its "input_ids" has more."""
    if (isinstance(val_batch, dict) and torch.is_tensor(val_batch.get("input_ids"))
            and val_batch["input_ids"].shape[0] > EXPLICIT_META_ROWS):
        return {k: (v[:EXPLICIT_META_ROWS] if torch.is_tensor(v) and v.ndim > 0 else v)
                for k, v in val_batch.items()}
    return val_batch
