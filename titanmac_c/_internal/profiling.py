"""Named ranges around the parts of a titanmac_c step, for torch.profiler and Nsight Systems.

    from titanmac_c._internal.profiling import step_range, STATS
    with step_range(STATS):
        ...                                   # shows as "titanmac/stats" in the timelines

What a range emits:

* torch.profiler: a ``record_function`` range, only while a torch profiler is recording. The check
  is ``torch._C._autograd._profiler_enabled()`` (true for ``torch.profiler.profile``, the legacy
  ``torch.autograd.profiler.profile`` and a profiler started by other means), ~50 ns. An unguarded
  ``record_function`` costs ~5 us per use even with no profiler, hence the guard.
* NVTX (Nsight Systems / Nsight Compute): a ``torch.cuda.nvtx`` push/pop, only when CUDA is
  initialised in this process and NVTX is wanted. Environment ``TITANMAC_NVTX``:
    unset or ``auto``  NVTX when a tool is attached, i.e. ``NVTX_INJECTION64_PATH`` is set (nsys
                       and ncu set it in the profiled process);
    ``1``              always (when CUDA is in use), e.g. for a tool that does not set it;
    ``0``              never.
  Read at import; ``set_nvtx(True | False | None)`` overrides it at run time (None: back to the
  environment).
* Nothing otherwise: ``step_range`` returns one shared no-op context manager, ~0.2 us per
  ``with`` block in all (see ``inactive_cost_ns``).

The C entry points of the CUDA backend carry their own NVTX ranges (csrc/cuda/tm_nvtx.cuh, the
NVTX3 header-only API: a few ns without a tool attached; -DTM_NO_NVTX removes them), named after
the C op ("titanmac/cuda_norms", ...), so an Nsight timeline shows the Python parts around the
kernels they launch.
"""

import functools
import os
import time

import torch

# Range names of the parts of a step (wired into optim/adamw.py and deep_nested/optimizer.py).
STEP = "titanmac/step"              # one whole optimizer step
STATS = "titanmac/stats"            # group norms / clip norm statistics (one pass over the grads)
CONTROLLER = "titanmac/controller"  # EMA, NestedController, lr = base_lr * mu, skip flag
CLIP = "titanmac/clip"              # global-norm clip coefficient (or torch's in-place clip)
UPDATE = "titanmac/update"          # the AdamW update
CMS = "titanmac/cms"                # CMS-mode update (docs/deep_nested_optimizer.md section 7)
META = "titanmac/meta"              # simple-mode meta-update every meta_update_freq steps
GRAPH = "titanmac/graph"            # CUDA-graph capture or replay of the whole step
PARTS = (STATS, CONTROLLER, CLIP, UPDATE, CMS, META, GRAPH)
RANGE_NAMES = (STEP,) + PARTS

__all__ = ["step_range", "annotate", "set_nvtx", "nvtx_enabled", "profiler_active",
           "inactive_cost_ns"] + ["STEP", "STATS", "CONTROLLER", "CLIP", "UPDATE", "CMS", "META",
                                  "GRAPH", "PARTS", "RANGE_NAMES"]

try:  # the C-level truth: any profiler (kineto or legacy) started in this process
    profiler_active = torch._C._autograd._profiler_enabled
except AttributeError:  # pragma: no cover - older torch
    profiler_active = torch.autograd._profiler_enabled

_record_function = torch.autograd.profiler.record_function


def _nvtx_from_env():
    value = os.environ.get("TITANMAC_NVTX", "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value not in ("", "auto"):
        raise ValueError(f"TITANMAC_NVTX={value!r}: expected auto, 0 or 1")
    return bool(os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH"))


_nvtx_wanted = _nvtx_from_env()


def set_nvtx(enabled=None):
    """Force NVTX ranges on (True) or off (False); None goes back to TITANMAC_NVTX / auto."""
    global _nvtx_wanted
    _nvtx_wanted = _nvtx_from_env() if enabled is None else bool(enabled)


def nvtx_enabled():
    """True when step_range would emit NVTX ranges now (wanted, and CUDA initialised)."""
    return _nvtx_wanted and torch.cuda.is_initialized()


class _Range:
    """An active range: record_function and/or NVTX push/pop."""

    __slots__ = ("name", "nvtx", "rf")

    def __init__(self, name, record, nvtx):
        self.name = name
        self.nvtx = nvtx
        self.rf = _record_function(name) if record else None

    def __enter__(self):
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        if self.rf is not None:
            self.rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.rf is not None:
            self.rf.__exit__(*exc)
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        return False


class _Inactive:
    """The shared no-op range (cheaper than contextlib.nullcontext: no argument handling)."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_INACTIVE = _Inactive()


def step_range(name):
    """Context manager: a named range while a profiler or NVTX tool is attached, else nothing.

    name: a str (use the constants of this module for the parts of a step)."""
    if profiler_active():
        return _Range(name, True, _nvtx_wanted and torch.cuda.is_initialized())
    if _nvtx_wanted and torch.cuda.is_initialized():
        return _Range(name, False, True)
    return _INACTIVE


def annotate(name):
    """Decorator form of step_range: the whole call is one range."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with step_range(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


def inactive_cost_ns(n=200_000):
    """Measured cost of one ``with step_range(...)`` block with no profiler and no NVTX, in ns
    (the loop's own cost subtracted). For the docs and the benchmarks; not used at run time."""
    if profiler_active():
        raise RuntimeError("inactive_cost_ns: a profiler is running")
    saved = _nvtx_wanted
    set_nvtx(False)
    try:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                pass
            t1 = time.perf_counter()
            for _ in range(n):
                with step_range(STATS):
                    pass
            t2 = time.perf_counter()
            best = min(best, ((t2 - t1) - (t1 - t0)) / n * 1e9)
        return best
    finally:
        set_nvtx(saved)

