"""A layout balanced from an attention mask: where each row goes when the mask is not causal.

The causal layouts (zigzag, packed) balance causal work; under a GRPO prompt tree or RAG block
attention they leave the busiest ring rank 1.2-3x above the mean. Here the row is cut into
``ring * chunks_per_rank`` chunks (sizes differ by at most one), each chunk's work is the visible cells
of its query rows (`AttnMask.count`, closed form), and chunks go heaviest first onto the least-loaded
ring rank that still has room (equal chunk counts, so equal tokens: MagiAttention's min-heap
dispatch). Exactness does not depend on the placement (`Layout.mask_tasks` computes every visible
cell once on any layout); balance and the rows the ring moves do.
"""

from __future__ import annotations

from functools import lru_cache

from .heads import pieces
from .layouts import PAD, Layout, Span
from .masks import AttnMask


class MaskBalanced(Layout):
    """One row of `mask.seq_len` tokens placed for the mask's work; ulysses rank i holds the i-th
    contiguous 1/u of its ring block (no permutation follows the all-to-all).

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
        chunks = [c for c in pieces(0, mask.seq_len, ring * chunks_per_rank) if c[1] > c[0]]
        self._blocks = _dispatch(chunks, [mask.count(a, b) for a, b in chunks], ring, chunks_per_rank)
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


def _dispatch(chunks: list[tuple[int, int]], work: list[int], ring: int, per_rank: int) -> list[list[tuple[int, int]]]:
    """Chunks heaviest first onto the least-loaded ring rank with fewer than `per_rank` chunks (ties:
    the lower rank, so every rank decides the same); each rank's chunks in row order."""
    blocks: list[list[tuple[int, int]]] = [[] for _ in range(ring)]
    load = [0] * ring
    for index in sorted(range(len(chunks)), key=lambda i: (-work[i], i)):
        rank = min((j for j in range(ring) if len(blocks[j]) < per_rank), key=lambda j: (load[j], j))
        blocks[rank].append(chunks[index])
        load[rank] += work[index]
    return [sorted(block) for block in blocks]


def work_ratios(layout: Layout, mask: AttnMask) -> tuple[float, float]:
    """(busiest ring rank's total work / mean, lock-step ratio): the ring's steps wait for the
    slowest rank, so its time goes as the sum over steps of the busiest rank's work at that step;
    the second ratio is that sum over the mean total work (1.0: perfectly balanced at every step)."""
    work = [[sum(t.work() for t in layout.mask_tasks(j, s, mask)) for s in range(layout.ring)]
            for j in range(layout.ring)]
    mean = max(sum(map(sum, work)) / layout.ring, 1)
    lock_step = sum(max(work[j][s] for j in range(layout.ring)) for s in range(layout.ring))
    return max(map(sum, work)) / mean, lock_step / mean


__all__ = ["MaskBalanced", "mask_layout", "work_ratios"]
