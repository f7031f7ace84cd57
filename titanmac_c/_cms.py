"""CMS mode of the DeepNestedOptimizer (spec section 7): the state it keeps, Phase 1 (surrogate
training of DirectUpdateMLP, torch autograd without host syncs) and the checkpoint layout.
Phase 2, the parameter update, is one call of the C core (tm_cms_step).

State per tensor and level l < K, as in the reference's ContinuumMemoryState: momentum m_l,
accumulated gradient A_l, gradient EMA e_l, squared-gradient EMA v_sq_l (all float32, the
parameter's shape), and the level's fire count, kept as a float32 device tensor [K] per tensor
(incremented by the C core, so a step skipped on the device does not count).
"""

import torch

from ._reference_dno import SURROGATE_MAX_TENSORS

CMS_BUFFERS = ("momentum", "accumulated_grad", "ema_grad", "v_sq")


def level_frequencies(cms_frequencies, consistent=False):
    """Level l fires every B**l steps, B = cms_frequencies[1] (10 with one level): spec 7.1, B7.
    consistent (fix_reference_bugs): level l fires every cms_frequencies[l] steps, the period
    its gradient sum is divided by."""
    if consistent:
        return [int(f) for f in cms_frequencies]
    base = cms_frequencies[1] if len(cms_frequencies) > 1 else 10
    return [int(base ** level) for level in range(len(cms_frequencies))]


class CMSState:
    """The CMS buffers of every grouped tensor, as per-level lists in group order."""

    def __init__(self, params, cms_frequencies, device, consistent=False):
        self.params = list(params)
        self.k = len(cms_frequencies)
        self.frequencies = level_frequencies(cms_frequencies, consistent)
        self.ema_decays = [0.99 ** (1.0 / f) for f in self.frequencies]
        self.index = {p: i for i, p in enumerate(self.params)}
        f32 = dict(dtype=torch.float32, device=device)
        self.buffers = {name: [[torch.zeros(p.shape, **f32) for p in self.params]
                               for _ in range(self.k)] for name in CMS_BUFFERS}
        self.step_counts = [torch.zeros(self.k, **f32) for _ in self.params]

    def public_view(self):
        """optimizer.state in CMS mode: per parameter its buffers by level (views, not copies)."""
        view = {}
        for i, p in enumerate(self.params):
            entry = {name: [self.buffers[name][level][i] for level in range(self.k)]
                     for name in CMS_BUFFERS}
            entry["step_count"] = self.step_counts[i]
            view[p] = entry
        return view

    def momenta(self):
        return [m for level in self.buffers["momentum"] for m in level]

    def level_lists(self, name, indices):
        """Per-level lists of buffer `name` for the tensors at `indices`."""
        return [[level[i] for i in indices] for level in self.buffers[name]]

    def fires(self, t):
        return [t % f == 0 for f in self.frequencies]

    # -------------------------------------------------------------- checkpoints (Appendix A)

    def state_dict(self):
        """{tensor index: {level: {momentum, step_count (int), accumulated_grad, ema_grad,
        v_sq}}}; the step counts are read from the device here (checkpointing may sync)."""
        out = {}
        for i in range(len(self.params)):
            counts = self.step_counts[i].tolist()
            out[i] = {level: dict({name: self.buffers[name][level][i] for name in CMS_BUFFERS},
                                  step_count=int(counts[level]))
                      for level in range(self.k)}
        return out

    @torch.no_grad()
    def load_state_dict(self, cms_state):
        """Copies into the existing buffers; a missing ema_grad / v_sq (older checkpoints) loads
        as zeros, as in the reference."""
        for i, levels in cms_state.items():
            if i >= len(self.params):
                raise ValueError(f"cms_state[{i}]: the optimizer has {len(self.params)} tensors")
            for level, saved in levels.items():
                if level >= self.k:
                    raise ValueError(f"cms_state[{i}][{level}]: the optimizer has {self.k} levels")
                for name in CMS_BUFFERS:
                    buf = self.buffers[name][level][i]
                    value = saved.get(name)
                    if value is None and name in ("momentum", "accumulated_grad"):
                        raise ValueError(f"cms_state[{i}][{level}]: no {name!r}")
                    if value is not None and value.shape != buf.shape:
                        raise ValueError(f"cms_state[{i}][{level}][{name!r}]: shape "
                                         f"{tuple(value.shape)}, expected {tuple(buf.shape)}")
                    buf.copy_(value if value is not None else torch.zeros_like(buf))
                self.step_counts[i][level] = float(saved.get("step_count", 0))


def surrogate_loss(output, target, prev_output=None):
    """Spec 7.4, R + 0.1 M + T, with the reference's branches on norms as torch.where (no host
    sync); the unused branch is computed on safe denominators so it cannot poison gradients."""
    o = output.reshape(-1)
    g = target.reshape(-1)
    eps = 1e-8
    g_norm, o_norm = g.norm(), o.norm()
    g_ok, o_ok = g_norm > eps, o_norm > eps
    # F.cosine_similarity divides by max(||o|| * ||g||, 1e-8); only used where both are > 1e-8
    cos = (o * g).sum() / torch.clamp(o_norm * g_norm, min=eps)
    direction = torch.where(g_ok & o_ok, 1.0 - cos, torch.zeros_like(cos))
    magnitude = torch.where(g_ok, (o_norm / torch.clamp(g_norm, min=eps) - 1.0) ** 2,
                            o_norm ** 2)
    loss = direction + 0.1 * magnitude
    if prev_output is not None and prev_output.shape == output.shape:
        loss = loss + 0.1 * torch.mean((output - prev_output) ** 2)
    return loss


def select_phase1_tensors(param_groups):
    """The first (at most) 20 tensors with a gradient, walking the groups in order (7.2)."""
    selected = []
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None:
                selected.append(p)
                if len(selected) >= SURROGATE_MAX_TENSORS:
                    return selected
    return selected


@torch.no_grad()
def init_output_on_sign(mlp):
    """The corrected B4: DirectUpdateMLP starts at output = 0.1 * sign_g exactly (the intent of
    the reference's weight[0, 1] = 0.1, which lands on a hidden unit instead). Hidden units 0 and
    1 read only sign_g, with opposite signs, and every later hidden layer carries them on; since
    SiLU(x) - SiLU(-x) = x, the output layer's weights (0.1, -0.1) on them give 0.1 * sign_g."""
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    first, hidden, out = linears[0], linears[1:-1], linears[-1]
    if first.out_features < 2:
        raise ValueError("fix_reference_bugs needs a momentum MLP of width >= 2")
    first.weight[0:2].zero_()
    first.weight[0, 1], first.weight[1, 1] = 1.0, -1.0  # feature 1 is sign_g
    first.bias[0:2].zero_()
    for layer in hidden:
        layer.weight[0:2].zero_()
        layer.weight[0, 0], layer.weight[0, 1] = 1.0, -1.0
        layer.weight[1, 0], layer.weight[1, 1] = -1.0, 1.0
        layer.bias[0:2].zero_()
    out.weight.zero_()
    out.bias.zero_()
    out.weight[0, 0], out.weight[0, 1] = 0.1, -0.1
