"""hybrid attention = ulysses all-to-all, then the ring over the ulysses group's tokens, then back.

Every input check runs before the first collective; with `cp.validate` the ranks also agree on
the call signature (hybrid_cp/validate.py:agree_across_ranks; by default only for calls they could
not predict), so an inconsistent call raises instead of hanging in the all-to-all.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from topology.layouts import Layout

from .comm import head_to_seq, seq_to_head
from .heads import HeadMap, HeadSplit, head_split
from .kernels import AttentionKernel, kernel_needs  # noqa: F401  (kernel_needs: compiled reads it here)
from .layout import gathered_to_ring_block, ring_block_to_gathered
from .mesh import CPMesh
from .ring import Plan, block_plan, ring_backward, ring_forward
from .errors import ShapeError
from .validate import checked_call
from . import compiled as _compiled  # noqa: E402  (imports this module back; used at call time)

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _SeqToHead(torch.autograd.Function):
    """[B, S, H|H_kv, D] seq-sharded -> [B, u*S, own heads, D] in ring-block order (q, k, v fused)."""

    @staticmethod
    def forward(ctx, cp: CPMesh, split: HeadSplit, lay: Layout, q, k, v):
        ctx.cp, ctx.split, ctx.lay = cp, split, lay
        parts = seq_to_head(cp, [q, k, v], [split.q, split.kv, split.kv], "ulysses_fwd")
        return tuple(gathered_to_ring_block(x, lay) for x in parts)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cp, split = ctx.cp, ctx.split
        parts = [ring_block_to_gathered(g, ctx.lay) for g in (dq, dk, dv)]
        dq, dk, dv = head_to_seq(cp, parts, [split.q, split.kv, split.kv],
                                 [split.heads, split.kv_heads, split.kv_heads], "ulysses_bwd", accumulate=True)
        return None, None, None, dq, dk, dv


class _HeadToSeq(torch.autograd.Function):
    """[B, u*S, own heads, D] in ring-block order -> [B, S, H, D] seq-sharded."""

    @staticmethod
    def forward(ctx, cp: CPMesh, split: HeadSplit, lay: Layout, out_h):
        ctx.cp, ctx.split, ctx.lay = cp, split, lay
        gathered = ring_block_to_gathered(out_h, lay)
        return head_to_seq(cp, [gathered], [split.q], [split.heads], "ulysses_fwd")[0]

    @staticmethod
    def backward(ctx, dout):
        cp, split = ctx.cp, ctx.split
        (d,) = seq_to_head(cp, [dout.contiguous()], [split.q], "ulysses_bwd")
        return None, None, None, gathered_to_ring_block(d, ctx.lay)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPMesh, kernel: AttentionKernel, kv_index: list[int], plan: Plan,
                scale: float):
        out, lse, halo = ring_forward(cp, kernel, q, k, v, kv_index, plan, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cp, kernel, kv_index, plan, scale, halo)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cp, kernel, kv_index, plan, scale, halo = ctx.args
        dq, dk, dv = ring_backward(cp, kernel, dout.contiguous(), q, k, v, out, lse, kv_index, plan, halo,
                                   scale=scale)
        return dq, dk, dv, None, None, None, None, None


def _needs_grad(q, k, v) -> int:
    """1 if this call records a backward (every rank must agree, or backward hangs on the others)."""
    return int(torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPMesh, *, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False,
              backend: str | AttentionKernel | LocalAttention = "auto", seq_len: int | None = None,
              cu_seqlens=None, window: int | tuple[int, int] | None = None, head_chunks: int = 1):
    """Exact attention over the whole row from this rank's shards.

    q is [B, S_local, H, D], k/v are [B, S_local, H_kv, D], laid out by `hcp.shard`. Returns out
    [B, S_local, H, D] and, with `return_lse`, lse [B, H, S_local] in fp32 (not differentiable).
    Dense rows: `seq_len` is the unpadded global length (by default the length `hcp.shard` saw;
    ambiguous lengths raise). Packed rows: `cu_seqlens` = [0, len_0, ..., total] (the same on every
    rank, B = 1): no token attends across a document boundary; padding is invisible.
    `window`: with causal=True an int W, each query sees the W keys ending at itself
    (transformers' sliding_window); with causal=False (left, right), query i sees keys i - left ..
    i + right (flash-attn's window_size). Positions count inside each document. Blocks no window
    reaches are skipped, and short windows exchange only the halo rows between ring ranks.
    `backend` is "auto", a registered kernel name, a kernel object, or (ring = 1, dense only) a
    plain callable attn(q, k, v) -> out run on the gathered sequence.
    `head_chunks` > 1 runs the heads through all-to-all -> ring -> all-to-all in that many chunks,
    one after another (or, with `hybrid_cp.headchunk.OVERLAP = True`, each chunk's all-to-all
    overlapping the previous chunk's compute): less attention memory, same
    result (`hybrid_cp/headchunk.py`; clamped to the fewest query heads a ulysses rank has).
    Under `torch.compile` the call is one opaque custom op (`hybrid_cp/compiled.py`).
    """
    if torch.compiler.is_compiling():  # dynamo cannot trace the collectives: hand the call to the custom op
        return _compiled.compiled_attention(q, k, v, cp, causal=causal, softmax_scale=softmax_scale,
                                            return_lse=return_lse, backend=backend, seq_len=seq_len,
                                            cu_seqlens=cu_seqlens, window=window, head_chunks=head_chunks)
    lay, kernel, window = checked_call(q, k, v, cp, causal, softmax_scale, backend, seq_len, cu_seqlens, window,
                                       head_chunks, _needs_grad(q, k, v))
    b, s, h, d = q.shape
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    split = head_split(h, k.shape[2], cp.ulysses_size)
    kv_index = split.kv_index(cp.ulysses_rank)
    if head_chunks > 1:
        from .headchunk import chunked_attention

        plan = block_plan(lay, cp.ring_rank, causal, q.device, window)
        return chunked_attention(q, k, v, cp, kernel, lay, split, plan, scale, head_chunks, return_lse=return_lse)
    qh, kh, vh = _SeqToHead.apply(cp, split, lay, q, k, v)
    if kernel is None:  # plain local-attention callable (ring = 1)
        ragged = HeadMap.of(kv_index, kh.shape[2], q.device)  # callables get plain GQA groups
        kh, vh = ragged.expand(kh), ragged.expand(vh)
        out_h = backend(qh, kh, vh)
        if not isinstance(out_h, torch.Tensor) or out_h.shape != qh.shape:
            raise ShapeError(f"the local attention callable returned "
                             f"{getattr(out_h, 'shape', type(out_h).__name__)}; it must return a tensor "
                             f"shaped like its q input, {tuple(qh.shape)}")
        return _HeadToSeq.apply(cp, split, lay, out_h)
    plan = block_plan(lay, cp.ring_rank, causal, q.device, window)
    out_h, lse_h = _RingAttention.apply(qh, kh, vh, cp, kernel, kv_index, plan, scale)
    out = _HeadToSeq.apply(cp, split, lay, out_h)
    if not return_lse:
        return out
    lse_tokens = ring_block_to_gathered(lse_h.transpose(1, 2).unsqueeze(-1), lay)
    lse = head_to_seq(cp, [lse_tokens.contiguous()], [split.q], [h], "ulysses_lse")[0]
    return out, lse.squeeze(-1).transpose(1, 2).contiguous()
