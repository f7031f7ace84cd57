"""Turn what a benchmark script wrote (its --out JSON) into a result file of benchmarks/results/,
then regenerate benchmarks/RESULTS.md from all of them (make_results.py).

    python benchmarks/bench_step.py --device cuda
    python benchmarks/add_result.py benchmarks/out/bench_step_cuda.json --machine H100

Takes the output of bench_step.py (the AdamW and clip + AdamW step against torch's AdamW) and of
bench_train.py (the DeepNestedOptimizer against the reference). The result file carries the run's
metadata: the date, torch version, threads and device the script recorded, the command it was run
with, the commit checked out now (run this right after the benchmark), and --machine and
--hardware. Its name, <machine>-<date>-<benchmark>.json, is its id; a second run of the same
benchmark on the same machine and day replaces the first (git keeps the history).
"""

import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_results  # noqa: E402  (benchmarks/ is not a package)
from _cli import make_parser  # noqa: E402

# bench_step.py's output before it timed device and host apart (median_ms: events around the
# step on an idle GPU)
STEP_COLUMNS_OLD = [
    dict(key="shape", label="parameters"),
    dict(key="tensors", label="tensors", decimals=0),
    dict(key="op", label="op"),
    dict(key="impl", label="impl"),
    dict(key="median_ms", label="median", unit="ms", decimals=3),
    dict(key="vs_fused", label="time / torch fused", unit="x", decimals=2),
    dict(key="gbps", label="bandwidth", unit="GB/s", decimals=1),
    dict(key="of_copy", label="of copy bandwidth", unit="fraction", decimals=2),
    dict(key="launches", label="launches", decimals=0),
]
STEP_COLUMNS = [
    dict(key="shape", label="parameters"),
    dict(key="tensors", label="tensors", decimals=0),
    dict(key="op", label="op"),
    dict(key="impl", label="impl"),
    dict(key="device_ms", label="device time, median", unit="ms", decimals=3),
    dict(key="vs_fused", label="device time / torch fused", unit="x", decimals=2),
    dict(key="host_us", label="host time, median", unit="us", decimals=0),
    dict(key="host_vs_fused", label="host time / torch fused", unit="x", decimals=2),
    dict(key="gbps", label="bandwidth", unit="GB/s", decimals=1),
    dict(key="of_copy", label="of copy bandwidth", unit="fraction", decimals=2),
    dict(key="launches", label="launches", decimals=0),
    dict(key="profiled_us", label="profiled device time", unit="us", decimals=0),
]
# added where a step's device time could not be taken alone (it waits on the GPU)
WAITS_COLUMN = dict(key="waits", label="device time includes host time")
TRAIN_COLUMNS = [
    dict(key="impl", label="impl"),
    dict(key="steps_per_s", label="training", unit="steps/s", decimals=2),
    dict(key="opt_median_ms", label="optimizer step, median", unit="ms", decimals=3),
    dict(key="opt_mean_ms", label="optimizer step, mean", unit="ms", decimals=3),
    dict(key="launches", label="launches", decimals=0),
    dict(key="syncs", label="host syncs", decimals=0),
    dict(key="state_mb", label="optimizer state", unit="MB", decimals=1),
    dict(key="peak_mb", label="peak memory", unit="MB", decimals=1),
    dict(key="final_loss", label="final loss", decimals=5),
]


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def current_commit():
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def kind_of(data):
    """'step' (bench_step.py) or 'train' (bench_train.py), from the rows' keys."""
    rows = data.get("rows") or []
    if rows and "op" in rows[0] and "ratio_vs_torch_fused" in rows[0]:
        return "step"
    if rows and "steps_per_s" in rows[0] and "opt_ms" in rows[0]:
        return "train"
    raise SystemExit("add_result: not the output of bench_step.py or bench_train.py")


def step_table(meta, rows, file_id):
    """The table of a bench_step.py output: device and host time apart where it has them
    (device_ms), else the single median of earlier versions."""
    dtype = meta.get("dtype", "float32")
    table = dict(id=f"{file_id}-{dtype}", title=f"AdamW and clip + AdamW step, {dtype}")
    if "device_ms" not in rows[0]:
        out = [dict(shape=r["shape"], tensors=r["tensors"], op=r["op"], impl=r["impl"],
                    median_ms=r["median_ms"], vs_fused=r["ratio_vs_torch_fused"], gbps=r["gbs"],
                    of_copy=r["frac_of_copy"], launches=r.get("launches")) for r in rows]
        return dict(table, columns=STEP_COLUMNS_OLD, rows=out,
                    note=("Median over round-robin repetitions. `time / torch fused`: median "
                          "time over torch `AdamW(fused=True)`'s for the same op. Bandwidth "
                          "counts the bytes the step must move; `of copy bandwidth` divides it "
                          "by a copy's measured in the same run."))
    out = [dict(shape=r["shape"], tensors=r["tensors"], op=r["op"], impl=r["impl"],
                device_ms=r["device_ms"], vs_fused=r["ratio_vs_torch_fused"],
                host_us=r["host_us"], host_vs_fused=r["host_ratio_vs_torch_fused"],
                gbps=r["gbs"], of_copy=r["frac_of_copy"], launches=r.get("launches"),
                profiled_us=r.get("profiled_device_us")) for r in rows]
    columns = list(STEP_COLUMNS)
    if not all(r.get("device_covered", True) for r in rows):
        columns.append(WAITS_COLUMN)
        for o, r in zip(out, rows):
            o["waits"] = None if r.get("device_covered", True) else "yes: a host sync"
    timing = meta.get("timing", "")
    return dict(table, columns=columns, rows=out,
                note=("Medians over round-robin repetitions; `/ torch fused`: over torch "
                      "`AdamW(fused=True)`'s for the same op. Bandwidth counts the bytes the step "
                      "must move over its device time; `of copy bandwidth` divides it by a "
                      "copy's measured in the same run. " + timing).strip())


def train_table(meta, rows, file_id):
    out = [dict(impl=r["impl"], steps_per_s=r["steps_per_s"], opt_median_ms=r["opt_ms"],
                opt_mean_ms=r.get("opt_mean_ms"), launches=r.get("launches"),
                syncs=r.get("syncs"), state_mb=r.get("state_mb"), peak_mb=r.get("peak_mb"),
                final_loss=r.get("final_loss")) for r in rows]
    mode = meta.get("mode", "adamw")
    what = "AdamW mode" if mode == "adamw" else f"CMS mode, {meta.get('net', 'direct')} network"
    return dict(id=file_id, title=f"DeepNestedOptimizer, {what}",
                note=("The TitanMAC-like model (3.2M parameters in 48 tensors). Optimizer step "
                      "time, median and mean; launches and host syncs inside one step (CUDA)."),
                columns=TRAIN_COLUMNS, rows=out)


def result_file(data, machine, hardware, commit):
    """The result file (a dict) of one benchmark script's output."""
    meta = data.get("meta", {})
    kind = kind_of(data)
    device = "cuda" if str(meta.get("device", "cpu")).startswith("cuda") else "cpu"
    date = meta.get("date") or "unknown"
    name = kind
    if kind == "step" and meta.get("dtype", "float32") != "float32":
        name += "-" + meta["dtype"]
    if kind == "train" and meta.get("mode", "adamw") != "adamw":
        name += "-cms" + ("-legacy" if meta.get("net") == "legacy" else "")
    file_id = f"{slug(machine)}-{date}-{name}"
    table = (step_table if kind == "step" else train_table)(meta, data["rows"], file_id)
    prefix = "cpu" if device == "cpu" else "gpu"
    software = ", ".join(f"{k} {meta[k]}" for k in ("threads", "titanmac_c", "cpu_isa")
                         if k in meta)
    return dict(schema=1, id=file_id,
                section=f"{prefix}-adamw-step" if kind == "step" else f"{prefix}-dno-train",
                device=device, machine=machine,
                hardware=hardware or meta.get("gpu") or meta.get("machine") or "unknown",
                date=date, commit=commit, torch=meta.get("torch", "unknown"),
                software=software or "unknown",
                command=meta.get("command") or f"python benchmarks/bench_{kind}.py",
                order=50, tables=[table])


def main(argv=None):
    parser = make_parser("Add a benchmark script's --out JSON (bench_step.py, bench_train.py) to "
                         "benchmarks/results/ and regenerate benchmarks/RESULTS.md.")
    parser.add_argument("output", nargs="+", help="the JSON files the scripts wrote")
    parser.add_argument("--machine", required=True,
                        help="a short name of the machine, e.g. H100 or 2-core CPU (required, no "
                             "default)")
    parser.add_argument("--hardware", default=None,
                        help="a description of the hardware (default: what the script recorded)")
    parser.add_argument("--results", default=make_results.RESULTS_DIR,
                        help="folder of result files (default: benchmarks/results)")
    parser.add_argument("--page", default=make_results.PAGE,
                        help="the page to regenerate (default: benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    commit = current_commit()
    for path in args.output:
        with open(path) as f:
            data = json.load(f)
        result = result_file(data, args.machine, args.hardware, commit)
        target = os.path.join(args.results, result["id"] + ".json")
        with open(target, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"add_result: {path} -> {target}")
    return make_results.main(["--results", args.results, "--out", args.page])


if __name__ == "__main__":
    sys.exit(main())
