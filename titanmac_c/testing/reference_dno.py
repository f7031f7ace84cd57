"""Pure-PyTorch reference of TitanMAC's DeepNestedOptimizer: the executable specification.

Written from the clean-room specification ``docs/deep_nested_optimizer.md`` (baseline: master
HEAD 1934775, i.e. ``deep_nested_optimizer.py`` / ``nested_controller.py`` as of e83314a and
``param_groups.py`` as of 4819455). Section numbers in the comments ("§5 step 7") and bug ids
(B1-B11, listed in its §14) refer to that document. This module stands in for the upstream
optimizer: ``titanmac_c.DeepNestedOptimizer`` is tested for parity against it, step by step, in
both modes.

It is deliberately FAITHFUL, oddities included:

* the known bugs of spec §14 that change behaviour are reproduced (B1 CMS Phase 1 trains on
  zeros, B2 the MLP meta-loss has no gradient path, B4 DirectUpdateMLP's init, B5 explicit
  meta_update sees zero gradients, B6 raw, unnormalised controller inputs, B7 half-used CMS
  frequency list, B10 CPU-side defaults on reload, B11 CMS buffers in every mode);
* B3: the unrolled meta path, broken upstream, raises NotImplementedError here;
* the host syncs of the eager path (``.item()``, ``.tolist()``, Python branches on device values)
  are where the reference has them.

CUDA-graph mode (§11) is NOT reproduced: with ``use_cuda_graph=True`` this reference runs the eager
path of §5 (the argument is stored and otherwise ignored). B8/B9 therefore do not occur here.

Nothing here is fast. Of titanmac_c it imports only deep_nested.nets, the modules both optimizers
share by design; no production module imports this one.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# The networks, grouping rules, meta trainers and constants are the optimizer's own modules: the
# reference builds the very same ones (same classes, same random draws), so only the step logic
# below is independent of titanmac_c's.
from ..deep_nested.nets import (  # noqa: F401  (re-exported: the reference's namespace)
    CLIP_EPS,
    CMS_BETA2,
    CMS_EMA_BASE,
    CMS_MOMENTUM,
    DIRECT_MLP_MAX_HIDDEN,
    EMA_LOSS_BETA,
    EMA_TARGET_MIN,
    EXPLICIT_META_ROWS,
    IMPROVEMENT_THRESHOLD,
    MAX_LR_MULT,
    META_GRAD_CLIP,
    META_SAMPLE_MAX,
    META_SAMPLE_PER_GROUP,
    MIN_LR_MULT,
    MOMENTUM_CLAMP_RATIO,
    N_GROUPS,
    PREPROCESS_P,
    PROXY_WARMUP_ENTRIES,
    STAGNATION_CONSTANT,
    SURROGATE_FREQ,
    SURROGATE_LR,
    SURROGATE_MAX_TENSORS,
    DirectUpdateMLP,
    L2RegressionMomentum,
    NestedController,
    SimplifiedMetaTrainer,
    UnrolledMetaTrainer,
    group_moe_params,
    infer_param_depth,
    preprocess_gradient,
)
from ..deep_nested.nets import default_loss_fn as _default_loss_fn  # noqa: F401
from ..deep_nested.nets import fused_clip_grad_norm_ as _fused_clip_grad_norm_  # noqa: F401
from ..deep_nested.nets import model_n_layers as _model_n_layers  # noqa: F401
from ..deep_nested.nets import tensor_stats as _tensor_stats  # noqa: F401

__all__ = [
    "CMSLevel",
    "ContinuumMemoryState",
    "DeepNestedOptimizer",
    "DirectUpdateMLP",
    "L2RegressionMomentum",
    "NestedController",
    "ReferenceDeepNestedOptimizer",
    "SimplifiedMetaTrainer",
    "UnrolledMetaTrainer",
    "compute_surrogate_loss",
    "group_moe_params",
    "infer_param_depth",
    "preprocess_gradient",
]

# ---------------------------------------------------------------------------------------------
# §7.1 Per-parameter CMS state
# ---------------------------------------------------------------------------------------------
class CMSLevel:
    """One frequency level of a ContinuumMemoryState (§7.1 table)."""

    def __init__(self, shape, frequency: int, device):
        self.frequency = frequency
        self.momentum = torch.zeros(shape, dtype=torch.float32, device=device)
        self.accumulated_grad = torch.zeros(shape, dtype=torch.float32, device=device)
        self.ema_grad = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v_sq = torch.zeros(shape, dtype=torch.float32, device=device)
        self.step_count = 0
        self.ema_decay = CMS_EMA_BASE ** (1.0 / frequency)
        self.beta2 = CMS_BETA2


class ContinuumMemoryState:
    """K levels; level l fires every B**l steps with B = frequencies[1] (or 10 if K == 1) (B7)."""

    def __init__(self, param_shape, frequencies, device=None):
        self.frequencies = list(frequencies)
        base = self.frequencies[1] if len(self.frequencies) > 1 else 10
        self.levels = [CMSLevel(param_shape, int(base ** level), device)
                       for level in range(len(self.frequencies))]

    def should_update(self, level: int, step: int) -> bool:
        return step % self.levels[level].frequency == 0

    def accumulate(self, grad: torch.Tensor) -> None:
        for level in self.levels:
            level.accumulated_grad.add_(grad)

    def get_adaptive_lr(self, level: int) -> float:
        """Defined upstream, never called."""
        lvl = self.levels[level]
        if lvl.step_count == 0:
            return 1.0
        v_hat = lvl.v_sq / (1 - lvl.beta2 ** lvl.step_count)
        return torch.clamp(1.0 / (torch.sqrt(v_hat) + 1e-8), 0.1, 10.0)

    def to(self, device):
        for lvl in self.levels:
            for key in ("momentum", "accumulated_grad", "ema_grad", "v_sq"):
                setattr(lvl, key, getattr(lvl, key).to(device))
        return self


# ---------------------------------------------------------------------------------------------
# §7.4 Surrogate loss (Phase-1 training of DirectUpdateMLP)
# ---------------------------------------------------------------------------------------------
def compute_surrogate_loss(output: torch.Tensor, target: torch.Tensor,
                           prev_output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """R + 0.1 M + T; every condition is a Python branch on a device value (host sync)."""
    o = output.reshape(-1)
    g = target.reshape(-1)
    g_norm = g.norm()
    o_norm = o.norm()
    # direction term R
    if g_norm > 1e-8 and o_norm > 1e-8:
        direction = 1.0 - F.cosine_similarity(o, g, dim=0)
    else:
        direction = torch.tensor(0.0, device=o.device)         # a fresh leaf
    # magnitude term M
    if g_norm > 1e-8:
        magnitude = (o_norm / g_norm - 1.0) ** 2
    else:
        magnitude = o_norm ** 2
    # smoothness term T
    if prev_output is not None and prev_output.shape == output.shape:
        smooth = 0.1 * torch.mean((output - prev_output) ** 2)
    else:
        smooth = 0.0
    return direction + 0.1 * magnitude + smooth


# ---------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------
class ReferenceDeepNestedOptimizer:
    """DeepNestedOptimizer (not a torch.optim.Optimizer): AdamW over two groups with per-group
    learning rates base_lr * mu_g from a NestedController, or (use_cms_updates=True) the CMS
    update of §7. See the module docstring for what is and is not reproduced."""

    # §2.1 constructor, arguments in order with their defaults
    def __init__(self, model: nn.Module, base_lr: float = 1e-3, meta_lr: float = 1e-4,
                 k_unroll: int = 5, cms_frequencies: Optional[List[int]] = None,
                 momentum_hidden_dim: int = 64, momentum_num_layers: int = 2,
                 controller_hidden_dim: int = 32, controller_num_layers: int = 2,
                 use_gradient_checkpointing: bool = True, mode: str = "simple",
                 meta_update_freq: int = 100, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, low_memory: bool = False,
                 use_cms_updates: bool = False, use_preprocessing: bool = True,
                 use_compile: bool = False, controller_update_freq: int = 1,
                 use_cuda_graph: bool = False, cuda_graph_warmup_steps: int = 3):
        if mode not in ("simple", "explicit"):
            raise ValueError(f"mode must be 'simple' or 'explicit', got {mode!r}")
        if cms_frequencies is None:
            cms_frequencies = [1] if low_memory else [1, 10, 100]

        self.model = model
        self.base_lr = base_lr
        self.meta_lr = meta_lr
        self.k_unroll = k_unroll
        self.cms_frequencies = list(cms_frequencies)
        self.momentum_hidden_dim = momentum_hidden_dim
        self.momentum_num_layers = momentum_num_layers
        self.controller_hidden_dim = controller_hidden_dim
        self.controller_num_layers = controller_num_layers
        self.use_gradient_checkpointing = use_gradient_checkpointing
        self.mode = mode
        self.meta_update_freq = meta_update_freq
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.low_memory = low_memory
        self.use_cms_updates = use_cms_updates
        self.use_preprocessing = use_preprocessing
        self.use_compile = use_compile
        self.controller_update_freq = controller_update_freq
        # §11 is not reproduced: graph mode runs the eager path (AdamW is built as usual, not
        # capturable, with float learning rates).
        self.use_cuda_graph = use_cuda_graph
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.n_groups = N_GROUPS
        self.device = next(model.parameters()).device

        # §2.1 objects, in order. 1. the two groups (§2.2)
        groups, group_names = group_moe_params(model)
        self._group_names = group_names

        # 2. the base optimizer: AdamW with its defaults (betas 0.9/0.999, eps 1e-8)
        self.base_optimizer = torch.optim.AdamW(groups, lr=base_lr, weight_decay=weight_decay)

        # 3. the momentum MLP, on the device
        if use_preprocessing:
            self.momentum_mlp = DirectUpdateMLP(
                hidden_dim=min(momentum_hidden_dim, DIRECT_MLP_MAX_HIDDEN),
                num_layers=momentum_num_layers)
        else:
            self.momentum_mlp = L2RegressionMomentum(hidden_dim=momentum_hidden_dim,
                                                     num_layers=momentum_num_layers)
        self.momentum_mlp = self.momentum_mlp.to(self.device)

        # 4. the controller, on the device
        self.controller = NestedController(hidden_dim=controller_hidden_dim,
                                           num_layers=controller_num_layers,
                                           n_groups=N_GROUPS).to(self.device)

        # 5. optional compile wrappers (state_dict keys then gain '_orig_mod.')
        if use_compile:
            self.controller = torch.compile(self.controller, mode="reduce-overhead")
            self.momentum_mlp = torch.compile(self.momentum_mlp, mode="reduce-overhead")

        # 6. the meta optimizer over momentum-MLP params ++ controller params
        self.meta_optimizer = torch.optim.Adam(
            list(self.momentum_mlp.parameters()) + list(self.controller.parameters()), lr=meta_lr)

        # 7. surrogate training of DirectUpdateMLP
        if use_preprocessing:
            self.mlp_optimizer = torch.optim.Adam(self.momentum_mlp.parameters(), lr=SURROGATE_LR)
            self.mlp_train_freq = SURROGATE_FREQ
            self._mlp_output_history: Dict[int, torch.Tensor] = {}     # keyed by id(param)
        else:
            self.mlp_optimizer = None
            self.mlp_train_freq = SURROGATE_FREQ
            self._mlp_output_history = {}
        self._last_surrogate_loss: Optional[torch.Tensor] = None

        # 8. CMS state for every tensor of both groups, in every mode (B11, reproduced)
        self.state: Dict[torch.Tensor, ContinuumMemoryState] = {}
        for group in self.base_optimizer.param_groups:
            for p in group["params"]:
                self.state[p] = ContinuumMemoryState(p.shape, self.cms_frequencies, self.device)

        # 9. tracking values
        self.global_step = 0
        self._lr_multipliers = torch.ones(N_GROUPS, device=self.device)
        self.ema_loss = torch.zeros(N_GROUPS, device=self.device)
        self.last_meta_loss = None
        self.controller_grad_norm = 0.0
        self._stored_loss = None
        self._warned_no_loss = False

        # 10., 11. meta trainers (the history window is meta_update_freq)
        self.meta_trainer = SimplifiedMetaTrainer(window_size=meta_update_freq,
                                                  improvement_threshold=IMPROVEMENT_THRESHOLD)
        self.unrolled_trainer = UnrolledMetaTrainer(k_steps=k_unroll,
                                                    use_checkpointing=use_gradient_checkpointing)

        # 12. group depths (§2.3): unweighted mean per group, 0.5 for an empty group
        n_layers = _model_n_layers(model)
        depths = []
        for names in group_names:
            if names:
                depths.append(sum(infer_param_depth(n, n_layers) for n in names) / len(names))
            else:
                depths.append(0.5)
        self.group_depths = torch.tensor(depths, dtype=torch.float32, device=self.device)

        # 13. (CUDA-graph state: not reproduced)
        self._param_groups = None
        self._stats_scratch = torch.zeros(N_GROUPS, 3, dtype=torch.float32, device=self.device)

    # -----------------------------------------------------------------------------------------
    # §12 small public methods
    # -----------------------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.base_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._param_groups = value         # stored only; no effect (as in the reference)

    def set_loss(self, loss_value) -> None:
        self._stored_loss = loss_value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def get_lr_multipliers(self) -> torch.Tensor:
        return self._lr_multipliers.clone()

    def get_effective_lrs(self) -> List[float]:
        return [self.base_lr * m for m in self._lr_multipliers.tolist()]

    def _momentum_norms(self) -> List[torch.Tensor]:
        return [lvl.momentum.norm() for st in self.state.values() for lvl in st.levels]

    def get_momentum_stats(self) -> Dict[str, float]:
        norms = self._momentum_norms()
        if not norms:
            return {"momentum_total_norm": 0.0, "momentum_avg_norm": 0.0,
                    "global_step": self.global_step}
        total = torch.stack(norms).sum().item()
        return {"momentum_total_norm": total, "momentum_avg_norm": total / len(norms),
                "global_step": self.global_step}

    # -----------------------------------------------------------------------------------------
    # §3 group statistics
    # -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _compute_group_stats(self) -> torch.Tensor:
        """S [2, 3] fp32: [grad norm (pre-clip in step()), param norm, depth] per group."""
        S = self._stats_scratch
        for g, group in enumerate(self.base_optimizer.param_groups):
            params = group["params"]
            S[g, 0] = 0.0
            S[g, 1] = 0.0
            if params:
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    # per-tensor norms come back in the tensor dtype; squared, summed, sqrt
                    gnorms = torch._foreach_norm(grads)
                    S[g, 0] = torch.stack(list(gnorms)).pow(2).sum().sqrt()
                pnorms = torch._foreach_norm(list(params))
                S[g, 1] = torch.stack(list(pnorms)).pow(2).sum().sqrt()
            S[g, 2] = self.group_depths[g]
        # branch-free NaN/Inf substitution: norms -> 1.0, depth -> depth; returns a new tensor
        replacement = torch.stack(
            [torch.ones_like(self.group_depths), torch.ones_like(self.group_depths),
             self.group_depths], dim=1)
        return torch.where(torch.isfinite(S), S, replacement)

    def _get_context(self, loss_value: float) -> torch.Tensor:
        """§3 context vector [t/1000, base_lr, ln(max(L, 1e-8) + 1)] (legacy MLP only)."""
        return torch.tensor(
            [self.global_step / 1000.0, self.base_lr, math.log(max(loss_value, 1e-8) + 1.0)],
            dtype=torch.float32, device=self.device)

    def _zero_model_grads(self) -> None:
        self.base_optimizer.zero_grad(set_to_none=True)

    # -----------------------------------------------------------------------------------------
    # §5 step
    # -----------------------------------------------------------------------------------------
    def step(self, loss_value=None):
        # 1. counter
        self.global_step += 1
        t = self.global_step

        # 2. loss: argument, else set_loss(), else 0.0 with a one-time warning; then clear
        if loss_value is not None:
            loss = loss_value
        elif self._stored_loss is not None:
            loss = self._stored_loss
        else:
            loss = 0.0
            if not self._warned_no_loss:
                warnings.warn("DeepNestedOptimizer.step() called without a loss value; using 0.0")
                self._warned_no_loss = True
        self._stored_loss = None
        loss = float(loss)

        # 3. NaN-loss guard: only t has changed
        if math.isnan(loss) or math.isinf(loss):
            print(f"[DeepNestedOptimizer] step {t}: non-finite loss ({loss}), skipping update")
            self._zero_model_grads()
            return self._skip_result("nan_loss")

        # 4. CUDA-graph branch: not reproduced (eager path below, see module docstring)

        # 5. EMA of the loss (returned, never used)
        if t == 1:
            self.ema_loss = torch.full((N_GROUPS,), loss, dtype=torch.float32, device=self.device)
        else:
            self.ema_loss = (1.0 - EMA_LOSS_BETA) * self.ema_loss + EMA_LOSS_BETA * loss

        # 6. controller, on update steps only (stale mu otherwise); stats are pre-clip
        if t % self.controller_update_freq == 0 or t == 1:
            stats = self._compute_group_stats()
            with torch.no_grad():
                self._lr_multipliers = self.controller(stats)   # stored without a clone

        # 7. global clip over model.parameters() (non-in-place variant) and NaN-gradient guard
        if self.max_grad_norm > 0:
            total_norm = _fused_clip_grad_norm_(self.model.parameters(), self.max_grad_norm,
                                                inplace=False)
            if bool(torch.isnan(total_norm) | torch.isinf(total_norm)):      # host sync
                print(f"[DeepNestedOptimizer] step {t}: non-finite gradient norm, skipping update")
                self._zero_model_grads()
                return self._skip_result("nan_gradient")

        # 8. update
        if self.use_cms_updates:
            self._cms_step(loss)
        else:
            self._adamw_step()

        # 9. simple-mode meta-update
        if self.mode == "simple" and t % self.meta_update_freq == 0:
            self._update_meta_components(loss)

        # 11. result
        result = {
            "global_step": t,
            "lr_multipliers": self._lr_multipliers.clone(),
            "ema_loss": self.ema_loss.clone(),
        }
        if self._last_surrogate_loss is not None:
            result["surrogate_loss"] = self._last_surrogate_loss    # stale after its step
        return result

    def _skip_result(self, reason: str):
        return {"global_step": self.global_step,
                "lr_multipliers": self._lr_multipliers.tolist(),
                "skipped": True, "reason": reason}

    # -----------------------------------------------------------------------------------------
    # §6 AdamW path
    # -----------------------------------------------------------------------------------------
    def _adamw_step(self) -> None:
        multipliers = self._lr_multipliers.tolist()                  # one host read
        for g, group in enumerate(self.base_optimizer.param_groups):
            if group["params"]:
                group["lr"] = self.base_lr * multipliers[g]
        self.base_optimizer.step()

    # -----------------------------------------------------------------------------------------
    # §7.2 CMS path
    # -----------------------------------------------------------------------------------------
    def _cms_step(self, loss: float) -> None:
        t = self.global_step
        # prelude: eta_g = base_lr * mu_g as Python floats (one host sync), context vector
        lrs = [self.base_lr * m for m in self._lr_multipliers.tolist()]
        context = self._get_context(loss)

        # Phase 1: surrogate training of DirectUpdateMLP, before Phase 2
        if self.use_preprocessing and t % self.mlp_train_freq == 0:
            self._train_mlp_surrogate()

        # Phase 2: parameter updates
        with torch.no_grad():
            for g, group in enumerate(self.base_optimizer.param_groups):
                lr = lrs[g]
                for p in group["params"]:
                    if p.grad is None:
                        continue          # no accumulation, no decay
                    self._cms_update_param(p, lr, context, t)

    def _train_mlp_surrogate(self) -> None:
        # 1. the FIRST (at most) 20 tensors with a gradient, walking the groups in order
        selected = []
        for group in self.base_optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    selected.append(p)
                if len(selected) >= SURROGATE_MAX_TENSORS:
                    break
            if len(selected) >= SURROGATE_MAX_TENSORS:
                break
        if not selected:
            return
        # 2. per-tensor surrogate losses
        losses = []
        with torch.enable_grad():
            for p in selected:
                level0 = self.state[p].levels[0]
                # B1: A_0 was reset by the previous Phase 2 and the current gradient is not yet
                # added, so this is always the zero tensor. (p.grad is what it should use.)
                g0 = level0.accumulated_grad.detach().clone() / max(self.cms_frequencies[0], 1)
                out = self.momentum_mlp(g0, level0.momentum.detach())
                prev = self._mlp_output_history.get(id(p))
                losses.append(compute_surrogate_loss(out, g0, prev))
                self._mlp_output_history[id(p)] = out.detach().clone()
            # 3. mean, backprop, clip MLP grads to 1.0 (in place), one Adam step at 1e-3
            total = torch.stack(losses).mean()
            self.mlp_optimizer.zero_grad()
            total.backward()
        _fused_clip_grad_norm_(self.momentum_mlp.parameters(), META_GRAD_CLIP, inplace=True)
        self.mlp_optimizer.step()
        # 4. keep it (lazily) for the step dict
        self._last_surrogate_loss = total.detach()

    def _cms_update_param(self, p: torch.Tensor, lr: float, context: torch.Tensor, t: int) -> None:
        state = self.state[p]
        grad = p.grad                      # the clipped gradient
        # 1. accumulate into every level
        state.accumulate(grad)
        # 2.
        update = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        n_active = 0
        # 3. every level that fires at t, in order
        for level_idx, lvl in enumerate(state.levels):
            if t % lvl.frequency != 0:
                continue
            # 3.1 mean gradient over the period: divisor cms_frequencies[l], not B**l (B7)
            g_level = lvl.accumulated_grad.clone() / max(self.cms_frequencies[level_idx], 1)
            lvl.accumulated_grad.zero_()
            lvl.step_count += 1
            # 3.2 EMA of level gradients (read only by the meta proxy loss)
            lvl.ema_grad = lvl.ema_decay * lvl.ema_grad + (1.0 - lvl.ema_decay) * g_level
            # 3.3 squared-gradient EMA (never read)
            lvl.v_sq = lvl.beta2 * lvl.v_sq + (1.0 - lvl.beta2) * g_level ** 2
            if self.use_preprocessing:
                # 3.4 DirectUpdateMLP: contribution is the MLP output itself
                delta = self.momentum_mlp(g_level, lvl.momentum)
                new_momentum = CMS_MOMENTUM * lvl.momentum + (1.0 - CMS_MOMENTUM) * delta
                new_momentum = self._clamp_momentum(new_momentum, g_level)
                lvl.momentum = new_momentum
                contribution = delta
            else:
                # 3.5 legacy L2RegressionMomentum: m <- a m + b g, contribution m (1 - d)
                scale, shift, damping = self.momentum_mlp(g_level, lvl.momentum, context)
                new_momentum = scale * lvl.momentum + shift * g_level
                new_momentum = self._clamp_momentum(new_momentum, g_level)
                lvl.momentum = new_momentum
                contribution = new_momentum * (1.0 - damping)
            # 3.6 non-finite contribution: skip it (the state changes above stay)
            if bool(torch.isnan(contribution).any()) or bool(torch.isinf(contribution).any()):
                continue
            # 3.7
            update = update + contribution
            n_active += 1
        # 4. apply
        if n_active > 0:
            if n_active > 1:
                update = update / math.sqrt(n_active)           # geometric normalisation
            if bool(torch.isnan(update).any()) or bool(torch.isinf(update).any()):
                return
            if self.weight_decay > 0:
                update = update + self.weight_decay * p
            p.add_(update.to(p.dtype), alpha=-lr)

    @staticmethod
    def _clamp_momentum(momentum: torch.Tensor, g_level: torch.Tensor) -> torch.Tensor:
        """||m|| <= 100 * max(||g||, 1e-8); a Python branch (host sync)."""
        limit = MOMENTUM_CLAMP_RATIO * torch.clamp(g_level.norm(), min=1e-8)
        m_norm = momentum.norm()
        if m_norm > limit:
            momentum = momentum * (limit / m_norm)
        return momentum

    # -----------------------------------------------------------------------------------------
    # §9 meta-learning
    # -----------------------------------------------------------------------------------------
    def _update_meta_components(self, loss_value: float) -> None:
        """§9.2; called by step() in simple mode and by meta_update()."""
        # 1. mean momentum norm over all (tensor, level) pairs: one stacked reduction, one .item()
        norms = self._momentum_norms()
        mean_momentum_norm = torch.stack(norms).mean().item() if norms else 0.0
        # 2. history entry (one per meta-update call)
        self.meta_trainer.record_step(loss_value, self._lr_multipliers, mean_momentum_norm)
        # 3. stats (clipped grads after step(); zero grad column after meta_update(), B5)
        stats = self._compute_group_stats()
        with torch.enable_grad():
            # 4. controller proxy loss P on mu~ = controller(S), with gradients
            self.meta_optimizer.zero_grad()
            proposed = self.controller(stats)
            controller_loss = self.meta_trainer.compute_proxy_loss(proposed)
            # 5. MLP proxy loss Q (no gradient path to the MLP, B2)
            mlp_loss = self._compute_mlp_proxy_loss(loss_value)
            # 6. backprop P + Q, clip (MLP ++ controller) grads to 1.0, Adam step
            total = controller_loss + mlp_loss
            total.backward()
        meta_params = list(self.momentum_mlp.parameters()) + list(self.controller.parameters())
        grad_norm = _fused_clip_grad_norm_(meta_params, META_GRAD_CLIP, inplace=True)
        self.meta_optimizer.step()
        # 7. lazy device values
        self.last_meta_loss = total.detach()
        self.controller_grad_norm = grad_norm
        # 8. mu~ is discarded; _lr_multipliers is unchanged

    def _compute_mlp_proxy_loss(self, loss_value: float) -> torch.Tensor:
        """§9.3 'paper-aligned L2 regression' proxy; never differentiable in the MLP (B2)."""
        # 1. warmup
        if len(self.meta_trainer.loss_history) < PROXY_WARMUP_ENTRIES:
            return torch.zeros((), device=self.device, requires_grad=True)
        # 2. the first 5 tensors of each group, those with a gradient, at most 10 in total
        sampled = []
        for group in self.base_optimizer.param_groups:
            sampled.extend(p for p in group["params"][:META_SAMPLE_PER_GROUP] if p.grad is not None)
        sampled = sampled[:META_SAMPLE_MAX]
        context = self._get_context(loss_value)
        # 3. per-tensor losses
        losses = []
        for p in sampled:
            level0 = self.state[p].levels[0]
            target = level0.ema_grad
            if target.abs().max() < EMA_TARGET_MIN:          # host sync; always true in AdamW mode
                continue
            if self.use_preprocessing:
                pred = self.momentum_mlp(p.grad, level0.momentum)
            else:
                a, b, _ = self.momentum_mlp(p.grad, level0.momentum, context)
                pred = a * level0.momentum + b * p.grad
            diff = _tensor_stats(pred) - _tensor_stats(target)
            losses.append((diff ** 2).sum())
        if not losses:
            # nothing survived the filter: Q is structurally 0 (no stagnation constant)
            return torch.zeros((), device=self.device, requires_grad=True)
        # 4. mean over the kept tensors; 5. stagnation constant
        mlp_loss = torch.stack(losses).mean()
        if self.meta_trainer.recent_improvement() < IMPROVEMENT_THRESHOLD:
            mlp_loss = mlp_loss + STAGNATION_CONSTANT
        return mlp_loss

    def meta_update(self, val_batch, train_batches=None, loss_fn=None, use_unrolled=True):
        """§9.4. loss_fn(model, batch) -> loss; the default takes model(batch)['loss'|'total']."""
        if loss_fn is None:
            loss_fn = _default_loss_fn
        # unrolled branch (B3): broken upstream, raises here
        if use_unrolled and train_batches is not None and len(train_batches) >= self.k_unroll:
            self.unrolled_trainer.compute_meta_loss(self.model, self, train_batches, val_batch,
                                                    loss_fn)
            return
        # simplified branch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()                                          # 1.
        if (isinstance(val_batch, dict) and torch.is_tensor(val_batch.get("input_ids"))
                and val_batch["input_ids"].shape[0] > EXPLICIT_META_ROWS):    # 2. first 4 rows
            val_batch = {k: (v[:EXPLICIT_META_ROWS] if torch.is_tensor(v) and v.ndim > 0 else v)
                         for k, v in val_batch.items()}
        with torch.enable_grad():                                             # 3. no backward
            val_loss = loss_fn(self.model, val_batch)
        val_loss = val_loss.item() if torch.is_tensor(val_loss) else float(val_loss)   # 4.
        self.base_optimizer.zero_grad(set_to_none=True)                       # 5.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()                                          # 6.
        self._update_meta_components(val_loss)                                # 7. (B5)

    # -----------------------------------------------------------------------------------------
    # §12 / Appendix A checkpoints
    # -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Appendix A layout. Like torch optimizers, tensors are returned by reference."""
        cms_state = {}
        for index, st in enumerate(self.state.values()):     # insertion order = group order
            cms_state[index] = {
                level_idx: {
                    "momentum": lvl.momentum,
                    "step_count": lvl.step_count,
                    "accumulated_grad": lvl.accumulated_grad,
                    "ema_grad": lvl.ema_grad,
                    "v_sq": lvl.v_sq,
                }
                for level_idx, lvl in enumerate(st.levels)
            }
        sd = {
            "base_optimizer": self.base_optimizer.state_dict(),
            "momentum_mlp": self.momentum_mlp.state_dict(),
            "controller": self.controller.state_dict(),
            "meta_optimizer": self.meta_optimizer.state_dict(),
            "global_step": self.global_step,
            "lr_multipliers": self._lr_multipliers,
            "ema_loss": self.ema_loss,
            "cms_state": cms_state,
        }
        if self.mlp_optimizer is not None:
            sd["mlp_optimizer"] = self.mlp_optimizer.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of state_dict(). Missing lr_multipliers / ema_loss default to ones(2) /
        zeros(2) ON THE CPU (as the reference does, B10); missing ema_grad / v_sq to zeros.
        CMS tensors are copied to the device (copies, so the source dict is never aliased).
        Not restored (never saved): surrogate output history, meta-trainer histories."""
        self.base_optimizer.load_state_dict(state_dict["base_optimizer"])
        self.momentum_mlp.load_state_dict(state_dict["momentum_mlp"])
        self.controller.load_state_dict(state_dict["controller"])
        self.meta_optimizer.load_state_dict(state_dict["meta_optimizer"])
        if self.mlp_optimizer is not None and "mlp_optimizer" in state_dict:
            self.mlp_optimizer.load_state_dict(state_dict["mlp_optimizer"])
        self.global_step = state_dict.get("global_step", 0)
        if "lr_multipliers" in state_dict:
            self._lr_multipliers = state_dict["lr_multipliers"].to(self.device, copy=True)
        else:
            self._lr_multipliers = torch.ones(N_GROUPS)
        if "ema_loss" in state_dict:
            self.ema_loss = state_dict["ema_loss"].to(self.device, copy=True)
        else:
            self.ema_loss = torch.zeros(N_GROUPS)
        cms_state = state_dict.get("cms_state", {})
        for index, st in enumerate(self.state.values()):
            if index not in cms_state:
                continue
            for level_idx, saved in cms_state[index].items():
                lvl = st.levels[level_idx]
                lvl.momentum = saved["momentum"].to(self.device, torch.float32, copy=True)
                lvl.step_count = saved["step_count"]
                lvl.accumulated_grad = saved["accumulated_grad"].to(self.device, torch.float32,
                                                                    copy=True)
                if "ema_grad" in saved:
                    lvl.ema_grad = saved["ema_grad"].to(self.device, torch.float32, copy=True)
                else:
                    lvl.ema_grad = torch.zeros_like(lvl.momentum)
                if "v_sq" in saved:
                    lvl.v_sq = saved["v_sq"].to(self.device, torch.float32, copy=True)
                else:
                    lvl.v_sq = torch.zeros_like(lvl.momentum)


# The name the upstream module exports.
DeepNestedOptimizer = ReferenceDeepNestedOptimizer
