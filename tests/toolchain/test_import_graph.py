"""The package's import graph (.ci/import_graph.py, read from the sources): no cycle, and no edge
up the layers docs/architecture.md describes (_C < _internal < functional < optim < deep_nested
< __init__, testing on top). The script is checked on a package built to break both rules."""

import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / ".ci" / "import_graph.py"


def run(package_dir):
    return subprocess.run([sys.executable, str(SCRIPT), str(package_dir)], capture_output=True,
                          text=True, timeout=60)


def test_the_package_has_no_cycle_and_no_upward_edge():
    done = run(ROOT / "titanmac_c")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 problems" in done.stdout
    # the references are imported by nothing in the package (a wrapped line goes on indented)
    for entry in done.stdout.replace("\n    ", " ").splitlines():
        module, _, targets = entry.partition(" -> ")
        if not module.startswith("testing"):
            assert "testing" not in targets, entry


def test_a_cycle_and_an_upward_edge_are_found(tmp_path):
    pkg = tmp_path / "titanmac_c"
    (pkg / "optim").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import functional\n")
    (pkg / "functional.py").write_text("from .optim import adamw\n")  # up: functional < optim
    (pkg / "optim" / "__init__.py").write_text("")
    (pkg / "optim" / "adamw.py").write_text("from . import state\n")
    (pkg / "optim" / "state.py").write_text("from .adamw import x\n")  # adamw <-> state
    done = run(pkg)
    assert done.returncode == 1
    assert "upward edge: titanmac_c.functional -> titanmac_c.optim.adamw" in done.stderr
    assert "cycle: titanmac_c.optim.adamw -> titanmac_c.optim.state -> titanmac_c.optim.adamw" \
        in done.stderr
