"""The ring engine: one loop for every layout and mask, forward and backward.

Each ring rank keeps its query block and streams (un-expanded) K/V blocks around the ring; the
next exchange is posted before the current block is computed. Partial results merge with an
online softmax in fp32. Backward recomputes every block with the final out/lse; dK/dV
accumulate in fp32 buffers that travel the ring with K/V and arrive home after r hops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .comm import RingExchange
from .layout import padded_length, ring_block_positions

if TYPE_CHECKING:
    from .kernels import AttentionKernel
    from .mesh import CPMesh


@dataclass
class BlockTask:
    """Which rows of my queries meet which keys of the visiting block, and with what mask."""

    q_rows: slice
    k_rows: slice | torch.Tensor   # a slice, or an index of valid (non-pad) keys
    causal: bool


def schedule(layout: str, ulysses: int, ring: int, ring_rank: int, step: int, causal: bool, padded_len: int,
             seq_len: int, device: torch.device | str | None = None) -> BlockTask | None:
    """The work of ring step `step` for this rank, or None if the visiting block is invisible.

    zigzag causal: step 0 is causal on my own [chunk j ; chunk 2r-1-j]; a block from a lower
    ring rank is seen by both query halves through its first half only; a block from a higher
    rank is seen by my second query half only, entirely. Every step costs the same.
    """
    r, j = ring, ring_rank
    src = (j - step) % r
    full = slice(None)
    if not causal:
        if seq_len == padded_len:
            return BlockTask(full, full, False)
        pos = ring_block_positions(padded_len, layout, ulysses, r, src, device=device)
        valid = torch.nonzero(pos < seq_len).flatten()
        if valid.numel() == 0:
            return None
        if valid.numel() == pos.numel():
            return BlockTask(full, full, False)
        return BlockTask(full, valid, False)
    # Causal: pad tokens come after every real token, so the causal mask already hides them.
    if src == j:
        return BlockTask(full, full, True)
    if layout == "contiguous":
        return BlockTask(full, full, False) if src < j else None
    half = padded_len // (2 * r)
    if src < j:
        return BlockTask(full, slice(0, half), False)
    return BlockTask(slice(half, None), full, False)


def block_work(layout: str, ulysses: int, ring: int, seq_len: int, causal: bool = True) -> list[list[int]]:
    """Score-matrix entries each ring rank evaluates at each step (per batch and head), counted
    from the same schedule the engine runs; a balanced layout has equal entries in every row."""
    n = padded_length(seq_len, layout, ulysses, ring)
    block = n // ring
    work = []
    for j in range(ring):
        row = []
        for step in range(ring):
            t = schedule(layout, ulysses, ring, j, step, causal, n, seq_len)
            if t is None:
                row.append(0)
                continue
            rows = len(range(block)[t.q_rows])
            cols = len(range(block)[t.k_rows]) if isinstance(t.k_rows, slice) else t.k_rows.numel()
            row.append(rows * (rows + 1) // 2 if t.causal else rows * cols)
        work.append(row)
    return work


def _take_keys(x: torch.Tensor, rows) -> torch.Tensor:
    return x[:, rows] if isinstance(rows, slice) else x.index_select(1, rows)


class _HeadMap:
    """Maps local query heads to local KV heads for the kernel.

    Kernels take contiguous GQA groups; when an uneven head split gives a rank a ragged group
    (e.g. 3 query heads over 2 KV heads) the visiting KV block is expanded for the kernel call
    only, and the gradient is summed back. The ring still streams un-expanded KV.
    """

    def __init__(self, kv_index: list[int], kv_heads: int, device: torch.device):
        hq = len(kv_index)
        uniform = hq % kv_heads == 0 and kv_index == [h // (hq // kv_heads) for h in range(hq)]
        self.index = None if uniform else torch.tensor(kv_index, device=device)
        self.kv_heads = kv_heads

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is None else x.index_select(2, self.index)

    def reduce(self, g: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return g
        out = g.new_zeros(*g.shape[:2], self.kv_heads, g.shape[3])
        return out.index_add_(2, self.index, g)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (out, lse) into the running fp32 (out, lse), in place.

    out [B, S, H, D], lse [B, H, S]. Rows that have seen no key (lse = -inf on both sides) stay
    at out = 0, lse = -inf instead of becoming NaN.
    """
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_new)
    lse.copy_(new)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def ring_forward(cp: "CPMesh", kernel: "AttentionKernel", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_index: list[int], *, causal: bool, scale: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] (this ring rank's block) -> (out in q.dtype, lse fp32)."""
    r = cp.ring_size
    b, n, hq, d = q.shape
    padded_len = n * r
    heads = _HeadMap(kv_index, k.shape[2], q.device)
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(b, n, hq, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)
    kv = torch.empty(2, 2, *k.shape, dtype=k.dtype, device=k.device)  # double buffer of fused K/V
    kv[0, 0].copy_(k)
    kv[0, 1].copy_(v)
    exchange = RingExchange(cp, cp.ring_group, "ring_fwd")
    for step in range(r):
        cur = kv[step % 2]
        works = exchange.start(cur, kv[(step + 1) % 2]) if step < r - 1 else None
        task = schedule(cp.layout, cp.ulysses_size, r, cp.ring_rank, step, causal, padded_len, seq_len, q.device)
        if task is not None:
            kb, vb = (heads.expand(_take_keys(x, task.k_rows)) for x in (cur[0], cur[1]))
            o_b, lse_b = kernel.forward(q[:, task.q_rows], kb, vb, causal=task.causal, scale=scale)
            merge_(out[:, task.q_rows], lse[:, :, task.q_rows], o_b, lse_b.to(acc))
        exchange.wait(works)
    return out.to(q.dtype), lse


def _add_rows_(target: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        target[:, rows].add_(value)
    else:
        target.index_add_(1, rows, value.to(target.dtype))


def ring_backward(cp: "CPMesh", kernel: "AttentionKernel", dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kv_index: list[int], *, causal: bool,
                  scale: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `ring_forward` for this ring rank's block (dq, dk, dv in the inputs' dtypes)."""
    r = cp.ring_size
    n = q.shape[1]
    padded_len = n * r
    heads = _HeadMap(kv_index, k.shape[2], q.device)
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.empty(2, 2, *k.shape, dtype=k.dtype, device=k.device)
    kv[0, 0].copy_(k)
    kv[0, 1].copy_(v)
    dkv = torch.zeros(2, 2, *k.shape, dtype=acc, device=k.device)  # travelling fp32 dK/dV
    kv_exchange = RingExchange(cp, cp.ring_group_bwd, "ring_bwd")
    dkv_exchange = RingExchange(cp, cp.ring_group_bwd, "ring_bwd")
    dkv_works = None
    for step in range(r):
        cur = kv[step % 2]
        kv_works = kv_exchange.start(cur, kv[(step + 1) % 2]) if step < r - 1 else None
        task = schedule(cp.layout, cp.ulysses_size, r, cp.ring_rank, step, causal, padded_len, seq_len, q.device)
        grads = None
        if task is not None:
            rows = task.q_rows
            kb, vb = (heads.expand(_take_keys(x, task.k_rows)) for x in (cur[0], cur[1]))
            dq_b, dk_b, dv_b = kernel.backward(dout[:, rows], q[:, rows], kb, vb, out[:, rows],
                                               lse[:, :, rows], causal=task.causal, scale=scale)
            dq[:, rows].add_(dq_b)
            grads = (heads.reduce(dk_b), heads.reduce(dv_b))
        dkv_exchange.wait(dkv_works)  # my travelling buffer for this block has arrived
        mine = dkv[step % 2]
        if grads is not None:
            _add_rows_(mine[0], task.k_rows, grads[0])
            _add_rows_(mine[1], task.k_rows, grads[1])
        if r > 1:
            dkv_works = dkv_exchange.start(mine, dkv[(step + 1) % 2])
        kv_exchange.wait(kv_works)
    dkv_exchange.wait(dkv_works)
    home = dkv[r % 2] if r > 1 else dkv[0]
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)
