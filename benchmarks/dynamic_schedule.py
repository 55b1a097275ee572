"""Dynamic context-parallel degrees: what the step schedule sends and pads against the best fixed split,
counted exactly, and how long the scheduler takes.

Bytes table: for long-tailed global batches on 8 ranks (one DGX-H100 node, a Llama-3-8B-shaped
attention layer in bf16, C = 8,192 tokens per rank), the bytes every rank sends in one layer's
all-to-all and ring exchanges (forward + backward; `topology.comm_bytes`, the engine's counter's
formulas) per token, for the dynamic schedule (`topology.schedule`, degrees priced by the calibrated
cost model), the best fixed (ulysses, ring) split (rows of k x C tokens packed first-fit decreasing,
the fewest bytes of every split that holds the longest document), and the lower bound (each document
longer than C alone on the cheapest split of its minimum degree). Padding is the layouts' pad rows.
Predicted times are the cost model's per layer (dynamic: the sum of each micro-batch's slowest
group; fixed: dp rows at a time).

Speed: `schedule_step` on 1,000 lognormal documents at world 64 (calibrated degrees built once, as
at init), the median and best of repeated runs, and two runs' digests compared.

    python benchmarks/dynamic_schedule.py [--out benchmarks/results/dynamic_schedule.md]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from hybrid_cp.cli.table import format_table
from topology import Cluster, ModelShape
from topology.degrees import degree_table
from topology.schedule import schedule_step
from topology.schedule_report import Shape, compare

MODEL = ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)
SHAPE = Shape(32, 8, 128, 2)
C = 8192


def lognormal(seed: int, median: int, sigma: float, total: int, cap: int) -> list[int]:
    """Lengths from a lognormal around `median` (each at most `cap`), cut to `total` tokens exactly."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(min(cap, max(1, int(rng.lognormvariate(math.log(median), sigma)))))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def long_plus_short(seed: int, long: int, median: int, total: int) -> list[int]:
    """One long document among short lognormal ones (median `median`, sigma 0.8, at most C)."""
    return [long] + lognormal(seed, median, 0.8, total - long, C)


def mixes(world: int) -> dict[str, list[int]]:
    total, cap = 8 * world * C, world * C
    return {
        "lognormal median 2K, sigma 1.0": lognormal(0, 2048, 1.0, total, cap),
        "lognormal median 2K, sigma 1.5": lognormal(1, 2048, 1.5, total, cap),
        "lognormal median 4K, sigma 1.5": lognormal(2, 4096, 1.5, total, cap),
        "one 48K + short (median 1K)": long_plus_short(3, 49152, 1024, total),
        "one 64K + short (median 512)": long_plus_short(4, 65536, 512, total),
    }


def bytes_table(world: int = 8) -> str:
    degrees = degree_table(Cluster.preset("dgx-h100", nodes=max(1, world // 8)), MODEL, world, C)
    header = [
        "mix",
        "docs",
        "tokens > C",
        "dynamic B/token",
        "best fixed",
        "fixed B/token",
        "fixed / dynamic",
        "bound B/token",
        "padding dyn / fixed",
        "predicted ms dyn / fixed",
        "idle dyn / fixed",
    ]
    rows = []
    for name, lens in mixes(world).items():
        sched = schedule_step(lens, world, C, degrees)
        cmp = compare(sched, SHAPE)
        s, f = cmp.schedule, cmp.fixed
        long_share = sum(n for n in lens if n > C) / sum(lens)
        f_time = f"{f.predicted_s * 1e3:.1f}" if f.predicted_s is not None else "-"
        f_idle = f"{f.idle_share:.1%}" if f.idle_share is not None else "-"
        rows.append(
            [
                name,
                len(lens),
                f"{long_share:.0%}",
                f"{s.bytes_per_token:.0f}",
                f.label,
                f"{f.bytes_per_token:.0f}",
                f"{f.bytes / max(s.bytes, 1):.2f}x",
                f"{cmp.bound_bytes / s.tokens:.0f}",
                f"{s.padding} / {f.padding}",
                f"{s.predicted_s * 1e3:.1f} / {f_time}",
                f"{s.idle_share:.1%} / {f_idle}",
            ]
        )
    return format_table(header, rows, markdown=True)


def speed(world: int = 64, docs: int = 1000, repeats: int = 30) -> str:
    degrees = degree_table(Cluster.preset("dgx-h100", nodes=world // 8), MODEL, world, C)
    rng = random.Random(5)
    lens = [min(world * C, max(1, int(rng.lognormvariate(math.log(2048), 1.5)))) for _ in range(docs)]
    times, digests = [], set()
    for _ in range(repeats):
        t0 = time.perf_counter()
        sched = schedule_step(lens, world, C, degrees)
        times.append(time.perf_counter() - t0)
        digests.add(sched.digest)
    placed = sorted(d for mb in sched.microbatches for g in mb.groups for d in g.docs)
    assert placed == list(range(docs)) and len(digests) == 1
    return (
        f"schedule_step: {docs} documents ({sum(lens)} tokens) at world {world}, C = {C}: "
        f"median {statistics.median(times) * 1e3:.1f} ms, best {min(times) * 1e3:.1f} ms over {repeats} runs; "
        f"{len(sched.microbatches)} micro-batches; one digest ({sched.digest}); every document exactly once"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the results to this Markdown file")
    args = ap.parse_args()
    text = bytes_table() + "\n\n" + speed()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
