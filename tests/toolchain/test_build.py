"""The installed extension is the one the build promised: the C core (never a Python stand-in),
the CUDA backend where the build required it, a CPU loop body the CPU can run; and a source
distribution carries what its build and tests read."""

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

import titanmac_c
from titanmac_c import _C
from conftest import ROOT, child_env


def source_copy(tmp_path):
    """The source tree, less build outputs, in tmp_path / "src"."""
    src = tmp_path / "src"
    for name in ("csrc", "tests", "benchmarks", "docs", "titanmac_c"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "out"))
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        if (ROOT / name).exists():  # without MANIFEST.in: the assertion names what is missing
            shutil.copy(ROOT / name, src / name)
    return src


def test_extension_is_compiled_c():
    assert _C.__file__.endswith((".so", ".pyd"))
    assert titanmac_c.cpu_isa() in ("generic", "avx2", "avx512")


@pytest.mark.slow
def test_a_torch_older_than_2_10_is_refused_at_import(tmp_path):
    """pyproject's torch>=2.10 binds only pip's resolver: an older torch installed otherwise is
    named at import instead of failing in the middle of a step. Dev builds of 2.10 are taken."""
    probe = ("import sys, torch; torch.__version__ = sys.argv[1]; import titanmac_c; "
             "print(titanmac_c._TORCH_RELEASE)")
    for version, refused in (("2.9.1", True), ("1.13.0", True), ("2.10.0a0+git1234", False),
                             ("2.11.0+cu128", False), ("3.0.0", False)):
        # run outside the source tree, whose titanmac_c (unbuilt where CI installs a copy)
        # would shadow the installed one
        done = subprocess.run([sys.executable, "-c", probe, version], capture_output=True,
                              text=True, cwd=tmp_path, env=child_env())
        if refused:
            assert done.returncode != 0
            assert (f"ImportError: titanmac_c needs torch >= 2.10; this is torch {version}"
                    in done.stderr)
        else:
            assert done.returncode == 0, done.stderr
            major, minor = version.split(".")[:2]
            assert done.stdout.strip() == str((int(major), int(minor)))


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
    src = source_copy(tmp_path)  # the sdist command writes its egg-info beside setup.py
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                   cwd=src, check=True, capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert [n for n in needed if n not in names] == []


# A C compiler without OpenMP, as Apple's clang: gcc that refuses -fopenmp. It logs the arguments
# of every source it compiles and then fails, so a build stops at its first source file.
NO_OPENMP_CC = """#!/bin/sh
for a in "$@"; do
    case $a in
    -fopenmp) echo "cc: error: unsupported option '-fopenmp'" >&2; exit 1 ;;
    csrc/*.c) echo "$@" >> "$0.log"; exit 1 ;;
    esac
done
exec gcc "$@"
"""


def build_with_no_openmp_cc(tmp_path, openmp):
    cc = tmp_path / "cc"
    cc.write_text(NO_OPENMP_CC)
    cc.chmod(0o755)
    env = dict(os.environ, CC=str(cc), LDSHARED=f"{cc} -shared", TITANMAC_WITH_CUDA="0",
               TITANMAC_OPENMP=openmp)
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                          cwd=source_copy(tmp_path), env=env, capture_output=True, text=True)
    log = tmp_path / "cc.log"
    return done, log.read_text() if log.exists() else ""


def test_a_compiler_without_openmp_builds_without_it(tmp_path):
    """TITANMAC_OPENMP=auto (the default) probes the compiler and builds without -fopenmp."""
    done, compiled = build_with_no_openmp_cc(tmp_path, "auto")
    assert "no OpenMP: " in done.stdout and "cannot build and link with -fopenmp" in done.stdout
    assert "csrc/" in compiled and "-fopenmp" not in compiled


def test_openmp_required_without_it_fails_before_compiling(tmp_path):
    done, compiled = build_with_no_openmp_cc(tmp_path, "1")
    assert done.returncode != 0 and compiled == ""
    assert "TITANMAC_OPENMP=1 but" in done.stderr + done.stdout
