"""Packing: which ring rank holds which documents of a packed row, balanced for causal attention.

Documents longer than a threshold are cut per-document zigzag (2r chunks, rank j holds chunks j and
2r-1-j: equal causal work everywhere); the others stay whole on one ring rank, placed greedily. The
threshold is the longest-first split count that balances best (docs/layouts.md). `topology.layouts.Packed`
lays out the blocks this module assigns.
"""

from __future__ import annotations

__all__ = ["Block", "block_tokens", "assign_documents", "best_assignment"]


def _zigzag_chunks(length: int, ring: int, offset: int) -> list[tuple[int, int]]:
    """Cut a document into 2r chunks whose sizes differ by at most one; the spare tokens go to ring
    ranks offset, offset+1, ... so that they spread over ranks across documents."""
    base, spare = divmod(length, 2 * ring)
    sizes = [base] * (2 * ring)
    for t in range(spare):
        rank = (offset + t) % ring
        sizes[rank if t < ring else 2 * ring - 1 - rank] += 1
    out, pos = [], 0
    for n in sizes:
        out.append((pos, n))
        pos += n
    return out


Block = tuple[list[tuple[int, tuple[tuple[int, int], ...]]], list[int]]


def block_tokens(doc_lens: tuple[int, ...], block: Block) -> int:
    split, whole = block
    return sum(n for _, ch in split for _, n in ch) + sum(doc_lens[d] for d in whole)


def _causal_work(chunks) -> int:
    """Causal score entries of queries at these document positions (each sees every earlier key)."""
    return sum(n * a + n * (n + 1) // 2 for a, n in chunks)


def assign_documents(doc_lens: tuple[int, ...], split: list[int], ring: int) -> list[Block]:
    """Cut the `split` documents per-document zigzag; place the others whole, largest work first,
    on the ring rank with the least work among those with room (else the one with fewest tokens)."""
    blocks: list[Block] = [([], []) for _ in range(ring)]
    work, tokens = [0] * ring, [0] * ring
    offset = 0
    for d in split:
        chunks = _zigzag_chunks(doc_lens[d], ring, offset)
        offset = (offset + doc_lens[d] % (2 * ring)) % ring
        for j in range(ring):
            mine = (chunks[j], chunks[2 * ring - 1 - j])
            blocks[j][0].append((d, mine))
            work[j] += _causal_work(mine)
            tokens[j] += mine[0][1] + mine[1][1]
    rest = sorted(
        (d for d in range(len(doc_lens)) if d not in set(split) and doc_lens[d] > 0), key=lambda d: -doc_lens[d]
    )
    capacity = -(-sum(doc_lens) // ring)
    for d in rest:
        n = doc_lens[d]
        fits = [j for j in range(ring) if tokens[j] + n <= capacity]
        j = min(fits, key=lambda j: (work[j], tokens[j])) if fits else min(range(ring), key=lambda j: tokens[j])
        blocks[j][1].append(d)
        work[j] += n * (n + 1) // 2
        tokens[j] += n
    return blocks


def _score(doc_lens: tuple[int, ...], blocks: list[Block]) -> tuple[float, float]:
    """(causal work of the busiest rank / mean, tokens of the fullest rank / mean)."""
    work = [
        sum(_causal_work(ch) for _, ch in split) + sum(doc_lens[d] * (doc_lens[d] + 1) // 2 for d in whole)
        for split, whole in blocks
    ]
    tokens = [block_tokens(doc_lens, b) for b in blocks]
    mean_w, mean_t = sum(work) / len(work), sum(tokens) / len(tokens)
    return max(work) / max(mean_w, 1), max(tokens) / max(mean_t, 1)


def best_assignment(doc_lens: tuple[int, ...], ring: int) -> list[Block]:
    """Split the k longest documents for the smallest k whose placement has causal work within 2%
    and tokens within 1% of the mean; else the k with the best worst ratio. Every k is tried for
    up to 64 documents, else k = 0, 1, 2, 4, ..., all (the search stays in milliseconds)."""
    order = sorted((d for d in range(len(doc_lens)) if doc_lens[d] > 0), key=lambda d: -doc_lens[d])
    if len(order) <= 64:
        counts = list(range(len(order) + 1))
    else:
        counts, k = [0], 1
        while k < len(order):
            counts.append(k)
            k *= 2
        counts.append(len(order))
    best, best_score = None, None
    for k in counts:
        blocks = assign_documents(doc_lens, order[:k], ring)
        w, t = _score(doc_lens, blocks)
        if w <= 1.02 and t <= 1.01:
            return blocks
        score = max(w, t)
        if best_score is None or score < best_score:
            best, best_score = blocks, score
    return best
