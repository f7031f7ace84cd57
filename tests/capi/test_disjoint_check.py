"""The C core's memory-sharing check over many tensors lying in the heap in no order related to
their lists (a real model's): the check sorts every tensor's bytes by address (tm_roles.c), and
a wrong sort or sweep would either refuse a disjoint set or miss, or misname, one overlap.

Each case lays the tensors of one role out as views of one buffer at shuffled, gapped offsets
(addresses differing in many bits, so the sort's every digit matters), steps them against torch,
then makes exactly one pair overlap and expects that pair named, nothing written."""

import random

import pytest
import torch

import titanmac_c
from conftest import expect_refused

COUNT = 300  # parameters: 1,500 tensors in the call


def _scattered(rng, sizes, gap_max):
    """Views of one zeroed buffer with these sizes, at shuffled offsets with random gaps between
    them: disjoint, their addresses in no order related to the list's."""
    order = list(range(len(sizes)))
    rng.shuffle(order)
    offsets, at = [0] * len(sizes), 0
    for i in order:
        at += rng.randrange(gap_max + 1)
        offsets[i] = at
        at += sizes[i]
    buf = torch.zeros(at + 1)
    return buf, [buf[o:o + n] for o, n in zip(offsets, sizes)]


def _model(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 3, 7, 64, 1000, 4097]) for _ in range(COUNT)]
    _, views = _scattered(rng, sizes, gap_max=5000)
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(v.copy_(torch.randn(v.shape))) for v in views]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return rng, sizes, params, theirs


def _set_grads(rng, sizes, params, theirs):
    _, grads = _scattered(rng, sizes, gap_max=100)
    for p, t, g in zip(params, theirs, grads):
        p.grad = g.copy_(torch.randn(g.shape))
        t.grad = p.grad.clone()


@pytest.mark.parametrize("seed", range(4))
def test_disjoint_scattered_tensors_step_as_torch(seed):
    rng, sizes, params, theirs = _model(seed)
    ours = titanmac_c.AdamW(params, lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1)
    for _ in range(3):
        _set_grads(rng, sizes, params, theirs)
        ours.step()
        ref.step()
    for p, t in zip(params, theirs):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_one_overlap_among_scattered_tensors_is_named(seed):
    """The state of every parameter moved into scattered views of one buffer (as a checkpoint
    loaded into a flat buffer would be), then one parameter's exp_avg_sq made to start inside
    another's last element: that pair is named, later index first."""
    rng, sizes, params, _ = _model(seed)
    opt = titanmac_c.AdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    buf, views = _scattered(rng, sizes, gap_max=50)
    for p, v in zip(params, views):
        v.copy_(opt.state[p]["exp_avg_sq"])
        opt.state[p]["exp_avg_sq"] = v
    # b's exp_avg_sq moved to start on the last element of a's, the view lying last in the
    # buffer: b then overlaps a and nothing else
    a = max(range(COUNT), key=lambda i: views[i].storage_offset())
    b = rng.choice([i for i in range(COUNT) if i != a])
    start = views[a].storage_offset() + sizes[a] - 1
    shared = torch.zeros(start + sizes[b])
    shared[:buf.numel()] = buf
    for i, p in enumerate(params):
        off = start if i == b else views[i].storage_offset()
        opt.state[p]["exp_avg_sq"] = shared[off:off + sizes[i]]
    first, later = sorted((a, b))
    expect_refused(opt, params, ValueError,
                   rf"^exp_avg_sq\[{later}\]: shares memory with exp_avg_sq\[{first}\] ")
