"""A small CPU training run with titanmac_c.AdamW beside torch.optim.AdamW, default and fused.

Three copies of the same MLP learn the same regression task from the same batches, with
  torch        torch.optim.AdamW (its default implementation: a for-loop over the tensors on
               the CPU) and torch.nn.utils.clip_grad_norm_;
  torch fused  torch.optim.AdamW(fused=True) and torch.nn.utils.clip_grad_norm_;
  titanmac_c   titanmac_c.AdamW and titanmac_c.clip_grad_norm_;
clipping the gradient norm at 1.0 before every step. The script prints the three losses every few
steps and, at the end, each one's median time of the optimizer step (clip + step) and of the
whole training step (forward + backward + clip + step), and the largest loss difference from
torch's: the point of the swap is the same losses, faster. The three take turns step by step,
each step in another order, so that the drifts of a shared machine hit all alike.

Usage: python benchmarks/demo_train.py [--steps 200] [--width 512]
"""

import argparse
import copy
import time
import warnings

# torch warns at import when NumPy is not installed; nothing here uses NumPy
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

import titanmac_c  # noqa: E402


def make_model(width):
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )


def train_step(model, opt, x, y, clip):
    """One training step: (loss, optimizer-step seconds (clip + step), whole-step seconds)."""
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t1 = time.perf_counter()
    clip(model.parameters(), 1.0)
    opt.step()
    t2 = time.perf_counter()
    return loss.item(), t2 - t1, t2 - t0


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="A small CPU training run: titanmac_c.AdamW beside torch.optim.AdamW, "
                    "default and fused.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--width", type=int, default=512, help="width of the MLP's hidden layers")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = make_model(args.width)
    n_params = sum(p.numel() for p in model.parameters())
    runs = {}  # name -> (model, optimizer, clip)
    for name, make_opt, clip in (
            ("torch", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
             torch.nn.utils.clip_grad_norm_),
            ("torch fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01,
                                                         fused=True),
             torch.nn.utils.clip_grad_norm_),
            ("titanmac_c", lambda ps: titanmac_c.AdamW(ps, lr=1e-3, weight_decay=0.01),
             titanmac_c.clip_grad_norm_)):
        copy_ = copy.deepcopy(model)
        runs[name] = (copy_, make_opt(copy_.parameters()), clip)
    names = list(runs)
    teacher = torch.nn.Linear(64, 1)

    print(f"MLP with {n_params:,} parameters, {args.steps} steps of batch 128, "
          f"cpu isa {titanmac_c.cpu_isa()}, {torch.get_num_threads()} threads")
    print(f"{'step':>5}" + "".join(f"{'loss ' + name:>18}" for name in names))
    losses = {name: [] for name in names}
    opt_s = {name: [] for name in names}
    step_s = {name: [] for name in names}
    for step in range(1, args.steps + 1):
        x = torch.randn(128, 64)
        y = torch.sin(teacher(x)).detach()
        shift = step % len(names)  # each step in another order
        for name in names[shift:] + names[:shift]:
            model_, opt, clip = runs[name]
            loss, dt_opt, dt_step = train_step(model_, opt, x, y, clip)
            losses[name].append(loss)
            opt_s[name].append(dt_opt)
            step_s[name].append(dt_step)
        if step == 1 or step % max(1, args.steps // 10) == 0:
            print(f"{step:>5}" + "".join(f"{losses[name][-1]:>18.6f}" for name in names))

    skip = min(10, args.steps // 2)  # the first steps allocate the state: not timed

    def med(ts):
        ts = sorted(ts[skip:])
        return ts[len(ts) // 2] * 1e3

    def max_rel_diff(name):
        return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["torch"], losses[name]))

    print(f"median ms of steps {skip + 1}-{args.steps} (speed-up over torch):")
    print(f"{'':<12} {'optimizer step (clip + step)':>30} {'training step (fwd+bwd+opt)':>30}")
    base_opt, base_step = med(opt_s["torch"]), med(step_s["torch"])
    for name in names:
        o, s = med(opt_s[name]), med(step_s[name])
        print(f"{name:<12} {o:>19.3f} ms ({base_opt / o:4.2f}x) "
              f"{s:>19.3f} ms ({base_step / s:4.2f}x)")
    print("largest relative loss difference from torch: "
          + ", ".join(f"{name} {max_rel_diff(name):.2e}" for name in names[1:]))


if __name__ == "__main__":
    main()
