"""How a linear layer's per-run summaries travel between the cp ranks: an all-gather, or a log-step scan.

A linear layer under context parallelism (docs/linear.md) needs, before each run that continues a document
started elsewhere, the state after everything before it: the composition, in token order, of the summaries
(M, E) of the document's earlier runs, with `(M2, E2) o (M1, E1) = (M2 M1, M2 E1 + E2)` (a run that starts its
document has M = 0, which cuts the composition there).

*gather*: every rank all-gathers every exporting run's (M, E) and composes what it needs: per rank and direction
(P - 1) x slots summaries, growing with P.

*scan*: a Hillis-Steele exclusive scan over the *elements*, every run that exports or continues, in token order
(each owned by the rank that holds it): in round k each element i receives from element i - 2^k its composed
window `V = own o X` and composes it into its exclusive prefix X (what it has received so far covers the
elements (i - 2^k, i)); after ceil(log2 n) rounds X is the state entering i. Under contiguous rows an element
is a rank and its partner is at distance 2^k in ring order; under zigzag each rank owns two elements. The plan
is static, so a transfer that cannot matter is never made, and the transition part of one that is not used
later is left out:

- a transfer j -> i is made only if every element in (j, i] continues its document (otherwise a document
  start in between, or at i, makes it irrelevant: its M = 0);
- its M travels only if the receiver composes again later or passes its own M on, and M is not structurally
  zero (a window that reaches a document start): in the last round only E travels.

`summary_scan` is read by the engine (`hybrid_cp.engine.recurrence.linear_scan`) and by the cost model
(`topology.linear_cost.linear_layer_bytes`), and `exchange_kind` is the one rule that picks between the two: the scan
where its busiest rank moves fewer bytes than the gather's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["SummaryScan", "summary_scan", "scan_bytes", "gather_bytes", "exchange_kind"]


@dataclass(frozen=True)
class SummaryScan:
    """`elements`: (rank, index in `Layout.document_runs(rank)`, continues) in token order; `rounds`: per round
    the transfers (from element, to element, whether M travels)."""

    elements: tuple[tuple[int, int, bool], ...]
    rounds: tuple[tuple[tuple[int, int, bool], ...], ...]


def _elements(lay: Any, size: int) -> list[tuple[int, int, int, bool]]:
    """(first token, rank, run index, continues) of every run that exports or continues, in token order."""
    starts, lens, out = lay.doc_starts, lay.doc_lens, []
    for rank in range(size):
        for index, (tok, pos, n) in enumerate(lay.document_runs(rank)):
            if tok < 0:
                continue
            doc = bisect.bisect_right(starts, tok) - 1
            if pos > 0 or pos + n < lens[doc]:
                out.append((tok, rank, index, pos > 0))
    return sorted(out)


def _transition_needed(cont: list[bool], rounds: list[list[tuple[int, int]]]) -> list[list[bool]]:
    """Per transfer, whether its M must travel: the receiver's new prefix M is used later (it composes again,
    or sends its own M on) and the sent window's M is not structurally zero (a document start in it)."""
    zero_x = [False] * len(cont)  # the prefix received so far reaches a document start: its M is 0
    zero_v = []
    for transfers in rounds:
        sent = [(not cont[j]) or zero_x[j] for j, _ in transfers]
        for (_, i), z in zip(transfers, sent):
            zero_x[i] = zero_x[i] or z
        zero_v.append(sent)
    receives_later, sends_m_later = [False] * len(cont), [False] * len(cont)
    needed: list[list[bool]] = [[] for _ in rounds]
    for k in range(len(rounds) - 1, -1, -1):
        needed[k] = [(receives_later[i] or sends_m_later[i]) and not z for (_, i), z in zip(rounds[k], zero_v[k])]
        for (j, i), m in zip(rounds[k], needed[k]):
            receives_later[i] = True
            sends_m_later[j] = sends_m_later[j] or m
    return needed


@lru_cache(maxsize=256)
def summary_scan(lay: Any, size: int) -> SummaryScan:
    """The scan's elements and rounds for `lay` on `size` cp ranks (the same on every rank).

    Args:
        lay: The row's `topology.layouts.Layout`.
        size: The cp ranks.

    Returns:
        The plan.
    """
    found = _elements(lay, size)
    cont = [c for *_, c in found]
    rounds, d = [], 1
    while d < len(found):
        rounds.append([(i - d, i) for i in range(d, len(found)) if all(cont[i - d + 1 : i + 1])])
        d *= 2
    rounds = [t for t in rounds if t]
    needed = _transition_needed(cont, rounds)
    return SummaryScan(
        tuple((rank, index, c) for _, rank, index, c in found),
        tuple(tuple((j, i, m) for (j, i), m in zip(t, need)) for t, need in zip(rounds, needed)),
    )


def scan_bytes(lay: Any, size: int, rank: int, transition: int, state: int) -> tuple[int, int]:
    """(forward, backward) summary bytes `rank` sends in the scan, per batch row and byte of a number:
    forward its elements' windows to other ranks, backward the gradients of what it received."""
    plan = summary_scan(lay, size)
    owner = [r for r, _, _ in plan.elements]
    fwd = bwd = 0
    for transfers in plan.rounds:
        for j, i, m in transfers:
            numel = state + (transition if m else 0)
            if owner[j] != owner[i]:
                fwd += numel if owner[j] == rank else 0
                bwd += numel if owner[i] == rank else 0
    return fwd, bwd


def gather_bytes(size: int, slots: int, transition: int, state: int) -> int:
    """Summary numbers one rank sends per direction in the all-gather (per batch row): (P - 1) x slots x (M + E)."""
    return (size - 1) * slots * (transition + state)


def exchange_kind(lay: Any, size: int, slots: int, transition: int, state: int) -> str:
    """ "scan" where the scan's busiest rank sends fewer summary bytes (forward + backward) than each rank of the
    all-gather, else "gather" (the one rule: engine and cost model)."""
    if size == 1 or not slots:
        return "gather"
    worst = max(sum(scan_bytes(lay, size, r, transition, state)) for r in range(size))
    return "scan" if worst < 2 * gather_bytes(size, slots, transition, state) else "gather"
