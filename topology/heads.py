"""Where heads live: how the query and key/value heads of one attention call split over the ulysses ranks,
and how an attention module cuts them into chunks. Pure Python (no torch, no pydantic), shared by the engine
and the cost and memory models."""

from __future__ import annotations

__all__ = ["head_split", "module_chunks", "pieces"]


def head_split(heads: int, kv_heads: int, ulysses: int) -> list[tuple[int, int, int, int]]:
    """Per ulysses rank ``i``: ``(c_i, start_i, lo_i, k_i)`` query-head count, first query head, first KV
    head and number of KV heads it receives (uneven split: the first ``H % u`` ranks get one more)."""
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if ulysses > heads:
        raise ValueError(f"ulysses={ulysses} exceeds heads={heads}: every ulysses rank needs at least one head")
    grp = heads // kv_heads
    out, start = [], 0
    for i in range(ulysses):
        c = heads // ulysses + (1 if i < heads % ulysses else 0)
        lo, hi = start // grp, (start + c - 1) // grp + 1
        out.append((c, start, lo, hi - lo))
        start += c
    return out


def module_chunks(heads: int, kv_heads: int, ulysses: int, head_chunks: int) -> tuple[list[tuple[int, int]], int]:
    """How an attention module runs `head_chunks` chunks from its projections on: the KV-head ranges
    of its module-level chunks (whole GQA groups, so a KV head is projected and exchanged in one chunk
    only; sizes differ by at most one group; every chunk keeps >= `ulysses` query heads), and the
    engine-level chunks (hcp.attention(head_chunks=...)) each of them runs, to reach about
    `head_chunks` in all."""
    group = heads // kv_heads
    most = max(1, kv_heads // -(-ulysses // group))  # chunks of >= ceil(u / group) KV heads
    n = max(1, min(head_chunks, most))
    return pieces(0, kv_heads, n), -(-head_chunks // n)


def pieces(start: int, end: int, n: int) -> list[tuple[int, int]]:
    """[start, end) in n consecutive pieces whose sizes differ by at most one (the first ones larger)."""
    size, extra = divmod(end - start, n)
    out, at = [], start
    for i in range(n):
        width = size + (1 if i < extra else 0)
        out.append((at, at + width))
        at += width
    return out
