"""Parity table of the linear recurrence and the causal conv under CP (max relative error over ranks),
and of the hybrid models' training step, as tests/test_recurrence.py and tests/test_hybrid_models.py check.

    python benchmarks/linear_parity.py
"""

from __future__ import annotations

import os

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
DOCS = (1, 3, 19, 2, 1, 7)
MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (8, 1)]


def main() -> None:
    from hybrid_cp.testing import WorkerPool

    with WorkerPool(8, extra_paths=[TESTS]) as pool:
        print("| mesh | layout | rows | kernel | gdn fwd | gdn bwd (worst of q,k,v,g,beta) | conv fwd | conv bwd |")
        print("|---|---|---|---|---|---|---|---|")
        for u, r in MESHES:
            cases = [(lay, docs, kern) for kern in ("naive", "hf") for lay in ("zigzag", "contiguous")
                     for docs in (None, DOCS)]
            rows = pool.run("linear_cases:scan_parity", u=u, r=r, cases=cases)
            for i, (lay, docs, kern) in enumerate(cases):
                worst = {part: {k: max(row[i][part][k] for row in rows) for k in rows[0][i][part]}
                         for part in ("gdn", "conv")}
                g, c = worst["gdn"], worst["conv"]
                print(f"| ({u},{r}) | {lay} | {'packed' if docs else 'dense'} | "
                      f"{'fp64 naive' if kern == 'naive' else 'fp32 transformers'} | {g['out']:.1e} | "
                      f"{max(v for k, v in g.items() if k != 'out'):.1e} | {c['out']:.1e} | "
                      f"{max(v for k, v in c.items() if k != 'out'):.1e} |")
        print("\n| model | mesh | rows | logits | loss | worst gradient |")
        print("|---|---|---|---|---|---|")
        runs = [("qwen3_next", u, r, f, False) for u, r, f in ((2, 2, False), (1, 4, False), (4, 1, False),
                                                             (2, 2, True))]
        runs += [("qwen3_next", 2, 2, False, True), ("qwen3_5_text", 2, 2, False, False),
                 ("qwen3_5_text", 2, 2, False, True)]
        for kind, u, r, fsdp, packed in runs:
            if packed:
                rows = pool.run("linear_cases:hybrid_packed_parity", u=u, r=r, kind=kind)
            else:
                rows = pool.run("linear_cases:hybrid_parity", u=u, r=r, kind=kind, fsdp=fsdp)
            logits = "-" if packed else f"{max(x['logits'] for x in rows):.1e}"
            print(f"| {kind}{' FSDP2' if fsdp else ''} | ({u},{r}) | {'packed' if packed else 'dense, right-padded'} "
                  f"| {logits} | {max(x['loss'] for x in rows):.1e} | {max(x['grad'] for x in rows):.1e} |")


if __name__ == "__main__":
    main()
