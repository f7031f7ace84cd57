"""CMS mode of the DeepNestedOptimizer (spec section 7): Phase 1 (surrogate training of
DirectUpdateMLP: its gradient from the C core on the CPU, from the same algorithm in torch ops,
without host syncs, on CUDA), Phase 2, the parameter update, as one call of the C core
(tm_cms_step), and the momentum network's meta proxy loss. The state it keeps and its
checkpoint layout: _cms_state.py.
"""

import math

import torch

from .. import _C
from .cms_state import CMS_BUFFERS
from .nets import (
    DIRECT_MLP_MAX_HIDDEN,
    EMA_TARGET_MIN,
    IMPROVEMENT_THRESHOLD,
    META_GRAD_CLIP,
    META_SAMPLE_MAX,
    META_SAMPLE_PER_GROUP,
    PROXY_WARMUP_ENTRIES,
    STAGNATION_CONSTANT,
    SURROGATE_MAX_TENSORS,
    fused_clip_grad_norm_,
    tensor_stats,
)
from .._internal.runtime import before_write, dense_order, exec_kwargs, in_layout_of, mark_written
from .surrogate import SurrogatePlan, surrogate_gradient

PHASE1_PLANS_KEPT = 4  # Phase 1 layouts whose SurrogatePlan is kept (CUDA's way)


def select_phase1_tensors(param_groups):
    """The first (at most) 20 tensors with a gradient, walking the groups in order (7.2)."""
    selected = []
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None:
                selected.append(p)
                if len(selected) >= SURROGATE_MAX_TENSORS:
                    return selected
    return selected


def _order_of(p):
    """The permutation under which p is contiguous when p lies in another dense order
    (channels_last, transposed); None when it is contiguous or dense in no order (the C core
    refuses that, naming it). Phase 1 reads its tensors as flat memory (CUDA's torch ops view
    them as 1-d), so it takes them under this permutation."""
    return None if p.is_contiguous() else dense_order(p)


def _permuted(t, order, p):
    """t (a tensor paired element by element with parameter p, in p's layout) under p's
    permutation: a contiguous view of its memory. t as it is when its shape is not p's (the
    C core names the mismatch)."""
    return t if order is None or t.shape != p.shape else t.permute(order)


@torch.no_grad()
def init_output_on_sign(mlp):
    """The corrected B4: DirectUpdateMLP starts at output = 0.1 * sign_g exactly (the intent of
    the reference's weight[0, 1] = 0.1, which lands on a hidden unit instead). Hidden units 0 and
    1 read only sign_g, with opposite signs, and every later hidden layer carries them on; since
    SiLU(x) - SiLU(-x) = x, the output layer's weights (0.1, -0.1) on them give 0.1 * sign_g."""
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    first, hidden, out = linears[0], linears[1:-1], linears[-1]  # width >= 2 (constructor)
    first.weight[0:2].zero_()
    first.weight[0, 1], first.weight[1, 1] = 1.0, -1.0  # feature 1 is sign_g
    first.bias[0:2].zero_()
    for layer in hidden:
        layer.weight[0:2].zero_()
        layer.weight[0, 0], layer.weight[0, 1] = 1.0, -1.0
        layer.weight[1, 0], layer.weight[1, 1] = -1.0, 1.0
        layer.bias[0:2].zero_()
    out.weight.zero_()
    out.bias.zero_()
    out.weight[0, 0], out.weight[0, 1] = 0.1, -0.1


class CMSModeMixin:
    """The CMS-mode steps of DeepNestedOptimizer (its attributes: _cms, momentum_mlp,
    mlp_optimizer, base_optimizer, _lr, _coef, skipped, _loss, ...)."""

    def _momentum_norms(self):
        """The norm of every (tensor, level) momentum, as device tensors; none in AdamW mode or
        without grouped tensors (a model frozen at construction), where the reference's are 0."""
        momenta = self._cms.momenta() if self._cms is not None else []
        return list(torch._foreach_norm(momenta)) if momenta else []

    def get_momentum_stats(self):
        """Norms of every (tensor, level) momentum (one host sync). AdamW mode keeps no momentum
        buffers: the reference's all-zero ones give 0."""
        norms = self._momentum_norms()
        if not norms:
            return {"momentum_total_norm": 0.0, "momentum_avg_norm": 0.0,
                    "global_step": self.global_step}
        total = torch.stack(norms).sum().item()
        return {"momentum_total_norm": total, "momentum_avg_norm": total / len(norms),
                "global_step": self.global_step}

    def _phase1(self, t):
        """Spec 7.2 Phase 1, every mlp_train_freq steps with DirectUpdateMLP: the surrogate
        training on the first 20 tensors with a gradient. Its input is the level-0 accumulator,
        zero at this point in the reference (B1). On the CPU the loss's gradient comes from the
        C core (tm_cms_surrogate); on CUDA from its algorithm in torch ops
        (_surrogate.surrogate_gradient)."""
        if not self._phase1_due(t):
            return
        if self._phase1_cpu_path and float(self.skipped) != 0.0:
            return  # the reference's guard returns before Phase 1 (CUDA: _phase1_targets)
        self._check_cms_state_matches()
        # Phase 1 writes the MLP and its Adam state before Phase 2 runs: whatever Phase 2 would
        # refuse (a gradient sharing memory, a buffer of another dtype) is refused first
        self._cms_phase2(t, check_only=True)
        selected = select_phase1_tensors(self.base_optimizer.param_groups)
        if not selected:
            return
        self.mlp_optimizer.zero_grad()
        total = self._phase1_gradient(selected)
        # The reference's clip (torch ops, no host sync) and Adam step.
        fused_clip_grad_norm_(self.momentum_mlp.parameters(), META_GRAD_CLIP, inplace=True)
        self.mlp_optimizer.step()
        self._last_surrogate_loss = total.detach()

    def _check_cms_state_matches(self):
        """Phase 1 trains the MLP before Phase 2 runs: a parameter that no longer matches its CMS
        state (`p.data = ...` of another size or device) is refused here first, with a message
        that says what happened, nothing written."""
        momentum = self._cms.buffers["momentum"][0]
        params = self._gather(with_params=True)[1]
        for p, i in zip(params, self._cms_indices(params)):
            m = momentum[i]
            if m.numel() != p.numel() or m.device != p.device:
                raise ValueError(
                    f"parameter {self._param_names[p]!r}: {p.numel()} elements on {p.device}, "
                    f"its CMS state {m.numel()} on {m.device} (the parameter was replaced since "
                    "the optimizer was built: build a new optimizer, or load a checkpoint of "
                    "this model)")

    def _cms_indices(self, params):
        """Each parameter's place in the CMS state. One appended to a group after construction
        has none (the reference fails on it with a KeyError): refused, named, nothing written."""
        try:
            return [self._cms.index[p] for p in params]
        except KeyError as err:
            name = self._param_names.get(err.args[0], "?")
            raise ValueError(
                f"parameter {name!r}: no CMS state (appended to a group after the optimizer was "
                "built: CMS mode keeps the state of the parameters it was built with, as the "
                "reference does; build a new optimizer to train it)") from None

    def _phase1_due(self, t):
        """Phase 1 runs at step t (the DirectUpdateMLP's surrogate training)."""
        return self.use_preprocessing and t % self.mlp_train_freq == 0

    def _phase1_targets(self, selected):
        """Per tensor what g^_0 is made of, and the scale: (targets, scale, divisor) with
        g^_0 = target * scale / divisor (a non-finite g^_0 counts as 0)."""
        divisor = float(max(self.cms_frequencies[0], 1))
        if self.fix_reference_bugs:  # B1 corrected: the current (clipped) gradient
            targets, scale = [p.grad.detach() for p in selected], self._coef
        else:  # B1: A_0 was reset by the last Phase 2, so this is zero
            acc = self._cms.buffers["accumulated_grad"][0]
            targets, scale = [acc[self._cms.index[p]] for p in selected], None
        if not self._phase1_cpu_path:
            # A step the guard skipped (known on the device only) trains on zero targets: scale
            # 0 zeroes them, NaN gradients included. x * 1 is exact, so an unskipped step is
            # unchanged.
            scale = torch.where(self.skipped != 0.0, 0.0, 1.0 if scale is None else scale)
        return targets, scale, divisor

    def _phase1_gradient(self, selected):
        """The surrogate loss's gradient over the selected tensors into the MLP's .grad (the
        mean over tensors, as the reference's backward of the stacked mean), each tensor's output
        kept in place as the next call's previous output; returns the mean loss. The activations
        are never all stored: the reference's autograd holds [numel, H] floats per layer for
        every tensor until its backward (~1.3 GB on the 3.2M-parameter TitanMAC-like model)."""
        cms = self._cms
        idx = [cms.index[p] for p in selected]
        for i, p in zip(idx, selected):
            cms.lay_out_like(i, p)  # the targets may be the accumulators
        targets, scale, divisor = self._phase1_targets(selected)
        history = self._mlp_output_history
        has_prev = [i in history and history[i].shape == p.shape
                    for i, p in zip(idx, selected)]
        for i, p, prev in zip(idx, selected, has_prev):
            # the first call on this tensor (or a history of another shape): a fresh output;
            # else the last one, in p's layout as every tensor it pairs with
            history[i] = (in_layout_of(history[i], p) if prev
                          else torch.empty_like(p, dtype=torch.float32))
        orders = [_order_of(p) for p in selected]

        def views(tensors):  # in the parameters' layouts, as the C core pairs elements
            return [_permuted(in_layout_of(t, p), o, p)
                    for t, o, p in zip(tensors, orders, selected)]
        targets = views(targets)
        momenta = views([cms.buffers["momentum"][0][i] for i in idx])
        outputs = views([history[i] for i in idx])
        grads = []
        for w in self.momentum_mlp.parameters():
            w.grad = torch.empty_like(w)
            grads.append(w.grad)
        weights = self._weights_of("momentum_mlp")
        losses = torch.empty(len(selected), dtype=torch.float32, device=self.device)
        if self._phase1_cpu_path:
            _C.cms_surrogate(
                targets, momenta, outputs, weights, grads, losses, divisor=divisor,
                hidden=min(self.momentum_hidden_dim, DIRECT_MLP_MAX_HIDDEN),
                layers=self.momentum_num_layers, has_prev=has_prev, scale=scale,
                **exec_kwargs(self.device))
        else:
            surrogate_gradient(targets, momenta, outputs, weights, grads, losses,
                               divisor=divisor, has_prev=has_prev, scale=scale,
                               plan=self._phase1_plan(tuple(p.numel() for p in selected)))
        return losses.mean()

    def _phase1_plan(self, sizes):
        """The SurrogatePlan of these sizes, from the last few layouts (a selection that changes
        with gradients present or not, e.g. alternating branches, reuses its plans: each costs a
        few fills per tensor on CUDA)."""
        plans = self._phase1_plans
        plan = plans.pop(sizes, None) or SurrogatePlan(sizes, self.device)
        plans[sizes] = plan  # most recent last
        while len(plans) > PHASE1_PLANS_KEPT:
            del plans[next(iter(plans))]
        return plan

    def _cms_phase2(self, t, check_only=False, context=None):
        """Spec 7.2 Phase 2 for every grouped tensor with a gradient: one tm_cms_step call.
        check_only: the call's checks alone (tm_cms_check), nothing run or written. context:
        None, or a float64 [2] device tensor that holds (t, base_lr) for the legacy network's
        context when the call runs, read there instead of the numbers (CUDA-graph mode: a
        replay repeats the numbers of its capture)."""
        grads, params, group_of, _ = self._gather(with_params=True)
        if not params:
            return
        idx = self._cms_indices(params)
        if not check_only:
            before_write(params)
        try:
            # a gradient laid out otherwise than its parameter, buffers of a parameter relaid
            # out since: the C core refuses them (it pairs elements by their place in memory)
            # before any write, so they are laid out like the parameter; at once when the last
            # step needed it (a gradient that comes so every step), else after a refusal
            laid = self._cms_laid_out_grads(idx, params, grads) if self._cms_relaid else None
            if laid is None:
                try:
                    self._cms_call(t, idx, params, grads, group_of, check_only, context)
                except BufferError:
                    laid = self._cms_laid_out_grads(idx, params, grads)
                    if laid is None:
                        raise
            if laid is not None:
                self._cms_call(t, idx, params, laid, group_of, check_only, context)
        except (BufferError, ValueError, TypeError) as err:
            self._reraise_named(err, params, weights_of="momentum_mlp")
        self._cms_relaid = laid is not None
        if not check_only:
            mark_written(params)

    def _cms_laid_out_grads(self, idx, params, grads):
        """The gradients in their parameters' layouts (copies for this step, in_layout_of),
        every CMS buffer moved into its parameter's layout for good (CMSState.lay_out_like);
        None when that changes nothing."""
        changed = False
        laid = []
        for i, p, g in zip(idx, params, grads):
            changed = self._cms.lay_out_like(i, p) or changed
            laid.append(in_layout_of(g, p))
            changed = changed or laid[-1] is not g
        return laid if changed else None

    def _cms_call(self, t, idx, params, grads, group_of, check_only, context=None):
        """tm_cms_step (or its checks alone) on the tensors at idx."""
        cms = self._cms
        lists = {name: cms.level_lists(name, idx) for name in CMS_BUFFERS}
        net = "direct" if self.use_preprocessing else "legacy"
        hidden = (min(self.momentum_hidden_dim, DIRECT_MLP_MAX_HIDDEN) if self.use_preprocessing
                  else self.momentum_hidden_dim)
        scratch = None
        if self.device.type == "cuda":
            nbytes = _C.cms_scratch_bytes(params, levels=cms.k, net=net)
            scratch = self._cms_scratch.get(self.device, nbytes)
        _C.cms_step(
            params, grads, lists["momentum"], lists["accumulated_grad"], lists["ema_grad"],
            lists["v_sq"], [cms.step_counts[i] for i in idx], self._lr, group_of,
            self._weights_of("momentum_mlp"),
            fires=cms.fires(t), divisors=[float(max(f, 1)) for f in self.cms_frequencies],
            ema_decays=cms.ema_decays, net=net, hidden=hidden,
            layers=self.momentum_num_layers, weight_decay=self.weight_decay, t=float(t),
            base_lr=self.base_lr, loss=self._loss, grad_scale=self._coef, skip=self.skipped,
            context=context, scratch=scratch, check_only=check_only, **exec_kwargs(self.device))

    def _mlp_proxy_loss(self, loss_value, grad_scale):
        """Spec 9.3 in CMS mode (in AdamW mode every target is zero, so it is 0). No gradient
        reaches the MLP (B2); the value only enters last_meta_loss."""
        zero = torch.zeros((), device=self.device, requires_grad=True)
        if self._cms is None or len(self.meta_trainer.loss_history) < PROXY_WARMUP_ENTRIES:
            return zero
        sampled = []
        for group in self.base_optimizer.param_groups:
            sampled.extend(p for p in group["params"][:META_SAMPLE_PER_GROUP]
                           if p.grad is not None)
        sampled = sampled[:META_SAMPLE_MAX]
        context = torch.tensor([self.global_step / 1000.0, self.base_lr,
                                math.log(max(loss_value, 1e-8) + 1.0)],
                               dtype=torch.float32, device=self.device)
        losses = []
        for p in sampled:
            i = self._cms.index[p]
            target = self._cms.buffers["ema_grad"][0][i]
            if target.abs().max() < EMA_TARGET_MIN:  # host sync, meta steps only
                continue
            m0 = self._cms.buffers["momentum"][0][i]
            grad = p.grad if grad_scale is None else p.grad * grad_scale
            if self.use_preprocessing:
                pred = self.momentum_mlp(grad, m0)
            else:
                a, b, _ = self.momentum_mlp(grad, m0, context)
                pred = a * m0 + b * grad
            losses.append(((tensor_stats(pred) - tensor_stats(target)) ** 2).sum())
        if not losses:
            return zero
        mlp_loss = torch.stack(losses).mean()
        if self.meta_trainer.recent_improvement() < IMPROVEMENT_THRESHOLD:
            mlp_loss = mlp_loss + STAGNATION_CONSTANT
        return mlp_loss
