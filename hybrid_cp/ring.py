"""The ring engine: one loop for every layout and mask, forward and backward.

Each ring rank keeps its query block and streams (un-expanded) K/V blocks around the ring; the
next exchange is posted before the current block is computed. What each step computes comes from
the call's block plan (`block_plan`), built once from the layout and reused by forward and
backward: no layout names, no device syncs and no index searches inside the loop. Partial results
merge with an online softmax in fp32. Backward recomputes every block with the final out/lse;
dK/dV accumulate in fp32 buffers that travel the ring with K/V and arrive home after r hops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from topology.layouts import Layout, Step

from .comm import RingExchange
from .heads import HeadMap

if TYPE_CHECKING:
    from .kernels import AttentionKernel
    from .mesh import CPMesh

Rows = slice | torch.Tensor


@dataclass(frozen=True)
class Task:
    """One kernel call: my query rows against rows of the visiting key block. With several
    (query, key) segment pairs the rows are their concatenation and `varlen` holds the kernel's
    cu_seqlens_q/k and max_seqlen_q/k (flash-attn's varlen naming)."""

    q_rows: Rows
    k_rows: Rows
    causal: bool
    varlen: dict | None = None


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> Rows:
    """A slice when the ranges are back to back, else an index tensor."""
    if all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][0] + ranges[-1][1])
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in ranges])


def _task(step: Step, device: torch.device) -> Task:
    q = [(a, n) for a, n, _, _ in step.pairs]
    k = [(a, n) for _, _, a, n in step.pairs]
    varlen = None
    if len(step.pairs) > 1:
        def cu(ranges):
            out = [0]
            for _, n in ranges:
                out.append(out[-1] + n)
            return torch.tensor(out, dtype=torch.int32, device=device)
        varlen = dict(cu_seqlens_q=cu(q), cu_seqlens_k=cu(k), max_seqlen_q=max(n for _, n in q),
                      max_seqlen_k=max(n for _, n in k))
    return Task(_rows(q, device), _rows(k, device), step.causal, varlen)


_PLANS: dict = {}


def block_plan(lay: Layout, ring_rank: int, causal: bool, device: torch.device) -> list[Task | None]:
    """The task of each ring step for this rank (None: the visiting block is invisible), cached
    per (layout, rank, mask, device) since every layer of a model asks for the same plan."""
    key = (lay, ring_rank, causal, str(device))
    if key not in _PLANS:
        steps = [lay.step(ring_rank, s, causal) for s in range(lay.ring)]
        _PLANS[key] = [None if st is None else _task(st, device) for st in steps]
    return _PLANS[key]


def _take(x: torch.Tensor, rows: Rows, dim: int = 1) -> torch.Tensor:
    return x[(slice(None),) * dim + (rows,)] if isinstance(rows, slice) else x.index_select(dim, rows)


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


def _merge_rows_(out: torch.Tensor, lse: torch.Tensor, rows: Rows, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    if isinstance(rows, slice):
        merge_(out[:, rows], lse[:, :, rows], block_out, block_lse)
        return
    o, l = out.index_select(1, rows), lse.index_select(2, rows)
    merge_(o, l, block_out, block_lse)
    out.index_copy_(1, rows, o)
    lse.index_copy_(2, rows, l)


def _add_rows_(target: torch.Tensor, rows: Rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        target[:, rows].add_(value)
    else:
        target.index_add_(1, rows, value.to(target.dtype))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kv_buffers(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    kv = torch.empty(2, 2, *k.shape, dtype=k.dtype, device=k.device)  # double buffer of fused K/V
    kv[0, 0].copy_(k)
    kv[0, 1].copy_(v)
    return kv


def ring_forward(cp: "CPMesh", kernel: "AttentionKernel", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_index: list[int], plan: list[Task | None], *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] (this ring rank's block) -> (out in q.dtype, lse fp32)."""
    r = cp.ring_size
    b, n, hq, d = q.shape
    heads = HeadMap(kv_index, k.shape[2], q.device)
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(b, n, hq, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)
    kv = _kv_buffers(k, v)
    exchange = RingExchange(cp, cp.ring_group, "ring_fwd")
    for step, task in enumerate(plan):
        cur = kv[step % 2]
        works = exchange.start(cur, kv[(step + 1) % 2]) if step < r - 1 else None
        if task is not None:
            kb, vb = (heads.expand(_take(x, task.k_rows)) for x in (cur[0], cur[1]))
            o_b, lse_b = kernel.forward(_take(q, task.q_rows), kb, vb, causal=task.causal, scale=scale,
                                        **(task.varlen or {}))
            _merge_rows_(out, lse, task.q_rows, o_b, lse_b.to(acc))
        exchange.wait(works)
    return out.to(q.dtype), lse


def ring_backward(cp: "CPMesh", kernel: "AttentionKernel", dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kv_index: list[int],
                  plan: list[Task | None], *, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `ring_forward` for this ring rank's block (dq, dk, dv in the inputs' dtypes)."""
    r = cp.ring_size
    heads = HeadMap(kv_index, k.shape[2], q.device)
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = _kv_buffers(k, v)
    dkv = torch.zeros(2, 2, *k.shape, dtype=acc, device=k.device)  # travelling fp32 dK/dV
    kv_exchange = RingExchange(cp, cp.ring_group_bwd, "ring_bwd")
    dkv_exchange = RingExchange(cp, cp.ring_group_bwd, "ring_bwd")
    dkv_works = None
    for step, task in enumerate(plan):
        cur = kv[step % 2]
        kv_works = kv_exchange.start(cur, kv[(step + 1) % 2]) if step < r - 1 else None
        grads = None
        if task is not None:
            rows = task.q_rows
            kb, vb = (heads.expand(_take(x, task.k_rows)) for x in (cur[0], cur[1]))
            dq_b, dk_b, dv_b = kernel.backward(_take(dout, rows), _take(q, rows), kb, vb, _take(out, rows),
                                               _take(lse, rows, 2), causal=task.causal, scale=scale,
                                               **(task.varlen or {}))
            _add_rows_(dq, rows, dq_b)
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
