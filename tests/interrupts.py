"""Interrupts at every point of a step: a KeyboardInterrupt raised at the n-th line the step runs
in the package (a trace function raises it there, as a signal handler or a hook would), for
every n, and what the step left compared with the state before it and after it."""

import copy
import os
import sys

import torch

import titanmac_c

PACKAGE = os.path.dirname(os.path.abspath(titanmac_c.__file__)) + os.sep


def run_interrupted(n, fn):
    """fn() with a KeyboardInterrupt raised at the n-th line event in the package's code:
    ("interrupted", where) when it was, ("done", the number of lines fn ran) when fn returned
    first."""
    count = 0
    where = None

    def trace(frame, event, arg):
        nonlocal count, where
        if event == "call":
            return trace if frame.f_code.co_filename.startswith(PACKAGE) else None
        if event == "line":
            count += 1
            if count == n:
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                raise KeyboardInterrupt(where)
        return trace

    sys.settrace(trace)
    try:
        fn()
    except KeyboardInterrupt as exc:
        if where is None or exc.args != (where,):
            raise  # not ours
        return "interrupted", where
    finally:
        sys.settrace(None)
    return "done", count


def same(a, b):
    """Nested tensors, dicts, lists and values equal exactly (tensors: shape, dtype, values)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return a == b


def sweep(make, step, snapshot, allowed_after=()):
    """For every n: a fresh object from make(), stepped by step(obj) with a KeyboardInterrupt at
    its n-th line. Every interrupted step must leave snapshot(obj) exactly as before the step
    or exactly as after a whole step (or one of allowed_after(): states made by other whole
    steps, e.g. one whose meta-update did not run). Returns (points left as before, points
    left as after); raises AssertionError naming the first point that left anything else."""
    obj = make()
    before = snapshot(obj)
    status, total = run_interrupted(0, lambda: step(obj))
    assert status == "done" and total > 0
    afters = [snapshot(obj), *allowed_after]
    counts = [0, 0]
    for n in range(1, total + 1):
        obj = make()
        status, where = run_interrupted(n, lambda: step(obj))
        state = snapshot(obj)
        if status == "done":  # caches filled by earlier runs: fewer lines now
            assert any(same(state, after) for after in afters), f"line {n}: a step went astray"
            break
        if same(state, before):
            counts[0] += 1
        elif any(same(state, after) for after in afters):
            counts[1] += 1
        else:
            raise AssertionError(f"interrupted at {where} (line {n} of {total}): the state is "
                                 "neither as before the step nor as after it")
    return tuple(counts)


def deep_copy_with_grads(objects, model):
    """copy.deepcopy of (model, ...) with the parameters' gradients (deepcopy leaves them)."""
    copied = copy.deepcopy(objects)
    for a, b in zip(model.parameters(), copied[0].parameters()):
        b.grad = None if a.grad is None else a.grad.clone()
    return copied
