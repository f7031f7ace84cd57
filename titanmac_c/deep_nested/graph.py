"""CUDA-graph mode of the DeepNestedOptimizer (spec section 11, done so that every step applies its
update): after `cuda_graph_warmup_steps` eager steps, the C calls of a step are captured in a CUDA
graph, one per kind of step (controller or not; in CMS mode, which levels fire), and replayed; in
CMS mode a step that trains the DirectUpdateMLP (Phase 1) is one graph too with
TITANMAC_CUDA_PHASE1=core (the C core's Phase 1 and the MLP's Adam step captured between the
control and Phase 2: one replay a step), else it runs Phase 1 (eager torch ops) between two graphs,
the statistics and control before it and Phase 2 after. The gradients live in static buffers
(zero_grad zeroes them in place; a gradient that was reallocated anyway is copied in), base_lr (and
for the legacy network's context t) reaches the graph through a device tensor, a reload re-captures
(so the reference's B8, B9, B10 do not occur), and so does a change of a number the calls take from
the host (max_grad_norm, the weight decay, AdamW's group hyperparameters). Tested on an H100 against
eager, AdamW and CMS modes with the DirectUpdateMLP; the two-graph Phase 1 step, the legacy
network's capture and the re-captures are tested on the CPU only, with simulated replays
(tests/cms/test_deep_nested_cms.py). The one-graph Phase 1 step is tested that way on the CPU;
its real capture has tests that run on a GPU only (tests/deep_nested/test_deep_nested_cuda.py).

Section numbers (spec N, §N) and bug ids (B1-B11, its section 14) refer to
docs/deep_nested_optimizer.md.
"""

import operator
import warnings

import torch

from .. import _C
from .._internal import profiling as prof
from .._internal.runtime import before_write, mark_written, run_to_completion
from ..optim.adamw import adamw_step, group_hyperparameters
from ..optim.batching import lay_out_state
from .args import check_float, check_rate_range


class GraphState:
    """Spec 11, done so that every step applies its update: after `warmup` eager steps, the three
    C calls of a step are captured in a CUDA graph (one per controller/no-controller step kind)
    and replayed; the gradients live in static buffers (zero_grad zeroes them in place, and a
    gradient that was reallocated anyway is copied in), the learning rate scale is a device
    tensor, and a reload re-captures."""

    # (class defaults for objects pickled before they existed)
    update_mark = written = phase1_finish = None

    def __init__(self, device, params, weights, control, cms, warmup):
        self.device = device
        self.params = params  # GroupedParams (its .base: the AdamW)
        self.weights = weights  # NetworkWeights
        self.control = control  # Control
        self.cms = cms  # CMSMode, or None in AdamW mode
        self.warmup = warmup  # eager steps before the first capture
        self.base_lr = None
        self.context = None  # legacy network: (t, base_lr), float64, for its context
        self.reset()

    def supported(self):
        """Whether graphs can be captured here (CUDA tensors and the CUDA backend); else warns
        that the steps run eagerly."""
        if self.device.type != "cuda" or not _C.cuda_compiled():
            warnings.warn("use_cuda_graph=True needs CUDA tensors and the CUDA backend; "
                          "running eagerly")
            return False
        return True

    def reset(self):
        """No graph: the next graph step binds the gradients and captures anew."""
        self.graphs = {}
        self.static_grads = None
        self.bound_params = []  # the parameters static_grads belong to, in order
        self.captured = False
        self.update_mark = None  # completed_calls() before this step's update replay
        self.written = None  # the tensors that replay writes, until finish_written
        self.phase1_finish = None  # a captured Phase 1's bookkeeping, until finish_written
        self.addresses = None  # see _addresses
        self.host_values = None  # see _host_values

    def _addresses(self, params, step):
        """The memory the captured calls read and write besides the static gradients and the
        optimizer's own buffers: the parameters and the networks' weights. One replaced or moved
        since the capture (`p.data = ...`, a module's `load_state_dict(..., assign=True)`) would
        leave the graphs on the old memory, so they are captured again."""
        weights = self.weights.of("controller", step.controller)
        if self.cms is not None:
            weights = weights + self.weights.of("momentum_mlp", step.momentum_mlp)
        return tuple(t.data_ptr() for t in params) + tuple(w.data_ptr() for w in weights)

    def _host_values(self, step):
        """The numbers the captured calls take from the host, which a capture freezes: the clip
        threshold, and the update's hyperparameters (CMS: the weight decay; AdamW: each group's
        betas, eps, weight decay, maximize and amsgrad, as its step reads them, so a value the
        step would refuse is refused here, before anything is written). One changed since the
        capture (a weight decay schedule, a new max_grad_norm) captures the graphs again: the
        replays would go on with the old value."""
        # float(): a 0-d tensor assigned and then changed in place would compare equal to itself
        if self.cms is not None:
            update = float(step.weight_decay)
        else:  # the groups' (the optimizer's weight_decay is their default only at construction)
            update = group_hyperparameters(self.params.base)
        return float(step.max_grad_norm), update

    def _bind_grads(self, params):
        """Make every parameter's .grad the static buffer the graphs read. False when a
        parameter has no gradient, or one of another shape than its buffer (then this step runs
        eagerly). The gradients as they are become the buffers, and the graphs are captured
        again (they read the old ones), on the first call and when the parameters changed (one
        appended to a group or taken out)."""
        bound = self.bound_params
        if (self.static_grads is None or len(bound) != len(params)
                or not all(map(operator.is_, bound, params))):
            if any(p.grad is None for p in params):
                return False
            self.bound_params = list(params)
            self.static_grads = [p.grad for p in params]
            self.graphs = {}
            return True
        for p, buf in zip(params, self.static_grads):
            if p.grad is None or p.grad.shape != buf.shape:
                return False
            if p.grad is not buf:
                buf.copy_(p.grad)
                p.grad = buf
        return True

    def step(self, step):
        """Run this step (StepInputs) as graph replays, capturing first where needed; False when
        it must run eagerly (a warm-up step, gradients outside the groups or missing), nothing
        done then."""
        t = step.t
        if t <= self.warmup or t == 1:
            return False
        # the captured control op took base_lr = 1 and checks nothing of the real one
        check_rate_range(check_float("base_lr", step.base_lr))
        if self.params.ungrouped_grads():
            return False  # gradients outside the groups, at addresses of their own: eager
        params = self.params.all()
        if not self._bind_grads(params):
            return False
        addresses = self._addresses(params, step)
        host_values = self._host_values(step)
        if addresses != self.addresses or host_values != self.host_values:
            self.graphs = {}
            self.addresses = addresses
            self.host_values = host_values
            self._lay_out_state(params)
        if self.base_lr is None:
            self.base_lr = torch.empty(1, dtype=torch.float32, device=self.device)
        self.base_lr.fill_(step.base_lr)
        cms = self.cms
        if cms is not None and not cms.use_preprocessing:
            # the legacy network's context [t / 1000, base_lr, ...] reads both in memory
            if self.context is None:
                self.context = torch.empty(2, dtype=torch.float64, device=self.device)
            self.context[0].fill_(float(t))
            self.context[1].fill_(step.base_lr)
        # One graph per kind of step: controller or not, and (CMS) which levels fire. A step
        # that trains the DirectUpdateMLP is one more kind with the C core's Phase 1 (captured
        # between the control op, whose clip coefficient and skip flag it reads, and Phase 2);
        # with the torch ops' Phase 1 (and torch's Adam, eager) it replays two graphs: the
        # statistics and control, then Phase 2.
        # a replay writes what the eager step's calls mark (parameters; gradients zeroed on a
        # skip in AdamW mode): marked by finish_written once the update replay ran
        self.written = (params, self.static_grads if cms is None else ())
        before_write(*self.written)
        fires = None if cms is None else tuple(cms.state.fires(t))
        update = step.update
        self.phase1_finish = None
        phase1_due = cms is not None and cms.phase1_due(step)
        phase1 = None
        try:
            if phase1_due:
                phase1 = cms.phase1_graph_call(step)
            if phase1 is not None:  # the whole step, Phase 1 included, in one graph
                key, run, self.phase1_finish = phase1
                self._replay(("phase1", update, fires, key),
                             lambda: (self._captured_head(step), run(),
                                      self._captured_tail(step)), update=True)
        except BaseException:  # a refusal, or an interrupt before the replay ran
            if not self.updated:  # the step did not happen: nothing on the device changed
                self.phase1_finish = None
                if phase1_due and cms.phase1_undo is not None:
                    cms.phase1_undo()
            raise
        if phase1 is not None:
            # within the step (an interrupt until it completed: the step's handler runs it,
            # through finish_written), as the eager Phase 1's bookkeeping
            run_to_completion(self._finish_phase1)
            return True
        if phase1_due:
            head_mark = _C.completed_calls()
            try:
                self._replay(("head", update), lambda: self._captured_head(step))
                cms.phase1(step)
                self._replay(("tail", fires), lambda: self._captured_tail(step), update=True)
            except BaseException:  # a refusal, or an interrupt before the tail wrote
                if not self.updated:  # the step did not happen
                    if _C.completed_calls() != head_mark:  # the head's control op ran
                        self.control.undo()
                    if cms.phase1_undo is not None:
                        cms.phase1_undo()
                raise
        else:
            self._replay((update, fires), lambda: (self._captured_head(step),
                                                   self._captured_tail(step)), update=True)
        return True

    def finish_written(self):
        """After a step whose update replay ran (also when an exception followed it; run again
        if interrupted): autograd told of the replay's writes (mark_written), and a captured
        Phase 1's host bookkeeping done (its finish does the same when run again)."""
        if self.written is not None and self.updated:
            mark_written(*self.written)  # (twice, if interrupted here: a harmless extra bump)
        self.written = None
        self._finish_phase1()

    def _finish_phase1(self):
        """A captured Phase 1's host bookkeeping, once its replay ran (run again, it does the
        same)."""
        if self.phase1_finish is not None and self.updated:
            self.phase1_finish()
        self.phase1_finish = None

    def _lay_out_state(self, params):
        """The state of a parameter relaid out since the last capture (`p.data = ...` in another
        layout) moved into its layout now, eagerly: the update would move it itself (values
        kept), but inside a capture that copy would be captured and every replay would repeat
        it, from the old buffer."""
        if self.cms is not None:
            self.cms.state.lay_out_all()
            return
        state = self.params.base.state
        for p in params:
            entries = state.get(p)
            if isinstance(entries, dict):
                lay_out_state(entries, p)

    def _replay(self, key, calls, update=False):
        """Replay the graph of this kind of step, captured from calls() the first time. update:
        the replay writes the parameters: `updated` holds once it ran, also when an exception (a
        KeyboardInterrupt surfacing as it returns) follows."""
        with prof.step_range(prof.GRAPH):
            run = self._graph_of(key, calls)
            # capture records without running: replay at once (avoids B8), counted so that an
            # exception tells whether it ran
            if update:
                self.update_mark = _C.completed_calls()
            _C.run_counted(run)

    def _graph_of(self, key, calls):
        """The replay of the graph of this kind of step, captured from calls() the first
        time."""
        graph = self.graphs.get(key)
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls()
            self.graphs[key] = graph
            self.captured = True
        return graph.replay

    @property
    def updated(self):
        """This step's update replay ran (the optimizer resets update_mark each step)."""
        return self.update_mark is not None and _C.completed_calls() != self.update_mark

    def _captured_head(self, step):
        """The statistics and the control op: learning rates, clip coefficient, skip flag."""
        control = self.control
        control.run_norms(step.update)
        control.control(step.t, step.update, True, step.controller, 1.0, step.max_grad_norm)
        control.lr.mul_(self.base_lr)  # base_lr schedules reach the graph through a tensor

    def _captured_tail(self, step):
        """The update: CMS Phase 2, or AdamW."""
        if self.cms is not None:
            self.cms.phase2(step, context=self.context)
        else:
            control = self.control
            adamw_step(self.params.base, lr=control.lr, grad_scale=control.coef,
                       skip=control.skipped, zero_grads_on_skip=True)
