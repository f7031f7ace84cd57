"""The user-facing scripts of benchmarks/ and the profiling ranges (titanmac_c._internal.profiling):

* train_lm.py, the copyable training example, trains to a lower loss on the CPU (plain, bf16 with
  gradient accumulation), accumulates gradients correctly, and follows the fp16 GradScaler flow
  (an overflowing step is skipped and the scale backs off);
* profile_step.py runs with tiny settings and writes both implementations' figures;
* plot_results.py writes readable PNGs (labelled axes, legends) from JSON made here;
* step_range is a no-op without a profiler and a named range under torch.profiler.

These run on the CPU in a few seconds each. plot_results needs matplotlib: its test fails (never
skips) when matplotlib is missing.
"""

import importlib.util
import json
import os
import struct
import sys

import pytest
import torch

import titanmac_c
from titanmac_c._internal import profiling as _profiling
from conftest import ROOT

BENCH = os.path.join(ROOT, "benchmarks")


def _load(name):
    """Import benchmarks/<name>.py as a module (the folder is not a package)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(f"_bench_{name}",
                                                  os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_LM = ["--device", "cpu", "--d-model", "64", "--layers", "2", "--heads", "4", "--seq-len",
           "32", "--batch-size", "8", "--eval-batches", "4", "--warmup", "5", "--quiet",
           "--log-every", "1000"]


# ---------------------------------------------------------------------------- train_lm.py

def test_train_lm_lowers_the_loss_on_cpu():
    train_lm = _load("train_lm")
    out = train_lm.main(TINY_LM + ["--steps", "30", "--accum", "2"])
    assert out["final_val_loss"] < out["initial_val_loss"] - 0.3, out
    assert out["last_train_loss"] < out["first_train_loss"], out
    assert all(torch.isfinite(torch.tensor(out["train_losses"])))


def test_train_lm_bf16_autocast_with_accumulation_lowers_the_loss():
    train_lm = _load("train_lm")
    out = train_lm.main(TINY_LM + ["--steps", "20", "--accum", "3", "--amp", "bf16"])
    assert out["final_val_loss"] < out["initial_val_loss"] - 0.2, out


def _tiny_model(train_lm, vocab):
    torch.manual_seed(0)
    return train_lm.TitanMACLM(vocab, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def test_train_lm_accumulation_equals_one_big_batch():
    """2 micro-batches of 4 give the gradients (and the step) of one batch of 8: zero_grad once
    per step, each micro-loss divided by the number of micro-batches."""
    import contextlib
    train_lm = _load("train_lm")
    data = train_lm.CharData(train_lm.generate_corpus(20_000), 16, torch.device("cpu"))
    x, y = data.train_batch(8)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runs = []
    for micro in ([(x, y)], [(x[:4], y[:4]), (x[4:], y[4:])]):
        model = _tiny_model(train_lm, data.vocab_size)
        opt = titanmac_c.DeepNestedOptimizer(model, base_lr=1e-3)
        # a first step so that zero_grad has stale gradients to clear in the second
        train_lm.train_step(model, opt, micro, contextlib.nullcontext, scaler)
        loss = train_lm.train_step(model, opt, micro, contextlib.nullcontext, scaler)
        runs.append((model, float(loss)))
    (big, big_loss), (acc, acc_loss) = runs
    assert acc_loss == pytest.approx(big_loss, rel=1e-6)
    for (name, p), q in zip(big.named_parameters(), acc.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(q, p, rtol=0, atol=3e-3, msg=name)  # 1 step: |du| <= ~2 lr


def test_train_lm_fp16_overflow_step_is_skipped_and_the_scale_backs_off():
    """The GradScaler flow around DeepNestedOptimizer: a scale so large that the fp16 backward
    overflows gives Inf gradients after unscale_; the optimizer skips the step (parameters
    unchanged) and scaler.update() halves the scale. The next, sane step updates."""
    train_lm = _load("train_lm")
    data = train_lm.CharData(train_lm.generate_corpus(20_000), 16, torch.device("cpu"))
    model = _tiny_model(train_lm, data.vocab_size)
    opt = titanmac_c.DeepNestedOptimizer(model, base_lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120)

    def autocast():
        return torch.autocast("cpu", dtype=torch.float16)

    before = [p.detach().clone() for p in model.parameters()]
    train_lm.train_step(model, opt, [data.train_batch(4)], autocast, scaler)
    assert float(opt.skipped) == 1.0
    assert scaler.get_scale() == 2.0 ** 119
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p.detach())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train_lm.train_step(model, opt, [data.train_batch(4)], autocast, scaler)
    assert float(opt.skipped) == 0.0
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


# ---------------------------------------------------------------------------- profile_step.py

def test_profile_step_tiny_run_writes_both_implementations(tmp_path, capsys):
    profile_step = _load("profile_step")
    out = tmp_path / "profile.json"
    profile_step.main(["--device", "cpu", "--warmup", "1", "--steps", "2", "--profile-steps", "2",
                       "--top", "5", "--out", str(out), "--quiet",
                       "--compare", str(tmp_path / "none.json")])
    printed = capsys.readouterr().out
    assert "reference" in printed and "titanmac_c" in printed
    assert "Top ATen operations by host time" in printed
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["range_inactive_ns"] > 0
    (size,) = data["sizes"]
    assert size["size"] == "titanmac"
    ref, ours = size["impls"]["reference"], size["impls"]["titanmac_c"]
    for r in (ref, ours):
        assert r["params"] == 3_237_888 and r["tensors"] == 48
        assert r["steps_per_s"] > 0 and r["opt_ms"] > 0 and r["profiled_host_ms_per_step"] > 0
        for part in ("train/forward", "train/backward", "train/optimizer", _profiling.STATS,
                     _profiling.CONTROLLER, _profiling.UPDATE):
            assert r["parts"][part]["host_ms"] > 0, part
        assert r["top_host"] and r["aten_ops_per_step"] > 0
        assert r["device_ms_per_step"] is None and r["launches_per_step"] is None  # CPU
        assert r["opt_state_bytes"] > 0 and r["peak_bytes"] >= r["param_bytes"]
        assert os.path.exists(r["trace"])
    assert _profiling.CLIP in ref["parts"]                  # the reference's own clip pass
    assert ref["final_loss"] == pytest.approx(ours["final_loss"], rel=1e-4)
    # the reference reads scalars every step (loss.item(), the NaN check, torch AdamW's step
    # counters); the titanmac_c optimizer step reads none
    assert ref["scalar_reads_per_opt_step"] >= 2 and ours["scalar_reads_per_opt_step"] == 0
    # the reference's CMS buffers in every mode (B11 in docs/deep_nested_optimizer.md section 14)
    assert ref["opt_state_bytes"] > 4 * ours["opt_state_bytes"]


# ---------------------------------------------------------------------------- bench_step.py

def test_bench_step_tiny_cpu_run_writes_device_and_host_time(tmp_path, capsys):
    """Every variant's row carries the device and the host time; on the CPU both are the step's
    wall time, and the bandwidth and the ratio to torch fused come from the device time. The
    output goes through add_result.py (both columns in the table) and plot_results.py."""
    bench_step = _load("bench_step")
    out = tmp_path / "bench_step_cpu.json"
    bench_step.main(["--sizes", "100k", "--reps", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "device ms" in printed and "host us" in printed
    assert "on the CPU the wall time of the step" in printed
    data = json.loads(out.read_text())
    assert "wall time" in data["meta"]["timing"]
    rows = data["rows"]
    assert {(r["op"], r["impl"]) for r in rows} == set(bench_step.variants_for(torch.device("cpu")))
    fused = {r["op"]: r for r in rows if r["impl"] == "torch_fused"}
    for r in rows:
        assert r["params"] == 100_000 and r["tensors"] == 20
        assert r["device_ms"] > 0 and r["device_p90_ms"] >= r["device_ms"]
        assert r["host_us"] == pytest.approx(r["device_ms"] * 1e3)
        assert r["device_covered"] is True and r["spin_us"] == 0.0
        assert r["gbs"] == pytest.approx(
            bench_step.BYTES_PER_ELEMENT[r["op"]] * 100_000 / (r["device_ms"] / 1e3) / 1e9)
        assert r["frac_of_copy"] == pytest.approx(r["gbs"] / r["copy_gbs"])
        assert r["ratio_vs_torch_fused"] == pytest.approx(
            r["device_ms"] / fused[r["op"]]["device_ms"])
        assert r["host_ratio_vs_torch_fused"] == pytest.approx(
            r["host_us"] / fused[r["op"]]["host_us"])
        assert r["launches"] is None and r["profiled_device_us"] is None
    add_result = _load("add_result")
    result = add_result.result_file(data, "2-core CPU", None, "abc1234")
    (table,) = result["tables"]
    keys = [c["key"] for c in table["columns"]]
    assert keys[4:8] == ["device_ms", "vs_fused", "host_us", "host_vs_fused"]
    assert "waits" not in keys and "wall time" in table["note"]
    assert [row["device_ms"] for row in table["rows"]] == [r["device_ms"] for r in rows]
    assert [row["host_us"] for row in table["rows"]] == [r["host_us"] for r in rows]
    _require_matplotlib()
    plot_results = _load("plot_results")
    series = plot_results.step_time_series(plot_results.load([str(out)])["cpu"])
    assert dict(series["adamw"]["titanmac_c"])[100_000] == pytest.approx(
        next(r["device_ms"] for r in rows if r["op"] == "adamw" and r["impl"] == "titanmac_c"))


def test_bench_step_spin_doubles_until_it_covers_the_step():
    """The spin ahead of a step doubles, at most three times, until it outlasts the step's host
    work; a step that waits on the GPU is never covered and keeps the last try."""
    bench_step = _load("bench_step")
    tries = []

    def timer(fn, spin):
        tries.append(spin)
        return spin * 10, spin >= 0.0035  # (seconds, covered) as Timer returns them

    assert bench_step.device_seconds(timer, None, 0.001) == (0.04, True, 0.004)
    assert tries == [0.001, 0.002, 0.004]
    tries.clear()
    assert bench_step.device_seconds(timer, None, 0.0001) == (0.008, False, 0.0008)
    assert tries == [0.0001, 0.0002, 0.0004, 0.0008]
    tries.clear()
    assert bench_step.device_seconds(timer, None, 0.0001, retry=False) == (0.001, False, 0.0001)
    assert tries == [0.0001]
    assert bench_step.first_spin(torch.device("cuda"), 0.001) == pytest.approx(0.00205)
    assert bench_step.first_spin(torch.device("cpu"), 0.001) == 0.0


# ---------------------------------------------------------------------------- plot_results.py

def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("matplotlib is not installed: plot_results.py and this test need it "
                    "(pip install matplotlib)")


def _fake_results(tmp_path):
    rows = []
    for shape, n, copy in (("1M", 1_000_000, 100.0), ("10M", 10_000_000, 50.0)):
        for op, impls in (("adamw", ("titanmac_c", "torch_fused", "torch_foreach")),
                          ("clip+adamw", ("titanmac_c", "torch_fused"))):
            for k, impl in enumerate(impls):
                ms = n / 1e6 * (1.0 + 0.5 * k)
                gbs = 28 * n / (ms / 1e3) / 1e9
                rows.append(dict(shape=shape, params=n, tensors=10, op=op, impl=impl,
                                 median_ms=ms, gbs=gbs, frac_of_copy=gbs / copy, copy_gbs=copy))
    meta = dict(device="cpu", torch=torch.__version__, threads=2, date="2026-01-01")
    step = tmp_path / "bench_step_cpu.json"
    step.write_text(json.dumps(dict(meta=meta, rows=rows)))
    train = tmp_path / "bench_train_cpu.json"
    train.write_text(json.dumps(dict(meta=meta, rows=[
        dict(impl="reference", steps_per_s=5.0, opt_ms=30.0, final_loss=1.0),
        dict(impl="titanmac_c", steps_per_s=20.0, opt_ms=2.5, final_loss=1.0)])))
    prof = tmp_path / "profile_step_cpu.json"
    prof.write_text(json.dumps(dict(meta=meta, sizes=[
        dict(size="d512l4", impls=dict(reference=dict(params=12_775_424, opt_ms=90.0),
                                       titanmac_c=dict(params=12_775_424, opt_ms=8.0)))])))
    return [str(step), str(train), str(prof)]


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_plot_results_writes_readable_pngs(tmp_path):
    _require_matplotlib()
    plot_results = _load("plot_results")
    inputs = _fake_results(tmp_path)
    figures = plot_results.make_figures(inputs)
    assert set(figures) == {"step_time_vs_size_cpu.png", "bandwidth_cpu.png"}
    for name, fig in figures.items():
        assert fig._suptitle is not None and fig._suptitle.get_text()
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), name
            legend = ax.get_legend()
            assert legend is not None and len(legend.get_texts()) >= 2, name
    step_axes = figures["step_time_vs_size_cpu.png"].axes
    assert [ax.get_title() for ax in step_axes][-1].startswith("DeepNestedOptimizer")
    labels = {t.get_text() for t in step_axes[-1].get_legend().get_texts()}
    assert any("reference" in t for t in labels) and "titanmac_c" in labels
    assert "ms" in step_axes[0].get_ylabel()
    import matplotlib.pyplot as plt
    for fig in figures.values():
        plt.close(fig)
    written = plot_results.main(["--inputs", *inputs, "--out", str(tmp_path / "plots")])
    assert len(written) == 2
    for path in written:
        width, height = _png_size(path)
        assert width >= 800 and height >= 400, (path, width, height)
        assert os.path.getsize(path) > 20_000


# ---------------------------------------------------------------------------- _profiling

def test_step_range_is_a_shared_no_op_without_a_profiler():
    assert not _profiling.profiler_active()
    _profiling.set_nvtx(True)  # wanted, but CUDA is not initialised in this process: no NVTX
    try:
        if not torch.cuda.is_initialized():
            assert _profiling.step_range(_profiling.STATS) is _profiling.step_range("x")
    finally:
        _profiling.set_nvtx(None)
    with _profiling.step_range(_profiling.UPDATE) as r:
        assert r is not None
    assert _profiling.inactive_cost_ns(20_000) < 5_000  # ~0.15 us; loose for shared machines


def test_step_range_records_named_ranges_under_torch_profiler():
    @_profiling.annotate(_profiling.CONTROLLER)
    def controller():
        return torch.ones(4).sum()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert _profiling.profiler_active()
        with _profiling.step_range(_profiling.STATS):
            torch.ones(3).mul(2)
        controller()
    names = [e.name for e in prof.events()]
    assert _profiling.STATS in names and _profiling.CONTROLLER in names
    assert names.index(_profiling.STATS) < names.index("aten::mul")
    assert set(_profiling.PARTS) >= {"titanmac/stats", "titanmac/controller", "titanmac/clip",
                                     "titanmac/update", "titanmac/cms"}


def test_nvtx_setting_from_the_environment(monkeypatch):
    try:
        monkeypatch.setenv("TITANMAC_NVTX", "1")
        _profiling.set_nvtx(None)
        assert _profiling._nvtx_wanted
        monkeypatch.setenv("TITANMAC_NVTX", "0")
        monkeypatch.setenv("NVTX_INJECTION64_PATH", "/some/tool.so")
        _profiling.set_nvtx(None)
        assert not _profiling._nvtx_wanted
        monkeypatch.delenv("TITANMAC_NVTX")
        _profiling.set_nvtx(None)
        assert _profiling._nvtx_wanted                      # auto: a tool is attached
        monkeypatch.delenv("NVTX_INJECTION64_PATH")
        _profiling.set_nvtx(None)
        assert not _profiling._nvtx_wanted
        monkeypatch.setenv("TITANMAC_NVTX", "maybe")
        with pytest.raises(ValueError, match="TITANMAC_NVTX"):
            _profiling.set_nvtx(None)
    finally:
        monkeypatch.delenv("TITANMAC_NVTX", raising=False)
        _profiling.set_nvtx(None)


# ---------------------------------------------------------------------------- bench_host.py

def test_bench_host_tiny_run_prints_every_row(capsys):
    threads = torch.get_num_threads()
    try:
        _load("bench_host").main(["--counts", "6", "--steps", "5"])
    finally:
        torch.set_num_threads(threads)  # the script pins one thread for its figures
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "tensors" in line or " conv " in line]
    assert len(rows) == 8, out  # 3 AdamW rows, the DNO's, 2 x 2 layout rows
    assert all(float(line.split()[-1]) > 0.0 for line in rows)


# -------------------------------------------------------------------------- bench_phase1.py

@pytest.mark.slow
def test_bench_phase1_tiny_run_counts_every_implementation(capsys):
    """One Phase 1 of each implementation on the CPU: every row printed with its ATen op count;
    CUDA's torch ops dispatch well under the reference autograd's count (the host time they
    exist to cut: ~800 against ~2,200, benchmarks/RESULTS.md)."""
    _load("bench_phase1").main(["--reps", "1", "--steps", "1"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("reference", "torch_ops", "c_op")}
    assert set(rows) == {"reference", "torch_ops", "c_op"}, out
    ops = {k: int(v[1]) for k, v in rows.items()}
    assert all(float(v[2]) > 0.0 for v in rows.values()), out
    assert 0 < ops["c_op"] < ops["torch_ops"] < ops["reference"] / 2, ops
