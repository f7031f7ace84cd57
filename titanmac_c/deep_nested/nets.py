"""The networks and rules the DeepNestedOptimizer shares with the reference by design: the
constants of the reference (spec section 10), the parameter grouping and depths (2.2, 2.3), the
NestedController (4), the momentum networks DirectUpdateMLP and L2RegressionMomentum (7.3), the
meta trainers (9.1, 9.4), the meta-optimizers' gradient clip (8) and the default meta loss.

These are torch modules and plain functions with the reference's parameter names, state_dict keys
and initialisation, so a checkpoint of either optimizer loads into the other. The pure-PyTorch
reference (titanmac_c.testing.reference_dno) imports them from here: both optimizers build the
same modules from the same random draws.

Section numbers (spec N, §N) and bug ids (B1-B11, its section 14) refer to
docs/deep_nested_optimizer.md.
"""

import math
import re
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# §10 Constants (all hard-coded in the reference)
# ---------------------------------------------------------------------------------------------
N_GROUPS = 2                       # 'core', 'embed'
MIN_LR_MULT, MAX_LR_MULT = 0.1, 2.0
EMA_LOSS_BETA = 0.1                # ema <- (1 - 0.1) * ema + 0.1 * L
CLIP_EPS = 1e-6                    # kappa = min(max_norm / (N + 1e-6), 1)
META_GRAD_CLIP = 1.0               # meta optimizer and mlp_optimizer gradient clip
IMPROVEMENT_THRESHOLD = 0.001
PROXY_WARMUP_ENTRIES = 10
CMS_MOMENTUM = 0.9                 # DirectUpdate path: m <- 0.9 m + 0.1 delta
CMS_BETA2 = 0.999                  # v_sq decay (v_sq is never read)
CMS_EMA_BASE = 0.99                # ema_decay = 0.99 ** (1 / f)
MOMENTUM_CLAMP_RATIO = 100.0       # ||m|| <= 100 * max(||g||, 1e-8)
PREPROCESS_P = 10.0                # log-sign preprocessing, tau = exp(-10)
DIRECT_MLP_MAX_HIDDEN = 20
SURROGATE_LR = 1e-3
SURROGATE_FREQ = 5
SURROGATE_MAX_TENSORS = 20
META_SAMPLE_PER_GROUP = 5
META_SAMPLE_MAX = 10
EMA_TARGET_MIN = 1e-10
STAGNATION_CONSTANT = 0.01
EXPLICIT_META_ROWS = 4


# ---------------------------------------------------------------------------------------------
# §8 Gradient clipping of the meta-optimizers: fused_clip_grad_norm_
# ---------------------------------------------------------------------------------------------
def fused_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                           inplace=True):
    """Global-norm clip; returns N, the PRE-clip total norm (0-dim tensor on the grad device).

    N is computed as torch.nn.utils.clip_grad_norm_ computes it (per-tensor fused norms, then the
    norm of their stack), in the gradient dtype. kappa = min(max_norm / (N + 1e-6), 1) stays a
    device tensor. inplace=True multiplies every gradient by kappa, unconditionally (even when
    kappa == 1). inplace=False calls torch.nn.utils.clip_grad_norm_, which recomputes N and scales
    the gradients in place by the same formula (the only difference: a second norm pass).
    No NaN handling: a NaN N gives kappa = NaN and every gradient becomes NaN.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    # §8 step 1: no gradients at all -> tensor(0.0) on the CPU
    if len(grads) == 0:
        return torch.tensor(0.0)
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    # §8 step 2
    if math.isinf(norm_type):
        per_tensor = [g.detach().abs().max() for g in grads]
        total_norm = per_tensor[0] if len(per_tensor) == 1 else torch.max(torch.stack(per_tensor))
    else:
        per_tensor = torch._foreach_norm([g.detach() for g in grads], norm_type)
        total_norm = torch.linalg.vector_norm(torch.stack(list(per_tensor)), norm_type)
    # §8 step 3 (off everywhere in DNO)
    if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped.")
    # §8 steps 4, 5
    if inplace:
        clip_coef = max_norm / (total_norm + CLIP_EPS)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        torch._foreach_mul_(grads, clip_coef_clamped.to(grads[0].device))
    else:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type,
                                       error_if_nonfinite=error_if_nonfinite)
    # §8 step 6
    return total_norm


# ---------------------------------------------------------------------------------------------
# §2.2 Group formation (group_moe_params) and §2.3 depths (infer_param_depth @ 4819455)
# ---------------------------------------------------------------------------------------------
def _is_embed_group_param(name: str, p: torch.Tensor) -> bool:
    return ("token_embedding" in name
            or "norm" in name.lower()
            or "router" in name or "gate" in name      # case-sensitive
            or p.ndim != 2)


def group_moe_params(model: nn.Module):
    """Returns ([core, embed] group dicts, [core names, embed names]).

    Tied weights appear once (named_parameters de-duplicates, keeping the first name);
    requires_grad=False tensors are skipped. An empty embed group is kept as an empty list.
    """
    core, embed, core_names, embed_names = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _is_embed_group_param(name, p):
            embed.append(p)
            embed_names.append(name)
        else:
            core.append(p)
            core_names.append(name)
    groups = [{"params": core, "name": "core"}, {"params": embed, "name": "embed"}]
    return groups, [core_names, embed_names]


def model_n_layers(model: nn.Module) -> int:
    """§2.3: config.n_layers, else len(transformer_blocks), else len(layers), else 1."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "n_layers"):
        return int(config.n_layers)
    if hasattr(model, "transformer_blocks"):
        return len(model.transformer_blocks)
    if hasattr(model, "layers"):
        return len(model.layers)
    return 1


# The spec writes the patterns with unescaped dots; reproduced literally ('.' matches any char).
_DEPTH_PATTERNS = (r"layers.(\d+).", r"blocks.(\d+).", r"layer.(\d+).")


def infer_param_depth(name: str, n_layers: int) -> float:
    """§2.3 at master HEAD: embed -> 0; lm_head / exactly norm.weight|norm.bias -> 1;
    layer index i -> (i+1)/n_layers (no cap); otherwise 0.5."""
    lname = name.lower()
    if "embed" in lname:
        return 0.0
    if "lm_head" in lname or name in ("norm.weight", "norm.bias"):
        return 1.0
    for pattern in _DEPTH_PATTERNS:
        match = re.search(pattern, name)
        if match is not None:
            return (int(match.group(1)) + 1) / n_layers
    return 0.5


# ---------------------------------------------------------------------------------------------
# §4 NestedController
# ---------------------------------------------------------------------------------------------
class NestedController(nn.Module):
    """Shared MLP over the rows of S [n_groups, 3] -> one LR multiplier per group in [0.1, 2.0].

    Layers: Linear(3,H), ReLU, (L-1) x [Linear(H,H), ReLU], Linear(H,1), in a Sequential `net`
    (state_dict keys net.0.*, net.2.*, ...). Xavier-uniform (gain 1) weights, zero biases.
    """

    def __init__(self, hidden_dim: int = 32, num_layers: int = 2, n_groups: int = N_GROUPS,
                 min_lr_mult: float = MIN_LR_MULT, max_lr_mult: float = MAX_LR_MULT):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers
        self.n_groups = n_groups
        self.min_lr_mult = min_lr_mult
        self.max_lr_mult = max_lr_mult
        layers: List[nn.Module] = [nn.Linear(3, hidden_dim), nn.ReLU()]
        for _ in range(num_layers - 1):
            layers += [nn.Linear(hidden_dim, hidden_dim), nn.ReLU()]
        layers.append(nn.Linear(hidden_dim, 1))
        self.net = nn.Sequential(*layers)
        for module in self.net:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight, gain=1.0)
                nn.init.zeros_(module.bias)

    def forward(self, stats: torch.Tensor) -> torch.Tensor:
        # 1. non-finite inputs -> 1.0, remembering whether there were any (no host sync)
        bad = ~torch.isfinite(stats)
        any_bad = bad.any()
        clean = torch.where(bad, torch.ones_like(stats), stats)
        # 2. one scalar per group (each row on its own)
        raw = self.net(clean).squeeze(-1)
        # 3. mu = 0.1 + 1.9 * sigmoid(r), clamped to [0.1, 2.0]
        mult = self.min_lr_mult + (self.max_lr_mult - self.min_lr_mult) * torch.sigmoid(raw)
        mult = torch.clamp(mult, self.min_lr_mult, self.max_lr_mult)
        # 4. non-finite multipliers -> 1.0
        ones = torch.ones_like(mult)
        mult = torch.where(torch.isfinite(mult), mult, ones)
        # 5. any bad input -> all multipliers 1.0
        mult = torch.where(any_bad, ones, mult)
        return mult


# ---------------------------------------------------------------------------------------------
# §7.3 The momentum networks
# ---------------------------------------------------------------------------------------------
def preprocess_gradient(x: torch.Tensor, p: float = PREPROCESS_P):
    """Log-sign features, element-wise: |x| >= e^-p -> (ln|x|/p, sign x); else (-1, e^p * x)."""
    tau = math.exp(-p)
    absx = x.abs()
    big = absx >= tau
    log_feat = torch.where(big, torch.log(absx) / p, torch.full_like(x, -1.0))
    sign_feat = torch.where(big, torch.sign(x), math.exp(p) * x)
    return log_feat, sign_feat


class DirectUpdateMLP(nn.Module):
    """Coordinate-wise learned update (default momentum network).

    Per element features [log_g, sign_g, log_m, sign_m] -> Linear(4,H), SiLU,
    (L-1) x [Linear(H,H), SiLU], Linear(H,1). Output reshaped to the gradient's shape.
    Init (B4, reproduced): hidden Xavier-uniform / zero bias; output zero weight and bias, then
    weight[0, 1] = 0.1 -- index 1 is hidden unit 1, not the sign_g input.
    """

    def __init__(self, hidden_dim: int = DIRECT_MLP_MAX_HIDDEN, num_layers: int = 2,
                 preprocess_p: float = PREPROCESS_P):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers
        self.preprocess_p = preprocess_p
        self.input_dim = 4
        layers: List[nn.Module] = [nn.Linear(self.input_dim, hidden_dim), nn.SiLU()]
        for _ in range(num_layers - 1):
            layers += [nn.Linear(hidden_dim, hidden_dim), nn.SiLU()]
        layers.append(nn.Linear(hidden_dim, 1))
        self.net = nn.Sequential(*layers)
        linears = [m for m in self.net if isinstance(m, nn.Linear)]
        for module in linears[:-1]:
            nn.init.xavier_uniform_(module.weight, gain=1.0)
            nn.init.zeros_(module.bias)
        out = linears[-1]
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
        with torch.no_grad():
            out.weight[0, 1] = 0.1

    def forward(self, grad: torch.Tensor, momentum: Optional[torch.Tensor] = None) -> torch.Tensor:
        grad = grad.float()
        # DNO always passes a momentum; a missing one is treated as zero momentum here (the
        # upstream 2-feature form cannot feed a Linear(4, H)).
        momentum = torch.zeros_like(grad) if momentum is None else momentum.float()
        log_g, sign_g = preprocess_gradient(grad, self.preprocess_p)
        log_m, sign_m = preprocess_gradient(momentum, self.preprocess_p)
        features = torch.stack(
            [log_g.reshape(-1), sign_g.reshape(-1), log_m.reshape(-1), sign_m.reshape(-1)], dim=-1)
        return self.net(features).reshape(grad.shape)


def tensor_stats(x: torch.Tensor) -> torch.Tensor:
    """[mean, unbiased std (0 if numel == 1), L2 norm] of the flattened tensor, under no-grad
    (this no-grad is what makes the MLP meta-loss non-differentiable, B2)."""
    with torch.no_grad():
        flat = x.detach().reshape(-1).float()
        mean = flat.mean()
        std = flat.std() if flat.numel() > 1 else torch.zeros((), device=flat.device)
        norm = flat.norm()
        return torch.stack([mean, std, norm])


class L2RegressionMomentum(nn.Module):
    """Legacy momentum network: [stats(m_prev), stats(g), context] (9) -> (a, b, d).

    Linear(9,H), SiLU, (L-1) x [Linear(H,H), SiLU], Linear(H,3); hidden layers keep PyTorch's
    default Linear init; output zero weight, bias [1.5, 3.0, -5.0]. `residual_weight` (0.9) is a
    parameter that forward never uses.
    """

    def __init__(self, hidden_dim: int = 64, num_layers: int = 2):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers
        self.input_dim = 9
        self.residual_weight = nn.Parameter(torch.tensor(0.9))
        layers: List[nn.Module] = [nn.Linear(self.input_dim, hidden_dim), nn.SiLU()]
        for _ in range(num_layers - 1):
            layers += [nn.Linear(hidden_dim, hidden_dim), nn.SiLU()]
        layers.append(nn.Linear(hidden_dim, 3))
        self.net = nn.Sequential(*layers)
        out = self.net[-1]
        nn.init.zeros_(out.weight)
        with torch.no_grad():
            out.bias.copy_(torch.tensor([1.5, 3.0, -5.0]))

    def forward(self, grad: torch.Tensor, momentum: Optional[torch.Tensor],
                context: torch.Tensor):
        if momentum is None:
            momentum = torch.zeros_like(grad)
        m_stats = tensor_stats(momentum)              # momentum stats first
        g_stats = tensor_stats(grad)
        x = torch.cat([m_stats, g_stats, context.to(m_stats.device).float().reshape(-1)])
        out = self.net(x)
        scale = 0.5 + 0.49 * torch.sigmoid(out[0])     # a in [0.5, 0.99]
        shift = torch.tanh(out[1])                     # b in [-1, 1]
        damping = torch.sigmoid(out[2])                # d in [0, 1]
        return scale, shift, damping

    def compute_internal_loss(self, predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """MSE; defined upstream and never called."""
        return F.mse_loss(predicted, target)


# ---------------------------------------------------------------------------------------------
# §9.1 SimplifiedMetaTrainer, §9.4 UnrolledMetaTrainer
# ---------------------------------------------------------------------------------------------
# the SimplifiedMetaTrainer lists that steer its proxy loss (checkpointed, undone with a meta step)
META_HISTORIES = ("loss_history", "multiplier_history", "momentum_history")


def meta_histories(meta_trainer):
    """The meta trainer's histories as lists of their live entries (a checkpoint's, an undo's)."""
    return {name: list(getattr(meta_trainer, name)) for name in META_HISTORIES}


class SimplifiedMetaTrainer:
    """FIFO histories (one entry per meta-update call), window = meta_update_freq."""

    def __init__(self, window_size: int = 100,
                 improvement_threshold: float = IMPROVEMENT_THRESHOLD):
        self.window_size = window_size
        self.improvement_threshold = improvement_threshold
        self.loss_history: List[float] = []
        self.multiplier_history: List[torch.Tensor] = []
        self.momentum_history: List[float] = []

    def record_step(self, loss: float, multipliers: torch.Tensor, momentum_norm: float) -> None:
        self.loss_history.append(float(loss))
        self.multiplier_history.append(multipliers.detach().clone())
        self.momentum_history.append(float(momentum_norm))
        while len(self.loss_history) > self.window_size:
            self.loss_history.pop(0)
            self.multiplier_history.pop(0)
            self.momentum_history.pop(0)

    def recent_improvement(self) -> float:
        return self.loss_history[0] - self.loss_history[-1]

    def compute_proxy_loss(self, current_multipliers: torch.Tensor) -> torch.Tensor:
        """P of §9.1, differentiable in current_multipliers."""
        if len(self.loss_history) < PROXY_WARMUP_ENTRIES:
            return torch.mean((current_multipliers - 1.0) ** 2)
        if self.recent_improvement() > self.improvement_threshold:
            target = self.multiplier_history[-1]
            return torch.mean((current_multipliers - target) ** 2)
        deviation = current_multipliers - 1.0
        return torch.mean(deviation ** 2) - 0.1 * torch.mean(torch.abs(deviation))

    def get_statistics(self) -> Dict[str, float]:
        if not self.loss_history:
            return {"loss_improvement": 0.0, "loss_std": 0.0, "avg_momentum_norm": 0.0}
        std = torch.tensor(self.loss_history).std().item() if len(self.loss_history) > 1 else 0.0
        return {
            "loss_improvement": self.recent_improvement(),
            "loss_std": std,
            "avg_momentum_norm": sum(self.momentum_history) / len(self.momentum_history),
        }


class UnrolledMetaTrainer:
    """Nominal k-step unrolled meta trainer. Broken upstream (B3): it passes 3 arguments to
    DirectUpdateMLP, detaches the controller through .item(), swaps parameters via .data and
    crashes in backward with an in-place-modification error. Not reproduced: it raises."""

    def __init__(self, k_steps: int = 5, use_checkpointing: bool = True):
        self.k_steps = k_steps
        self.use_checkpointing = use_checkpointing

    def compute_meta_loss(self, *args, **kwargs):
        raise NotImplementedError(
            "UnrolledMetaTrainer is non-functional in the reference DeepNestedOptimizer (spec "
            "§9.4, bug B3); use meta_update(..., use_unrolled=False)")


def default_loss_fn(model, batch):
    """§9.4: model(batch), then the 'loss' entry, else 'total', else the output itself."""
    out = model(batch)
    if isinstance(out, dict):
        if "loss" in out:
            return out["loss"]
        if "total" in out:
            return out["total"]
    return out
