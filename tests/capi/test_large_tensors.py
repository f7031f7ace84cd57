"""Tensors of more than 2^31 elements: every index past int32's range must reach its element.

A billion-parameter model's embedding or output matrix can hold more than 2^31 elements (a
262,144-token vocabulary at width 8,192). An index or offset kept in 32 bits somewhere in a loop
would wrap there: the tail would go unwritten, or the write would land in the head (or outside
the tensor). These tests give such a tensor distinct values in its head and its tail (and a known
constant between them), run the ops, and check head and tail element by element against torch on
copies of those slices, and the middle against its known value.

They need about 18 GB of memory on their device (four 4.3 GB half-precision tensors for AdamW), so
they run only with TITANMAC_LARGE_TESTS=1 (benchmarks/gpu_check.sh's "large" step sets it on the
GPU); otherwise pytest reports them as skipped.
"""

import gc
import os

import pytest
import torch

import titanmac_c
from conftest import DEVICES, tol

pytestmark = [pytest.mark.large, pytest.mark.skipif(
    os.environ.get("TITANMAC_LARGE_TESTS") != "1",
    reason="needs ~18 GB on its device: set TITANMAC_LARGE_TESTS=1")]

N = 2**31 + 77  # past int32's range, and not a multiple of any vector width or chunk
EDGE = 64  # elements with random values at each end
MIDDLE = 0.25  # the value of every element between them


@pytest.fixture(autouse=True)
def _free_between_tests():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ends(t):
    """The two slices that carry random values: the head and the tail."""
    return t[:EDGE], t[-EDGE:]


def structured(dtype, device, gen):
    """N elements: random head and tail, MIDDLE everywhere else."""
    t = torch.full((N,), MIDDLE, dtype=dtype, device=device)
    for part in ends(t):
        part.copy_(torch.randn(EDGE, generator=gen))
    return t


def exact_norm(t, norm_type):
    """The norm of a structured tensor, in float64, from its ends and its constant middle."""
    head, tail = (part.double().cpu() for part in ends(t))
    middle = torch.tensor(float(t[EDGE].item()), dtype=torch.float64)
    rest = N - 2 * EDGE
    if norm_type == float("inf"):
        return max(head.abs().max(), tail.abs().max(), middle.abs()).item()
    total = head.abs().pow(norm_type).sum() + tail.abs().pow(norm_type).sum()
    return (total + rest * middle.abs().pow(norm_type)).pow(1.0 / norm_type).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_total_norm_of_a_tensor_past_int32(device, norm_type):
    gen = torch.Generator().manual_seed(1)
    g = structured(torch.float32, device, gen)
    norm = titanmac_c.get_total_norm([g], norm_type)
    assert norm.dtype == torch.float32 and norm.device == g.device
    torch.testing.assert_close(norm.double().cpu().item(), exact_norm(g, norm_type),
                               rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_scales_every_element_past_int32(device):
    gen = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.zeros(N, dtype=torch.float16, device=device))
    p.grad = structured(torch.float16, device, gen)
    before = [part.clone() for part in ends(p.grad)]
    expected_norm = exact_norm(p.grad, 2.0)
    max_norm = expected_norm / 4
    norm = titanmac_c.clip_grad_norm_([p], max_norm)
    torch.testing.assert_close(norm.double().cpu().item(), expected_norm, rtol=1e-3, atol=0.0)
    # torch's clip on the ends, with the coefficient of the whole tensor's norm (from the exact
    # norm: the one returned is rounded to float16, 8 units apart at this size)
    coef = torch.tensor(max_norm / (expected_norm + 1e-6), dtype=torch.float32).clamp(max=1.0)
    for part, orig in zip(ends(p.grad), before):
        torch.testing.assert_close(part, orig.mul(coef.to(device)), **tol(torch.float16, device))
    middle = p.grad[EDGE:-EDGE]
    assert bool((middle == torch.tensor(MIDDLE * float(coef), dtype=torch.float16)).all())


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_updates_every_element_past_int32(device):
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    p = torch.nn.Parameter(structured(dtype, device, gen))
    # torch's fused AdamW (fp32 math, one rounding per store, as ours) on copies of the ends,
    # stepped on the same gradients
    copies = [torch.nn.Parameter(part.detach().clone()) for part in ends(p)]
    kw = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
    ours, theirs = titanmac_c.AdamW([p], **kw), torch.optim.AdamW(copies, fused=True, **kw)
    for step in range(3):
        p.grad = structured(dtype, device, gen)
        for c, part in zip(copies, ends(p.grad)):
            c.grad = part.clone()
        ours.step()
        theirs.step()
        del p.grad
    t = tol(dtype, device)
    state = ours.state[p]
    assert float(state["step"]) == 3.0
    for c, part, avg, avg_sq in zip(copies, ends(p), ends(state["exp_avg"]),
                                     ends(state["exp_avg_sq"])):
        torch.testing.assert_close(part.detach(), c.detach(), **t)
        torch.testing.assert_close(avg, theirs.state[c]["exp_avg"], **t)
        torch.testing.assert_close(avg_sq, theirs.state[c]["exp_avg_sq"], **t)
    # the middle: a constant parameter with a constant gradient stays one value, torch's
    mid = torch.nn.Parameter(torch.full((4,), MIDDLE, dtype=dtype, device=device))
    mid_opt = torch.optim.AdamW([mid], fused=True, **kw)
    for _ in range(3):
        mid.grad = torch.full_like(mid, MIDDLE)
        mid_opt.step()
    assert bool((p.detach()[EDGE:-EDGE] == mid.detach()[0]).all())
