"""Balance and padding of packed rows under each packing policy, counted exactly from the block plan.

For each document mix and (ulysses, ring) mesh: the causal work of the busiest ring rank over the
mean (1.0 is perfect), the padding the layout adds, the (query, key) segments a ring rank's kernel
calls carry over all steps, and the shortest segment. The "per-doc padded" column is the padding
the peers' scheme needs (every document padded to a multiple of 2 x cp degree).

    python benchmarks/packing_balance.py [--out benchmarks/results/packing_balance.md]
"""

from __future__ import annotations

import argparse
import math
import random

from hybrid_cp.cli.table import format_table
from topology.layouts import Packed

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def lognormal_mix(seed: int, total: int = 65536, median: int = 2048, sigma: float = 1.0) -> tuple[int, ...]:
    """Document lengths drawn from a lognormal around `median`, cut to fill `total` tokens exactly."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(max(1, int(rng.lognormvariate(math.log(median), sigma))))
    lens[-1] -= sum(lens) - total
    return tuple(n for n in lens if n > 0)


def long_plus_short(seed: int, long: int = 32768, short: int = 400, total: int = 65536) -> tuple[int, ...]:
    """One long document among `short` short ones (random cut points), `total` tokens in all."""
    rng = random.Random(seed)
    rest = total - long
    cuts = sorted(rng.sample(range(1, rest), short - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [rest])]
    lens.insert(rng.randrange(short), long)
    return tuple(lens)


MIXES = {
    "lognormal 2K, 64K row (seed 0)": lognormal_mix(0),
    "lognormal 2K, 64K row (seed 1)": lognormal_mix(1),
    "lognormal 2K sigma 1.5, 64K row": lognormal_mix(2, sigma=1.5),
    "32K + 400 short, 64K row": long_plus_short(0),
}


def measure(doc_lens: tuple[int, ...], u: int, r: int, policy: str) -> dict:
    lay = Packed(doc_lens, u, r, policy)
    work = [sum(row) for row in lay.work(causal=True)]
    segments = [
        n for j in range(r) for s in range(r) if (t := lay.step(j, s, True)) is not None for _, n, _, _ in t.pairs
    ]
    cp = u * r
    return {
        "imbalance": max(work) / (sum(work) / len(work)),
        "padding": lay.padding(),
        "padding_pct": 100 * lay.padding() / lay.padded_len,
        "segments": max(lay.kernel_calls()),
        "shortest": min(segments),
        "per_doc_padded": sum(-(-n // (2 * cp)) * 2 * cp - n for n in doc_lens),
    }


def table() -> str:
    header = [
        "mix",
        "docs",
        "u x r",
        "policy",
        "busiest/mean work",
        "padding tokens (%)",
        "segments per rank",
        "shortest segment",
        "per-doc padded (peers)",
    ]
    rows = []
    for name, mix in MIXES.items():
        for u, r in MESHES:
            for policy in ("balanced", "zigzag", "contiguous"):
                m = measure(mix, u, r, policy)
                rows.append(
                    [
                        name,
                        len(mix),
                        f"{u} x {r}",
                        policy,
                        m["imbalance"],
                        f"{m['padding']} ({m['padding_pct']:.2f}%)",
                        m["segments"],
                        m["shortest"],
                        m["per_doc_padded"],
                    ]
                )
    return format_table(header, rows, formats=["", "", "", "", ".4f"], markdown=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this Markdown file")
    args = ap.parse_args()
    text = table()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
