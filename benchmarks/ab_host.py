"""Host time of two builds side by side: bench_host.py run against build A, then build B, then A
again, and so on for a number of rounds, so that whatever the machine drifts by (clock, cache,
other work) falls on both alike. Each build is a folder an installed titanmac_c lies in
(`pip install --no-deps --target DIR .` from each source tree). Per row: the median over the
rounds of each build's figure, and B / A.

Usage: python benchmarks/ab_host.py A_DIR B_DIR [--rounds 5] [--counts 48,1000] [--steps 1000]
                                    [--json FILE]
"""

import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _cli import make_parser  # noqa: E402


def child_env(build):
    env = dict(os.environ, PYTHONPATH=build)
    env.pop("PYTHONSTARTUP", None)
    return env


def extension_of(build):
    """The extension file a process with this build on its path imports (checked to lie in it:
    a build that fails to import must not be replaced by another one found further on)."""
    probe = "import titanmac_c; print(titanmac_c._C.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=child_env(build), cwd=HERE, check=True)
    path = done.stdout.strip()
    if not os.path.realpath(path).startswith(os.path.realpath(build) + os.sep):
        raise SystemExit(f"ab_host: {build} holds no titanmac_c (it imported {path})")
    return path


def bench_host_rows(build, counts, steps):
    """{(set, step): host us} of one bench_host.py run with this build."""
    command = [sys.executable, os.path.join(HERE, "bench_host.py"), "--counts", counts,
               "--steps", str(steps), "--controllers", ""]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(build), cwd=HERE,
                          check=True)
    rows = {}
    for line in done.stdout.splitlines():
        # bench_host.py's rows: f"{set:>19}  {step:<50} {us:>8.1f}"
        if len(line) > 71 and not line.startswith("["):
            try:
                rows[(line[:19].strip(), line[21:71].strip())] = float(line[71:])
            except ValueError:
                continue  # the header
    return rows


def main(argv=None):
    parser = make_parser("bench_host.py's host times of two installed builds, run alternately.")
    parser.add_argument("a", help="folder holding build A (the baseline)")
    parser.add_argument("b", help="folder holding build B")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each build, alternated")
    parser.add_argument("--counts", default="48,1000", help="bench_host.py --counts")
    parser.add_argument("--steps", type=int, default=1000, help="bench_host.py --steps")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    builds = {"A": args.a, "B": args.b}
    files = {name: extension_of(path) for name, path in builds.items()}
    runs = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):  # neither always goes first
            runs[name].append(bench_host_rows(builds[name], args.counts, args.steps))
    keys = [k for k in runs["A"][0] if all(k in run for run in runs["A"] + runs["B"])]
    table = []
    print(f"A: {files['A']}\nB: {files['B']}")
    print(f"{'set':>19}  {'step':<50} {'A us':>8} {'B us':>8} {'B/A':>6}")
    for key in keys:
        a = statistics.median(run[key] for run in runs["A"])
        b = statistics.median(run[key] for run in runs["B"])
        table.append({"set": key[0], "step": key[1], "a_us": a, "b_us": b, "ratio": b / a})
        print(f"{key[0]:>19}  {key[1]:<50} {a:>8.1f} {b:>8.1f} {b / a:>6.3f}")
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "python": sys.version.split()[0], "rounds": args.rounds, "steps": args.steps,
            "a": files["A"], "b": files["B"], "command": " ".join(sys.argv)}
    print(f"[ab_host] {args.rounds} rounds alternated, medians; torch {meta['torch']}, "
          f"Python {meta['python']}, {meta['date']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
