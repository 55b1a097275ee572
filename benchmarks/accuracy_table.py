"""Error table of hcp.attention against single-device fp64 attention, by mesh and case.

    python benchmarks/accuracy_table.py [--markdown]

Runs the test-suite's cases (tests/dist_cases.py) on 8 gloo ranks and prints, for every mesh,
the largest relative error (max |err| / max |ref|) over ranks and cases of each tensor, split
into causal/non-causal fp32 cases, and the bf16 error as a ratio to the single-device bf16 error.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]
TENSORS = ("out", "lse", "dq", "dk", "dv")


def main() -> None:
    from test_attention import _cases

    from hybrid_cp.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args()
    print("| mesh (u x r) | cases | mask | " + " | ".join(TENSORS) + " | bf16 worst ratio to 1-GPU bf16 |")
    print("|---|---|---|" + "---|" * len(TENSORS) + "---|")
    with WorkerPool(8, extra_paths=[TESTS]) as pool:
        for u, r in MESHES:
            cases = _cases(u)
            rows = [row for rank in pool.run("dist_cases:attention_errors", u=u, r=r, layout="zigzag", cases=cases)
                    for row in rank]
            bf = [dict(b=2, n=1000, h=8, hkv=2, d=64, causal=c, dtype="bf16") for c in (True, False)]
            bf_rows = [row for rank in pool.run("dist_cases:attention_errors", u=u, r=r, layout="zigzag", cases=bf)
                       for row in rank]
            ratio = max(row[t] / row["base_" + t] for row in bf_rows for t in TENSORS)
            heads = sorted({(c["h"], c["hkv"]) for c in cases})
            for causal in (True, False):
                sel = [row for row in rows if row["causal"] == causal]
                errs = " | ".join(f"{max(row[t] for row in sel):.1e}" for t in TENSORS)
                label = f"{len(sel) // 8} fp32 (H/H_kv {heads}, N 512/1000)"
                print(f"| {u} x {r} | {label} | {'causal' if causal else 'full'} | {errs} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
