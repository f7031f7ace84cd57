"""Plots (PNG) from the benchmark JSON files: step time against model size, and bandwidth as a
fraction of copy bandwidth.

Reads (default: every *.json in benchmarks/out/, newest file of each kind per device)
  bench_step*.json    benchmarks/bench_step.py    AdamW / clip+AdamW (/ stats+clip+AdamW) steps of
                                                  titanmac_c and torch (fused, foreach, for-loop)
  bench_train*.json   benchmarks/bench_train.py   DeepNestedOptimizer step, reference vs titanmac_c
                                                  (the 3.2M TitanMAC-like model)
  profile_step*.json  benchmarks/profile_step.py  the same per model size (--sizes)
and writes, per device, into --out (default benchmarks/plots/):
  step_time_vs_size_<device>.png   median step time (ms) against parameters, log-log, one panel
                                   per operation: titanmac_c, torch and the reference (bench_step:
                                   the device time, in files that have it)
  bandwidth_<device>.png           effective bandwidth of each step over the bandwidth of a plain
                                   device copy of the same size measured in the same run

Usage: python benchmarks/plot_results.py [--inputs a.json b.json ...] [--out benchmarks/plots]
Needs matplotlib (pip install matplotlib).
"""

import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FuncFormatter = None  # matplotlib.ticker.FuncFormatter, imported with matplotlib
TITANMAC_PARAMS = 3_237_888  # tests/dno_models.make_titanmac_like_model (bench_train's model)

STYLE = {  # impl -> (label, colour, marker)
    "titanmac_c": ("titanmac_c", "#d62728", "o"),
    "torch_fused": ("torch fused=True", "#1f77b4", "s"),
    "torch_foreach": ("torch foreach=True", "#2ca02c", "^"),
    "torch_forloop": ("torch for-loop", "#9467bd", "v"),
    "reference": ("reference DNO (pure PyTorch)", "#7f7f7f", "D"),
}
OP_TITLES = {
    "adamw": "AdamW step",
    "clip+adamw": "clip_grad_norm_ + AdamW step",
    "stats+clip+adamw": "group norms + clip + AdamW",
    "dno": "DeepNestedOptimizer.step() in training",
}


def _import_matplotlib():
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("plot_results.py needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _kind(data):
    rows = data.get("rows")
    if "sizes" in data:
        return "profile_step"
    if rows and "op" in rows[0]:
        # the plots are of float32 steps; a float64 run (bench_step.py --dtype float64) is not
        return "bench_step" if data.get("meta", {}).get("dtype", "float32") == "float32" else None
    if rows and "steps_per_s" in rows[0]:
        return "bench_train"
    return None


def _params_of_shape(row):
    if row.get("params"):
        return row["params"]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB])", row["shape"], re.IGNORECASE)
    if match:
        return int(float(match.group(1)) * {"K": 1e3, "M": 1e6, "B": 1e9}[match.group(2).upper()])
    sys.path.insert(0, HERE)
    from bench_step import named_sizes  # the CUDA shape sets: titanmac, gpt2, 1b
    return sum(named_sizes(row["shape"]))


def load(paths):
    """{device: {kind: data}} keeping, per device and kind, the newest file (by mtime); the sizes
    of all profile_step files are merged."""
    found = {}
    for path in sorted(paths, key=lambda p: os.path.getmtime(p) if isinstance(p, str) else 0):
        if isinstance(path, str):
            with open(path) as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError:
                    continue
        else:
            data = path
        if not isinstance(data, dict):
            continue
        kind = _kind(data)
        if kind is None:
            continue
        device = str(data.get("meta", {}).get("device", "cpu")).split(":")[0]
        bundle = found.setdefault(device, {})
        if kind == "profile_step" and kind in bundle:
            # profile_step runs add up: sizes from every file, a newer file's size replacing an
            # older one's
            merged = {s["size"]: s for s in bundle[kind]["sizes"]}
            merged.update({s["size"]: s for s in data["sizes"]})
            data = dict(data, sizes=list(merged.values()))
        bundle[kind] = data
    return found


def step_ms(row):
    """A bench_step row's time: its device time, or, in files written before bench_step.py timed
    device and host apart, its one median."""
    return row["device_ms"] if "device_ms" in row else row["median_ms"]


def step_time_series(bundle):
    """{op: {impl: [(params, ms), ...]}} from bench_step, bench_train and profile_step."""
    series = {}
    step = bundle.get("bench_step")
    if step:
        for r in step["rows"]:
            series.setdefault(r["op"], {}).setdefault(r["impl"], []).append(
                (_params_of_shape(r), step_ms(r)))
    dno = {}
    train = bundle.get("bench_train")
    if train:
        for r in train["rows"]:
            dno.setdefault(r["impl"], {})[TITANMAC_PARAMS] = r["opt_ms"]
    prof = bundle.get("profile_step")
    if prof:
        for size in prof["sizes"]:
            for impl, r in size["impls"].items():
                dno.setdefault(impl, {})[r["params"]] = r["opt_ms"]  # newer figure wins
    if dno:
        series["dno"] = {impl: sorted(points.items()) for impl, points in dno.items()}
    for op in series.values():
        for impl in op:
            op[impl] = sorted(op[impl])
    return series


def _subtitle(bundle):
    parts = []
    for kind in ("bench_step", "bench_train", "profile_step"):
        meta = bundle.get(kind, {}).get("meta")
        if meta:
            where = meta.get("gpu") or f"{meta.get('threads', '?')} threads"
            parts.append(f"{kind}.py {meta.get('date', '?')}, {where}, torch {meta.get('torch')}")
    return "; ".join(parts)


def plot_step_time(plt, device, bundle):
    series = step_time_series(bundle)
    ops = [op for op in ("adamw", "clip+adamw", "stats+clip+adamw", "dno") if op in series]
    if not ops:
        return None
    fig, axes = plt.subplots(1, len(ops), figsize=(4.6 * len(ops) + 0.6, 4.6), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for impl, points in series[op].items():
            label, colour, marker = STYLE.get(impl, (impl, None, "x"))
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=marker, color=colour, label=label, linewidth=1.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if f"{v:.1g}"[0] in "25" else ""))
        ax.set_xlabel("model size (parameters, log scale)")
        ax.set_ylabel("median step time (ms, log scale)")
        ax.set_title(OP_TITLES.get(op, op), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Optimizer step time against model size, {device} (lower is better)\n"
                 f"{_subtitle(bundle)}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_bandwidth(plt, device, bundle):
    step = bundle.get("bench_step")
    if not step:
        return None
    rows = step["rows"]
    ops = [op for op in ("adamw", "clip+adamw", "stats+clip+adamw")
           if any(r["op"] == op for r in rows)]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    copy = {r["shape"]: r["copy_gbs"] for r in rows}
    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops) + 0.6, 4.6), squeeze=False)
    for ax, op in zip(axes[0], ops):
        impls = list(dict.fromkeys(r["impl"] for r in rows if r["op"] == op))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            label, colour, _ = STYLE.get(impl, (impl, None, "x"))
            values = []
            for shape in shapes:
                match = [r for r in rows if r["op"] == op and r["impl"] == impl
                         and r["shape"] == shape]
                values.append(match[0]["frac_of_copy"] if match else 0.0)
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, values, width=width, color=colour, label=label)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1,
                   label="copy bandwidth (same run)")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{s}\ncopy {copy[s]:.0f} GB/s" for s in shapes], fontsize=8)
        ax.set_xlabel("parameters (shape set), with the copy bandwidth measured")
        ax.set_ylabel("effective bandwidth / copy bandwidth (fraction)")
        ax.set_title(f"{OP_TITLES.get(op, op)} (higher is better)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Bandwidth as a fraction of copy bandwidth, {device}: (bytes the step must move"
                 " / time) over the bandwidth of an 8 B/element copy\nbytes per element: fp32 "
                 "AdamW 28, clip + AdamW 32, stats + clip + AdamW 36; "
                 + _subtitle({"bench_step": step}), fontsize=9)
    fig.tight_layout()
    return fig


def make_figures(inputs):
    """{file name: matplotlib Figure} (not yet saved) for every device found in inputs (paths
    or already-loaded dicts)."""
    plt = _import_matplotlib()
    global FuncFormatter
    from matplotlib.ticker import FuncFormatter
    figures = {}
    for device, bundle in load(inputs).items():
        fig = plot_step_time(plt, device, bundle)
        if fig is not None:
            figures[f"step_time_vs_size_{device}.png"] = fig
        fig = plot_bandwidth(plt, device, bundle)
        if fig is not None:
            figures[f"bandwidth_{device}.png"] = fig
    return figures


def main(argv=None):
    sys.path.insert(0, HERE)
    from _cli import make_parser
    parser = make_parser("PNG plots from the benchmark JSON files: step time against model size, "
                         "bandwidth as a fraction of copy bandwidth.")
    parser.add_argument("--inputs", nargs="*", default=None,
                        help="JSON files (default: benchmarks/out/*.json, the newest of each kind "
                             "per device)")
    parser.add_argument("--out", default=os.path.join(HERE, "plots"),
                        help="output folder (default: benchmarks/plots)")
    parser.add_argument("--dpi", type=int, default=110, help="resolution of the PNGs")
    args = parser.parse_args(argv)
    inputs = args.inputs or sorted(glob.glob(os.path.join(HERE, "out", "*.json")))
    if not inputs:
        raise SystemExit("plot_results.py: no JSON inputs (run bench_step.py / bench_train.py / "
                         "profile_step.py first, or pass --inputs)")
    figures = make_figures(inputs)
    if not figures:
        raise SystemExit(f"plot_results.py: nothing to plot in {inputs}")
    os.makedirs(args.out, exist_ok=True)
    import matplotlib.pyplot as plt
    written = []
    for name, fig in figures.items():
        path = os.path.join(args.out, name)
        fig.savefig(path, dpi=args.dpi)
        plt.close(fig)
        written.append(path)
        print(f"[plot_results] {os.path.relpath(path)}")
    return written


if __name__ == "__main__":
    main()
