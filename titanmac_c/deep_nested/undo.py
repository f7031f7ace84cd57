"""Undo records for the parts of a DeepNestedOptimizer step that train its small networks with
torch ops (Phase 1's surrogate training, the meta-update): taken before they write, run when an
exception (a KeyboardInterrupt, one from torch's global optimizer hooks, which run in their Adam
steps) stops them half way, so the networks and their Adam state are left as they were."""

import torch


def training_undo(params, optimizer):
    """A function that puts back the values and gradients of params and the whole state of
    optimizer (a torch optimizer over them) as they are now. The copies are of small networks:
    the controller and the momentum network."""
    params = list(params)
    values = [(w, w.detach().clone(), w.grad) for w in params]
    state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
             for p, entry in optimizer.state.items()}

    def undo():
        with torch.no_grad():
            for w, value, grad in values:
                w.copy_(value)
                w.grad = grad
        optimizer.state.clear()
        optimizer.state.update(state)
    return undo
