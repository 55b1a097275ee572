"""The margin of every tolerance in the test suite over the worst value it has seen across runs.

    HCP_RECORD_TOLERANCES=/tmp/run1.jsonl python -m pytest tests/test_attention.py   # once per run
    python benchmarks/tolerance_margins.py /tmp/run1.jsonl /tmp/run2.jsonl [--top 10] [--all]

Each file is one run's record (tests/tolerance.py appends a line {test, label, value, bound} per check).
Prints the checks sorted by margin = bound / worst value over the runs (the ten tightest, or all with
--all), then a summary: checks, runs, how many runs gave bitwise-identical figures, and every check with
a margin under 3x (exit code 1 if any).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict

REQUIRED_MARGIN = 3.0


def margin(value: float, bound: float) -> float:
    """bound / value; infinite for a value of 0 (or below); 0 for a NaN (it has no margin)."""
    if math.isnan(value):
        return 0.0
    return math.inf if value <= 0 else bound / value


def load(paths: list[str]) -> tuple[dict, list[dict]]:
    """(test, label) -> [(value, bound) per run]; and each run's own {(test, label): (value, bound)}. A check a
    run records more than once (a loop over examples, a helper called twice) counts with its smallest margin."""
    checks: dict = defaultdict(list)
    runs = []
    for path in paths:
        run: dict = {}
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                key, pair = (rec["test"], rec["label"]), (float(rec["value"]), float(rec["bound"]))
                if key not in run or margin(*pair) < margin(*run[key]):
                    run[key] = pair
        for key, pair in run.items():
            checks[key].append(pair)
        runs.append(run)
    return dict(checks), runs


def table(rows: list[tuple], title: str) -> None:
    print(f"\n{title}\n")
    print("| test | check | worst seen | bound | margin |")
    print("|---|---|---|---|---|")
    for (test, label), worst, bound, m in rows:
        print(f"| {test} | {label} | {worst:.3g} | {bound:.3g} | {m:.3g}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="one JSONL record per run (HCP_RECORD_TOLERANCES)")
    parser.add_argument("--top", type=int, default=10, help="how many of the tightest checks to print")
    parser.add_argument("--all", action="store_true", help="print every check")
    parser.add_argument(
        "--per-function",
        action="store_true",
        help="the tightest check of each test function (its parametrizations together) only",
    )
    args = parser.parse_args(argv)
    checks, runs = load(args.files)
    worst = {key: min(pairs, key=lambda pair: margin(*pair)) for key, pairs in checks.items()}
    rows = sorted(
        ((key, value, bound, margin(value, bound)) for key, (value, bound) in worst.items()),
        key=lambda row: (row[3], row[0]),
    )
    shown = rows
    if args.per_function:
        seen: set = set()
        shown = [row for row in rows if not (row[0][0].split("[")[0] in seen or seen.add(row[0][0].split("[")[0]))]
    table(shown if args.all else shown[: args.top], "every check" if args.all else f"the {args.top} tightest margins")
    tight = [row for row in rows if row[3] < REQUIRED_MARGIN]
    partial = sum(len(pairs) < len(runs) for pairs in checks.values())
    shared = [key for key in runs[0] if all(key in run for run in runs[1:])]
    same = sum(all(run[key] == runs[0][key] for run in runs[1:]) for key in shared)
    print(
        f"\n{len(checks)} checks in {len(args.files)} runs ({partial} not recorded in every run); of the {len(shared)} "
        f"recorded in every run, {same} gave bitwise the same figure in every run"
    )
    if tight:
        table(tight, f"{len(tight)} checks with a margin under {REQUIRED_MARGIN:g}x")
        return 1
    print(f"every margin >= {REQUIRED_MARGIN:g}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
