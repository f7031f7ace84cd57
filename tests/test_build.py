"""The installed extension is the one the build promised: the C core (never a Python stand-in),
the CUDA backend where the build required it, a CPU loop body the CPU can run."""

import os

import titanmac_c
from titanmac_c import _C


def test_extension_is_compiled_c():
    assert _C.__file__.endswith((".so", ".pyd"))
    assert titanmac_c.cpu_isa() in ("generic", "avx2", "avx512")


def test_cuda_backend_present_when_required():
    """CI sets TITANMAC_EXPECT_CUDA=1 when nvcc is on the machine (TITANMAC_WITH_CUDA=1 build)."""
    expected = os.environ.get("TITANMAC_EXPECT_CUDA") == "1"
    if expected:
        assert _C.cuda_compiled()
    assert isinstance(_C.cuda_compiled(), bool)
