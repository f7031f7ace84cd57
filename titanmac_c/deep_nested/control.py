"""The statistics pass and the fused control step of the DeepNestedOptimizer (spec sections 3
and 4): per-group gradient and parameter norms in one tm_norms call, then tm_dno_control (loss
EMA, NestedController, learning rates, clip coefficient, skip predicate) on the device. Every
tensor list comes from AdamW's cached plan in the steady state.

Section numbers (spec N, §N) and bug ids (B1-B11, its section 14) refer to
docs/deep_nested_optimizer.md.
"""

import torch

from .. import _C
from .._internal.norm_calls import real_views
from .._internal.runtime import call_dense, exec_kwargs, norms_scratch, reraise_with_names
from .nets import EMA_LOSS_BETA, MAX_LR_MULT, MIN_LR_MULT, N_GROUPS


def call_norms(run, *lists):
    """run(*lists), a call of the C core's norms, through call_dense (any layout), and again
    with complex tensors as their real views when the C core refused one (AdamW mode trains
    complex models: the 2-norm of a complex tensor is its real view's, as torch's norm)."""
    try:
        return call_dense(run, *lists, read_only=True)
    except BufferError:
        real = [ts if ts is None else real_views("tensors", ts, 2.0) for ts in lists]
        if all(r is ts for r, ts in zip(real, lists)):
            raise
        return call_dense(run, *real, read_only=True)



class Control:
    """The device buffers a step's statistics and control op write, and the calls that write
    them. The optimizer exposes ema_loss and skipped (the reference's attributes) and the
    multipliers from here; CMS mode and the AdamW update read lr, coef and skipped.

    Buffers (float32, on the optimizer's device, fixed addresses: graph-safe):
      norms       [2G + 1]  group grad norms | group param norms | total grad norm (pre-clip)
      loss        [1]       the step's loss
      lr_multipliers, ema_loss, lr  [G]
      coef, skipped         [1]  clip coefficient; 1.0 after a step the device guards skipped
      previous    [2G + 4]  mu | ema | lr | coef | skip as the last control op found them: a step
                            refused after it is undone from here (undo)
    """

    def __init__(self, device, params, weights, group_depths, hidden, layers,
                 fix_reference_bugs, base_lr):
        self.device = device
        self.params = params  # GroupedParams
        self.weights = weights  # NetworkWeights
        self.group_depths = group_depths
        self.hidden = hidden
        self.layers = layers
        self.fix_reference_bugs = fix_reference_bugs
        g = N_GROUPS
        f32 = dict(dtype=torch.float32, device=device)
        self.lr_multipliers = torch.ones(g, **f32)
        self.ema_loss = torch.zeros(g, **f32)
        self.norms = torch.zeros(2 * g + 1, **f32)
        self.loss = torch.zeros(1, **f32)
        self.lr = torch.full((g,), base_lr, **f32)
        self.coef = torch.ones(1, **f32)
        self.skipped = torch.zeros(1, **f32)
        self.previous = torch.zeros(2 * g + 4, **f32)

    def run_norms(self, update):
        """tm_norms into self.norms: group grad norms, group param norms (controller steps),
        total grad norm. Parameters without a gradient still count in their group's parameter
        norm (spec 3), through a second pass over just those. Returns the gradients as AdamW's
        cached plan listed them, for its update in the same step, or None (no plan)."""
        g = N_GROUPS
        norms = self.norms
        grads, params, group_of, complete = self.params.gather(update)
        if not grads:
            norms.zero_()
        else:
            kw = dict(group_param=norms[g:2 * g] if update else None, group_of=group_of,
                      num_groups=g, **exec_kwargs(self.device))

            # norms take any layout: each list as it lies, else as dense views or copies
            # (channels_last parameters and gradients, AdamW mode)
            def run(gs, ps):
                _C.norms(gs, ps, norms[0:g], norms[2 * g:],
                         scratch=norms_scratch(self.device, gs, ps), **kw)

            try:
                call_norms(run, grads, params)
            except (BufferError, ValueError, TypeError) as err:
                self.params.reraise_named(err, self.params.gather(True)[1])
        extra = self.params.ungrouped_grads(planned=complete)
        if extra:
            self.add_to_total_norm(extra)
        if update:
            missing = [] if complete else self.params.without_grads()
            if missing or not grads:
                extra = self.param_norms_without_grads(missing)
                norms[g:2 * g] = torch.sqrt(norms[g:2 * g] ** 2 * bool(grads) + extra ** 2)
        return grads if complete else None

    def add_to_total_norm(self, extra):
        """total grad norm <- hypot(total, ||extra||): a NaN there skips the step, as in the
        reference."""
        grads = [grad for _, grad in extra]
        out = torch.empty(2, dtype=torch.float32, device=self.device)

        def run(gs):
            _C.norms(gs, None, out[0:1], out[1:], group_of=[0] * len(gs), num_groups=1,
                     scratch=norms_scratch(self.device, gs), **exec_kwargs(self.device))

        try:
            call_norms(run, grads)
        except (BufferError, ValueError, TypeError) as err:
            reraise_with_names(err, [f"parameter {name!r} (outside the optimizer's groups, its "
                                     "gradient counts in the clip norm)" for name, _ in extra],
                               lists=("grads",))
        total = self.norms[2 * N_GROUPS:]
        total.copy_(torch.hypot(total, out[1:]))

    def param_norms_without_grads(self, missing):
        g = N_GROUPS
        out = torch.zeros(g + 1, dtype=torch.float32, device=self.device)
        if missing:
            tensors = [p.detach() for _, p in missing]

            def run(ts):
                _C.norms(ts, None, out[0:g], out[g:], group_of=[gi for gi, _ in missing],
                         num_groups=g, scratch=norms_scratch(self.device, ts),
                         **exec_kwargs(self.device))

            try:
                call_norms(run, tensors)
            except (BufferError, ValueError, TypeError) as err:
                # "grads[i]" here counts the parameters without a gradient
                self.params.reraise_named(err, [p for _, p in missing], ", which has no gradient")
        return out[0:g]

    def controller_inputs(self, grad_norms, param_norms):
        """The stats columns the controller reads: raw norms (B6, the reference), or with
        fix_reference_bugs log1p(norm) / 10 as the sibling ContinuumOptimizer scales them."""
        if not self.fix_reference_bugs:
            return grad_norms, param_norms
        return torch.log1p(grad_norms) / 10.0, torch.log1p(param_norms) / 10.0

    def group_stats(self, grad_scale=None):
        """S [G, 3] as the reference's _compute_group_stats (non-finite norms -> 1.0), from a
        fresh statistics pass. grad_scale: the clip coefficient of the step just taken. The
        reference clips the gradients in place, so stats taken after its step see clipped
        gradients; ours are scaled only as the update loads them, and ||k g|| = k ||g||."""
        self.run_norms(True)
        g = N_GROUPS
        grad_norms = self.norms[0:g] if grad_scale is None else self.norms[0:g] * grad_scale
        grad_in, param_in = self.controller_inputs(grad_norms, self.norms[g:2 * g])
        stats = torch.stack([grad_in, param_in, self.group_depths], dim=1)
        ones = torch.ones_like(self.group_depths)
        return torch.where(torch.isfinite(stats),
                           stats, torch.stack([ones, ones, self.group_depths], dim=1))

    def control(self, t, update, check_loss, controller, base_lr, max_grad_norm):
        """tm_dno_control over this step's norms: the loss EMA, the multipliers (the controller
        evaluated when update), lr = base_lr * mu, the clip coefficient and the skip flag."""
        g = N_GROUPS
        n = self.norms
        grad_in, param_in = self.controller_inputs(n[0:g], n[g:2 * g])
        try:
            self.call_control(
                controller, grad_in, param_in, n[2 * g:], self.loss, self.lr_multipliers,
                self.ema_loss,
                self.lr, self.coef, self.skipped, update_controller=update,
                first_step=(t == 1), check_loss=check_loss,
                base_lr=base_lr, max_grad_norm=max_grad_norm, previous=self.previous)
        except (BufferError, ValueError, TypeError) as err:
            self.params.reraise_named(err, [], weights=("controller", controller))

    def c_controller(self, stats, controller, base_lr):
        """The multipliers the C control step computes from stats [G, 3] (what a step records),
        into temporaries: the optimizer's own state is not touched."""
        f32 = dict(dtype=torch.float32, device=self.device)
        g = N_GROUPS
        mu, lr = torch.empty(g, **f32), torch.empty(g, **f32)
        ema, coef, skip = torch.zeros(2, **f32), torch.empty(1, **f32), torch.empty(1, **f32)
        unused = torch.zeros(1, **f32)  # the total norm and the loss: read only when clipping
        self.call_control(controller, stats[:, 0].contiguous(), stats[:, 1].contiguous(), unused,
                          unused, mu, ema, lr, coef, skip, update_controller=True,
                          first_step=True, check_loss=False, base_lr=base_lr, max_grad_norm=0.0)
        return mu

    def call_control(self, controller, grad_in, param_in, total, loss, mu, ema, lr, coef, skip,
                     **flags):
        """_C.dno_control with the controller's weights, its shape and the spec's constants."""
        _C.dno_control(grad_in, param_in, total, self.group_depths, loss,
                       self.weights.of("controller", controller), mu, ema, lr, coef, skip,
                       hidden=self.hidden, layers=self.layers,
                       ema_beta=EMA_LOSS_BETA, mu_min=MIN_LR_MULT, mu_max=MAX_LR_MULT,
                       stream=exec_kwargs(self.device).get("stream"), **flags)

    def undo(self):
        """The C core refused a call of the step after the control op (a tensor that no longer
        matches its state, e.g. after model.half() or `p.data = ...` of another shape): the step
        did not happen, so everything the op writes goes back to what it found: the lr
        multipliers, the loss EMA, the learning rates, the clip coefficient and the skip flag
        (opt.skipped reads as after the last step taken)."""
        g = N_GROUPS
        prev = self.previous
        self.lr_multipliers.copy_(prev[:g])
        self.ema_loss.copy_(prev[g:g + 2])
        self.lr.copy_(prev[g + 2:2 * g + 2])
        self.coef.copy_(prev[2 * g + 2:2 * g + 3])
        self.skipped.copy_(prev[2 * g + 3:2 * g + 4])
