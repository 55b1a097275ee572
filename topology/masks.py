"""Attention masks as range slices: which keys each query of a row sees, in global row positions.

Pure Python (no torch), so that the planner, the cost model and the engine read one value. A mask is
a set of slices ``(q_start, q_end, k_start, k_end, lo, hi)``: query ``i`` sees key ``j`` iff, for
some slice, ``q_start <= i < q_end``, ``k_start <= j < k_end`` and ``lo <= j - i <= hi`` (``None``:
unbounded). This is MagiAttention's rectangle with a diagonal band; every slice cut by a (query
run, key run) pair is again a rectangle with a band, which flash-attn's varlen ``window_size``
(or causal, or nothing) reproduces, so no dense mask exists outside the tests.

Slices cover disjoint cells (a cell covered twice would enter the softmax twice), so a mask's
visible cells are the sum of its slices' cells, each counted in closed form.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

UNBOUNDED = 1 << 60


def band(causal: bool, window) -> tuple[int, int]:
    """The visible key-minus-query position offsets [lo, hi] of a mask; +-UNBOUNDED when open.

    ``window=W`` (an int, causal): W keys including the query itself (transformers'
    ``sliding_window``); ``window=(left, right)`` (non-causal): i - left <= j <= i + right."""
    if window is None:
        return (-UNBOUNDED, 0) if causal else (-UNBOUNDED, UNBOUNDED)
    if causal:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"window={window!r} with causal=True must be an int W >= 1: each query sees the W keys "
                f"ending at itself (transformers' sliding_window); for local non-causal attention pass "
                f"causal=False and window=(left, right)"
            )
        return -(window - 1), 0
    if not (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in window)
    ):
        raise ValueError(
            f"window={window!r} with causal=False must be (left, right), two ints >= 0: query i sees "
            f"keys i - left .. i + right (flash-attn's window_size); for a causal sliding window pass "
            f"causal=True and window=W"
        )
    return -window[0], window[1]


class MaskSlice(NamedTuple):
    """Query rows [q_start, q_end) see key rows [k_start, k_end) where lo <= key - query <= hi."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    lo: int | None
    hi: int | None

    def offsets(self) -> tuple[int, int]:
        """(lo, hi) as ints, +-UNBOUNDED where open (what `layouts._chunk_pair` takes)."""
        return (-UNBOUNDED if self.lo is None else self.lo), (UNBOUNDED if self.hi is None else self.hi)


def band_cells(q_start: int, q_end: int, k_start: int, k_end: int, lo: int, hi: int) -> int:
    """Cells (i, j) of the rectangle with lo <= j - i <= hi, in closed form (no loop over rows).

    On diagonal d = j - i the rectangle holds f(d) = min(c, d + P, Q - d) cells, with
    c = min(rows, cols), P = q_end - k_start, Q = k_end - q_start: f rises by one per diagonal up
    to c, stays there, falls by one; summed over the clipped diagonals as arithmetic series."""
    a, b = max(lo, k_start - q_end + 1), min(hi, k_end - 1 - q_start)
    if a > b or q_start >= q_end or k_start >= k_end:
        return 0
    c = min(q_end - q_start, k_end - k_start)
    p, q = q_end - k_start, k_end - q_start
    total = 0
    for lo_d, hi_d, slope, offset in (
        (a, min(b, c - p - 1), 1, p),
        (max(a, c - p), min(b, q - c), 0, c),
        (max(a, q - c + 1), b, -1, q),
    ):
        if lo_d <= hi_d:
            count = hi_d - lo_d + 1
            total += offset * count + slope * (lo_d + hi_d) * count // 2
    return total


def _trim(s: MaskSlice) -> MaskSlice | None:
    """The slice cut to the rows and keys its band reaches, its band None where the rectangle
    bounds it anyway (one canonical form per cell set: equal masks compare equal); None if empty."""
    lo, hi = s.offsets()
    i0, i1 = max(s.q_start, s.k_start - hi), min(s.q_end - 1, s.k_end - 1 - lo)
    if i0 > i1 or lo > hi:
        return None
    j0, j1 = max(s.k_start, i0 + lo), min(s.k_end - 1, i1 + hi)
    return MaskSlice(i0, i1 + 1, j0, j1 + 1, None if lo <= j0 - i1 else lo, None if hi >= j1 - i0 else hi)


def _overlap(a: MaskSlice, b: MaskSlice) -> int:
    """Cells two slices share: their rectangles' intersection under both bands."""
    (alo, ahi), (blo, bhi) = a.offsets(), b.offsets()
    return band_cells(
        max(a.q_start, b.q_start),
        min(a.q_end, b.q_end),
        max(a.k_start, b.k_start),
        min(a.k_end, b.k_end),
        max(alo, blo),
        min(ahi, bhi),
    )


@dataclass(frozen=True)
class AttnMask:
    """Which keys each query sees, as disjoint range slices over the global rows of one sequence.

    Build one with `from_slices`, `documents`, `blocks`, `prefix_lm` or `shared_prefix`; it is an
    immutable, hashable value (plans are cached on it). A row that no slice covers sees no key.
    `slices` holds the canonical form: sorted, each cut to the cells its band reaches.

    Args:
        seq_len: Tokens in the row (every slice lies in [0, seq_len)).
        slices: The canonical `MaskSlice`s.
    """

    seq_len: int
    slices: tuple[MaskSlice, ...]
    longest: int = field(init=False, repr=False, compare=False)  # the widest query range, bounds `_rows`' scan
    error: ClassVar[type[Exception]] = ValueError  # hybrid-cp's AttnMask raises its ConfigError

    def __post_init__(self) -> None:
        object.__setattr__(self, "longest", max((s.q_end - s.q_start for s in self.slices), default=0))

    # ---- builders ---------------------------------------------------------------------------
    @classmethod
    def from_slices(cls, n: int, slices) -> AttnMask:
        """Any mask: slices ``(q_start, q_end, k_start, k_end, lo, hi)`` of disjoint cells.

        Args:
            n: Tokens in the row.
            slices: Query rows [q_start, q_end) see keys [k_start, k_end) where
                lo <= key - query <= hi (None: unbounded). Rectangles may overlap where their
                bands share no cell.

        Returns:
            The mask.

        Raises:
            ConfigError: (hybrid_cp.AttnMask; ValueError in topology) a malformed slice, one outside
                [0, n), or two slices sharing a (query, key) cell, named.
        """
        n = cls._count("n", n, minimum=1)
        checked = []
        for index, s in enumerate(list(slices)):
            checked.append(cls._slice(n, index, s))
        # ordered by rectangle, then band as ints (a None band compared with an int one would raise TypeError)
        trimmed = sorted(
            ((t, i) for i, s in enumerate(checked) if (t := _trim(s)) is not None),
            key=lambda ti: (ti[0][:4], ti[0].offsets(), ti[1]),
        )
        cls._disjoint(trimmed, checked)
        return cls(n, tuple(t for t, _ in trimmed))

    @classmethod
    def documents(cls, cu_seqlens, causal: bool = True, window=None, chunk_size: int | None = None) -> AttnMask:
        """Packed documents: each token sees only its own document (causal, windowed, chunked).

        Args:
            cu_seqlens: Document boundaries [0, len_0, len_0 + len_1, ..., total] (flash-attn's).
            causal: Each query sees the keys at or before it (else the whole document).
            window: As `hcp.attention`'s: an int W with causal=True (W keys ending at the query),
                (left, right) with causal=False.
            chunk_size: Llama 4's attention chunks: a query at document position i sees only
                keys j with j // chunk_size == i // chunk_size.

        Returns:
            The mask; ``documents([0, n])`` is plain causal attention.

        Raises:
            ConfigError: bad boundaries, window or chunk_size, named.
        """
        cu = cls._boundaries("cu_seqlens", cu_seqlens)
        try:
            lo, hi = band(causal, window)
        except ValueError as exc:
            raise cls.error(str(exc)) from None
        step = None if chunk_size is None else cls._count("chunk_size", chunk_size, minimum=1)
        slices = []
        for start, end in zip(cu, cu[1:]):
            cut = list(range(start, end, step)) + [end] if step else [start, end]
            slices += [MaskSlice(a, b, a, b, lo, hi) for a, b in zip(cut, cut[1:]) if a < b]
        return cls.from_slices(cu[-1], slices)

    @classmethod
    def blocks(cls, block_ids, causal: bool = True, window: int | None = None) -> AttnMask:
        """Bidirectional blocks in a causal row (image tokens in Gemma 3, PaliGemma, Gemma 4).

        Args:
            block_ids: One int per token. A contiguous run of one id > 0 is a block: its tokens
                see the whole block and everything before it. Tokens with id <= 0 are causal.
                (transformers' ``block_sequence_ids`` count from 0 with -1 for text: add 1.)
            causal: False makes the base mask bidirectional, so every token sees the whole row.
            window: With causal=True, Gemma 3's sliding layers: every token sees only keys
                j > i - window (transformers' AND of the window with causal OR block).

        Returns:
            The mask.

        Raises:
            ConfigError: a non-int id, or an id > 0 that recurs after a gap (one block per id).
        """
        ids = [cls._token_id(i, x) for i, x in enumerate(block_ids)]
        if not ids:
            raise cls.error("block_ids=[] is empty: pass one int per token of the row")
        if not causal:
            if window is not None:
                raise cls.error(f"window={window!r} with causal=False: blocks take a window only on a causal row")
            return cls.from_slices(len(ids), [(0, len(ids), 0, len(ids), None, None)])
        lo = None if window is None else -(cls._count("window", window, minimum=1) - 1)
        runs, seen = [], {}
        for i, x in enumerate(ids):
            if runs and (runs[-1][2] == x if x > 0 else runs[-1][2] <= 0):
                runs[-1][1] = i + 1
                continue
            if x > 0 and x in seen:
                raise cls.error(
                    f"block_ids: id {x} starts a second block at token {i} (its first run starts at "
                    f"token {seen[x]}); give every contiguous block its own id"
                )
            seen.setdefault(x, i)
            runs.append([i, i + 1, x])
        return cls.from_slices(len(ids), [(a, b, 0, b, lo, None if x > 0 else 0) for a, b, x in runs])

    @classmethod
    def prefix_lm(cls, cu_seqlens, prefix_lens) -> AttnMask:
        """Prefix-LM documents (PaliGemma, T5-style): the prefix is one bidirectional block, the
        rest of the document is causal and sees the whole prefix.

        Args:
            cu_seqlens: Document boundaries [0, len_0, ..., total].
            prefix_lens: One int per document, 0 <= prefix_len <= its length (0: plain causal).

        Returns:
            The mask.

        Raises:
            ConfigError: bad boundaries, a prefix count that differs from the documents', or a
                prefix longer than its document.
        """
        cu = cls._boundaries("cu_seqlens", cu_seqlens)
        prefixes = list(prefix_lens)
        if len(prefixes) != len(cu) - 1:
            raise cls.error(
                f"prefix_lens has {len(prefixes)} entries but cu_seqlens holds {len(cu) - 1} documents: "
                f"pass one prefix length per document"
            )
        slices = []
        for d, (start, end, p) in enumerate(zip(cu, cu[1:], prefixes)):
            p = cls._count(f"prefix_lens[{d}]", p, minimum=0)
            if p > end - start:
                raise cls.error(f"prefix_lens[{d}]={p} exceeds document {d}'s length {end - start}")
            slices += [(start, start + p, start, start + p, None, None), (start + p, end, start, end, None, 0)]
        return cls.from_slices(cu[-1], [s for s in slices if s[0] < s[1]])

    @classmethod
    def shared_prefix(cls, prompt_len: int, completion_lens) -> AttnMask:
        """One prompt and its completions in one row (GRPO groups, tree packing): the prompt is
        causal; each completion sees the whole prompt and itself causally, never another completion.

        Args:
            prompt_len: Tokens of the prompt (the row starts with it), >= 1.
            completion_lens: Tokens of each completion, in row order, each >= 1.

        Returns:
            The mask over prompt_len + sum(completion_lens) tokens.

        Raises:
            ConfigError: a length that is not a positive int, named.
        """
        p = cls._count("prompt_len", prompt_len, minimum=1)
        lens = [cls._count(f"completion_lens[{t}]", n, minimum=1) for t, n in enumerate(completion_lens)]
        slices, start = [(0, p, 0, p, None, 0)], p
        for n in lens:
            slices += [(start, start + n, 0, p, None, None), (start, start + n, start, start + n, None, 0)]
            start += n
        return cls.from_slices(start, slices)

    def within(self, lo: int | None, hi: int | None) -> AttnMask:
        """The mask with every slice's band narrowed to lo <= key - query <= hi (None: no bound): a
        sliding window on top of any mask (`hcp.attention(..., mask=m, window=W)` is
        ``m.within(-(W - 1), 0)``; window=(left, right) is ``m.within(-left, right)``)."""

        def tighter(a, b, pick):
            return a if b is None else b if a is None else pick(a, b)

        slices = [
            t
            for s in self.slices
            if (t := _trim(s._replace(lo=tighter(s.lo, lo, max), hi=tighter(s.hi, hi, min)))) is not None
        ]
        return type(self)(self.seq_len, tuple(sorted(slices, key=lambda t: (t[:4], t.offsets()))))

    def windowed(self, window) -> AttnMask:
        """The mask narrowed by an `hcp.attention` window (None: unchanged): an int W drops the keys more
        than W - 1 before each query (lo = -(W - 1); the mask keeps deciding what lies after it, so on a
        causal mask these are the W keys ending at the query, and a bidirectional image block keeps its
        later keys: transformers' sliding_window_overlay); (left, right) keeps the keys i - left .. i + right
        (`within`)."""
        if window is None:
            return self
        if isinstance(window, int) and not isinstance(window, bool):
            if window < 1:
                raise self.error(
                    f"window={window!r} must be an int W >= 1 (each query keeps the keys from W - 1 "
                    f"before it on) or (left, right)"
                )
            return self.within(-(window - 1), None)
        try:
            lo, hi = band(False, window)
        except ValueError as exc:
            raise self.error(
                f"{exc} (with a mask, an int W keeps the keys from W - 1 before each query on, "
                f"(left, right) the keys i - left .. i + right, inside the mask)"
            ) from None
        return self.within(lo, hi)

    # ---- queries the planner asks -----------------------------------------------------------
    def cells(self) -> int:
        """Visible (query, key) cells of the whole row."""
        return sum(band_cells(s.q_start, s.q_end, s.k_start, s.k_end, *s.offsets()) for s in self.slices)

    def clip(self, q_start: int, q_end: int, k_start: int = 0, k_end: int | None = None) -> tuple[MaskSlice, ...]:
        """The slices cut to the rectangle [q_start, q_end) x [k_start, k_end), canonical, in order:
        what a (query run, key run) pair of a plan computes."""
        k_end = self.seq_len if k_end is None else k_end
        out = []
        for s in self._rows(q_start, q_end):
            cut = _trim(
                MaskSlice(
                    max(s.q_start, q_start),
                    min(s.q_end, q_end),
                    max(s.k_start, k_start),
                    min(s.k_end, k_end),
                    s.lo,
                    s.hi,
                )
            )
            if cut is not None:
                out.append(cut)
        return tuple(out)

    def count(self, q_start: int, q_end: int, k_start: int = 0, k_end: int | None = None) -> int:
        """Visible cells in the rectangle [q_start, q_end) x [k_start, k_end), exact, closed form."""
        return sum(
            band_cells(s.q_start, s.q_end, s.k_start, s.k_end, *s.offsets())
            for s in self.clip(q_start, q_end, k_start, k_end)
        )

    def visible_keys(self, q_start: int, q_end: int) -> tuple[tuple[int, int], ...]:
        """Merged [start, end) key ranges that some query of [q_start, q_end) sees (every key of a
        range is seen by at least one of those queries)."""
        ranges = sorted((s.k_start, s.k_end) for s in self.clip(q_start, q_end))
        merged: list[list[int]] = []
        for a, b in ranges:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return tuple((a, b) for a, b in merged)

    def components(self) -> tuple[tuple[int, int], ...]:
        """Maximal [start, end) row ranges that no slice crosses (a query and every key it sees lie
        in one): the units a balancer may place apart without splitting attention."""
        spans = sorted((min(s.q_start, s.k_start), max(s.q_end, s.k_end)) for s in self.slices)
        out: list[list[int]] = []
        for a, b in spans:
            if out and a < out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return tuple((a, b) for a, b in out)

    def _rows(self, q_start: int, q_end: int):
        """Slices whose query range meets [q_start, q_end) (sorted by q_start; bounded scan)."""
        first = bisect_left(self.slices, (q_start - self.longest,))
        for s in self.slices[first:]:
            if s.q_start >= q_end:
                break
            if s.q_end > q_start:
                yield s

    # ---- validation -------------------------------------------------------------------------
    @classmethod
    def _count(cls, name: str, value, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise cls.error(f"{name}={value!r} must be an int >= {minimum}")
        return value

    @classmethod
    def _token_id(cls, index: int, value) -> int:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise cls.error(f"block_ids[{index}]={value!r} must be an int (a block id > 0, or <= 0 for causal text)")
        return int(value)

    @classmethod
    def _boundaries(cls, name: str, cu) -> list[int]:
        try:
            values = [int(x) for x in cu]
        except (TypeError, ValueError):
            raise cls.error(f"{name}={cu!r} must be a sequence of ints [0, len_0, len_0 + len_1, ..., total]") from None
        if len(values) < 2 or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] < 1:
            shown = f"{values[:8]}{'...' if len(values) > 8 else ''}"
            raise cls.error(
                f"{name}={shown} must start at 0, never decrease and end at the row's length >= 1 "
                f"(flash-attn's cumulative document boundaries)"
            )
        return values

    @classmethod
    def _slice(cls, n: int, index: int, s) -> MaskSlice:
        """One user slice checked: six fields, ints in range, lo <= hi."""
        if not isinstance(s, (tuple, list)) or len(s) != 6:
            raise cls.error(f"slices[{index}]={s!r} must be (q_start, q_end, k_start, k_end, lo, hi)")
        names = MaskSlice._fields
        for name, value in zip(names, s):
            optional = name in ("lo", "hi")
            if not (optional and value is None) and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise cls.error(f"slices[{index}].{name}={value!r} must be an int{' or None' if optional else ''}")
        qa, qb, ka, kb, lo, hi = (None if v is None else int(v) for v in s)
        if not (0 <= qa < qb <= n and 0 <= ka < kb <= n):
            raise cls.error(
                f"slices[{index}]={tuple(s)!r}: need 0 <= q_start < q_end <= n and 0 <= k_start < k_end <= n with n={n}"
            )
        if lo is not None and hi is not None and lo > hi:
            raise cls.error(f"slices[{index}]={tuple(s)!r}: lo={lo} > hi={hi} leaves no visible key; drop the slice")
        return MaskSlice(qa, qb, ka, kb, lo, hi)

    @classmethod
    def _disjoint(cls, trimmed: list[tuple[MaskSlice, int]], given: list[MaskSlice]) -> None:
        """Raise on the first two slices that share a cell (a sweep over query ranges)."""
        active: list[tuple[MaskSlice, int]] = []
        for s, i in trimmed:
            active = [(t, j) for t, j in active if t.q_end > s.q_start]
            for t, j in active:
                if _overlap(s, t):
                    a, b = sorted((i, j))
                    raise cls.error(
                        f"slices[{a}]={tuple(given[a])!r} and slices[{b}]={tuple(given[b])!r} share "
                        f"{_overlap(s, t)} (query, key) cells; a cell may be covered once (it would "
                        f"enter the softmax twice): cut one slice's range or band"
                    )
            active.append((s, i))


__all__ = ["UNBOUNDED", "band", "MaskSlice", "AttnMask", "band_cells"]
