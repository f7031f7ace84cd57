"""The statistics pass and the fused control step of the DeepNestedOptimizer (spec sections 3
and 4), as a mixin of DeepNestedOptimizer: per-group gradient and parameter norms in one tm_norms
call, then tm_dno_control (loss EMA, NestedController, learning rates, clip coefficient, skip
predicate) on the device. Every tensor list comes from AdamW's cached plan in the steady state.
"""

import re

import torch

from .. import _C
from ..optim.batching import groups_snapshot, same_groups
from .nets import EMA_LOSS_BETA, MAX_LR_MULT, MIN_LR_MULT, N_GROUPS
from .._internal.runtime import call_dense, exec_kwargs, norms_scratch, reraise_with_names
from .._internal.norm_calls import real_views

# a C-core message about the network weights' list (after TITANMAC_DEBUG's "file.c:line: ")
_WEIGHTS_FIRST = re.compile(r"([\w.]+:\d+: )?weights\[\d+\]")
# the functional ops' name of a tensor by its place in the list they were given
_LIST_PREFIX = re.compile(r"(?:parameters|tensors)\[(\d+)\]")
# AdamW's name of a parameter by its place in the groups
_GROUP_POSITION = re.compile(r"param_groups\[(\d+)\]\['params'\]\[(\d+)\]")


_MODEL_EDITS = [0]  # parameters or submodules registered on any module since the hooks went in


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


def _count_model_edit(module, name, value):
    _MODEL_EDITS[0] += 1  # returns None: the registered value stays as it is


def watch_model_edits():
    """Count parameter and submodule registrations (torch's global registration hooks; installed
    once, by the first DeepNestedOptimizer built or unpickled in the process): a model grown
    after the optimizer was built (a head added, a layer replaced) changes which parameters lie
    outside the groups, which the reference's clip over model.parameters() sees at every
    step."""
    if not getattr(watch_model_edits, "installed", False):
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_model_edit)
        torch.nn.modules.module.register_module_module_registration_hook(_count_model_edit)
        watch_model_edits.installed = True
    return _MODEL_EDITS[0]


class GroupWatch:
    """The base optimizer's groups as last seen, to tell when a parameter was appended to,
    removed from or replaced in one since (which model parameters lie outside the groups
    follows such edits; an amsgrad flag switched counts too, harmlessly). Copies and pickles
    start unseen: the next look rebuilds."""

    __slots__ = ("seen", "plan")

    def __init__(self):
        self.seen = self.plan = None

    def __reduce__(self):
        return GroupWatch, ()

    def changed(self, optimizer, planned):
        """Whether the groups differ from those of the last call. planned: AdamW's cached plan
        matched the groups in this step (so when it is the plan of the last call, they are as
        then, at no cost; else the groups are compared as the plan compares them)."""
        plan = optimizer._plan if planned else None
        if plan is not None and plan is self.plan:
            return False
        groups = optimizer.param_groups
        same = self.seen is not None and same_groups(groups, self.seen)
        if not same:
            self.seen = groups_snapshot(groups)
        self.plan = plan
        return not same


class ControlStepMixin:
    """Needs from the optimizer: base_optimizer, controller, device, the device buffers _norms,
    _loss, _lr_multipliers, ema_loss, _lr, _coef, skipped, the hyperparameters it passes,
    _weight_views = {} (the cache of _weights_of), _param_names, and _group_watch = GroupWatch()
    with _ungrouped and _model_edits (the state of _ungrouped_grads)."""

    def __setstate__(self, state):
        """Unpickled (torch.load of the whole optimizer, a spawned worker, a deep copy): the edit
        count saved is another process's, whose registration hooks this process may not have
        (none is installed before a constructor runs)."""
        self.__dict__.update(state)
        self._watch_model_afresh()

    def _watch_model_afresh(self):
        """Install the registration hooks (once per process) and let the next step list the
        parameters outside the groups and the modules' weights anew."""
        self._model_edits = watch_model_edits() - 1
        self._weight_views = {}  # module name -> (module, edit count, parameters, views)

    def _check_group_count(self):
        """Refuses a step over another number of groups than the controller's."""
        groups = self.base_optimizer.param_groups
        if len(groups) != N_GROUPS:  # e.g. base_optimizer.add_param_group(): refused, no change
            raise ValueError(
                f"base_optimizer.param_groups: {len(groups)} groups, where the controller sets "
                f"the learning rates of {N_GROUPS} (core, embed); append a parameter to one of "
                "their 'params' lists instead")

    def _gather(self, with_params):
        """Grads (and params) of the grouped tensors that have a gradient, with group indices;
        and whether they were listed through AdamW's cached plan, which holds these lists in the
        steady state (read-only) and lists them only when every grouped tensor has one."""
        flat = self.base_optimizer._planned_flat()
        if flat is not None:
            grads, params, group_of = flat
            return grads, (params if with_params else None), group_of, True
        grads, params, group_of = [], [], []
        for gi, group in enumerate(self.base_optimizer.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad)
                    params.append(p)
                    group_of.append(gi)
        return grads, (params if with_params else None), group_of, False

    def _run_norms(self, update):
        """tm_norms into self._norms: group grad norms, group param norms (controller steps),
        total grad norm. Parameters without a gradient still count in their group's parameter
        norm (spec 3), through a second pass over just those. Returns the gradients as AdamW's
        cached plan listed them, for its update in the same step, or None (no plan)."""
        g = N_GROUPS
        norms = self._norms
        grads, params, group_of, complete = self._gather(update)
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
                self._reraise_named(err, self._gather(True)[1])
        extra = self._ungrouped_grads(planned=complete)
        if extra:
            self._add_to_total_norm(extra)
        if update:
            missing = [] if complete else [
                (gi, p) for gi, grp in enumerate(self.base_optimizer.param_groups)
                for p in grp["params"] if p.grad is None]
            if missing or not grads:
                extra = self._param_norms_without_grads(missing)
                norms[g:2 * g] = torch.sqrt(norms[g:2 * g] ** 2 * bool(grads) + extra ** 2)
        return grads if complete else None

    def _ungrouped_grads(self, planned=False):
        """Gradients of model parameters outside the groups (frozen when the optimizer was built
        and unfrozen since, or added to the model since): the reference's clip norm covers all
        of model.parameters() (spec 8), each once. The list is rebuilt only after a model edit
        or an edit of the groups (a parameter appended to one: then grouped, no longer outside).
        planned: AdamW's cached plan matched the groups in this step."""
        groups_changed = self._group_watch.changed(self.base_optimizer, planned)
        if groups_changed:
            self._name_new_grouped()
        if groups_changed or self._model_edits != _MODEL_EDITS[0]:
            self._model_edits = _MODEL_EDITS[0]
            grouped = {id(p) for g in self.base_optimizer.param_groups for p in g["params"]}
            self._ungrouped = [(name, p) for name, p in self.model.named_parameters()
                               if id(p) not in grouped]
        return [(name, p.grad) for name, p in self._ungrouped if p.grad is not None]

    def _name_new_grouped(self):
        """Names for parameters appended to a group since construction, for messages: the
        model's, or the place in the groups of one that is not the model's."""
        model_names = None
        for gi, group in enumerate(self.base_optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if p not in self._param_names:
                    if model_names is None:
                        model_names = {id(q): n for n, q in self.model.named_parameters()}
                    self._param_names[p] = model_names.get(
                        id(p), f"param_groups[{gi}]['params'][{j}]")

    def _add_to_total_norm(self, extra):
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
        total = self._norms[2 * N_GROUPS:]
        total.copy_(torch.hypot(total, out[1:]))

    def _reraise_named(self, err, params, note="", weights_of=None):
        """A C-core error about "grads[i]" / "params[i]" (or the CMS state's lists) of lists in
        the order of params, with params[i]'s name appended; one about "weights[i]", the weights
        of the network self.<weights_of>, with its parameter's name."""
        if weights_of is not None and _WEIGHTS_FIRST.match(str(err)):
            module = getattr(self, weights_of)
            reraise_with_names(err, [f"{weights_of} parameter {n!r}"
                                     for n, _ in module.named_parameters()], lists=("weights",))
        reraise_with_names(err, [f"parameter {self._param_names[p]!r}{note}" for p in params],
                           lists=("grads", "params", "step_counts"),
                           level_lists=("momentum", "accumulated", "ema", "v_sq"))

    def _raise_by_name(self, err, params):
        """err of a call over the gradients of params, its "parameters[i]" / "tensors[i]" (the
        i-th of those lists, not the user's numbering) replaced by the parameter's name."""
        message = str(err)
        match = _LIST_PREFIX.match(message)
        if match is None:
            raise err
        name = self._param_names[params[int(match.group(1))]]
        raise type(err)(f"parameter {name!r}{message[match.end():]}") from None

    def _name_group_positions(self, err):
        """err's message (AdamW's: "param_groups[g]['params'][j]") with each parameter named
        as the model names it, in place (the exception itself is re-raised)."""
        if not err.args or not isinstance(err.args[0], str):
            return
        groups = self.base_optimizer.param_groups

        def name(match):
            g, j = int(match.group(1)), int(match.group(2))
            params = groups[g]["params"] if g < len(groups) else ()
            p = params[j] if j < len(params) else None
            label = self._param_names.get(p) if p is not None else None
            # a parameter the model does not hold is named by this very position already
            return match.group(0) if label in (None, match.group(0)) else f"parameter {label!r}"
        err.args = (_GROUP_POSITION.sub(name, err.args[0]),) + err.args[1:]

    def _raise_if_sparse(self):
        """A sparse gradient fails the first C call with torch's DLPack message: say what it is."""
        for p in self._gather(with_params=True)[1]:
            if p.grad.layout != torch.strided:
                raise RuntimeError(f"parameter {self._param_names[p]!r}: {p.grad.layout} "
                                   "gradients are not supported (e.g. nn.Embedding(sparse=True))"
                                   ) from None

    def _param_norms_without_grads(self, missing):
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
                self._reraise_named(err, [p for _, p in missing], ", which has no gradient")
        return out[0:g]

    def _controller_inputs(self, grad_norms, param_norms):
        """The stats columns the controller reads: raw norms (B6, the reference), or with
        fix_reference_bugs log1p(norm) / 10 as the sibling ContinuumOptimizer scales them."""
        if not self.fix_reference_bugs:
            return grad_norms, param_norms
        return torch.log1p(grad_norms) / 10.0, torch.log1p(param_norms) / 10.0

    def _weights_of(self, name):
        """Detached views of the current weights of the module self.<name> (the controller, the
        momentum network), for the C calls. Walking a module's parameters costs ~7 us, so the
        list is taken again only when the module object changed or torch registered a parameter
        or submodule anywhere since (watch_model_edits: `load_state_dict(..., assign=True)`, a
        new nn.Parameter), and the views again when a weight's storage moved (`p.data = ...`);
        meta-updates and plain loads write in place."""
        module = getattr(self, name)
        entry = self._weight_views.get(name)
        if entry is None or entry[0] is not module or entry[1] != _MODEL_EDITS[0]:
            params = list(module.parameters())
            entry = (module, _MODEL_EDITS[0], params, [p.detach() for p in params])
        elif any(v.data_ptr() != p.data_ptr() for p, v in zip(entry[2], entry[3])):
            entry = entry[:3] + ([p.detach() for p in entry[2]],)
        self._weight_views[name] = entry
        return entry[3]

    def _control(self, t, update, check_loss, base_lr=None):
        g = N_GROUPS
        n = self._norms
        grad_in, param_in = self._controller_inputs(n[0:g], n[g:2 * g])
        try:
            self._call_control(
                grad_in, param_in, n[2 * g:], self._loss, self._lr_multipliers, self.ema_loss,
                self._lr, self._coef, self.skipped, update_controller=update,
                first_step=(t == 1), check_loss=check_loss,
                base_lr=self.base_lr if base_lr is None else base_lr,
                max_grad_norm=self.max_grad_norm, previous=self._control_previous)
        except (BufferError, ValueError, TypeError) as err:
            self._reraise_named(err, [], weights_of="controller")

    def _c_controller(self, stats):
        """The multipliers the C control step computes from stats [G, 3] (what a step records),
        into temporaries: the optimizer's own state is not touched."""
        f32 = dict(dtype=torch.float32, device=self.device)
        g = N_GROUPS
        mu, lr = torch.empty(g, **f32), torch.empty(g, **f32)
        ema, coef, skip = torch.zeros(2, **f32), torch.empty(1, **f32), torch.empty(1, **f32)
        unused = torch.zeros(1, **f32)  # the total norm and the loss: read only when clipping
        self._call_control(stats[:, 0].contiguous(), stats[:, 1].contiguous(), unused, unused,
                           mu, ema, lr, coef, skip, update_controller=True, first_step=True,
                           check_loss=False, base_lr=self.base_lr, max_grad_norm=0.0)
        return mu

    def _call_control(self, grad_in, param_in, total, loss, mu, ema, lr, coef, skip, **flags):
        """_C.dno_control with this optimizer's controller, its shape and the spec's constants."""
        _C.dno_control(grad_in, param_in, total, self.group_depths, loss,
                       self._weights_of("controller"), mu, ema, lr, coef, skip,
                       hidden=self.controller_hidden_dim, layers=self.controller_num_layers,
                       ema_beta=EMA_LOSS_BETA, mu_min=MIN_LR_MULT, mu_max=MAX_LR_MULT,
                       stream=exec_kwargs(self.device).get("stream"), **flags)

    def _undo_control(self):
        """The C core refused a call of the step after the control op (a tensor that no longer
        matches its state, e.g. after model.half() or `p.data = ...` of another shape): the step
        did not happen, so everything the op writes goes back to what it found: the lr
        multipliers, the loss EMA, the learning rates, the clip coefficient and the skip flag
        (opt.skipped reads as after the last step taken)."""
        g = N_GROUPS
        prev = self._control_previous
        self._lr_multipliers.copy_(prev[:g])
        self.ema_loss.copy_(prev[g:g + 2])
        self._lr.copy_(prev[g + 2:2 * g + 2])
        self._coef.copy_(prev[2 * g + 2:2 * g + 3])
        self.skipped.copy_(prev[2 * g + 3:2 * g + 4])
