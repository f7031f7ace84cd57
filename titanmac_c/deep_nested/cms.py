"""CMS mode of the DeepNestedOptimizer (spec section 7): Phase 1 (surrogate training of
DirectUpdateMLP: its gradient from the C core on the CPU; on CUDA, without host syncs, from the
same algorithm in torch ops, or with TITANMAC_CUDA_PHASE1=core from the C core with the MLP's
Adam step, capturable in a CUDA graph: phase1.py), Phase 2, the parameter update, as one call of
the C core (tm_cms_step), and the momentum network's meta proxy loss. The state it keeps and its
checkpoint layout: cms_state.py.

Section numbers (spec N, §N) and bug ids (B1-B11, its section 14) refer to
docs/deep_nested_optimizer.md.
"""

import math
from types import SimpleNamespace

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
from .._internal.runtime import (Scratch, before_write, dense_order, exec_kwargs, in_layout_of,
                                mark_written)
from .._internal.step_hooks import has_step_hooks, tell_schedulers_stepped, with_step_hooks
from .phase1 import CorePhase1, Phase1Call, cuda_phase1_path, device_skip_scale
from .surrogate import SurrogatePlan, surrogate_gradient
from .undo import training_undo

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


class CMSMode:
    """The CMS-mode update of a DeepNestedOptimizer: its state (CMSState), Phase 1 (the
    DirectUpdateMLP's surrogate training) and Phase 2 (the C core's tm_cms_step), reading the
    learning rates, clip coefficient, skip flag and loss the control op wrote (Control).

    phase1_cpu_path: how Phase 1 runs. On the CPU its gradient comes from the C core's op, and a
    step the device-side guard skipped is seen on the host (a free read there), so Phase 1 skips
    it as the reference's does; on CUDA the same algorithm runs in torch ops (with chunk plans for
    the selected sizes) and a skipped step's targets count as zero (no host read). The tests set
    it False to run CUDA's way on the CPU. phase1_core (CUDA, TITANMAC_CUDA_PHASE1=core; the
    tests set it on the CPU too): CUDA's way with the gradient from the C core's op and the MLP's
    Adam step from its AdamW op (phase1.py), which CUDA-graph mode captures with the step."""

    phase1_core = False  # (class defaults for objects pickled before they existed)
    core = None

    def __init__(self, device, params, weights, control, state, *, use_preprocessing, hidden,
                 layers, cms_frequencies, fix_reference_bugs):
        self.device = device
        self.params = params  # GroupedParams
        self.weights = weights  # NetworkWeights
        self.control = control  # Control: lr, coef, skipped, loss
        self.state = state  # CMSState
        self.use_preprocessing = use_preprocessing
        self.net = "direct" if use_preprocessing else "legacy"
        # the DirectUpdateMLP is capped at DIRECT_MLP_MAX_HIDDEN units, as the reference's
        self.hidden = min(hidden, DIRECT_MLP_MAX_HIDDEN) if use_preprocessing else hidden
        self.layers = layers
        self.cms_frequencies = cms_frequencies
        self.fix_reference_bugs = fix_reference_bugs
        self.output_history = {}  # tensor index -> last Phase 1 output (checkpointed)
        self.phase1_cpu_path = device.type == "cpu"
        # opt-in until a GPU has run it: the torch ops stay CUDA's default (the variable is
        # checked on every device, so a misspelt value fails on the CPU too)
        self.phase1_core = cuda_phase1_path() == "core" and device.type == "cuda"
        self.core = CorePhase1()
        self.phase1_plans = {}
        self.last_surrogate_loss = None
        self.phase1_undo = None  # see phase1
        self.scratch = Scratch()
        self.relaid = False  # the last Phase 2 laid gradients out (phase2)

    def momentum_norms(self):
        """The norm of every (tensor, level) momentum, as device tensors; none without grouped
        tensors (a model frozen at construction), where the reference's are 0."""
        momenta = self.state.momenta()
        return list(torch._foreach_norm(momenta)) if momenta else []

    def phase1(self, step):
        """Spec 7.2 Phase 1, every mlp_train_freq steps with DirectUpdateMLP: the surrogate
        training on the first 20 tensors with a gradient. Its input is the level-0 accumulator,
        zero at this point in the reference (B1). On the CPU the loss's gradient comes from the
        C core (tm_cms_surrogate); on CUDA from its algorithm in torch ops
        (surrogate.surrogate_gradient), or with phase1_core from the C core, the MLP's Adam step
        then by the C core's AdamW too (_core_phase1; graph mode: phase1_graph_call)."""
        self.phase1_undo = None  # set when this step's Phase 1 wrote: undone if Phase 2 fails
        if not self.phase1_due(step):
            return
        if self.phase1_cpu_path and float(self.control.skipped) != 0.0:
            return  # the reference's guard returns before Phase 1 (CUDA: device_skip_scale)
        selected = self._phase1_selection(step)
        if not selected:
            return
        if self._core_on_device():
            self.core.adam.check(step.mlp_optimizer)  # refused before anything is written
        # an exception from here until Phase 2 has written (torch's optimizer hooks run in the
        # MLP's Adam step; a tensor's __dlpack__; a signal) is undone by the caller with this
        self.phase1_undo = self._phase1_undo(step)
        step.mlp_optimizer.zero_grad()
        if self._core_on_device():
            self._core_phase1(step, selected)
            return
        total = self._phase1_gradient(selected, step.momentum_mlp)
        # The reference's clip (torch ops, no host sync) and Adam step.
        fused_clip_grad_norm_(step.momentum_mlp.parameters(), META_GRAD_CLIP, inplace=True)
        step.mlp_optimizer.step()
        self.last_surrogate_loss = total.detach()

    def _phase1_selection(self, step):
        """The checks before Phase 1 writes, then the tensors it trains on (may be none)."""
        self._check_state_matches()
        # Phase 1 writes the MLP and its Adam state before Phase 2 runs: whatever Phase 2 would
        # refuse (a gradient sharing memory, a buffer of another dtype) is refused first
        self.phase2(step, check_only=True)
        return select_phase1_tensors(self.params.base.param_groups)

    def _core_on_device(self):
        """Phase 1 takes CUDA's way (no host read of the skip flag) through the C core."""
        return self.phase1_core and not self.phase1_cpu_path

    def _core_phase1(self, step, selected):
        """An eager Phase 1 step through the C core (phase1.py): the surrogate gradient, the
        reference's clip, and mlp_optimizer's step by the C core's AdamW between torch's step
        hooks of mlp_optimizer (its own and the global ones), as its step() runs them."""
        mlp, optimizer = step.momentum_mlp, step.mlp_optimizer
        call = self._core_call(selected, mlp, static=False)
        call.run()

        def update():  # prepared here: a pre-hook may have changed a group's lr
            self.core.adam.prepare(optimizer, self.device).run_eagerly()
        if has_step_hooks(optimizer):
            with_step_hooks(optimizer, update)
        else:
            update()
        tell_schedulers_stepped(optimizer)
        self.last_surrogate_loss = call.total.detach()

    def phase1_graph_call(self, step):
        """CUDA-graph mode's Phase 1 step: (key, run, finish) when it is captured with the step's
        other calls, built on the host now (every check, every buffer, the Adam's step counts in
        device memory): run() the device work a capture records, key what that capture froze
        (host numbers, addresses), finish() the host bookkeeping after the replay ran (run again
        after an interrupt, it does the same). None when this step's Phase 1 runs eagerly
        instead (the torch ops' path, step hooks on mlp_optimizer, no tensor selected)."""
        optimizer = step.mlp_optimizer
        if not self._core_on_device() or has_step_hooks(optimizer):
            return None
        self.phase1_undo = None
        selected = self._phase1_selection(step)
        if not selected:
            return None
        mlp = step.momentum_mlp
        # nothing on the device is written before the replay, which writes all of it or nothing
        self.phase1_undo = self._host_undo(mlp, optimizer)
        call = self._core_call(selected, mlp, static=True)
        adam = self.core.adam.prepare(optimizer, self.device)
        adam.fill_steps()
        before_write(adam.params)

        def run():  # what the capture records (run at the capture only)
            call.run()
            adam.run()

        def finish():
            mark_written(adam.params)
            adam.finish()
            tell_schedulers_stepped(optimizer)
            self.last_surrogate_loss = call.total.clone()  # the graph's buffer: a copy
        return (call.key(), adam.key()), run, finish

    def _host_undo(self, mlp, optimizer):
        """Puts back what building a graph's Phase 1 call changes on the host: the output
        history's entries, the MLP's .grad, Adam state entries made for its first step."""
        history = dict(self.output_history)
        grads = [(w, w.grad) for w in mlp.parameters()]
        had_state = set(optimizer.state)

        def undo():
            self.output_history = history
            for w, g in grads:
                w.grad = g
            for p in [p for p in optimizer.state if p not in had_state]:
                del optimizer.state[p]
        return undo

    def _core_call(self, selected, mlp, static):
        """The Phase1Call of these tensors. static (graph mode): the MLP's gradients and the
        losses in buffers kept across steps, and the mean loss written into one."""
        inputs = self._phase1_inputs(selected, mlp, static)
        core = self.core
        scratch = core.scratch_for(inputs.targets, self.layers, self.device)
        total = core.static_total(self.device) if static else None
        return Phase1Call(inputs, self.control.skipped, self.hidden, self.layers, scratch,
                          self.device, total)

    def _phase1_undo(self, step):
        """A function that puts back what Phase 1 writes: the MLP's weights and gradients, its
        Adam state, the output history. Copies made every Phase 1 step: the weights and Adam
        state are small; the history holds at most SURROGATE_MAX_TENSORS tensors, in float32,
        a fraction of what the per-element MLP itself computes over them."""
        undo_training = training_undo(step.momentum_mlp.parameters(), step.mlp_optimizer)
        history = {i: t.clone() for i, t in self.output_history.items()}
        last_loss = self.last_surrogate_loss

        def undo():
            undo_training()
            self.output_history = history
            self.last_surrogate_loss = last_loss
        return undo

    def _check_state_matches(self):
        """Phase 1 trains the MLP before Phase 2 runs: a parameter that no longer matches its CMS
        state (`p.data = ...` of another size or device) is refused here first, with a message
        that says what happened, nothing written."""
        momentum = self.state.buffers["momentum"][0]
        params = self.params.gather(with_params=True)[1]
        for p, i in zip(params, self.indices(params)):
            m = momentum[i]
            if m.numel() != p.numel() or m.device != p.device:
                raise ValueError(
                    f"parameter {self.params.names[p]!r}: {p.numel()} elements on {p.device}, "
                    f"its CMS state {m.numel()} on {m.device} (the parameter was replaced since "
                    "the optimizer was built: build a new optimizer, or load a checkpoint of "
                    "this model)")

    def indices(self, params):
        """Each parameter's place in the CMS state. One appended to a group after construction
        has none (the reference fails on it with a KeyError): refused, named, nothing written."""
        try:
            return [self.state.index[p] for p in params]
        except KeyError as err:
            name = self.params.names.get(err.args[0], "?")
            raise ValueError(
                f"parameter {name!r}: no CMS state (appended to a group after the optimizer was "
                "built: CMS mode keeps the state of the parameters it was built with, as the "
                "reference does; build a new optimizer to train it)") from None

    def phase1_due(self, step):
        """Phase 1 runs at this step (the DirectUpdateMLP's surrogate training)."""
        return self.use_preprocessing and step.t % step.mlp_train_freq == 0

    def _phase1_targets(self, selected):
        """Per tensor what g^_0 is made of, and the scale: (targets, scale, divisor) with
        g^_0 = target * scale / divisor (a non-finite g^_0 counts as 0). CUDA's way applies
        device_skip_scale to the scale when it runs."""
        divisor = float(max(self.cms_frequencies[0], 1))
        if self.fix_reference_bugs:  # B1 corrected: the current (clipped) gradient
            targets, scale = [p.grad.detach() for p in selected], self.control.coef
        else:  # B1: A_0 was reset by the last Phase 2, so this is zero
            acc = self.state.buffers["accumulated_grad"][0]
            targets, scale = [acc[self.state.index[p]] for p in selected], None
        return targets, scale, divisor

    def _phase1_gradient(self, selected, mlp):
        """The surrogate loss's gradient over the selected tensors into the MLP's .grad (the
        mean over tensors, as the reference's backward of the stacked mean), each tensor's output
        kept in place as the next call's previous output; returns the mean loss. The activations
        are never all stored: the reference's autograd holds [numel, H] floats per layer for
        every tensor until its backward (~1.3 GB on the 3.2M-parameter TitanMAC-like model)."""
        i = self._phase1_inputs(selected, mlp, static=False)
        scale = i.scale if self.phase1_cpu_path else device_skip_scale(self.control.skipped,
                                                                       i.scale)
        if self.phase1_cpu_path:
            _C.cms_surrogate(
                i.targets, i.momenta, i.outputs, i.weights, i.grads, i.losses,
                divisor=i.divisor, hidden=self.hidden, layers=self.layers,
                has_prev=i.has_prev, scale=scale, **exec_kwargs(self.device))
        else:
            surrogate_gradient(i.targets, i.momenta, i.outputs, i.weights, i.grads, i.losses,
                               divisor=i.divisor, has_prev=i.has_prev, scale=scale,
                               plan=self._phase1_plan(tuple(p.numel() for p in i.selected)))
        return i.losses.mean()

    def _phase1_inputs(self, selected, mlp, static):
        """The lists and numbers of a Phase 1 gradient call over the selected tensors, each
        tensor's last output in the history (a fresh one the first time) as the call's previous
        output and its new output's place; the MLP's .grad made (static: graph mode's kept
        buffers, CorePhase1)."""
        cms = self.state
        idx = [cms.index[p] for p in selected]
        for i, p in zip(idx, selected):
            cms.lay_out_like(i, p)  # the targets may be the accumulators
        targets, scale, divisor = self._phase1_targets(selected)
        history = self.output_history
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
        mlp_params = list(mlp.parameters())
        grads = (self.core.static_grads(mlp_params) if static
                 else [torch.empty_like(w) for w in mlp_params])
        for w, g in zip(mlp_params, grads):
            w.grad = g
        losses = (self.core.static_losses(len(selected), self.device) if static else
                  torch.empty(len(selected), dtype=torch.float32, device=self.device))
        return SimpleNamespace(
            selected=selected, targets=views(targets), scale=scale, divisor=divisor,
            momenta=views([cms.buffers["momentum"][0][i] for i in idx]),
            outputs=views([history[i] for i in idx]), has_prev=has_prev,
            weights=self.weights.of("momentum_mlp", mlp), grads=grads, losses=losses,
            mlp_params=mlp_params)

    def _phase1_plan(self, sizes):
        """The SurrogatePlan of these sizes, from the last few layouts (a selection that changes
        with gradients present or not, e.g. alternating branches, reuses its plans: each costs a
        few fills per tensor on CUDA)."""
        plans = self.phase1_plans
        plan = plans.pop(sizes, None) or SurrogatePlan(sizes, self.device)
        plans[sizes] = plan  # most recent last
        while len(plans) > PHASE1_PLANS_KEPT:
            del plans[next(iter(plans))]
        return plan

    def phase2(self, step, check_only=False, context=None):
        """Spec 7.2 Phase 2 for every grouped tensor with a gradient: one tm_cms_step call.
        check_only: the call's checks alone (tm_cms_check), nothing run or written. context:
        None, or a float64 [2] device tensor that holds (t, base_lr) for the legacy network's
        context when the call runs, read there instead of the numbers (CUDA-graph mode: a
        replay repeats the numbers of its capture)."""
        grads, params, group_of, _ = self.params.gather(with_params=True)
        if not params:
            return
        idx = self.indices(params)
        if not check_only:
            before_write(params)
        try:
            # a gradient laid out otherwise than its parameter, buffers of a parameter relaid
            # out since: the C core refuses them (it pairs elements by their place in memory)
            # before any write, so they are laid out like the parameter; at once when the last
            # step needed it (a gradient that comes so every step), else after a refusal
            laid = self._laid_out_grads(idx, params, grads) if self.relaid else None
            if laid is None:
                try:
                    self._call(step, idx, params, grads, group_of, check_only, context)
                except BufferError:
                    laid = self._laid_out_grads(idx, params, grads)
                    if laid is None:
                        raise
            if laid is not None:
                self._call(step, idx, params, laid, group_of, check_only, context)
        except (BufferError, ValueError, TypeError) as err:
            self.params.reraise_named(err, params, weights=("momentum_mlp", step.momentum_mlp))
        self.relaid = laid is not None
        if not check_only:
            mark_written(params)

    def _laid_out_grads(self, idx, params, grads):
        """The gradients in their parameters' layouts (copies for this step, in_layout_of),
        every CMS buffer moved into its parameter's layout for good (CMSState.lay_out_like);
        None when that changes nothing."""
        changed = False
        laid = []
        for i, p, g in zip(idx, params, grads):
            changed = self.state.lay_out_like(i, p) or changed
            laid.append(in_layout_of(g, p))
            changed = changed or laid[-1] is not g
        return laid if changed else None

    def _call(self, step, idx, params, grads, group_of, check_only, context=None):
        """tm_cms_step (or its checks alone) on the tensors at idx."""
        cms = self.state
        control = self.control
        lists = {name: cms.level_lists(name, idx) for name in CMS_BUFFERS}
        scratch = None
        if self.device.type == "cuda":
            nbytes = _C.cms_scratch_bytes(params, levels=cms.k, net=self.net)
            scratch = self.scratch.get(self.device, nbytes)
        _C.cms_step(
            params, grads, lists["momentum"], lists["accumulated_grad"], lists["ema_grad"],
            lists["v_sq"], [cms.step_counts[i] for i in idx], control.lr, group_of,
            self.weights.of("momentum_mlp", step.momentum_mlp),
            fires=cms.fires(step.t), divisors=[float(max(f, 1)) for f in self.cms_frequencies],
            ema_decays=cms.ema_decays, net=self.net, hidden=self.hidden,
            layers=self.layers, weight_decay=step.weight_decay, t=float(step.t),
            base_lr=step.base_lr, loss=control.loss, grad_scale=control.coef,
            skip=control.skipped, context=context, scratch=scratch, check_only=check_only,
            **exec_kwargs(self.device))

    def mlp_proxy_loss(self, loss_value, grad_scale, meta_trainer, global_step, base_lr, mlp):
        """Spec 9.3 in CMS mode (in AdamW mode every target is zero, so it is 0). No gradient
        reaches the MLP (B2); the value only enters last_meta_loss."""
        zero = torch.zeros((), device=self.device, requires_grad=True)
        if len(meta_trainer.loss_history) < PROXY_WARMUP_ENTRIES:
            return zero
        sampled = []
        for group in self.params.base.param_groups:
            sampled.extend(p for p in group["params"][:META_SAMPLE_PER_GROUP]
                           if p.grad is not None)
        sampled = sampled[:META_SAMPLE_MAX]
        context = torch.tensor([global_step / 1000.0, base_lr,
                                math.log(max(loss_value, 1e-8) + 1.0)],
                               dtype=torch.float32, device=self.device)
        losses = []
        for p in sampled:
            i = self.state.index[p]
            target = self.state.buffers["ema_grad"][0][i]
            if target.abs().max() < EMA_TARGET_MIN:  # host sync, meta steps only
                continue
            m0 = self.state.buffers["momentum"][0][i]
            grad = p.grad if grad_scale is None else p.grad * grad_scale
            if self.use_preprocessing:
                pred = mlp(grad, m0)
            else:
                a, b, _ = mlp(grad, m0, context)
                pred = a * m0 + b * grad
            losses.append(((tensor_stats(pred) - tensor_stats(target)) ** 2).sum())
        if not losses:
            return zero
        mlp_loss = torch.stack(losses).mean()
        if meta_trainer.recent_improvement() < IMPROVEMENT_THRESHOLD:
            mlp_loss = mlp_loss + STAGNATION_CONSTANT
        return mlp_loss
