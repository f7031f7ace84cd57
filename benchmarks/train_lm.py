"""Train a small TitanMAC-like character language model with titanmac_c.DeepNestedOptimizer.

A complete script to copy: a plain PyTorch training loop in which the only titanmac_c line is the
optimizer. It shows the three things a training loop around DeepNestedOptimizer must get right:

* Gradient accumulation. zero_grad() once per optimizer step, not per micro-batch (TitanMAC's
  train_titanmac_nested.py zeroes on every micro-batch, so nothing accumulates: spec section 14);
  each micro-batch's loss is divided by the number of micro-batches, so the gradient is the mean
  over the whole batch and max_grad_norm means the same thing at any --accum.
* Mixed precision. bf16 autocast needs no scaler. fp16 needs a GradScaler, and
  DeepNestedOptimizer is not a torch Optimizer, so scaler.step(opt) is not possible: scale the
  loss for backward, then, after the last micro-batch, scaler.unscale_(opt.base_optimizer) once
  (the optimizer's norms, controller and clipping must see true gradients), opt.step(loss),
  scaler.update(). A step whose fp16 gradients overflowed has an Inf gradient norm, which
  DeepNestedOptimizer's guard skips (no update; with titanmac_c on the device, no host sync),
  and unscale_ has told the scaler to lower its scale. The loss given to step() is the unscaled
  mean loss of the micro-batches (the controller's loss EMA must not see the scale).
* No host syncs in the loop. step() takes the loss as a 0-d tensor (no loss.item()); the loss is
  read on the host only every --log-every steps.

The learning-rate schedule is set through opt.base_lr (DeepNestedOptimizer computes its rates as
base_lr * mu and does not read its groups' lr, so torch.optim.lr_scheduler does not apply).

Data: a generated English-like text (deterministic, ~180k characters, so the script needs no
download), or --text FILE for your own (a plain text file; characters are the tokens). 90% train,
10% validation.

    python benchmarks/train_lm.py                  # CPU or CUDA, 0.8M parameters, ~75 s on 2 cores
    python benchmarks/train_lm.py --device cuda --amp fp16 --accum 4 --steps 2000
    python benchmarks/train_lm.py --text my.txt --d-model 384 --layers 6 --save lm.pt

To compare with the pure-PyTorch stand-in of TitanMAC's optimizer, --optimizer reference swaps in
titanmac_c.testing.reference_dno.ReferenceDeepNestedOptimizer (it needs a float loss: one host
sync per step, which is what the titanmac_c version removes).
"""

import argparse
import math
import os
import random
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanmac_c import DeepNestedOptimizer  # the one titanmac_c line (was: titans_core.opt)

try:  # a progress bar when run from the titanmac_c repository; plain range() elsewhere
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _progress import progress
    from _cli import DefaultsFormatter
except ImportError:  # pragma: no cover - the script copied on its own
    def progress(iterable, **_):
        return iterable
    DefaultsFormatter = argparse.ArgumentDefaultsHelpFormatter


# ------------------------------------------------------------------------------------- data

_WORDS = dict(
    det=["the", "a", "one", "every", "that", "this"],
    adj=["quick", "small", "old", "bright", "quiet", "green", "heavy", "gentle", "cold", "brave",
         "curious", "silver", "tired", "clever", "distant", "warm"],
    noun=["fox", "river", "sailor", "garden", "lantern", "mountain", "teacher", "window", "bird",
          "machine", "village", "letter", "forest", "engine", "child", "storm", "road", "clock"],
    verb=["sees", "follows", "builds", "finds", "carries", "remembers", "watches", "paints",
          "crosses", "opens", "repairs", "answers", "waits for", "writes to"],
    prep=["near", "under", "beyond", "behind", "inside", "across", "above", "beside"],
    adv=["slowly", "quietly", "again", "at dawn", "every morning", "in the rain", "before noon",
         "without a word"],
    conj=["and then", "but", "because", "while", "so"],
)


def generate_corpus(n_chars=180_000, seed=0):
    """Deterministic English-like text from a small grammar: learnable structure (spelling,
    agreement of articles, punctuation) with enough randomness that it is not memorised."""
    rng = random.Random(seed)
    w = _WORDS

    def phrase():
        det = rng.choice(w["det"])
        adj = rng.choice(w["adj"]) + " " if rng.random() < 0.6 else ""
        return f"{det} {adj}{rng.choice(w['noun'])}"

    def clause():
        s = f"{phrase()} {rng.choice(w['verb'])} {phrase()}"
        if rng.random() < 0.5:
            s += f" {rng.choice(w['prep'])} {phrase()}"
        if rng.random() < 0.3:
            s += f" {rng.choice(w['adv'])}"
        return s

    out, size = [], 0
    while size < n_chars:
        sentence = clause()
        if rng.random() < 0.4:
            sentence += f", {rng.choice(w['conj'])} {clause()}"
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", ".", "!", "?"])
        sentence += "\n\n" if rng.random() < 0.15 else " "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class CharData:
    """Characters -> token ids; random windows for training, fixed windows for validation."""

    def __init__(self, text, seq_len, device, seed=0):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n_val = max(len(ids) // 10, seq_len + 2)
        self.train, self.val = ids[:-n_val], ids[-n_val:]
        self.seq_len = seq_len
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def vocab_size(self):
        return len(self.chars)

    def _windows(self, data, starts):
        x = torch.stack([data[s:s + self.seq_len] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + 1 + self.seq_len] for s in starts.tolist()])
        # pinned + non_blocking on CUDA: the copy overlaps the previous step's work
        if self.device.type == "cuda":
            return (x.pin_memory().to(self.device, non_blocking=True),
                    y.pin_memory().to(self.device, non_blocking=True))
        return x.to(self.device), y.to(self.device)

    def train_batch(self, batch_size):
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size,),
                               generator=self.gen)
        return self._windows(self.train, starts)

    def val_batches(self, batch_size, n_batches):
        span = len(self.val) - self.seq_len - 1
        starts = torch.linspace(0, span - 1, batch_size * n_batches).long()
        return [self._windows(self.val, starts[i * batch_size:(i + 1) * batch_size])
                for i in range(n_batches)]


# ------------------------------------------------------------------------------------ model
# The shape of TitanMAC (titans_core): RMSNorm pre-norm blocks, causal attention with depthwise
# causal convolutions on q, k, v and a sigmoid output gate, a GELU MLP, learned persistent tokens
# prepended to the sequence, tied embeddings. Parameter names follow TitanMAC's, which is what
# DeepNestedOptimizer's grouping (core matrices vs norms/gates/convs/biases) and depth rules read.

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, conv_kernel=4):
        super().__init__()
        self.n_heads = n_heads
        self.kernel = conv_kernel
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.q_conv = nn.Conv1d(d_model, d_model, conv_kernel, groups=d_model, bias=False)
        self.k_conv = nn.Conv1d(d_model, d_model, conv_kernel, groups=d_model, bias=False)
        self.v_conv = nn.Conv1d(d_model, d_model, conv_kernel, groups=d_model, bias=False)
        self.gate_proj = nn.Linear(n_heads, d_model)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def _causal_conv(self, conv, x):  # x: B, T, C
        return conv(F.pad(x.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (self._causal_conv(c, t) for c, t in
                   ((self.q_conv, q), (self.k_conv, k), (self.v_conv, v)))
        hd = C // self.n_heads
        qh, kh, vh = (t.view(B, T, self.n_heads, hd).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        att = att.transpose(1, 2).reshape(B, T, C)
        gate = torch.sigmoid(self.gate_proj(q.view(B, T, self.n_heads, hd).mean(-1)))
        return self.o_proj(att * gate)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.mlp.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.mlp.down_proj(F.gelu(self.mlp.up_proj(h)))


class TitanMACLM(nn.Module):
    """forward(ids [B, T]) -> logits [B, T, vocab]."""

    def __init__(self, vocab_size, d_model=128, n_layers=4, n_heads=4, d_ff=None, max_seq_len=256,
                 n_persistent=8):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.config = SimpleNamespace(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                                      n_heads=n_heads, d_ff=d_ff, max_seq_len=max_seq_len,
                                      n_persistent=n_persistent)
        self.n_persistent = n_persistent
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.embed_positions = nn.Embedding(max_seq_len, d_model)
        self.persistent_tokens = nn.Parameter(torch.zeros(n_persistent, d_model))
        self.layers = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith(".scale"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        x = self.embed_tokens(ids) + self.embed_positions(pos)
        x = torch.cat([self.persistent_tokens.unsqueeze(0).expand(B, -1, -1).to(x.dtype), x], 1)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x[:, self.n_persistent:]))


# --------------------------------------------------------------------------------- training

def lm_loss(model, x, y):
    logits = model(x)
    # the loss in float32 whatever the autocast dtype
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, batches, autocast):
    model.eval()
    total = torch.zeros((), device=batches[0][0].device)
    for x, y in batches:
        with autocast():
            total += lm_loss(model, x, y)
    model.train()
    return float(total / len(batches))  # one host read per evaluation


def lr_at(step, steps, base_lr, warmup):
    """Linear warm-up, then cosine decay to 10% of base_lr."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train_step(model, opt, micro_batches, autocast, scaler, float_loss=False):
    """One optimizer step over len(micro_batches) micro-batches. Returns the mean loss (a 0-d
    tensor; no host sync unless float_loss, which the reference optimizer needs)."""
    accum = len(micro_batches)
    opt.zero_grad(set_to_none=True)           # once per optimizer step
    loss_sum = None
    for x, y in micro_batches:
        with autocast():
            loss = lm_loss(model, x, y)
        scaler.scale(loss / accum).backward()  # gradients add up to the mean over the batch
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    mean_loss = loss_sum / accum
    if scaler.is_enabled():
        scaler.unscale_(opt.base_optimizer)    # once, after the last micro-batch, before step
    opt.step(float(mean_loss) if float_loss else mean_loss)
    scaler.update()                            # no-op unless fp16
    return mean_loss


def build_optimizer(kind, model, args):
    kw = dict(base_lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.clip,
              mode="simple", meta_update_freq=args.meta_every)
    if kind == "reference":
        from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer
        return ReferenceDeepNestedOptimizer(model, **kw)
    return DeepNestedOptimizer(model, **kw)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a small character language model with titanmac_c.DeepNestedOptimizer.",
        formatter_class=DefaultsFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=3e-3, help="base_lr (the controller scales it)")
    p.add_argument("--warmup", type=int, default=20, help="lr warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (keep > 0 with fp16)")
    p.add_argument("--meta-every", type=int, default=100, help="meta_update_freq")
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                   help="autocast dtype; fp16 adds a GradScaler")
    p.add_argument("--optimizer", choices=("titanmac_c", "reference"), default="titanmac_c",
                   help="titanmac_c's DeepNestedOptimizer or the pure-PyTorch reference")
    p.add_argument("--text", default=None, help="a text file to train on (default: generated)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="validation batches per evaluation")
    p.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    p.add_argument("--save", default=None,
                   help="a checkpoint file to write at the end (default: none)")
    p.add_argument("--out", default=None, help="a JSON summary file to write (default: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = generate_corpus(seed=args.seed)
    data = CharData(text, args.seq_len, device, seed=args.seed)
    model = TitanMACLM(data.vocab_size, d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.heads, max_seq_len=args.seq_len).to(device)
    opt = build_optimizer(args.optimizer, model, args)

    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train_lm] {n_params:,} parameters, vocab {data.vocab_size}, {len(data.train):,} "
          f"train characters, device {device}, amp {args.amp}, {args.accum} x {args.batch_size} "
          f"x {args.seq_len} tokens per step, optimizer {args.optimizer}", file=sys.stderr)
    val = data.val_batches(args.batch_size, args.eval_batches)
    initial_val = evaluate(model, val, autocast)
    losses = []
    bar = progress(range(args.steps), desc=f"{args.optimizer} AdamW-mode: training steps",
                   unit="step", disable=args.quiet)
    start = time.perf_counter()
    for step in bar:
        opt.base_lr = lr_at(step, args.steps, args.lr, args.warmup)  # the schedule hook
        micro = [data.train_batch(args.batch_size) for _ in range(args.accum)]
        loss = train_step(model, opt, micro, autocast, scaler,
                          float_loss=args.optimizer == "reference")
        losses.append(loss)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            value = float(loss)  # the only host read in the loop, every log_every steps
            line = f"step {step + 1}/{args.steps}: loss {value:.4f}, base_lr {opt.base_lr:.2e}"
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{value:.3f}")
            if not args.quiet:
                (bar.write if hasattr(bar, "write") else print)(line)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    final_val = evaluate(model, val, autocast)
    train_losses = torch.stack(losses).float().tolist() if losses else []
    tokens = args.steps * args.accum * args.batch_size * args.seq_len
    summary = dict(parameters=n_params, steps=args.steps, initial_val_loss=initial_val,
                   final_val_loss=final_val,
                   first_train_loss=train_losses[0] if train_losses else None,
                   last_train_loss=train_losses[-1] if train_losses else None,
                   tokens_per_s=tokens / elapsed if elapsed > 0 else None, seconds=elapsed,
                   amp=args.amp, accum=args.accum, optimizer=args.optimizer,
                   lr_multipliers=[float(m) for m in opt.get_lr_multipliers()])
    print(f"[train_lm] validation loss {initial_val:.4f} -> {final_val:.4f} "
          f"(uniform: {math.log(data.vocab_size):.4f}); {summary['tokens_per_s']:,.0f} tokens/s; "
          f"lr multipliers {summary['lr_multipliers']}")
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "chars": data.chars, "config": vars(model.config), "step": args.steps},
                   args.save)
    if args.out:
        import json
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    summary["train_losses"] = train_losses
    return summary


if __name__ == "__main__":
    main()
