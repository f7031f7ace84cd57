"""CMS Phase 1 through the C core on CUDA (TITANMAC_CUDA_PHASE1=core; docs/deep_nested.md): the
DirectUpdateMLP's surrogate gradient by tm_cms_surrogate, the reference's clip of it (its torch
ops, no host sync), and the momentum network's Adam step by the C core's AdamW op on the state of
the torch.optim.Adam that owns it (mlp_optimizer), so a Phase 1 step holds no host sync and can be
captured in a CUDA graph, while mlp_optimizer, its state and its state_dict stay torch's.

A step is built on the host (every check, every buffer; Phase1Call, MLPAdam.prepare), run (device
work only: what a CUDA graph captures), then finished on the host (the Adam's step counts, kept on
the CPU as torch keeps them; the loss). Section numbers (spec N) refer to
docs/deep_nested_optimizer.md.
"""

import os

import torch

from .. import _C
from .._internal.runtime import Scratch, before_write, exec_kwargs, mark_written
from ..optim.hparams import Hyperparameters
from .nets import META_GRAD_CLIP, fused_clip_grad_norm_

PHASE1_ENV = "TITANMAC_CUDA_PHASE1"
PHASE1_PATHS = ("torch", "core")


def cuda_phase1_path():
    """How CMS Phase 1 runs on CUDA, from TITANMAC_CUDA_PHASE1 when the optimizer is built:
    "torch" (unset or empty: the default) runs the surrogate gradient in torch ops
    (surrogate.py) and steps mlp_optimizer itself; "core" runs the C core's op and AdamW
    (this module). Anything else is refused, naming the variable."""
    raw = os.environ.get(PHASE1_ENV, "")
    value = raw.strip().lower() or "torch"
    if value not in PHASE1_PATHS:
        raise ValueError(f"{PHASE1_ENV}={raw!r}: must be 'torch' (the default) or 'core'")
    return value


def device_skip_scale(skipped, scale):
    """The targets' scale when a step the device-side guard skipped (known on the device only)
    trains on zero targets: 0 there (NaN targets included, tm_sur_g), else scale (None: 1). x * 1
    is exact, so an unskipped step is unchanged."""
    return torch.where(skipped != 0.0, 0.0, 1.0 if scale is None else scale)


class Phase1Call:
    """One Phase 1 step's surrogate gradient and clip, with its inputs fixed on the host
    (CMSMode._phase1_inputs): run() enqueues the device work only. total: the mean loss, a
    device tensor (the given 0-d buffer, in graph mode), after run()."""

    def __init__(self, inputs, skipped, hidden, layers, scratch, device, total=None):
        self.inputs = inputs
        self.skipped = skipped  # Control.skipped: written by the step's control op
        self.hidden, self.layers = hidden, layers
        self.scratch = scratch
        self.device = device
        self.total = total

    def key(self):
        """What a capture of run() freezes: the host numbers and every address it reads or
        writes (a buffer made anew since, e.g. an output of another layout, captures again)."""
        i = self.inputs
        lists = (i.targets, i.momenta, i.outputs, i.weights, i.grads)
        ptrs = tuple(t.data_ptr() for ts in lists for t in ts)
        extra = (i.losses, self.total, self.scratch, self.skipped, i.scale)
        return (tuple(i.has_prev), i.divisor, self.hidden, self.layers, ptrs,
                tuple(t.data_ptr() if t is not None else 0 for t in extra))

    def run(self):
        i = self.inputs
        _C.cms_surrogate(
            i.targets, i.momenta, i.outputs, i.weights, i.grads, i.losses, divisor=i.divisor,
            hidden=self.hidden, layers=self.layers, has_prev=i.has_prev,
            scale=device_skip_scale(self.skipped, i.scale), scratch=self.scratch,
            **exec_kwargs(self.device))
        if self.total is None:
            self.total = i.losses.mean()
        else:
            torch.mean(i.losses, 0, out=self.total)
        # the reference's clip of the MLP's gradients, in place (torch ops, no host sync)
        fused_clip_grad_norm_(i.mlp_params, META_GRAD_CLIP, inplace=True)


class AdamCall:
    """One step of mlp_optimizer by the C core's AdamW op, prepared by MLPAdam.prepare: the
    lists of its parameters with gradients, the groups' hyperparameters, the step counts before
    the step (host values, torch's CPU tensors). fill_steps() (outside a capture) puts those
    counts in the device's step buffer, run() enqueues the update (the op counts the steps up
    there), finish() counts torch's own up (a fill: run again after an interrupt, it does the
    same). The caller tells autograd of the parameters' writes (params, before_write and
    mark_written): a graph's replays run no Python."""

    def __init__(self, lists, lr, groups, group_of, amsgrad, steps, values, states, scratch,
                 device):
        self.lists = lists
        self.lr, self.groups, self.group_of, self.amsgrad = lr, groups, group_of, amsgrad
        self.steps, self.values, self.states = steps, values, states
        self.scratch = scratch
        self.device = device

    def key(self):
        """What a capture of run() freezes: the host numbers and every address it reads."""
        ptrs = tuple(t.data_ptr() for ts in self.lists for t in ts)
        scratch = self.scratch.data_ptr() if self.scratch is not None else 0
        return (self.groups, self.group_of, self.amsgrad, ptrs, self.lr.data_ptr(), scratch)

    def fill_steps(self):
        buf = self.steps
        if all(v == self.values[0] for v in self.values):
            buf.fill_(self.values[0])
        else:  # counts that differ (a checkpoint edited by hand): one fill each
            for k, v in enumerate(self.values):
                buf[k].fill_(v)

    @property
    def params(self):
        return self.lists[0]

    def run(self):
        _C.adamw_step(*self.lists, self.lr, self.groups, self.group_of, amsgrad=self.amsgrad,
                      scratch=self.scratch, **exec_kwargs(self.device))

    def run_eagerly(self):
        """The whole step now: steps filled, the update, the bookkeeping."""
        self.fill_steps()
        before_write(self.params)
        self.run()
        mark_written(self.params)
        self.finish()

    def finish(self):
        for state, v in zip(self.states, self.values):
            state["step"].fill_(v + 1.0)  # torch's Adam adds 1 in float32: the same value


class MLPAdam:
    """torch.optim.Adam's step (spec 7.2 Phase 1 step 3: lr 1e-3) over the momentum network by
    the C core's AdamW op (tm_adamw_step, with the groups' weight decay 0, or decoupled), on the
    Adam's own state tensors: exp_avg, exp_avg_sq (and max_exp_avg_sq) in place, and the step
    counts torch keeps on the CPU (non-capturable Adam) mirrored in a device buffer that the op
    counts up (a graph replay reads the step from memory). The element math is torch's AdamW's
    order (tm_math.h), so the update is the torch Adam's to its rounding (on CUDA the
    bias corrections are computed on the device in double, and nvcc contracts some a * b + c).
    A group whose options the op does not take (coupled weight decay, capturable, fused,
    differentiable, amsgrad in some groups only) is refused, named, before anything is
    written."""

    def __init__(self):
        self.hparams = Hyperparameters()
        # the AdamW op's completion counter: a zeroed buffer of its own (tm_adamw_scratch_bytes)
        self.scratch = Scratch()
        self.steps = None  # float32 [n] on the device, and its one-element views
        self.step_views = []

    def check(self, optimizer):
        """(the groups' hyperparameters as the op takes them, amsgrad): every check of the
        groups, nothing written (a caller runs it before the writes that precede the step)."""
        groups, amsgrad = [], None
        for gi, group in enumerate(optimizer.param_groups):
            where = f"mlp_optimizer.param_groups[{gi}]"
            for option in ("capturable", "fused", "differentiable"):
                if group.get(option):
                    raise ValueError(f"{where}[{option!r}] = {group[option]!r}: the momentum "
                                     f"network's Adam under {PHASE1_ENV}=core is stepped by the "
                                     f"C core, which takes torch's default Adam ({option} off)")
            if group.get("weight_decay", 0) != 0 and not group.get("decoupled_weight_decay"):
                raise ValueError(f"{where}['weight_decay'] = {group['weight_decay']!r}: the "
                                 f"momentum network's Adam under {PHASE1_ENV}=core is stepped by "
                                 "the C core's AdamW, whose weight decay is decoupled (set "
                                 "decoupled_weight_decay=True, or weight_decay=0)")
            try:
                groups.append(self.hparams.of_group(gi, group))
            except (ValueError, TypeError) as err:
                raise type(err)(f"mlp_optimizer.{err}") from None
            ams = bool(group.get("amsgrad", False))
            if amsgrad is not None and ams != amsgrad:
                raise ValueError(f"{where}['amsgrad'] = {ams}: under {PHASE1_ENV}=core every "
                                 "group of mlp_optimizer takes the same amsgrad")
            amsgrad = ams
        return tuple(groups), bool(amsgrad)

    def prepare(self, optimizer, device):
        """The AdamCall of optimizer's next step: every check, and state made as torch's Adam
        makes it on its first step (step a CPU tensor 0, zeroed moments)."""
        groups, ams = self.check(optimizer)
        params, grads, exp_avgs, exp_avg_sqs, maxes = [], [], [], [], []
        group_of, states = [], []
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                if not state:  # torch's Adam._init_group
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if ams:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format)
                params.append(p.detach())
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if ams:
                    maxes.append(state["max_exp_avg_sq"])
                group_of.append(gi)
                states.append(state)
        n = len(params)
        if self.steps is None or self.steps.numel() != n or self.steps.device != device:
            self.steps = torch.zeros(n, dtype=torch.float32, device=device)
            self.step_views = [self.steps[k:k + 1] for k in range(n)]
        values = [float(s["step"]) for s in states]  # CPU tensors: no device sync
        lists = (params, grads, exp_avgs, exp_avg_sqs, maxes, self.step_views)
        lr = self.hparams.lr_tensor(device, [g["lr"] for g in optimizer.param_groups],
                                    torch.float32)
        scratch = None
        if device.type == "cuda" and n:
            scratch = self.scratch.get(device, _C.adamw_scratch_bytes(*lists))
        return AdamCall(lists, lr, groups, tuple(group_of), ams, self.steps, values, states,
                        scratch, device)


def _scalar_dtype():
    """The dtype of torch's Adam step counts: float64 under a float64 default dtype."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class CorePhase1:
    """What CMSMode keeps for the core path: the op's scratch (a buffer of its own, so a captured
    graph keeps its address), the Adam runner, and graph mode's static buffers (the MLP's
    gradients and the losses, which a capture reads and writes at fixed addresses)."""

    def __init__(self):
        self.scratch = Scratch()
        self.adam = MLPAdam()
        self.grads = []  # [(weight, its static gradient)]
        self.losses = None
        self.total = None

    def static_grads(self, mlp_params):
        """A gradient buffer per weight of the MLP, the same tensors every call while the weights
        are (by identity and shape)."""
        kept = self.grads
        if len(kept) != len(mlp_params) or not all(
                w is k and g.shape == w.shape for w, (k, g) in zip(mlp_params, kept)):
            self.grads = kept = [(w, torch.empty_like(w)) for w in mlp_params]
        return [g for _, g in kept]

    def static_losses(self, n, device):
        if self.losses is None or self.losses.numel() != n or self.losses.device != device:
            self.losses = torch.empty(n, dtype=torch.float32, device=device)
        return self.losses

    def static_total(self, device):
        if self.total is None or self.total.device != device:
            self.total = torch.empty((), dtype=torch.float32, device=device)
        return self.total

    def scratch_for(self, targets, layers, device):
        """The op's scratch: none on the CPU, a buffer sized for these targets on CUDA."""
        if device.type != "cuda":
            return None
        return self.scratch.get(device, _C.cms_surrogate_scratch_bytes(targets, layers=layers))
