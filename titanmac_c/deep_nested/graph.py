"""CUDA-graph mode of the DeepNestedOptimizer (spec section 11, done so that every step applies
its update): after `cuda_graph_warmup_steps` eager steps, the C calls of a step are captured in a
CUDA graph, one per kind of step (controller or not; in CMS mode, which levels fire), and
replayed; in CMS mode a step that trains the DirectUpdateMLP (Phase 1, eager torch ops) runs it
between two graphs, the statistics and control before it and Phase 2 after. The gradients live
in static buffers (zero_grad zeroes them in place; a gradient that was reallocated anyway is
copied in), base_lr (and for the legacy network's context t) reaches the graph through a device
tensor, a reload re-captures (B8, B9, B10 fixed), and so does a change of a number the calls
take from the host (max_grad_norm, the weight decay, AdamW's group hyperparameters). Tested on
an H100 against eager, AdamW and CMS modes with the DirectUpdateMLP; the two-graph Phase 1 step,
the legacy network's capture and the re-captures not yet: their logic is tested on the CPU with
simulated replays (tests/test_deep_nested_cms.py).
"""

import operator
import warnings

import torch

from .. import _C
from .._internal import profiling as prof
from .args import check_float, check_rate_range
from ..optim.batching import lay_out_state
from .._internal.runtime import before_write, mark_written


class GraphState:
    """Spec 11, done so that every step applies its update: after `warmup` eager steps, the three
    C calls of a step are captured in a CUDA graph (one per controller/no-controller step kind)
    and replayed; the gradients live in static buffers (zero_grad zeroes them in place, and a
    gradient that was reallocated anyway is copied in), the learning rate scale is a device
    tensor, and a reload re-captures."""

    def __init__(self, opt):
        self.opt = opt
        self.base_lr = None
        self.context = None  # legacy network: (t, base_lr), float64, for its context
        self.reset()

    def supported(self):
        if self.opt.device.type != "cuda" or not _C.cuda_compiled():
            warnings.warn("use_cuda_graph=True needs CUDA tensors and the CUDA backend; "
                          "running eagerly")
            self.opt._graph = None
            return False
        return True

    def reset(self):
        """No graph: the next graph step binds the gradients and captures anew."""
        self.graphs = {}
        self.static_grads = None
        self.bound_params = []  # the parameters static_grads belong to, in order
        self.captured = False
        self.addresses = None  # see _addresses
        self.host_values = None  # see _host_values

    def _addresses(self, params):
        """The memory the captured calls read and write besides the static gradients and the
        optimizer's own buffers: the parameters and the networks' weights. One replaced or moved
        since the capture (`p.data = ...`, a module's `load_state_dict(..., assign=True)`) would
        leave the graphs on the old memory, so they are captured again."""
        opt = self.opt
        weights = opt._weights_of("controller")
        if opt._cms is not None:
            weights = weights + opt._weights_of("momentum_mlp")
        return tuple(t.data_ptr() for t in params) + tuple(w.data_ptr() for w in weights)

    def _host_values(self):
        """The numbers the captured calls take from the host, which a capture freezes: the clip
        threshold, and the update's hyperparameters (CMS: the weight decay; AdamW: each group's
        betas, eps, weight decay, maximize and amsgrad, as its step reads them, so a value the
        step would refuse is refused here, before anything is written). One changed since the
        capture (a weight decay schedule, a new max_grad_norm) captures the graphs again: the
        replays would go on with the old value."""
        opt = self.opt
        # float(): a 0-d tensor assigned and then changed in place would compare equal to itself
        if opt._cms is not None:
            update = float(opt.weight_decay)
        else:  # the groups' (opt.weight_decay is the AdamW step's default only at construction)
            read = opt.base_optimizer._hparams.of_group
            update = tuple((read(gi, g), bool(g.get("amsgrad", False)))
                           for gi, g in enumerate(opt.base_optimizer.param_groups))
        return float(opt.max_grad_norm), update

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

    def step(self, t, update):
        opt = self.opt
        if t <= opt.cuda_graph_warmup_steps or t == 1:
            return False
        # the captured control op took base_lr = 1 and checks nothing of the real one
        check_rate_range(check_float("base_lr", opt.base_lr))
        if opt._ungrouped_grads():
            return False  # gradients outside the groups, at addresses of their own: eager
        params = [p for g in opt.base_optimizer.param_groups for p in g["params"]]
        if not self._bind_grads(params):
            return False
        addresses = self._addresses(params)
        host_values = self._host_values()
        if addresses != self.addresses or host_values != self.host_values:
            self.graphs = {}
            self.addresses = addresses
            self.host_values = host_values
            self._lay_out_state(params)
        if self.base_lr is None:
            self.base_lr = torch.empty(1, dtype=torch.float32, device=opt.device)
        self.base_lr.fill_(opt.base_lr)
        if opt._cms is not None and not opt.use_preprocessing:
            # the legacy network's context [t / 1000, base_lr, ...] reads both in memory
            if self.context is None:
                self.context = torch.empty(2, dtype=torch.float64, device=opt.device)
            self.context[0].fill_(float(t))
            self.context[1].fill_(opt.base_lr)
        # One graph per kind of step: controller or not, and (CMS) which levels fire. A step
        # that trains the DirectUpdateMLP (Phase 1: torch ops and torch's Adam, eager) replays
        # two: the statistics and control, whose clip coefficient and skip flag Phase 1 reads,
        # then Phase 2.
        written = (params, self.static_grads if opt._cms is None else ())
        before_write(*written)
        fires = None if opt._cms is None else tuple(opt._cms.fires(t))
        if opt._cms is not None and opt._phase1_due(t):
            self._replay(("head", update), lambda: self._captured_head(t, update))
            try:
                opt._phase1(t)
                self._replay(("tail", fires), lambda: self._captured_tail(t))
            except Exception:
                opt._undo_control()  # refused after the control op ran: the step did not happen
                raise
        else:
            self._replay((update, fires), lambda: (self._captured_head(t, update),
                                                   self._captured_tail(t)))
        # a replay writes what the eager step's calls mark (parameters; gradients zeroed on a
        # skip in AdamW mode)
        mark_written(*written)
        return True

    def _lay_out_state(self, params):
        """The state of a parameter relaid out since the last capture (`p.data = ...` in another
        layout) moved into its layout now, eagerly: the update would move it itself (values
        kept), but inside a capture that copy would be captured and every replay would repeat
        it, from the old buffer."""
        opt = self.opt
        if opt._cms is not None:
            opt._cms.lay_out_all()
            return
        state = opt.base_optimizer.state
        for p in params:
            entries = state.get(p)
            if isinstance(entries, dict):
                lay_out_state(entries, p)

    def _replay(self, key, calls):
        """Replay the graph of this kind of step, captured from calls() the first time."""
        with prof.step_range(prof.GRAPH):
            graph = self.graphs.get(key)
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    calls()
                self.graphs[key] = graph
                self.captured = True
            graph.replay()  # capture records without running: replay at once (B8 fixed)

    def _captured_head(self, t, update):
        """The statistics and the control op: learning rates, clip coefficient, skip flag."""
        opt = self.opt
        opt._run_norms(update)
        opt._control(t, update, check_loss=True, base_lr=1.0)
        opt._lr.mul_(self.base_lr)  # base_lr schedules reach the graph through a tensor

    def _captured_tail(self, t):
        """The update: CMS Phase 2, or AdamW."""
        opt = self.opt
        if opt._cms is not None:
            opt._cms_phase2(t, context=self.context)
        else:
            opt.base_optimizer._fused_step(lr=opt._lr, grad_scale=opt._coef, skip=opt.skipped,
                                           zero_grads_on_skip=True)
