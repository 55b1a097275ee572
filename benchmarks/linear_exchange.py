"""A linear layer's summary exchange: the all-gather against the log-step scan, counted and measured.

    python benchmarks/linear_exchange.py                      # counted at P = 8, 16, 32; measured on 8 gloo ranks
    python benchmarks/linear_exchange.py --ranks 8 --heads 8 --repeat 9

*Counted* (`topology.linear_cost.linear_layer_bytes`, what `hcp.comm_bytes` is tested equal to): the summary bytes the
busiest rank sends per Gated DeltaNet layer, forward and backward, one sequence, Qwen3-Next-80B-A3B's layer
(`ModelShape.preset("qwen3-next-80b")`: 32 value heads, dk = dv = 128, fp32 summaries), zigzag and contiguous
rows, the all-gather ((P - 1) x slots x (M + E)) beside the scan `topology.summary_scan.exchange_kind` picks.

*Measured* on `--ranks` gloo processes (a ring, ulysses 1, one thread each): `recurrence.linear_scan` forward and
backward with a stand-in kernel that costs next to nothing (so the time is the exchange, the compositions and the
corrections: what the two exchanges differ in), `--heads` value heads of dk = dv = 128, the all-gather forced
(as the cost model would never pick it here) against the scan, alternating per repeat; per repeat the slowest
rank's wall time; min / median over repeats of scan / gather, and the bytes every rank counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = ("zigzag", "contiguous")
DIM = 128


def counted(sizes: tuple[int, ...] = (8, 16, 32)) -> str:
    """The markdown table of counted bytes, Qwen3-Next-80B's Gated DeltaNet layer."""
    from topology.layouts import layout_of
    from topology.linear_cost import linear_layer_bytes
    from topology.model_shape import ModelShape
    from topology.summary_scan import summary_scan

    model = ModelShape.preset("qwen3-next-80b")
    lines = [
        "| P | layout | all-gather fwd + bwd (MiB) | scan fwd + bwd, busiest rank (MiB) | scan / all-gather | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for size in sizes:
        for layout in LAYOUTS:
            lay = layout_of(layout, 1, size, seq_len=4096 * size)
            args = (lay, size, 1, model.linear_state_numel)
            kw = dict(transition_numel=model.linear_transition_numel)
            gather = linear_layer_bytes(*args, exchange="gather", **kw)
            scan = linear_layer_bytes(*args, **kw)
            g = gather["linear_state_fwd"] + gather["linear_state_bwd"]
            s = scan["linear_state_fwd"] + scan["linear_state_bwd"]
            lines.append(
                f"| {size} | {layout} | {g / 2**20:.0f} | {s / 2**20:.0f} | {s / g:.3f} | "
                f"{len(summary_scan(lay, size).rounds)} |"
            )
    return "\n".join(lines)


def _stand_in(q, k, v, g=None, beta=None, initial_state=None, output_final_state=False, **_):
    """fla's signature, next to no arithmetic: output v scaled by the gate, final state from the run's mean value
    (and 0.9 x the initial state), shapes as the real kernel's."""
    out = v * torch.sigmoid(g)[..., None]
    state = v.mean(1)[:, :, None, :].expand(-1, -1, k.shape[-1], -1) * 0.1
    if initial_state is not None:
        state = state + 0.9 * initial_state
    return out, (state if output_final_state else None)


def rank_times(tokens: int, repeat: int, heads: int) -> dict:
    """On every rank: {layout: {"gather"/"scan": [(wall seconds, summary bytes fwd, bwd) per repeat]}}."""
    import hybrid_cp as hcp
    from hybrid_cp.engine.recurrence import GatedDelta, linear_scan
    from topology.layouts import layout_of

    world, out = dist.get_world_size(), {}
    for layout in LAYOUTS:
        cp = hcp.init_cp_mesh(1, world, layout=layout)
        lay = layout_of(layout, 1, world, seq_len=tokens)
        gen = torch.Generator().manual_seed(cp.rank)
        n = lay.local_len
        xs = [torch.randn(1, n, heads, DIM, generator=gen).requires_grad_() for _ in range(3)]
        xs += [torch.randn(1, n, heads, generator=gen).requires_grad_() for _ in range(2)]
        kind = GatedDelta(_stand_in)
        rows = {"gather": [], "scan": []}
        for i in range(repeat + 1):
            for mode in ("gather", "scan") if i % 2 else ("scan", "gather"):
                forced = mock.patch("hybrid_cp.engine.recurrence.exchange_kind", lambda *a: mode)
                hcp.reset_comm_bytes(cp)
                dist.barrier()
                start = time.perf_counter()
                with forced:
                    linear_scan(cp, lay, kind, xs).square().mean().backward()
                wall = time.perf_counter() - start
                sent = hcp.comm_bytes(cp)
                if i:  # the first repeat warms up
                    rows[mode].append((wall, sent.get("linear_state_fwd", 0), sent.get("linear_state_bwd", 0)))
        out[layout] = rows
        hcp.destroy_cp_mesh(cp)
    return out


def measured(per_rank: list[dict], ranks: int, heads: int) -> str:
    """The markdown table: bytes (busiest rank, and the sum over ranks) and the slowest rank's time ratios."""
    from topology.layouts import layout_of
    from topology.linear_cost import linear_layer_bytes

    lines = [
        "| layout | all-gather bytes fwd + bwd, each rank (MiB) | scan, busiest rank (MiB) | scan, all ranks / "
        "all-gather, all ranks | cost model = counted | all-gather median (ms) | scan / all-gather, min | "
        "median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        per = {m: [r[layout][m] for r in per_rank] for m in ("gather", "scan")}
        tot = {m: [rows[0][1] + rows[0][2] for rows in per[m]] for m in per}
        lay = layout_of(layout, 1, ranks, seq_len=per_rank[0]["_tokens"])
        numel, trans = heads * DIM * 2 * DIM, heads * DIM * DIM
        model = [
            sum(
                linear_layer_bytes(
                    lay, ranks, 1, numel, transition_numel=trans, rank=r, exchange=m, state_bytes=4
                ).values()
            )
            for m in ("gather", "scan")
            for r in range(ranks)
        ]
        agree = model == tot["gather"] + tot["scan"]
        walls = {m: [max(rows[i][0] for rows in per[m]) for i in range(len(per[m][0]))] for m in per}
        ratio = [s / g for s, g in zip(walls["scan"], walls["gather"])]
        lines.append(
            f"| {layout} | {max(tot['gather']) / 2**20:.1f} | {max(tot['scan']) / 2**20:.1f} | "
            f"{sum(tot['scan']) / sum(tot['gather']):.3f} | {'yes' if agree else 'NO'} | "
            f"{statistics.median(walls['gather']) * 1e3:.1f} | {min(ratio):.2f} | "
            f"{statistics.median(ratio):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    from hybrid_cp.testing import WorkerPool

    print("Counted, Qwen3-Next-80B-A3B's Gated DeltaNet layer (32 value heads, dk = dv = 128, fp32), one sequence:\n")
    print(counted())
    before = os.getloadavg()
    with WorkerPool(args.ranks, threads=1, extra_paths=[os.path.dirname(os.path.abspath(__file__))]) as pool:
        rows = pool.run(rank_times, timeout=3600, tokens=args.tokens, repeat=args.repeat, heads=args.heads)
    after = os.getloadavg()
    for row in rows:
        row["_tokens"] = args.tokens
    print(
        f"\nMeasured: ranks={args.ranks} tokens={args.tokens} heads={args.heads} (dk = dv = {DIM}) "
        f"repeat={args.repeat}, 1 thread per rank, load average (1 min) {before[0]:.1f} before, {after[0]:.1f} "
        f"after, {os.cpu_count()} cores\n"
    )
    print(measured(rows, args.ranks, args.heads))


if __name__ == "__main__":
    main()
