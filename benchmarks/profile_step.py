"""Profile training steps with the pure-PyTorch reference DeepNestedOptimizer and with titanmac_c,
and print the tables of TitanMAC's profiling reports side by side.

For each model size and implementation (reference = titanmac_c.testing.reference_dno, the
stand-in for the upstream optimizer, given loss.item() as the upstream scripts do; titanmac_c
given the loss tensor), on the same model, options (bench_train.OPT_KW) and batches as
benchmarks/bench_train.py:

  1. --warmup steps, not measured;
  2. --steps steps timed without a profiler, as bench_train.py times them: steps per second and
     the median optimizer step (these are the figures to compare with bench_train.py);
  3. --profile-steps steps under torch.profiler (CPU activity, plus CUDA on a GPU; memory on),
     from which come
       - the parts of a step: train/forward, train/backward, train/optimizer and, inside the
         optimizer, the titanmac/* ranges (titanmac_c._internal.profiling names: stats,
         controller, clip, update, cms, meta; the reference's methods are wrapped here to emit
         the same names);
       - top operations by device time (CUDA only) and by host time (self time);
       - kernel launches per step (CUDA), host syncs per step (CUDA: sync-debug-mode warnings in
         one extra optimizer step; everywhere: device-to-host scalar reads, i.e.
         aten::_local_scalar_dense, each a sync on CUDA), ATen ops per step;
       - device time against host (wall) time per step, the "GPU efficiency" (CUDA);
       - peak memory: parameters + gradients + optimizer state (every tensor of its state_dict:
         the reference's CMS buffers count) + the peak allocated above the start of the profiled
         steps (CUDA: max_memory_allocated; CPU: the profiler's memory events, which count the
         gradients, reallocated every step, in that peak);
  4. a Chrome trace per implementation (open in chrome://tracing or ui.perfetto.dev) and one JSON
     summary of everything printed.

On the CPU the device columns read "-" (host figures only).

Usage: python benchmarks/profile_step.py [--device cpu|cuda] [--sizes titanmac[,d512l8,...]]
           [--warmup 5] [--steps 20] [--profile-steps 10] [--top 12]
           [--out benchmarks/out/profile_step_<device>.json] [--no-trace]
Sizes: "titanmac" is tests/dno_models' TitanMAC-like LM (3.2M parameters, bench_train's model);
"d<width>l<layers>" is train_lm.TitanMACLM at that width and depth (e.g. d512l8: 25M) on the same
token batches.
"""

import contextlib
import gc
import gzip
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from _cli import make_parser  # noqa: E402
from _progress import progress, progress_rows  # noqa: E402
from bench_train import OPT_KW  # noqa: E402
from dno_models import loss_fn, make_titanmac_like_model, synthetic_batches  # noqa: E402

import titanmac_c  # noqa: E402
from titanmac_c._internal import profiling as P  # noqa: E402
from titanmac_c.testing import reference_dno as _reference_dno  # noqa: E402
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer  # noqa: E402

IMPLS = ("reference", "titanmac_c")
TRAIN_PARTS = ("train/zero_grad", "train/forward", "train/backward", "train/optimizer")
OPT_PARTS = P.PARTS
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
SCALAR_READ = "aten::_local_scalar_dense"


# ------------------------------------------------------------------------------ set-up

def build_model(size):
    if size == "titanmac":
        return make_titanmac_like_model(seed=0)
    match = re.fullmatch(r"d(\d+)l(\d+)", size)
    if not match:
        raise SystemExit(f"profile_step: unknown size {size!r} (titanmac or d<width>l<layers>)")
    from train_lm import TitanMACLM
    width, layers = int(match.group(1)), int(match.group(2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TitanMACLM(19, d_model=width, n_layers=layers, n_heads=max(4, width // 64))


def _wrap_method(obj, attr, name):
    """obj.attr becomes the same callable inside step_range(name) (instance attribute)."""
    fn = getattr(obj, attr, None)
    if fn is None:
        return False

    def wrapped(*args, **kwargs):
        with P.step_range(name):
            return fn(*args, **kwargs)
    setattr(obj, attr, wrapped)
    return True


@contextlib.contextmanager
def reference_clip_range():
    """The reference's step calls the module function _fused_clip_grad_norm_: wrap it."""
    original = _reference_dno._fused_clip_grad_norm_

    def clip(*args, **kwargs):
        with P.step_range(P.CLIP):
            return original(*args, **kwargs)
    _reference_dno._fused_clip_grad_norm_ = clip
    try:
        yield
    finally:
        _reference_dno._fused_clip_grad_norm_ = original


def annotate_reference(opt):
    _wrap_method(opt, "_compute_group_stats", P.STATS)
    _wrap_method(opt.controller, "forward", P.CONTROLLER)
    _wrap_method(opt, "_adamw_step", P.UPDATE)
    _wrap_method(opt, "_cms_step", P.CMS)
    _wrap_method(opt, "_update_meta_components", P.META)


def annotate_titanmac_c(opt):
    """Until the DeepNestedOptimizer emits the ranges itself: wrap its parts from outside. In
    titanmac_c the clip has no pass of its own: the coefficient comes out of the control op
    (controller range) and is applied as the update loads each gradient (update range)."""
    _wrap_method(opt._control, "run_norms", P.STATS)
    _wrap_method(opt._control, "control", P.CONTROLLER)
    _wrap_method(opt.base_optimizer, "_fused_step", P.UPDATE)
    _wrap_method(opt, "_update_meta_components", P.META)
    if getattr(opt, "_graph", None) is not None:
        _wrap_method(opt._graph, "step", P.GRAPH)


def emits_ranges():
    """True when titanmac_c's own modules use titanmac_c._internal.profiling (then its steps
    record the titanmac/* ranges themselves and nothing is wrapped here). Decided without running
    a step, so both implementations train on exactly the same batches."""
    from titanmac_c.deep_nested import optimizer
    from titanmac_c.optim import adamw
    for module in (optimizer, adamw):
        if any(v is P or v is P.step_range or v is P.annotate for v in vars(module).values()):
            return True
    return False


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_bytes(opt, model):
    """Bytes of parameters, of gradients, and of every tensor in the optimizer's state_dict
    (unique storages; the reference's CMS buffers included)."""
    seen, total = set(), 0

    def walk(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            key = (obj.untyped_storage().data_ptr(), obj.device)
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for p in params:  # not counted again as state
        seen.add((p.untyped_storage().data_ptr(), p.device))
    walk(opt.state_dict())
    return param_bytes, grad_bytes, total


def trace_memory_peak(trace_path, device):
    """Peak bytes allocated during the profiled steps above the level at their start, from the
    '[memory]' events of a Chrome trace (CPU: device type 0; CUDA: 1)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    want = 1 if device.type == "cuda" else 0
    mem = sorted((e for e in events if e.get("name") == "[memory]"
                  and e.get("args", {}).get("Device Type") == want), key=lambda e: e["ts"])
    if not mem:
        return None
    first = mem[0]["args"]
    base = first["Total Allocated"] - first["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - base


# ------------------------------------------------------------------------------ one run

class Run:
    """One implementation on its own model copy, stepping through the shared batches."""

    def __init__(self, kind, size, device, batches):
        torch.manual_seed(0)
        self.kind, self.size, self.device = kind, size, device
        self.model = build_model(size).to(device)
        cls = (ReferenceDeepNestedOptimizer if kind == "reference"
               else titanmac_c.DeepNestedOptimizer)
        self.opt = cls(self.model, **OPT_KW)
        self.batches = iter(batches)
        self.opt_times = None  # a list while timing
        self.wall = 0.0
        self.loss = None

    def step(self):
        model, opt, device = self.model, self.opt, self.device
        batch = next(self.batches)
        with P.step_range("train/zero_grad"):
            opt.zero_grad()
        with P.step_range("train/forward"):
            loss = loss_fn(model, batch)
        with P.step_range("train/backward"):
            loss.backward()
        if self.opt_times is not None:
            _sync(device)
            t0 = time.perf_counter()
        with P.step_range("train/optimizer"):
            # the reference needs a Python float (a host sync); titanmac_c takes the tensor
            opt.step(loss.item() if self.kind == "reference" else loss.detach())
        if self.opt_times is not None:
            _sync(device)
            self.opt_times.append(time.perf_counter() - t0)
        self.loss = loss.detach()

    def annotate(self):
        if self.kind == "reference":
            annotate_reference(self.opt)
        elif not emits_ranges():
            annotate_titanmac_c(self.opt)


def run_size(size, device, args, batches, trace_dir):
    """Warm-up and timed steps of both implementations interleaved step by step (so the drifts
    of a shared machine hit both alike), then each one's profiled steps on its own."""
    runs = [Run(kind, size, device, batches) for kind in IMPLS]
    labels = [run_label(run) for run in runs]

    def bars(phase, total):
        """One bar per implementation, for the phase whose steps alternate between them."""
        return progress_rows([f"{label}: {phase}" for label in labels], total=total,
                             unit="step", disable=args.quiet or total == 0)

    with bars("warm-up", args.warmup) as rows:
        for _ in range(args.warmup):
            for run, bar in zip(runs, rows):
                run.step()
                bar.update(1)
    for run in runs:
        run.annotate()
    results = {}
    with reference_clip_range():
        # timed as bench_train.py times: the wall time of the steps, the optimizer step between
        # syncs; interleaved, so each run's wall time is the sum of its own steps
        for run in runs:
            run.opt_times = []
        with bars("timed steps", args.steps) as rows:
            for _ in range(args.steps):
                for run, bar in zip(runs, rows):
                    _sync(device)
                    t0 = time.perf_counter()
                    run.step()
                    _sync(device)
                    run.wall += time.perf_counter() - t0
                    bar.update(1)
        for run in runs:
            opt_times, run.opt_times = run.opt_times, None
            results[run.kind] = profile_run(run, args, trace_dir)
            results[run.kind].update(
                steps_per_s=args.steps / run.wall, opt_ms=statistics.median(opt_times) * 1e3,
                opt_ms_p90=sorted(opt_times)[int(0.9 * (len(opt_times) - 1))] * 1e3)
    del runs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


@contextlib.contextmanager
def stderr_held_back():
    """What C++ writes to stderr meanwhile (the profiler's start and stop lines, its allocator
    warnings) goes to a file and is printed when the block ends; yields a file on the real
    stderr for a progress bar, which thus never shares a line with those logs."""
    sys.stderr.flush()
    real = os.dup(2)
    bar_file = os.fdopen(os.dup(real), "w", buffering=1)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield bar_file
        finally:
            sys.stderr.flush()
            os.dup2(real, 2)
            os.close(real)
            bar_file.close()
            held.seek(0)
            text = held.read().decode(errors="replace")
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


def run_label(run):
    """What a progress bar names: the implementation, its mode and the model size."""
    return f"{run.kind} AdamW-mode ({run.size})"


def profile_run(run, args, trace_dir):
    device, model, opt, kind = run.device, run.model, run.opt, run.kind
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_at_start = torch.cuda.memory_allocated(device)
    # the profiler's log lines are printed after the bar is closed
    with stderr_held_back() as bar_file, profile(activities=acts, profile_memory=True) as prof:
        _sync(device)
        p0 = time.perf_counter()
        with progress(total=args.profile_steps, desc=f"{run_label(run)}: profiled steps",
                      unit="step", disable=args.quiet, file=bar_file) as bar:
            for _ in range(args.profile_steps):
                run.step()
                bar.update(1)
            _sync(device)
        profiled_wall = time.perf_counter() - p0
    if cuda:
        cuda_transient = torch.cuda.max_memory_allocated(device) - allocated_at_start
    final_loss = float(run.loss)
    syncs = count_syncs(opt, model, kind, device)
    if args.no_trace:
        tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        tmp.close()
        trace_path = tmp.name
    else:
        trace_path = os.path.join(
            trace_dir, f"profile_step_{device.type}_{run.size}_{kind}.trace.json.gz")
    prof.export_chrome_trace(trace_path)
    transient = cuda_transient if cuda else trace_memory_peak(trace_path, device)
    if args.no_trace:
        os.unlink(trace_path)
        trace_path = None
    param_b, grad_b, state_b = state_bytes(opt, model)
    if transient is None:
        peak = None
    elif cuda:  # what was allocated at the start for this run, plus the peak above it
        peak = param_b + grad_b + state_b + transient
    else:  # the CPU figure counts the gradients in the transient (they are reallocated)
        peak = param_b + state_b + transient
    result = summarise(prof, device, args.profile_steps, args.top)
    result.update(
        impl=kind, size=run.size, params=sum(p.numel() for p in model.parameters()),
        tensors=len(list(model.parameters())),
        profiled_host_ms_per_step=profiled_wall / args.profile_steps * 1e3,
        syncs_per_opt_step=syncs, final_loss=final_loss,
        param_bytes=param_b, grad_bytes=grad_b, opt_state_bytes=state_b,
        transient_peak_bytes=transient, peak_bytes=peak,
        trace=trace_path and os.path.relpath(trace_path))
    eff = result["device_ms_per_step"]
    result["gpu_efficiency"] = None if eff is None else eff / result["profiled_host_ms_per_step"]
    del prof
    return result


def count_syncs(opt, model, kind, device):
    """CUDA: synchronizing calls inside one optimizer step (sync debug mode), as bench_train.
    Run after the profiled steps, on a batch of its own."""
    if device.type != "cuda":
        return None
    batch = synthetic_batches("titanmac", 1, seed=1, device=device)[0]
    opt.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    value = loss.item() if kind == "reference" else loss.detach()
    _sync(device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(value)
            _sync(device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in caught if "synchroniz" in str(w.message))


# ------------------------------------------------------------------------------ summaries

def _within(events, ranges):
    """Events whose start lies inside one of the (start, end) ranges (sorted)."""
    import bisect
    starts = [r[0] for r in ranges]
    out = []
    for e in events:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start <= ranges[i][1]:
            out.append(e)
    return out


def _kernel_name(name):
    """'void ns::adamw_kernel<4, float>(...)' -> 'ns::adamw_kernel' (readable in a table)."""
    name = re.sub(r"^void ", "", name)
    return re.sub(r"[<(].*", "", name) or name


def summarise(prof, device, steps, top):
    """Per-step figures from the profiled steps. Host-side figures come from the CPU events
    (device_type CPU); device time from the device events (kernels, memcpy, memset), never from
    the GPU copies of the user annotations."""
    from torch.autograd import DeviceType
    cuda = device.type == "cuda"
    events = prof.events()
    host_events = [e for e in events if e.device_type == DeviceType.CPU]
    opt_ranges = sorted((e.time_range.start, e.time_range.end) for e in host_events
                        if e.name == "train/optimizer")
    in_opt = _within(host_events, opt_ranges)

    def per_step(n):
        return n / steps

    parts = {}
    for e in host_events:
        if e.name in TRAIN_PARTS or e.name in OPT_PARTS:
            part = parts.setdefault(e.name, dict(host_ms=0.0, device_ms=0.0 if cuda else None,
                                                 calls=0.0))
            part["host_ms"] += e.cpu_time_total / 1e3 / steps
            if cuda:  # kernels launched inside the range (its own and its children's)
                part["device_ms"] += e.device_time_total / 1e3 / steps
            part["calls"] += per_step(1)
    averages = prof.key_averages()
    ops = [a for a in averages if not a.is_user_annotation and a.key.startswith("aten::")]
    by_host = sorted(ops, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    host_table = [dict(op=a.key, ms=a.self_cpu_time_total / 1e3 / steps, calls=per_step(a.count))
                  for a in by_host]
    device_table = None
    device_ms = None
    if cuda:
        kernels = {}
        for e in events:
            if e.device_type != DeviceType.CPU and not e.is_user_annotation \
                    and e.name not in TRAIN_PARTS and e.name not in OPT_PARTS:
                k = kernels.setdefault(_kernel_name(e.name), [0.0, 0])
                k[0] += e.time_range.elapsed_us()
                k[1] += 1
        device_ms = sum(v[0] for v in kernels.values()) / 1e3 / steps
        device_table = [dict(op=name, ms=v[0] / 1e3 / steps, calls=per_step(v[1]))
                        for name, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]

    def count(evts, pred):
        return per_step(sum(1 for e in evts if pred(e.name)))

    def is_aten(name):
        return name.startswith("aten::")

    launches = (count(host_events, lambda n: n in LAUNCH_NAMES) if cuda else None,
                count(in_opt, lambda n: n in LAUNCH_NAMES) if cuda else None)
    return dict(parts=parts, top_host=host_table, top_device=device_table,
                device_ms_per_step=device_ms,
                launches_per_step=launches[0], launches_per_opt_step=launches[1],
                scalar_reads_per_step=count(host_events, lambda n: n == SCALAR_READ),
                scalar_reads_per_opt_step=count(in_opt, lambda n: n == SCALAR_READ),
                aten_ops_per_step=count(host_events, is_aten),
                aten_ops_per_opt_step=count(in_opt, is_aten))


# ------------------------------------------------------------------------------ printing

def _f(value, fmt="{:.2f}"):
    return "-" if value is None else fmt.format(value)


def _mb(value):
    return "-" if value is None else f"{value / 2**20:.1f}"


def print_side_by_side(title, rows_a, rows_b, width=34, note=None):
    print(f"\n{title}")
    if note:
        print(f"  ({note})")
    head = f"{'#':>2} {'reference':<{width}} {'ms/step':>8} {'calls':>7} | " \
           f"{'titanmac_c':<{width}} {'ms/step':>8} {'calls':>7}"
    print(head)
    print("-" * len(head))
    for i in range(max(len(rows_a), len(rows_b))):
        cells = []
        for rows in (rows_a, rows_b):
            if i < len(rows):
                r = rows[i]
                cells.append(f"{r['op'][:width]:<{width}} {r['ms']:>8.3f} {r['calls']:>7.1f}")
            else:
                cells.append(" " * (width + 17))
        print(f"{i + 1:>2} {cells[0]} | {cells[1]}")


def print_report(size_result, device):
    ref, ours = (size_result["impls"][k] for k in IMPLS)
    cuda = device.type == "cuda"
    print(f"\n=== {size_result['size']}: {ref['params']:,} parameters in {ref['tensors']} tensors,"
          f" device {device} ===")

    rows = [("steps/s (unprofiled, as bench_train)", "steps_per_s", "{:.2f}"),
            ("optimizer ms/step (median, unprofiled)", "opt_ms", "{:.3f}"),
            ("host (wall) ms/step, profiled", "profiled_host_ms_per_step", "{:.2f}"),
            ("device ms/step (kernel time)", "device_ms_per_step", "{:.2f}"),
            ("GPU efficiency (device / host time)", "gpu_efficiency", "{:.1%}"),
            ("kernel launches / training step", "launches_per_step", "{:.0f}"),
            ("kernel launches / optimizer step", "launches_per_opt_step", "{:.0f}"),
            ("host syncs / optimizer step (sync debug)", "syncs_per_opt_step", "{}"),
            ("scalar reads / training step (note 1)", "scalar_reads_per_step", "{:.0f}"),
            ("scalar reads / optimizer step", "scalar_reads_per_opt_step", "{:.0f}"),
            ("ATen ops / training step", "aten_ops_per_step", "{:.0f}"),
            ("ATen ops / optimizer step", "aten_ops_per_opt_step", "{:.0f}"),
            ("final loss", "final_loss", "{:.5f}")]
    print(f"\n{'metric':<56} {'reference':>12} {'titanmac_c':>12} {'gain':>7}")
    print("-" * 90)
    for label, key, fmt in rows:
        a, b = ref.get(key), ours.get(key)
        gain = ""  # how many times better titanmac_c is (rates: ours / ref; the rest: ref / ours)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and b \
                and key not in ("final_loss", "gpu_efficiency"):
            gain = f"{(b / a if key == 'steps_per_s' else a / b):.1f}x"
        print(f"{label:<56} {_f(a, fmt):>12} {_f(b, fmt):>12} {gain:>7}")
    mem_rows = [("parameters (MiB)", "param_bytes"), ("gradients (MiB)", "grad_bytes"),
                ("optimizer state (MiB)", "opt_state_bytes"),
                ("peak allocated in the profiled steps, above start (MiB)",
                 "transient_peak_bytes"),
                ("peak memory (MiB)" + (" [params+grads+state + that peak]" if cuda else
                                        " [params + state + that peak]"), "peak_bytes")]
    for label, key in mem_rows:
        a, b = ref.get(key), ours.get(key)
        gain = f"{a / b:.1f}x" if a and b else ""
        print(f"{label:<56} {_mb(a):>12} {_mb(b):>12} {gain:>7}")
    print("note 1: .item() / .tolist() / bool(tensor) reads (aten::_local_scalar_dense). On CUDA a "
          "read of a device tensor is a host sync; on the CPU the count also holds torch AdamW's "
          "reads of its CPU step counters (not syncs on CUDA either). Syncs proper are counted "
          "on CUDA only (sync debug mode).")

    print(f"\nParts of a training step (inclusive time per step; {P.CLIP} is the reference's "
          "clip pass: titanmac_c folds the clip into controller + update)")
    head = f"{'part':<22} {'ref host ms':>11} {'ours host ms':>12} {'ref dev ms':>10} " \
           f"{'ours dev ms':>11} {'ref calls':>9} {'ours calls':>10}"
    print(head)
    print("-" * len(head))
    for name in TRAIN_PARTS + OPT_PARTS:
        a, b = ref["parts"].get(name), ours["parts"].get(name)
        if a is None and b is None:
            continue
        a, b = a or {}, b or {}
        label = ("  " + name) if name in OPT_PARTS else name
        print(f"{label:<22} {_f(a.get('host_ms'), '{:.3f}'):>11} "
              f"{_f(b.get('host_ms'), '{:.3f}'):>12} {_f(a.get('device_ms'), '{:.3f}'):>10} "
              f"{_f(b.get('device_ms'), '{:.3f}'):>11} {_f(a.get('calls'), '{:.1f}'):>9} "
              f"{_f(b.get('calls'), '{:.1f}'):>10}")

    if cuda:
        print_side_by_side("Top kernels by device time (per training step)",
                           ref["top_device"] or [], ours["top_device"] or [])
    else:
        print("\nTop operations by device time: - (CPU run: host figures only)")
    print_side_by_side("Top ATen operations by host time (self, per training step)",
                       ref["top_host"], ours["top_host"])


def main(argv=None):
    parser = make_parser("Profile training steps with the reference DeepNestedOptimizer and with "
                         "titanmac_c, and print the profiling tables side by side.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--sizes", default="titanmac",
                        help="comma list: titanmac (3.2M, bench_train's model), d<width>l<layers>")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (no profiler)")
    parser.add_argument("--profile-steps", type=int, default=10, help="steps under the profiler")
    parser.add_argument("--top", type=int, default=12, help="rows of the top-operation tables")
    parser.add_argument("--out", default=None,
                        help="JSON summary (default: benchmarks/out/profile_step_<device>.json); "
                             "Chrome traces go next to it")
    parser.add_argument("--compare", default=None,
                        help="a bench_train.py JSON to print next to the timings (default: "
                             "benchmarks/out/bench_train_<device>.json when it exists)")
    parser.add_argument("--no-trace", action="store_true", help="write no Chrome traces")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if min(args.steps, args.profile_steps) < 1 or args.warmup < 0:
        raise SystemExit("profile_step: --steps and --profile-steps must be >= 1, --warmup >= 0")
    device = torch.device(args.device)
    out = args.out or os.path.join(HERE, "out", f"profile_step_{device.type}.json")
    trace_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(trace_dir, exist_ok=True)
    n_batches = args.warmup + args.steps + args.profile_steps
    batches = synthetic_batches("titanmac", n_batches, seed=0, device=device)

    results = []
    for size in args.sizes.split(","):
        impls = run_size(size, device, args, batches, trace_dir)
        size_result = dict(size=size, impls=impls)
        results.append(size_result)
        print_report(size_result, device)

    compare = args.compare or os.path.join(HERE, "out", f"bench_train_{device.type}.json")
    if os.path.exists(compare) and "titanmac" in args.sizes.split(","):
        with open(compare) as f:
            bench = json.load(f)
        mine = next(r for r in results if r["size"] == "titanmac")["impls"]
        rows = {r["impl"]: r for r in bench["rows"]}
        if all(k in rows for k in IMPLS):
            print(f"\nbench_train.py, same model and options, another run "
                  f"({os.path.relpath(compare)}, {bench['meta'].get('date')}, "
                  f"{bench['meta'].get('steps')} steps; on a shared machine compare the ratios):")
            print(f"  {'':>10}  {'steps/s':>16}  {'optimizer ms/step':>20}")
            for k in IMPLS:
                print(f"  {k:>10}  {rows[k]['steps_per_s']:>7.2f} "
                      f"(here {mine[k]['steps_per_s']:5.2f})  {rows[k]['opt_ms']:>8.3f} "
                      f"(here {mine[k]['opt_ms']:7.3f})")
            b_opt = rows["reference"]["opt_ms"] / rows["titanmac_c"]["opt_ms"]
            h_opt = mine["reference"]["opt_ms"] / mine["titanmac_c"]["opt_ms"]
            b_tr = rows["titanmac_c"]["steps_per_s"] / rows["reference"]["steps_per_s"]
            h_tr = mine["titanmac_c"]["steps_per_s"] / mine["reference"]["steps_per_s"]
            print(f"  optimizer speed-up {b_opt:.1f}x (here {h_opt:.1f}x); training speed-up "
                  f"{b_tr:.2f}x (here {h_tr:.2f}x)")

    meta = dict(device=str(device), torch=torch.__version__, titanmac_c=titanmac_c.__version__,
                cpu_isa=titanmac_c.cpu_isa(), threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(), date=time.strftime("%Y-%m-%d"),
                warmup=args.warmup, steps=args.steps, profile_steps=args.profile_steps,
                options=OPT_KW, range_inactive_ns=P.inactive_cost_ns(50_000))
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, sizes=results), f, indent=1)
    traces = [r["impls"][k]["trace"] for r in results for k in IMPLS if r["impls"][k]["trace"]]
    print(f"\n[profile_step] summary -> {os.path.relpath(out)}"
          + (f"; Chrome traces (chrome://tracing, ui.perfetto.dev): {', '.join(traces)}"
             if traces else ""))
    return dict(meta=meta, sizes=results)


if __name__ == "__main__":
    main()
