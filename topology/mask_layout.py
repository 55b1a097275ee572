"""A layout balanced from an attention mask: where each row goes when the mask is not causal.

The causal layouts (zigzag, packed) balance causal work; under a GRPO prompt tree or RAG block
attention they leave the busiest ring rank 1.2-3x above the mean. Here the row is cut into
``ring * chunks_per_rank`` chunks (sizes differ by at most one) and every (query chunk, key chunk)
pair's visible cells are counted in closed form (`band_cells`). The ring is lock-step: its time goes
as the sum over steps of the busiest rank's work at that step, and step s pairs rank j's queries with
rank j - s's keys, so that sum depends on where every chunk sits, not only on each rank's total.
Three starting placements (MagiAttention's heaviest-first min-heap dispatch, a zigzag, the row in
order) are each improved by swapping chunk pairs while the lock-step sum falls; the best wins. Each
rank keeps `chunks_per_rank` chunks, so tokens stay equal. When the mask splits into components (rows
no slice crosses, e.g. packed documents) small enough to sit whole on one rank within one chunk of
padding, whole components placed heaviest first move no ring rows; they win when their lock-step
ratio is within `LOCAL_SLACK` of the swapped grid's. Integer arithmetic throughout, so every rank
computes the same placement. Exactness does not depend on the placement (`Layout.mask_tasks`
computes every visible cell once on any layout); balance and the rows the ring moves do.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache

import numpy as np

from .heads import pieces
from .layouts import PAD, Layout, Span
from .masks import AttnMask, band_cells

LOCAL_SLACK = 1.05  # whole components (no ring rows) win over a grid up to 5% better balanced per step
_SCALE_BITS = 30  # the search's cells are quantized to total / 2**30: its sums of squares fit int64
SEARCH_BUDGET = 1 << 22  # rank-pair entries one start's swap search scores (~0.2 s): swaps = budget / (pairs r^2)


class MaskBalanced(Layout):
    """One row of `mask.seq_len` tokens placed for the mask's work per ring step; ulysses rank i holds
    the i-th contiguous 1/u of its ring block (no permutation follows the all-to-all).

    Args:
        mask: The row's attention mask.
        ulysses: The ulysses degree u.
        ring: The ring degree r.
        chunks_per_rank: Chunks each ring rank holds (finer balances better and moves more rows;
            8 is MagiAttention's default).
    """

    kind = "mask-balanced"

    def __init__(self, mask: AttnMask, ulysses: int, ring: int, chunks_per_rank: int = 8):
        if isinstance(chunks_per_rank, bool) or not isinstance(chunks_per_rank, int) or chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank={chunks_per_rank!r} must be an int >= 1")
        self.mask, self.chunks_per_rank = mask, chunks_per_rank
        self.ulysses, self.ring, self.doc_lens = ulysses, ring, (mask.seq_len,)
        self._blocks = place(mask, ring, chunks_per_rank)
        tokens = max(sum(b - a for a, b in block) for block in self._blocks)
        self.block_len = -(-max(tokens, 1) // ulysses) * ulysses

    def _spans(self, ring_rank: int) -> list[Span]:
        chunks = tuple((a, b - a) for a, b in self._blocks[ring_rank])
        spans, row = ([Span(0, 0, chunks)], sum(n for _, n in chunks)) if chunks else ([], 0)
        if row < self.block_len:
            spans.append(Span(PAD, row, ((0, self.block_len - row),)))
        return spans

    def key(self) -> tuple:
        return super().key() + (self.mask, self.chunks_per_rank)


@lru_cache(maxsize=64)
def mask_layout(mask: AttnMask, ulysses: int, ring: int) -> MaskBalanced:
    """The row's `MaskBalanced` layout, cached: every layer of a model asks for the same one."""
    return MaskBalanced(mask, ulysses, ring)


def place(mask: AttnMask, ring: int, per_rank: int) -> list[list[tuple[int, int]]]:
    """Each ring rank's [start, end) token ranges, in row order: the placement with the smallest
    lock-step work (whole components preferred within `LOCAL_SLACK`). Deterministic."""
    chunks = [c for c in pieces(0, mask.seq_len, ring * per_rank) if c[1] > c[0]]
    work = chunk_work(mask, chunks)
    best = None
    for start in _starts(work, ring, per_rank):
        rank = _improve(work, start, ring)
        score = lock_step(_rank_work(work, rank, ring))
        if best is None or score < best[0]:
            best = (score, rank)
    blocks = [[chunks[i] for i in np.flatnonzero(best[1] == j)] for j in range(ring)]
    local = _whole_components(mask, ring, per_rank)
    if local is not None:
        units, rank = local
        score = lock_step(_rank_work(chunk_work(mask, units), rank, ring))
        if score * 100 <= best[0] * round(LOCAL_SLACK * 100):
            blocks = [[units[i] for i in np.flatnonzero(rank == j)] for j in range(ring)]
    return blocks


def chunk_work(mask: AttnMask, chunks: list[tuple[int, int]]) -> np.ndarray:
    """Visible cells of every (query chunk, key chunk) pair, exact (int64), from the mask's slices:
    each slice cut by the query chunk meets a run of key chunks."""
    starts, n = [a for a, _ in chunks], len(chunks)
    work = np.zeros((n, n), dtype=np.int64)
    for a, (qa, qb) in enumerate(chunks):
        for s in mask.clip(qa, qb):
            lo, hi = s.offsets()
            for b in range(max(0, bisect_right(starts, s.k_start) - 1), n):
                if chunks[b][0] >= s.k_end:
                    break
                ka, kb = max(chunks[b][0], s.k_start), min(chunks[b][1], s.k_end)
                if ka < kb:
                    work[a, b] += band_cells(s.q_start, s.q_end, ka, kb, lo, hi)
    return work


def lock_step(rank_work: np.ndarray) -> int:
    """Sum over ring steps s of the busiest rank's work at s: rank j computes its queries against
    rank j - s's keys (`rank_work[j, k]`: cells of rank j's queries on rank k's keys)."""
    r = rank_work.shape[0]
    j = np.arange(r)
    return int(sum(rank_work[j, (j - s) % r].max() for s in range(r)))


def _rank_work(work: np.ndarray, rank: np.ndarray, ring: int) -> np.ndarray:
    onehot = np.zeros((len(rank), ring), dtype=np.int64)
    onehot[np.arange(len(rank)), rank] = 1
    return onehot.T @ work @ onehot


def _starts(work: np.ndarray, ring: int, per_rank: int) -> list[np.ndarray]:
    """Starting placements (chunk -> ring rank, `per_rank` chunks each): heaviest query chunk first
    onto the least-loaded rank with room (ties: the lower rank); zigzag over the chunks (rank j holds
    chunks j and 2r-1-j of every 2r, which evens causal-like work); the row in order (keeps local masks
    local)."""
    n = work.shape[0]
    load, count = [0] * ring, [0] * ring
    heaviest = np.zeros(n, dtype=np.int64)
    rows = work.sum(axis=1).tolist()
    for i in sorted(range(n), key=lambda i: (-rows[i], i)):
        j = min((j for j in range(ring) if count[j] < per_rank), key=lambda j: (load[j], j))
        heaviest[i], load[j], count[j] = j, load[j] + rows[i], count[j] + 1
    fold = np.arange(n) % (2 * ring)
    zigzag = np.where(fold < ring, fold, 2 * ring - 1 - fold)
    if np.bincount(zigzag, minlength=ring).max() > per_rank:  # per_rank odd: the last fold is partial
        zigzag = np.arange(n) % ring
    return [heaviest, zigzag, np.arange(n) // per_rank]


def _improve(work: np.ndarray, rank: np.ndarray, ring: int, max_swaps: int | None = None) -> np.ndarray:
    """Swap the chunk pair that lowers the lock-step sum most (ties: the smaller sum of squared
    rank-pair work, which evens the entries below the maxima), until no swap helps. Every candidate
    swap is scored at once: moving chunk a from rank p to q and b from q to p changes the rank-pair
    matrix by v x^T + y v^T + c v v^T with v = e_q - e_p, x = a's minus b's work on each rank's keys,
    y = the same as keys, c = W_aa - W_ab - W_ba + W_bb (a rank-one form of P' = P + (e_a - e_b) v^T)."""
    total = int(work.sum())
    w = work // max(1, -(-total // (1 << _SCALE_BITS)))
    n, rank = len(rank), rank.copy()
    first, second = np.triu_indices(n, 1)
    steps = (np.arange(ring)[None, :] - np.arange(ring)[:, None]) % ring  # [s, j]: the key rank of j at step s
    diag = np.diag(w)

    def score(pair_work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at_step = pair_work[..., np.arange(ring)[None, :], steps]
        return at_step.max(axis=-1).sum(axis=-1), (pair_work * pair_work).sum(axis=(-1, -2))

    if max_swaps is None:  # a count, not a clock: every rank stops at the same swap
        max_swaps = max(1, SEARCH_BUDGET // max(1, len(first) * ring * ring))
    for _ in range(max_swaps):
        onehot = np.zeros((n, ring), dtype=np.int64)
        onehot[np.arange(n), rank] = 1
        queries, keys = w @ onehot, w.T @ onehot
        now = onehot.T @ queries
        apart = rank[first] != rank[second]
        a, b = first[apart], second[apart]
        v = np.zeros((len(a), ring), dtype=np.int64)
        v[np.arange(len(a)), rank[b]] += 1
        v[np.arange(len(a)), rank[a]] -= 1
        x, y = queries[a] - queries[b], keys[a] - keys[b]
        c = diag[a] - w[a, b] - w[b, a] + diag[b]
        swapped = (
            now[None]
            + v[:, :, None] * x[:, None, :]
            + y[:, :, None] * v[:, None, :]
            + c[:, None, None] * v[:, :, None] * v[:, None, :]
        )
        lock, squares = score(swapped)
        tied = np.flatnonzero(lock == lock.min()) if len(a) else np.array([], dtype=np.int64)
        if not len(tied):
            break
        k = tied[np.argmin(squares[tied])]
        lock_now, squares_now = score(now)
        if (lock[k], squares[k]) >= (lock_now, squares_now):
            break
        rank[a[k]], rank[b[k]] = rank[b[k]], rank[a[k]]
    return rank


def _whole_components(mask: AttnMask, ring: int, per_rank: int) -> tuple[list[tuple[int, int]], np.ndarray] | None:
    """Whole components (and the rows between them, in chunk-sized pieces) placed heaviest first onto
    the least-loaded rank with token room, room being the even share plus one chunk; None when a unit
    is too long for that or none fits (then documents must be cut, and the grid serves)."""
    n, chunk = mask.seq_len, -(-mask.seq_len // (ring * per_rank))
    room = -(-n // ring) + chunk
    units, at = [], 0
    for a, b in mask.components() + ((n, n),):
        units += [c for c in pieces(at, a, -(-(a - at) // chunk)) if c[1] > c[0]] if a > at else []
        if b > a:
            units.append((a, b))
        at = max(at, b)
    if len(units) < ring or max(b - a for a, b in units) > room:
        return None
    work = [mask.count(a, b) for a, b in units]
    load, tokens, rank = [0] * ring, [0] * ring, np.zeros(len(units), dtype=np.int64)
    for i in sorted(range(len(units)), key=lambda i: (-work[i], -(units[i][1] - units[i][0]), i)):
        fits = [j for j in range(ring) if tokens[j] + units[i][1] - units[i][0] <= room]
        if not fits:
            return None
        j = min(fits, key=lambda j: (load[j], tokens[j], j))
        rank[i], load[j], tokens[j] = j, load[j] + work[i], tokens[j] + units[i][1] - units[i][0]
    return units, rank


def work_ratios(layout: Layout, mask: AttnMask) -> tuple[float, float]:
    """(busiest ring rank's total work / mean, lock-step ratio): the ring's steps wait for the
    slowest rank, so its time goes as the sum over steps of the busiest rank's work at that step;
    the second ratio is that sum over the mean total work (1.0: perfectly balanced at every step)."""
    work = [
        [sum(t.work() for t in layout.mask_tasks(j, s, mask)) for s in range(layout.ring)] for j in range(layout.ring)
    ]
    mean = max(sum(map(sum, work)) / layout.ring, 1)
    lock = sum(max(work[j][s] for j in range(layout.ring)) for s in range(layout.ring))
    return max(map(sum, work)) / mean, lock / mean


__all__ = [
    "LOCAL_SLACK",
    "SEARCH_BUDGET",
    "MaskBalanced",
    "mask_layout",
    "place",
    "chunk_work",
    "lock_step",
    "work_ratios",
]
