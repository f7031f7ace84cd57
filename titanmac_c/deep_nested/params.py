"""The tensors a DeepNestedOptimizer step hands the C core, and their names in its messages: the
parameters as the base AdamW's two groups hold them (with the model's parameters outside the
groups, whose gradients count in the clip norm, spec 8), and the current weights of the
controller and the momentum network.

Section numbers (spec N) refer to docs/deep_nested_optimizer.md."""

import re

import torch

from .._internal.runtime import reraise_with_names
from ..optim.adamw import plan_token, planned_gradients
from ..optim.batching import groups_snapshot, same_groups
from .nets import N_GROUPS

# a C-core message about the network weights' list (after TITANMAC_DEBUG's "file.c:line: ")
_WEIGHTS_FIRST = re.compile(r"([\w.]+:\d+: )?weights\[\d+\]")
# the functional ops' name of a tensor by its place in the list they were given
_LIST_PREFIX = re.compile(r"(?:parameters|tensors)\[(\d+)\]")
# AdamW's name of a parameter by its place in the groups
_GROUP_POSITION = re.compile(r"param_groups\[(\d+)\]\['params'\]\[(\d+)\]")

_MODEL_EDITS = [0]  # parameters or submodules registered on any module since the hooks went in


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
        plan = plan_token(optimizer) if planned else None
        if plan is not None and plan is self.plan:
            return False
        groups = optimizer.param_groups
        same = self.seen is not None and same_groups(groups, self.seen)
        if not same:
            self.seen = groups_snapshot(groups)
        self.plan = plan
        return not same


class GroupedParams:
    """The model's parameters as the base optimizer's groups list them, their gradients, and the
    model's name of each for messages. The groups may be edited between steps (a parameter
    appended to one): every list is read from them at the step."""

    def __init__(self, model, base_optimizer, names):
        self.model = model
        self.base = base_optimizer
        self.names = names  # parameter -> the model's name (or its place in the groups)
        self.watch = GroupWatch()
        # model parameters outside the groups: their gradients count in the clip norm (spec 8);
        # found at the first step and again after the model or the groups were edited
        self.ungrouped = []
        self.model_edits = watch_model_edits() - 1

    def __setstate__(self, state):
        """Unpickled (torch.load of the whole optimizer, a spawned worker, a deep copy): the edit
        count saved is another process's, whose registration hooks this process may not have
        (none is installed before a constructor runs): the next step lists anew."""
        self.__dict__.update(state)
        self.model_edits = watch_model_edits() - 1

    def check_group_count(self):
        """Refuses a step over another number of groups than the controller's."""
        groups = self.base.param_groups
        if len(groups) != N_GROUPS:  # e.g. base_optimizer.add_param_group(): refused, no change
            raise ValueError(
                f"base_optimizer.param_groups: {len(groups)} groups, where the controller sets "
                f"the learning rates of {N_GROUPS} (core, embed); append a parameter to one of "
                "their 'params' lists instead")

    def all(self):
        """Every grouped parameter, in group order."""
        return [p for g in self.base.param_groups for p in g["params"]]

    def gather(self, with_params):
        """Grads (and params) of the grouped tensors that have a gradient, with group indices;
        and whether they were listed through AdamW's cached plan, which holds these lists in the
        steady state (read-only) and lists them only when every grouped tensor has one."""
        flat = planned_gradients(self.base)
        if flat is not None:
            grads, params, group_of = flat
            return grads, (params if with_params else None), group_of, True
        grads, params, group_of = [], [], []
        for gi, group in enumerate(self.base.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad)
                    params.append(p)
                    group_of.append(gi)
        return grads, (params if with_params else None), group_of, False

    def without_grads(self):
        """(group index, parameter) of every grouped parameter without a gradient."""
        return [(gi, p) for gi, grp in enumerate(self.base.param_groups)
                for p in grp["params"] if p.grad is None]

    def ungrouped_grads(self, planned=False):
        """(name, gradient) of model parameters outside the groups (frozen when the optimizer was
        built and unfrozen since, or added to the model since): the reference's clip norm covers
        all of model.parameters() (spec 8), each once. The list is rebuilt only after a model
        edit or an edit of the groups (a parameter appended to one: then grouped, no longer
        outside). planned: AdamW's cached plan matched the groups in this step."""
        groups_changed = self.watch.changed(self.base, planned)
        if groups_changed:
            self._name_new_grouped()
        if groups_changed or self.model_edits != _MODEL_EDITS[0]:
            self.model_edits = _MODEL_EDITS[0]
            grouped = {id(p) for g in self.base.param_groups for p in g["params"]}
            self.ungrouped = [(name, p) for name, p in self.model.named_parameters()
                              if id(p) not in grouped]
        return [(name, p.grad) for name, p in self.ungrouped if p.grad is not None]

    def _name_new_grouped(self):
        """Names for parameters appended to a group since construction, for messages: the
        model's, or the place in the groups of one that is not the model's."""
        model_names = None
        for gi, group in enumerate(self.base.param_groups):
            for j, p in enumerate(group["params"]):
                if p not in self.names:
                    if model_names is None:
                        model_names = {id(q): n for n, q in self.model.named_parameters()}
                    self.names[p] = model_names.get(id(p), f"param_groups[{gi}]['params'][{j}]")

    # ------------------------------------------------------------------ errors, by name

    def reraise_named(self, err, params, note="", weights=None):
        """A C-core error about "grads[i]" / "params[i]" (or the CMS state's lists) of lists in
        the order of params, with params[i]'s name appended; one about "weights[i]", the weights
        of the network weights = (label, module), with its parameter's name."""
        if weights is not None and _WEIGHTS_FIRST.match(str(err)):
            label, module = weights
            reraise_with_names(err, [f"{label} parameter {n!r}"
                                     for n, _ in module.named_parameters()], lists=("weights",))
        reraise_with_names(err, [f"parameter {self.names[p]!r}{note}" for p in params],
                           lists=("grads", "params", "step_counts"),
                           level_lists=("momentum", "accumulated", "ema", "v_sq"))

    def raise_by_name(self, err, params):
        """err of a call over the gradients of params, its "parameters[i]" / "tensors[i]" (the
        i-th of those lists, not the user's numbering) replaced by the parameter's name."""
        message = str(err)
        match = _LIST_PREFIX.match(message)
        if match is None:
            raise err
        name = self.names[params[int(match.group(1))]]
        raise type(err)(f"parameter {name!r}{message[match.end():]}") from None

    def name_group_positions(self, err):
        """err's message (AdamW's: "param_groups[g]['params'][j]") with each parameter named
        as the model names it, in place (the exception itself is re-raised)."""
        if not err.args or not isinstance(err.args[0], str):
            return
        groups = self.base.param_groups

        def name(match):
            g, j = int(match.group(1)), int(match.group(2))
            params = groups[g]["params"] if g < len(groups) else ()
            p = params[j] if j < len(params) else None
            label = self.names.get(p) if p is not None else None
            # a parameter the model does not hold is named by this very position already
            return match.group(0) if label in (None, match.group(0)) else f"parameter {label!r}"
        err.args = (_GROUP_POSITION.sub(name, err.args[0]),) + err.args[1:]

    def raise_if_sparse(self):
        """A sparse gradient fails the first C call with torch's DLPack message: say what it is."""
        for p in self.gather(with_params=True)[1]:
            if p.grad.layout != torch.strided:
                raise RuntimeError(f"parameter {self.names[p]!r}: {p.grad.layout} "
                                   "gradients are not supported (e.g. nn.Embedding(sparse=True))"
                                   ) from None


class NetworkWeights:
    """Detached views of the current weights of the controller and the momentum network, for the
    C calls. Walking a module's parameters costs ~7 us, so the list is taken again only when the
    module object changed or torch registered a parameter or submodule anywhere since
    (watch_model_edits: `load_state_dict(..., assign=True)`, a new nn.Parameter), and the views
    again when a weight's storage moved (`p.data = ...`); meta-updates and plain loads write in
    place. Copies and pickles start empty."""

    def __init__(self):
        watch_model_edits()
        self.views = {}  # label -> (module, edit count, parameters, views)

    def __reduce__(self):
        return NetworkWeights, ()

    def of(self, label, module):
        entry = self.views.get(label)
        if entry is None or entry[0] is not module or entry[1] != _MODEL_EDITS[0]:
            params = list(module.parameters())
            entry = (module, _MODEL_EDITS[0], params, [p.detach() for p in params])
        elif any(v.data_ptr() != p.data_ptr() for p, v in zip(entry[2], entry[3])):
            entry = entry[:3] + ([p.detach() for p in entry[2]],)
        self.views[label] = entry
        return entry[3]
