"""The installed extension is the one the build promised: the C core (never a Python stand-in),
the CUDA backend where the build required it, a CPU loop body the CPU can run; and a source
distribution carries what its build and tests read."""

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import titanmac_c
from titanmac_c import _C

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_extension_is_compiled_c():
    assert _C.__file__.endswith((".so", ".pyd"))
    assert titanmac_c.cpu_isa() in ("generic", "avx2", "avx512")


def test_cuda_backend_present_when_required():
    """CI sets TITANMAC_EXPECT_CUDA=1 when nvcc is on the machine (TITANMAC_WITH_CUDA=1 build)."""
    expected = os.environ.get("TITANMAC_EXPECT_CUDA") == "1"
    if expected:
        assert _C.cuda_compiled()
    assert isinstance(_C.cuda_compiled(), bool)


def test_the_sdist_holds_every_file_the_build_and_tests_read(tmp_path):
    """pip builds a released sdist, not a checkout, and setuptools puts only the .c sources and
    the package in one by itself (MANIFEST.in adds the rest): every header and CUDA file, the
    tests' helpers and the benchmarks the tests run."""
    needed = sorted(str(p.relative_to(ROOT)) for folder in ("csrc", "tests", "benchmarks")
                    for p in (ROOT / folder).rglob("*")
                    if p.suffix in (".c", ".h", ".cu", ".cuh", ".py", ".sh") and p.is_file())
    assert any(n.endswith(".cuh") for n in needed) and "tests/conftest.py" in needed
    src = tmp_path / "src"  # the sdist command writes its egg-info beside setup.py
    for name in ("csrc", "tests", "benchmarks", "docs", "titanmac_c"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "out"))
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        if (ROOT / name).exists():  # without MANIFEST.in: the assertion names what is missing
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                   cwd=src, check=True, capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert [n for n in needed if n not in names] == []
