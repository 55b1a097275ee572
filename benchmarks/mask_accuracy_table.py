"""Worst relative errors of packed-document and sliding-window attention against fp64 references,
per mesh, over the cases the test-suite runs (hybrid_cp.testing.cases: tests/test_packing.py, tests/test_windows.py).

    python benchmarks/mask_accuracy_table.py [--out benchmarks/results/mask_accuracy.md]

Runs 8 local gloo processes (about a minute on 2 idle cores).
"""

from __future__ import annotations

import argparse
from typing import Iterator

from hybrid_cp.cli.table import table_lines
from hybrid_cp.testing import WorkerPool, parity
from hybrid_cp.testing.cases import packed_cases, window_cases

MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]
TENSORS = ("out", "lse", "dq", "dk", "dv")


def rows(pool: WorkerPool) -> Iterator[list[str]]:
    """One row per mesh and mask kind, as soon as it is measured."""
    for u, r in MESHES:
        for name, target, cases in (
            ("packed documents", "packed_errors", packed_cases(u, seed=u * 10 + r)),
            ("sliding window", "window_errors", window_cases(u)),
        ):
            measured = [
                row
                for rank in pool.run(getattr(parity, target), u=u, r=r, layout="zigzag", cases=cases, timeout=600)
                for row in rank
            ]
            yield [f"{u} x {r}", name, str(len(cases)), *(f"{max(row[t] for row in measured):.1e}" for t in TENSORS)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this Markdown file")
    args = ap.parse_args()
    lines = []
    with WorkerPool(8) as pool:
        for line in table_lines(["mesh (u x r)", "mask", "cases", *TENSORS], rows(pool), markdown=True):
            lines.append(line)
            if len(lines) > 2:  # each row as it is measured (the header goes only into the file)
                print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
