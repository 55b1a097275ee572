"""What a dynamic schedule sends and pads, against the best fixed split: counted, exact.

Bytes are `topology.comm_bytes` summed over every rank of every group (all-to-all and ring, forward and
backward, one attention layer): the numbers the engine's byte counter reports. A group of degree k
runs its documents as one packed row of its (ulysses, ring) split. The fixed split packs the same
documents first-fit-decreasing into rows of k * C tokens for every (ulysses, ring) with u * r = k
that holds the longest document, dp = world / k rows at a time; "best" is the one with the fewest
bytes. The lower bound is what the documents longer than C cannot avoid: each alone on its cheapest
split of its minimum degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layouts import make_layout
from .traffic import comm_bytes


@dataclass(frozen=True)
class Shape:
    """The attention shape bytes are counted for: heads, KV heads, head dim, bytes per element."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2


@dataclass(frozen=True)
class Traffic:
    """One way of running the step: its label, bytes all ranks send (one layer, forward + backward),
    layout padding tokens, tokens, and (when priced) predicted seconds per layer and idle share."""

    label: str
    bytes: int
    padding: int
    tokens: int
    predicted_s: float | None = None
    idle_share: float | None = None

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)


@dataclass(frozen=True)
class Comparison:
    schedule: Traffic
    fixed: Traffic  # the best fixed split (fewest bytes)
    bound_bytes: int  # what the long documents cannot avoid
    candidates: tuple[Traffic, ...]


def _cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def row_bytes(lens: list[int], ulysses: int, ring: int, shape: Shape) -> int:
    """Bytes all u * r ranks send for one packed row of documents `lens` (one layer, fwd + bwd)."""
    if ulysses * ring == 1 or not sum(lens):
        return 0
    cu, total = _cu(lens), 0
    for i in range(ulysses):
        for j in range(ring):
            got = comm_bytes(
                shape.heads,
                shape.kv_heads,
                shape.head_dim,
                cu[-1],
                1,
                ulysses,
                ring,
                shape.dtype_bytes,
                cu_seqlens=cu,
                ulysses_rank=i,
                ring_rank=j,
            )
            total += sum(got.values())
    return total


def row_padding(lens: list[int], ulysses: int, ring: int) -> int:
    return make_layout("zigzag", ulysses, ring, doc_lens=tuple(lens)).padding() if sum(lens) else 0


def schedule_traffic(sched: Any, shape: Shape) -> Traffic:
    total = pad = 0
    for mb in sched.microbatches:
        for g in mb.groups:
            lens = [sched.lengths[d] for d in g.docs]
            total += row_bytes(lens, g.ulysses, g.ring, shape)
            pad += row_padding(lens, g.ulysses, g.ring)
    idle = sum(mb.idle_share * mb.time_s for mb in sched.microbatches) / max(sched.predicted_s, 1e-30)
    return Traffic("dynamic", total, pad, sum(sched.lengths), sched.predicted_s, idle)


def pack_rows(lengths: tuple[int, ...], room: int) -> list[list[int]]:
    """First-fit decreasing: documents (longest first) into rows of `room` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for n in sorted((n for n in lengths if n > 0), reverse=True):
        at = next((i for i, f in enumerate(free) if f >= n), None)
        if at is None:
            rows.append([])
            free.append(room)
            at = len(rows) - 1
        rows[at].append(n)
        free[at] -= n
    return rows


def fixed_traffic(
    lengths: tuple[int, ...], world: int, capacity: int, ulysses: int, ring: int, shape: Shape, degree: Any = None
) -> Traffic:
    """The step on one fixed (ulysses, ring) mesh: rows of u * r * C tokens, dp = world / (u * r) at a time."""
    k = ulysses * ring
    rows = pack_rows(lengths, k * capacity)
    total = sum(row_bytes(r, ulysses, ring, shape) for r in rows)
    pad = sum(row_padding(r, ulysses, ring) for r in rows)
    time = idle = None
    if degree is not None:  # dp rows at a time, the slowest first: sum of the per-micro-batch maxima
        times = sorted((degree.time_s(sum(n * n for n in r), sum(r)) for r in rows), reverse=True)
        dp = world // k
        steps = [times[i : i + dp] + [0.0] * (dp - len(times[i : i + dp])) for i in range(0, len(times), dp)]
        time = sum(max(s) for s in steps)
        idle = 1 - sum(sum(s) for s in steps) / (dp * time) if time else 0.0
    return Traffic(f"fixed u{ulysses}r{ring}", total, pad, sum(lengths), time, idle)


def compare(sched: Any, shape: Shape = Shape()) -> Comparison:
    """The schedule's traffic, every feasible fixed split's, and the lower bound (see the module docstring)."""
    longest = max(sched.lengths, default=0)
    table = {d.size: d for d in sched.degrees}
    cands = []
    for k in sorted(table):
        if k * sched.tokens_per_rank < longest:
            continue
        for u in (x for x in range(1, k + 1) if k % x == 0 and x <= shape.heads):
            deg = table[k] if (table[k].ulysses, table[k].ring) == (u, k // u) else None
            cands.append(fixed_traffic(sched.lengths, sched.world, sched.tokens_per_rank, u, k // u, shape, deg))
    bound = 0
    for n in sched.lengths:
        if n > sched.tokens_per_rank:
            k = next(k for k in sorted(table) if n <= k * sched.tokens_per_rank)
            bound += min(row_bytes([n], u, k // u, shape) for u in range(1, k + 1) if k % u == 0 and u <= shape.heads)
    best = min(cands, key=lambda t: (t.bytes, t.label))
    return Comparison(schedule_traffic(sched, shape), best, bound, tuple(cands))


def explain(sched: Any, fixed: Comparison | None = None) -> str:
    """The schedule as a table: per micro-batch its groups (degree(u x r)@first rank: documents),
    predicted time and idle share; then the totals, and with `fixed` the bytes against the best fixed split."""
    lines = [
        f"step: {len(sched.lengths)} documents, {sum(sched.lengths)} tokens, {sched.targets} targets; world "
        f"{sched.world}, {sched.tokens_per_rank} tokens/rank; {len(sched.microbatches)} micro-batches; "
        f"digest {sched.digest}",
        f"{'mb':>3} {'groups (degree(u x r)@rank: docs)':<60} {'tokens':>9} {'time ms':>9} {'idle':>6}",
    ]
    for i, mb in enumerate(sched.microbatches):
        busy = [g for g in mb.groups if g.docs]
        text = " ".join(f"{g.degree}({g.ulysses}x{g.ring})@{g.first_rank}:{len(g.docs)}" for g in busy[:8])
        text += f" +{len(busy) - 8} groups" if len(busy) > 8 else ""
        idle = len(mb.groups) - len(busy)
        text += f" ({idle} idle ranks)" if idle else ""
        lines.append(
            f"{i:>3} {text:<60} {sum(g.tokens for g in mb.groups):>9} {mb.time_s * 1e3:>9.3f} {mb.idle_share:>6.1%}"
        )
    lines.append(f"predicted {sched.predicted_s * 1e3:.3f} ms per layer (sum of the micro-batches' slowest groups)")
    if fixed is not None:
        s, f = fixed.schedule, fixed.fixed
        saved = 1 - s.bytes / f.bytes if f.bytes else 0.0
        lines.append(
            f"bytes (one layer, fwd+bwd, all ranks): dynamic {s.bytes:,} ({s.bytes_per_token:.1f}/token), "
            f"best fixed {f.label} {f.bytes:,} ({f.bytes_per_token:.1f}/token): {saved:.1%} saved; "
            f"lower bound {fixed.bound_bytes:,}; padding {s.padding} vs {f.padding}"
        )
    return "\n".join(lines)


__all__ = [
    "Shape",
    "Traffic",
    "Comparison",
    "row_bytes",
    "schedule_traffic",
    "fixed_traffic",
    "compare",
    "explain",
    "pack_rows",
]
