"""Head-chunked hybrid attention (UPipe-style): the heads go through all-to-all -> ring -> all-to-all a
few at a time; with `AttentionSpec.overlap` the all-to-all of chunk i + 1 runs while chunk i computes.

Why: with all heads at once the attention stage holds, per rank, the gathered query, output,
d(output) and fp32 d(query) of every local head for the ulysses group's whole sequence. Processing
`head_chunks` chunks one after another divides that working set by the number of chunks (the
"Untied Ulysses" paper, UPipe, arXiv 2602.21196: 87.5% less attention-stage memory at 8 chunks).
The paper's stages run one after another, as the default here does; with `overlap=True` each
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

import sys
import types

import torch

from .comm import acc_dtype
from .pipeline import (
    AttentionCall,
    HeadChunks,
    Saved,
    chunk_heads,
    drive,
    post_heads,
    post_home,
    stage_backward,
    stage_forward,
)

__all__ = ["HeadChunks", "chunk_heads", "chunked_attention"]


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, call: AttentionCall, overlap: bool, want_lse: bool):
        cp, lay, split, chunks = call.cp, call.lay, call.split, call.stages
        kv_flight = post_heads(cp, lay, [k, v], [split.kv, split.kv], "ulysses_fwd")
        out = q.new_empty(*q.shape[:3], v.shape[3])
        lse_seq = (
            torch.empty(q.shape[0], q.shape[1], q.shape[2], 1, dtype=acc_dtype(q.dtype), device=q.device)
            if want_lse
            else None
        )
        lses, halos, kv = [], [], []

        def post(j):
            return post_heads(cp, lay, [q], [chunks.q[j]], "ulysses_fwd")

        def compute(j, got):
            if not kv:
                kv.extend(kv_flight.wait())
            out_h, lse_h, halo = stage_forward(call, j, got.pop(), kv[0], kv[1], sinks)
            lses.append(lse_h)
            halos.append(halo)
            landed = [post_home(cp, lay, [out_h], [chunks.q[j]], [out], "ulysses_fwd")]
            if want_lse:
                landed.append(
                    post_home(
                        cp,
                        lay,
                        [lse_h.transpose(1, 2).unsqueeze(-1).contiguous()],
                        [chunks.q[j]],
                        [lse_seq],
                        "ulysses_lse",
                    )
                )
            return landed, None

        drive(list(range(chunks.count)), post, compute, overlap)
        kh, vh = kv
        ctx.save_for_backward(q, kh, vh, out, sinks, *lses)
        ctx.args = (call, overlap, halos, k.shape, v.shape, k.dtype)
        if want_lse:
            ctx.mark_non_differentiable(lse_seq)
            return out, lse_seq.squeeze(-1).transpose(1, 2).contiguous()
        return out

    @staticmethod
    def backward(ctx, dout, *_ignored):
        q, kh, vh, out, sinks, *lses = ctx.saved_tensors
        call, overlap, halos, k_shape, v_shape, k_dtype = ctx.args
        cp, lay, split, chunks = call.cp, call.lay, call.split, call.stages
        dout = dout.contiguous()
        acc = acc_dtype(q.dtype)
        dkv_h = [torch.zeros(x.shape, dtype=acc, device=kh.device) for x in (kh, vh)]
        dq = torch.empty_like(q)
        dsinks = None if sinks is None else torch.zeros_like(sinks)  # each stage adds its heads' share

        def post(j):
            r = chunks.q[j]
            return post_heads(cp, lay, [q, out, dout], [r, r, r], "ulysses_bwd")

        def compute(j, got):
            qh, oh, doh = got
            dqh, dkh, dvh, ds = stage_backward(call, j, doh, Saved(qh, kh, vh, oh, lses[j], halos[j], sinks))
            del qh, oh, doh, got
            if ds is not None:
                dsinks.add_(ds)
            lo, hi = chunks.kv_local[j]
            dkv_h[0][:, :, lo:hi] += dkh
            dkv_h[1][:, :, lo:hi] += dvh
            return [post_home(cp, lay, [dqh], [chunks.q[j]], [dq], "ulysses_bwd")], None

        drive(list(range(chunks.count)), post, compute, overlap)
        # dK/dV go home once; replicated KV heads (H_kv < u) sum their replicas' gradients in fp32
        dk = torch.zeros(k_shape, dtype=acc, device=kh.device)
        dv = torch.zeros(v_shape, dtype=acc, device=kh.device)
        post_home(cp, lay, [dkv_h[0], dkv_h[1]], [split.kv, split.kv], [dk, dv], "ulysses_bwd", accumulate=True).wait()
        return dq, dk.to(k_dtype), dv.to(k_dtype), dsinks, None, None, None


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, *, sinks: torch.Tensor | None = None
):
    """The attention pipeline of `hcp.attention` over the head stages of `call` (`head_chunks` of them,
    see the module docstring), on the schedule `call.spec.overlap` says: False runs the chunks one after
    another, the least memory, which is what head chunks are for; True posts the next chunk's all-to-all
    before this chunk computes, so communication hides behind compute where it can (on GPUs), at the price
    of another chunk's buffers alive (docs/memory.md measures both). Inputs are already validated by
    `hcp.attention`; returns out (and lse [B, H, S], with the sinks, when `call.spec.return_lse`). `sinks`
    [H]: each stage merges its heads' sinks; their gradient is this rank's share (zero outside its heads)."""
    return _ChunkedAttention.apply(q, k, v, sinks, call, call.spec.overlap, call.spec.return_lse)


class _Removed(types.ModuleType):
    """This module, refusing the global schedule switch it once had (a switch set here would do nothing now)."""

    def __setattr__(self, name: str, value) -> None:
        if name == "OVERLAP":
            raise AttributeError(_OVERLAP_MOVED)
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name == "OVERLAP":
            raise AttributeError(_OVERLAP_MOVED)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_OVERLAP_MOVED = (
    "hybrid_cp.engine.headchunk.OVERLAP was replaced by a setting of each call: pass "
    "hcp.attention(..., overlap=True) or apply_context_parallel(..., overlap=True)"
)
sys.modules[__name__].__class__ = _Removed
