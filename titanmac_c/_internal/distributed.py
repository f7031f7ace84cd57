"""DTensors (FSDP2's fully_shard, tensor parallelism): the C core works on each rank's local
shards, and the norms are reduced over the device mesh with torch.distributed's collectives
(DESIGN principle 7: no transport of our own).

A DTensor is a wrapper without storage of its own; its local shard (`_local_tensor`, what
`to_local()` returns without the autograd node) is an ordinary tensor the C core takes. AdamW is
element-wise, so stepping the local shards of a parameter, its gradient and its state steps the
DTensor. A norm is not: each rank's local norm is reduced over the mesh dimensions on which the
tensor is sharded (replicated dimensions hold copies and are not summed).
"""

import math
import sys

import torch
import torch.distributed as dist


def dtensor_type():
    """torch's DTensor class once torch.distributed.tensor has been imported (no DTensor exists
    before that), else None: costs nothing to a program that does not use them."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def any_dtensor(tensors):
    """Whether any of tensors is a DTensor, by their distinct types (one isinstance a tensor
    costs a program that imports torch.distributed.tensor without using it ~70 ns a tensor)."""
    cls = dtensor_type()
    return cls is not None and any(issubclass(c, cls) for c in set(map(type, tensors)))


def is_dtensor(t):
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_of(t):
    """The local shard of a DTensor (no autograd node; the same storage)."""
    return t._local_tensor


def _placements_text(t):
    return "(" + ", ".join(repr(p) for p in t.placements) + ")"


def reduced(t):
    """t, or when it has Partial placements (a gradient not yet summed over the ranks, as autograd
    leaves those of a sequence-parallel LayerNorm) a copy summed there (Replicate), as torch's
    ops redistribute one before using it: a collective."""
    if not any(placement.is_partial() for placement in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if placement.is_partial() else placement
                                          for placement in t.placements])


def sharded_dims(t):
    """The mesh dimensions over which t's local norm must be summed: every one it is not
    replicated on (a replicated dimension holds copies). Not `is_shard()`: FSDP2 composed with
    tensor parallelism shards along dimensions placed as _StridedShard, which is no Shard.
    t has no Partial placement (reduced)."""
    return tuple(d for d, placement in enumerate(t.placements) if not placement.is_replicate())


def replicated(mesh, value):
    """value (the same on every rank) as the DTensor torch's norms return: replicated over the
    mesh, so `.full_tensor()` and `.to_local()` work as on torch's result."""
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


class ShardedNorms:
    """The tensors of a norm (all DTensors on one device mesh) split by the mesh dimensions they
    are sharded on: parts[dims] = (positions in the caller's list, the local shards the norm
    reads); positions and tensors: all of them, as given. A Partial tensor is read summed over
    the ranks (reduced); its own shards, which a clip scales, stay partial (scaling commutes
    with the sum). names: the user's name of each position (default "<label>[<position>]")."""

    def __init__(self, label, positions, tensors, names=None):
        cls = dtensor_type()
        self._names = names
        self._label = label
        self.positions, self.tensors = list(positions), list(tensors)
        j, first = next((j, t) for j, t in zip(positions, tensors) if isinstance(t, cls))
        self.mesh = first.device_mesh
        self.parts = {}
        for i, t in zip(positions, tensors):
            if not isinstance(t, cls):
                raise ValueError(
                    f"{self._name(i)}: a plain tensor among DTensors ({self._name(j)} is one): "
                    "the norm over ranks needs all of them as DTensors (as torch's does)")
            if t.device_mesh is not self.mesh and t.device_mesh != self.mesh:
                raise ValueError(f"{self._name(i)}: on another device mesh than "
                                 f"{self._name(j)}: one norm reduces over one mesh")
            read = reduced(t)
            part = self.parts.setdefault(sharded_dims(read), ([], []))
            part[0].append(i)
            part[1].append(local_of(read))

    def _name(self, i):
        return self._names[i] if self._names is not None else f"{self._label}[{i}]"

    def total(self, local_norm, norm_type):
        """The norm over every rank's shards, a 0-d tensor on this rank's device, equal on all
        ranks, in the dtype local_norm(positions, tensors) gives the 0-d norm of local tensors in
        (float32, float64 for float64 tensors). One all_reduce per mesh dimension of each part
        (an FSDP2 model: one), on float64 powers so that summing many ranks loses nothing."""
        inf = math.isinf(norm_type)
        total = None
        dtype = torch.float32
        for dims, (positions, tensors) in self.parts.items():
            value = local_norm(positions, tensors)
            dtype = torch.promote_types(dtype, value.dtype)
            value = value.double()
            if inf and dims:
                # a MAX may drop a NaN (gloo's does): it travels as a flag beside the value
                nan = value.isnan()
                value = torch.stack([torch.where(nan, 0.0, value), nan.double()])
            elif not inf:
                value = value.pow(norm_type)
            for d in dims:
                dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                                group=self.mesh.get_group(d))
            if inf and dims:
                value = torch.where(value[1] > 0, math.nan, value[0])
            total = value if total is None else (
                torch.maximum(total, value) if inf else total + value)
        if not inf:
            total = total.pow(1.0 / norm_type)
        return total.to(dtype)

    def replicated(self, value):
        return replicated(self.mesh, value)


def localize(name, p, grad, state, keys):
    """(local p, local grad, {key: local state tensor}) of a DTensor parameter. Its state tensors
    (the keys present in state) must be DTensors of its mesh and placements, as torch's AdamW on
    a DTensor leaves them; its gradient a DTensor of its mesh, taken in the parameter's
    placements for this step (a Partial one summed, a replicated one sliced: a collective, as in
    torch's ops). Anything else is refused with the tensor's name, before the C core writes."""
    cls = dtensor_type()
    named = [("gradient", grad)] + [(k, state[k]) for k in keys if k in state]
    for what, t in named:
        if not isinstance(t, cls):
            raise ValueError(f"{name}: the parameter is a DTensor {_placements_text(p)} but its "
                             f"{what} is a plain tensor of shape {tuple(t.shape)}; load "
                             "sharded state with torch.distributed.checkpoint's "
                             "set_optimizer_state_dict")
        if t.device_mesh != p.device_mesh or (
                what != "gradient" and tuple(t.placements) != tuple(p.placements)):
            raise ValueError(f"{name}: its {what} is a DTensor {_placements_text(t)} on "
                             f"{t.device_mesh}, the parameter {_placements_text(p)} on "
                             f"{p.device_mesh}: they must be sharded alike")
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return local_of(p), local_of(grad), {k: local_of(state[k]) for k in keys if k in state}


def refuse_plain_with_dtensor(name, p, grad, state, keys):
    """A plain parameter whose gradient or state is a DTensor: refused by name."""
    cls = dtensor_type()
    for what, t in [("gradient", grad)] + [(k, state.get(k)) for k in keys]:
        if isinstance(t, cls):
            raise ValueError(f"{name}: its {what} is a DTensor {_placements_text(t)}, the "
                             "parameter a plain tensor")
