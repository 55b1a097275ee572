"""Error table of hcp.attention against single-device fp64 attention, by mesh and case.

    python benchmarks/accuracy_table.py [--markdown]

Runs the test-suite's cases (hybrid_cp.testing.cases, by hybrid_cp.testing.parity) on 8 gloo ranks and prints, for every mesh,
the largest relative error (max |err| / max |ref|) over ranks and cases of each tensor, split
into causal/non-causal fp32 cases, and the bf16 error as a ratio to the single-device bf16 error.
"""

from __future__ import annotations

import argparse
from typing import Iterator

from hybrid_cp.cli.table import table_lines
from hybrid_cp.testing import WorkerPool
from hybrid_cp.testing.cases import attention_cases

TASK = "hybrid_cp.testing.parity:attention_errors"  # the test-suite runs the same function
MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]
TENSORS = ("out", "lse", "dq", "dk", "dv")


def rows(pool: WorkerPool) -> Iterator[list[str]]:
    """One row per mesh and mask, as soon as the mesh is measured."""
    for u, r in MESHES:
        cases = attention_cases(u)
        measured = [row for rank in pool.run(TASK, u=u, r=r, layout="zigzag", cases=cases) for row in rank]
        bf = [dict(b=2, n=1000, h=8, hkv=2, d=64, causal=c, dtype="bf16") for c in (True, False)]
        bf_rows = [row for rank in pool.run(TASK, u=u, r=r, layout="zigzag", cases=bf) for row in rank]
        ratio = max(row[t] / row["base_" + t] for row in bf_rows for t in TENSORS)
        heads = sorted({(c["h"], c["hkv"]) for c in cases})
        for causal in (True, False):
            sel = [row for row in measured if row["causal"] == causal]
            label = f"{len(sel) // 8} fp32 (H/H_kv {heads}, N 512/1000)"
            yield [
                f"{u} x {r}",
                label,
                "causal" if causal else "full",
                *(f"{max(row[t] for row in sel):.1e}" for t in TENSORS),
                f"{ratio:.2f}",
            ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args()
    header = ["mesh (u x r)", "cases", "mask", *TENSORS, "bf16 worst ratio to 1-GPU bf16"]
    with WorkerPool(8) as pool:
        for line in table_lines(header, rows(pool), markdown=True):
            print(line, flush=True)


if __name__ == "__main__":
    main()
