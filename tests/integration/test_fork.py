"""A process forked after a multi-threaded call (multiprocessing's fork start method, forked
evaluation or sweep workers). GNU OpenMP's thread team, which torch's CPU ops and ours share,
does not survive fork(): a child's first parallel region waits forever for the parent's threads,
in torch's ops as in ours. torch's answer, which DataLoader workers apply, is
torch.set_num_threads(1) in the child; the C core takes torch's thread count at every call, so it
holds for our calls too. The child's results are compared with the parent's, bit for bit."""

import io
import os
import select
import time

import pytest
import torch

import titanmac_c
from conftest import clone_params, set_grads

SIZES = (3, 70000, 300000)  # above the C core's serial threshold: a parallel region


def _work(params):
    """Every CPU loop kind: the norm pass, the clip's scale, the fused clip and AdamW step."""
    norm = titanmac_c.get_total_norm([p.grad for p in params])
    clipped = titanmac_c.clip_grad_norm_(params, 0.5)
    opt = titanmac_c.AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.clip_grad_norm_(1e-3)
        opt.step()
    return [norm, clipped] + [p.detach() for p in params]


def _child_results(params, timeout=60.0):
    """_work(params) run in a forked child, its results sent back through a pipe; fails the test
    when the child has not answered within timeout seconds."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            buf = io.BytesIO()
            torch.save(_work(params), buf)
            os.write(write, buf.getvalue())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read], [], [], 1.0)
            if ready:
                chunk = os.read(read, 1 << 20)
                if not chunk:
                    break
                data += chunk
        else:
            pytest.fail(f"the forked child did not finish within {timeout} s (hung)")
    finally:
        os.close(read)
        if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running: hung
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert data, "the forked child failed"
    return torch.load(io.BytesIO(data))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_child_forked_after_a_parallel_call_runs_on_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
        mirror = clone_params(params)
        set_grads(params, mirror, 0)
        titanmac_c.get_total_norm([torch.randn(1 << 20)])  # the parent's thread team exists
        theirs = _child_results(params)
        ours = _work(mirror)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)  # same bits: the C core's results do not depend on threads
