"""Optimizer-step benchmark: titanmac_c against torch, as ratios measured in one run.

For each shape set (total parameters in a number of tensors) it times
  - AdamW step: titanmac_c.AdamW vs torch.optim.AdamW for-loop, foreach and fused;
  - clip + AdamW: titanmac_c (AdamW.clip_grad_norm_ + step: the coefficient is folded into the
    update) vs torch.nn.utils.clip_grad_norm_ + fused AdamW;
and reports the median time, the ratio to torch fused, and the effective bandwidth against the
bytes each step must move (fp32 AdamW 28 B/element, clip + AdamW 32 B/element) as a fraction of
a device copy (8 B/element) measured in the same run.

Usage: python benchmarks/bench_step.py [--device cpu|cuda] [--sizes 1M,10M,50M] [--reps 7]
                                       [--out benchmarks/out/bench_step.json]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import titanmac_c

SHAPES = {"1M": (1_000_000, 50), "10M": (10_000_000, 200), "50M": (50_000_000, 500)}


def tensor_sizes(total, count, seed=0):
    """count sizes summing to total, spread like a model's (a few big, many small)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=gen) ** 3 + 0.01
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    sizes[0] += total - int(sizes.sum())
    return [int(s) for s in sizes]


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def make_case(sizes, device, kind):
    params = [torch.nn.Parameter(torch.randn(n, device=device) * 0.1) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 0.01
    if kind == "titanmac_c":
        opt = titanmac_c.AdamW(params, lr=1e-3, weight_decay=0.01)
    else:
        flags = {"torch_forloop": dict(foreach=False), "torch_foreach": dict(foreach=True),
                 "torch_fused": dict(fused=True)}[kind]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
    return params, opt


def step_fn(kind, params, opt, clip):
    if not clip:
        return opt.step
    if kind == "titanmac_c":
        def run():
            opt.clip_grad_norm_(1.0)
            opt.step()
    else:
        def run():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
    return run


def copy_bandwidth(numel, device, timer, reps):
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(reps + 1)][1:]
    return 8 * numel / statistics.median(times) / 1e9


def bench_shape(name, device, reps, timer):
    total, count = SHAPES[name]
    sizes = tensor_sizes(total, count)
    variants = [("adamw", k) for k in ("titanmac_c", "torch_fused", "torch_foreach",
                                       "torch_forloop")]
    variants += [("clip+adamw", k) for k in ("titanmac_c", "torch_fused")]
    cases = {}
    for what, kind in variants:
        params, opt = make_case(sizes, device, kind)
        fn = step_fn(kind, params, opt, what == "clip+adamw")
        fn()  # warm-up: creates state
        cases[(what, kind)] = fn
    times = {key: [] for key in cases}
    for _ in range(reps):  # round-robin so drifts of a shared machine hit every variant alike
        for key, fn in cases.items():
            times[key].append(timer(fn))
    copy_gbs = copy_bandwidth(total, device, timer, reps)
    rows = []
    for (what, kind), ts in times.items():
        med = statistics.median(ts)
        base = statistics.median(times[(what, "torch_fused")])
        bytes_per = 28 if what == "adamw" else 32
        gbs = bytes_per * total / med / 1e9
        rows.append(dict(shape=name, tensors=count, op=what, impl=kind, median_ms=med * 1e3,
                         p90_ms=sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3,
                         ratio_vs_torch_fused=med / base, gbs=gbs,
                         frac_of_copy=gbs / copy_gbs, copy_gbs=copy_gbs))
    del cases
    return rows


def print_table(rows):
    head = (f"{'shape':>5} {'tensors':>7} {'op':>10} {'impl':>14} {'median ms':>10} "
            f"{'vs fused':>8} {'GB/s':>7} {'of copy':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['shape']:>5} {r['tensors']:>7} {r['op']:>10} {r['impl']:>14} "
              f"{r['median_ms']:>10.2f} {r['ratio_vs_torch_fused']:>8.2f} {r['gbs']:>7.1f} "
              f"{r['frac_of_copy']:>7.2f}")
    copies = {r["shape"]: r["copy_gbs"] for r in rows}
    listed = ", ".join(f"{shape}: {gbs:.1f} GB/s" for shape, gbs in copies.items())
    print(f"copy bandwidth (8 B/element) measured in the same run: {listed}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="1M,10M,50M")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=os.path.join("benchmarks", "out", "bench_step.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    timer = Timer(device)
    rows = []
    for name in args.sizes.split(","):
        print(f"[bench_step] {name} ...", file=sys.stderr, flush=True)
        rows.extend(bench_shape(name, device, args.reps, timer))
    print_table(rows)
    meta = dict(device=str(device), torch=torch.__version__, titanmac_c=titanmac_c.__version__,
                cpu_isa=titanmac_c.cpu_isa(), threads=torch.get_num_threads(),
                machine=platform.processor() or platform.machine(),
                date=time.strftime("%Y-%m-%d"))
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"[bench_step] {meta} -> {args.out}")


if __name__ == "__main__":
    main()
