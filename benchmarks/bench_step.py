"""Optimizer-step benchmark: titanmac_c against torch, as ratios measured in one run.

For each shape set it times
  - AdamW step: titanmac_c.AdamW vs torch.optim.AdamW for-loop (CPU only), foreach and fused;
  - clip + AdamW: titanmac_c (AdamW.clip_grad_norm_ + step: the coefficient is folded into the
    update) vs torch.nn.utils.clip_grad_norm_ (foreach) + fused AdamW;
  - amp + AdamW: scaler.step(opt) + scaler.update() of a torch.amp.GradScaler (scale 1, so the
    gradients keep their values from step to step): titanmac_c and torch's AdamW with
    fused=True take the scale and inf flag in the update (no host read), foreach AdamW takes
    GradScaler's ordinary path (unscale_, then a host read of the inf flag);
  - stats + clip + AdamW (CUDA): per-group gradient and parameter norms, global clip, AdamW, as
    the DeepNestedOptimizer needs them: titanmac_c (group_norms + clip + step, three calls) vs
    torch's best composition (_foreach_norm statistics + clip_grad_norm_(foreach=True) + fused
    AdamW);
and reports for every variant two times apart, as medians over round-robin repetitions:

  device time  the step's work on the device. On CUDA the kernels' own time: two CUDA events
               around the step, with a spin kernel (torch.cuda._sleep) queued ahead of the start
               event, long enough to outlast the step's host work, so that the GPU is busy when
               the start event is recorded and the events bracket the GPU's work alone. (A start
               event recorded on an idle GPU completes at once: the host work before the step's
               first kernel, DLPack intake and checks, would count as device time.) A step that
               waits on the GPU (a host sync) cannot be covered so; it is flagged. On the CPU,
               the wall time of the step.
  host time    CUDA: the time to enqueue one step after a synchronize (no wait for the GPU). On
               the CPU, the wall time of the step, as the device time (the CPU runs it itself).

and from the device time the ratio to torch's fused AdamW and the effective bandwidth against the
bytes each step must move (fp32 AdamW 28 B/element, clip + AdamW 32, stats + clip + AdamW 36, amp
+ AdamW 40: GradScaler's inf check reads and writes the gradients, the update stores them; twice
that with --dtype float64) as a fraction of a device copy (8 B/element, 16 in float64) timed the
same way in the same run. On CUDA also, from one step under torch.profiler, the kernel launches
and the summed durations of the step's GPU activities (a cross-check of the device time).

The JSON (--out) holds meta (device, dtype, torch, date, command, timing: how the device time was
taken) and one row per variant: shape, params, tensors, dtype, op, impl; device_ms and
device_p90_ms (median and 90th percentile device time), device_covered (false: a spin did not
outlast the step's host work, so device_ms includes host time), spin_us (the spin queued ahead);
host_us (median host time); ratio_vs_torch_fused and host_ratio_vs_torch_fused (this variant's
median over torch fused's for the same op: device, host); gbs and frac_of_copy (bandwidth from the
device time, and over copy_gbs, the copy's); launches and profiled_device_us (CUDA; null on the
CPU). Files of earlier versions carry median_ms and p90_ms (CUDA events around the step on an idle
GPU, host work before the first kernel included) in place of device_ms and device_p90_ms, and no
timing, spin_us, device_covered, host_ratio_vs_torch_fused or profiled_device_us.

Shape sets: CPU 1M / 10M / 50M parameters in 50 / 200 / 500 tensors; CUDA the TitanMAC config
(3.2M in 48 tensors), GPT-2 small (124M in 148 tensors), a 1B model (16 layers of width 2048) and
1000t (10M in 1,000 tensors, for the host time per tensor); 100k (in 20 tensors) to try the
script in seconds.

Usage: python benchmarks/bench_step.py [--device cpu|cuda] [--sizes ...] [--reps N]
                                       [--dtype float32|float64]
                                       [--out benchmarks/out/bench_step_cpu.json]
"""

import json
import math
import os
import platform
import statistics
import sys
import time

import torch

import titanmac_c

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

SHAPES = {"1M": (1_000_000, 50), "10M": (10_000_000, 200), "50M": (50_000_000, 500),
          "1000t": (10_000_000, 1000),  # many tensors: the host time of a 1,000-tensor step
          "100k": (100_000, 20)}  # a run of seconds, to try the script


def _transformer_sizes(vocab, ctx, width, layers, ffn, biases=True):
    """Tensor sizes of a GPT-style model: embeddings, per layer 2 norms, qkv, proj, 2 mlp."""
    sizes = [vocab * width, ctx * width]
    for _ in range(layers):
        sizes += [width, width] if biases else [width]
        sizes += [width * 3 * width] + ([3 * width] if biases else [])
        sizes += [width * width] + ([width] if biases else [])
        sizes += [width, width] if biases else [width]
        sizes += [width * ffn] + ([ffn] if biases else [])
        sizes += [ffn * width] + ([width] if biases else [])
    return sizes + ([width, width] if biases else [width])


def named_sizes(name):
    """(sizes, group_of) of a named shape set: matrices in group 0, the rest in group 1."""
    if name in SHAPES:
        sizes = tensor_sizes(*SHAPES[name])
    elif name == "titanmac":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "tests"))
        from dno_models import make_titanmac_like_model
        sizes = [p.numel() for p in make_titanmac_like_model(seed=0).parameters()]
    elif name == "gpt2":
        sizes = _transformer_sizes(50257, 1024, 768, 12, 3072)
    elif name == "1b":
        sizes = _transformer_sizes(32000, 2048, 2048, 16, 8192, biases=False)
    else:
        raise SystemExit(f"unknown shape set {name!r}")
    return sizes


def tensor_sizes(total, count, seed=0):
    """count sizes summing to total, spread like a model's (a few big, many small)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=gen) ** 3 + 0.01
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    sizes[0] += total - int(sizes.sum())
    return [int(s) for s in sizes]


class Timer:
    """Device seconds of one call of fn: see the module docstring. On CUDA, spin_s seconds of
    spin are queued ahead of the start event; the call is covered when the start event is still
    pending (the spin still running) as fn returns to the host, so that no host work of fn lies
    between the two events. Returns (seconds, covered)."""

    def __init__(self, device):
        self.device = device
        self.cycles_per_s = spin_rate() if device.type == "cuda" else None

    def __call__(self, fn, spin_s=0.0):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(max(1, int(spin_s * self.cycles_per_s)))
            start.record()
            fn()
            covered = not start.query()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, covered
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, True


def spin_rate():
    """Cycles per second of torch.cuda._sleep's spin on the current GPU (the one the benchmark
    runs on): two spins timed with events, their difference free of the launch's own cost."""
    def spin_seconds(cycles):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    spin_seconds(1_000_000)  # loads the kernel
    short = statistics.median(spin_seconds(2_000_000) for _ in range(3))
    long = statistics.median(spin_seconds(12_000_000) for _ in range(3))
    return 10_000_000 / max(long - short, 1e-6)


def first_spin(device, host_s):
    """Seconds of spin to queue ahead of a step whose enqueue takes host_s: twice that and
    50 us (none on the CPU)."""
    return 2 * host_s + 50e-6 if device.type == "cuda" else 0.0


def device_seconds(timer, fn, spin, retry=True):
    """(seconds, covered, spin) of one call after `spin` seconds of spin; with retry, while the
    spin does not cover the call (a slower host this time), again with one twice as long, up to
    three times. A step that waits on the GPU is never covered: the last try counts."""
    tries = 4 if retry else 1
    for i in range(tries):
        seconds, covered = timer(fn, spin)
        if covered or i == tries - 1:
            return seconds, covered, spin
        spin *= 2


def make_params(sizes, device, dtype):
    params = [torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype) * 0.1)
              for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 0.01
    return params


def make_case(params, kind):
    """An optimizer of the given kind over params (see shared_params for when variants share)."""
    big = [p for p in params if p.numel() >= 4096]
    small = [p for p in params if p.numel() < 4096]
    groups = [{"params": big}, {"params": small}] if small and big else [{"params": params}]
    if kind == "titanmac_c":  # fused=True: GradScaler hands it the scale (the amp op)
        opt = titanmac_c.AdamW(groups, lr=1e-3, weight_decay=0.01, fused=True)
    else:
        flags = {"torch_forloop": dict(foreach=False), "torch_foreach": dict(foreach=True),
                 "torch_fused": dict(fused=True)}[kind]
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, **flags)
    return params, opt


def torch_group_stats(opt):
    """The reference's statistics: per group, _foreach_norm of grads and params, combined."""
    rows = []
    for group in opt.param_groups:
        grads = [p.grad for p in group["params"]]
        gn = torch.stack(list(torch._foreach_norm(grads))).pow(2).sum().sqrt()
        pn = torch.stack(list(torch._foreach_norm(group["params"]))).pow(2).sum().sqrt()
        rows.append(torch.stack([gn, pn]))
    return torch.stack(rows)


def step_fn(kind, params, opt, what):
    if what == "adamw":
        return opt.step
    if what == "amp+adamw":
        scaler = torch.amp.GradScaler(params[0].device.type, init_scale=1.0,
                                      growth_interval=2 ** 30)
        scaler.scale(torch.ones((), device=params[0].device))  # creates the scale

        def run():
            scaler.step(opt)
            scaler.update()
        return run
    if kind == "titanmac_c":
        group_of = [gi for gi, g in enumerate(opt.param_groups) for _ in g["params"]]
        ordered = [p for g in opt.param_groups for p in g["params"]]

        def run():
            total = None
            if what == "stats+clip+adamw":
                stats = titanmac_c.group_norms([p.grad for p in ordered],
                                               [p.detach() for p in ordered], group_of,
                                               len(opt.param_groups))
                total = stats.total_grad
            opt.clip_grad_norm_(1.0, total_norm=total)
            opt.step()
    else:
        foreach = True if params[0].device.type == "cuda" else None

        def run():
            if what == "stats+clip+adamw":
                torch_group_stats(opt)
            # torch's own pick on the CPU (what the recorded CPU table used); foreach on CUDA
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
            opt.step()
    return run


def copy_bandwidth(numel, device, timer, reps, dtype):
    """GB/s of a device copy of numel elements, its device time taken as a step's."""
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
    copy()
    spin = first_spin(device, enqueue_seconds(copy, device, reps) if device.type == "cuda" else 0)
    times = [device_seconds(timer, copy, spin)[0] for _ in range(reps)]
    return 2 * src.element_size() * numel / statistics.median(times) / 1e9


# in float32; scaled by the element size for other dtypes
BYTES_PER_ELEMENT = {"adamw": 28, "clip+adamw": 32, "stats+clip+adamw": 36, "amp+adamw": 40}


def variants_for(device):
    if device.type == "cuda":
        return ([("adamw", k) for k in ("titanmac_c", "torch_fused", "torch_foreach")]
                + [(w, k) for w in ("clip+adamw", "stats+clip+adamw")
                   for k in ("titanmac_c", "torch_fused")]
                + [("amp+adamw", k) for k in ("titanmac_c", "torch_fused", "torch_foreach")])
    return ([("adamw", k) for k in ("titanmac_c", "torch_fused", "torch_foreach",
                                    "torch_forloop")]
            + [("clip+adamw", k) for k in ("titanmac_c", "torch_fused")]
            + [("amp+adamw", k) for k in ("titanmac_c", "torch_fused", "torch_foreach")])


def enqueue_seconds(fn, device, reps):
    """Median host time of fn() over reps calls, each started from an idle device and not
    waiting for it (on CUDA, the time to enqueue the work)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_time_and_launches(fn, device, reps=21):
    """CUDA: seconds to enqueue one step (median of reps), and from one step under
    torch.profiler the kernel launches in it and the summed microseconds of its GPU activities
    (kernels, copies, memsets). CPU: (None, None, None)."""
    if device.type != "cuda":
        return None, None, None
    host = enqueue_seconds(fn, device, reps)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    launches = sum(1 for e in events if e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    gpu_us = sum(e.time_range.elapsed_us() for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    return host, launches, gpu_us


def shared_params(total, n_variants, device, dtype):
    """Whether the variants of a shape set share one set of params and grads (each keeps its own
    state): only where separate ones would not fit in half the GPU's free memory (a 1B model
    seven times over does not fit in 80 GB). Otherwise each variant gets its own, so that none
    finds the arrays another just stepped in a cache."""
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    # params + grads + exp_avg + exp_avg_sq
    return 4 * dtype.itemsize * total * n_variants > free // 2


def bench_shape(name, device, reps, timer, dtype):
    sizes = named_sizes(name)
    total, count = sum(sizes), len(sizes)
    cases = {}
    variants = variants_for(device)
    shared = (make_params(sizes, device, dtype)
              if shared_params(total, len(variants), device, dtype) else None)
    for what, kind in variants:
        params, opt = make_case(shared or make_params(sizes, device, dtype), kind)
        fn = step_fn(kind, params, opt, what)
        fn()  # warm-up: creates state
        cases[(what, kind)] = fn
    # the host times first: each sizes the spin queued ahead of its step's device timing
    extra = {key: host_time_and_launches(fn, device) for key, fn in cases.items()}
    samples = {key: [] for key in cases}
    spins = {key: first_spin(device, extra[key][0] or 0.0) for key in cases}
    waits = set()  # steps that wait on the GPU: no spin covers them, so none is retried
    for _ in range(reps):  # round-robin so drifts of a shared machine hit every variant alike
        for key, fn in cases.items():
            sample = device_seconds(timer, fn, spins[key], retry=key not in waits)
            if sample[1]:
                spins[key] = sample[2]
            else:
                waits.add(key)
            samples[key].append(sample)
    copy_gbs = copy_bandwidth(total, device, timer, reps, dtype)
    cpu = device.type != "cuda"
    med = {key: statistics.median(s for s, _, _ in ss) for key, ss in samples.items()}
    # on the CPU the host time is the step's wall time, the device time's samples
    host = {key: med[key] if cpu else extra[key][0] for key in cases}
    rows = []
    for (what, kind), ss in samples.items():
        ts = sorted(s for s, _, _ in ss)
        dev, base = med[(what, kind)], med[(what, "torch_fused")]
        gbs = BYTES_PER_ELEMENT[what] * dtype.itemsize // 4 * total / dev / 1e9
        _, launches, gpu_us = extra[(what, kind)]
        rows.append(dict(shape=name, params=total, tensors=count, dtype=str(dtype), op=what,
                         impl=kind, device_ms=dev * 1e3,
                         device_p90_ms=ts[math.ceil(0.9 * len(ts)) - 1] * 1e3,  # nearest rank
                         device_covered=all(c for _, c, _ in ss),
                         spin_us=max(sp for _, _, sp in ss) * 1e6,
                         host_us=host[(what, kind)] * 1e6,
                         ratio_vs_torch_fused=dev / base,
                         host_ratio_vs_torch_fused=host[(what, kind)] / host[(what, "torch_fused")],
                         gbs=gbs, frac_of_copy=gbs / copy_gbs, copy_gbs=copy_gbs,
                         launches=launches, profiled_device_us=gpu_us))
    del cases, shared
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_table(rows, device):
    head = (f"{'shape':>8} {'tensors':>7} {'op':>16} {'impl':>14} {'device ms':>10} "
            f"{'vs torch':>8} {'host us':>9} {'vs torch':>8} {'GB/s':>7} {'of copy':>7} "
            f"{'prof. us':>9} {'launches':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        gpu = "-" if r["profiled_device_us"] is None else f"{r['profiled_device_us']:.0f}"
        launches = "-" if r["launches"] is None else str(r["launches"])
        flag = " " if r["device_covered"] else "*"
        print(f"{r['shape']:>8} {r['tensors']:>7} {r['op']:>16} {r['impl']:>14} "
              f"{r['device_ms']:>9.3f}{flag} {r['ratio_vs_torch_fused']:>8.2f} "
              f"{r['host_us']:>9.0f} {r['host_ratio_vs_torch_fused']:>8.2f} {r['gbs']:>7.1f} "
              f"{r['frac_of_copy']:>7.2f} {gpu:>9} {launches:>8}")
    copies = {r["shape"]: r["copy_gbs"] for r in rows}
    listed = ", ".join(f"{shape}: {gbs:.1f} GB/s" for shape, gbs in copies.items())
    print(f"copy bandwidth measured in the same run: {listed}")
    print(timing_note(device))
    if not all(r["device_covered"] for r in rows):
        print("*: the spin did not outlast the step's host work (a step that waits on the GPU): "
              "its device time includes host time")


def timing_note(device):
    if device.type == "cuda":
        return ("device ms: CUDA events around the step with a spin kernel queued ahead of the "
                "start event, outlasting the step's host work, so they bracket its kernels alone; "
                "GB/s and the ratios from it. host us: one enqueue after a synchronize. "
                "prof. us: the step's GPU activities summed, one profiled step.")
    return ("device ms: on the CPU the wall time of the step, as is host us (the CPU runs the "
            "step itself); GB/s and the ratios from it.")


def main(argv=None):
    from _cli import make_parser
    parser = make_parser("Optimizer-step benchmark: titanmac_c against torch (AdamW, clip + AdamW, "
                         "amp + AdamW), as ratios measured in one run.")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--sizes", default=None,
                        help="shape sets, comma-separated (default: 1M,10M,50M on the CPU, "
                             "titanmac,gpt2,1b,1000t on CUDA)")
    parser.add_argument("--reps", type=int, default=7,
                        help="timed repetitions per variant (median reported)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="dtype of parameters, gradients and state")
    parser.add_argument("--out", default=None,
                        help="JSON results (default: benchmarks/out/bench_step_<device>.json, "
                             "bench_step_<device>_float64.json with --dtype float64)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    suffix = "" if dtype == torch.float32 else f"_{args.dtype}"
    args.out = args.out or os.path.join(OUT_DIR, f"bench_step_{device.type}{suffix}.json")
    timer = Timer(device)
    rows = []
    sizes = args.sizes or ("titanmac,gpt2,1b,1000t" if device.type == "cuda" else "1M,10M,50M")
    for name in sizes.split(","):
        print(f"[bench_step] {name} ...", file=sys.stderr, flush=True)
        rows.extend(bench_shape(name, device, args.reps, timer, dtype))
    print_table(rows, device)
    meta = dict(device=str(device), dtype=args.dtype, torch=torch.__version__,
                timing=timing_note(device),
                titanmac_c=titanmac_c.__version__,
                cpu_isa=titanmac_c.cpu_isa(), threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(),
                date=time.strftime("%Y-%m-%d"),
                command=" ".join(["python benchmarks/bench_step.py"] + list(
                    sys.argv[1:] if argv is None else argv)))
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"[bench_step] {meta} -> {args.out}")


if __name__ == "__main__":
    main()
