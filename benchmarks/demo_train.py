"""A small CPU training run with titanmac_c.AdamW beside torch.optim.AdamW.

Two copies of the same MLP learn the same regression task from the same batches, one with each
optimizer (gradient clipping at 1.0 in both). The script prints both losses and step times every
few steps and, at the end, the largest loss difference: the point of the swap is the same losses,
faster.

Usage: python benchmarks/demo_train.py [--steps 200] [--width 512]
"""

import argparse
import copy
import time

import torch

import titanmac_c


def make_model(width):
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )


def train_step(model, opt, x, y, clip):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t0 = time.perf_counter()
    clip(model)
    opt.step()
    return loss.item(), time.perf_counter() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model_torch = make_model(args.width)
    model_ours = copy.deepcopy(model_torch)
    n_params = sum(p.numel() for p in model_torch.parameters())
    opt_torch = torch.optim.AdamW(model_torch.parameters(), lr=1e-3, weight_decay=0.01)
    opt_ours = titanmac_c.AdamW(model_ours.parameters(), lr=1e-3, weight_decay=0.01)
    teacher = torch.nn.Linear(64, 1)

    print(f"MLP with {n_params:,} parameters, {args.steps} steps, cpu isa {titanmac_c.cpu_isa()}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'step':>5} {'loss torch':>12} {'loss titanmac_c':>16} "
          f"{'opt ms torch':>13} {'opt ms ours':>12}")
    max_diff, t_torch, t_ours = 0.0, [], []
    for step in range(1, args.steps + 1):
        x = torch.randn(128, 64)
        y = torch.sin(teacher(x)).detach()
        loss_t, dt_t = train_step(model_torch, opt_torch, x, y,
                                  lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        loss_o, dt_o = train_step(model_ours, opt_ours, x, y,
                                  lambda m: titanmac_c.clip_grad_norm_(m.parameters(), 1.0))
        t_torch.append(dt_t)
        t_ours.append(dt_o)
        max_diff = max(max_diff, abs(loss_t - loss_o) / max(abs(loss_t), 1e-12))
        if step == 1 or step % max(1, args.steps // 10) == 0:
            print(f"{step:>5} {loss_t:>12.6f} {loss_o:>16.6f} "
                  f"{dt_t * 1e3:>13.3f} {dt_o * 1e3:>12.3f}")
    med = lambda ts: sorted(ts)[len(ts) // 2] * 1e3  # noqa: E731
    print(f"median clip+step: torch {med(t_torch):.3f} ms, titanmac_c {med(t_ours):.3f} ms "
          f"({med(t_torch) / med(t_ours):.2f}x); largest relative loss difference {max_diff:.2e}")


if __name__ == "__main__":
    main()
