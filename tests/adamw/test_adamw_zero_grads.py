"""_C.adamw_step(zero_grads_on_skip=True): with skip[0] != 0 every grad element becomes +0.0 and
nothing else changes (params, state, steps, and on CUDA the scratch counter, bit for bit); with
skip[0] == 0 the step is an ordinary one. Grads must then be writable."""

import math

import numpy as np
import pytest
import torch

from conftest import DEVICES, SIZES
from titanmac_c import _C

def adamw_lists(device, dtype):
    gen = torch.Generator().manual_seed(11)
    sizes = SIZES + [0]

    def rnd(n):
        return torch.randn(n, generator=gen).to(device=device, dtype=dtype)

    params = [rnd(n) for n in sizes]
    grads = [rnd(n) for n in sizes]
    ms = [rnd(n) * 0.1 for n in sizes]
    vs = [rnd(n).abs() * 0.01 for n in sizes]
    steps = [torch.full((), 3.0, device=device) for _ in sizes]
    return [params, grads, ms, vs, [], steps]


def adamw_call(lists, device, skip, zero):
    lr = torch.full((1,), 1e-2, device=device)
    scratch = None
    if device == "cuda":
        scratch = torch.zeros(max(_C.adamw_scratch_bytes(*lists), 1), dtype=torch.uint8,
                              device=device)
    skip_t = None if skip is None else torch.full((1,), skip, device=device)
    _C.adamw_step(*lists, lr, [(0.9, 0.999, 1e-8, 0.01, False)], skip=skip_t,
                  zero_grads_on_skip=zero, scratch=scratch)
    return scratch


def clone_lists(lists):
    return [[t.clone() for t in lst] for lst in lists]


def lists_equal(a, b):
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("skip", [1.0, math.nan])
def test_skip_zeroes_grads_and_nothing_else(device, dtype, skip):
    lists = adamw_lists(device, dtype)
    before = clone_lists(lists)
    scratch = adamw_call(lists, device, skip, zero=True)
    for g in lists[1]:
        assert torch.equal(g, torch.zeros_like(g)) and not torch.signbit(g).any()
    kept = [lst for k, lst in enumerate(lists) if k != 1]
    kept_before = [lst for k, lst in enumerate(before) if k != 1]
    assert lists_equal(kept, kept_before)
    if scratch is not None:
        assert int(scratch.count_nonzero()) == 0  # the step counter protocol left it zero


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_no_skip_is_a_normal_step(device, dtype):
    a = adamw_lists(device, dtype)
    b = clone_lists(a)
    grads_before = [g.clone() for g in a[1]]
    adamw_call(a, device, 0.0, zero=True)
    adamw_call(b, device, None, zero=False)
    assert lists_equal(a, b)
    assert all(torch.equal(g, g0) for g, g0 in zip(a[1], grads_before))
    assert a[5][0].item() == 4.0


@pytest.mark.parametrize("device", DEVICES)
def test_skip_without_zeroing_changes_nothing(device):
    lists = adamw_lists(device, torch.float32)
    before = clone_lists(lists)
    adamw_call(lists, device, 1.0, zero=False)
    assert lists_equal(lists, before)


def test_read_only_grads_cannot_be_zeroed():
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    g.flags.writeable = False
    m, v, step = np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(1, np.float32)
    lr, skip = np.full(1, 0.1, np.float32), np.ones(1, np.float32)
    hp = [(0.9, 0.999, 1e-8, 0.0, False)]
    with pytest.raises(BufferError, match=r"^grads\[0\]: read-only, cannot be zeroed$"):
        _C.adamw_step([p], [g], [m], [v], [], [step], lr, hp, skip=skip, zero_grads_on_skip=True)
    assert (g == 0.5).all() and (p == 1).all() and (step == 0).all()
    # Without zeroing (or without a skip flag) read-only grads are fine.
    _C.adamw_step([p], [g], [m], [v], [], [step], lr, hp, skip=skip)
    _C.adamw_step([p], [g], [m], [v], [], [step], lr, hp, zero_grads_on_skip=True)
    assert step[0] == 1 and (g == 0.5).all()


def test_skip_inside_a_grad_is_rejected():
    g = torch.ones(8)
    p, m, v, step = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.zeros(())
    with pytest.raises(ValueError,
                       match=r"^skip: shares memory with grads\[0\]$"):
        _C.adamw_step([p], [g], [m], [v], [], [step], torch.full((1,), 0.1),
                      [(0.9, 0.999, 1e-8, 0.0, False)], skip=g[3:4], zero_grads_on_skip=True)
    assert torch.equal(g, torch.ones(8)) and step.item() == 0
