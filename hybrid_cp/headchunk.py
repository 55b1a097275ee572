"""Head-chunked hybrid attention (UPipe-style): the heads go through all-to-all -> ring -> all-to-all a
few at a time; with `OVERLAP` the all-to-all of chunk i + 1 runs while chunk i computes.

Why: with all heads at once the attention stage holds, per rank, the gathered query, output,
d(output) and fp32 d(query) of every local head for the ulysses group's whole sequence. Processing
`head_chunks` chunks one after another divides that working set by the number of chunks (the
"Untied Ulysses" paper, UPipe, arXiv 2602.21196: 87.5% less attention-stage memory at 8 chunks).
The paper's stages run one after another, as the default here does; with `OVERLAP = True` each
chunk's all-to-all is posted asynchronously before the previous chunk's ring attention runs (forward
and backward), so communication hides behind compute at the price of a second chunk's buffers.

Schedule, per rank (u = ulysses degree):
* Every rank's query heads (its part of the usual uneven head split) are cut into `head_chunks`
  consecutive pieces (sizes differ by at most one); chunk j is piece j of every rank. So a rank keeps
  the same KV heads in every chunk, and K/V go through the all-to-all ONCE, up front (GQA-aware:
  a KV head used by several chunks is not exchanged again), while Q and the output travel per chunk.
* Ring attention runs per chunk on the chunk's query heads and only the KV heads they use.
* Forward keeps this rank's local q (sequence layout), the exchanged K/V, the local output and each
  chunk's lse; backward re-exchanges q, output and d(output) per chunk (prefetching the next chunk's)
  instead of keeping every chunk's gathered tensors, accumulates dK/dV in fp32 and sends them home once.
  Traffic: the all-to-all sends q and the output once more in backward than `head_chunks=1`; the
  ring streams a KV head once per chunk that uses it (once in total when chunks align with GQA groups).

`head_chunks` larger than a rank's query heads is clamped (every rank needs a head in every chunk);
results equal `head_chunks=1` to fp32 round-off (heads are independent).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from topology.layouts import pieces as _pieces

from .comm import acc_dtype, comm_guard, count, pack_head_to_seq, unpack_head_to_seq_
from .heads import HeadSplit
from .layout import gathered_to_ring_block, ring_block_to_gathered
from .ring import ring_backward, ring_forward

if TYPE_CHECKING:
    from topology.layouts import Layout

    from .kernels import AttentionKernel
    from .mesh import CPMesh
    from .ring import Plan

Ranges = tuple[tuple[int, int], ...]

__all__ = ["HeadChunks", "chunk_heads", "chunked_attention"]


@dataclass(frozen=True)
class HeadChunks:
    """Chunk j: the query-head range of every ulysses rank (`q[j][p]`), and for this rank the range of
    its local KV heads the chunk uses (`kv_local[j]`, relative to its first KV head) with each chunk
    query head's index into that range (`kv_index[j]`)."""

    q: tuple[Ranges, ...]
    kv_local: tuple[tuple[int, int], ...]
    kv_index: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.q)


def chunk_heads(split: HeadSplit, head_chunks: int, rank: int) -> HeadChunks:
    """Cut every rank's query heads into min(head_chunks, fewest heads on a rank) chunks."""
    n = max(1, min(head_chunks, min(e - s for s, e in split.q)))
    per_rank = [_pieces(s, e, n) for s, e in split.q]
    group = split.heads // split.kv_heads
    ks = split.kv[rank][0]
    q, kv_local, kv_index = [], [], []
    for j in range(n):
        q.append(tuple(per_rank[p][j] for p in range(len(split.q))))
        qs, qe = per_rank[rank][j]
        lo, hi = qs // group - ks, (qe - 1) // group + 1 - ks
        kv_local.append((lo, hi))
        kv_index.append(tuple(h // group - ks - lo for h in range(qs, qe)))
    return HeadChunks(tuple(q), tuple(kv_local), tuple(kv_index))


class _InFlight:
    """An all-to-all posted with async_op=True; `wait()` returns what `finish` makes of the receive buffer
    (a lost peer raises hcp.CommTimeoutError, as everywhere in the engine)."""

    def __init__(self, work, keep: tuple, finish: Callable[[], object], cp: "CPMesh | None" = None):
        self.work, self.keep, self.finish, self.cp = work, keep, finish, cp

    def wait(self):
        if self.work is not None:
            start = time.perf_counter()
            with comm_guard(self.cp, "the head-chunk all-to-all"):
                self.work.wait()
            self.cp.chunk_wait_s += time.perf_counter() - start   # what the schedule left exposed
        self.keep = ()
        result, self.finish, self.work = self.finish(), None, None   # drop the receive buffer with the closure
        return result


def _post_seq_to_head(cp: "CPMesh", lay: "Layout", parts: list[torch.Tensor], ranges: list[Ranges],
                      stage: str) -> _InFlight:
    """Post [B, S, h_i, D] (sequence layout) -> [B, u*S, my heads of ranges[i], D] (ring-block order)."""
    u, me = cp.ulysses_size, cp.ulysses_rank
    if u == 1:
        out = [gathered_to_ring_block(x[:, :, r[0][0]:r[0][1]], lay) for x, r in zip(parts, ranges)]
        return _InFlight(None, (), lambda: out)
    b, s, _, d = parts[0].shape
    pieces = [torch.cat([x[:, :, r[p][0]:r[p][1]] for x, r in zip(parts, ranges)], dim=2).reshape(-1)
              for p in range(u)]
    send = torch.cat(pieces)
    send_sizes = [x.numel() for x in pieces]
    del pieces
    mine = [r[me][1] - r[me][0] for r in ranges]
    recv = send.new_empty(u * b * s * sum(mine) * d)
    count(cp, stage, (send.numel() - send_sizes[me]) * send.element_size())
    with comm_guard(cp, "the head-chunk all-to-all"):
        work = dist.all_to_all_single(recv, send, [b * s * sum(mine) * d] * u, send_sizes, group=cp.ulysses_group,
                                      async_op=True)

    def finish():
        full = recv.view(u, b, s, sum(mine), d).transpose(0, 1).reshape(b, u * s, sum(mine), d)
        return [gathered_to_ring_block(x, lay) for x in full.split(mine, dim=2)]

    return _InFlight(work, (send,), finish, cp)


def _post_head_to_seq(cp: "CPMesh", lay: "Layout", parts: list[torch.Tensor], ranges: list[Ranges],
                      targets: list[torch.Tensor], stage: str, accumulate: bool = False) -> _InFlight:
    """Post [B, u*S (ring-block order), my heads, D] -> write (or add, for replicated KV gradients) each
    rank's heads into targets[i] [B, S, heads, D] at ranges[i][p]."""
    u = cp.ulysses_size
    gathered = [ring_block_to_gathered(x, lay) for x in parts]
    if u == 1:
        def local(gathered=gathered):
            for x, r, t in zip(gathered, ranges, targets):
                view = t[:, :, r[0][0]:r[0][1]]
                view.add_(x) if accumulate else view.copy_(x)
            return targets
        return _InFlight(None, (), local)
    send, sizes_out, sizes_in = pack_head_to_seq(gathered, ranges, u)
    del gathered
    recv = send.new_empty(sum(sizes_in))
    count(cp, stage, (u - 1) * sizes_out[0] * send.element_size())
    with comm_guard(cp, "the head-chunk all-to-all"):
        work = dist.all_to_all_single(recv, send, sizes_in, sizes_out, group=cp.ulysses_group, async_op=True)

    def finish():
        unpack_head_to_seq_(recv, targets, ranges, sizes_in, accumulate)
        return targets

    return _InFlight(work, (send,), finish, cp)


def drive(order: list, post: Callable, compute: Callable, overlap: bool,
          finish: Callable | None = None) -> None:
    """Run pipeline stages in order: `post(stage)` sends a stage's inputs (an _InFlight), `compute(stage,
    received)` runs it and returns (the flights taking its results home, an item for `finish` or None),
    `finish(item)` uses results once they have landed. Overlapped: the next stage is posted before this one
    computes, and this stage's results travel while the next one computes (one stage's in flight);
    serial: each stage's results land before the next stage is posted."""
    flight, back, done = post(order[0]), [], None
    for at, stage in enumerate(order):
        got = [flight.wait()]
        nxt = order[at + 1] if at + 1 < len(order) else None
        if overlap and nxt is not None:
            flight = post(nxt)
        landed, item = compute(stage, got.pop())   # compute owns the received tensors and may free them early
        if overlap:
            for f in back:
                f.wait()
            if done is not None:
                finish(done)
            back, done = landed, item
        else:
            for f in landed:
                f.wait()
            if item is not None:
                finish(item)
            if nxt is not None:
                flight = post(nxt)
    for f in back:
        f.wait()
    if done is not None:
        finish(done)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, kernel, lay, split, chunks, plan, scale, overlap, want_lse):
        n = chunks.count
        kv_flight = _post_seq_to_head(cp, lay, [k, v], [split.kv, split.kv], "ulysses_fwd")
        out = q.new_empty(q.shape)
        lse_seq = torch.empty(q.shape[0], q.shape[1], q.shape[2], 1, dtype=torch.float32, device=q.device) \
            if want_lse else None
        lses, halos, kv = [], [], []

        def post(j):
            return _post_seq_to_head(cp, lay, [q], [chunks.q[j]], "ulysses_fwd")

        def compute(j, got):
            if not kv:
                kv.extend(kv_flight.wait())
            lo, hi = chunks.kv_local[j]
            out_h, lse_h, halo = ring_forward(cp, kernel, got.pop(), kv[0][:, :, lo:hi], kv[1][:, :, lo:hi],
                                              list(chunks.kv_index[j]), plan, scale=scale)
            lses.append(lse_h)
            halos.append(halo)
            landed = [_post_head_to_seq(cp, lay, [out_h], [chunks.q[j]], [out], "ulysses_fwd")]
            if want_lse:
                landed.append(_post_head_to_seq(cp, lay, [lse_h.transpose(1, 2).unsqueeze(-1).contiguous()],
                                                [chunks.q[j]], [lse_seq], "ulysses_lse"))
            return landed, None

        drive(list(range(n)), post, compute, overlap)
        kh, vh = kv
        ctx.save_for_backward(q, kh, vh, out, *lses)
        ctx.args = (cp, kernel, lay, split, chunks, plan, scale, overlap, halos, k.shape, k.dtype)
        if want_lse:
            ctx.mark_non_differentiable(lse_seq)
            return out, lse_seq.squeeze(-1).transpose(1, 2).contiguous()
        return out

    @staticmethod
    def backward(ctx, dout, *_ignored):
        q, kh, vh, out, *lses = ctx.saved_tensors
        cp, kernel, lay, split, chunks, plan, scale, overlap, halos, k_shape, k_dtype = ctx.args
        n = chunks.count
        dout = dout.contiguous()
        acc = acc_dtype(q.dtype)
        dkv_h = torch.zeros(2, *kh.shape, dtype=acc, device=kh.device)
        dq = torch.empty_like(q)

        def post(j):
            r = chunks.q[j]
            return _post_seq_to_head(cp, lay, [q, out, dout], [r, r, r], "ulysses_bwd")

        def compute(j, got):
            qh, oh, doh = got
            lo, hi = chunks.kv_local[j]
            dqh, dkh, dvh = ring_backward(cp, kernel, doh, qh, kh[:, :, lo:hi], vh[:, :, lo:hi], oh, lses[j],
                                          list(chunks.kv_index[j]), plan, halos[j], scale=scale)
            del qh, oh, doh, got
            dkv_h[0][:, :, lo:hi] += dkh
            dkv_h[1][:, :, lo:hi] += dvh
            return [_post_head_to_seq(cp, lay, [dqh], [chunks.q[j]], [dq], "ulysses_bwd")], None

        drive(list(range(n)), post, compute, overlap)
        # dK/dV go home once; replicated KV heads (H_kv < u) sum their replicas' gradients in fp32
        dk = torch.zeros(k_shape, dtype=acc, device=kh.device)
        dv = torch.zeros(k_shape, dtype=acc, device=kh.device)
        _post_head_to_seq(cp, lay, [dkv_h[0], dkv_h[1]], [split.kv, split.kv], [dk, dv], "ulysses_bwd",
                          accumulate=True).wait()
        return dq, dk.to(k_dtype), dv.to(k_dtype), None, None, None, None, None, None, None, None, None


OVERLAP = False
"""Schedule of head chunks (engine-level here, module-level in hybrid_cp/modulechunk.py): False (default)
runs the chunks one after another, the least memory, which is what head chunks are for; True posts the
next chunk's all-to-all before this chunk computes, so communication hides behind compute where it can
(on GPUs), at the price of another chunk's buffers alive (docs/memory.md measures both). Set
`hybrid_cp.headchunk.OVERLAP = True` on every rank alike."""


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: "CPMesh", kernel: "AttentionKernel",
                      lay: "Layout", split: HeadSplit, plan: "Plan", scale: float, head_chunks: int, *,
                      overlap: bool | None = None, return_lse: bool = False):
    """The attention pipeline of `hcp.attention` with the heads in `head_chunks` chunks (see the module
    docstring). Inputs are already validated by `hcp.attention`; returns out (and lse [B, H, S]).
    `overlap=None` uses `OVERLAP`."""
    overlap = OVERLAP if overlap is None else bool(overlap)
    chunks = chunk_heads(split, head_chunks, cp.ulysses_rank)
    return _ChunkedAttention.apply(q, k, v, cp, kernel, lay, split, chunks, plan, scale, overlap, return_lse)
