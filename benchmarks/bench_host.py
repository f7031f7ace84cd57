"""Host time of one optimizer step: tensors of 4 elements, so the arithmetic is nothing and what
is timed is the Python shim, the DLPack intake and the C core's validation (on CUDA, also the
launches). The step's host-cost targets (<= 50 us a step for 48 tensors, <= 150 us for 1,000)
are about this cost.

Times (median of many steps, microseconds): titanmac_c.AdamW.step, clip_grad_norm_ + step,
torch.optim.AdamW(fused=True).step, and the DeepNestedOptimizer's step in AdamW mode on the
TitanMAC-like model's 48 tensors, each shrunk to 4 elements (its grouping by name still applies);
AdamW.step over tensors listed in another order than their addresses (as a real model's lie in
the heap); and AdamW.step and the DeepNestedOptimizer's CMS-mode step on a stack of 16 tiny
convolutions (32 tensors), contiguous and channels_last (whose weights the C core takes where
they lie); and the AdamW-mode step with controllers of other widths, ours against the
reference's.

Usage: python benchmarks/bench_host.py [--device cpu|cuda] [--counts 48,1000] [--steps N]
                                       [--controllers 32x2,1024x4]
"""

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
import titanmac_c  # noqa: E402
from _cli import make_parser  # noqa: E402
from bench_step import enqueue_seconds  # noqa: E402
from dno_models import make_titanmac_like_model  # noqa: E402
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer  # noqa: E402


def _median_us(fn, device, steps, warmup=50):
    for _ in range(warmup):
        fn()
    return enqueue_seconds(fn, device, steps) * 1e6


def adamw_rows(count, device, steps):
    params = [torch.nn.Parameter(torch.randn(4, device=device)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    half = count // 2
    groups = [{"params": params[:half]}, {"params": params[half:]}]
    ours = titanmac_c.AdamW(groups, lr=1e-3, weight_decay=0.01)
    groups_t = [{"params": params[:half]}, {"params": params[half:]}]
    theirs = torch.optim.AdamW(groups_t, lr=1e-3, weight_decay=0.01, fused=True)

    def clip_step():
        ours.clip_grad_norm_(1.0)
        ours.step()

    return [(f"{count} tensors", "titanmac_c AdamW.step", _median_us(ours.step, device, steps)),
            (f"{count} tensors", "titanmac_c clip_grad_norm_ + step",
             _median_us(clip_step, device, steps)),
            (f"{count} tensors", "torch AdamW(fused=True).step",
             _median_us(theirs.step, device, steps))]


def heap_order_row(count, device, steps):
    """AdamW.step over tensors listed in another order than their addresses, as a real model's
    lie in the heap: the C core's memory-sharing check sorts them by address (the rows above
    list them in allocation order, the sort's easiest case)."""
    params = [torch.nn.Parameter(torch.randn(4, device=device)) for _ in range(count)]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    params = [params[i] for i in order]
    grads = [torch.randn(4, device=device) for _ in range(count)]
    for p, i in zip(params, order):
        p.grad = grads[i]
    ours = titanmac_c.AdamW(params, lr=1e-3, weight_decay=0.01)
    return (f"{count} in heap order", "titanmac_c AdamW.step", _median_us(ours.step, device, steps))


def _tiny_titanmac_like(device):
    model = make_titanmac_like_model(seed=0).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = torch.randn(4, device=device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def dno_row(device, steps):
    model = _tiny_titanmac_like(device)
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=3e-4, weight_decay=0.01,
                                         max_grad_norm=1.0)
    loss = torch.tensor(1.0, device=device)
    n = sum(1 for _ in model.parameters())
    return (f"{n} tensors", "titanmac_c DeepNestedOptimizer.step (AdamW mode)",
            _median_us(lambda: opt.step(loss), device, steps))


def controller_rows(device, steps, shapes):
    """The AdamW-mode step of dno_row with a controller of hidden width H and L hidden layers
    (controller_hidden_dim, controller_num_layers), ours and the reference's: at widths of a few
    hundred and more the controller's matrix-vector products, not the host, are the cost."""
    rows = []
    for hidden, layers in shapes:
        for name, cls in (("titanmac_c", titanmac_c.DeepNestedOptimizer),
                          ("reference", ReferenceDeepNestedOptimizer)):
            model = _tiny_titanmac_like(device)
            opt = cls(model, controller_hidden_dim=hidden, controller_num_layers=layers)
            rows.append((f"controller {hidden}x{layers}",
                         f"{name} DeepNestedOptimizer.step (AdamW mode)",
                         _median_us(lambda: opt.step(1.0), device, steps, warmup=5)))
    return rows


def layout_rows(device, steps):
    rows = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Conv2d(2, 2, 2) for _ in range(16)])
        model = model.to(device=device, memory_format=memory_format)
        for p in model.parameters():
            p.grad = torch.randn_like(p)  # in the parameter's layout, as autograd makes them
        adamw = titanmac_c.AdamW(model.parameters(), lr=1e-3)
        dno = titanmac_c.DeepNestedOptimizer(model, use_cms_updates=True)
        loss = torch.tensor(1.0, device=device)
        where = f"{sum(1 for _ in model.parameters())} conv " + (
            "CL" if memory_format == torch.channels_last else "contig")
        rows += [(where, "titanmac_c AdamW.step", _median_us(adamw.step, device, steps)),
                 (where, "titanmac_c DeepNestedOptimizer.step (CMS mode)",
                  _median_us(lambda: dno.step(loss), device, steps))]
    return rows


def main(argv=None):
    parser = make_parser("Host time of one optimizer step on 4-element tensors (the Python shim, "
                         "DLPack intake and validation).")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--counts", default="48,1000",
                        help="tensor counts of the AdamW rows, comma-separated")
    parser.add_argument("--steps", type=int, default=1000,
                        help="timed steps (a tenth for counts over 100)")
    parser.add_argument("--controllers", default="32x2,1024x4",
                        help="controller shapes HxL for the controller rows ('' for none)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)  # no OpenMP fork/join in the figure: 4-element tensors
    rows = []
    for count in (int(c) for c in args.counts.split(",")):
        count_steps = args.steps if count <= 100 else args.steps // 10
        rows += adamw_rows(count, device, count_steps)
        rows.append(heap_order_row(count, device, count_steps))
    rows.append(dno_row(device, args.steps))
    rows += layout_rows(device, args.steps)
    shapes = [tuple(int(n) for n in shape.split("x"))
              for shape in args.controllers.split(",") if shape]
    rows += controller_rows(device, max(args.steps // 20, 10), shapes)
    print(f"{'set':>19}  {'step':<50} {'host us':>8}")
    for where, what, us in rows:
        print(f"{where:>19}  {what:<50} {us:>8.1f}")
    print(f"[bench_host] device {device}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
