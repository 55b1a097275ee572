"""Worst relative errors of packed-document and sliding-window attention against fp64 references,
per mesh, over the cases the test-suite runs (tests/test_packing.py, tests/test_windows.py).

    python benchmarks/mask_accuracy_table.py [--out benchmarks/results/mask_accuracy.md]

Runs 8 local gloo processes (about a minute on 2 idle cores).
"""

from __future__ import annotations

import argparse
import os
import sys

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]
TENSORS = ("out", "lse", "dq", "dk", "dv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this Markdown file")
    args = ap.parse_args()
    sys.path.insert(0, TESTS)
    from test_packing import _cases as packed_cases
    from test_windows import _cases as window_cases

    from hybrid_cp.testing import WorkerPool

    lines = ["| mesh (u x r) | mask | cases | out | lse | dq | dk | dv |", "|---|---|---|---|---|---|---|---|"]
    with WorkerPool(8, extra_paths=[TESTS]) as pool:
        for u, r in MESHES:
            for name, target, cases in (("packed documents", "packed_errors", packed_cases(u, seed=u * 10 + r)),
                                        ("sliding window", "window_errors", window_cases(u))):
                rows = [row for rank in pool.run(f"dist_cases:{target}", u=u, r=r, layout="zigzag", cases=cases,
                                                  timeout=600) for row in rank]
                worst = {t: max(row[t] for row in rows) for t in TENSORS}
                lines.append(f"| {u} x {r} | {name} | {len(cases)} | " + " | ".join(f"{worst[t]:.1e}" for t in TENSORS)
                             + " |")
                print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
