"""Write benchmarks/RESULTS.md from the result files in benchmarks/results/*.json.

Each result file holds one run of one benchmark on one machine: its metadata (id, section, device,
machine, hardware, date, commit, torch, software, command) and its tables (id, title, columns,
rows, an optional note, an optional command of its own and optional summary entries). The page is
a title, how the figures are measured, a summary of the headline figures (each linking to its
table), one section per benchmark and device, and the plots. Every table is headed by its
metadata and carries a stable anchor (its id) that other pages can link to.

Usage:
  python benchmarks/make_results.py            write benchmarks/RESULTS.md
  python benchmarks/make_results.py --check    exit 1 if RESULTS.md differs from what it would write

A result file, benchmarks/results/<machine>-<date>-<benchmark>.json (e.g. h100-2026-11-23-step):
  schema 1; id (the file name without .json); section (one of SECTIONS below); device (cpu or
  cuda); machine (short name: "2-core CPU", "H100"); hardware; date (YYYY-MM-DD); commit (short
  hash, or "unknown"); torch (version); software (threads, build, ...); command (a string, or a
  list of commands run for the one table); optional order (position in its section, default 100);
  tables: a list of
    id          the anchor on the page (lower case, digits and dashes; unique on the page)
    title       the table's heading
    command     optional: when the table's command differs from the file's
    note        optional: what was measured and what it shows
    columns     [{key, label, unit?, decimals?}]: unit "ms", "us", "GB/s", "MB", "x" (a ratio),
                "fraction", ...; decimals an int, or a list (one per row) where rows differ
    rows        [{key: value}]: numbers, or strings for ranges and composite cells; null for none
    summary     optional entries of the page's summary: {order, label, column, parts: [{label,
                where: {key: value}} (a cell) or {label, num: {...}, den: {...}} (a ratio of two
                rows' cells)], decimals?, suffix?}

To add a result: write a file in benchmarks/results/ (copy one of the same benchmark), run this
script, commit both. The output depends only on the result files and the names of the plots in
benchmarks/plots/, so it is deterministic.
"""

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "RESULTS.md")
PLOTS_DIR = os.path.join(HERE, "plots")

# Fields every result file carries, and every table.
FILE_FIELDS = ("schema", "id", "section", "device", "machine", "hardware", "date", "commit",
               "torch",
               "software", "command", "tables")
TABLE_FIELDS = ("id", "title", "columns", "rows")
COLUMN_FIELDS = ("key", "label")

# Section id -> heading, in page order. A result file names its section by id.
SECTIONS = [
    ("cpu-adamw-step", "CPU: AdamW and clip + AdamW step (`bench_step.py`)"),
    ("cpu-dno-train",
     "CPU: DeepNestedOptimizer training, reference vs titanmac_c (`bench_train.py`)"),
    ("cpu-dno-phase1", "CPU: CMS Phase 1 alone (`bench_phase1.py`)"),
    ("cpu-host", "CPU: host time of a step (`bench_host.py`)"),
    ("cpu-distributed", "CPU: FSDP2-sharded model (`bench_distributed.py`)"),
    ("cpu-builds", "CPU: compilers and loop bodies"),
    ("cpu-profile", "CPU: profile of a training step (`profile_step.py`)"),
    ("cpu-demo", "CPU: demo training (`demo_train.py`)"),
    ("gpu-adamw-step", "GPU (H100): AdamW and clip + AdamW step (`bench_step.py`)"),
    ("gpu-host", "GPU (H100): host time of a step (`bench_host.py`)"),
    ("gpu-dno-train",
     "GPU (H100): DeepNestedOptimizer training, reference vs titanmac_c (`bench_train.py`)"),
    ("gpu-profile", "GPU (H100): profile of the optimizer step (`profile_step.py`)"),
]

PLOT_TEXT = {
    "step_time_vs_size": "Step time against model size",
    "bandwidth": "Bandwidth as a fraction of copy bandwidth",
}
PLOT_DETAIL = {
    "step_time_vs_size": ("AdamW and clip + AdamW steps, titanmac_c against torch's fused, "
                          "foreach and for-loop AdamW; the DeepNestedOptimizer step, titanmac_c "
                          "against the pure-PyTorch reference (log-log, ms against parameters)"),
    "bandwidth": ("the bytes each step must move over its time, divided by the bandwidth of a "
                  "copy of the same size in the same run"),
}

INTRO = """\
Every figure on this page comes from a command in `benchmarks/`, run on the machine named above
its table, with the date, commit (`unknown` where it was not recorded) and torch version. All rows
of a table come from one run, the variants interleaved round-robin where the script does so:
compare ratios within a table, not absolute times across tables. The CPU figures come from a
shared 2-core machine whose load moves absolute times between runs, and "round 1 / round 2"
columns are repeated runs of the same build. Times are medians unless a column says otherwise.
On the GPU, `bench_step.py` reports a step's device time and host time apart: the device time
between two CUDA events recorded around the step with a spin kernel queued ahead of them, so that
the GPU is busy when the start event is recorded and the events bracket the kernels alone; the
host time as one enqueue after a synchronize. Its tables of 2026-11-23 and before have one time,
from two CUDA events around the step on an idle GPU: that counts the host work before the step's
first kernel as device time, and measures a step whose host enqueue is slower than its kernels
(small models, many tensors) at its host time. `bench_train.py` times the optimizer step on the
host between two device synchronizes; `bench_host.py` and the host columns give the time to
enqueue one step after a synchronize; kernel launches and host syncs are counted in one profiled
step. The data lives in [`results/`](results/), one JSON file per machine and run; this page is
generated from it by `python benchmarks/make_results.py` (`--check` verifies that the page matches
the data)."""


class ResultError(Exception):
    pass


def load(results_dir):
    """The result files, sorted by name, each checked for its fields."""
    files = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        name = os.path.basename(path)
        missing = [k for k in FILE_FIELDS if k not in data]
        if missing:
            raise ResultError(f"{name}: missing fields {missing}")
        if data["id"] + ".json" != name:
            raise ResultError(f"{name}: id {data['id']!r} does not match the file name")
        for t in data["tables"]:
            tmissing = [k for k in TABLE_FIELDS if k not in t]
            if tmissing:
                raise ResultError(f"{name}: table {t.get('id')!r} missing fields {tmissing}")
            for c in t["columns"]:
                if any(k not in c for k in COLUMN_FIELDS):
                    raise ResultError(f"{name}: table {t['id']}: column without key/label: {c}")
                d = c.get("decimals")
                if isinstance(d, list) and len(d) != len(t["rows"]):
                    raise ResultError(f"{name}: table {t['id']}: decimals of {c['key']} "
                                      "do not match the rows")
        data["_file"] = name
        files.append(data)
    ids = [t["id"] for d in files for t in d["tables"]] + [s for s, _ in SECTIONS]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ResultError(f"anchors used twice: {dup}")
    return files


def fmt_value(value, decimals):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        d = 0 if decimals is None else decimals
        return f"{value:.{d}f}"
    return str(value)


def cell(table, col, row_index):
    value = table["rows"][row_index].get(col["key"])
    d = col.get("decimals")
    if isinstance(d, list):
        d = d[row_index]
    text = fmt_value(value, d)
    stripped = text.lstrip(" ")
    text = "&nbsp;&nbsp;" * ((len(text) - len(stripped) + 1) // 2) + stripped
    return text.replace("|", "\\|")


def header(col):
    unit = col.get("unit")
    if unit in (None, "fraction"):
        return col["label"]
    return f"{col['label']} ({unit})"


def render_table(table):
    cols = table["columns"]
    out = ["| " + " | ".join(header(c) for c in cols) + " |",
           "|" + "---|" * len(cols)]
    for i in range(len(table["rows"])):
        out.append("| " + " | ".join(cell(table, c, i) for c in cols) + " |")
    return out


def code_or_text(command):
    """A command (or a list of commands) as code; a description of a method as text."""
    if isinstance(command, list):
        return "; ".join(code_or_text(c) for c in command)
    if command.startswith(("python ", "TITANMAC_", "OUT=", "STEPS=")):
        return f"`{command}`"
    return command


def metadata(data, table):
    command = table.get("command", data["command"])
    return [
        f"- Command: {code_or_text(command)}",
        f"- Date: {data['date']}; commit: `{data['commit']}`",
        f"- Hardware: {data['hardware']}",
        f"- Software: torch {data['torch']}; {data['software']}",
        f"- Data: [`results/{data['_file']}`](results/{data['_file']})",
    ]


def match(row, where):
    return all(row.get(k) == v for k, v in where.items())


def find_row(table, where, what):
    rows = [r for r in table["rows"] if match(r, where)]
    if len(rows) != 1:
        raise ResultError(f"summary {what!r}: {len(rows)} rows of {table['id']} match {where}")
    return table["rows"].index(rows[0])


def summary_figures(table, spec):
    col = next(c for c in table["columns"] if c["key"] == spec["column"])
    parts = []
    for part in spec["parts"]:
        if "where" in part:
            i = find_row(table, part["where"], spec["label"])
            text = cell(table, col, i)
            if col.get("unit") == "x" or spec.get("suffix"):
                text += spec.get("suffix", "x")
        else:
            num = table["rows"][find_row(table, part["num"], spec["label"])][spec["column"]]
            den = table["rows"][find_row(table, part["den"], spec["label"])][spec["column"]]
            text = fmt_value(num / den, spec.get("decimals", 2)) + spec.get("suffix", "")
        parts.append(text + (f" ({part['label']})" if part.get("label") else ""))
    return ", ".join(parts)


def render(files, plots):
    by_section = {}
    for data in files:
        by_section.setdefault(data["section"], []).append(data)
    order = [s for s, _ in SECTIONS if s in by_section]
    titles = dict(SECTIONS)
    unknown = sorted(set(by_section) - set(titles))
    if unknown:
        raise ResultError(f"unknown sections {unknown}: add them to SECTIONS in make_results.py")

    out = ["<!-- Generated by benchmarks/make_results.py from benchmarks/results/*.json: "
           "edit those",
           "     files and run `python benchmarks/make_results.py`, do not edit this page. -->", "",
           "# Benchmark results", "", INTRO, ""]

    summaries = []
    for data in files:
        for table in data["tables"]:
            for spec in table.get("summary", []):
                summaries.append((spec["order"], spec["label"], data, table, spec))
    summaries.sort(key=lambda s: (s[0], s[1]))
    out += ['<a id="summary"></a>', "", "## Summary", "",
            "| measurement | figures | machine, date | table |", "|---|---|---|---|"]
    for _, label, data, table, spec in summaries:
        figures = summary_figures(table, spec).replace("|", "\\|")
        out.append(f"| {label} | {figures} | {data['machine']}, {data['date']} | "
                   f"[{table['id']}](#{table['id']}) |")
    out.append("")

    out += ["Sections:", ""]
    for sid in order:
        out.append(f"- [{titles[sid]}](#{sid})")
    if plots:
        out.append("- [Plots](#plots)")
    out.append("")

    for sid in order:
        out += [f'<a id="{sid}"></a>', "", f"## {titles[sid]}", ""]
        # Optional "order" (default 100) first, then newest first, then by id.
        runs = sorted(by_section[sid], key=lambda d: d["id"])
        runs.sort(key=lambda d: d["date"], reverse=True)
        runs.sort(key=lambda d: d.get("order", 100))
        for data in runs:
            for table in data["tables"]:
                out += [f'<a id="{table["id"]}"></a>', "", f"### {table['title']}", ""]
                out += metadata(data, table) + [""]
                out += render_table(table) + [""]
                if table.get("note"):
                    out += [table["note"], ""]

    if plots:
        out += ['<a id="plots"></a>', "", "## Plots", "",
                "Written by `python benchmarks/plot_results.py` from the JSON files the benchmark "
                "scripts write to `benchmarks/out/` (not committed): on the CPU the runs of "
                "[cpu-adamw-step-fp32](#cpu-adamw-step-fp32), "
                "[cpu-dno-train-adamw](#cpu-dno-train-adamw) "
                "and [cpu-profile-sizes](#cpu-profile-sizes), on CUDA those of "
                "[gpu-adamw-step-fp32](#gpu-adamw-step-fp32), "
                "[gpu-dno-train-modes](#gpu-dno-train-modes) "
                "and [gpu-profile-adamw](#gpu-profile-adamw).", ""]
        for name in plots:
            stem, _ = os.path.splitext(name)
            kind, _, device = stem.rpartition("_")
            what = PLOT_TEXT.get(kind, kind.replace("_", " "))
            detail = PLOT_DETAIL.get(kind)
            dev = "CPU" if device == "cpu" else device.upper()
            out.append(f"- [{what}, {dev}](plots/{name})" + (f": {detail}." if detail else ""))
        out.append("")
        for name in plots:
            stem, _ = os.path.splitext(name)
            kind, _, device = stem.rpartition("_")
            dev = "CPU" if device == "cpu" else device.upper()
            out += [f"![{PLOT_TEXT.get(kind, kind)}, {dev}](plots/{name})", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def plot_names(plots_dir):
    """The plots, known kinds first (in PLOT_TEXT's order), CPU before CUDA."""
    kinds = list(PLOT_TEXT)

    def key(name):
        kind, _, device = os.path.splitext(name)[0].rpartition("_")
        return (kinds.index(kind) if kind in kinds else len(kinds), kind, device != "cpu", device)
    return sorted((os.path.basename(p) for p in glob.glob(os.path.join(plots_dir, "*.png"))),
                  key=key)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the page differs from what would be written")
    parser.add_argument("--results", default=RESULTS_DIR,
                        help="folder of result files (default %(default)s)")
    parser.add_argument("--out", default=PAGE, help="the page (default %(default)s)")
    parser.add_argument("--plots", default=PLOTS_DIR, help="folder of plots (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        text = render(load(args.results), plot_names(args.plots))
    except ResultError as exc:
        print(f"make_results: {exc}", file=sys.stderr)
        return 2
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"make_results: {args.out} does not match {args.results}; "
                  "run python benchmarks/make_results.py", file=sys.stderr)
            return 1
        print(f"make_results: {args.out} matches its data")
        return 0
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    print(f"make_results: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
