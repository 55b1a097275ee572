"""Where tokens live: the layouts of one row, the arithmetic the engine (`hybrid_cp`) and the cost model share.

Pure Python (no torch, no pydantic), so that `import hybrid_cp` does not load the planner and the
planner does not load torch. The engine builds its index tensors and ring schedule from these
objects; `topology.comm_bytes` prices the same shapes, so the two cannot disagree.

A layout places the tokens of one row (a dense sequence, or packed documents) on the ``u x r`` cp
ranks. After the Ulysses all-to-all, ring rank ``j`` holds a *ring block* of ``block_len`` rows; the
layout describes it as spans (one per document, plus pad spans), each a list of chunks of document
positions in row order. Everything else is derived here once: which rows each ulysses rank holds,
which original token sits in each local slot, the (query rows, key rows) pairs each ring step
computes, and the causal work per rank. Heads are `topology.heads`' (re-exported here), a step's kernel
calls and their masks `topology.block_masks`', and where a packed row's documents go `topology.packing`'s.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from .block_masks import Step, band_pair, group_calls
from .heads import head_split, module_chunks, pieces
from .masks import AttnMask, band
from .packing import assign_documents, best_assignment, block_tokens

LAYOUTS = ("zigzag", "contiguous")
PAD = -1  # the document id of pad rows


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a known sequence layout; use one of {LAYOUTS}")
    return layout


def granularity(layout: str, ulysses: int, ring: int) -> int:
    """Dense lengths are padded to a multiple of this: zigzag cuts 2*u*r pieces, contiguous u*r.

    Args:
        layout: "zigzag" or "contiguous".
        ulysses: The ulysses degree u.
        ring: The ring degree r.

    Returns:
        The granularity in tokens.
    """
    return (2 if check_layout(layout) == "zigzag" else 1) * ulysses * ring


def padded_length(seq_len: int, layout: str, ulysses: int, ring: int) -> int:
    """A dense `seq_len` rounded up to the layout's granularity (the engine pads at the end).

    Args:
        seq_len: The unpadded length.
        layout: "zigzag" or "contiguous".
        ulysses: The ulysses degree u.
        ring: The ring degree r.

    Returns:
        The padded length.
    """
    g = granularity(layout, ulysses, ring)
    return -(-seq_len // g) * g


@dataclass(frozen=True)
class Span:
    """Consecutive rows of a ring block that belong to one document (or are padding).

    ``chunks`` are (first document position, length) runs in row order, with increasing positions,
    so the causal order of the rows is their row order."""

    doc: int
    row: int
    chunks: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.chunks)


class Layout:
    """Base class: subclasses set the fields below and implement `_spans` and `_local_rows`."""

    kind: str
    ulysses: int
    ring: int
    doc_lens: tuple[int, ...]  # real tokens per document (one entry for a dense sequence)
    block_len: int  # rows of every ring block (u * local_len)

    @property
    def local_len(self) -> int:
        return self.block_len // self.ulysses

    @property
    def seq_len(self) -> int:
        return sum(self.doc_lens)

    @property
    def padded_len(self) -> int:
        return self.block_len * self.ring

    @property
    def doc_starts(self) -> tuple[int, ...]:
        out, total = [], 0
        for n in self.doc_lens:
            out.append(total)
            total += n
        return tuple(out)

    def _spans(self, ring_rank: int) -> list[Span]:
        raise NotImplementedError

    def _local_rows(self, ulysses_rank: int) -> list[tuple[int, int]]:
        """(first row, count) runs of the ring block that ulysses rank `ulysses_rank` holds, in local order."""
        s = self.local_len
        return [(ulysses_rank * s, s)]

    # ---- derived (cached per layout instance) ------------------------------------------------
    def spans(self, ring_rank: int) -> tuple[Span, ...]:
        cache = self.__dict__.setdefault("_span_cache", {})
        if ring_rank not in cache:
            spans = tuple(self._spans(ring_rank))
            row = 0
            for sp in spans:  # spans tile the block in row order, chunk positions increase
                assert sp.row == row and all(a + n <= b for (a, n), (b, _) in zip(sp.chunks, sp.chunks[1:])), sp
                row += sp.length
            assert row == self.block_len, (row, self.block_len)
            cache[ring_rank] = spans
        return cache[ring_rank]

    def gathered_rows(self) -> list[int] | None:
        """Ring-block row of each position of the gathered (ulysses-rank-major) order; None if identical."""
        rows = [a + i for u in range(self.ulysses) for a, n in self._local_rows(u) for i in range(n)]
        return None if rows == list(range(self.block_len)) else rows

    def token_runs(self, cp_rank: int) -> list[tuple[int, int, int]]:
        """(original token index or PAD, document position, count) runs of `cp_rank`'s local slots in order."""
        ring_rank, ulysses_rank = divmod(cp_rank, self.ulysses)
        starts = self.doc_starts
        row_runs = []  # (row, token or PAD, position, count) over the whole ring block
        for sp in self.spans(ring_rank):
            row = sp.row
            for pos, n in sp.chunks:
                row_runs.append((row, PAD if sp.doc == PAD else starts[sp.doc] + pos, pos, n))
                row += n
        out = []
        for first, count in self._local_rows(ulysses_rank):
            end = first + count
            for row, tok, pos, n in row_runs:
                a, b = max(row, first), min(row + n, end)
                if a < b:
                    off = a - row
                    out.append((PAD if tok == PAD else tok + off, pos + off, b - a))
        return out

    def document_runs(self, cp_rank: int) -> list[tuple[int, int, int]]:
        """`token_runs` with adjacent runs of one document merged: under zigzag the last ring rank's two
        chunks meet, and at one rank both chunks are one document; as one run the second neither continues
        nor takes a gather slot. The one definition of a linear layer's runs (the engine's
        `recurrence.scan_plan` and the cost model both read it)."""
        out: list[tuple[int, int, int]] = []
        for tok, pos, n in self.token_runs(cp_rank):
            if out and tok != PAD and pos > 0 and out[-1][0] != PAD and out[-1][0] + out[-1][2] == tok:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((tok, pos, n))
        return out

    def effective_window(self, causal: bool, window):
        """`window` validated, or None when it reaches every key of every document anyway (then
        the windowless plan, with whole-document segments, is the same attention)."""
        if window is None:
            return None
        lo, hi = band(causal, window)
        longest = max(self.doc_lens, default=0)
        if lo <= -(longest - 1) and (causal or hi >= longest - 1):
            return None
        return window if causal else tuple(window)

    def effective_chunk(self, chunk_size: int | None) -> int | None:
        """`chunk_size` validated, or None when no document is longer than one chunk (then the plain
        plan is the same attention)."""
        if chunk_size is None:
            return None
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(
                f"chunk_size={chunk_size!r} must be an int >= 1 (positions per attention chunk, "
                f"Llama 4's attention_chunk_size) or None for no chunking"
            )
        return chunk_size if chunk_size < max(self.doc_lens, default=0) else None

    def tasks(
        self,
        ring_rank: int,
        step: int,
        causal: bool,
        window=None,
        chunk_size: int | None = None,
        mask: AttnMask | None = None,
    ) -> tuple[Step, ...]:
        """What ring rank `ring_rank` computes at ring step `step` (keys from rank ring_rank - step):
        one kernel call per mask; empty when the visiting block is invisible. With `chunk_size` C a
        query at document position i sees only keys j with j // C == i // C. With `mask` (an
        `AttnMask`, which then says everything: causal, window and chunk_size are not read) the
        plan is `mask_tasks`'. Cached."""
        if mask is not None:
            return self.mask_tasks(ring_rank, step, mask)
        cache = self.__dict__.setdefault("_task_cache", {})
        chunk = self.effective_chunk(chunk_size)
        key = (ring_rank, step, causal, tuple(window) if isinstance(window, list) else window, chunk)
        if key not in cache:
            cache[key] = self._tasks(ring_rank, step, causal, window, chunk)
        return cache[key]

    def _tasks(self, ring_rank: int, step: int, causal: bool, window, chunk: int | None) -> tuple[Step, ...]:
        src = (ring_rank - step) % self.ring
        queries = {sp.doc: sp for sp in self.spans(ring_rank) if sp.doc != PAD}
        keys = [sp for sp in self.spans(src) if sp.doc in queries]
        if window is None and chunk is None:  # whole document spans: one pair per document and step
            pairs = []
            for sp in keys:
                q = queries[sp.doc]
                if not causal:
                    pairs.append((q.row, q.length, sp.row, sp.length))
                elif src == ring_rank:
                    pairs.append((q.row, q.length, q.row, q.length))
                elif (pair := _visible_rectangle(q, sp)) is not None:
                    pairs.append(pair)
            return (Step(tuple(pairs), causal and src == ring_rank),) if pairs else ()
        lo, hi = band(causal, window)
        found = []
        for sp in keys:  # run by run: a window's reach and a chunk's bounds depend on document positions
            by_chunk: dict[int, list[tuple[int, int, int]]] = {}
            for run in _runs(sp, chunk):  # the visiting runs, by attention chunk
                by_chunk.setdefault(0 if chunk is None else run[1] // chunk, []).append(run)
            for q_row, q_pos, nq in _runs(queries[sp.doc], chunk):
                for k_row, k_pos, nk in by_chunk.get(0 if chunk is None else q_pos // chunk, ()):
                    found.append(band_pair(q_row, q_pos, nq, k_row, k_pos, nk, lo, hi))
        return group_calls(found)

    def mask_tasks(self, ring_rank: int, step: int, mask: AttnMask) -> tuple[Step, ...]:
        """`tasks` under any `AttnMask` over the row's global token positions: every slice cut by each
        (query run of `ring_rank`, key run of the visiting block) pair is one `band_pair`, so each
        visible cell is computed once, by the rank holding its query. Any layout of `mask.seq_len`
        tokens serves (exactness does not depend on where the tokens sit; balance does). Cached."""
        if mask.seq_len != self.seq_len:
            raise ValueError(f"mask.seq_len={mask.seq_len} differs from the layout's {self.seq_len} tokens")
        cache = self.__dict__.setdefault("_task_cache", {})
        key = (ring_rank, step, mask)
        if key not in cache:
            keys = self.row_runs((ring_rank - step) % self.ring)
            starts = [tok for _, tok, _ in keys]
            found = []
            for q_row, q_tok, nq in self.row_runs(ring_rank):
                for s in mask.clip(q_tok, q_tok + nq):
                    lo, hi = s.offsets()
                    for k_row, k_tok, nk in keys[max(0, bisect_right(starts, s.k_start) - 1) :]:
                        if k_tok >= s.k_end:
                            break
                        a, b = max(k_tok, s.k_start), min(k_tok + nk, s.k_end)
                        if a < b:
                            found.append(
                                band_pair(
                                    q_row + s.q_start - q_tok,
                                    s.q_start,
                                    s.q_end - s.q_start,
                                    k_row + a - k_tok,
                                    a,
                                    b - a,
                                    lo,
                                    hi,
                                )
                            )
            cache[key] = group_calls(found)
        return cache[key]

    def row_runs(self, ring_rank: int) -> list[tuple[int, int, int]]:
        """(ring-block row, global token, count) of the real (non-pad) rows of a ring block, by token."""
        starts = self.doc_starts
        return sorted(
            (
                (row, starts[sp.doc] + pos, n)
                for sp in self.spans(ring_rank)
                if sp.doc != PAD
                for row, pos, n in _runs(sp, None)
            ),
            key=lambda run: run[1],
        )

    def step(self, ring_rank: int, step: int, causal: bool) -> Step | None:
        """The single kernel call of a ring step without a window (None if the block is invisible)."""
        found = self.tasks(ring_rank, step, causal)
        return found[0] if found else None

    def work(
        self, causal: bool = True, window=None, chunk_size: int | None = None, mask: AttnMask | None = None
    ) -> list[list[int]]:
        """Score entries each ring rank evaluates at each step, counted from the same plan the engine runs."""
        return [
            [sum(t.work() for t in self.tasks(j, s, causal, window, chunk_size, mask)) for s in range(self.ring)]
            for j in range(self.ring)
        ]

    def work_imbalance(self, causal: bool = True) -> float:
        """The busiest ring rank's attention work over the mean, in the continuous limit (whole
        blocks, ignoring the diagonal's half rows) that the cost model prices: 1 for layouts that
        balance causal work (zigzag pairs chunks j and 2r-1-j; packed layouts balance by design)."""
        return 1.0

    def kernel_calls(
        self, causal: bool = True, window=None, chunk_size: int | None = None, mask: AttnMask | None = None
    ) -> list[int]:
        """(query, key) segment pairs per ring rank over all steps: what its kernel calls carry."""
        return [
            sum(len(t.pairs) for s in range(self.ring) for t in self.tasks(j, s, causal, window, chunk_size, mask))
            for j in range(self.ring)
        ]

    def needed_rows(
        self,
        ring_rank: int,
        step: int,
        causal: bool,
        window=None,
        chunk_size: int | None = None,
        mask: AttnMask | None = None,
    ) -> list[tuple[int, int]]:
        """Merged (first row, count) runs of the visiting key block that the step's calls read."""
        runs = sorted(
            (a, n) for t in self.tasks(ring_rank, step, causal, window, chunk_size, mask) for _, _, a, n in t.pairs
        )
        merged: list[list[int]] = []
        for a, n in runs:
            if merged and a <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], a + n - merged[-1][0])
            else:
                merged.append([a, n])
        return [(a, n) for a, n in merged]

    def halo(self, causal: bool, window, chunk_size: int | None = None, mask: AttnMask | None = None) -> bool:
        """Whether the ring exchanges only the key rows other ranks' queries can see (`needed_rows`, the
        one visibility rule) instead of streaming whole blocks; decided identically on every rank, for
        every mask: a packed row whose documents each sit whole on one ring rank moves no ring bytes.
        Halo when, on every rank, the rows received plus the rows sent fit in one block: then its
        buffers (received K/V kept for backward, their fp32 gradients, those of the rows sent, and the
        fp32 home block) never exceed the streaming ring's two K/V and two fp32 dK/dV blocks, which the
        memory model prices; wider reads stream whole blocks (skipping the invisible steps)."""
        if self.ring == 1:
            return False
        r = self.ring
        for j in range(r):
            moved = sum(
                n
                for s in range(1, r)
                for rank in (j, (j + s) % r)
                for _, n in self.needed_rows(rank, s, causal, window, chunk_size, mask)
            )
            if moved > self.block_len:
                return False
        return True

    def key(self) -> tuple:
        return (self.kind, self.ulysses, self.ring, self.doc_lens, self.block_len)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.key() == other.key()

    def __hash__(self) -> int:  # computed once: a layout keys the engine's caches on every call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash(self.key())
        return cached

    def __getstate__(self) -> dict:  # a string's hash differs between processes: never pickle the cached one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(u={self.ulysses}, r={self.ring}, docs={len(self.doc_lens)}, "
            f"tokens={self.seq_len}, padded={self.padded_len})"
        )


def _runs(span: Span, chunk: int | None):
    """(row, first document position, count) of the span's position runs, each cut at the multiples
    of `chunk` (an attention chunk's bounds) when given."""
    row = span.row
    for pos, n in span.chunks:
        end = pos + n
        while pos < end:
            stop = end if chunk is None else min(end, (pos // chunk + 1) * chunk)
            yield row, pos, stop - pos
            row, pos = row + stop - pos, stop


def _visible_rectangle(q: Span, k: Span) -> tuple[int, int, int, int] | None:
    """The rows of `q` that see rows of `k` of the same document on another ring rank (every key
    before every query), as one rectangle. Chunks of one document on different ranks are disjoint,
    so each (query chunk, key chunk) pair is all visible or all invisible."""
    sel_q = [i for i, (a, _) in enumerate(q.chunks) if any(b + m <= a for b, m in k.chunks)]
    if not sel_q:
        return None
    first_q = q.chunks[sel_q[0]][0]
    sel_k = [i for i, (b, m) in enumerate(k.chunks) if b + m <= first_q]
    # one rectangle: the selected chunks are suffix of the query span / prefix of the key span
    assert sel_q == list(range(sel_q[0], len(q.chunks))) and sel_k == list(range(len(sel_k))), (q, k)
    q_row = q.row + sum(n for _, n in q.chunks[: sel_q[0]])
    k_len = sum(k.chunks[i][1] for i in sel_k)
    return q_row, q.row + q.length - q_row, k.row, k_len


class DenseZigzag(Layout):
    """One sequence cut into 2r chunks (padded at the end); ring rank j holds chunks j and 2r-1-j,
    and each chunk is cut into u pieces of which ulysses rank i holds piece i."""

    kind = "zigzag"

    def __init__(self, seq_len: int, ulysses: int, ring: int):
        self.ulysses, self.ring, self.doc_lens = ulysses, ring, (seq_len,)
        self.block_len = padded_length(seq_len, "zigzag", ulysses, ring) // ring

    def _spans(self, ring_rank: int) -> list[Span]:
        c = self.block_len // 2
        return _dense_spans([(ring_rank * c, c), ((2 * self.ring - 1 - ring_rank) * c, c)], self.seq_len)

    def _local_rows(self, ulysses_rank: int) -> list[tuple[int, int]]:
        c = self.block_len // 2
        p = c // self.ulysses
        return [(ulysses_rank * p, p), (c + ulysses_rank * p, p)]


class DenseContiguous(Layout):
    """One sequence cut into u*r equal runs (padded at the end); cp rank k holds run k."""

    kind = "contiguous"

    def __init__(self, seq_len: int, ulysses: int, ring: int):
        self.ulysses, self.ring, self.doc_lens = ulysses, ring, (seq_len,)
        self.block_len = padded_length(seq_len, "contiguous", ulysses, ring) // ring

    def _spans(self, ring_rank: int) -> list[Span]:
        return _dense_spans([(ring_rank * self.block_len, self.block_len)], self.seq_len)

    def work_imbalance(self, causal: bool = True) -> float:
        """Causal: ring rank j computes j whole blocks and one half block, j + 1/2 in block units; the
        last rank's r - 1/2 over the mean r/2 is 2 - 1/r."""
        return 2.0 - 1.0 / self.ring if causal and self.ring > 1 else 1.0


def _dense_spans(chunks: list[tuple[int, int]], seq_len: int) -> list[Span]:
    """Spans of a dense ring block made of `chunks` of the padded sequence: the real prefix of the
    chunks is one span of document 0 (real rows are contiguous: padding sits at the sequence end,
    so a chunk with padding is followed only by all-pad chunks), the rest one pad span."""
    real = [(a, min(n, seq_len - a)) for a, n in chunks if a < seq_len]
    pads = [(max(a, seq_len), a + n - max(a, seq_len)) for a, n in chunks if a + n > seq_len]
    spans, row = [], 0
    if real:
        spans.append(Span(0, 0, tuple(real)))
        row = sum(n for _, n in real)
    if pads:
        spans.append(Span(PAD, row, tuple(pads)))
    return spans


class Packed(Layout):
    """Packed documents of any lengths, balanced for causal attention.

    policy "balanced" (default): documents longer than a threshold are cut per-document zigzag
    (2r chunks, rank j holds chunks j and 2r-1-j: equal causal work everywhere); the others stay
    whole on one ring rank, placed greedily (largest work first, onto the least-loaded rank with
    room). The threshold is the longest-first split count that balances best (see docs/layouts.md).
    policy "zigzag": every document per-document zigzag (the peers' scheme, without their
    per-document padding). policy "contiguous": the row cut into equal runs (no balance).
    Each ring block is [split documents' two chunks, adjacent; whole documents; padding]; ulysses
    rank i holds the i-th contiguous 1/u of it, so no permutation follows the all-to-all.
    """

    def __init__(self, doc_lens: tuple[int, ...], ulysses: int, ring: int, policy: str = "balanced"):
        if policy not in ("balanced", "zigzag", "contiguous"):
            raise ValueError(f"packing policy={policy!r}; use 'balanced', 'zigzag' or 'contiguous'")
        self.kind = "packed-" + policy
        self.ulysses, self.ring, self.doc_lens, self.policy = ulysses, ring, tuple(doc_lens), policy
        if policy == "contiguous" or ring == 1:  # one ring block: keep the row in order
            self.block_len = -(-max(self.seq_len, 1) // (ulysses * ring)) * ulysses
            self._blocks = None
            return
        if policy == "zigzag":
            blocks = assign_documents(self.doc_lens, [d for d, n in enumerate(self.doc_lens) if n > 0], ring)
        else:
            blocks = best_assignment(self.doc_lens, ring)
        self._blocks = blocks  # per ring rank: (split docs with their chunks, whole docs)
        tokens = max(block_tokens(self.doc_lens, b) for b in blocks)
        self.block_len = -(-max(tokens, 1) // ulysses) * ulysses

    def _spans(self, ring_rank: int) -> list[Span]:
        spans, row = [], 0
        if self._blocks is None:  # contiguous
            a, b = ring_rank * self.block_len, (ring_rank + 1) * self.block_len
            for d, start in enumerate(self.doc_starts):
                lo, hi = max(a, start), min(b, start + self.doc_lens[d])
                if lo < hi:
                    spans.append(Span(d, row, ((lo - start, hi - lo),)))
                    row += hi - lo
        else:
            split, whole = self._blocks[ring_rank]
            for d, chunks in split:
                chunks = tuple(c for c in chunks if c[1] > 0)
                if chunks:
                    spans.append(Span(d, row, chunks))
                    row += sum(n for _, n in chunks)
            for d in whole:
                spans.append(Span(d, row, ((0, self.doc_lens[d]),)))
                row += self.doc_lens[d]
        if row < self.block_len:
            spans.append(Span(PAD, row, ((0, self.block_len - row),)))
        return spans

    def padding(self) -> int:
        return self.padded_len - self.seq_len


@lru_cache(maxsize=256)
def make_layout(
    layout: str, ulysses: int, ring: int, seq_len: int | None = None, doc_lens: tuple[int, ...] | None = None
) -> Layout:
    """The layout of one row: dense (`seq_len`) or packed documents (`doc_lens`); cached, since
    every layer of a model asks for the same one."""
    check_layout(layout)
    if doc_lens is None:
        return (DenseZigzag if layout == "zigzag" else DenseContiguous)(seq_len, ulysses, ring)
    return Packed(doc_lens, ulysses, ring, "balanced" if layout == "zigzag" else "contiguous")


def layout_of(layout: str, ulysses: int, ring: int, *, seq_len: int | None = None, cu_seqlens=None) -> Layout:
    """The layout of one row from its length (dense) or its document boundaries (packed, flash-attn's
    ``cu_seqlens`` as a sequence of ints): the one place both the engine and the planner turn
    boundaries into a layout."""
    if cu_seqlens is not None:
        return make_layout(layout, ulysses, ring, doc_lens=doc_lengths(cu_seqlens))
    return make_layout(layout, ulysses, ring, seq_len=seq_len)


def doc_lengths(cu_seqlens) -> tuple[int, ...]:
    """Document lengths from flash-attn style boundaries [0, len_0, len_0 + len_1, ..., total]."""
    cu = [int(x) for x in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(
            f"cu_seqlens={cu[:8]}{'...' if len(cu) > 8 else ''} must start at 0 and hold at least "
            f"[0, total]: the packed row's document boundaries, as flash-attn's varlen functions take"
        )
    lens = tuple(b - a for a, b in zip(cu, cu[1:]))
    bad = [i for i, n in enumerate(lens) if n < 0]
    if bad:
        raise ValueError(
            f"cu_seqlens decreases after index {bad[0]} ({cu[bad[0]]} -> {cu[bad[0] + 1]}); boundaries "
            f"must be non-decreasing cumulative lengths"
        )
    return lens


__all__ = [
    "LAYOUTS",
    "PAD",
    "Layout",
    "DenseZigzag",
    "DenseContiguous",
    "Packed",
    "Span",
    "Step",
    "band",
    "head_split",
    "module_chunks",
    "pieces",
    "granularity",
    "padded_length",
    "make_layout",
    "layout_of",
    "doc_lengths",
    "check_layout",
]
