"""DLPack intake: what the C side sees of a tensor, refcounts, capsule ownership, rejections,
and the Python-protocol path used by torch versions without the C exchange table."""

import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import torch
import torch.utils.dlpack

from titanmac_c import _C
from conftest import child_env


def test_import_describes_the_tensor():
    t = torch.randn(4, 5)
    d = _C._import(t)
    assert d["data"] == t.data_ptr() and d["numel"] == 20 and d["dtype"] == "float32"
    assert d["device"] == (1, 0) and d["read_only"] is False
    view = torch.randn(100)[1:]  # storage offset 1: the data pointer moves by 4 bytes
    assert _C._import(view)["data"] == view.data_ptr()
    assert _C._import(torch.zeros((), dtype=torch.bfloat16))["numel"] == 1
    assert _C._import(torch.zeros(0, 3))["numel"] == 0


def test_parameters_that_require_grad_are_accepted():
    p = torch.nn.Parameter(torch.randn(3))
    assert _C._import(p)["data"] == p.data_ptr()


def test_refcounts_unchanged_after_many_calls():
    params = [torch.randn(8) for _ in range(4)]
    grads = [torch.randn(8) for _ in range(4)]
    ms = [torch.zeros(8) for _ in range(4)]
    vs = [torch.zeros(8) for _ in range(4)]
    steps = [torch.zeros(()) for _ in range(4)]
    lr = torch.full((1,), 1e-3)
    everything = params + grads + ms + vs + steps + [lr]
    before = [sys.getrefcount(t) for t in everything]
    for _ in range(1000):
        _C.adamw_step(params, grads, ms, vs, [], steps, lr, [(0.9, 0.999, 1e-8, 0.0, False)])
    assert [sys.getrefcount(t) for t in everything] == before
    assert float(steps[0]) == 1000.0


def test_capsules_are_consumed_and_marked_used():
    t = torch.randn(6)
    capsule = torch.utils.dlpack.to_dlpack(t)
    d = _C._import(capsule)
    assert d["path"] == "capsule" and d["data"] == t.data_ptr()
    assert "used_dltensor" in repr(capsule)
    with pytest.raises((BufferError, ValueError, TypeError)):
        _C._import(capsule)  # a capsule is consumed once


def test_versioned_capsule_from_numpy():
    a = np.arange(6, dtype=np.float32)
    capsule = a.__dlpack__(max_version=(1, 0))
    d = _C._import(capsule)
    assert d["data"] == a.ctypes.data and d["numel"] == 6
    assert "used_dltensor_versioned" in repr(capsule)


def test_numpy_read_only_is_flagged():
    a = np.ones(3, dtype=np.float32)
    a.flags.writeable = False
    assert _C._import(a)["read_only"] is True


@pytest.mark.parametrize("make, match", [
    (lambda: torch.randn(4, 6)[:, ::2], r"tensor: not contiguous"),
    (lambda: torch.randn(3, dtype=torch.complex64), r"dtype complex64 is not supported"),
    (lambda: torch.zeros(3, dtype=torch.int64), r"dtype int64 is not supported"),
    (lambda: torch.zeros(3, dtype=torch.uint8), r"dtype uint8 is not supported"),
    (lambda: torch.zeros(3, dtype=torch.bool), r"dtype bool is not supported"),
])
def test_rejections_are_buffer_errors(make, match):
    with pytest.raises(BufferError, match=match):
        _C._import(make())


def test_size_one_dims_do_not_break_contiguity():
    t = torch.randn(1, 5)
    odd = t.as_strided((1, 5), (99, 1))  # the stride of a size-1 dim is meaningless
    assert _C._import(odd)["numel"] == 5
    assert _C._import(torch.randn(3, 1).t())["numel"] == 3


def test_not_a_tensor_is_type_error():
    with pytest.raises(TypeError):
        _C._import("nope")
    with pytest.raises(TypeError):
        _C._import(3.0)


class _ShrinksItsList:
    """A tensor whose __dlpack__ first removes the last entry of the list it is in: Python code
    a producer may run while the binding walks that list."""

    def __init__(self, tensor, holder):
        self.tensor, self.holder = tensor, holder

    def __dlpack__(self, **kwargs):
        self.holder.pop()
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_a_list_that_shrinks_while_it_is_read_is_refused_before_any_write():
    ps = [torch.ones(3), torch.ones(3)]
    params = [None, ps[1]]
    params[0] = _ShrinksItsList(ps[0], params)
    grads = [torch.ones(3), torch.ones(3)]
    m, v = [torch.zeros(3), torch.zeros(3)], [torch.zeros(3), torch.zeros(3)]
    steps = [torch.zeros(()), torch.zeros(())]
    with pytest.raises(RuntimeError, match=r"^params: the list changed size during the call$"):
        _C.adamw_step(params, grads, m, v, [], steps, torch.full((1,), 0.1),
                      [(0.9, 0.999, 1e-8, 0.0, False)])
    assert len(params) == 1
    assert all(torch.equal(p, torch.ones(3)) for p in ps)
    assert all(torch.equal(s, torch.zeros(())) for s in steps)


def test_intake_mode():
    assert _C.dlpack_intake() in ("exchange", "protocol")
    if hasattr(torch.Tensor, "__dlpack_c_exchange_api__") and \
            os.environ.get("TITANMAC_DLPACK") != "protocol":
        assert _C.dlpack_intake() == "exchange"
        assert _C._import(torch.zeros(2))["path"] == "exchange"


def test_protocol_path_gives_the_same_results():
    """Run AdamW + clip through the Python __dlpack__ protocol (what torch < 2.10 gets) in a
    subprocess and compare with torch.optim.AdamW."""
    script = textwrap.dedent("""
        import torch, titanmac_c
        from titanmac_c import _C
        assert _C.dlpack_intake() == "protocol", _C.dlpack_intake()
        assert _C._import(torch.zeros(2))["path"] == "protocol"
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(n)) for n in (3, 255, 4097)]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        ours = titanmac_c.AdamW(a, lr=1e-2, weight_decay=0.1, amsgrad=True)
        theirs = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, amsgrad=True)
        for step in range(20):
            for pa, pb in zip(a, b):
                g = torch.randn_like(pa)
                pa.grad, pb.grad = g.clone(), g.clone()
            na = titanmac_c.clip_grad_norm_(a, 1.0)
            nb = torch.nn.utils.clip_grad_norm_(b, 1.0)
            torch.testing.assert_close(na, nb, rtol=1e-5, atol=0)
            ours.step(); theirs.step()
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        print("protocol-ok")
    """)
    env = dict(child_env(), TITANMAC_DLPACK="protocol")
    # Run outside the source tree so the installed package (with _C) is imported.
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr
    assert "protocol-ok" in out.stdout


def test_classes_made_at_run_time_are_not_kept_alive():
    """The binding remembers which types carry torch's DLPack exchange table; a class without
    one that is defined at run time (a wrapper made per call) was remembered too, with
    everything its class dict holds, for the life of the process (up to 16 of them)."""
    import gc
    import weakref

    refs = []
    for _ in range(20):
        payload = torch.zeros(1 << 16)

        class Wrapper:
            held = payload

            def __dlpack__(self, stream=None, max_version=None):
                return torch.ones(3).__dlpack__(stream=stream, max_version=max_version)

        assert _C._import(Wrapper())["numel"] == 3
        refs.append((weakref.ref(Wrapper), weakref.ref(payload)))
        del Wrapper, payload
    gc.collect()
    assert sum(c() is not None or p() is not None for c, p in refs) == 0

    class Sub(torch.Tensor):  # a table through inheritance: still taken, and still correct
        pass

    for _ in range(3):
        t = torch.arange(5.0).as_subclass(Sub)
        assert _C._import(t)["data"] == t.data_ptr()


class _SwapsStorage:
    """A number whose float() moves `tensor` to new memory (`set_`), as Python code run while a
    call parses its arguments could: the call must read every number before it imports a
    tensor, or it steps the old memory, freed by then (a use after free that can crash the
    process)."""

    def __init__(self, value, tensor):
        self.value, self.tensor = value, tensor

    def __float__(self):
        self.tensor.set_(self.tensor.detach().clone())
        return self.value


def test_adamw_reads_its_numbers_before_importing_a_tensor():
    p, g = torch.ones(6), torch.full((6,), 0.5)
    m, v, step = torch.zeros(6), torch.zeros(6), torch.zeros(())
    old = p.untyped_storage().data_ptr()
    hp = [(_SwapsStorage(0.9, p), 0.999, 1e-8, 0.0, False)]
    _C.adamw_step([p], [g], [m], [v], [], [step], torch.full((1,), 0.1), hp)
    assert p.untyped_storage().data_ptr() != old
    ref = torch.ones(6, requires_grad=True)
    opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
    ref.grad = torch.full((6,), 0.5)
    opt.step()
    torch.testing.assert_close(p, ref.detach(), rtol=0, atol=0)  # the memory p holds now


def test_cms_reads_its_numbers_before_importing_a_tensor():
    """Same for cms_step's per-level numbers (the divisors here)."""
    import copy
    from test_cms_op_errors import ORDER, _valid
    args, kw = _valid()
    twin = copy.deepcopy(args)
    p = args["params"][2]
    before, old = p.clone(), p.untyped_storage().data_ptr()
    _C.cms_step(*[twin[k] for k in ORDER], **kw)
    kw["divisors"] = [1.0, _SwapsStorage(10.0, p), 100.0]
    _C.cms_step(*[args[k] for k in ORDER], **kw)
    assert p.untyped_storage().data_ptr() != old
    assert not torch.equal(twin["params"][2], before)  # the step moved it
    for a, b in zip(args["params"], twin["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_misaligned_tensor_is_refused_before_any_write():
    """torch.frombuffer at an odd byte offset makes a float32 tensor whose elements straddle
    their alignment: the C loops' whole-element loads would be undefined behaviour (a fault on
    CUDA). Refused by name, in a norm and in a step, nothing written."""
    import titanmac_c
    raw = bytearray(4 * 8 + 1)
    odd = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=8)
    assert odd.data_ptr() % 4 != 0
    with pytest.raises(BufferError, match=r"^grads\[1\]: data address 0x[0-9a-f]+ is not "
                                          r"aligned to its 4-byte elements \(tensors\[1\]\)$"):
        titanmac_c.get_total_norm([torch.ones(2), odd])
    good = torch.nn.Parameter(torch.ones(3))
    bad = torch.nn.Parameter(odd)
    good.grad, bad.grad = torch.ones(3), torch.ones(8)
    before = bytes(raw)
    opt = titanmac_c.AdamW([good, bad], lr=0.1)
    with pytest.raises(BufferError, match=r"not aligned to its 4-byte elements "
                                          r"\(param_groups\[0\]\['params'\]\[1\]\)"):
        opt.step()
    assert bytes(raw) == before and torch.equal(good, torch.ones(3)) and not opt.state


def test_an_empty_tensor_for_an_optional_input_is_refused():
    """The core reads an optional input with no elements as not given: an empty skip flag would
    have run the step it stands for skipping, an empty coefficient output stayed unwritten."""
    p, g, m, v, step = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4), torch.zeros(())
    hp = [(0.9, 0.999, 1e-8, 0.0, False)]
    for kw in (dict(skip=torch.empty(0)), dict(grad_scale=torch.empty(0)),
               dict(loss_scale=torch.empty(0))):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"^{name}: an empty tensor \(give None to leave "
                                             r"it out\)$"):
            _C.adamw_step([p], [g], [m], [v], [], [step], torch.full((1,), 0.1), hp, **kw)
        assert torch.equal(p, torch.ones(4)) and float(step) == 0.0
    with pytest.raises(ValueError, match=r"^coef: an empty tensor"):
        _C.norms([g], [], torch.empty(1), torch.empty(1), coef=torch.empty(0), max_norm=1.0)


def test_an_exchange_table_chain_that_loops_ends():
    """A class claiming the DLPack 1.2 exchange-table attribute with a pointer to a table header
    (version 0.0) whose chain of older tables points back to itself: the walk is bounded, so
    the import falls back to __dlpack__ and fails with a TypeError instead of spinning with the
    GIL held."""
    code = textwrap.dedent("""
        import ctypes
        from titanmac_c import _C
        class Header(ctypes.Structure):  # DLPackExchangeAPIHeader
            _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                        ("prev_api", ctypes.c_void_p)]
        header = Header(0, 0, None)
        header.prev_api = ctypes.addressof(header)
        class T: pass
        T.__c_dlpack_exchange_api__ = ctypes.addressof(header)
        try:
            _C._import(T())
        except TypeError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tempfile.gettempdir(), env=child_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tensor: expected a tensor (an object with __dlpack__), got T"
