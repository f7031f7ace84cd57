"""Train the TitanMAC-like model (3.2M parameters in 48 tensors) with the pure-PyTorch reference
DeepNestedOptimizer (titanmac_c.testing.reference_dno: a faithful stand-in for the upstream
optimizer, host syncs included) and with titanmac_c.DeepNestedOptimizer, and report per
implementation: steps per second, optimizer time per step (median, and mean: in CMS mode every
5th step also trains the momentum MLP (Phase 1: torch autograd in the reference; in ours the C
core on the CPU, its algorithm in torch ops on CUDA), which the median leaves out), and on CUDA
kernel launches and host syncs inside one optimizer step, plus the loss after the run (the two
must agree).

Peak memory: on CUDA torch.cuda.max_memory_allocated; on the CPU the peak resident set size of
a subprocess that trains only one implementation (so neither counts the other's tensors), next
to the bytes the optimizer keeps as state.

Usage: python benchmarks/bench_train.py [--device cpu|cuda] [--mode adamw|cms] [--steps 60]
                                        [--net direct|legacy] (CMS mode's momentum network)
                                        [--warmup 5] [--out benchmarks/out/bench_train_cpu.json]
"""

import argparse
import json
import os
import resource
import subprocess
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "out")
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from dno_models import loss_fn, make_titanmac_like_model, synthetic_batches  # noqa: E402

import titanmac_c  # noqa: E402
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer  # noqa: E402

OPT_KW = dict(base_lr=3e-4, weight_decay=0.01, max_grad_norm=1.0, mode="simple",
              meta_update_freq=100, controller_update_freq=1)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_bytes(opt):
    """Bytes of memory held by tensors the optimizer keeps between steps (AdamW state and CMS
    buffers), each storage counted once: in titanmac_c's optimizer.state a CMS buffer it does not
    keep reads as zeros of one element of storage."""
    tensors = [t for st in opt.base_optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor)]
    for st in opt.state.values():  # CMS mode: a ContinuumMemoryState or our view of one
        tensors += [getattr(lvl, k) for lvl in st.levels
                    for k in ("momentum", "accumulated_grad", "ema_grad", "v_sq")]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def train(kind, device, steps, warmup, batches, mode="adamw", net="direct"):
    torch.manual_seed(0)
    model = make_titanmac_like_model(seed=0).to(device)
    cls = ReferenceDeepNestedOptimizer if kind == "reference" else titanmac_c.DeepNestedOptimizer
    graph = dict(use_cuda_graph=True) if kind == "titanmac_c_graph" else {}
    opt = cls(model, use_cms_updates=(mode == "cms"), use_preprocessing=(net == "direct"),
              **OPT_KW, **graph)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
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
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return dict(impl=kind, mode=mode, steps_per_s=steps / wall,
                opt_ms=statistics.median(opt_times) * 1e3,
                opt_mean_ms=statistics.fmean(opt_times) * 1e3, final_loss=float(losses[-1]),
                state_mb=state_bytes(opt) / 2**20, peak_mb=peak / 2**20, model=model, opt=opt)


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


# titanmac_c_graph: use_cuda_graph=True, the whole step replayed as one CUDA graph (CUDA only).
IMPLS = ("reference", "titanmac_c", "titanmac_c_graph")


def main(argv=None):
    sys.path.insert(0, HERE)
    from _cli import make_parser
    parser = make_parser("Train the TitanMAC-like model with the reference DeepNestedOptimizer and "
                         "with titanmac_c's: steps/s, optimizer time, launches, syncs, memory.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--mode", choices=("adamw", "cms"), default="adamw",
                        help="the DeepNestedOptimizer's mode")
    parser.add_argument("--net", choices=("direct", "legacy"), default="direct",
                        help="CMS mode's momentum network: DirectUpdateMLP (use_preprocessing="
                             "True) or the legacy L2RegressionMomentum")
    parser.add_argument("--only", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=60, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--out", default=None,
                        help="JSON results (default: benchmarks/out/bench_train[_cms|_legacy]_"
                             "<device>.json, the name profile_step.py --compare looks for)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.out is None:
        kind = "" if args.mode == "adamw" else ("_cms" if args.net == "direct" else "_legacy")
        args.out = os.path.join(OUT_DIR, f"bench_train{kind}_{device.type}.json")
    batches = synthetic_batches("titanmac", args.warmup + args.steps + 1, seed=0, device=device)
    if args.only:  # a child process: one implementation, its row as JSON on the last line
        run = train(args.only, device, args.steps, args.warmup, batches, args.mode, args.net)
        run["launches"], run["syncs"] = launches_and_syncs(run, device, batches[-1])
        print(json.dumps({k: v for k, v in run.items() if k not in ("model", "opt")}))
        return
    rows = []
    label = f"{args.mode} mode" + (f" ({args.net} network)" if args.mode == "cms" else "")
    for kind in IMPLS if device.type == "cuda" else IMPLS[:2]:
        print(f"[bench_train] {kind}, {label}, on {device} ...", file=sys.stderr, flush=True)
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--only", kind, "--device", args.device,
             "--mode", args.mode, "--net", args.net, "--steps", str(args.steps),
             "--warmup", str(args.warmup)],
            capture_output=True, text=True, check=True)
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    ref = rows[0]
    print(f"{'impl':>16} {'steps/s':>8} {'opt ms/step':>12} {'mean ms':>8} {'launches':>9} "
          f"{'syncs':>6} {'state MB':>9} {'peak MB':>8} {'final loss':>11}")
    for r in rows:
        print(f"{r['impl']:>16} {r['steps_per_s']:>8.2f} {r['opt_ms']:>12.3f} "
              f"{r['opt_mean_ms']:>8.3f} {str(r['launches']):>9} {str(r['syncs']):>6} "
              f"{r['state_mb']:>9.1f} {r['peak_mb']:>8.1f} {r['final_loss']:>11.5f}")
    for ours in rows[1:]:
        print(f"{ours['impl']}: optimizer step speed-up {ref['opt_ms'] / ours['opt_ms']:.1f}x "
              f"(median), {ref['opt_mean_ms'] / ours['opt_mean_ms']:.1f}x (mean); "
              f"training speed-up {ours['steps_per_s'] / ref['steps_per_s']:.2f}x")
    meta = dict(device=str(device), torch=torch.__version__, titanmac_c=titanmac_c.__version__,
                threads=torch.get_num_threads(), steps=args.steps, mode=args.mode, net=args.net,
                options=OPT_KW,
                date=time.strftime("%Y-%m-%d"),
                command=" ".join(["python benchmarks/bench_train.py"] + list(
                    sys.argv[1:] if argv is None else argv)))
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
