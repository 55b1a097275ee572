"""The kernel calls of one ring step: (query rows, key rows) segment pairs, each with the flash-attn mask
(causal, a ``window_size`` band, or none) that reproduces on it the band of keys its queries see.

Pure Python. `topology.layouts.Layout.tasks` and `mask_tasks` cut a ring block into such pairs; the cost
model counts their work (`Step.work`, closed form) and the engine runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Step", "visible_entries", "band_pair", "group_calls"]


@dataclass(frozen=True)
class Step:
    """One kernel call of a ring step: (query row start, count, key row start, count) segment pairs
    with one mask. ``causal``: square causal blocks on identical rows. ``window``: flash-attn's
    ``window_size`` (left, right), bottom-right aligned, -1 for unbounded: key j is visible to
    query i iff -left <= j - i - (nk - nq) <= right. Neither: every pair is fully visible."""

    pairs: tuple[tuple[int, int, int, int], ...]
    causal: bool
    window: tuple[int, int] | None = None

    def work(self) -> int:
        """Score-matrix entries evaluated (per batch row and head)."""
        return sum(visible_entries(nq, nk, self.causal, self.window) for _, nq, _, nk in self.pairs)


def visible_entries(nq: int, nk: int, causal: bool, window: tuple[int, int] | None) -> int:
    """Visible entries of one nq x nk block under the step's mask (closed form: windows of
    million-token rows are priced without a loop over rows)."""
    if causal:
        return nq * (nq + 1) // 2
    if window is None:
        return nq * nk
    left, right = window
    lo = -(nq - 1) if left < 0 else max(-(nq - 1), (nk - nq) - left)  # band of d = j - i
    hi = nk - 1 if right < 0 else min(nk - 1, (nk - nq) + right)
    # entries on diagonal d: min(nq, nk - d) - max(0, -d), linear between the breakpoints 0 and nk - nq

    def on_diagonals(a: int, b: int) -> int:
        total = 0
        for x, y in ((a, min(b, -1)), (max(a, 0), b)):  # d < 0 and d >= 0
            for u, v in ((x, min(y, nk - nq - 1)), (max(x, nk - nq), y)):  # nk - d > nq and <= nq
                if u > v:
                    continue
                # count(d) = A + B*d on [u, v]
                if u < nk - nq:  # min(nq, nk - d) = nq
                    A, B = nq, 0
                else:  # = nk - d
                    A, B = nk, -1
                if u < 0:  # - max(0, -d) = d
                    B += 1
                total += A * (v - u + 1) + B * (u + v) * (v - u + 1) // 2
        return total

    return on_diagonals(lo, hi) if lo <= hi else 0


def band_pair(
    q_row: int, q_pos: int, nq: int, k_row: int, k_pos: int, nk: int, lo: int, hi: int
) -> tuple[tuple[int, int, int, int], bool, tuple[int, int] | None] | None:
    """The part of a (query chunk, key chunk) block that the band [lo, hi] reaches, trimmed to its
    bounding box, with the kernel mask that reproduces the band there (None if invisible)."""
    d = k_pos - q_pos
    dlo, dhi = lo - d, hi - d  # visible iff dlo <= j - i <= dhi
    i0, i1 = max(0, -dhi), min(nq - 1, nk - 1 - dlo)
    if i0 > i1:
        return None
    j0, j1 = max(0, i0 + dlo), min(nk - 1, i1 + dhi)
    nq2, nk2 = i1 - i0 + 1, j1 - j0 + 1
    dlo2, dhi2 = dlo - (j0 - i0), dhi - (j0 - i0)  # the band in the trimmed block's frame
    pair = (q_row + i0, nq2, k_row + j0, nk2)
    full_lo, full_hi = dlo2 <= -(nq2 - 1), dhi2 >= nk2 - 1
    if full_lo and full_hi:
        return pair, False, None
    left = -1 if full_lo else (nk2 - nq2) - dlo2
    right = -1 if full_hi else dhi2 - (nk2 - nq2)
    if nq2 == nk2 and left == -1 and right == 0:
        return pair, True, None
    return pair, False, (left, right)


def group_calls(found) -> tuple[Step, ...]:
    """`band_pair` results (None: invisible) grouped into kernel calls: one per mask, and within a
    mask as few calls as keep each call's query rows disjoint (its results merge by row)."""
    groups: dict[tuple, list[list[tuple[int, int, int, int]]]] = {}
    for item in found:
        if item is None:
            continue
        pair, is_causal, win = item
        calls = groups.setdefault((is_causal, win), [])
        home = next((c for c in calls if all(pair[0] + pair[1] <= a or a + n <= pair[0] for a, n, _, _ in c)), None)
        if home is None:
            calls.append([pair])
        else:
            home.append(pair)
    return tuple(
        Step(tuple(sorted(c)), mask[0], mask[1]) for mask, calls in sorted(groups.items(), key=str) for c in calls
    )
