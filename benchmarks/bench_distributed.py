"""Optimizer step of an FSDP2-sharded model (fully_shard: DTensor parameters): titanmac_c.AdamW
and clip_grad_norm_ against torch's, on each rank's shards.

torch's AdamW and norms run through DTensor's dispatch, op by op and tensor by tensor; ours hand
the local shards to one C call and reduce the norm with one all_reduce. With narrow layers
(the default) the figures are the host time a step costs per tensor; with --width 4096 and up
they approach the memory traffic of the shards.

Times: median milliseconds per call over --steps calls (on CUDA each call synchronized).
Usage: python benchmarks/bench_distributed.py [--device cpu|cuda] [--world N] [--layers 100]
           [--width 16] [--steps 30]
(one process per rank; gloo on the CPU, nccl on CUDA, one GPU per rank)
"""

import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
import titanmac_c  # noqa: E402
from _cli import make_parser  # noqa: E402


def _model(layers, width, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _median_ms(fn, device, steps):
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rows(args, device):
    """(implementation, call, ms, the torch call it replaces)."""
    rows = []
    for name, cls, clip in (("torch", torch.optim.AdamW, torch.nn.utils.clip_grad_norm_),
                            ("titanmac_c", titanmac_c.AdamW, titanmac_c.clip_grad_norm_)):
        model = _model(args.layers, args.width, device)
        opt = cls(model.parameters(), lr=1e-4, weight_decay=0.01)
        model(torch.randn(2, args.width, device=device)).sum().backward()
        params = list(model.parameters())

        def clip_and_step():
            clip(params, 1.0)
            opt.step()

        calls = [("AdamW.step", opt.step), ("clip_grad_norm_", lambda: clip(params, 1.0)),
                 ("clip_grad_norm_ + step", clip_and_step)]
        if name == "titanmac_c":
            def folded():
                opt.clip_grad_norm_(1.0)
                opt.step()
            calls.append(("AdamW.clip_grad_norm_ + step (folded)", folded))
        for what, fn in calls:
            replaces = "clip_grad_norm_ + step" if "folded" in what else what
            rows.append((name, what, _median_ms(fn, device, args.steps), replaces))
    return rows


def _rank_main(rank, args, init_file):
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    try:
        rows = _rows(args, device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        tensors = 2 * args.layers
        print(f"FSDP2 model: {args.layers} Linear({args.width}, {args.width}) layers, "
              f"{tensors} tensors, {args.world} rank(s)")
        torch_ms = {what: ms for who, what, ms, _ in rows if who == "torch"}
        print(f"{'':<11} {'call':<40} {'ms':>9} {'us/tensor':>10} {'torch / ours':>13}")
        for who, what, ms, replaces in rows:
            ratio = f"{torch_ms[replaces] / ms:13.1f}" if who != "torch" else ""
            print(f"{who:<11} {what:<40} {ms:9.3f} {1e3 * ms / tensors:10.2f} {ratio}")
        print(f"[bench_distributed] device {args.device}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}")


def main(argv=None):
    parser = make_parser("Optimizer step and clip_grad_norm_ of an FSDP2-sharded model: "
                         "titanmac_c against torch, per rank.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="gloo on the CPU, nccl on CUDA (one GPU per rank)")
    parser.add_argument("--world", type=int, default=1, help="ranks (processes)")
    parser.add_argument("--layers", type=int, default=100, help="linear layers of the model")
    parser.add_argument("--width", type=int, default=16,
                        help="width of each layer (4096 and up: memory-bound figures)")
    parser.add_argument("--steps", type=int, default=30, help="timed calls (median reported)")
    args = parser.parse_args(argv)
    if not dist.is_available():
        sys.exit("torch.distributed is not available in this torch build")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, os.path.join(tmp, "init")), nprocs=args.world)


if __name__ == "__main__":
    main()
