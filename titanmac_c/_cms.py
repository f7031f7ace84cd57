"""CMS mode of the DeepNestedOptimizer (spec section 7): the state it keeps, Phase 1 (surrogate
training of DirectUpdateMLP: its gradient from the C core on the CPU, from the same algorithm in
torch ops, without host syncs, on CUDA) and the checkpoint layout.
Phase 2, the parameter update, is one call of the C core (tm_cms_step).

State per tensor and level l < K, of the reference's ContinuumMemoryState only what some
computation reads: momentum m_l, accumulated gradient A_l (float32, the parameter's shape), the
gradient EMA e_0 of level 0 (the meta proxy loss's target), and the levels' fire counts, a
float32 device tensor [K] per tensor (incremented by the C core, so a step skipped on the device
does not count). The reference also keeps e_l for l > 0 and v_sq_l, which nothing reads (spec
7.1): 2K + 1 full-size buffers per tensor here instead of 4K. Checkpoints still carry every key
of the reference's layout; the buffers not kept are saved as zeros (stride-0 tensors, one
element of storage each), which the reference loads and, never reading them, continues as if
they held its values.
"""

import math

import torch

from . import _C
from ._reference_dno import (
    CMS_BETA2,
    DIRECT_MLP_MAX_HIDDEN,
    EMA_TARGET_MIN,
    IMPROVEMENT_THRESHOLD,
    META_GRAD_CLIP,
    META_SAMPLE_MAX,
    META_SAMPLE_PER_GROUP,
    PROXY_WARMUP_ENTRIES,
    STAGNATION_CONSTANT,
    SURROGATE_MAX_TENSORS,
    _fused_clip_grad_norm_,
    _tensor_stats,
)
from ._runtime import exec_kwargs, is_one_number, mark_written
from ._surrogate import SurrogatePlan, surrogate_gradient

CMS_BUFFERS = ("momentum", "accumulated_grad", "ema_grad", "v_sq")
PHASE1_PLANS_KEPT = 4  # Phase 1 layouts whose SurrogatePlan is kept (CUDA's way)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # where the fire counts are kept


def kept(name, level):
    """Whether CMSState keeps buffer `name` of `level` (see the module docstring)."""
    return name in ("momentum", "accumulated_grad") or (name == "ema_grad" and level == 0)


def level_frequencies(cms_frequencies, consistent=False):
    """Level l fires every B**l steps, B = cms_frequencies[1] (10 with one level): spec 7.1, B7.
    consistent (fix_reference_bugs): level l fires every cms_frequencies[l] steps, the period
    its gradient sum is divided by."""
    if consistent:
        return [int(f) for f in cms_frequencies]
    base = cms_frequencies[1] if len(cms_frequencies) > 1 else 10
    return [int(base ** level) for level in range(len(cms_frequencies))]


class CMSState:
    """The CMS buffers of every grouped tensor, as per-level lists in group order."""

    def __init__(self, params, cms_frequencies, device, consistent=False):
        self.params = list(params)
        self.k = len(cms_frequencies)
        self.cms_frequencies = list(cms_frequencies)
        self.frequencies = level_frequencies(cms_frequencies, consistent)
        self.ema_decays = [0.99 ** (1.0 / f) for f in self.frequencies]
        self.index = {p: i for i, p in enumerate(self.params)}
        f32 = dict(dtype=torch.float32, device=device)
        # buffers[name][level]: one tensor per param, or [] for a buffer not kept
        self.buffers = {name: [[torch.zeros(p.shape, **f32) for p in self.params]
                               if kept(name, level) else [] for level in range(self.k)]
                        for name in CMS_BUFFERS}
        self.step_counts = [torch.zeros(self.k, **f32) for _ in self.params]

    def public_view(self):
        """optimizer.state in CMS mode: per parameter a ParamCMSView, read like the reference's
        ContinuumMemoryState (.frequencies, .levels[l].momentum, ...) over the live buffers."""
        return CMSStateDict((p, ParamCMSView(self, i)) for i, p in enumerate(self.params))

    def momenta(self):
        return [m for level in self.buffers["momentum"] for m in level]

    def level_lists(self, name, indices):
        """Per-level lists of buffer `name` for the tensors at `indices` ([] where not kept: the
        C core then computes that buffer's update and drops it)."""
        return [[level[i] for i in indices] if level else [] for level in self.buffers[name]]

    def fires(self, t):
        return [t % f == 0 for f in self.frequencies]

    # -------------------------------------------------------------- checkpoints (Appendix A)

    def state_dict(self):
        """{tensor index: {level: {momentum, step_count (int), accumulated_grad, ema_grad,
        v_sq}}}; the step counts are read from the device here (checkpointing may sync)."""
        out = {}
        for i in range(len(self.params)):
            counts = self.step_counts[i].tolist()
            out[i] = {level: dict({name: self.buffer(name, level, i) for name in CMS_BUFFERS},
                                  step_count=int(counts[level]))
                      for level in range(self.k)}
        return out

    def buffer(self, name, level, i):
        """Tensor i's buffer `name` of `level`: the live one, or for a buffer not kept zeros of
        the parameter's shape with one element of storage (0-d parameters included)."""
        kept = self.buffers[name][level]
        if kept:
            return kept[i]
        p = self.params[i]
        return torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)

    def check_state_dict(self, cms_state):
        """Raises ValueError for a cms_state this state cannot load; writes nothing."""
        _check_dict("cms_state", cms_state)
        for i, levels in cms_state.items():
            if not isinstance(i, int) or not 0 <= i < len(self.params):
                raise ValueError(f"cms_state[{i!r}]: the optimizer has {len(self.params)} tensors")
            _check_dict(f"cms_state[{i}]", levels)
            for level, saved in levels.items():
                if not isinstance(level, int) or not 0 <= level < self.k:
                    raise ValueError(f"cms_state[{i}][{level!r}]: the optimizer has {self.k} "
                                     "levels")
                _check_dict(f"cms_state[{i}][{level}]", saved)
                _check_count(f"cms_state[{i}][{level}]['step_count']",
                             saved.get("step_count", 0))
                shape = self.params[i].shape
                for name in CMS_BUFFERS:
                    value = saved.get(name)
                    if value is None and name in ("momentum", "accumulated_grad"):
                        raise ValueError(f"cms_state[{i}][{level}]: no {name!r}")
                    if value is not None and (
                            not torch.is_tensor(value) or value.shape != shape
                            or value.device.type == "meta" or value.layout != torch.strided
                            or not value.is_floating_point()):
                        got = (type(value).__name__ if not torch.is_tensor(value) else
                               f"{tuple(value.shape)} {value.dtype} {value.layout} on "
                               f"{value.device}")
                        raise ValueError(f"cms_state[{i}][{level}][{name!r}]: {got}, expected a "
                                         f"dense floating tensor of shape {tuple(shape)} with "
                                         "values")

    @torch.no_grad()
    def reset(self):
        """Every buffer and step count back to zero, as at construction."""
        for levels in self.buffers.values():
            for level in levels:
                for buf in level:
                    buf.zero_()
        for counts in self.step_counts:
            counts.zero_()

    @torch.no_grad()
    def load_state_dict(self, cms_state):
        """Copies into the existing buffers; the caller has passed cms_state through
        check_state_dict (DeepNestedOptimizer checks every part of a checkpoint before its first
        write). A missing ema_grad / v_sq (older checkpoints) loads as zeros, as in the
        reference; values of buffers not kept were checked and are dropped."""
        for i, levels in cms_state.items():
            for level, saved in levels.items():
                for name in CMS_BUFFERS:
                    value = saved.get(name)
                    if self.buffers[name][level]:
                        buf = self.buffers[name][level][i]
                        buf.copy_(value if value is not None else torch.zeros_like(buf))
                self.step_counts[i][level] = float(saved.get("step_count", 0))


def _check_count(name, count):
    """A level's fire count as a checkpoint or a ContinuumMemoryState holds it: a number or a
    one-element tensor with a value, >= 0 and within float32 (where it is kept)."""
    try:
        value = float(count) if is_one_number(count) else None
    except (TypeError, ValueError, RuntimeError, OverflowError):
        value = None
    if value is None or not 0.0 <= value <= _FLOAT32_MAX:
        raise ValueError(f"{name}: {count!r}, expected a number >= 0 (float32)")


def _check_dict(name, value):
    if not isinstance(value, dict):
        raise ValueError(f"{name}: a {type(value).__name__}, expected a dict")


def _buffer_property(name):
    """A CMS buffer of one level: reads the live tensor; assigning copies into it (as the
    reference's attribute assignment replaces its tensor)."""
    def get(self):
        return self._cms.buffer(name, self._level, self._i)

    def set(self, value):
        self._assign(name, value)
    return property(get, set)


class CMSLevelView:
    """Level l of one tensor's CMS state, with the attributes of the reference's CMSLevel. The
    buffers are the live ones (in-place writes and assignments go into the optimizer's state);
    a buffer not kept (e_l for l > 0, v_sq) reads as zeros that refuse writes. step_count reads
    the device (a host sync)."""

    __slots__ = ("_cms", "_i", "_level")

    def __init__(self, cms, i, level):
        self._cms, self._i, self._level = cms, i, level

    def _check_assign(self, name, value):
        """The live buffer that `value` may be copied into (raises when it may not)."""
        kept = self._cms.buffers[name][self._level]
        if not kept:
            raise ValueError(f"{name} of CMS level {self._level}: not kept by titanmac_c (the "
                             "update never reads it; see the README's CMS memory note)")
        buf = kept[self._i]
        if not torch.is_tensor(value) or value.shape != buf.shape:
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"{name} of CMS level {self._level}: {got}, expected a tensor of "
                             f"shape {tuple(buf.shape)}")
        return buf

    def _assign(self, name, value):
        with torch.no_grad():
            self._check_assign(name, value).copy_(value)

    momentum = _buffer_property("momentum")
    accumulated_grad = _buffer_property("accumulated_grad")
    ema_grad = _buffer_property("ema_grad")
    v_sq = _buffer_property("v_sq")
    frequency = property(lambda self: self._cms.frequencies[self._level])
    ema_decay = property(lambda self: self._cms.ema_decays[self._level])
    beta2 = property(lambda self: CMS_BETA2)

    @property
    def step_count(self):
        return int(self._cms.step_counts[self._i][self._level])

    @step_count.setter
    def step_count(self, value):
        self._cms.step_counts[self._i][self._level] = float(value)


class CMSStateDict(dict):
    """optimizer.state in CMS mode. `state[p] = ContinuumMemoryState(...)` (the reference's way
    to reset one tensor's state) copies the given levels' kept buffers and step counts into the
    live state, all checked before any is written; an unknown key or a value without levels
    raises (a dict entry of its own would be ignored by the steps)."""

    def __reduce__(self):  # copies and pickles rebuild it whole (not through __setitem__)
        return type(self), (list(self.items()),)

    def __setitem__(self, p, value):
        view = self.get(p)
        if view is None:
            raise KeyError("optimizer.state: not a parameter of this optimizer (CMS mode keeps "
                           "one state per grouped parameter, made at construction)")
        if value is view:
            return
        levels = getattr(value, "levels", None)
        if levels is None or len(levels) != len(view.levels):
            raise ValueError(f"optimizer.state[p] = {type(value).__name__}: expected a CMS state "
                             f"with {len(view.levels)} levels (.levels)")
        writes = []
        for mine, given in zip(view.levels, levels):
            for name in CMS_BUFFERS:
                value_l = getattr(given, name, None)
                if value_l is not None and mine._cms.buffers[name][mine._level]:
                    writes.append((mine._check_assign(name, value_l), value_l))
            _check_count(f"step_count of CMS level {mine._level}", getattr(given, "step_count", 0))
        with torch.no_grad():
            for buf, value_l in writes:
                buf.copy_(value_l)
        for mine, given in zip(view.levels, levels):
            mine.step_count = getattr(given, "step_count", 0)


class ParamCMSView:
    """optimizer.state[p] in CMS mode: the reference's ContinuumMemoryState surface (frequencies,
    levels, should_update) over CMSState's buffers of tensor i."""

    __slots__ = ("_cms", "_i", "levels")

    def __init__(self, cms, i):
        self._cms, self._i = cms, i
        self.levels = [CMSLevelView(cms, i, level) for level in range(cms.k)]

    @property
    def frequencies(self):
        return list(self._cms.cms_frequencies)

    def should_update(self, level, step):
        return step % self.levels[level].frequency == 0

    def __repr__(self):
        return f"ParamCMSView(tensor {self._i}, frequencies {self.frequencies})"


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
        _fused_clip_grad_norm_(self.momentum_mlp.parameters(), META_GRAD_CLIP, inplace=True)
        self.mlp_optimizer.step()
        self._last_surrogate_loss = total.detach()

    def _check_cms_state_matches(self):
        """Phase 1 trains the MLP before Phase 2 runs: a parameter that no longer matches its CMS
        state (`p.data = ...` of another size or device) is refused here first, with a message
        that says what happened, nothing written."""
        momentum = self._cms.buffers["momentum"][0]
        for p in self._gather(with_params=True)[1]:
            m = momentum[self._cms.index[p]]
            if m.numel() != p.numel() or m.device != p.device:
                raise ValueError(
                    f"parameter {self._param_names[p]!r}: {p.numel()} elements on {p.device}, "
                    f"its CMS state {m.numel()} on {m.device} (the parameter was replaced since "
                    "the optimizer was built: build a new optimizer, or load a checkpoint of "
                    "this model)")

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
        targets, scale, divisor = self._phase1_targets(selected)
        idx = [cms.index[p] for p in selected]
        history = self._mlp_output_history
        has_prev = [i in history and history[i].shape == p.shape
                    for i, p in zip(idx, selected)]
        for i, p, prev in zip(idx, selected, has_prev):
            if not prev:  # the first call on this tensor (or a history of another shape)
                history[i] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        momenta = [cms.buffers["momentum"][0][i] for i in idx]
        outputs = [history[i] for i in idx]
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

    def _cms_phase2(self, t, check_only=False):
        """Spec 7.2 Phase 2 for every grouped tensor with a gradient: one tm_cms_step call.
        check_only: the call's checks alone (tm_cms_check), nothing run or written."""
        cms = self._cms
        grads, params, group_of, _ = self._gather(with_params=True)
        if not params:
            return
        idx = [cms.index[p] for p in params]
        lists = {name: cms.level_lists(name, idx) for name in
                 ("momentum", "accumulated_grad", "ema_grad", "v_sq")}
        net = "direct" if self.use_preprocessing else "legacy"
        hidden = (min(self.momentum_hidden_dim, DIRECT_MLP_MAX_HIDDEN) if self.use_preprocessing
                  else self.momentum_hidden_dim)
        kwargs = exec_kwargs(self.device)
        scratch = None
        try:
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
                scratch=scratch, check_only=check_only, **kwargs)
        except (BufferError, ValueError, TypeError) as err:
            self._reraise_named(err, params, weights_of="momentum_mlp")
        if not check_only:
            mark_written(params)

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
            losses.append(((_tensor_stats(pred) - _tensor_stats(target)) ** 2).sum())
        if not losses:
            return zero
        mlp_loss = torch.stack(losses).mean()
        if self.meta_trainer.recent_improvement() < IMPROVEMENT_THRESHOLD:
            mlp_loss = mlp_loss + STAGNATION_CONSTANT
        return mlp_loss
