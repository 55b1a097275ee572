"""Side-by-side CPU benchmark of mesh shapes and layouts for causal GQA attention (gloo).

    python benchmarks/bench_attention.py --seq-len 16384 --repeats 3 [--csv out.csv]

All configurations run in one pool of 8 processes, one after another, so their times are
comparable (ratios against the first row). Next to the time it prints what can be counted
exactly: bytes sent per rank by each stage and the causal work imbalance (max/min score entries
per rank over the ring schedule). On this 2-core machine 8 ranks share 2 cores, so wall time
tracks total work plus communication overhead, not a cluster's parallel speed-up.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch

CONFIGS = [
    (8, 1, "zigzag"),
    (4, 2, "zigzag"),
    (2, 4, "zigzag"),
    (1, 8, "zigzag"),
    (4, 2, "contiguous"),
    (1, 8, "contiguous"),
]


def run_rank(
    ulysses: int, ring: int, layout: str, seq_len: int, heads: int, kv_heads: int, head_dim: int, repeats: int
) -> dict:
    import torch.distributed as dist

    import hybrid_cp as hcp

    cp = hcp.init_cp_mesh(ulysses, ring, layout=layout)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, heads, head_dim, generator=g)
    k, v = (torch.randn(1, seq_len, kv_heads, head_dim, generator=g) for _ in range(2))
    ql, kl, vl = (hcp.shard(x, cp).requires_grad_() for x in (q, k, v))
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        hcp.reset_comm_bytes(cp)
        dist.barrier()
        t0 = time.perf_counter()
        out = hcp.attention(ql, kl, vl, cp, causal=True)
        out.sum().backward()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"times": times[1:], "bytes": hcp.comm_bytes(cp)}


def main() -> None:
    from hybrid_cp.cli.table import format_table
    from hybrid_cp.testing import WorkerPool
    from topology.layouts import make_layout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--csv")
    a = p.parse_args()
    rows = []
    with WorkerPool(8) as pool:
        for u, r, layout in CONFIGS:
            res = pool.run(
                run_rank,
                timeout=3600,
                ulysses=u,
                ring=r,
                layout=layout,
                seq_len=a.seq_len,
                heads=a.heads,
                kv_heads=a.kv_heads,
                head_dim=a.head_dim,
                repeats=a.repeats,
            )
            per_run = [max(rr["times"][i] for rr in res) for i in range(a.repeats)]
            work = [sum(row) for row in make_layout(layout, u, r, seq_len=a.seq_len).work()]
            b = res[0]["bytes"]
            rows.append(
                {
                    "ulysses": u,
                    "ring": r,
                    "layout": layout,
                    "min_s": min(per_run),
                    "median_s": statistics.median(per_run),
                    "imbalance": max(work) / min(work),
                    "a2a_MiB": (b.get("ulysses_fwd", 0) + b.get("ulysses_bwd", 0)) / 2**20,
                    "ring_MiB": (b.get("ring_fwd", 0) + b.get("ring_bwd", 0)) / 2**20,
                }
            )
            print(rows[-1], flush=True)
    base = rows[0]["median_s"]
    print(
        f"\ncausal GQA attention fwd+bwd, {a.seq_len} tokens, H={a.heads}, H_kv={a.kv_heads}, D={a.head_dim}, "
        f"8 gloo ranks, {a.repeats} timed runs each"
    )
    header = ["u", "r", "layout", "min s", "median s", "vs first", "work max/min", "a2a MiB/rank", "ring MiB/rank"]
    print(
        format_table(
            header,
            [
                [
                    row["ulysses"],
                    row["ring"],
                    row["layout"],
                    row["min_s"],
                    row["median_s"],
                    row["median_s"] / base,
                    row["imbalance"],
                    row["a2a_MiB"],
                    row["ring_MiB"],
                ]
                for row in rows
            ],
            formats=["", "", "", ".2f", ".2f", ".2f", ".2f", ".1f", ".1f"],
            align=">" * 9,
            gap=1,
        )
    )
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
