"""The attention pipeline: Ulysses exchange -> block plan -> ring -> exchange back, over head stages.

One call's plan travels as an explicit handle (`AttentionCall`: layout, kernel, head split, block
plan, scale and the head stages), built once by `plan_call`. Everything that runs attention uses the
steps here, so a new attention input is added in one place:

* `forward` / `backward`: all heads as one stage, exchange -> ring -> exchange. Eager `hcp.attention`
  runs `forward(autograd=True)` (each step its own autograd node: `SeqToHead`, `RingStage`,
  `HeadToSeq`); the compiled custom ops in hybrid_cp/engine/compiled.py run `forward` and `backward` inside
  the op: the same steps, not a copy.
* `stage_forward` / `stage_backward`: the ring over one head stage, and `post_heads` / `post_home`:
  a stage's exchange, posted (hybrid_cp/engine/comm.py owns the all-to-all itself). Engine-level head chunks
  (hybrid_cp/engine/headchunk.py) and module-level head chunks (hybrid_cp/engine/modulechunk.py) run their stages
  through `drive`, the one stage driver for the serial and the overlapped schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from topology.heads import pieces as _pieces

from .comm import Posted, head_to_seq, post_head_to_seq, post_seq_to_head, seq_to_head
from .heads import HeadSplit, head_split
from .kernels.merge import sink_grad
from .layout import gathered_rows_identity, gathered_to_ring_block, ring_block_to_gathered
from .ring import Plan, block_plan, ring_backward, ring_forward

if TYPE_CHECKING:
    from topology.layouts import Layout

    from .kernels import AttentionKernel
    from .mesh import CPMesh
    from .spec import AttentionSpec
    from .validate import Checked

Ranges = tuple[tuple[int, int], ...]

__all__ = [
    "AttentionCall",
    "HeadChunks",
    "HeadToSeq",
    "RingStage",
    "Saved",
    "SeqToHead",
    "backward",
    "chunk_heads",
    "drive",
    "forward",
    "heads_home",
    "heads_in",
    "plan_call",
    "post_heads",
    "post_home",
    "stage_backward",
    "stage_forward",
]


@dataclass(frozen=True)
class HeadChunks:
    """Head stage j: the query-head range of every ulysses rank (`q[j][p]`), and for this rank the range of
    its local KV heads the stage uses (`kv_local[j]`, relative to its first KV head) with each stage
    query head's index into that range (`kv_index[j]`)."""

    q: tuple[Ranges, ...]
    kv_local: tuple[tuple[int, int], ...]
    kv_index: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.q)


def chunk_heads(split: HeadSplit, head_chunks: int, rank: int) -> HeadChunks:
    """Cut every rank's query heads into min(head_chunks, fewest heads on a rank) stages (1: all heads)."""
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


@dataclass(frozen=True)
class AttentionCall:
    """Everything one attention call needs besides tensors, decided once (after validation): the call's
    settings (`spec`), its layout, kernel, head split, block plan, scale and head stages."""

    cp: "CPMesh"
    spec: "AttentionSpec"
    lay: "Layout"
    kernel: "AttentionKernel"
    split: HeadSplit
    plan: Plan
    scale: float
    stages: HeadChunks
    kv_index: tuple[int, ...] = ()  # per query head of this rank, its KV head among the local ones (one stage)
    local: bool = False  # ulysses = 1 and ring-block order = local order: the exchange is the identity

    @property
    def softcap(self) -> float | None:
        """The kernels' logit soft-cap (None: off)."""
        return None if self.spec.softcap is None else float(self.spec.softcap)


def plan_call(
    cp: "CPMesh",
    spec: "AttentionSpec",
    checked: "Checked",
    q_shape: tuple[int, ...],
    kv_heads: int,
    device: torch.device,
) -> AttentionCall:
    """The call's head split, block plan, scale and head stages (`spec.head_chunks` of them), from its checked
    layout, kernel and window (`checked`; the default scale is 1/sqrt(q's head dim))."""
    lay, kernel, window, mask = checked
    heads, head_dim = q_shape[2], q_shape[3]
    split = head_split(heads, kv_heads, cp.ulysses_size)
    scale = float(spec.softmax_scale) if spec.softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    plan = block_plan(lay, cp.ring_rank, spec.causal, device, window, spec.chunk_size, mask)
    return AttentionCall(
        cp,
        spec,
        lay,
        kernel,
        split,
        plan,
        scale,
        chunk_heads(split, spec.head_chunks, cp.ulysses_rank),
        tuple(split.kv_index(cp.ulysses_rank)),
        cp.ulysses_size == 1 and gathered_rows_identity(lay, device),
    )


# --- the exchange in ring-block row order ---------------------------------------------------------------


def heads_in(
    cp: "CPMesh", lay: "Layout", parts: list[torch.Tensor], ranges: list[Ranges], stage: str
) -> list[torch.Tensor]:
    """[B, S, h_i, D] (sequence layout) -> [B, u*S, my heads of ranges[i], D] in ring-block order."""
    return [gathered_to_ring_block(x, lay) for x in seq_to_head(cp, parts, ranges, stage)]


def heads_home(
    cp: "CPMesh",
    lay: "Layout",
    parts: list[torch.Tensor],
    ranges: list[Ranges],
    heads: list[int],
    stage: str,
    accumulate: bool = False,
) -> list[torch.Tensor]:
    """[B, u*S (ring-block order), my heads, D] -> new [B, S, heads[i], D] (sequence layout)."""
    gathered = [ring_block_to_gathered(x, lay) for x in parts]
    return head_to_seq(cp, gathered, ranges, heads, stage, accumulate=accumulate)


def post_heads(cp: "CPMesh", lay: "Layout", parts: list[torch.Tensor], ranges: list[Ranges], stage: str) -> Posted:
    """`heads_in`, posted: the handle's `wait()` returns the parts in ring-block order."""
    return post_seq_to_head(cp, parts, ranges, stage, then=lambda x: gathered_to_ring_block(x, lay), timed=True)


def post_home(
    cp: "CPMesh",
    lay: "Layout",
    parts: list[torch.Tensor],
    ranges: list[Ranges],
    targets: list[torch.Tensor],
    stage: str,
    accumulate: bool = False,
) -> Posted:
    """Post [B, u*S (ring-block order), my heads, D] -> write (or add, for replicated KV gradients) each
    rank's heads into targets[i] [B, S, heads, D] at ranges[i][p]. `parts` is consumed: each part is taken
    out of the list as it is reordered, so a part the caller handed over (no other reference) is freed
    before the next one is copied."""
    gathered = []
    while parts:
        gathered.append(ring_block_to_gathered(parts.pop(0), lay))
    # the reordered list is handed over, not kept here: the exchange frees it before it allocates the receive buffer
    return post_head_to_seq(cp, gathered, ranges, targets, stage, accumulate, timed=True)


# --- the ring over one head stage ------------------------------------------------------------------------


def stage_forward(
    call: AttentionCall, e: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, sinks: torch.Tensor | None = None
):
    """Ring attention of head stage e: qh holds the stage's query heads, kh/vh all of this rank's KV heads
    (ring-block order); `sinks` [H] the sink logits of all H query heads (or None). Returns (out, lse, halo)
    as `ring_forward` (with the stage's sinks merged in)."""
    lo, hi = call.stages.kv_local[e]
    return _ring_forward(
        call,
        qh,
        kh[:, :, lo:hi],
        vh[:, :, lo:hi],
        list(call.stages.kv_index[e]),
        call.stages.q[e][call.cp.ulysses_rank],
        sinks,
    )


def stage_backward(call: AttentionCall, e: int, doh: torch.Tensor, saved: "Saved"):
    """Gradients of `stage_forward`: (dq for the stage's query heads, dk/dv for its KV range `kv_local[e]`,
    d(sinks) [H] (this rank's share, zero outside the stage's heads) or None). `saved`: the stage's q, all of
    this rank's K/V heads, the stage's out and lse, its halo and the sinks of all H heads."""
    lo, hi = call.stages.kv_local[e]
    stage = replace(saved, kh=saved.kh[:, :, lo:hi], vh=saved.vh[:, :, lo:hi])
    return _ring_backward_heads(call, doh, stage, list(call.stages.kv_index[e]), call.stages.q[e][call.cp.ulysses_rank])


def _ring_forward(call: AttentionCall, qh, kh, vh, kv_index: list[int], heads: tuple[int, int], sinks):
    """The ring over query heads `heads` (a range of the H query heads), their sinks merged in."""
    return ring_forward(call, qh, kh, vh, kv_index, None if sinks is None else sinks[heads[0] : heads[1]])


def _ring_backward_heads(call: AttentionCall, doh, s: "Saved", kv_index: list[int], heads: tuple[int, int]):
    """`_ring_forward`'s gradients: the ring backward with the final (sink-merged) out and lse is exact for
    q/k/v; the sinks' gradient is this rank's share, a full [H] tensor that is zero outside `heads` (summed
    over the cp ranks it is the full gradient, as for every replicated parameter)."""
    dq, dk, dv = ring_backward(call, doh, s.qh, s.kh, s.vh, (s.out_h, s.lse_h), kv_index, s.halo)
    dsinks = None
    if s.sinks is not None:
        dsinks = torch.zeros_like(s.sinks)
        dsinks[heads[0] : heads[1]] = sink_grad(doh, s.out_h, s.lse_h, s.sinks[heads[0] : heads[1]])
    return dq, dk, dv, dsinks


# --- all heads as one stage: eager autograd and the compiled ops -----------------------------------------


@dataclass
class Saved:
    """What `backward` needs from `forward`: the exchanged q/k/v, out and lse (ring-block order, sinks merged
    in), in halo mode the K/V rows received from the ring peers (None: received again), and the sinks [H]."""

    qh: torch.Tensor
    kh: torch.Tensor
    vh: torch.Tensor
    out_h: torch.Tensor
    lse_h: torch.Tensor
    halo: list | None = None
    sinks: torch.Tensor | None = None


def forward(
    call: AttentionCall,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    want_lse: bool = False,
    autograd: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, Saved]:
    """q [B, S, H, D], k/v [B, S, H_kv, D] (sequence layout), sinks [H] or None -> (out [B, S, H, D], lse [B, H, S]
    (with the sinks) or None, what `backward` needs): one exchange of q/k/v, the ring over all of this rank's
    heads, out (and lse) home. With `autograd` each step is its own autograd node (eager: each node frees what
    it saved as soon as its backward ran); without, the caller keeps `Saved` (the compiled op returns it)."""
    cp, lay, split = call.cp, call.lay, call.split
    halo = None
    if call.local:  # ulysses = 1, no reordering: the exchange would give back its inputs
        qh, kh, vh = q, k, v
        if autograd:
            out_h, lse_h = RingStage.apply(call, q, k, v, sinks)
        else:
            out_h, lse_h, halo = _ring_forward(call, q, k, v, call.kv_index, split.q[cp.ulysses_rank], sinks)
        out = out_h
    elif autograd:
        qh, kh, vh = SeqToHead.apply(cp, split, lay, q, k, v)
        out_h, lse_h = RingStage.apply(call, qh, kh, vh, sinks)
        out = HeadToSeq.apply(cp, split, lay, out_h)
    else:
        qh, kh, vh = heads_in(cp, lay, [q, k, v], [split.q, split.kv, split.kv], "ulysses_fwd")
        out_h, lse_h, halo = _ring_forward(call, qh, kh, vh, call.kv_index, split.q[cp.ulysses_rank], sinks)
        (out,) = heads_home(cp, lay, [out_h], [split.q], [split.heads], "ulysses_fwd")
    lse = None
    if want_lse:  # not differentiable
        (lse,) = heads_home(cp, lay, [lse_h.transpose(1, 2).unsqueeze(-1)], [split.q], [split.heads], "ulysses_lse")
        lse = lse.squeeze(-1).transpose(1, 2).contiguous()
    return out, lse, Saved(qh, kh, vh, out_h, lse_h, halo, sinks)


def backward(call: AttentionCall, dout: torch.Tensor, saved: Saved) -> list[torch.Tensor | None]:
    """Gradients of `forward` w.r.t. q, k, v (sequence layout) and sinks (this rank's share, or None): d(out)
    over, the ring backward, the gradients home (replicated KV heads sum their replicas' gradients in fp32);
    what eager's nodes run."""
    cp, lay, split = call.cp, call.lay, call.split
    (doh,) = heads_in(cp, lay, [dout.contiguous()], [split.q], "ulysses_bwd")
    *grads, dsinks = _ring_backward(call, doh, saved)
    del doh
    return _grads_home(cp, split, lay, grads) + [dsinks]


def _ring_backward(call: AttentionCall, doh: torch.Tensor, s: Saved) -> tuple[torch.Tensor | None, ...]:
    return _ring_backward_heads(call, doh.contiguous(), s, call.kv_index, call.split.q[call.cp.ulysses_rank])


def _grads_home(cp: "CPMesh", split: HeadSplit, lay: "Layout", grads) -> list[torch.Tensor]:
    return heads_home(
        cp,
        lay,
        list(grads),
        [split.q, split.kv, split.kv],
        [split.heads, split.kv_heads, split.kv_heads],
        "ulysses_bwd",
        accumulate=True,
    )


class SeqToHead(torch.autograd.Function):
    """`forward`'s first step as an autograd node (also around a plain local-attention callable):
    [B, S, H|H_kv, D] seq-sharded -> [B, u*S, own heads, D] in ring-block order (q, k, v fused)."""

    @staticmethod
    def forward(ctx, cp: "CPMesh", split: HeadSplit, lay: "Layout", q, k, v):
        ctx.cp, ctx.split, ctx.lay = cp, split, lay
        return tuple(heads_in(cp, lay, [q, k, v], [split.q, split.kv, split.kv], "ulysses_fwd"))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return (None, None, None, *_grads_home(ctx.cp, ctx.split, ctx.lay, (dq, dk, dv)))


class RingStage(torch.autograd.Function):
    """`forward`'s ring step as an autograd node: (qh, kh, vh, sinks) -> (out_h, lse_h), ring-block order; its
    backward returns the sinks' gradient too (this rank's share)."""

    @staticmethod
    def forward(ctx, call: AttentionCall, qh, kh, vh, sinks):
        out_h, lse_h, halo = _ring_forward(call, qh, kh, vh, call.kv_index, call.split.q[call.cp.ulysses_rank], sinks)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h, sinks)
        ctx.call, ctx.halo = call, halo
        ctx.mark_non_differentiable(lse_h)
        return out_h, lse_h

    @staticmethod
    def backward(ctx, doh, _dlse):
        *saved, sinks = ctx.saved_tensors
        return (None, *_ring_backward(ctx.call, doh, Saved(*saved, ctx.halo, sinks)))


class HeadToSeq(torch.autograd.Function):
    """`forward`'s last step as an autograd node: [B, u*S, own heads, D] in ring-block order -> [B, S, H, D]."""

    @staticmethod
    def forward(ctx, cp: "CPMesh", split: HeadSplit, lay: "Layout", out_h):
        ctx.cp, ctx.split, ctx.lay = cp, split, lay
        return heads_home(cp, lay, [out_h], [split.q], [split.heads], "ulysses_fwd")[0]

    @staticmethod
    def backward(ctx, dout):
        (d,) = heads_in(ctx.cp, ctx.lay, [dout.contiguous()], [ctx.split.q], "ulysses_bwd")
        return None, None, None, d


# --- the stage driver ------------------------------------------------------------------------------------


def drive(order: list, post: Callable, compute: Callable, overlap: bool, finish: Callable | None = None) -> None:
    """Run pipeline stages in order: `post(stage)` sends a stage's inputs (a `Posted`), `compute(stage,
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
        landed, item = compute(stage, got.pop())  # compute owns the received tensors and may free them early
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
