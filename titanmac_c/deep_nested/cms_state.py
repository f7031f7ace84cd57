"""The CMS state of the DeepNestedOptimizer (spec section 7.1) and the checkpoint layout.
State per tensor and level l < K, of the reference's ContinuumMemoryState only what some
computation reads: momentum m_l, accumulated gradient A_l (float32, the parameter's shape), the
gradient EMA e_0 of level 0 (the meta proxy loss's target), and the levels' fire counts, a
float32 device tensor [K] per tensor (incremented by the C core, so a step skipped on the device
does not count). The reference also keeps e_l for l > 0 and v_sq_l, which nothing reads (spec
7.1): 2K + 1 full-size buffers per tensor here instead of 4K. The buffers lie in their
parameter's memory layout (channels_last too; the reference's are contiguous, the same values):
the C core pairs elements by their place in memory, so no step copies them. Checkpoints still
carry every key of the reference's layout; the buffers not kept are saved as zeros (stride-0
tensors, one element of storage each), which the reference loads and, never reading them,
continues as if they held its values.

Section numbers (spec N, §N) and bug ids (B1-B11, its section 14) refer to
docs/deep_nested_optimizer.md.
"""

import torch

from .nets import CMS_BETA2
from .._internal.runtime import in_layout_of, is_one_number

CMS_BUFFERS = ("momentum", "accumulated_grad", "ema_grad", "v_sq")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # where the fire counts are kept


def kept(name, level):
    """Whether CMSState keeps buffer `name` of `level` (see the module docstring)."""
    return name in ("momentum", "accumulated_grad") or (name == "ema_grad" and level == 0)


def level_frequencies(cms_frequencies, consistent=False):
    """Level l fires every B**l steps, B = cms_frequencies[1] (10 with one level): spec 7.1, B7.
    consistent (fix_reference_bugs): level l fires every cms_frequencies[l] steps, the period
    its gradient sum is divided by."""
    if consistent:
        return [int(f) for f in cms_frequencies]
    base = cms_frequencies[1] if len(cms_frequencies) > 1 else 10
    return [int(base ** level) for level in range(len(cms_frequencies))]


class CMSState:
    """The CMS buffers of every grouped tensor, as per-level lists in group order."""

    def __init__(self, params, cms_frequencies, device, consistent=False):
        self.params = list(params)
        self.k = len(cms_frequencies)
        self.cms_frequencies = list(cms_frequencies)
        self.frequencies = level_frequencies(cms_frequencies, consistent)
        self.ema_decays = [0.99 ** (1.0 / f) for f in self.frequencies]
        self.index = {p: i for i, p in enumerate(self.params)}
        f32 = dict(dtype=torch.float32, device=device)
        # buffers[name][level]: one tensor per param, or [] for a buffer not kept
        self.buffers = {name: [[torch.zeros_like(p, **f32) for p in self.params]
                               if kept(name, level) else [] for level in range(self.k)]
                        for name in CMS_BUFFERS}
        self.step_counts = [torch.zeros(self.k, **f32) for _ in self.params]

    def public_view(self):
        """optimizer.state in CMS mode: per parameter a ParamCMSView, read like the reference's
        ContinuumMemoryState (.frequencies, .levels[l].momentum, ...) over the live buffers."""
        return CMSStateDict((p, ParamCMSView(self, i)) for i, p in enumerate(self.params))

    def momenta(self):
        return [m for level in self.buffers["momentum"] for m in level]

    def level_lists(self, name, indices):
        """Per-level lists of buffer `name` for the tensors at `indices` ([] where not kept: the
        C core then computes that buffer's update and drops it)."""
        return [[level[i] for i in indices] if level else [] for level in self.buffers[name]]

    def lay_out_like(self, i, p):
        """Tensor i's kept buffers moved into p's memory layout (copies holding their values
        replace them) where p lies otherwise than they do: a parameter relaid out since the
        buffers were made (`p.data = p.data.contiguous()`). True when one was replaced."""
        first = self.buffers["momentum"][0][i]
        if first.stride() == p.stride() and first.shape == p.shape:
            return False  # its buffers are made and moved together: all lie as the first
        moved = False
        for levels in self.buffers.values():
            for level in levels:
                if level:
                    buf = in_layout_of(level[i], p)
                    moved = moved or buf is not level[i]
                    level[i] = buf
        return moved

    def lay_out_all(self):
        """lay_out_like for every tensor."""
        for i, p in enumerate(self.params):
            self.lay_out_like(i, p)

    def fires(self, t):
        return [t % f == 0 for f in self.frequencies]

    # -------------------------------------------------------------- checkpoints (Appendix A)

    def state_dict(self):
        """{tensor index: {level: {momentum, step_count (int), accumulated_grad, ema_grad,
        v_sq}}}; the step counts are read from the device here (checkpointing may sync)."""
        out = {}
        for i in range(len(self.params)):
            counts = self.step_counts[i].tolist()
            out[i] = {level: dict({name: self.buffer(name, level, i) for name in CMS_BUFFERS},
                                  step_count=int(counts[level]))
                      for level in range(self.k)}
        return out

    def buffer(self, name, level, i):
        """Tensor i's buffer `name` of `level`: the live one, or for a buffer not kept zeros of
        the parameter's shape with one element of storage (0-d parameters included)."""
        kept = self.buffers[name][level]
        if kept:
            return kept[i]
        p = self.params[i]
        return torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)

    def check_state_dict(self, cms_state):
        """Raises ValueError for a cms_state this state cannot load; writes nothing."""
        _check_dict("cms_state", cms_state)
        for i, levels in cms_state.items():
            if not isinstance(i, int):  # e.g. keys flattened to strings by a checkpoint tool
                raise ValueError(f"cms_state[{i!r}]: a {type(i).__name__} key; cms_state is "
                                 "keyed by each tensor's position in the groups (an int). "
                                 "torch.distributed.checkpoint's load gives such keys back as "
                                 "strings: save this optimizer's state_dict() with torch.save")
            if not 0 <= i < len(self.params):
                raise ValueError(f"cms_state[{i!r}]: the optimizer has {len(self.params)} tensors")
            _check_dict(f"cms_state[{i}]", levels)
            for level, saved in levels.items():
                if not isinstance(level, int) or not 0 <= level < self.k:
                    raise ValueError(f"cms_state[{i}][{level!r}]: the optimizer has {self.k} "
                                     "levels")
                _check_dict(f"cms_state[{i}][{level}]", saved)
                _check_count(f"cms_state[{i}][{level}]['step_count']",
                             saved.get("step_count", 0))
                shape = self.params[i].shape
                for name in CMS_BUFFERS:
                    value = saved.get(name)
                    if value is None and name in ("momentum", "accumulated_grad"):
                        raise ValueError(f"cms_state[{i}][{level}]: no {name!r}")
                    if value is not None:
                        check_dense_float(f"cms_state[{i}][{level}][{name!r}]", value, shape)

    @torch.no_grad()
    def reset(self):
        """Every buffer and step count back to zero, as at construction."""
        for levels in self.buffers.values():
            for level in levels:
                for buf in level:
                    buf.zero_()
        for counts in self.step_counts:
            counts.zero_()

    @torch.no_grad()
    def load_state_dict(self, cms_state):
        """Copies into the existing buffers; the caller has passed cms_state through
        check_state_dict (DeepNestedOptimizer checks every part of a checkpoint before its first
        write). A missing ema_grad / v_sq (older checkpoints) loads as zeros, as in the
        reference; values of buffers not kept were checked and are dropped."""
        for i, levels in cms_state.items():
            for level, saved in levels.items():
                for name in CMS_BUFFERS:
                    value = saved.get(name)
                    if self.buffers[name][level]:
                        buf = self.buffers[name][level][i]
                        buf.copy_(value if value is not None else torch.zeros_like(buf))
                self.step_counts[i][level] = float(saved.get("step_count", 0))


def check_dense_float(where, value, shape):
    """Raises ValueError naming `where` unless value is a dense floating tensor of `shape` with
    values (not on the meta device): a checkpoint's state tensor that can be copied in."""
    if (not torch.is_tensor(value) or value.shape != shape or value.device.type == "meta"
            or value.layout != torch.strided or not value.is_floating_point()):
        got = (type(value).__name__ if not torch.is_tensor(value) else
               f"{tuple(value.shape)} {value.dtype} {value.layout} on {value.device}")
        raise ValueError(f"{where}: {got}, expected a dense floating tensor of shape "
                         f"{tuple(shape)} with values")


def _check_count(name, count):
    """A level's fire count as a checkpoint or a ContinuumMemoryState holds it: a number or a
    one-element tensor with a value, >= 0 and within float32 (where it is kept)."""
    try:
        value = float(count) if is_one_number(count) else None
    except (TypeError, ValueError, RuntimeError, OverflowError):
        value = None
    if value is None or not 0.0 <= value <= _FLOAT32_MAX:
        raise ValueError(f"{name}: {count!r}, expected a number >= 0 (float32)")


def _check_dict(name, value):
    if not isinstance(value, dict):
        raise ValueError(f"{name}: a {type(value).__name__}, expected a dict")


def _buffer_property(name):
    """A CMS buffer of one level: reads the live tensor; assigning copies into it (as the
    reference's attribute assignment replaces its tensor)."""
    def get(self):
        return self._cms.buffer(name, self._level, self._i)

    def set(self, value):
        self._assign(name, value)
    return property(get, set)


class CMSLevelView:
    """Level l of one tensor's CMS state, with the attributes of the reference's CMSLevel. The
    buffers are the live ones (in-place writes and assignments go into the optimizer's state);
    a buffer not kept (e_l for l > 0, v_sq) reads as zeros that refuse writes. step_count reads
    the device (a host sync)."""

    __slots__ = ("_cms", "_i", "_level")

    def __init__(self, cms, i, level):
        self._cms, self._i, self._level = cms, i, level

    def _check_assign(self, name, value):
        """The live buffer that `value` may be copied into (raises when it may not)."""
        kept = self._cms.buffers[name][self._level]
        if not kept:
            raise ValueError(f"{name} of CMS level {self._level}: not kept by titanmac_c (the "
                             "update never reads it; see docs/deep_nested.md, CMS mode)")
        buf = kept[self._i]
        if not torch.is_tensor(value) or value.shape != buf.shape:
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"{name} of CMS level {self._level}: {got}, expected a tensor of "
                             f"shape {tuple(buf.shape)}")
        return buf

    def _assign(self, name, value):
        with torch.no_grad():
            self._check_assign(name, value).copy_(value)

    momentum = _buffer_property("momentum")
    accumulated_grad = _buffer_property("accumulated_grad")
    ema_grad = _buffer_property("ema_grad")
    v_sq = _buffer_property("v_sq")
    frequency = property(lambda self: self._cms.frequencies[self._level])
    ema_decay = property(lambda self: self._cms.ema_decays[self._level])
    beta2 = property(lambda self: CMS_BETA2)

    @property
    def step_count(self):
        return int(self._cms.step_counts[self._i][self._level])

    @step_count.setter
    def step_count(self, value):
        self._cms.step_counts[self._i][self._level] = float(value)


class CMSStateDict(dict):
    """optimizer.state in CMS mode. `state[p] = ContinuumMemoryState(...)` (the reference's way
    to reset one tensor's state) copies the given levels' kept buffers and step counts into the
    live state, all checked before any is written; an unknown key or a value without levels
    raises (a dict entry of its own would be ignored by the steps)."""

    def __reduce__(self):  # copies and pickles rebuild it whole (not through __setitem__)
        return type(self), (list(self.items()),)

    def __setitem__(self, p, value):
        view = self.get(p)
        if view is None:
            raise KeyError("optimizer.state: not a parameter of this optimizer (CMS mode keeps "
                           "one state per grouped parameter, made at construction)")
        if value is view:
            return
        levels = getattr(value, "levels", None)
        if levels is None or len(levels) != len(view.levels):
            raise ValueError(f"optimizer.state[p] = {type(value).__name__}: expected a CMS state "
                             f"with {len(view.levels)} levels (.levels)")
        writes = []
        for mine, given in zip(view.levels, levels):
            for name in CMS_BUFFERS:
                value_l = getattr(given, name, None)
                if value_l is not None and mine._cms.buffers[name][mine._level]:
                    writes.append((mine._check_assign(name, value_l), value_l))
            _check_count(f"step_count of CMS level {mine._level}", getattr(given, "step_count", 0))
        with torch.no_grad():
            for buf, value_l in writes:
                buf.copy_(value_l)
        for mine, given in zip(view.levels, levels):
            mine.step_count = getattr(given, "step_count", 0)


class ParamCMSView:
    """optimizer.state[p] in CMS mode: the reference's ContinuumMemoryState surface (frequencies,
    levels, should_update) over CMSState's buffers of tensor i."""

    __slots__ = ("_cms", "_i", "levels")

    def __init__(self, cms, i):
        self._cms, self._i = cms, i
        self.levels = [CMSLevelView(cms, i, level) for level in range(cms.k)]

    @property
    def frequencies(self):
        return list(self._cms.cms_frequencies)

    def should_update(self, level, step):
        return step % self.levels[level].frequency == 0

    def __repr__(self):
        return f"ParamCMSView(tensor {self._i}, frequencies {self.frequencies})"
