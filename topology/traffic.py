"""Traffic: the bytes each rank sends for one attention call, and how long transfers take on the links.

:func:`comm_bytes` gives exact bytes per stage with the formulas the engine's own byte counter is tested
against (uneven heads, GQA replication, zigzag padding, halo exchange under masks); the helpers below turn
bytes into seconds over a cluster's link tiers (latency-bandwidth per tier, contention when several groups
exchange at once).
"""

from __future__ import annotations

from typing import Any

from .cluster import Cluster
from .heads import head_split
from .layouts import layout_of
from .mask_layout import mask_layout
from .units import FP32_BYTES, check_counts

__all__ = [
    "GRAD_BYTES",
    "grad_bytes",
    "a2a_peer_bytes",
    "comm_bytes",
    "bandwidth",
    "a2a_time",
    "ring_tier",
    "whole_block_bytes",
]

GRAD_BYTES = FP32_BYTES  # dK/dV travel the ring in fp32 (the engine's default: gradients accumulate in fp32)


def grad_bytes(dtype_bytes: int) -> int:
    """Bytes of one accumulated gradient element: fp32, or fp64 for fp64 inputs (the engine's acc_dtype)."""
    return max(GRAD_BYTES, dtype_bytes)


def a2a_peer_bytes(split: list[tuple[int, int, int, int]], i: int, p: int, unit: int, unit_v: int) -> tuple[int, int]:
    """Bytes rank ``i`` sends to peer ``p`` in the forward and backward all-to-alls (``unit``: one head of
    q/k for S tokens, ``unit_v``: one head of v, which may be narrower).

    Forward: p's query heads and the KV heads p needs for our S tokens (fused QKV), then our heads'
    output (v's width) for p's tokens. Backward: dO of p's heads, then dQ/dK/dV of our heads for p's tokens.
    """
    c_i, k_i = split[i][0], split[i][3]
    c_p, k_p = split[p][0], split[p][3]
    return unit * (c_p + k_p) + unit_v * (k_p + c_i), unit_v * (c_p + k_i) + unit * (c_i + k_i)


def comm_bytes(  # noqa: PLR0913 (public entry point)
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch: int,
    ulysses: int,
    ring: int,
    dtype_bytes: int,
    layout: str = "zigzag",
    ulysses_rank: int | None = None,
    cu_seqlens: Any = None,
    causal: bool = True,
    window: Any = None,
    ring_rank: int | None = None,
    v_head_dim: int | None = None,
    chunk_size: int | None = None,
    mask: Any = None,
) -> dict[str, int]:
    """Bytes one rank sends to other ranks for one attention call (one layer), by stage.

    Keys ``ulysses_fwd``, ``ulysses_bwd``, ``ring_fwd``, ``ring_bwd``. With ``ulysses_rank=None`` each
    value is the maximum over ulysses ranks (taken per key). These are the formulas the engine's
    byte counter must satisfy exactly; see docs/planner.md for the derivation. For a packed row pass
    the documents' boundaries as ``cu_seqlens`` (``seq_len`` is then their total): the packed layout's
    padding decides the local length, the formulas are the same. When the layout's halo rule
    (`Layout.halo`: what other ranks' queries can see fits one block) holds, under any mask (packed
    rows of whole documents, a sliding ``window``, attention chunks ``chunk_size``), a rank sends each
    ring peer only the K/V rows that peer reads, and gets back their fp32 gradients; the ring values
    then depend on the ring rank (``ring_rank=None``: the maximum over ring ranks). With ``mask`` (an
    `AttnMask`, which replaces ``layout``, ``cu_seqlens``, ``causal`` and ``chunk_size``; a ``window``
    narrows it as `hcp.attention`'s does) the row is the mask's balanced layout (`mask_layout.MaskBalanced`).

    Args:
        heads: Query heads.
        kv_heads: Key/value heads.
        head_dim: q/k head dim.
        seq_len: Tokens per sequence (a packed row's total).
        batch: Sequences.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dtype_bytes: Bytes per element.
        layout: "zigzag" or "contiguous".
        ulysses_rank: One ulysses rank; None: the maximum over them.
        cu_seqlens: Packed documents' boundaries.
        causal: Causal attention.
        window: A sliding window (int, or (left, right) non-causal).
        ring_rank: One ring rank; None: the maximum over them.
        v_head_dim: v's head dim when it differs from `head_dim` (MLA); None: the same.
        chunk_size: Attention chunk size.
        mask: The row's attention mask (`topology.masks.AttnMask`); `seq_len` must be its length.

    Returns:
        Bytes by stage: "ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd".
    """
    check_counts(heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, batch=batch,
                ulysses=ulysses, ring=ring, dtype_bytes=dtype_bytes)  # fmt: skip
    split = head_split(heads, kv_heads, ulysses)
    lay, visible = _row(layout, ulysses, ring, seq_len, cu_seqlens, mask, (causal, window, chunk_size))
    s = lay.local_len
    dv = head_dim if v_head_dim is None else v_head_dim
    unit, unit_v = batch * s * head_dim * dtype_bytes, batch * s * dv * dtype_bytes
    halo = lay.halo(*visible)
    ring_ranks = range(ring) if ring_rank is None else [ring_rank]
    ranks = range(ulysses) if ulysses_rank is None else [ulysses_rank]
    if ulysses_rank is not None and not 0 <= ulysses_rank < ulysses:
        raise ValueError(f"ulysses_rank={ulysses_rank} must be in [0, {ulysses}) or None for the maximum")
    out = {"ulysses_fwd": 0, "ulysses_bwd": 0, "ring_fwd": 0, "ring_bwd": 0}
    for i in ranks:
        fwd, bwd = _a2a_bytes(split, i, unit, unit_v)
        row = batch * split[i][3] * (head_dim + dv)  # K/V elements of one token row
        ring_fwd, ring_bwd = _ring_bytes(lay, visible, halo, ring_ranks, ulysses, ring, row, dtype_bytes)
        for key, val in (("ulysses_fwd", fwd), ("ulysses_bwd", bwd), ("ring_fwd", ring_fwd), ("ring_bwd", ring_bwd)):
            out[key] = max(out[key], val)
    return out


def _a2a_bytes(split: list[tuple[int, int, int, int]], i: int, unit: int, unit_v: int) -> tuple[int, int]:
    """Ulysses rank ``i``'s forward and backward all-to-all bytes: `a2a_peer_bytes` summed over its peers."""
    fwd = bwd = 0
    for p in range(len(split)):
        if p != i:
            f, b = a2a_peer_bytes(split, i, p, unit, unit_v)
            fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def _ring_bytes(
    lay: Any, visible: tuple, halo: bool, ring_ranks: Any, ulysses: int, ring: int, row: int, dtype_bytes: int
) -> tuple[int, int]:
    """`comm_bytes`'s ring bytes (forward, backward) for K/V rows of ``row`` elements: halo rows, else whole blocks."""
    if halo:  # rows my peers read from me go out; gradients of rows I read go back

        def sent(j: int) -> tuple[int, int]:
            out_rows = sum(n for st in range(1, ring) for _, n in lay.needed_rows((j + st) % ring, st, *visible))
            back_rows = sum(n for st in range(1, ring) for _, n in lay.needed_rows(j, st, *visible))
            return out_rows * row * dtype_bytes, back_rows * row * grad_bytes(dtype_bytes)

        ring_fwd, ring_bwd = (max(v) for v in zip(*(sent(j) for j in ring_ranks)))
        return ring_fwd, ring_bwd
    return whole_block_bytes((ulysses * lay.local_len) * row, ring, dtype_bytes)


def whole_block_bytes(kv_block: int, ring: int, dtype_bytes: int) -> tuple[int, int]:
    """Ring bytes (forward, backward) of whole K/V blocks of `kv_block` elements streamed around the ring: r - 1
    blocks forward; backward those again and the r blocks' gradients coming home (0 without a ring)."""
    if ring == 1:
        return 0, 0
    fwd = (ring - 1) * kv_block * dtype_bytes
    return fwd, fwd + ring * kv_block * grad_bytes(dtype_bytes)


def _row(
    layout: str,
    ulysses: int,
    ring: int,
    seq_len: int,
    cu_seqlens: Any,
    mask: Any,  # noqa: PLR0913
    attention: tuple,
) -> tuple[Any, tuple]:
    """The row's layout and what `Layout.tasks` reads after the ranks: (causal, window, chunk_size, mask)."""
    causal, window, chunk_size = attention
    if mask is not None:
        lay = mask_layout(mask, ulysses, ring)
        if lay.seq_len != seq_len:
            raise ValueError(f"the mask's row has {lay.seq_len} tokens but seq_len={seq_len}; pass mask.seq_len")
        return lay, (False, None, None, mask.windowed(window))
    lay = layout_of(layout, ulysses, ring, seq_len=seq_len, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None and lay.seq_len != seq_len:
        raise ValueError(f"cu_seqlens ends at {lay.seq_len} but seq_len={seq_len}; pass the packed row's total")
    return lay, (causal, lay.effective_window(causal, window), chunk_size, None)


def bandwidth(link: Any, concurrent: bool) -> float:
    """Bytes/s of ``link``; divided by its measured contention when several groups exchange at once."""
    return link.bandwidth_gb_s * 1e9 / (link.contention if concurrent else 1.0)


def a2a_time(
    cluster: Cluster, groups: list[list[int]], split: list, unit: int, backward: bool = True
) -> tuple[float, str]:
    """Slowest rank's forward + backward all-to-all time over all groups, and the slowest tier used.

    Bytes to peers on different tiers travel concurrently on different links, so a rank's time is the
    max over tiers of bytes/bandwidth, plus one latency of the slowest tier per collective (2 forward,
    2 backward). Groups whose placement repeats (same offset inside a domain) are priced once. When
    more than one group exchanges at once, each link's ``contention`` divides its bandwidth.
    """
    concurrent = sum(1 for g in groups if len(g) > 1) > 1
    dom = cluster.domain_size
    seen: set[int] = set()
    worst, worst_tier = 0.0, -1
    for g in groups:
        key = g[0] % dom
        if key in seen or len(g) < 2:
            continue
        seen.add(key)
        for i in range(len(g)):
            per_tier: dict[int, list[int]] = {}
            for p in range(len(g)):
                if p != i:
                    t = cluster.tier(g[i], g[p])
                    f, b = a2a_peer_bytes(split, i, p, unit, unit)  # the planner's models: one head dim
                    acc = per_tier.setdefault(t, [0, 0])
                    acc[0] += f
                    acc[1] += b
            lat = max(cluster.tier_link(t).latency_us for t in per_tier) * 1e-6
            fwd = max(v[0] / bandwidth(cluster.tier_link(t), concurrent) for t, v in per_tier.items())
            bwd = max(v[1] / bandwidth(cluster.tier_link(t), concurrent) for t, v in per_tier.items())
            total = fwd + 2 * lat + ((bwd + 2 * lat) if backward else 0.0)
            if total > worst:
                worst = total
            worst_tier = max(worst_tier, max(per_tier))
    return worst, cluster.tier_name(worst_tier)


def ring_tier(cluster: Cluster, groups: list[list[int]]) -> int:
    """Slowest neighbour hop over all ring groups (a ring step waits for its slowest hop)."""
    dom = cluster.domain_size
    seen: set[int] = set()
    worst = -1
    for g in groups:
        if len(g) < 2 or g[0] % dom in seen:
            continue
        seen.add(g[0] % dom)
        worst = max(worst, max(cluster.tier(g[k], g[(k + 1) % len(g)]) for k in range(len(g))))
    return worst
