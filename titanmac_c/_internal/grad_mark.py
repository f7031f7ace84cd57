"""GradientMark: whether the gradients are still the ones of a given moment, the check behind a
pending clip coefficient (AdamW.clip_grad_norm_) and the DeepNestedOptimizer's meta-update."""

import functools
import operator
import weakref

_IS_NONE = functools.partial(operator.is_, None)
_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_DEREF = weakref.ref.__call__


class GradientMark:
    """Whether the gradients are still the ones of a given moment: every grouped gradient with
    a version counter, held by weak reference (a held gradient would stay alive through
    zero_grad() and the next backward), and its version. A new backward, a zero_grad() (to None
    or in place), a gradient assigned anew or edited in place changes what it marks. The checks
    run as C-level maps over the lists (a Python call per gradient would cost more than the rest
    of a step's host time over many small tensors)."""

    __slots__ = ("params", "refs", "versions")

    def __init__(self, params, grads, versions):
        self.params, self.refs, self.versions = params, tuple(map(weakref.ref, grads)), versions

    @classmethod
    def of(cls, param_groups):
        """The mark of the groups' current gradients, or None when none can be marked (no
        gradient, or only inference tensors, which keep no version)."""
        params = [p for group in param_groups for p in group["params"]]
        grads = list(map(_GRAD, params))
        try:  # an inference tensor raises: rare, so found this way instead of asking each
            if not any(map(_IS_NONE, grads)):
                return cls(params, grads, tuple(map(_VERSION, grads)))
        except RuntimeError:
            pass
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None and not g.is_inference()]
        params, grads = [p for p, _ in pairs], [g for _, g in pairs]
        return cls(params, grads, tuple(map(_VERSION, grads))) if params else None

    @classmethod
    def of_planned(cls, params, grads):
        """The mark of every grouped parameter's gradient as a cached plan just read them
        (params: the plan's list of the grouped parameters, which the next step's plan
        recognizes by identity), or None when one has no version (an inference tensor)."""
        try:
            return cls(params, grads, tuple(map(_VERSION, grads)))
        except RuntimeError:
            return None

    @classmethod
    def of_first(cls, param_groups):
        """The mark of the first grouped gradient with a version only: a backward or a
        zero_grad() changes it as it changes all, at no per-gradient cost; a change of other
        gradients only goes unseen (of() sees it, at ~0.5 us a gradient)."""
        for group in param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and not g.is_inference():
                    return cls([p], [g], (g._version,))
        return None

    def holds(self):
        return self.current() is not None

    def current(self):
        """The marked parameters' gradients as read now when they are the marked ones,
        unchanged; else None."""
        grads = list(map(_GRAD, self.params))
        # a gradient set to None matches a dead reference: ruled out first
        if (not any(map(_IS_NONE, grads)) and all(map(operator.is_, grads, map(_DEREF, self.refs)))
                and tuple(map(_VERSION, grads)) == self.versions):
            return grads
        return None

    def covers(self, params):
        """Whether every one of params is a marked parameter (by identity)."""
        if params is self.params:
            return True
        marked = set(map(id, self.params))
        return all(map(marked.__contains__, map(id, params)))

    def kept_and_edited(self):
        """(the marked gradients still in place and unchanged, how many are still in place but
        changed since: accumulated onto by another backward, zeroed in place, edited), read
        after holds() was False."""
        kept, edited = [], 0
        for p, ref, version in zip(self.params, self.refs, self.versions):
            g = ref()
            if g is not None and p.grad is g:
                if g._version == version:
                    kept.append(g)
                else:
                    edited += 1
        return kept, edited

    def __reduce__(self):
        # pickle and deepcopy: a weak reference cannot be pickled, and the copy's gradients are
        # not the ones marked (torch copies a Parameter without its .grad): a mark that no
        # longer holds
        return _lapsed_mark, (self.params, self.versions)


def _lapsed_mark(params, versions):
    mark = GradientMark.__new__(GradientMark)
    mark.params, mark.refs, mark.versions = params, tuple(_dead_ref() for _ in params), versions
    return mark


class _Gone:
    """An object that is freed as soon as the weak reference to it is made."""


def _dead_ref():
    return weakref.ref(_Gone())
