"""The step model: per-rank peak memory of one training step (the longest sequence that fits is
`topology.memory`'s search over it).

The model follows the tensors a Hugging Face Llama-style decoder keeps alive under hybrid-cp,
counted op by op (the derivation is in docs/memory.md) and checked against exact measurements of
live tensor storage (`benchmarks/memory_step.py`, `hybrid_cp.training.memory.StorageTracker`):

* **Model states**: with FSDP2 over all dp x cp ranks (``fsdp=True``), fp32 master weights,
  fp32 gradients and AdamW's two fp32 moments are sharded (16 bytes/parameter / world), plus the
  unsharded compute-dtype weights of the root (embedding and LM head, kept unsharded through the
  step) and of two decoder blocks (the current one and the prefetched one), and the unsharded
  gradients of one block in backward. Without FSDP every rank holds all of it in fp32.
* **Activations**: per decoder layer and local token, what autograd keeps: three tensors per
  RMSNorm (input, normalised, output; the normalised one in fp32), the attention engine's gathered
  q/k/v, output and fp32 lse, the output projection's input, and the MLP's four
  ``[tokens, intermediate]`` tensors (none with the tiled MLP). With activation checkpointing only
  each layer's input is kept (``offload_checkpoints`` moves those to host memory), plus one layer
  recomputed in backward.
* **Stage working sets** (on top of the above): the attention stage (local q/k/v, all-to-all buffers,
  the ring's buffers and fp32 gradients; with ``head_chunks`` one module-level chunk's projections
  and engine tensors, nothing saved but the input, one chunk recomputed in backward), the MLP
  (whole or one chunk at a time) and the loss (full ``[tokens, vocab]`` fp32 logits three times,
  or three chunks of them plus an fp32 weight gradient).

The peak is the largest of: the loss's backward, the last layer's backward (first in backward),
and the optimizer step. Not modelled: allocator fragmentation and caching, the CUDA context and
NCCL buffers (the planner's default budget leaves 10% of device memory for those), kernel scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .heads import head_split, module_chunks
from .layouts import make_layout
from .linear_cost import (
    linear_kernel_bytes,
    linear_mixer_saved,
    linear_mixer_token_bytes,
    linear_runs,
    linear_summary_bytes,
)
from .model_shape import ModelShape
from .split import Split
from .units import FP32_BYTES, LOSS_CHUNK_BYTES, GiB, check_counts, dtype_bytes

__all__ = [
    "MemoryOptions",
    "MemoryEstimate",
    "step_memory",
    "host_bytes",
    "attention_forwards",
    "module_chunked",
    "keeps_output",
]

ADAM_STATE = 2 * FP32_BYTES  # two fp32 moments per parameter
MASTER = FP32_BYTES  # fp32 weights (FSDP2 mixed precision keeps the sharded parameters in fp32)
GRAD = FP32_BYTES  # fp32 gradients (reduce dtype)

# Engine-level head chunks (hybrid_cp.engine.headchunk) counted in q-sized pieces of one chunk (G x c_chunk x D
# elements): the current chunk's received copies, the ring's accumulators and, overlapped, the next chunk's
# send and receive buffers and the previous chunk's return (forward and backward respectively). The counts
# came in with commit 536b27f ("planner prices the head-chunked engine as built"); docs/memory.md does not
# itemise them further.
CHUNK_FWD_PIECES = 8
CHUNK_BWD_PIECES = 13
# The overlapped module-chunk schedule keeps more alive than the serial one: the next stage's exchange and
# the previous chunk's returning results. Measured on the attention module alone that is 0.3-0.65 of one
# chunk's working set (docs/memory.md, the module overlap table and its limitations list: fitted to that
# table, not measured on a whole step); the planner charges the top of that range on top of the chunk.
OVERLAP_IN_FLIGHT = 1.65
# The tiled MLP's backward working set, in [chunk tokens, intermediate] tensors of the compute dtype (on
# top of d(output), d(input) and the fp32 weight gradients; d(output) was added after the fit below, from a
# snapshot of a bf16 step's peak). It came in with the exact step measurements (commit
# 31d64fe) without a written derivation; its check is docs/memory.md's step table, whose tiled-MLP rows
# put the estimate within -1.3% .. +1.0% of the measured peak.
TILED_MLP_BWD_CHUNKS = 6.5


class MemoryOptions(BaseModel):
    """Training options that change memory: what `hcp` offers and what the step does (a pydantic model like the
    cluster's: strict types, ranges as field constraints, the rules between fields in one validator)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    checkpoint: bool = True  # activation checkpointing of every decoder layer
    offload_checkpoints: bool = False  # checkpointed layer inputs live in host memory (hcp.offload_checkpoints)
    prefetch: bool = True  # with offload: the previous layer's input comes back while this layer runs
    # backward (the CUDA default): one more layer input on the device
    pin_memory: bool = True  # with offload: pinned host buffers (the CUDA default), which PyTorch's
    # host allocator rounds up to a power of two; False: pageable, exact
    head_chunks: int = Field(1, ge=1)  # attention heads processed in this many chunks (UPipe)
    chunk_projections: bool = True  # chunks start at the Q/K/V projections (apply_context_parallel's
    # default); False: inside hcp.attention only
    overlap: bool = False  # head-chunk schedule (hybrid_cp.engine.headchunk.OVERLAP): True keeps the next
    # chunk's exchange in flight while one computes; False: one after another
    tiled_loss: bool = False  # hcp.tiled_cross_entropy / hcp.lm_loss
    loss_chunk: int | None = Field(None, ge=1)  # tokens per loss chunk (None: hcp's default, 256 MiB of fp32 logits)
    tiled_mlp: int = Field(0, ge=0)  # tokens per MLP chunk (hcp.tile_mlp); 0: off
    fsdp: bool = True  # FSDP2 over dp x cp (hcp.integrations.fsdp.shard_model)
    master_weights: bool = True  # replicated weights (fsdp=False) kept in fp32 with fp32 gradients and AdamW
    # state; False: a model cast to the compute dtype (`.to(bf16)`), whose
    # weights, gradients and AdamW state are all in it
    fused_norm: bool = False  # a fused RMSNorm (keeps its input and rstd only; not part of hcp)
    tiled_norm: bool = False  # hcp's tiled RMSNorm: keeps only its input, the fp32 upcast lives for one
    # token tile at a time (no full-length fp32 copies)
    keep_attention_output: bool | None = None  # module-level chunks keep each chunk's attention output and lse
    # (apply_context_parallel's keep_attention_output): None, its default,
    # inside checkpointed layers only; True also without checkpointing
    foreach_optimizer: bool = True  # AdamW's multi-tensor path (CUDA default): one fp32 temporary per
    # parameter at once; False (CPU default): per tensor, the largest twice

    @model_validator(mode="after")
    def _consistent(self) -> "MemoryOptions":
        if self.tiled_norm and self.fused_norm:
            raise ValueError("tiled_norm=True and fused_norm=True both replace the RMSNorm: pick one")
        if self.fsdp and not self.master_weights:
            raise ValueError("master_weights=False needs fsdp=False: FSDP2 mixed precision keeps fp32 master weights")
        if self.offload_checkpoints and not self.checkpoint:
            raise ValueError("offload_checkpoints=True needs checkpoint=True (only checkpointed inputs are offloaded)")
        return self

    def describe(self) -> str:
        parts = ["ckpt" + ("+offload" if self.offload_checkpoints else "") if self.checkpoint else "no ckpt"]
        if self.head_chunks > 1:
            parts.append(
                f"head_chunks={self.head_chunks}"
                + ("" if self.chunk_projections else " (engine only)")
                + ("" if self.overlap else " serial")
            )
        parts.append(f"tiled loss ({self.loss_chunk or 'default'})" if self.tiled_loss else "full logits")
        parts.append(f"tiled MLP ({self.tiled_mlp})" if self.tiled_mlp else "whole MLP")
        if not self.fsdp:
            parts.append("replicated weights" + ("" if self.master_weights else " in the compute dtype"))
        if self.fused_norm:
            parts.append("fused RMSNorm")
        if self.tiled_norm:
            parts.append("tiled RMSNorm")
        if self.offload_checkpoints and not self.prefetch:
            parts.append("no prefetch")
        if self.offload_checkpoints and not self.pin_memory:
            parts.append("pageable host buffers")
        return ", ".join(parts)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per rank and where they go. ``stages`` are the working sets on top of the persistent
    part; ``phases`` the candidate peaks (the largest is ``peak``)."""

    peak: int
    persistent: dict[str, int]
    stages: dict[str, int]
    phases: dict[str, int]
    local_tokens: int
    notes: tuple[str, ...] = field(default=())
    host: int = 0  # host bytes per rank (the offloaded checkpoints)
    activations: dict[str, int] = field(default_factory=dict)  # the activation terms (see _activations)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "peak_phase": self.peak_phase,
            "persistent": dict(self.persistent),
            "stages": dict(self.stages),
            "phases": dict(self.phases),
            "local_tokens": self.local_tokens,
            "host": self.host,
            "activations": dict(self.activations),
        }


def _norm(e: int, o: MemoryOptions, input_kept: bool = False) -> int:
    """Bytes per hidden unit one RMSNorm adds to the saved tensors. Stock (Hugging Face): its input upcast
    to fp32, the normalised value cast back to the compute dtype, and the output (which the next projection
    keeps as its input): 4 + 2e. Fused or tiled: its compute-dtype input and the output, 2e. ``input_kept``:
    the input is counted elsewhere (a checkpointed layer's first norm, whose input the checkpoint keeps),
    so the tiled norm adds e, and so does the stock one's upcast in fp32, where it is the input itself."""
    if o.tiled_norm:
        return e if input_kept else 2 * e
    if o.fused_norm:
        return 2 * e
    return (0 if input_kept and e == 4 else 4) + 2 * e


def _attention_module(
    module: ModelShape, split: Split, rank: int | None, hc: int, reorder: bool = True, module_chunk: bool = False
) -> tuple[int, int, int, int, int]:
    """One attention module call with `module`'s H/Hkv heads (the model's, or one module-level chunk's) on the
    split's T local tokens, all heads projected at once and
    `hc` engine-level chunks: (bytes saved per local token, forward and backward working sets of the
    module, and of the engine inside it). `reorder`: the layout reorders the gathered tokens (see
    `_single_block_backward`). `module_chunk`: one chunk of `hybrid_cp.engine.modulechunk`, whose backward
    exchanges and returns its tensors with its own buffers: at ring size 1 it keeps the terms of ring > 1
    (not re-derived for the fast path; benchmarks/results/open_items.md, "Memory")."""
    H, Hkv, D, E = module.heads, module.n_kv, module.head_dim, module.d_model
    e, ulysses, ring, T = split.e, split.ulysses, split.ring, split.local_tokens
    per_rank = head_split(H, Hkv, ulysses)
    i = _busiest_rank(per_rank) if rank is None else rank
    c, k = per_rank[i][0], per_rank[i][3]
    G = ulysses * T  # tokens of the ulysses group (the heads' sequence after the all-to-all)
    hc = min(hc, c)
    c_chunk = -(-c // hc)  # query heads of the largest engine chunk
    # KV heads of the largest chunk: a GQA group straddling a chunk boundary is shared, not duplicated
    group = H // Hkv
    k_chunk = min(k, -(-c_chunk // group) + (1 if group > 1 and c_chunk % group else 0)) if hc > 1 else k
    if hc == 1:
        saved = (
            ulysses * (c + 2 * k) * D * e  # gathered q, k, v (the ring saves them)
            + ulysses * c * D * e
            + ulysses * c * 4  # output in head layout, fp32 lse
            + (H * D * e if ulysses > 1 else 0)
        )  # output back in sequence layout (o_proj input)
    else:  # hybrid_cp.engine.headchunk keeps the local q and output, the exchanged K/V and the lse only
        saved = 2 * H * D * e + ulysses * 2 * k * D * e + ulysses * c * 4
    local_qkv = T * (H + 2 * Hkv) * D * e
    chunk_g = G * (c + 2 * k) * D
    ring_buf = (2 * G * 2 * k_chunk * D * e + 2 * G * 2 * k_chunk * D * GRAD) if ring > 1 else 0
    # the Q/K/V projections (+ their contiguous copies) and the output projection
    module_fwd = 2 * local_qkv + T * E * e
    module_bwd = local_qkv + T * E * e
    if hc == 1:
        engine_fwd = 2 * chunk_g * e + T * H * D * e + ring_buf // 2
        if ring == 1 and not module_chunk:
            engine_bwd = _single_block_backward(module, split, c, k, reorder)
        else:
            engine_bwd = T * H * D * e + 2 * G * c * D * e + chunk_g * GRAD + 2 * chunk_g * e + ring_buf
    else:
        # per chunk (q-sized pieces of G * c_chunk * D): the current chunk's received copies, the ring's
        # accumulators, and (overlap) the next chunk's send + receive buffers and the previous chunk's return
        piece = G * c_chunk * D * e
        engine_fwd = T * H * D * e + G * 2 * k * D * e + CHUNK_FWD_PIECES * piece + ring_buf // 2
        engine_bwd = (
            T * H * D * e
            + G * 2 * k * D * GRAD
            + T * 2 * Hkv * D * GRAD  # dq, fp32 dK/dV
            + CHUNK_BWD_PIECES * piece
            + ring_buf
        )
    return saved, module_fwd + engine_fwd, module_bwd + engine_bwd, engine_fwd, engine_bwd


def _single_block_backward(module: ModelShape, split: Split, c: int, k: int, reorder: bool) -> int:
    """The engine's backward working set at ring size 1 (all heads at once), on top of its saved tensors (the
    gathered q/k/v, the head-layout output and the fp32 lse), as `hybrid_cp.engine.ring`'s whole-block fast
    path runs it: the largest of its three phases (docs/memory.md, "The engine at ring size 1"). `reorder`:
    the layout's gathered token order is not the ring block's (zigzag with ulysses > 1), so each exchange
    makes one reordered copy (`index_select`) while its source is alive.

    * d(out) in: the incoming d(out) [T, H, D], the all-to-all's send copy of it, the receive buffer
      [G, c, D] and (reorder) its reordered copy, d(out) in head layout: 2 T H D e + (1 + reorder) G c D e.
    * the ring backward, one kernel call: d(out) in head layout and the kernel's dq, dk, dv [G, c + 2k, D],
      in the compute dtype (no fp32 accumulator, no fused K/V or dK/dV buffer): G c D e + G (c + 2k) D e.
    * the gradients home (ulysses > 1): dq/dk/dv and the fp32 sums they land in
      (`head_to_seq(accumulate=True)`, [T, H + 2 Hkv, D]) throughout; while the send buffer is packed,
      (reorder) their reordered copy and the send buffer; once packed, the reordered copy is freed and the
      send buffer and the receive buffer [T, H + 2 Hkv, D] (compute dtype) are alive. The saved q/k/v,
      output and lse are freed by then, so they are taken off.
    """
    H, Hkv, D = module.heads, module.n_kv, module.head_dim
    e, ulysses, T = split.e, split.ulysses, split.local_tokens
    G = ulysses * T
    grads = G * (c + 2 * k) * D * e
    d_in = 2 * T * H * D * e + (1 + reorder) * G * c * D * e
    ring = G * c * D * e + grads
    if ulysses == 1:
        return max(d_in, ring)
    seq = T * (H + 2 * Hkv) * D
    freed = grads + G * c * D * e + G * c * FP32_BYTES
    home = max((2 + reorder) * grads, 2 * grads + seq * e) + seq * FP32_BYTES - freed
    return max(d_in, ring, home)


def _module_chunk_backward(
    split: list[tuple[int, int, int, int]], Hm: int, Km: int, D: int, E: int, e: int, T: int, reorder: bool
) -> int:
    """One module-level chunk's backward at ring size 1 in the serial schedule, with one engine stage per chunk
    (`hybrid_cp.engine.modulechunk._Backward`), on top of the module's d(output) and d(input) (two [T, E]
    tensors, added by the caller) and the kept outputs (counted with the layer): the largest of its phases
    (docs/memory.md, "Module chunks at ring size 1"). `split`: the chunk's heads over the ulysses ranks; Hm / Km
    its query / KV heads. Every exchange's parts are freed once packed (`post_seq_to_head` and
    `post_head_to_seq` consume them).

    * inputs over: the chunk's local q, k, v and d(out) and the send buffer (K/V once per receiving rank), then
      the send and receive buffers and (reorder) the received parts' reordered copy (the send buffer is
      dropped before the copies, but gloo's work releases it only later: measured alive through them).
    * the kernel: its inputs (q, d(out), k, v in head layout) and dq, dk, dv.
    * dq and the output home: dk/dv, the chunk's output and dq targets [T, Hm, D], and the exchange (dq and the
      output, their reordered copy or the receive buffer, the send buffer).
    * dK/dV home: the two targets, the fp32 sums [T, Km, D] and the exchange of dk/dv (replicated heads are
      received once per replica).
    * back through the projections: dq and the fp32 dK/dV, the projections recomputed with their graph, the
      rotary's d(q), one [T, E] d(input) before it is added to the module's, and the gradient of the chunk's
      slice of the query projection's weight [Hm D, E] before it is added to the weight's (seen with
      `StorageTracker.alive_at_peak`)."""
    i = _busiest_rank(split)
    u, c, k = len(split), split[i][0], split[i][3]
    G, kv_sent = u * T, sum(s[3] for s in split)
    local = T * (2 * Hm + 2 * Km) * D * e
    send = T * (2 * Hm + 2 * kv_sent) * D * e
    recv = G * (2 * c + 2 * k) * D * e
    inputs = max(local + send, send + (1 + reorder) * recv)  # the send buffer counted through the copies
    grads = G * (c + 2 * k) * D * e
    kernel = recv + grads
    targets = 2 * T * Hm * D * e
    dq_home = 2 * G * k * D * e + targets + 4 * G * c * D * e
    dkv = 2 * G * k * D * e
    kv_back = 2 * T * kv_sent * D * e
    # while packed: dk/dv (or their reordered copies) and the send buffer; once packed: the send and receive buffers
    dkv_home = targets + 2 * T * Km * D * FP32_BYTES + max(2 * dkv, dkv + kv_back)
    projections = (
        T * Hm * D * e
        + 2 * T * Km * D * FP32_BYTES
        + T * (Hm + 2 * Km) * D * e
        + T * Hm * D * e
        + T * E * e
        + Hm * D * E * e
    )
    return max(inputs, kernel, dq_home, dkv_home, projections)


def _busiest_rank(split: list[tuple[int, int, int, int]]) -> int:
    """The ulysses rank with the most query heads (then KV heads): the one whose memory is priced."""
    return max(range(len(split)), key=lambda j: (split[j][0], split[j][3]))


def _model_states(
    model: ModelShape, world: int, e: int, fsdp: bool, master: bool = True
) -> tuple[dict[str, int], dict[str, int]]:
    """Model-state bytes held through the step, then the gradients that appear in backward: one block's
    unsharded gradient and its fp32 reduce-scatter input (``block``), the LM head's gradient alive through
    the layers' backward (``lm_head``), those alive in the first layer's backward (``first_layer``: without
    FSDP every gradient but the embedding's has accumulated by then; ``one_layer``, what one layer's adds
    there), the root's at the end of backward
    (``root_end``: both root gradients and their fp32 reduce-scatter input) and, without FSDP, all of
    them (``all``). ``master=False`` (replicated only): weights, gradients and AdamW state in the compute dtype."""
    P, lp, root, head = (
        model.held_params,
        model.held_layer_params,
        2 * model.vocab * model.d_model,
        model.vocab * model.d_model,
    )
    if not fsdp:  # every rank holds all of it (in fp32, or in the compute dtype without master weights); the
        # gradients appear in backward (the LM head's first)
        w = MASTER if master else e
        return (
            {"params": w * P, "adam": 2 * w * P},
            {
                "block": 0,
                "lm_head": w * head,
                "first_layer": w * (P - head),
                "one_layer": w * lp,
                "root_end": 0,
                "all": w * P,
            },
        )
    persistent = {
        "sharded_states": (MASTER + GRAD + ADAM_STATE) * P // world,  # fp32 master weights are the shards
        "unsharded_root": root * e if world > 1 else 0,
        "unsharded_blocks": 2 * lp * e if world > 1 else 0,  # the current block and the prefetched one
    }
    # FSDP2's unsharded gradients are in the compute dtype (the parameters'); the root (embedding, LM head,
    # final norm) reduces once, after the embedding's backward, the last
    grads = {
        "block": lp * max(e, GRAD) if world > 1 else 0,
        "lm_head": head * e if world > 1 else 0,
        "root_end": root * (e + GRAD) if world > 1 else 0,
        "all": 0,
        "one_layer": 0,
    }
    grads["first_layer"] = grads["lm_head"]  # the blocks' gradients are reduce-scattered as each block finishes
    return persistent, grads


def _attention_stage(
    model: ModelShape, split: Split, rank: int, o: MemoryOptions, reorder: bool = True
) -> tuple[int, int, int, int, int]:
    """The attention module: (bytes saved per local token, module forward and backward working sets,
    engine forward and backward working sets), with module-level chunks when the options ask."""
    H, Hkv, D, E = model.heads, model.n_kv, model.head_dim, model.d_model
    e, ulysses, ring, T = split.e, split.ulysses, split.ring, split.local_tokens
    ranges, inner = (
        module_chunks(H, Hkv, ulysses, o.head_chunks) if o.chunk_projections else ([(0, Hkv)], o.head_chunks)
    )
    if len(ranges) == 1:
        return _attention_module(model, split, rank, inner, reorder)
    # module-level chunks (hybrid_cp.engine.modulechunk): forward saves nothing but the module's input; the
    # partial outputs of the output projection add into one [T, E] accumulator; backward recomputes one
    # chunk (its projections and attention) at a time, more of it alive when overlapped
    kv_m = max(b - a for a, b in ranges)
    h_m = kv_m * (H // Hkv)  # the largest chunk's query heads
    chunk = model.model_copy(update={"heads": h_m, "kv_heads": kv_m, "hidden": E})  # its heads, the model's width
    saved_m, fwd_m, bwd_m, engine_fwd, engine_bwd = _attention_module(chunk, split, None, inner, reorder, True)
    in_flight = OVERLAP_IN_FLIGHT if o.overlap else 1.0
    attn_fwd = int(in_flight * fwd_m) + T * E * e
    attn_bwd = int(in_flight * (T * saved_m + bwd_m)) + T * E * e
    split_m = head_split(h_m, kv_m, ulysses)
    if ring == 1 and not o.overlap and min(inner, split_m[_busiest_rank(split_m)][0]) == 1:
        attn_bwd = 2 * T * E * e + _module_chunk_backward(split_m, h_m, kv_m, D, E, e, T, reorder)
    c = head_split(H, Hkv, ulysses)[rank][0]
    kept = H * D * e + ulysses * c * FP32_BYTES if keeps_output(o) else 0  # every chunk's output and lse
    # the module holds them all until it returns (forward and recomputation alike)
    return kept, attn_fwd + T * kept, attn_bwd, engine_fwd, engine_bwd


def keeps_output(o: MemoryOptions) -> bool:
    """Whether module-level chunks keep each chunk's attention output and lse from the forward that saves
    tensors (the layer's recomputation under checkpointing), so that a chunk's backward re-projects its
    Q/K/V but runs no attention forward (UPipe's schedule): one output-sized tensor per layer in exchange
    for one attention forward."""
    return o.keep_attention_output is True or (o.keep_attention_output is None and o.checkpoint)


def module_chunked(model: ModelShape, ulysses: int, o: MemoryOptions) -> bool:
    """Whether ``o`` runs module-level head chunks (from the projections on) for this model and degree."""
    return (
        o.head_chunks > 1
        and o.chunk_projections
        and len(module_chunks(model.heads, model.n_kv, ulysses, o.head_chunks)[0]) > 1
    )


def attention_forwards(model: ModelShape, ulysses: int, o: MemoryOptions) -> int:
    """Attention forwards per layer and step: the forward, the checkpointed layer's recomputation, and with
    module-level chunks that do not keep their output (:func:`keeps_output`) one more in each chunk's
    backward: 2 with checkpointing, 1 without (2 with module chunks that keep nothing)."""
    return 1 + int(o.checkpoint) + int(module_chunked(model, ulysses, o) and not keeps_output(o))


def _mlp_stage(T: int, E: int, inter: int, n_mlp: int, e: int, tiled_mlp: int) -> tuple[int, int]:
    """The MLP's forward and backward working sets: whole, or one chunk of ``tiled_mlp`` tokens."""
    if not tiled_mlp:
        return (n_mlp + 1) * T * inter * e + T * E * e, 2 * T * inter * e + T * inter * max(e, 4) + T * E * e
    C = min(tiled_mlp, T)
    fwd = max(T * E * e + 3 * C * inter * e - C * E * e, 2 * T * E * e)
    # d(output) coming in and d(input) going out, the fp32 weight-gradient sums and one chunk's working set
    bwd = 2 * T * E * e + 2 * n_mlp * E * inter * max(e, 4) + int(TILED_MLP_BWD_CHUNKS * C * inter * e)
    return fwd, bwd


def _loss_stage(T: int, E: int, V: int, e: int, o: MemoryOptions) -> tuple[int, int]:
    """The loss's forward and backward working sets: full ``[tokens, vocab]`` logits, or one chunk."""
    if not o.tiled_loss:
        return T * V * e + T * V * 4 + (T * V * 4 if e < 4 else 0), 2 * T * V * 4 + (T * V * e if e < 4 else 0)
    C = min(o.loss_chunk or max(1, LOSS_CHUNK_BYTES // (4 * max(1, V))), T)
    fwd = C * V * max(e, 4) + (C * V * e if e < 4 else 0)
    bwd = (
        C * V * 4
        + (2 * C * V * e if e < 4 else 0)  # one fp32 buffer: logits, probs, d(logits)
        + V * E * 4
        + (V * E * e if e < 4 else 0)  # fp32 weight-gradient accumulator (+ cast)
        + T * E * e
    )  # d(hidden)
    return fwd, bwd


def _activations(
    model: ModelShape, T: int, e: int, attn_saved: int, mlp_saved: int, o: MemoryOptions, linear_saved: int = 0
) -> dict[str, int]:
    """What is alive of the activations, by term: one layer's saved tensors (``layer``), the final norm's
    (``final_norm``, freed by its backward, which runs before the last layer's), the layer inputs kept on
    the device (``inputs``: the other layers' saved tensors without checkpointing, every checkpointed
    input with it, none when offloaded), the previous layer's input prefetched from host memory while a
    layer runs backward (``fetched``), and the rotary cos/sin tables every layer reads (``rotary``).

    A hybrid's linear layers save their mixer's tensors (``linear_saved``, the rank's bytes: `_linear_saved`)
    where a softmax layer saves the attention's (``attn_saved`` per token); ``layer`` is then the larger of the
    two kinds (the one priced in backward: an upper bound when the last layer is of the other kind)."""
    E, L = model.d_model, model.layers
    # a checkpointed layer's own input is counted in `inputs` unless offloaded: then the norm that keeps it
    # keeps the fetched copy (a stock norm keeps its fp32 upcast instead and the fetched copy dies)
    first_norm = _norm(e, o, input_kept=o.checkpoint and not o.offload_checkpoints)
    common = T * ((first_norm + _norm(e, o)) * E + mlp_saved)
    kinds = [(model.attention_layers, common + T * attn_saved), (model.linear_layers, common + linear_saved)]
    layer = max(size for count, size in kinds if count)
    if not o.checkpoint:
        inputs = sum(count * size for count, size in kinds) - layer  # the other layers' saved tensors
    else:
        inputs = 0 if o.offload_checkpoints else L * T * E * e
    return {
        "layer": layer,
        "final_norm": T * _norm(e, o) * E,
        "inputs": inputs,
        "fetched": T * E * e if o.offload_checkpoints and o.prefetch else 0,
        "rotary": T * 2 * model.head_dim * e,
    }


def host_bytes(
    model: ModelShape,
    seq_len: int,
    ulysses: int = 1,
    ring: int = 1,
    batch: int = 1,
    options: MemoryOptions | None = None,
    *,
    dtype: Any = "bf16",
    layout: str = "zigzag",
) -> int:
    """Host memory one rank needs for its offloaded checkpoints: one buffer per layer input (the first
    one included: the runtime offloads them all), 0 without offload. Pinned buffers come from PyTorch's
    caching host allocator, which rounds each request up to a power of two (ATen/core/
    CachingHostAllocator.h, by default for every size): 5 GiB layer inputs take 8 GiB buffers."""
    o = options or MemoryOptions()
    if not o.offload_checkpoints:
        return 0
    T = batch * make_layout(layout, ulysses, ring, seq_len=seq_len).local_len
    one = T * model.d_model * dtype_bytes(dtype)
    return model.layers * (1 << (one - 1).bit_length() if o.pin_memory else one)


def step_memory(  # noqa: PLR0913 (public entry point)
    model: ModelShape,
    seq_len: int,
    ulysses: int = 1,
    ring: int = 1,
    dp: int = 1,
    batch: int = 1,
    options: MemoryOptions | None = None,
    *,
    dtype: Any = "bf16",
    layout: str = "zigzag",
    ulysses_rank: int | None = None,
) -> MemoryEstimate:
    """Predicted peak memory of one rank for one training step (forward, backward, AdamW step) of
    ``batch`` sequences of ``seq_len`` tokens on a (ulysses, ring) mesh with ``dp`` replicas.

    ``dtype`` is the compute/activation dtype (bf16: FSDP2 mixed precision with fp32 master weights;
    fp32: everything fp32). Head counts that ``ulysses`` does not divide are priced for the rank with
    the most heads (or ``ulysses_rank``).
    """
    o = options or MemoryOptions()
    check_counts(seq_len=seq_len, ulysses=ulysses, ring=ring, dp=dp, batch=batch)
    e, world = dtype_bytes(dtype), dp * ulysses * ring
    E, V, inter = model.d_model, model.vocab, model.intermediate or 4 * model.d_model
    n_mlp = 3 if (model.gated_mlp or model.intermediate is None) else 2
    split = Split(seq_len, ulysses, ring, dp, batch, dtype, layout)
    rank = _busiest_rank(head_split(model.heads, model.n_kv, ulysses)) if ulysses_rank is None else ulysses_rank
    local = split.lay.local_len
    T = split.local_tokens
    persistent, grads = _model_states(model, world, e, o.fsdp, o.master_weights)
    # whether the layout's gathered token order differs from the ring block's (a property of the layout, not
    # of the length: checked on the smallest sequence it takes); if so the engine caches the two int64 row
    # permutations between them (hybrid_cp.engine.layout._perm) from the first attention call on
    reorder = make_layout(layout, ulysses, ring, seq_len=2 * ulysses * ring).gathered_rows() is not None
    if reorder:
        persistent["layout_perms"] = 2 * ulysses * local * 8
    attn_saved, attn_fwd, attn_bwd, engine_fwd, engine_bwd = _attention_stage(model, split, rank, o, reorder)
    mlp_saved = 0 if o.tiled_mlp else (n_mlp + 1) * inter * e
    lin = (
        _linear_saved(model, make_layout(layout, ulysses, ring, seq_len=seq_len), ulysses * ring, batch, e)
        if model.linear_layers
        else (0, 0, 0)
    )
    acts = _activations(model, T, e, attn_saved, mlp_saved, o, lin[0])
    mlp_fwd, mlp_bwd = _mlp_stage(T, E, inter, n_mlp, e, o.tiled_mlp)
    loss_fwd, loss_bwd = _loss_stage(T, E, V, e, o)
    stages = {
        "engine_fwd": int(engine_fwd),
        "engine_bwd": int(engine_bwd),
        "attention_fwd": int(attn_fwd),
        "attention_bwd": int(attn_bwd),
        "mlp_fwd": int(mlp_fwd),
        "mlp_bwd": int(mlp_bwd),
        "loss_fwd": int(loss_fwd),
        "loss_bwd": int(loss_bwd),
    }
    if model.linear_layers:
        stages.update(linear_fwd=lin[1], linear_bwd=lin[2])
    if o.checkpoint:  # the recomputed layer's forward runs inside backward, before its own backward
        stages["recompute"] = int(max(attn_fwd, mlp_fwd, stages.get("linear_fwd", 0)))
    phases = _phases(model, split, o, persistent, grads, acts, stages, mlp_saved)
    notes = []
    host = host_bytes(model, seq_len, ulysses, ring, batch, o, dtype=dtype, layout=layout)
    if host:
        notes.append(f"{host / GiB:.1f} GiB of checkpointed layer inputs in host memory")
    persistent = {kk: int(v) for kk, v in persistent.items()}
    persistent["activations"] = int(sum(acts.values()))
    return MemoryEstimate(
        peak=int(max(phases.values())),
        persistent=persistent,
        stages=stages,
        phases={kk: int(v) for kk, v in phases.items()},
        local_tokens=T,
        notes=tuple(notes),
        host=int(host),
        activations={kk: int(v) for kk, v in acts.items()},
    )


# A linear layer's mixer (docs/linear.md "Memory"), counted from the engine's tensors (recurrence.causal_conv and
# linear_scan, integrations/linear_layers.py) and from what transformers' torch chunked kernels, the engine's
# kernels on every device today, save. The kernels' bytes per value head (Gated DeltaNet) or head (Mamba2) and
# token of one run were measured with StorageTracker on the kernels alone, every input requiring a gradient and
# q|k|v (x|B|C) views of one convolution output as in the model, over 10 shapes each: Gated DeltaNet exact in
# bf16 and in fp32 (where it keeps 16 dk more, and 4 dv + 4 more again with as many key heads as value heads),
# Mamba2 within 2% (it keeps x, B and C, views of the convolution output, so that output's share per head,
# 4 P + 8 G N / H in fp32). Their working sets above that (forward, backward) are upper fits of the same
# measurements (within about 10%, some shapes up to 30% over). w: the run's value width, dv, or dv + dk on
# probed runs; C: the kernel's chunk; P, N: Mamba2's head dim and state size.


def _linear_saved(model: ModelShape, lay: Any, size: int, batch: int, e: int) -> tuple[int, int, int]:
    """A linear layer's mixer on the busiest rank: (bytes it saves for backward, its forward and backward working
    sets above that). Saved: `linear_mixer_saved` per batch row, and the gathered summaries with the states
    composed from them (the composition's products keep them). Forward: during the last run's kernel, its
    working set, the earlier runs' outputs and (Gated DeltaNet) the convolution's output; backward: one run's
    kernel working set with the gradients of the kernel output and the convolution; both less what the mixer
    saves after the kernels, and backward adds the summaries' gradient and the reduce-scatter's buffer."""
    h, c, E = model.linear_heads, model.linear_conv_channels, model.d_model
    state = FP32_BYTES if e <= FP32_BYTES else e
    summaries = linear_summary_bytes(lay, size, batch, model, state)
    states = summaries * model.linear_value_dim * model.linear_key_dim * h // max(1, model.linear_state_numel)
    probed_extra = linear_mixer_token_bytes(model, e)[1]
    inner = h * model.linear_value_dim
    gated = model.linear_kind == "gated_delta"
    # saved after the kernels (the gated norm and the output projection's input; the corrections), which the
    # kernels' working sets do not overlap in forward, and which backward frees before it reaches the kernels
    post = inner * (12 + 3 * e if gated else 16 + e)
    best = (0, 0, 0)
    for rank in range(size):
        runs = linear_runs(lay, size, rank)
        T = sum(n for n, _ in runs)
        kern = [(n, linear_kernel_bytes(model, p, e), p) for n, p in runs]
        extra = sum(n * probed_extra for n, _, p in kern if p)
        saved = linear_mixer_saved(model, runs, e)
        # during the last run's kernel: its working set, the earlier runs' outputs, Gated DeltaNet's conv output
        fwd = (
            max(n * h * k[1] for n, k, _ in kern)
            + T * inner * (e if gated else FP32_BYTES)
            + (T * c * e if gated else 0)
        )
        bwd = max(n * h * k[2] for n, k, _ in kern) + T * (inner * FP32_BYTES + c * e)
        fwd, bwd = max(0, fwd - T * post - extra), max(T * (2 * c + E) * e, bwd - T * post - extra)
        cand = (batch * saved + summaries + states, batch * fwd, batch * bwd + 2 * summaries)
        best = max(best, cand)
    return best


def _phases(
    model: ModelShape,
    split: Split,
    o: MemoryOptions,
    persistent: dict[str, int],
    grads: dict[str, int],
    acts: dict[str, int],
    stages: dict[str, int],
    mlp_saved: int,
) -> dict[str, int]:
    """The candidate peaks: the last layer's forward, the loss, the last layer's backward (the first in
    backward: the most activations alive), the first layer's (the most gradients alive), the root's
    gradients at the end of backward, the optimizer."""
    T, e, world = split.local_tokens, split.e, split.world
    E, V, inter = model.d_model, model.vocab, model.intermediate or 4 * model.d_model
    base = sum(persistent.values())
    shards = world if o.fsdp else 1
    largest = max(V * E, E * inter, model.heads * model.head_dim * E) // shards
    w = FP32_BYTES if o.master_weights else e  # the optimizer's element size
    optimizer_temp = w * model.held_params // shards
    layer, final, fetched = acts["layer"], acts["final_norm"], acts["fetched"]
    inputs = acts["inputs"] + acts["rotary"]
    # the MLP's backward runs with the whole layer's saved tensors alive; the attention's after the MLP's
    # and the second norm's saved tensors are freed
    layer_bwd = (
        max(
            layer + stages["mlp_bwd"],
            layer - T * (mlp_saved + _norm(e, o) * E) + max(stages["attention_bwd"], stages.get("linear_bwd", 0)),
        )
        + grads["block"]
    )
    before_norm = inputs + (0 if o.checkpoint else layer)  # the layers' part when the final norm runs
    current = T * E * e if o.offload_checkpoints else 0  # the running layer's input, offloaded but still held
    phases = {
        "forward": base
        + before_norm
        + current
        + (0 if o.checkpoint else final)
        + max(stages["attention_fwd"], stages["mlp_fwd"], stages.get("linear_fwd", 0)),
        "loss": base
        + before_norm
        + final
        + (0 if o.tiled_loss else T * V * 4)
        + max(stages["loss_fwd"], stages["loss_bwd"]),
        "last_layer_backward": base + inputs + fetched + grads["lm_head"] + layer_bwd,
        # the first layer's backward: its own input only (nothing left to prefetch), the gradients so far
        "first_layer_backward": base
        + acts["rotary"]
        + (T * E * e if o.checkpoint and not o.offload_checkpoints else 0)
        + grads["first_layer"]
        + layer_bwd,
        "optimizer": base + grads["all"] + (optimizer_temp if o.foreach_optimizer else 2 * w * largest),
    }
    if o.offload_checkpoints and o.prefetch and model.layers > 1:
        # the second layer's backward: the first one's input prefetched, and (replicated weights) every
        # gradient but the first layer's and the embedding's: above both neighbours when a layer's
        # gradients weigh less than its input
        phases["second_layer_backward"] = phases["first_layer_backward"] + fetched - grads["one_layer"]
    if grads["root_end"]:
        phases["root_gradients"] = base + grads["root_end"]
    return phases
