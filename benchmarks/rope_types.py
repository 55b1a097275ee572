"""Every rope type of transformers' `ROPE_INIT_FUNCTIONS` under context parallelism against one process (fp64,
one training step: loss and every parameter gradient, the worst over ranks), as tests/test_rope.py checks,
next to the same run with every rotary left to its own shard (before the fix) and, for packed rows,
transformers' own one-process packed row against the per-document reference.

    python benchmarks/rope_types.py            # markdown table; ~1 minute on 2 CPU cores

Rows: 2 x 96 tokens (right-padded) on zigzag and contiguous ulysses=2 x ring=2, and a packed row of documents
(70, 9, 1, 23, 4, 21) tokens; the dynamic types' threshold is 64 (tests/rope_cases.py).
"""

from __future__ import annotations

import os

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def main() -> None:
    from hybrid_cp.testing import WorkerPool

    with WorkerPool(4, extra_paths=[TESTS]) as pool:
        fixed = pool.run("rope_cases:rope_table", u=2, r=2, stock=True)
        before = pool.run("rope_cases:rope_table", u=2, r=2, routed=False)
    print("| rope type | layout | loss rel. diff | worst gradient rel. diff | before the fix (worst gradient) "
          "| transformers' packed row vs per document |")
    print("|---|---|---|---|---|---|")
    for key in fixed[0]:
        worst = {k: max(row[key][k] for row in fixed) for k in ("loss", "grad")}
        old = max(row[key]["grad"] for row in before)
        stock = fixed[0][key].get("stock_row")
        print(f"| {key[0]} | {key[1]} | {worst['loss']:.1e} | {worst['grad']:.1e} | {old:.1e} | "
              f"{'' if stock is None else f'{stock:.1e}'} |")


if __name__ == "__main__":
    main()
