"""Phase 1 of the CMS step on CUDA (docs/deep_nested_optimizer.md 7.2, loss 7.4): the gradient of
the DirectUpdateMLP's surrogate loss over the selected tensors, by the algorithm of the C core's
CPU op (csrc/cpu/cpu_cms_surrogate.c) in torch ops, with that op's contract (_C.cms_surrogate).

Autograd of the reference's loss ran ~3,100 ATen ops a Phase 1 over the TitanMAC-like model's 20
tensors, plus the autograd engine's and nn.Module's host time: ~78 ms a Phase 1 on an H100 system's
host, as much as the reference's own. Here the loss's gradient with respect to the MLP's output
o is written out and the MLP's backward by hand, over chunks holding many tensors' elements:

  pass 1: per chunk o = MLP(g, m), and per tensor the sums of g^2, o^2, o g and (o - prev)^2 in
          double;
  then:   per tensor the loss and d loss / d o = co o + cg g + ct (o - prev) from those sums
          (surrogate_coefficients);
  pass 2: per chunk the forward again, keeping each layer's SiLU output and derivative, the
          backward of d loss / d o (the weights' gradients summed in float32 over blocks of 64
          rows, the blocks in double: _rows_outer_sum), o into the outputs.

~800 ATen ops a Phase 1 there (4 chunks; benchmarks/bench_phase1.py), no autograd. No op reads
a device value on the host and no tensor is made from host data (the reference's branches on
norms are selects; per-tensor constants are made by fills, once per layout): no host sync.
"""

import math

import torch

from .nets import PREPROCESS_P

# Chunks of 2^20 elements, or as many as the largest tensor up to 2^22: each chunk costs ~150
# ops, and pass 2 holds ~0.6 KB an element at width 20 and depth 2 (per hidden layer the
# [n, 20] float32 SiLU output and derivative kept, and the forward's temporaries): ~0.6 GB at
# 2^20, where the reference's autograd holds ~0.4 KB an element for all 20 tensors at once
# (~1.3 GB on the TitanMAC-like model, whose 20 tensors hold 3.2M elements: 4 chunks here).
CHUNK_MIN = 1 << 20
CHUNK_MAX = 1 << 22
# Rows summed in float32 in the weights' gradients (_rows_outer_sum): as accurate as the C op's
# double sums (tests/cms/test_cms_surrogate.py: <= 1e-6 of the largest entry); one float32 sum over
# a chunk's rows (a plain matmul) was 1e-3 off at 72,000 rows, and a double matmul is ~20x
# slower on a CPU and 1/64 rate on most GPUs.
ROW_BLOCK = 64

SURROGATE_EPS = 1e-8  # the reference's threshold on both norms


class SurrogatePlan:
    """How surrogate_gradient walks tensors of these sizes: chunks (lists of (tensor, start, end)
    element ranges; a tensor is split where a chunk fills up), each tensor's range of pieces in
    chunk order, and as device tensors 1 / numel per tensor and per chunk its pieces' tensors and
    lengths (which spread the per-tensor coefficients over the chunk's elements)."""

    def __init__(self, sizes, device, chunk=None):
        if chunk is None:
            chunk = min(max(max(sizes, default=0), CHUNK_MIN), CHUNK_MAX)
        self.chunks, self.pieces_of = [[]], []
        room, piece = chunk, 0
        for j, n in enumerate(sizes):
            first, a = piece, 0
            while True:
                if room == 0:
                    self.chunks.append([])
                    room = chunk
                b = min(n, a + room)
                self.chunks[-1].append((j, a, b))
                piece, room, a = piece + 1, room - (b - a), b
                if a == n:
                    break
            self.pieces_of.append((first, piece))
        self.one_piece_each = piece == len(sizes)

        # fills, not torch.tensor(list): a host-to-device copy would synchronize
        def vector(values, dtype):
            return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])

        # an empty tensor's 1 / numel is 1 (its (o - prev) sum is 0; surrogate_gradient makes its
        # loss NaN where it has a previous output, the reference's mean over no elements)
        self.inv_numel = vector([1.0 / max(n, 1) for n in sizes], torch.float64)
        self.piece_sizes = [[b - a for _, a, b in c] for c in self.chunks]
        self.tensor_of = [vector([j for j, _, _ in c], torch.int64) for c in self.chunks]
        self.lengths = [vector(sizes, torch.int64) for sizes in self.piece_sizes]


def surrogate_coefficients(sums, inv_numel):
    """Per tensor, from its sums [g^2, o^2, o g, (o - prev)^2] (rows of sums, double; (o - prev)
    is 0 without a previous output): the surrogate loss R + 0.1 M + 0.1 T and the coefficients
    [co, cg, ct] of d loss / d o = co o + cg g + ct (o - prev), divided by the number of tensors
    (the mean over tensors). The terms as torch's autograd differentiates the reference's loss
    (eps = 1e-8, a norm of 0 has gradient 0):
      R = 1 - cos(o, g) when ||g|| > eps and ||o|| > eps, else 0; P = ||o|| ||g||:
          d/do = -g / P + (o.g) o / (||o||^2 P)
      M = (||o|| / ||g|| - 1)^2 when ||g|| > eps:  d/do = 2 (||o|| / ||g|| - 1) o / (||g|| ||o||)
      M = ||o||^2 otherwise:                        d/do = 2 o
      T = mean((o - prev)^2):                       d/do = 2 (o - prev) / numel
    cpu_cms_surrogate.c's loss_and_coefs, with the branches as selects (the branch not taken
    computed on safe denominators). Returns (losses float32 [n], coefficients float32 [3, n])."""
    gg, oo, og, tt = sums.unbind(1)
    on, gn = oo.sqrt(), gg.sqrt()
    zero, one = torch.zeros_like(on), torch.ones_like(on)
    g_ok = gn > SURROGATE_EPS
    both = g_ok & (on > SURROGATE_EPS)
    p = torch.where(both, on * gn, one)
    loss = torch.where(both, 1.0 - og / p, zero)
    cg = torch.where(both, -1.0 / p, zero)
    co = torch.where(both, og / (on * on * p), zero)
    r = on / torch.where(g_ok, gn, one) - 1.0
    loss = loss + torch.where(g_ok, 0.1 * (r * r), 0.1 * (on * on))
    normed = g_ok & (on > 0.0)
    co = co + torch.where(normed, 0.1 * 2.0 * r / torch.where(normed, gn * on, one),
                          torch.where(g_ok, zero, 0.1 * 2.0 * one))
    loss = loss + 0.1 * (tt * inv_numel)
    ct = 0.1 * 2.0 * inv_numel
    return loss.float(), (torch.stack([co, cg, ct]) / sums.shape[0]).float()


def _features(g, m):
    """The MLP's input [log_g, sign_g, log_m, sign_m] per element, [n, 4]: the reference's
    preprocess_gradient (|x| >= e^-p: (ln|x| / p, sign x), else (-1, e^p x)) on g and m at once."""
    v = torch.stack([g, m], dim=1)
    absv = v.abs()
    big = absv >= math.exp(-PREPROCESS_P)
    log_feat = torch.where(big, torch.log(absv) / PREPROCESS_P, -1.0)
    sign_feat = torch.where(big, torch.sign(v), math.exp(PREPROCESS_P) * v)
    return torch.stack([log_feat, sign_feat], dim=2).view(-1, 4)


def _mlp_forward(weights, x, keep):
    """DirectUpdateMLP.net on the features x [n, 4]: o [n] and, when keep, every layer's input
    (x, then the SiLU outputs) and SiLU's derivative at each hidden layer."""
    inputs, derivs = [x], []
    a = x
    for w, b in zip(weights[0:-2:2], weights[1:-2:2]):
        z = torch.addmm(b, a, w.t())
        a = torch.nn.functional.silu(z)  # the same o in both passes
        if keep:
            s = torch.sigmoid(z)
            derivs.append(s + a * (1.0 - s))  # SiLU'(z) = s (1 + z (1 - s))
            inputs.append(a)
    return torch.addmm(weights[-1], a, weights[-2].t()).view(-1), inputs, derivs


def _rows_outer_sum(d, x):
    """sum over rows of d[r]^T x[r] (d [n, H], x [n, K]) as [H, K] double: float32 products
    summed over blocks of ROW_BLOCK rows (one batched matmul), the blocks' sums in double."""
    n = d.shape[0]
    full = n - n % ROW_BLOCK
    total = 0.0
    if full:
        blocks = torch.bmm(d[:full].view(-1, ROW_BLOCK, d.shape[1]).transpose(1, 2),
                           x[:full].view(-1, ROW_BLOCK, x.shape[1]))
        total = blocks.sum(0, dtype=torch.float64)
    if full < n:
        total = total + (d[full:].t() @ x[full:]).double()
    return total


def _mlp_backward(weights, inputs, derivs, dout, grads):
    """grads (double, the module's order) += the weights' gradients of sum(o dout)."""
    d = dout.view(-1, 1)
    for k in range(len(weights) - 2, -1, -2):  # the layers, last first
        grads[k].add_(_rows_outer_sum(d, inputs[k // 2]))
        grads[k + 1].add_(d.sum(0, dtype=torch.float64))
        if k > 0:
            d = (d @ weights[k]) * derivs[k // 2 - 1]


def _part(t, start, stop):
    """t[start:stop]: a slice is an op, none for the whole tensor."""
    return t if start == 0 and stop == t.numel() else t[start:stop]


def _join(parts):
    """The parts concatenated: a cat is an op, none for one part."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def surrogate_gradient(targets, momentum, outputs, weights, weight_grads, losses, *, divisor,
                       has_prev, scale=None, plan=None):
    """_C.cms_surrogate in torch ops: g_i = targets[i] * scale / divisor (float32, the
    reference's ops in its order; a non-finite element counts as 0, so scale 0 makes every g_i
    zero whatever the targets hold), o_i = MLP(g_i, momentum[i]) with the DirectUpdateMLP weights
    (weights: its parameters in module order); the gradient of mean_i loss(o_i, g_i, prev_i) is
    written into weight_grads, each loss into losses (float32 [n]), o_i into outputs[i]
    (float32, targets[i]'s numel), which is also prev_i where has_prev[i]. plan: a SurrogatePlan
    for these sizes (made here when None; callers on CUDA keep one, as it launches a few fills
    per tensor)."""
    if plan is None:
        plan = SurrogatePlan([t.numel() for t in targets], targets[0].device)
    flat = [t.reshape(-1) for t in targets]
    moms = [m.reshape(-1) for m in momentum]
    outs = [o.view(-1) for o in outputs]

    def pieces(x, c):  # the rows of x (chunk c's elements) by piece, in the chunk's order
        return x.split(plan.piece_sizes[c]) if len(plan.chunks[c]) > 1 else (x,)

    def chunk_pass(c, keep):
        chunk = plan.chunks[c]
        g = _join([_part(flat[j], a, b) for j, a, b in chunk]).float()
        g = (g * scale if scale is not None else g) / divisor
        g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)  # as the C op: non-finite -> 0
        m = _join([_part(moms[j], a, b) for j, a, b in chunk])
        o, inputs, derivs = _mlp_forward(weights, _features(g, m), keep)
        # a tensor without a previous output gets o itself: o - prev = 0, no temporal term in
        # its loss or its gradient, and no per-tensor flag on the device
        prev = _join([_part(outs[j], a, b) if has_prev[j] else own
                     for (j, a, b), own in zip(chunk, pieces(o, c))])
        return g, o, o - prev, inputs, derivs

    with torch.no_grad():
        sums = []
        for c in range(len(plan.chunks)):
            g, o, d, _, _ = chunk_pass(c, keep=False)
            both = torch.stack([g, o, o, d, g, o, g, d], dim=1).double()
            v = both[:, :4] * both[:, 4:]  # g^2, o^2, o g, (o - prev)^2, exact in double
            sums.extend(rows.sum(0) for rows in pieces(v, c))
        sums = torch.stack(sums)
        if not plan.one_piece_each:
            sums = torch.stack([sums[a:b].sum(0) for a, b in plan.pieces_of])
        tensor_losses, coefs = surrogate_coefficients(sums, plan.inv_numel)
        grads = [torch.zeros(w.shape, dtype=torch.float64, device=w.device) for w in weights]
        for c, chunk in enumerate(plan.chunks):
            g, o, d, inputs, derivs = chunk_pass(c, keep=True)
            co, cg, ct = coefs.index_select(1, plan.tensor_of[c]).repeat_interleave(
                plan.lengths[c], dim=1, output_size=o.numel())
            _mlp_backward(weights, inputs, derivs, co * o + cg * g + ct * d, grads)
            # after this chunk's last read of the previous outputs
            for (j, a, b), own in zip(chunk, pieces(o, c)):
                _part(outs[j], a, b).copy_(own)
        for wg, acc in zip(weight_grads, grads):
            wg.copy_(acc)
        losses.copy_(tensor_losses)
        for j, t in enumerate(targets):
            if has_prev[j] and t.numel() == 0:
                losses[j] = math.nan  # the temporal mean over no elements, as the reference's
