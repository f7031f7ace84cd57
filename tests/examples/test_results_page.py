"""benchmarks/RESULTS.md is generated from benchmarks/results/*.json by benchmarks/make_results.py:

* the committed page is what the script writes from the committed data (`--check` exits 0), so a
  figure cannot change on the page without its data file, nor the data without the page;
* every result file carries its metadata (date, commit, hardware, torch, command, ...) and every
  table its columns and rows, each row's values under the table's columns;
* `--check` notices a page that differs from its data (exit 1);
* the summary and every table have a stable anchor on the page, one each.

Pure Python, a fraction of a second; no torch needed.
"""

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "make_results.py")
RESULTS = sorted(glob.glob(os.path.join(BENCH, "results", "*.json")))

FILE_FIELDS = ("id", "section", "device", "machine", "hardware", "date", "commit", "torch",
               "software", "command")


def _make_results():
    spec = importlib.util.spec_from_file_location("_bench_make_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_page_matches_its_data():
    run = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True)
    assert run.returncode == 0, (
        f"benchmarks/RESULTS.md does not match benchmarks/results/: run "
        f"`python benchmarks/make_results.py` and commit the page\n{run.stdout}{run.stderr}")


def test_there_are_result_files():
    assert len(RESULTS) >= 10


@pytest.mark.parametrize("path", RESULTS, ids=[os.path.basename(p) for p in RESULTS])
def test_result_file_has_its_metadata(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert data.get("schema") == 1
    for field in FILE_FIELDS:
        value = data.get(field)
        if field == "command" and isinstance(value, list):
            assert value and all(isinstance(c, str) and c for c in value), field
        else:
            assert isinstance(value, str) and value.strip(), f"{field} missing or empty"
    assert data["id"] == os.path.splitext(os.path.basename(path))[0]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"])
    assert data["date"] in data["id"], "the file name carries the date of the run"
    assert data["device"] in ("cpu", "cuda")
    assert data["commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}", data["commit"])
    assert data["tables"], "a result file holds at least one table"
    for table in data["tables"]:
        assert re.fullmatch(r"[a-z0-9-]+", table["id"]), table["id"]
        assert table["title"].strip()
        keys = [c["key"] for c in table["columns"]]
        assert len(set(keys)) == len(keys), f"{table['id']}: a column key twice"
        for col in table["columns"]:
            assert col["label"].strip()
            if isinstance(col.get("decimals"), list):
                assert len(col["decimals"]) == len(table["rows"])
        assert table["rows"], f"{table['id']}: no rows"
        for row in table["rows"]:
            assert set(row) <= set(keys), f"{table['id']}: values outside its columns: {row}"
            assert any(isinstance(v, (int, float)) or (isinstance(v, str) and re.search(r"\d", v))
                       for v in row.values()), f"{table['id']}: a row without a figure: {row}"


def test_every_table_and_the_summary_have_one_anchor():
    with open(os.path.join(BENCH, "RESULTS.md"), encoding="utf-8") as f:
        page = f.read()
    anchors = re.findall(r'<a id="([a-z0-9-]+)"></a>', page)
    assert len(anchors) == len(set(anchors))
    assert "summary" in anchors
    for path in RESULTS:
        with open(path, encoding="utf-8") as f:
            for table in json.load(f)["tables"]:
                assert table["id"] in anchors
    for link in set(re.findall(r"\]\(#([a-z0-9-]+)\)", page)):
        assert link in anchors, f"link to a missing anchor #{link}"


def test_check_notices_a_page_that_differs(tmp_path):
    page = tmp_path / "RESULTS.md"
    shutil.copy(os.path.join(BENCH, "RESULTS.md"), page)
    mr = _make_results()
    argv = ["--results", os.path.join(BENCH, "results"), "--plots", os.path.join(BENCH, "plots"),
            "--out", str(page)]
    assert mr.main(argv + ["--check"]) == 0
    page.write_text(page.read_text(encoding="utf-8").replace("| titanmac_c |", "| titanmac |", 1),
                    encoding="utf-8")
    assert mr.main(argv + ["--check"]) == 1
    assert mr.main(argv) == 0  # rewrites it
    assert mr.main(argv + ["--check"]) == 0


def test_missing_metadata_is_refused(tmp_path):
    src = RESULTS[0]
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    del data["torch"]
    (tmp_path / os.path.basename(src)).write_text(json.dumps(data), encoding="utf-8")
    mr = _make_results()
    with pytest.raises(mr.ResultError, match="torch"):
        mr.load(str(tmp_path))


def test_a_benchmark_scripts_output_becomes_a_result_file_and_a_table(tmp_path):
    """add_result.py turns what bench_step.py and bench_train.py write (--out JSON) into result
    files with their metadata, and the regenerated page shows their tables with the numbers."""
    results = tmp_path / "results"
    results.mkdir()
    meta = dict(device="cuda:0", dtype="float32", torch="2.13.0", titanmac_c="0.2.0", threads=16,
                gpu="NVIDIA H200", date="2026-12-03",
                command="python benchmarks/bench_step.py --device cuda --sizes titanmac")
    rows = [dict(shape="titanmac", params=3_237_888, tensors=48, op="adamw", impl=impl,
                 median_ms=ms, ratio_vs_torch_fused=ms / 0.546, gbs=gbs, frac_of_copy=gbs / 3000,
                 copy_gbs=3000.0, launches=n)
            for impl, ms, gbs, n in (("titanmac_c", 0.367, 247.0, 1),
                                     ("torch_fused", 0.546, 166.0, 4))]
    step = tmp_path / "bench_step_cuda.json"
    step.write_text(json.dumps(dict(meta=meta, rows=rows)))
    train_meta = dict(device="cpu", torch="2.13.0", titanmac_c="0.2.0", threads=2, mode="cms",
                      net="legacy", date="2026-12-03",
                      command="python benchmarks/bench_train.py --mode cms --net legacy")
    train_rows = [dict(impl="reference", steps_per_s=3.5, opt_ms=35.4, opt_mean_ms=39.8,
                       launches=None, syncs=None, state_mb=148.2, peak_mb=574.0, final_loss=2.8),
                  dict(impl="titanmac_c", steps_per_s=9.9, opt_ms=10.0, opt_mean_ms=10.7,
                       launches=None, syncs=None, state_mb=86.5, peak_mb=444.0, final_loss=2.8)]
    train = tmp_path / "bench_train_cpu.json"
    train.write_text(json.dumps(dict(meta=train_meta, rows=train_rows)))
    page = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "add_result.py"), str(step),
                           str(train), "--machine", "H200 test", "--results", str(results),
                           "--page", str(page)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    written = json.loads((results / "h200-test-2026-12-03-step.json").read_text())
    for field in ("schema", "id", "section", "device", "machine", "hardware", "date", "commit",
                  "torch", "software", "command", "tables"):
        assert field in written
    assert written["section"] == "gpu-adamw-step" and written["hardware"] == "NVIDIA H200"
    assert written["command"] == meta["command"] and written["commit"] != ""
    assert (results / "h200-test-2026-12-03-train-cms-legacy.json").exists()
    text = page.read_text()
    assert "#h200-test-2026-12-03-step-float32" in text or \
        'id="h200-test-2026-12-03-step-float32"' in text
    assert "| titanmac | 48 | adamw | titanmac_c | 0.367 | 0.67 | 247.0 | 0.08 | 1 |" in text
    assert "| titanmac_c | 9.90 | 10.000 | 10.700 | - | - | 86.5 | 444.0 | 2.80000 |" in text


def test_a_step_output_with_device_and_host_time_becomes_a_table(tmp_path):
    """bench_step.py's output with the device and host time apart (device_ms, host_us) gives a
    table with both, each with its ratio to torch fused, the profiled device time, and a column
    naming a step whose device time includes host time (a host sync); the page shows them."""
    results = tmp_path / "results"
    results.mkdir()
    timing = "device ms: CUDA events around the step with a spin kernel queued ahead"
    meta = dict(device="cuda:0", dtype="float32", torch="2.13.0", titanmac_c="0.3.0",
                threads=16, gpu="NVIDIA H200", date="2026-12-04", timing=timing,
                command="python benchmarks/bench_step.py --device cuda --sizes gpt2")
    rows = [dict(shape="gpt2", params=124_439_808, tensors=148, op=op, impl=impl,
                 device_ms=ms, device_p90_ms=ms, device_covered=covered, spin_us=1200.0,
                 host_us=host, ratio_vs_torch_fused=ratio, host_ratio_vs_torch_fused=hratio,
                 gbs=gbs, frac_of_copy=gbs / 4000, copy_gbs=4000.0, launches=n,
                 profiled_device_us=prof)
            for op, impl, ms, covered, host, ratio, hratio, gbs, n, prof in (
                ("adamw", "titanmac_c", 1.163, True, 558.0, 0.71, 0.58, 2996.0, 1, 1150.0),
                ("adamw", "torch_fused", 1.635, True, 969.0, 1.0, 1.0, 2131.0, 11, 1600.0),
                ("amp+adamw", "torch_foreach", 9.5, False, 4000.0, 2.5, 1.7, 524.0, 70, 6000.0))]
    step = tmp_path / "bench_step_cuda.json"
    step.write_text(json.dumps(dict(meta=meta, rows=rows)))
    page = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "add_result.py"), str(step),
                           "--machine", "H200 test", "--results", str(results),
                           "--page", str(page)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    written = json.loads((results / "h200-test-2026-12-04-step.json").read_text())
    (table,) = written["tables"]
    assert [c["key"] for c in table["columns"]] == [
        "shape", "tensors", "op", "impl", "device_ms", "vs_fused", "host_us", "host_vs_fused",
        "gbps", "of_copy", "launches", "profiled_us", "waits"]
    assert timing in table["note"]
    text = page.read_text()
    assert ("| device time, median (ms) | device time / torch fused (x) | host time, median (us) "
            "| host time / torch fused (x) |") in text
    assert "| gpt2 | 148 | adamw | titanmac_c | 1.163 | 0.71 | 558 | 0.58 | 2996.0 | 0.75 | 1 | " \
           "1150 | - |" in text
    assert "| gpt2 | 148 | amp+adamw | torch_foreach | 9.500 | 2.50 | 4000 | 1.70 | 524.0 | 0.13 " \
           "| 70 | 6000 | yes: a host sync |" in text
