"""The flat tensor lists AdamW hands the C core: one Batch per C call (the tensors of every group
on one device with one amsgrad), and the Plan that keeps a steady-state Batch between steps."""

import functools
import operator

import torch

from .state import STATE_KEYS, malformed_state, step_count
from .._internal.distributed import dtensor_type, local_of, localize, refuse_plain_with_dtensor
from .._internal.runtime import (COMPLEX_DTYPES, in_layout_of, is_expanded,
                                is_strided_only, real_view)

_IS_NONE = functools.partial(operator.is_, None)
_EXP_AVG, _EXP_AVG_SQ, _MAX_EXP_AVG_SQ, _STEP = (
    operator.itemgetter(k) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"))


def lay_out_state(state, p):
    """p's AdamW state entries in p's memory layout, for good (in_layout_of: the same values)."""
    for k in STATE_KEYS:
        if k in state:
            state[k] = in_layout_of(state[k], p)


def _placed_as(t, mesh, placements):
    """t is a DTensor on mesh with these placements (a tuple)."""
    return (hasattr(t, "placements") and tuple(t.placements) == placements
            and (t.device_mesh is mesh or t.device_mesh == mesh))


class Batch:
    """The flat lists of one C call: the tensors of every group on one device with one amsgrad."""

    def __init__(self, device, amsgrad):
        self.device = device
        self.amsgrad = amsgrad
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = [], [], [], []
        self.max_exp_avg_sqs, self.steps, self.group_of = [], [], []
        self.names = []  # "param_groups[g]['params'][j]" of each flat entry
        self.owners = []  # the grouped parameter of each entry (a DTensor: not its shard)
        self.wrappers = []  # the DTensor parameters whose local shards are in params
        # entries a Plan could not re-read (gradients copied into their parameter's layout or
        # placed anew, complex views): no Plan
        self.no_plan = False
        # (name, gradient, its copy in grads) of gradients laid out anew for this step
        self.grad_copies = []
        # (parameter, its contiguous copy in params) of parameters dense in no order
        self.param_copies = []
        # the learning rates' dtype: float64 (torch's Python float) when a parameter is float64
        self.lr_dtype = torch.float32

    def add(self, gi, name, p, grad, state, dtensor):
        """p's tensors (of param_groups[gi]) appended: for a DTensor its local shards, for a
        complex p the real views, gradient and state in the parameter's layout."""
        dtype = p.dtype
        self.owners.append(p)
        if dtensor is not None and isinstance(p, dtensor):
            # FSDP2 / tensor parallel: the element-wise step of the local shards (the
            # state stays a DTensor, as torch's, for distributed checkpoints)
            self.wrappers.append(p)
            # a gradient placed otherwise is redistributed for this step: a Plan takes only
            # shards it can read as they are (Plan._localize)
            self.no_plan = self.no_plan or not _placed_as(grad, p.device_mesh,
                                                          tuple(p.placements))
            p, grad, tensors = localize(name, p, grad, state, STATE_KEYS)
            grad = self.laid_out_grad(name, grad, p)
        else:
            if dtensor is not None:
                refuse_plain_with_dtensor(name, p, grad, state, STATE_KEYS)
            p = self.dense_param(name, p)
            # gradient and state in the parameter's layout: the state for good (the same
            # values), the gradient as a copy for this step (the Plan re-reads .grad)
            lay_out_state(state, p)
            grad, tensors = self.laid_out_grad(name, grad, p), state
        if dtype in COMPLEX_DTYPES:
            # as torch's AdamW: the real views of parameter, gradient and state (kept
            # complex, as torch's) stepped by the real math. A Plan re-reads p.grad of
            # the parameters it holds, so such a batch gets none.
            self.no_plan = True
            p, grad = real_view(p), real_view(self.resolved_grad(name, grad))
            tensors = {k: real_view(v) if isinstance(v, torch.Tensor) else v
                       for k, v in tensors.items() if k in STATE_KEYS}
            dtype = p.dtype
        if dtype is torch.float64:
            self.lr_dtype = torch.float64
        self.group_of.append(gi)
        self.params.append(p)
        self.grads.append(grad)
        try:
            self.exp_avgs.append(tensors["exp_avg"])
            self.exp_avg_sqs.append(tensors["exp_avg_sq"])
            if self.amsgrad:
                self.max_exp_avg_sqs.append(tensors["max_exp_avg_sq"])
            self.steps.append(step_count(state, p.device))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise malformed_state(name, state, e) from None
        self.names.append(name)

    def paired_lists(self):
        """The lists whose entry i pairs element by element with params[i]."""
        lists = [self.grads, self.exp_avgs, self.exp_avg_sqs]
        if self.amsgrad:
            lists.append(self.max_exp_avg_sqs)
        return lists

    def release(self):
        """Drop the step's gradients and state tensors, keeping the parameters: a Plan holds
        its Batch between steps, and holding them would keep the last step's gradients alive
        through zero_grad() and the next backward (torch's optimizers keep none), and old state
        tensors alive after the state is replaced. refresh() reads them again."""
        self.grads = self.exp_avgs = self.exp_avg_sqs = self.max_exp_avg_sqs = self.steps = None

    def dense_param(self, name, p):
        """p, or for a parameter that no permutation makes dense (a strided slice of a larger
        tensor) a contiguous copy, stepped in its place and copied back by store_params (the C
        core takes dense memory; torch's ops step such a parameter in place). Its state is then
        laid out as the copy (contiguous, as torch makes it for such a parameter), and the
        batch gets no Plan."""
        if p.layout != torch.strided or not is_strided_only(p):
            return p
        if is_expanded(p):  # as torch's in-place ops refuse it
            raise RuntimeError(f"{name}: an expanded tensor (several elements on one memory "
                               "location) cannot be stepped in place; clone() it")
        copy = p.contiguous()
        self.param_copies.append((p, copy))
        self.no_plan = True
        return copy

    def store_params(self):
        """The stepped copies of dense_param written into their parameters."""
        if self.param_copies:
            with torch.inference_mode():  # an inference-mode parameter takes the write too
                for p, copy in self.param_copies:
                    p.copy_(copy)

    def laid_out_grad(self, name, grad, p):
        """grad in p's layout (in_layout_of); a copy made for that is recorded, so that a step
        storing the gradients back (GradScaler's unscale) writes them into the user's .grad, and
        the batch then gets no Plan (a Plan re-reads .grad)."""
        laid_out = in_layout_of(grad, p)
        if laid_out is not grad:
            self.no_plan = True
            self.grad_copies.append((name, grad, laid_out))
        return laid_out

    def resolved_grad(self, name, grad):
        """A complex gradient with the lazy conjugate bit (autograd leaves such) as a copy holding
        its values, recorded as laid_out_grad records one (torch's AdamW refuses it)."""
        if not grad.is_conj():
            return grad
        resolved = grad.resolve_conj()
        self.grad_copies.append((name, grad, resolved))
        return resolved

    def check_grads_storable(self):
        """Before a step that stores the gradients back (GradScaler's unscale): a gradient taken
        as a copy is written back after the C call, which an expanded one cannot take."""
        for name, grad, _ in self.grad_copies:
            if is_expanded(grad):
                raise RuntimeError(f"{name}: its gradient is an expanded tensor (several "
                                   "elements on one memory location) and cannot be unscaled "
                                   "in place")

    def listed_twice(self):
        """The message for one Parameter listed twice in a group (torch's AdamW warns at
        construction and steps it twice), else None: its one state would be written twice by one
        call, which the C core refuses as memory shared between written tensors. Asked on that
        refusal, to say what the user did instead."""
        first = {}
        for i, p in enumerate(self.owners):
            j = first.setdefault(id(p), i)
            if j != i:
                return (f"{self.names[i]}: the same Parameter as {self.names[j]}, listed twice in "
                        "the optimizer (torch's AdamW steps it twice per step; titanmac_c.AdamW "
                        "refuses it: list each parameter once)")
        return None

    def precheck(self, grads_written=False):
        """With several C calls per step, a failure in a later call must not follow a completed
        earlier one: check in Python what the C core would refuse, before any call.
        grads_written: the call stores into the gradients (unscale, zero on skip)."""
        self._precheck_entries()
        self._precheck_disjoint(grads_written)

    def _precheck_disjoint(self, grads_written):
        """The C core's rule (tm_roles.c): no tensor the call writes shares memory with another
        tensor of the call; tensors only read may share."""
        spans = []
        lists = [("param", self.params, True), ("gradient", self.grads, grads_written),
                 ("exp_avg", self.exp_avgs, True), ("exp_avg_sq", self.exp_avg_sqs, True),
                 ("step", self.steps, True)]
        if self.amsgrad:
            lists.append(("max_exp_avg_sq", self.max_exp_avg_sqs, True))
        for role, tensors, written in lists:
            for i, t in enumerate(tensors):
                if t.numel():
                    lo = t.data_ptr()
                    spans.append((lo, lo + t.numel() * t.element_size(), written, role, i))
        spans.sort(key=lambda s: s[0])
        reach = reach_written = None
        for span in spans:
            other = reach if span[2] else reach_written
            if other is not None and span[0] < other[1]:
                twice = self.listed_twice()
                if twice is not None:
                    raise ValueError(twice)
                raise ValueError(f"{self.names[span[4]]}: its {span[3]} shares memory with the "
                                 f"{other[3]} of {self.names[other[4]]}")
            if reach is None or span[1] > reach[1]:
                reach = span
            if span[2] and (reach_written is None or span[1] > reach_written[1]):
                reach_written = span

    def _precheck_entries(self):
        for i, p in enumerate(self.params):
            name = self.names[i]
            self._precheck_memory(i, name)
            if is_strided_only(p):
                raise BufferError(f"params[{i}]: not contiguous, nor dense in another order "
                                  f"({name})")
            for t in (ts[i] for ts in self.paired_lists()):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: a state entry is a {type(t).__name__}, not a "
                                    "tensor")
                if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                    raise ValueError(f"{name}: state or gradient does not match the parameter "
                                     f"(shape {tuple(t.shape)}, dtype {t.dtype}, {t.device})")
                # the C core pairs elements by their place in memory (a parameter dense in
                # another order: its strides)
                if t.layout != torch.strided or not (t.stride() == p.stride()
                                                     or t.is_contiguous() and p.is_contiguous()):
                    raise BufferError(f"{name}: state or gradient laid out otherwise than the "
                                      f"parameter (strides {t.stride()}, {p.stride()})")
            step = self.steps[i]
            if (not isinstance(step, torch.Tensor) or step.dtype != torch.float32
                    or step.numel() != 1 or step.device != p.device):
                raise ValueError(f"{name}: step must be a float32 scalar on {p.device}")

    def _precheck_memory(self, i, name):
        """Entry i's tensors have memory (a meta tensor, or a subclass wrapping other tensors,
        has none: data_ptr() 0) aligned to their elements (tm_check_usable), named as the C core
        names them."""
        roles = [("params", self.params), ("grads", self.grads), ("exp_avg", self.exp_avgs),
                 ("exp_avg_sq", self.exp_avg_sqs), ("step", self.steps)]
        for role, tensors in roles + ([("max_exp_avg_sq", self.max_exp_avg_sqs)]
                                      if self.amsgrad else []):
            t = tensors[i]
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            address, size = t.data_ptr(), t.element_size()
            if address == 0:
                raise BufferError(f"{role}[{i}]: data is NULL for {t.numel()} elements ({name})")
            if address % size:
                raise BufferError(f"{role}[{i}]: data address {address:#x} is not aligned to its "
                                  f"{size}-byte elements ({name})")


def groups_snapshot(groups):
    """What same_groups compares against: each group dict, its 'params' list object, a copy of
    that list and its amsgrad flag."""
    return [(g, g["params"], list(g["params"]), bool(g["amsgrad"])) for g in groups]


def same_groups(groups, snapshot):
    """Whether param groups are still those of a groups_snapshot: the same dicts holding the
    same list objects of the same parameters (by identity, C-level maps) and amsgrad flags."""
    if len(groups) != len(snapshot):
        return False
    for group, (built, listed, params, amsgrad) in zip(groups, snapshot):
        current = group["params"]
        if (group is not built or current is not listed or len(current) != len(params)
                or bool(group["amsgrad"]) != amsgrad
                or not all(map(operator.is_, current, params))):
            return False
    return True


class Plan:
    """The Batch of a steady-state step, kept between steps: one device, every parameter with a
    gradient and a state. A step then re-reads the gradients and the state tensors (either may
    have been replaced) with C-level maps instead of the per-tensor Python work of a full
    collection, most of the host time of a step over many small tensors. Valid while the groups
    hold the same parameter objects (checked by identity every step) and the state dict is the
    one it was built from."""

    def __init__(self, optimizer, batch):
        batch.release()
        self.batch = batch
        self.state = optimizer.state
        self.params = batch.params  # the shards of DTensor parameters, re-read each step
        self.owners = batch.owners  # the grouped parameters (whose .grad and state key)
        # DTensor parameters (FSDP2, tensor parallel): (position, parameter, its mesh and
        # placements), whose gradient and state a step takes as their local shards when they
        # are placed as the parameter is (else the full path redistributes or refuses them)
        dtensor = dtensor_type()
        self.sharded = tuple((i, p, p.device_mesh, tuple(p.placements))
                             for i, p in enumerate(batch.owners)
                             if dtensor is not None and isinstance(p, dtensor))
        # The state entries are read by position in the state dict, not by key: a lookup hashes
        # the parameter through Tensor.__hash__, a Python function (~0.1 us a tensor, a fifth of
        # a planned step's host time at 1,000 tensors). Valid while the dict holds the same keys
        # in the same order (checked by identity every step); an entry replaced under its key
        # keeps its position.
        self.keys = tuple(optimizer.state)
        position = {id(k): i for i, k in enumerate(self.keys)}
        order = tuple(position[id(p)] for p in self.owners)
        # None: the dict holds exactly the batch's parameters, in batch order (the usual case)
        self.order = None if order == tuple(range(len(self.keys))) else order
        self.groups = groups_snapshot(optimizer.param_groups)

    def matches(self, optimizer):
        return (optimizer.state is self.state and len(self.state) == len(self.keys)
                and same_groups(optimizer.param_groups, self.groups))

    @functools.cached_property
    def norm_dtype(self):
        """The promoted dtype of the parameters (and so of their gradients): the dtype torch's
        clip_grad_norm_ returns the norm in."""
        return functools.reduce(torch.promote_types, (p.dtype for p in self.params))

    def grads(self):
        """Every parameter's current gradient (a DTensor's: a DTensor), or None when one is
        missing."""
        grads = [p.grad for p in self.owners]
        return None if any(map(_IS_NONE, grads)) else grads

    def entries(self):
        """Every parameter's state entry in batch order, or None when the state dict's keys are
        no longer the ones the plan was built with."""
        state = self.state
        if len(state) != len(self.keys) or not all(map(operator.is_, state, self.keys)):
            return None
        entries = list(state.values())
        return entries if self.order is None else list(map(entries.__getitem__, self.order))

    def refresh(self, grads):
        """The batch with these gradients and the state tensors read again (KeyError when an
        entry lost a key), or None when the state dict's keys changed."""
        batch = self.batch
        states = self.entries()
        if states is None:
            return None
        batch.grads = grads
        batch.exp_avgs = list(map(_EXP_AVG, states))
        batch.exp_avg_sqs = list(map(_EXP_AVG_SQ, states))
        batch.steps = list(map(_STEP, states))
        if batch.amsgrad:
            batch.max_exp_avg_sqs = list(map(_MAX_EXP_AVG_SQ, states))
        return batch if not self.sharded or self._localize(batch) else None

    def _localize(self, batch):
        """The DTensor parameters' entries as their local shards (as _distributed.localize
        takes them); False when a gradient or state tensor is no longer placed as its parameter
        (the full path then redistributes or refuses it, by name)."""
        batch.grads = list(batch.grads)
        lists = batch.paired_lists()
        for i, p, mesh, placements in self.sharded:
            if not all(_placed_as(ts[i], mesh, placements) for ts in lists):
                return False
            for ts in lists:
                ts[i] = local_of(ts[i])
            batch.params[i] = local_of(p)  # `p.data = ...` may have replaced it
        return True
