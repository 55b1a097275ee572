"""Per-call cost of the cross-rank validation of hcp.attention, by mode.

    python benchmarks/validation_overhead.py [--world 4] [--calls 200]

Times, on a (u, r) gloo mesh of local processes: the check alone, as it was before issue 11
(an all-gather of the full signature over the cp group plus a host read), validate="always" (one
all-reduce of 3 integers on the host group, every call), validate=True (the default: that
all-reduce only for calls the ranks could not predict; a repeated call is predicted) and
validate="debug"; and a whole small hcp.attention forward with each mode. Median over `calls`
calls, the slowest rank. On a shared machine the figures are noisy: compare the columns, not the runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(u: int, r: int, calls: int) -> dict:
    import torch
    import torch.distributed as dist

    import hybrid_cp as hcp
    from hybrid_cp.engine.agreement import agree_across_ranks

    torch.manual_seed(0)
    cp = hcp.init_cp_mesh(u, r)
    sig = list(range(14))
    names = [f"f{i}" for i in range(14)]
    q = k = v = torch.randn(1, 64, 4, 32)
    seq = 64 * cp.size

    def old_check():  # the pre-issue-11 agree_across_ranks: all-gather + host read, every call
        mine = torch.tensor([0] + sig, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(cp.size)]
        dist.all_gather(rows, mine, group=cp.cp_group)
        [row.tolist() for row in rows]

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        dist.barrier()
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    out = {"check: before (all-gather, every call)": timed(old_check)}
    for mode in ("always", True, "debug"):
        cp.validate = mode
        out[f"check: validate={mode!r}"] = timed(
            lambda: agree_across_ranks(cp, sig, names, None, "bench", (("q", q), ("k", k), ("v", v)))
        )
    for mode in (False, "always", True, "debug"):
        cp.validate = mode
        with torch.no_grad():
            out[f"attention fwd: validate={mode!r}"] = timed(
                lambda: hcp.attention(q, k, v, cp, causal=True, seq_len=seq)
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ulysses", type=int, default=2)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    from hybrid_cp.testing import WorkerPool

    world = args.ulysses * args.ring
    with WorkerPool(world, extra_paths=[str(Path(__file__).parent)]) as pool:
        per_rank = pool.run(_measure, u=args.ulysses, r=args.ring, calls=args.calls)
    print(f"median microseconds per call, slowest of {world} ranks, mesh ulysses={args.ulysses} ring={args.ring}")
    for key in per_rank[0]:
        print(f"  {key:45s} {max(r[key] for r in per_rank):10.1f}")


if __name__ == "__main__":
    main()
