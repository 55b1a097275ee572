"""Time of a Gated DeltaNet recurrence under context parallelism vs one rank's local shard computation.

    python benchmarks/linear_layers.py [--ranks 4] [--tokens 2048] [--repeat 5]

Each of `ranks` gloo processes (ring of `ranks`, ulysses 1) times, side by side in one run and in
alternation: (a) transformers' torch chunked gated delta rule over its own shard as if it were the
whole sequence (forward + backward: what it computes without context parallelism, wrong but the
floor), and (b) `recurrence.linear_scan` over the same shard (probe, all-gather, scan, correction;
forward + backward). Prints the ratio b / a of the slowest rank, min and median over repeats, for
zigzag and contiguous. CPU only (there is no GPU here); the machine may be loaded by other work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_ratios(tokens: int, repeat: int, heads: int = 4, dim: int = 64) -> dict:
    """On every rank: {layout: [(local seconds, cp seconds) per repeat]}."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    import hybrid_cp as hcp
    from hybrid_cp.engine.layout import shard_tokens
    from hybrid_cp.engine.recurrence import GatedDelta, linear_scan
    from topology.layouts import layout_of

    kernel = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    world = dist.get_world_size()
    cp = hcp.init_cp_mesh(1, world)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(1, tokens, heads, generator=gen) * 0.1
    beta = torch.rand(1, tokens, heads, generator=gen)
    out = {}
    for layout in ("zigzag", "contiguous"):
        lay = layout_of(layout, 1, world, seq_len=tokens)
        xs = [shard_tokens(x, cp, 1, lay).requires_grad_() for x in (q, k, v, g, beta)]

        def local():
            o, _ = kernel(*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)
            o.sum().backward()

        def scan():
            linear_scan(cp, lay, GatedDelta(kernel), xs).sum().backward()

        rows = []
        for _ in range(repeat + 1):   # the first is a warm-up
            dist.barrier()
            a = _time(local)
            dist.barrier()
            b = _time(scan)
            rows.append((a, b))
        out[layout] = rows[1:]
    hcp.destroy_cp_mesh(cp)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from hybrid_cp.testing import WorkerPool

    with WorkerPool(args.ranks, extra_paths=[os.path.dirname(os.path.abspath(__file__))]) as pool:
        rows = pool.run("linear_layers:rank_ratios", timeout=1200, tokens=args.tokens, repeat=args.repeat)
    for layout in ("zigzag", "contiguous"):
        ratios = [max(r[layout][i][1] for r in rows) / max(r[layout][i][0] for r in rows) for i in range(args.repeat)]
        local = statistics.median(max(r[layout][i][0] for r in rows) for i in range(args.repeat))
        print(f"{layout:10s} ranks={args.ranks} tokens={args.tokens}: local shard {local * 1e3:.1f} ms, "
              f"cp / local min {min(ratios):.2f} median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
