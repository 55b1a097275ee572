"""hybrid attention = ulysses all-to-all, then the ring over the ulysses group's tokens, then back.

Every input check runs before the first collective; with `cp.validate` the ranks also agree on
the call signature (hybrid_cp/mesh.py:agree_across_ranks; by default only for calls they could
not predict), so an inconsistent call raises instead of hanging in the all-to-all.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

from topology.layouts import Layout, granularity

from .comm import head_to_seq, seq_to_head
from .heads import HeadMap, HeadSplit, head_split
from .kernels import AttentionKernel, get_kernel, takes_keyword_on
from .layout import gathered_to_ring_block, ring_block_to_gathered, row_layout
from .mesh import CPMesh, agree_across_ranks
from .ring import Plan, block_plan, ring_backward, ring_forward
from .errors import ConfigError, CPError, InputTypeError, ShapeError
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


_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


def kernel_needs(cu_seqlens, window) -> list[str]:
    """The kernel keywords a call passes beyond the dense ones (what "auto" must find a kernel for)."""
    return [kw for needed, kw in ((cu_seqlens is not None, "cu_seqlens_q"), (window is not None, "window")) if needed]


def _local_checks(q, k, v, cp, causal, softmax_scale, backend, seq_len, cu_seqlens,
                  window) -> tuple[Layout, AttentionKernel | None, tuple | int | None]:
    """Raise ValueError/TypeError for inputs this rank can judge alone; return (layout, kernel,
    the window in effect)."""
    if not isinstance(cp, CPMesh):
        raise InputTypeError(f"cp must be a CPMesh from hcp.init_cp_mesh(...), got {type(cp).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ShapeError(f"{name} must be [batch, seq_local, heads, head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise InputTypeError(f"{name}.dtype={x.dtype} is not floating point; pass bf16/fp16/fp32/fp64 tensors")
        if x.dtype != q.dtype:
            raise InputTypeError(f"{name}.dtype={x.dtype} differs from q.dtype={q.dtype}; cast all three to one dtype")
        if x.device != q.device:
            raise ConfigError(f"{name} is on {x.device} but q is on {q.device}; move all three to one device")
        if x.stride(-1) != 1:
            raise ShapeError(f"{name} has stride {x.stride(-1)} in head_dim; the kernels need a unit stride: "
                             f"pass {name}.contiguous()")
    if q.device.type != cp.device.type:
        raise ConfigError(f"q is on {q.device} but the cp mesh was built for {cp.device}; "
                         f"move the inputs to {cp.device} or rebuild the mesh with device=...")
    b, s, h, d = q.shape
    if k.shape != v.shape:
        raise ShapeError(f"k.shape={tuple(k.shape)} != v.shape={tuple(v.shape)}; k and v must match")
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ShapeError(f"k.shape={tuple(k.shape)} does not match q.shape={tuple(q.shape)} in batch, "
                         f"local length or head_dim; k/v must be [{b}, {s}, H_kv, {d}]")
    hkv = k.shape[2]
    if hkv < 1 or h % hkv:
        raise ShapeError(f"q has {h} heads and k/v have {hkv}: the query heads must be a multiple of the "
                         f"KV heads (GQA groups); fix num_key_value_heads")
    if h < cp.ulysses_size:
        raise ShapeError(f"q has {h} heads but ulysses={cp.ulysses_size}: every ulysses rank needs at least "
                         f"one head; use ulysses <= {h} and put the rest of the degree into ring")
    if s == 0:
        raise ShapeError(f"q has local length 0 (shape {tuple(q.shape)}); shard a non-empty sequence")
    if cu_seqlens is not None and b != 1:
        raise ShapeError(f"q has batch size {b} with cu_seqlens: a packed row is a batch of one; concatenate the "
                         f"documents into one row [1, total, ...] and describe them with cu_seqlens")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and
                                          math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ConfigError(f"softmax_scale={softmax_scale!r} must be a positive finite number (or None "
                         f"for 1/sqrt(head_dim))")
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal={causal!r} must be a bool")
    lay = row_layout(cp, local_len=s, seq_len=seq_len, cu_seqlens=cu_seqlens, causal=causal)
    window = lay.effective_window(causal, window)
    if callable(backend) and not isinstance(backend, (str, AttentionKernel)):
        if cp.ring_size != 1:
            raise ConfigError(f"a plain local-attention callable works with ring=1 only (got ring="
                             f"{cp.ring_size}): the ring needs a kernel that returns the log-sum-exp; "
                             f"register one with hcp.register_kernel")
        if cu_seqlens is not None or window is not None or (lay.padded_len != lay.seq_len and not causal):
            raise ConfigError("a plain local-attention callable cannot mask document boundaries, windows or (non-causal) "
                             "padding; use a kernel backend, or for dense rows a length divisible by "
                             f"{granularity(cp.layout, cp.ulysses_size, cp.ring_size)}")
        return lay, None, None
    needs = kernel_needs(cu_seqlens, window)
    kernel = get_kernel(backend, q.device, q.dtype, d, needs=needs)
    for keyword in needs:
        if not takes_keyword_on(kernel, keyword, q.device):
            raise ConfigError(f"backend={getattr(kernel, 'name', backend)!r} does not take the {keyword!r} keyword that "
                             f"{'cu_seqlens' if keyword == 'cu_seqlens_q' else 'window'} needs; see "
                             f"hybrid_cp/kernels/__init__.py")
    return lay, kernel, window


def checked_call(q, k, v, cp, causal, softmax_scale, backend, seq_len, cu_seqlens, window, head_chunks: int,
                 needs_grad: int) -> tuple[Layout, AttentionKernel | None, tuple | int | None]:
    """Every check of an attention call, before any collective: this rank's own (`_local_checks`), then,
    with `cp.validate`, the cross-rank agreement on the call's signature, so that a rank that failed
    or differs makes every rank raise. Returns (layout, kernel, the window in effect). `needs_grad`
    is passed in because the compiled path decides it at trace time (hybrid_cp/compiled.py)."""
    error, lay, kernel = None, None, None
    try:
        if not isinstance(head_chunks, int) or isinstance(head_chunks, bool) or head_chunks < 1:
            raise ConfigError(f"head_chunks={head_chunks!r} must be an integer >= 1 (1: all heads at once)")
        lay, kernel, window = _local_checks(q, k, v, cp, causal, softmax_scale, backend, seq_len, cu_seqlens, window)
        if head_chunks > 1 and kernel is None:
            raise ConfigError(f"head_chunks={head_chunks} needs a kernel backend (the ring path); a plain "
                             f"local-attention callable runs all heads at once: use head_chunks=1")
    except (TypeError, ValueError) as exc:
        if not isinstance(exc, CPError):  # e.g. topology's window/boundary checks: give it a documented type
            exc = (ConfigError if isinstance(exc, ValueError) else InputTypeError)(str(exc))
        if not (cp.__class__ is CPMesh and cp.validate and cp.size > 1):
            raise exc from None
        error = exc
    if cp.validate and cp.size > 1:
        shape = list(q.shape) + [k.shape[2]] if error is None else [0] * 5
        name = getattr(kernel, "name", "callable" if kernel is None else str(backend))
        docs = zlib.crc32(repr(lay.doc_lens).encode()) if lay is not None else 0
        win = (-1, -1) if error is not None or window is None else (window, 0) if isinstance(window, int) else window
        signature = [shape[0], shape[1], shape[2], shape[4], shape[3], _DTYPE_CODES.get(getattr(q, "dtype", None), 0),
                     int(causal) if isinstance(causal, bool) else -1, lay.seq_len if lay is not None else 0, docs, win[0], win[1],
                     zlib.crc32(name.encode()), int(needs_grad) if error is None else 0, head_chunks if error is None else 0]
        names = ["batch", "local length", "heads", "kv heads", "head_dim", "dtype", "causal", "seq_len",
                 "cu_seqlens (checksum)", "window", "window right", "backend", "needs grad", "head_chunks"]
        agree_across_ranks(cp, signature, names, error, "hcp.attention inputs",
                           tensors=(("q", q), ("k", k), ("v", v)) if error is None else ())
    return lay, kernel, window


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
