"""Phase 1 of the CMS step alone (the DirectUpdateMLP's surrogate training, every 5th step: spec
deep_nested_optimizer.md 7.2) on the TitanMAC-like model (bench_train.py's: 3.2M parameters in 48
tensors; Phase 1 trains on the first 20 of the optimizer's groups, 3,218,432 elements), per
implementation:

  reference   the pure-PyTorch reference's _train_mlp_surrogate (autograd of the loss, one
              backward of the mean, host reads of the norms' branches)
  c_op        ours with the C core's op (tm_cms_surrogate; the CPU's path, CPU only)
  torch_ops   ours with its algorithm in torch ops (titanmac_c/deep_nested/surrogate.py; CUDA's
              path, measured on the CPU too)

and prints the ATen ops one Phase 1 dispatches (the host cost on CUDA, where each is a launch or
a few us of host time), its time (median of --reps calls, synchronized), and on CUDA the peak
memory it allocates above what was allocated before it. Every Phase 1 includes the MLP's clip
and Adam step. The state comes from --steps training steps of each optimizer (momenta and the
previous outputs are real), B1's zero targets (the reference's default) or, with --fixed,
fix_reference_bugs (the clipped gradient as the target: the normed path).

Usage: python benchmarks/bench_phase1.py [--device cpu|cuda] [--reps 10] [--steps 5] [--fixed]
"""

import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dno_models import loss_fn, make_titanmac_like_model, synthetic_batches  # noqa: E402

import titanmac_c  # noqa: E402
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer  # noqa: E402
from bench_train import OPT_KW  # noqa: E402
from _cli import make_parser  # noqa: E402


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(kind, device, steps, fixed):
    model = make_titanmac_like_model(seed=0).to(device)
    cls = ReferenceDeepNestedOptimizer if kind == "reference" else titanmac_c.DeepNestedOptimizer
    kw = dict(fix_reference_bugs=True) if fixed and kind != "reference" else {}
    opt = cls(model, use_cms_updates=True, **OPT_KW, **kw)
    if kind != "reference":
        opt._cms_mode.phase1_cpu_path = kind == "c_op"
    for batch in synthetic_batches("titanmac", steps, seed=0, device=device):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(loss.item() if kind == "reference" else loss.detach())
    if kind == "reference":
        return opt._train_mlp_surrogate
    t = opt.mlp_train_freq
    return lambda: opt._cms_mode.phase1(opt._inputs(t))


def measure(kind, device, reps, steps, fixed):
    phase1 = setup(kind, device, steps, fixed)
    phase1()  # warm-up (the torch ops' plan is made here)
    counter = CountOps()
    with counter:
        phase1()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        phase1()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        phase1()
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return counter.ops, statistics.median(times) * 1e3, peak


def main(argv=None):
    parser = make_parser("Phase 1 of the CMS step alone (the momentum MLP's surrogate training), "
                         "per implementation.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--reps", type=int, default=10, help="timed Phase 1 calls (median)")
    parser.add_argument("--steps", type=int, default=5, help="training steps before measuring")
    parser.add_argument("--fixed", action="store_true",
                        help="titanmac_c with fix_reference_bugs=True")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
    kinds = ["reference", "torch_ops"] + (["c_op"] if device.type == "cpu" else [])
    print(f"Phase 1, TitanMAC-like model, {device.type}, torch {torch.__version__}, "
          f"targets {'the clipped gradient (ours fixed)' if args.fixed else 'zero (B1)'}")
    print(f"{'impl':<10} {'ATen ops':>9} {'ms median':>10} {'peak MB':>8}")
    for kind in kinds:
        ops, ms, peak = measure(kind, device, args.reps, args.steps, args.fixed)
        print(f"{kind:<10} {ops:>9} {ms:>10.2f} {'-' if peak is None else f'{peak:.1f}':>8}")


if __name__ == "__main__":
    main()
