"""Helpers of the CMS-mode parity tests (tests/cms/test_deep_nested_cms.py and the layouts'
tests): the reference and ours from one state, one step, and the comparison of parameters, CMS
buffers and multipliers with its tolerances.

Tolerance (fp32): as in AdamW mode, norms and the MLP evaluations are summed in a different order
than torch's (the C core evaluates the per-element MLP itself), a few ulps per step; over 250
steps parameters agree within PARAM_TOL.
"""

import math

import torch

from conftest import assert_nmse_close, reference_and_ours
from dno_models import loss_fn, make_mlp_10_32_5

PARAM_TOL = dict(rtol=1e-4, atol=1e-6)
NAN_GRAD_STEP = 37
# The DirectUpdateMLP path is chaotic in its last bits: when m' = 0.9 m + 0.1 delta cancels to
# |m| < e^-10, the next step's sign feature multiplies a last-bit difference by e^10 = 22026,
# and Phase 1 trains the MLP on those momenta. The reference run against itself with one MLP
# weight moved by 1 ulp diverges far beyond rounding within 100 steps
# (test_reference_itself_is_this_sensitive). So: the legacy network runs free for 250 steps; the
# direct network runs free for 50 steps, and over 250 steps each step starts from the reference's
# state (parameters, CMS buffers, MLP and its optimizer: sync_cms_from_reference), which checks
# every step's computation on 250 evolving states, level-2 firings and the NaN step included.
# There each step's update is compared element by element (within 1e-4 of itself plus 2 ulps of
# the parameter: p - lr u rounds to p's ulp), and so are the CMS buffers in every run that does
# not drift (STATE_REL of the element plus STATE_REL of the tensor's largest element; measured:
# 2.2e-6 of the largest element with the direct network resynced, 6.8e-7 with the legacy one
# free over 250 steps). The one free-running direct test compares buffers by normalized squared
# error (conftest.assert_nmse_close).
STATE_REL = 1e-5


def randomize_legacy_output(ref, ours):
    """The reference zeroes the legacy network's output layer and nothing ever trains it (no
    surrogate, no gradient from the meta loss), so (a, b, d) would be constants and the network's
    inputs (statistics of m and g, t, base_lr, the loss) untested: random output weights, the
    same in both."""
    out = ref.momentum_mlp.net[-1]
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        out.weight.copy_((torch.rand(out.weight.shape, generator=gen) - 0.5) * 0.6)
    ours.momentum_mlp.load_state_dict(ref.momentum_mlp.state_dict())


def cms_pair(device, model=None, **kw):
    model = make_mlp_10_32_5(seed=0) if model is None else model
    pair = reference_and_ours(model.to(device), use_cms_updates=True, **kw)
    if not kw.get("use_preprocessing", True):
        randomize_legacy_output(pair[0][1], pair[1][1])
    return pair


def set_phase1_path(opt, path):
    """How ours runs CMS Phase 1 (CMSMode): "cpu" (the CPU's way: the C op, the skip flag read
    on the host), "torch" (CUDA's default: torch ops, the skip applied on the device), "core"
    (TITANMAC_CUDA_PHASE1=core: the C op and the C core's AdamW for the MLP's Adam step, the skip
    applied on the device). Any of them on either device."""
    opt._cms_mode.phase1_cpu_path = path == "cpu"
    opt._cms_mode.phase1_core = path == "core"


def cms_step(model, opt, batch, step, inject=True):
    opt.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    if inject and step == NAN_GRAD_STEP:
        next(model.parameters()).grad.view(-1)[3] = math.nan
    return opt.step(loss.item())


def assert_state_close(actual, expected, what):
    """Same non-finite positions; elsewhere |a - e| <= STATE_REL (|e| + max |e|)."""
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    assert torch.equal(torch.isfinite(a), finite), f"{what}: non-finite elements differ"
    a, e = a[finite], e[finite]
    if e.numel():
        bound = STATE_REL * (e.abs() + e.abs().max())
        worst = float(((a - e).abs() / bound.clamp(min=1e-300)).max())
        assert worst <= 1.0, f"{what}: {worst:.2f} x the tolerance"


def assert_update_close(p_ours, p_ref, p_before, what):
    """From the same p_before: ours moved p as the reference did, within 1e-4 of the update plus
    2 ulps of p (the rounding of p - lr u) plus 1e-6 of the tensor's largest update (an update
    that cancels to nearly 0 keeps the float32 roundings of its terms: a float64 parameter's
    ulps are too small to cover them)."""
    before = p_before.detach().double()
    u_ours, u_ref = p_ours.detach().double() - before, p_ref.detach().double() - before
    ulp = (torch.nextafter(p_before.detach().abs(),
                          torch.tensor(math.inf, device=p_before.device)) -
           p_before.detach().abs()).double()
    bound = 1e-4 * u_ref.abs() + 2 * ulp + 1e-6 * u_ref.abs().max()
    worst = float(((u_ours - u_ref).abs() / bound).max())
    assert worst <= 1.0, f"{what}: update {worst:.2f} x the tolerance"


def compare_cms(ref, ours, model_ref, model_ours, step, before=None, elementwise=True):
    """Parameters (element-wise; with `before`, the parameters both started this step from,
    the step's update), CMS buffers m_l, A_l, e_0 and fire counts, multipliers."""
    check = assert_state_close if elementwise else assert_nmse_close
    for i, ((name, pr), po) in enumerate(zip(model_ref.named_parameters(),
                                             model_ours.parameters())):
        if before is None:
            torch.testing.assert_close(po.detach(), pr.detach(), **PARAM_TOL,
                                       msg=lambda m: f"step {step} {name}: {m}")
        else:
            assert_update_close(po, pr, before[i], f"step {step} {name}")
        for level, (mine, lvl) in enumerate(zip(ours.state[po].levels, ref.state[pr].levels)):
            check(mine.momentum, lvl.momentum, f"step {step} {name} m{level}")
            check(mine.accumulated_grad, lvl.accumulated_grad, f"step {step} {name} A{level}")
            if level == 0:
                check(mine.ema_grad, lvl.ema_grad, f"step {step} {name} e0")
            assert mine.step_count == lvl.step_count, (step, name, level)
    torch.testing.assert_close(ours.get_lr_multipliers(), ref.get_lr_multipliers(), rtol=1e-5,
                               atol=1e-6)
