"""Models, data and losses for the DeepNestedOptimizer tests and benchmarks. "The spec",
section numbers (§N) and bug ids (B1-B11, its section 14) refer to docs/deep_nested_optimizer.md.

* make_titanmac_like_model(seed): a small TitanMAC-shaped language model (d_model 256, 4 layers,
  vocab 19) whose parameter names, shapes and counts reproduce the spec's example (§2.2):
  3,237,888 parameters in 48 tensors. Under the reference grouping rule (§2.2) and depth rule
  (§2.3, n_layers = config.n_layers = 4) the groups come out as

    core : 19 tensors, 3,218,176 elements, depth 0.5526 (= 10.5 / 19)
           embed_tokens.weight (tied with lm_head, depth 0), embed_positions.weight (depth 0),
           persistent_tokens (depth 0.5: no rule matches), and per layer i (depth (i+1)/4)
           attn.qkv_proj.weight, attn.o_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight;
    embed: 29 tensors, 19,712 elements, depth 0.6207 (= 18 / 29)
           per layer i: attn_norm.scale, mlp_norm.scale (names contain 'norm'),
           attn.{q,k,v}_conv.weight (3-D depthwise convs), attn.gate_proj.{weight,bias}
           (names contain 'gate'), and the final norm.scale (depth 0.5: the depth rule only
           knows norm.weight / norm.bias).

  Initialisation: N(0, 0.02) for matrices, embeddings and conv weights, zero biases, norm scales
  1, so the parameter norm is about 60, close to the ~55 the spec quotes (enough to saturate the
  controller's sigmoid, B6).

* make_mlp_10_32_5(seed): the 10 -> 32 -> 5 MLP of the reference's unit tests, an
  nn.Sequential(Linear, ReLU, Linear) with names 0.weight, 0.bias, 2.weight, 2.bias: core = the two
  weights (352 elements), embed = the two biases (37 elements); n_layers = 1 and no name matches
  a depth rule, so both group depths are 0.5.

* synthetic_batches(model_kind, n, seed): deterministic batches (dicts) for 'titanmac' (alias
  'lm'; token batches with a learnable next-token rule), 'mlp' (regression) and 'mlp_cls'
  (5-way classification); loss_fn(model, batch) computes the matching loss.

Every builder seeds its own RNG and leaves torch's global RNG untouched.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 19
D_MODEL = 256
N_LAYERS = 4
N_HEADS = 4
D_FF = 1024
MAX_SEQ = 256
N_PERSISTENT = 8
CONV_KERNEL = 4


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class Attention(nn.Module):
    """Causal attention with depthwise causal convs on q, k, v and a sigmoid output gate."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.q_conv = nn.Conv1d(d_model, d_model, CONV_KERNEL, groups=d_model, bias=False)
        self.k_conv = nn.Conv1d(d_model, d_model, CONV_KERNEL, groups=d_model, bias=False)
        self.v_conv = nn.Conv1d(d_model, d_model, CONV_KERNEL, groups=d_model, bias=False)
        self.gate_proj = nn.Linear(n_heads, d_model)      # per-head summary -> channel gate
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    @staticmethod
    def _causal_conv(conv, x):                       # x: B, T, C
        y = F.pad(x.transpose(1, 2), (CONV_KERNEL - 1, 0))
        return conv(y).transpose(1, 2)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q = self._causal_conv(self.q_conv, q)
        k = self._causal_conv(self.k_conv, k)
        v = self._causal_conv(self.v_conv, v)
        hd = C // self.n_heads
        qh = q.view(B, T, self.n_heads, hd).transpose(1, 2)
        kh = k.view(B, T, self.n_heads, hd).transpose(1, 2)
        vh = v.view(B, T, self.n_heads, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        att = att.transpose(1, 2).reshape(B, T, C)
        gate = torch.sigmoid(self.gate_proj(q.view(B, T, self.n_heads, hd).mean(-1)))
        return self.o_proj(att * gate)


class MLP(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TitanMACLike(nn.Module):
    """forward(input_ids [B, T]) -> logits [B, T, vocab]; forward(dict with input_ids and
    labels) -> {'logits', 'loss'} (the form DeepNestedOptimizer.meta_update's default loss_fn
    expects)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(n_layers=N_LAYERS, d_model=D_MODEL, vocab_size=VOCAB,
                                      n_heads=N_HEADS, d_ff=D_FF, max_seq_len=MAX_SEQ,
                                      n_persistent=N_PERSISTENT)
        self.embed_tokens = nn.Embedding(VOCAB, D_MODEL)
        self.embed_positions = nn.Embedding(MAX_SEQ, D_MODEL)
        self.persistent_tokens = nn.Parameter(torch.zeros(N_PERSISTENT, D_MODEL))
        self.layers = nn.ModuleList(Block(D_MODEL, N_HEADS, D_FF) for _ in range(N_LAYERS))
        self.norm = RMSNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight          # tied: appears once
        self._init_weights()

    def _init_weights(self):
        for name, p in self.named_parameters():
            if name.endswith(".scale"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, batch):
        if isinstance(batch, dict):
            logits = self.forward(batch["input_ids"])
            out = {"logits": logits}
            if "labels" in batch:
                out["loss"] = F.cross_entropy(logits.reshape(-1, VOCAB),
                                              batch["labels"].reshape(-1))
            return out
        ids = batch
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        x = self.embed_tokens(ids) + self.embed_positions(pos)
        x = torch.cat([self.persistent_tokens.unsqueeze(0).expand(B, -1, -1), x], dim=1)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x[:, N_PERSISTENT:])
        return self.lm_head(x)


# the DeepNestedOptimizer's three modes: AdamW, CMS with the DirectUpdateMLP, CMS legacy
MODES = [dict(), dict(use_cms_updates=True), dict(use_cms_updates=True, use_preprocessing=False)]
MODE_IDS = ["adamw", "cms-direct", "cms-legacy"]


class PartlyFrozen(nn.Module):
    """Two linear layers, the second frozen at construction."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def make_titanmac_like_model(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TitanMACLike()


def make_mlp_10_32_5(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))


def synthetic_batches(model_kind, n, seed=0, batch_size=None, seq_len=32, device="cpu"):
    """n deterministic batches (dicts of tensors on `device`).

    'titanmac' / 'lm': {'input_ids', 'labels'} [B, seq_len] int64 (default B = 2); each row is an
        arithmetic progression mod 19 with a random start and stride, labels = the next token.
    'mlp': {'x' [B, 10], 'y' [B, 5]} with y = x W + 0.01 noise for one fixed random W (B = 16).
    'mlp_cls': {'x' [B, 10], 'labels' [B]} with labels = argmax(x W) (B = 16).
    """
    gen = torch.Generator().manual_seed(seed)
    batches = []
    if model_kind in ("titanmac", "lm"):
        bs = batch_size or 2
        for _ in range(n):
            start = torch.randint(0, VOCAB, (bs, 1), generator=gen)
            stride = torch.randint(1, 4, (bs, 1), generator=gen)
            seq = (start + stride * torch.arange(seq_len + 1)) % VOCAB
            batches.append({"input_ids": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device)})
        return batches
    if model_kind in ("mlp", "mlp_cls"):
        bs = batch_size or 16
        w_true = torch.randn(10, 5, generator=gen)
        for _ in range(n):
            x = torch.randn(bs, 10, generator=gen)
            if model_kind == "mlp":
                y = x @ w_true + 0.01 * torch.randn(bs, 5, generator=gen)
                batches.append({"x": x.to(device), "y": y.to(device)})
            else:
                batches.append({"x": x.to(device), "labels": (x @ w_true).argmax(-1).to(device)})
        return batches
    raise ValueError(f"unknown model_kind {model_kind!r}")


def loss_fn(model, batch):
    """The loss of `model` on a batch from synthetic_batches (a 0-dim tensor with grad)."""
    if "input_ids" in batch:
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    out = model(batch["x"])
    if "y" in batch:
        return F.mse_loss(out, batch["y"])
    return F.cross_entropy(out, batch["labels"])


def fixed_grads(model, step, frozen_scale=10.0):
    """Pseudo-random gradients by parameter name, drawn from the step number alone (so twin
    models get the same ones); those of a layer named 'frozen...' (PartlyFrozen's) are large, so
    that its norm dominates the clip norm and leaving it out changes every update."""
    gen = torch.Generator().manual_seed(500 + step)
    out = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen)
        out[name] = g * frozen_scale if name.startswith("frozen") else g
    return out


def set_grads_by_name(model, grads):
    for name, p in model.named_parameters():
        p.grad = grads[name].to(p.device).clone()


def step_all(step, *pairs):
    """One step (loss 0.5) of each (model, optimizer) pair on the same fixed_grads."""
    g = fixed_grads(pairs[0][0], step)
    for model, opt in pairs:
        set_grads_by_name(model, g)
        opt.step(0.5)
