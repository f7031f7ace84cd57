"""What every call into the C core needs besides its tensors: threads or stream, scratch, and
error messages that point at the user's parameters instead of at positions in a flat list."""

import functools
import math
import numbers
import os
import re
import sys

import torch

from .. import _C

# what the C core's norms, clipping and AdamW take (float64 computed in double, as torch does);
# the DeepNestedOptimizer's control and CMS ops take the first three
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

EAGER_ONLY_REASON = ("titanmac_c's C core writes tensors through DLPack, which a trace cannot "
                     "see: its calls run eagerly between graphs (fullgraph=True cannot hold them)")


def eager_only(fn):
    """fn run eagerly under torch.compile (Dynamo breaks the graph around the call instead of
    tracing into it). The C core writes tensors through DLPack, unseen by a trace: a traced
    caller would drop what fn tells autograd (mark_written's version bumps, which Dynamo does
    not replay, so a backward through a graph saved before the step would silently read the
    updated weights, and a pending clip coefficient would outlive its gradients), and would
    guard on every Python value fn reads (a scheduled learning rate: a recompilation per step
    until Dynamo's limit)."""
    # the reason is what a fullgraph=True compile's error shows
    disabled = torch.compiler.disable(fn, reason=EAGER_ONLY_REASON)

    # a plain function around it binds `self` for methods: torch 2.10's Dynamo called a disabled
    # method's wrapper without it ("missing 1 required positional argument: 'self'")
    @functools.wraps(fn)
    def eager(*args, **kwargs):
        return disabled(*args, **kwargs)

    return eager


# titanmac_c's folder (this file is in its _internal/), with the separator: torch's folder name
# is a prefix of torchvision's
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def user_stacklevel():
    """warnings.warn's stacklevel that names the user's line: the first frame, from the caller
    of warn up, outside titanmac_c and torch (whose wrappers, eager_only's among them, sit
    between a public function and its caller)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
        level, frame = level + 1, frame.f_back
    return level


def exec_kwargs(device: torch.device) -> dict:
    """Keyword arguments telling the C core where to run: torch's thread count on the CPU, torch's
    current stream on CUDA (so our kernels are ordered with the user's)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # The raw handle costs ~0.2 us; current_stream().cuda_stream builds a Stream object
        # (~4 us). With torch's DLPack exchange table the binding asks torch itself and this
        # value is only a fallback.
        return {"stream": torch._C._cuda_getCurrentRawStream(index)}
    return {"num_threads": torch.get_num_threads()}


def mark_written(*lists):
    """Tell autograd that the C core wrote these tensors in place. torch's in-place ops bump a
    tensor's version counter, so a backward through a graph that saved the old values raises
    ("modified by an inplace operation") instead of silently using the new ones; writes through
    DLPack bypass that, so the bump is made here (~40 ns a tensor)."""
    torch.autograd.graph.increment_version([t for ts in lists for t in ts])


def before_write(*lists):
    """Call before the C core writes these tensors in place. Under
    torch.autograd.graph.allow_mutation_on_saved_tensors(), torch keeps a tensor saved for
    backward by cloning it before an in-place op changes it, and sees the op through a dispatch
    mode, which writes through DLPack bypass: an in-place copy of each tensor onto itself (no
    pass over memory: torch returns early for it) lets the mode clone the saved ones first.
    Outside that context: one attribute read."""
    if not getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False):
        return
    with torch.no_grad():  # a leaf parameter that requires grad takes it then, as in a step
        for ts in lists:
            for t in ts:
                if not t.is_inference():  # (which no graph saves)
                    t.copy_(t)


def run_to_completion(fn, tries=8):
    """fn() (which does no harm when run again), run again when a KeyboardInterrupt or another
    BaseException that is not an Exception stops it, so that work which must follow a write (a
    step's bookkeeping after the C core wrote) is never left half done; the first such exception
    is raised once fn has completed. An Exception from fn propagates at once."""
    pending = None
    for _ in range(tries):
        try:
            fn()
            break
        except Exception:
            raise
        except BaseException as exc:  # noqa: B036 (re-raised below)
            pending = pending or exc
    if pending is not None:
        raise pending


_DENSE_ORDERS = {}  # (shape, strides) -> dense_order's answer: a model has few layouts
_DENSE_ORDERS_KEPT = 4096


def dense_order(t):
    """The permutation of t's dimensions under which t is contiguous, when t is dense and
    non-overlapping in another order (transposed, channels_last), else None. The C core takes
    such a tensor as it lies (numel elements in memory order), pairing it element by element only
    with tensors in the same order. Remembered per layout (the sort and the trial view cost ~7
    us, the lookup ~0.3 us)."""
    key = (t.shape, t.stride())
    if key in _DENSE_ORDERS:
        return _DENSE_ORDERS[key]
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    if not t.permute(order).is_contiguous():
        order = None
    if len(_DENSE_ORDERS) >= _DENSE_ORDERS_KEPT:
        _DENSE_ORDERS.clear()
    _DENSE_ORDERS[key] = order
    return order


def in_layout_of(t, p):
    """t (a gradient or state tensor of parameter p), or a copy of it in p's memory layout when
    the two differ (a checkpoint saved from a channels_last model loaded into a contiguous one,
    a gradient assigned in another layout): the C core pairs elements by their place in memory,
    where torch's ops pair them by index. t is returned as it is when p has no dense layout or
    the two differ in more than layout (the C core then names the problem)."""
    if (not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.shape != p.shape
            or t.device != p.device or t.stride() == p.stride()):
        return t  # the same strides: the same layout (the usual case, ~0.3 us)
    if p.is_contiguous():
        if t.is_contiguous():
            return t
    else:
        order = dense_order(p)
        if order is None or t.permute(order).is_contiguous():
            return t
    out = torch.empty_like(p, dtype=t.dtype)  # preserve_format: p's strides
    out.copy_(t)
    return out


def is_expanded(t):
    """Whether several elements of t lie on one memory location (a stride 0 over a dimension of
    more than one element): t cannot be written in place."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def is_strided_only(t):
    """Whether no permutation makes t dense (a strided slice, an expanded tensor): the C core
    cannot take it in place."""
    return not t.is_contiguous() and dense_order(t) is None


def strided_copies(tensors):
    """tensors, those no permutation makes dense (strided slices, expanded tensors) replaced by
    contiguous copies (for a call that only reads them); None when there is none."""
    copies = list(tensors)
    changed = False
    for i, t in enumerate(copies):
        if t.layout == torch.strided and is_strided_only(t):  # sparse: left for the C core
            copies[i] = t.contiguous()
            changed = True
    return copies if changed else None


def call_dense(fn, *lists, read_only=False):
    """fn(*lists) (a list may be None); if the C core refuses a tensor (BufferError: it
    validates before writing) and fn only reads them (read_only), again with the tensors it
    cannot take in place (dense in no order) as contiguous copies, as torch's norms take any
    tensor. Dense tensors in any order cost nothing extra."""
    try:
        return fn(*lists)
    except BufferError:
        if not read_only:
            raise
        copies = [None if ts is None else strided_copies(ts) for ts in lists]
        if all(c is None for c in copies):
            raise
        return fn(*(ts if c is None else c for ts, c in zip(lists, copies)))


def norms_scratch(device: torch.device, grads, params=None):
    """Scratch for one tm_norms call: none on the CPU (the binding borrows host memory), a fresh
    block from torch's caching allocator on CUDA (stream-ordered, so no reuse race; needs no
    zeroing)."""
    if device.type != "cuda":
        return None
    nbytes = _C.norms_scratch_bytes(grads, params)
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)


class Scratch:
    """Scratch memory the C core asks for, owned here because the library allocates nothing.

    CPU calls need none from us (the binding borrows host memory for the call). CUDA calls get a
    zero-initialised byte tensor per device that only grows; the AdamW completion counter relies on
    it starting at zero, and every kernel leaves it zero again.
    """

    def __init__(self):
        self._buffers = {}

    def get(self, device: torch.device, nbytes: int):
        if device.type != "cuda" or nbytes == 0:
            return None
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = torch.zeros(max(nbytes, 256), dtype=torch.uint8, device=device)
            self._buffers[device] = buf
        return buf


# "<list>[<i>]", or "<list>[<level>][<i>]" for the CMS state's lists (one per level)
_LIST_INDEX = re.compile(r"(\w+)(\[\d+\])?\[(\d+)\]")
# the C core's "file.c:123: " before the message under TITANMAC_DEBUG=1
_DEBUG_PREFIX = re.compile(r"[\w.]+:\d+: ")


def reraise_with_names(exc: Exception, flat_names, group_names=None, lists=None, level_lists=()):
    """Re-raise an error of the C core whose message starts with "<list>[<i>]" with the user's name
    of tensor i appended, e.g. "exp_avg[3]: ... (param_groups[0]['params'][5])"; another tensor
    the message names (one it shares memory with) is named too: "tensors[2]: shares memory with
    tensors[0] (parameters[3]; tensors[0] is parameters[1])". lists: the list names whose index
    flat_names follows (None: every list of the call shares it); level_lists: names of the lists
    of such lists, one per level, named "<list>[<level>]" by the C core."""
    message = str(exc)
    prefix = _DEBUG_PREFIX.match(message)
    start = prefix.end() if prefix else 0
    named = []  # (label, name) of every tensor mentioned, the first at the message's start
    for match in _LIST_INDEX.finditer(message):
        if not named and match.start() != start:
            break
        label, index = match.group(0), int(match.group(3))
        is_level, name = match.group(2) is not None, match.group(1)
        if name == "groups" and not is_level:
            names = group_names
        elif is_level:
            names = flat_names if name in level_lists else None
        else:
            names = flat_names if lists is None or name in lists else None
        user = names[index] if names is not None and index < len(names) else None
        if user is None and not named:
            break
        if user is not None and all(user != u for _, u in named):
            named.append((label, user))
    if named:
        others = "".join(f"; {label} is {user}" for label, user in named[1:])
        message = f"{message} ({named[0][1]}{others})"
    raise type(exc)(message) from None


def as_number(name: str, value, expected: str = "a number") -> float:
    """float(value) for an argument the user gave, with errors naming it: something that is not
    a number (None, a list, a string, which float() would parse but torch's math would not) is a
    TypeError, as torch's arithmetic raises on it; a tensor of several elements a ValueError."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except TypeError:
        raise TypeError(f"{name} = {value!r}: expected {expected}") from None
    except (ValueError, RuntimeError):
        raise ValueError(f"{name} = {value!r}: expected {expected}") from None


def is_one_number(value) -> bool:
    """Whether a count or step read from a checkpoint or a state entry holds one real value: a
    number (not a bool) or a one-element tensor with a value (not on the meta device)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.device.type != "meta"
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def float_in_range(name: str, value, low: float, high: float, high_open: bool = True) -> float:
    """Validate a host hyperparameter: finite, in [low, high) (or [low, high])."""
    value = as_number(name, value)
    ok = math.isfinite(value) and low <= value and (value < high if high_open else value <= high)
    if not ok:
        if math.isinf(high):
            raise ValueError(f"{name} = {value}: must be finite and >= {low}")
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} = {value}: must be in [{low}, {high}{bracket}")
    return value


def check_supported_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: dtype {str(tensor.dtype).replace('torch.', '')} is not supported "
            "(float32, float16, bfloat16, float64)"
        )


# complex parameters step as their real views (torch's AdamW does the same: view_as_real of the
# parameter, gradient and state, then the real math on both parts)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def real_view(t):
    """A complex64/complex128 tensor as the float32/float64 tensor of its real and imaginary
    parts (the same memory, a last dimension of 2); any other tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def memory_real_view(t):
    """real_view of the values in t's memory: a tensor with the lazy conjugate bit (autograd
    leaves such gradients) as its conjugate, the same memory without the bit. Its 2-norm is
    t's, and scaling it by a real factor scales t: good for norms and clipping, not for math
    that needs the values' signs."""
    return real_view(t.conj() if t.is_conj() else t)


def compute_dtype(dtype):
    """The dtype of the norms, clip coefficients and learning rates the C core computes for tensors
    of (promoted) dtype `dtype`: float64 for float64, as torch computes those, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


__all__ = ["before_write", "exec_kwargs", "mark_written", "norms_scratch", "Scratch",
           "reraise_with_names", "run_to_completion", "as_number", "is_one_number",
           "float_in_range", "compute_dtype", "real_view", "memory_real_view", "COMPLEX_DTYPES",
           "_C"]
