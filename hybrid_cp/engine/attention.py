"""hybrid attention = ulysses all-to-all, then the ring over the ulysses group's tokens, then back.

Every input check runs before the first collective; with `cp.validate` the ranks also agree on
the call signature (hybrid_cp/engine/validate.py:agree_across_ranks; by default only for calls they could
not predict), so an inconsistent call raises instead of hanging in the all-to-all.
"""

from __future__ import annotations

from typing import Callable

import torch

from topology.layouts import Layout

from ..errors import ShapeError
from .eager import eager_only
from .heads import HeadMap, head_split
from .kernels import AttentionKernel
from .masks import AttnMask
from .mesh import CPMesh
from .patterns import prepared
from .pipeline import HeadToSeq, SeqToHead, plan_call
from .pipeline import forward as pipeline_forward
from .spec import AttentionSpec

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["LocalAttention", "attention", "run_attention"]


def _needs_grad(*tensors) -> int:
    """1 if this call records a backward (every rank must agree, or backward hangs on the others)."""
    return int(torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors))


def attention(  # noqa: PLR0913 (public entry point)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: CPMesh,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | AttentionKernel | LocalAttention = "auto",
    seq_len: int | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    window: int | tuple[int, int] | None = None,
    head_chunks: int = 1,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    overlap: bool = False,
    mask: AttnMask | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the whole row from this rank's shards (variants and masks: docs/attention.md).

    Args:
        q: This rank's queries [B, S_local, H, D], laid out by `hcp.shard`.
        k: This rank's keys [B, S_local, H_kv, D]; H must be a multiple of H_kv.
        v: This rank's values [B, S_local, H_kv, D_v]; D_v may differ from D (MLA) with a kernel that can.
        cp: The mesh from `hcp.init_cp_mesh`.
        causal: Causal mask (query i sees keys <= i, inside its document for packed rows).
        softmax_scale: Scale of q.k; None: 1/sqrt(D).
        return_lse: Also return the fp32 log-sum-exp [B, H, S_local] (not differentiable; sinks included).
        backend: "auto", a registered kernel name, a kernel object, or (ring = 1, dense rows only) a
            plain callable attn(q, k, v) -> out run on the gathered sequence.
        seq_len: The unpadded global length of a dense row; None: the length `hcp.shard` saw.
        cu_seqlens: Packed documents' boundaries [0, len_0, ..., total], the same on every rank, B = 1.
        window: Causal: an int W, the W keys ending at each query (transformers' sliding_window);
            non-causal: (left, right), keys i - left .. i + right (flash-attn's window_size).
        head_chunks: > 1 runs the heads through all-to-all -> ring -> all-to-all in that many chunks:
            less attention memory, the same result (docs/memory.md).
        sinks: [H] one sink logit per query head (gpt-oss), the same on every cp rank; each rank's
            gradient is its share (docs/attention.md, "Attention sinks").
        softcap: > 0: logit soft-capping (Gemma 2), scores = softcap * tanh(scores * scale / softcap).
        chunk_size: C (Llama 4's attention_chunk_size): query i sees key j only if j // C == i // C.
        overlap: With head_chunks > 1, post each chunk's all-to-all before the previous chunk computes
            (more memory; the same on every rank); False: one chunk after another.
        mask: Any attention mask (`hcp.AttnMask`), the same on every rank, q/k/v sharded with
            `hcp.shard(x, cp, mask=mask)`; it replaces `causal`, `cu_seqlens`, `seq_len` and `chunk_size`.

    Returns:
        out [B, S_local, H, D_v] in q's dtype, or (out, lse) with `return_lse`.

    Raises:
        ShapeError: Shapes that do not fit each other, the mesh or the layout.
        InputTypeError: Wrong argument types or dtypes.
        ConfigError: An unknown or unavailable backend, an invalid window, chunk size, scale or length, or
            an argument the mask replaces.
        InconsistentRanksError: The cp ranks were called with different arguments (`cp.validate`).
        CommTimeoutError: A peer rank died or stopped calling (with `init_cp_mesh(timeout=...)`).
    """
    spec = AttentionSpec(
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        backend=backend,
        seq_len=seq_len,
        cu_seqlens=cu_seqlens,
        window=window,
        head_chunks=head_chunks,
        softcap=softcap,
        chunk_size=chunk_size,
        overlap=overlap,
        mask=mask,
    )
    return run_attention(q, k, v, cp, spec, sinks)


def run_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: CPMesh,
    spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`hcp.attention` with its settings as one `AttentionSpec` (the transformers attention function calls this)."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the collectives: hand the call to the custom op
        from .compiled import compiled_attention  # on the first trace: `import hybrid_cp` leaves torch._dynamo out

        result = compiled_attention(q, k, v, cp, spec, sinks)
        if result is not None:
            return result
        return _outside_graph(q, k, v, cp, spec, sinks)
    needs_grad = _needs_grad(q, k, v, sinks)
    ready = prepared(q, k, v, cp, spec, sinks, needs_grad)
    if ready.checked.kernel is None:  # plain local-attention callable (ring = 1)
        return _local_callable(q, k, v, cp, ready.checked.lay, spec.backend)
    call = ready.plan(lambda: plan_call(cp, spec, ready.checked, tuple(q.shape), k.shape[2], q.device))
    if spec.head_chunks > 1:
        from .headchunk import chunked_attention

        return chunked_attention(q, k, v, call, sinks=sinks)
    # without a backward to record, the same steps run without their autograd nodes
    out, lse, _ = pipeline_forward(call, q, k, v, want_lse=spec.return_lse, autograd=bool(needs_grad), sinks=sinks)
    return (out, lse) if spec.return_lse else out


def _local_callable(q, k, v, cp: CPMesh, lay: Layout, backend: LocalAttention) -> torch.Tensor:
    """The exchange around a plain local-attention callable run on the gathered sequence (ring = 1)."""
    split = head_split(q.shape[2], k.shape[2], cp.ulysses_size)
    qh, kh, vh = SeqToHead.apply(cp, split, lay, q, k, v)
    ragged = HeadMap.of(split.kv_index(cp.ulysses_rank), kh.shape[2], q.device)  # callables get plain GQA groups
    kh, vh = ragged.expand(kh), ragged.expand(vh)
    out_h = backend(qh, kh, vh)
    want = (*qh.shape[:3], vh.shape[3])
    if not isinstance(out_h, torch.Tensor) or tuple(out_h.shape) != want:
        raise ShapeError(
            f"the local attention callable returned "
            f"{getattr(out_h, 'shape', type(out_h).__name__)}; it must return a tensor "
            f"shaped like its q input with v's head dim, {want}"
        )
    return HeadToSeq.apply(cp, split, lay, out_h)


def _eager_attention(*args, **kwargs):
    return run_attention(*args, **kwargs)


_outside_graph = eager_only(_eager_attention)  # a graph break, run eagerly
