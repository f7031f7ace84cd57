"""One OpenMP runtime in the process: the extension's OpenMP calls go to the libgomp torch loaded.

torch's Linux wheels carry a libgomp and load it for the whole process (libtorch_global_deps,
opened RTLD_GLOBAL). titanmac_c imports torch before its extension, so the dynamic loader,
which looks in the global scope first, binds the extension's GOMP_* and omp_* references to
torch's copy. The binary wheel carries a libgomp of its own too (auditwheel bundles it: the
manylinux policy does not list libgomp); it is loaded and never called, and it starts no
threads. One pool of threads serves torch's ops and ours, where two would spin against each
other between parallel regions.

A clang build links LLVM's libomp, whose symbols carry their own version (VERSION, not
libgomp's OMP_1.0), so they bind to libomp even where torch's libgomp comes first: that build
has two runtimes, each consistent in itself. The check reads the loader's own record of its
bindings (LD_DEBUG=bindings) in a child process that runs an AdamW step on two threads.
"""

import re
import subprocess
import sys

import pytest

from titanmac_c import _C
from conftest import child_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads glibc's LD_DEBUG output")

STEP = """
import torch, titanmac_c
torch.set_num_threads(2)
params = [torch.nn.Parameter(torch.randn(300_000)) for _ in range(4)]
for p in params:
    p.grad = torch.randn_like(p)
titanmac_c.AdamW(params, lr=1e-3).step()
torch.randn(1000, 1000).sum()  # one of torch's own parallel ops
print(titanmac_c._C.__file__)
"""

BINDING = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `([^']+)'")


def openmp_bindings(tmp_path):
    """{file: {library its OpenMP symbols bound to: symbols}} of a child process, and the path of
    the extension it imported."""
    log = tmp_path / "ld"
    env = dict(child_env(), LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log))
    done = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    extension = done.stdout.strip().splitlines()[-1]
    bindings = {}
    for path in tmp_path.glob("ld.*"):
        for line in path.read_text(errors="replace").splitlines():
            m = BINDING.search(line)
            if m and m.group(3).startswith(("GOMP_", "omp_", "__kmpc_")):
                bindings.setdefault(m.group(1), {}).setdefault(m.group(2), set()).add(m.group(3))
    return bindings, extension


def test_the_extension_calls_one_openmp_runtime_and_with_gomp_torchs(tmp_path):
    bindings, extension = openmp_bindings(tmp_path)
    assert extension == _C.__file__  # the build under test, not another one on the path
    ours = bindings.get(extension, {})
    if not _C.openmp_compiled():
        assert ours == {}, ours
        return
    assert len(ours) == 1, f"the extension's OpenMP symbols bind to several libraries: {ours}"
    (runtime, symbols), = ours.items()
    assert any(s.startswith("omp_") for s in symbols)
    if any(s.startswith("GOMP_") for s in symbols):  # GCC's runtime: torch's copy
        torch_cpu = {lib for file, libs in bindings.items() if "libtorch_cpu" in file
                     for lib, syms in libs.items() if any(s.startswith("GOMP_") for s in syms)}
        assert torch_cpu == {runtime}, (torch_cpu, runtime)
    else:  # LLVM's runtime (a clang build)
        assert "libomp" in runtime and any(s.startswith("__kmpc_") for s in symbols), ours
