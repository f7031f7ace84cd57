"""The DeepNestedOptimizer's meta-learning (spec 9): the controller's proxy-loss update every
meta_update_freq steps (simple mode) or on meta_update() calls, and the bookkeeping that lets a
direct _update_meta_components() after step() see the clipped gradients the reference's in-place
clip would have left (ours scales them only as the update loads them).

A mixin of titanmac_c.DeepNestedOptimizer (deep_nested.py); the MLP's proxy loss is CMS mode's
(_cms.py).
"""

import torch

from .._internal.grad_mark import GradientMark
from .nets import (
    EXPLICIT_META_ROWS,
    META_GRAD_CLIP,
    N_GROUPS,
    default_loss_fn,
    fused_clip_grad_norm_,
)
from .._internal.runtime import eager_only

CURRENT = object()  # _update_meta_components' default: the current gradients' clip


def _host_float(loss):
    """A loss's value on the host: .item() of a tensor, as the reference reads it (float() of a
    tensor that requires grad warns, an error under -W error)."""
    return loss.item() if torch.is_tensor(loss) else float(loss)


class MetaLearningMixin:
    def _mark_clipped_gradients(self):
        """The GradientMark of the gradients after a step that clips: the reference clips .grad
        in place, ours scales only as the update loads it, so a later direct
        _update_meta_components applies the coefficient while these are still the step's
        gradients (no backward since). The first gradient only (of_first): this runs every step
        for a rare path whose worst case is the meta statistics of one call, where watching
        every gradient would cost every step ~0.5 us a tensor."""
        if self.max_grad_norm <= 0:
            return None
        return GradientMark.of_first(self.base_optimizer.param_groups)

    def _clip_of_current_gradients(self):
        """The clip coefficient the reference's in-place clip would have left on the current
        gradients, or None (no clip, a skipped step, or gradients from a backward since)."""
        mark = self._clip_mark
        if mark is None or not mark.holds() or float(self.skipped) != 0.0:
            return None
        return self._coef

    def _group_stats(self, grad_scale=None):
        """S [G, 3] as the reference's _compute_group_stats (non-finite norms -> 1.0).
        grad_scale: the clip coefficient of the step just taken. The reference clips the
        gradients in place, so stats taken after its step see clipped gradients; ours are
        scaled only as the update loads them, and ||k g|| = k ||g||."""
        self._run_norms(True)
        g = N_GROUPS
        grad_norms = self._norms[0:g] if grad_scale is None else self._norms[0:g] * grad_scale
        grad_in, param_in = self._controller_inputs(grad_norms, self._norms[g:2 * g])
        stats = torch.stack([grad_in, param_in, self.group_depths], dim=1)
        ones = torch.ones_like(self.group_depths)
        return torch.where(torch.isfinite(stats),
                           stats, torch.stack([ones, ones, self.group_depths], dim=1))

    def _update_meta_components(self, loss_value, grad_scale=CURRENT):
        """Spec 9.2. The mean momentum norm is 0 in AdamW mode and the MLP proxy loss is 0 (every
        sampled tensor's level-0 EMA is zero in the reference), so only the controller learns.
        Some callers call this directly after step() (spec 12): the gradients are then the
        clipped ones in the reference, hence the default grad_scale."""
        if grad_scale is CURRENT:
            grad_scale = self._clip_of_current_gradients()
        norms = self._momentum_norms()
        momentum_norm = torch.stack(norms).mean().item() if norms else 0.0
        loss_value = _host_float(loss_value)
        self.meta_trainer.record_step(loss_value, self._lr_multipliers.clone(),
                                      momentum_norm)
        stats = self._group_stats(grad_scale)
        with torch.enable_grad():
            self.meta_optimizer.zero_grad()
            proposed = self.controller(stats)
            # The recorded multipliers are the C controller's, which rounds each unit's sum once
            # where torch's forward rounds as its kernels go: the proxy takes the proposal's
            # value from the C controller too (its gradient still through torch's forward), so
            # a group whose stats did not change since the step (an empty one) gives the
            # reference's exact zero, not an ulp that Adam's normalization turns into a full
            # meta-step on the weights only that group reaches.
            proposed = proposed + (self._c_controller(stats) - proposed).detach()
            controller_loss = self.meta_trainer.compute_proxy_loss(proposed)
            mlp_loss = self._mlp_proxy_loss(loss_value, grad_scale)
            total = controller_loss + mlp_loss
            total.backward()
        meta_params = list(self.momentum_mlp.parameters()) + list(self.controller.parameters())
        grad_norm = fused_clip_grad_norm_(meta_params, META_GRAD_CLIP, inplace=True)
        self.meta_optimizer.step()
        self.last_meta_loss = total.detach()
        self.controller_grad_norm = grad_norm

    @eager_only
    def meta_update(self, val_batch, train_batches=None, loss_fn=None, use_unrolled=True):
        """Spec 9.4, simplified branch: the controller and the momentum network learn from the
        loss on val_batch (loss_fn(model, batch); by default model(batch)'s "loss" entry, else
        its "total", else the output itself; a dict batch's tensors cut to their first 4 rows
        when its "input_ids" has more, as the reference). The reference takes its unrolled
        branch when use_unrolled and train_batches holds at least k_unroll batches; that branch
        is broken in the reference (B3) and raises NotImplementedError here. With fewer batches
        (or none) both take the simplified branch."""
        loss_fn = loss_fn or default_loss_fn
        if use_unrolled and train_batches is not None and len(train_batches) >= self.k_unroll:
            raise NotImplementedError(
                "meta_update(use_unrolled=True): the reference's unrolled meta-gradient is "
                "broken (spec 14, B3); call meta_update(..., use_unrolled=False)")
        if (isinstance(val_batch, dict) and torch.is_tensor(val_batch.get("input_ids"))
                and val_batch["input_ids"].shape[0] > EXPLICIT_META_ROWS):
            val_batch = {k: (v[:EXPLICIT_META_ROWS] if torch.is_tensor(v) and v.ndim > 0 else v)
                         for k, v in val_batch.items()}
        with torch.enable_grad():
            val_loss = loss_fn(self.model, val_batch)
        val_loss = _host_float(val_loss)
        self.zero_grad(set_to_none=True)
        self._update_meta_components(val_loss, grad_scale=None)
