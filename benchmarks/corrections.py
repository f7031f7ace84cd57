"""What fix_reference_bugs=True changes: train the TitanMAC-like model with the reference's
behaviour (default) and with the corrections of B1, B4, B6, B7, in AdamW mode and in CMS mode,
from the same initialisation and data, and print the loss at the start and the mean loss of the
last 10 steps.

Usage: python benchmarks/corrections.py [--steps 150] [--device cpu] [--out ...json]
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dno_models import loss_fn, make_titanmac_like_model, synthetic_batches  # noqa: E402

import titanmac_c  # noqa: E402
from _cli import make_parser  # noqa: E402
from _progress import Progress  # noqa: E402


def run(mode, fix, steps, device, batches):
    torch.manual_seed(0)
    model = make_titanmac_like_model(seed=0).to(device)
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=3e-4, weight_decay=0.01,
                                         use_cms_updates=(mode == "cms"), meta_update_freq=50,
                                         fix_reference_bugs=fix)
    losses = []
    behaviour = "fix_reference_bugs=True" if fix else "reference behaviour"
    desc = f"titanmac_c {mode.upper() if mode == 'cms' else 'AdamW'}-mode, {behaviour}: training"
    for batch in Progress(batches[:steps], desc=desc, unit="step"):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step(loss.detach())
        losses.append(float(loss))
    return dict(mode=mode, fix_reference_bugs=fix, first_loss=losses[0],
                last10_loss=sum(losses[-10:]) / 10, mu=opt.get_lr_multipliers().tolist())


def main(argv=None):
    parser = make_parser("Train the TitanMAC-like model with the reference's behaviour and with "
                         "fix_reference_bugs=True, and compare the losses.")
    parser.add_argument("--steps", type=int, default=150, help="training steps per run")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "out", "corrections.json"),
                        help="JSON results (default: benchmarks/out/corrections.json)")
    args = parser.parse_args(argv)
    batches = synthetic_batches("titanmac", args.steps, seed=0, device=args.device)
    rows = [run(mode, fix, args.steps, args.device, batches)
            for mode in ("adamw", "cms") for fix in (False, True)]
    print(f"{'mode':>6} {'fix':>5} {'loss step 1':>12} {'loss last 10':>13}  multipliers")
    for r in rows:
        print(f"{r['mode']:>6} {str(r['fix_reference_bugs']):>5} {r['first_loss']:>12.4f} "
              f"{r['last10_loss']:>13.4f}  {[round(m, 3) for m in r['mu']]}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), steps=args.steps, device=args.device,
                       torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
