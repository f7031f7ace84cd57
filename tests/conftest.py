"""Shared fixtures: the devices every parity test runs on, dtypes, tolerances, sizes.

CUDA tests run when the extension has the CUDA backend and torch sees a GPU; otherwise they are
reported as skipped (never as passed). They carry the `cuda` marker (pyproject.toml), so
`pytest -m cuda` selects them and `-m "not cuda"` the rest.

The tests lie in one folder per area (adamw/, norms_clip/, deep_nested/, cms/, capi/, toolchain/,
integration/, examples/), none of them a package: a test module is imported by its file name, so
file names are unique across folders. The helpers beside this file (conftest, dno_models,
cms_checks) and the test modules whose helpers other tests import (test_cms_op, test_norms,
test_dno_control, ...) are imported by name from any folder: this folder and each area folder are
put on sys.path here, as the flat layout had them, whichever file or folder pytest is given.
"""

import copy
import io
import os
import pathlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import titanmac_c
from titanmac_c.testing.reference_dno import ReferenceDeepNestedOptimizer

TESTS = pathlib.Path(__file__).resolve().parent  # tests/: the helper modules
ROOT = TESTS.parent  # the repository root (benchmarks/, setup.py)
for _folder in [TESTS, *sorted(d for d in TESTS.iterdir()
                               if d.is_dir() and not d.name.startswith(("_", ".")))]:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

CUDA = titanmac_c.cuda_available()

# the `cuda` marker on the parameter: `-m cuda` selects the CUDA cases, `-m "not cuda"` the CPU ones
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not CUDA, reason="no CUDA device or backend")]),
]

# Sizes from apex/STYLE: 1, 3, 255, a block + 1, a CUDA chunk + 1, apex's odd size.
SIZES = [1, 3, 255, 4097, 65537, 278011]

# Element-wise tolerances against torch: fp32 within 1e-6 relative (plus a tiny absolute floor
# for elements near zero); bf16/fp16 within a couple of units of their rounding.
TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-7),
    torch.float16: dict(rtol=2e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    # float64: torch's CPU kernels contract addcmul's multiply-add into an FMA where ours rounds
    # the product (as for float32), so an element may sit an ulp or two apart after 20 steps
    torch.float64: dict(rtol=1e-13, atol=1e-15),
}

# On CUDA torch's own AdamW (foreach and fused) and ours (nvcc contracts by default) fuse
# a * b + c into FMAs, each in its own places. A store may then round one ulp apart, and the
# difference walks on through the state: fp32 within 1e-5 after 20 steps (fp64 within 1e-12); in
# fp16/bf16 a state element stored one ulp apart stays so (and exp_avg_sq near fp16's subnormals
# moves a step by percents), so within one unit of rounding at 1.0, the scale of these tensors,
# plus a few units relative.
TOL_CUDA = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-12, atol=1e-14),
    torch.float16: dict(rtol=2e-2, atol=2.0**-10),
    torch.bfloat16: dict(rtol=3.2e-2, atol=2.0**-7),
}


# ATen ops that read a device value on the host (a sync on CUDA) or make a tensor from host data
# (a host-to-device copy, which synchronizes from pageable memory)
HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
              "aten::is_nonzero", "aten::equal", "aten::lift_fresh", "aten::lift_fresh_copy"}


class RecordHostReads(TorchDispatchMode):
    """Counts every ATen op below this mode and records those that would stall a CUDA stream,
    so that a CUDA path run on CPU tensors shows its host reads on a machine without a GPU.
    host_side: tensors that stay on the CPU on CUDA too (torch's non-capturable Adam keeps its
    step counts there), whose reads are not recorded."""

    def __init__(self, host_side=()):
        super().__init__()
        self.ops, self.host_reads = 0, []
        self._host_side = {t.data_ptr() for t in host_side}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func._schema.name
        bool_index = (func is torch.ops.aten.index.Tensor and
                      any(i is not None and i.dtype == torch.bool for i in args[1]))
        if (name in HOST_READS or bool_index) and not (
                args and isinstance(args[0], torch.Tensor)
                and args[0].data_ptr() in self._host_side):
            self.host_reads.append(name)
        return func(*args, **(kwargs or {}))


def child_env(*first_paths):
    """The environment for a Python child process run in another directory: PYTHONPATH made
    absolute (CI's sanitizer job gives a relative one, the build under test), after
    first_paths."""
    paths = [*first_paths, *(os.path.abspath(p) for p in
                             os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def tol(dtype, device):
    """Tolerance of a parity test against torch's optimizer on that device."""
    return (TOL_CUDA if torch.device(device).type == "cuda" else TOL)[dtype]


# complex parameters step as their real views: compared at the tolerance of those
REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def assert_adamw_runs_agree(ours, theirs, params_a, params_b, tolerance=None):
    """The parameters and every state entry of two AdamW runs (ours against torch's) element by
    element, the steps exactly; state in its parameter's dtype, as torch's. tolerance: the same
    for all, or None: tol() of each parameter's (real) dtype on its device."""
    for pa, pb in zip(params_a, params_b):
        t = tolerance or tol(REAL_OF.get(pa.dtype, pa.dtype), pa.device)
        torch.testing.assert_close(pa.detach(), pb.detach(), **t)
        sa, sb = ours.state[pa], theirs.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            if key == "step":
                assert float(sa[key]) == float(sb[key])
            else:
                assert sa[key].dtype == sb[key].dtype == pa.dtype
                torch.testing.assert_close(sa[key], sb[key], **t)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def make_params(sizes, device="cpu", dtype=torch.float32, misaligned=True):
    """nn.Parameters of the given sizes; with misaligned, one more that is a view at element
    offset 1 of a larger tensor (so its data is not 16-byte aligned)."""
    params = [torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype)) for n in sizes]
    if misaligned:
        base = torch.randn(1 + 1000, device=device, dtype=dtype)
        params.append(torch.nn.Parameter(base[1:]))
    return params


# gradients drawn in the parameter's own dtype (true float64 / complex values); the others are
# drawn in float32 and rounded to theirs
_DRAWN_IN_OWN_DTYPE = (torch.float64, torch.complex64, torch.complex128)


def set_grads(params_a, params_b, step, scale=1.0, first_seed=1000):
    """Give two parameter lists identical pseudo-random gradients for this step (seeded
    first_seed + step)."""
    gen = torch.Generator().manual_seed(first_seed + step)
    for pa, pb in zip(params_a, params_b):
        drawn = pa.dtype if pa.dtype in _DRAWN_IN_OWN_DTYPE else torch.float32
        g = torch.randn(pa.shape, generator=gen, dtype=drawn) * scale
        pa.grad = g.to(device=pa.device, dtype=pa.dtype, copy=True)
        pb.grad = g.to(device=pb.device, dtype=pb.dtype, copy=True)


def run_pair(ours, theirs, params_a, params_b, steps=20, grad_scale=1.0, sched=None,
             first_seed=1000):
    """steps steps of two optimizers on the same gradients (set_grads), with schedulers."""
    for step in range(steps):
        set_grads(params_a, params_b, step, grad_scale, first_seed)
        ours.step()
        theirs.step()
        if sched is not None:
            for s in sched:
                s.step()


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


# Whole-tensor comparison of CMS state (momenta, accumulators) by normalized squared error, as
# ggml's test-backend-ops does: the DirectUpdateMLP's sign feature multiplies a last-bit
# difference of a cancelled |m| < e^-10 by e^10, so single elements may drift where the tensor
# as a whole agrees (tests/cms/test_deep_nested_cms.py explains and measures it).
STATE_NMSE = 1e-6


def assert_nmse_close(actual, expected, what, nmse=STATE_NMSE):
    """Same non-finite positions, and sum (a - e)^2 / sum e^2 <= nmse over the finite ones."""
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    assert torch.equal(torch.isfinite(a), finite), f"{what}: non-finite elements differ"
    err = (a[finite] - e[finite]).pow(2).sum()
    ref = e[finite].pow(2).sum().clamp(min=1e-30)
    assert float(err / ref) <= nmse, f"{what}: NMSE {float(err / ref):.3e}"


def reference_and_ours(model, **kw):
    """((model, reference DeepNestedOptimizer), (a copy of model, ours)) with the same options,
    ours given the reference's randomly initialized controller and momentum network so that both
    start from the same state."""
    model_ours = copy.deepcopy(model)
    ref = ReferenceDeepNestedOptimizer(model, **kw)
    ours = titanmac_c.DeepNestedOptimizer(model_ours, **kw)
    ours.controller.load_state_dict(ref.controller.state_dict())
    ours.momentum_mlp.load_state_dict(ref.momentum_mlp.state_dict())
    return (model, ref), (model_ours, ours)


@torch.no_grad()
def sync_adamw_from_reference(ref, ours, model_ref, model_ours):
    """Start ours (AdamW mode) from the reference's parameters and AdamW moments, so a long run
    checks every step's arithmetic without the ulp differences of earlier steps compounding
    through the model (the meta state, step counts and multipliers keep running on their own)."""
    for pr, po in zip(model_ref.parameters(), model_ours.parameters()):
        po.copy_(pr)
        sr, so = ref.base_optimizer.state.get(pr), ours.base_optimizer.state.get(po)
        for key in ("exp_avg", "exp_avg_sq") if sr else ():
            so[key].copy_(sr[key])


@torch.no_grad()
def sync_cms_from_reference(ref, ours, model_ref, model_ours):
    """Start ours (CMS mode) from the reference's state: parameters, CMS buffers, the momentum
    MLP, its Adam state and its Phase 1 output history. The DirectUpdateMLP path amplifies
    last-bit differences (tests/cms/test_deep_nested_cms.py), so its parity tests resync every step
    and check each step's computation."""
    for pr, po in zip(model_ref.parameters(), model_ours.parameters()):
        po.copy_(pr)
        for mine, lvl in zip(ours.state[po].levels, ref.state[pr].levels):
            mine.momentum.copy_(lvl.momentum)
            mine.accumulated_grad.copy_(lvl.accumulated_grad)
            if mine is ours.state[po].levels[0]:  # e_0: the one EMA kept (the meta proxy reads it)
                mine.ema_grad.copy_(lvl.ema_grad)
            mine.step_count = lvl.step_count
    ours.momentum_mlp.load_state_dict(ref.momentum_mlp.state_dict())
    if ref.mlp_optimizer is not None:
        ours.mlp_optimizer.load_state_dict(copy.deepcopy(ref.mlp_optimizer.state_dict()))
        # ours keys the history by the tensor's place in group order, the reference by id
        ours._cms_mode.output_history = {
            ours._cms.index[po]: ref._mlp_output_history[id(pr)].clone()
            for pr, po in zip(model_ref.parameters(), model_ours.parameters())
            if id(pr) in ref._mlp_output_history}


def expect_refused(opt, params, exc, match, action=None):
    """action (default opt.step) raises exc matching match, and the parameters and the
    optimizer's state (the same entries, every tensor) are bitwise as before."""
    values = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for p in opt.state}
    with pytest.raises(exc, match=match):
        (action or opt.step)()
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v), "a parameter changed"
    assert {id(p) for p in opt.state} == set(state), "state entries were added or removed"
    for p in opt.state:
        for k, v in state[id(p)].items():
            now = opt.state[p][k]
            if not torch.is_tensor(v):  # a planted Python number
                assert now == v, f"state {k} changed"
                continue
            if v.device.type == "meta":  # a planted bad tensor: no data to compare
                assert now.device.type == "meta"
                continue
            assert now.dtype == v.dtype and torch.equal(now, v), f"state {k} changed"


def checkpoint_roundtrip(state_dict):
    """state_dict through torch.save and torch.load, as a checkpoint file takes it."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_same_state(a, b, path="state"):
    """Nested equality of state_dict-like structures, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
