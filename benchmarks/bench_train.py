"""Train the TitanMAC-like model (3.2M parameters in 48 tensors) with the pure-PyTorch reference
DeepNestedOptimizer (titanmac_c._reference_dno: a faithful stand-in for the upstream optimizer,
host syncs included) and with titanmac_c.DeepNestedOptimizer, and report per implementation:
steps per second, optimizer time per step (median), and on CUDA kernel launches and host syncs
inside one optimizer step, plus the loss after the run (the two must agree).

Usage: python benchmarks/bench_train.py [--device cpu|cuda] [--steps 60] [--warmup 5]
                                        [--out benchmarks/out/bench_train.json]
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dno_models import loss_fn, make_titanmac_like_model, synthetic_batches  # noqa: E402

import titanmac_c  # noqa: E402
from titanmac_c._reference_dno import ReferenceDeepNestedOptimizer  # noqa: E402

OPT_KW = dict(base_lr=3e-4, weight_decay=0.01, max_grad_norm=1.0, mode="simple",
              meta_update_freq=100, controller_update_freq=1)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(kind, device, steps, warmup, batches):
    torch.manual_seed(0)
    model = make_titanmac_like_model(seed=0).to(device)
    cls = ReferenceDeepNestedOptimizer if kind == "reference" else titanmac_c.DeepNestedOptimizer
    opt = cls(model, **OPT_KW)
    opt_times, losses = [], []
    _sync(device)
    start = None
    for i, batch in enumerate(batches[: warmup + steps]):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        _sync(device)
        t0 = time.perf_counter()
        # The reference needs a Python float; titanmac_c takes the tensor (no .item()).
        opt.step(loss.item() if kind == "reference" else loss.detach())
        _sync(device)
        if i >= warmup:
            opt_times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    _sync(device)
    wall = time.perf_counter() - start
    return dict(impl=kind, steps_per_s=steps / wall, opt_ms=statistics.median(opt_times) * 1e3,
                final_loss=float(losses[-1]), model=model, opt=opt)


def launches_and_syncs(run, device, batch):
    """Kernel launches (torch.profiler) and synchronizing calls (sync debug mode warnings) inside
    one optimizer step, after training."""
    if device.type != "cuda":
        return None, None
    model, opt = run["model"], run["opt"]
    opt.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    value = loss.item() if run["impl"] == "reference" else loss.detach()
    _sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, \
                torch.profiler.profile(activities=acts) as prof:
            warnings.simplefilter("always")
            opt.step(value)
            _sync(device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    launches = sum(1 for e in prof.events()
                   if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                 "cudaGraphLaunch"))
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
    return launches, syncs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("benchmarks", "out", "bench_train.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches = synthetic_batches("titanmac", args.warmup + args.steps + 1, seed=0, device=device)
    rows = []
    for kind in ("reference", "titanmac_c"):
        print(f"[bench_train] {kind} on {device} ...", file=sys.stderr, flush=True)
        run = train(kind, device, args.steps, args.warmup, batches)
        run["launches"], run["syncs"] = launches_and_syncs(run, device, batches[-1])
        rows.append({k: v for k, v in run.items() if k not in ("model", "opt")})
    ref, ours = rows
    print(f"{'impl':>11} {'steps/s':>8} {'opt ms/step':>12} {'launches':>9} {'syncs':>6} "
          f"{'final loss':>11}")
    for r in rows:
        print(f"{r['impl']:>11} {r['steps_per_s']:>8.2f} {r['opt_ms']:>12.3f} "
              f"{str(r['launches']):>9} {str(r['syncs']):>6} {r['final_loss']:>11.5f}")
    print(f"optimizer step speed-up: {ref['opt_ms'] / ours['opt_ms']:.1f}x; "
          f"training speed-up: {ours['steps_per_s'] / ref['steps_per_s']:.2f}x")
    meta = dict(device=str(device), torch=torch.__version__, titanmac_c=titanmac_c.__version__,
                threads=torch.get_num_threads(), steps=args.steps, options=OPT_KW,
                date=time.strftime("%Y-%m-%d"))
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
