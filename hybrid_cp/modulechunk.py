"""Module-level head chunks, pipelined: each chunk of an attention module projects only its heads,
exchanges them, runs the ring and sends its output back, and chunk i + 1's projection and
all-to-all run while chunk i's ring computes, in forward and in backward.

Why a Function that owns the chunk loop: with the module's own forward run once per chunk (each under
checkpointing) the chunks can only run one after another, because the module calls attention in
the middle of its forward. Here the loop asks `project(j, tensors)` for chunk j's Q/K/V (the
integration runs the module's own code up to its attention call, so projections, norms and rotary
embeddings stay the model's), and owns everything after it, so it can post chunk j + 1's exchange
before chunk j's ring. The output projection is linear in the heads: each chunk applies its columns.

Memory, as with checkpointed chunks: forward keeps the module's inputs only. Backward takes one chunk
at a time: it recomputes the chunk's projections (values only, for the exchange) and its attention
forward (for the output and lse), runs the ring backward, and back-propagates through the projections
recomputed once more with their graph, so one chunk's graph exists at a time. Overlapped, one more
stage is in flight (its exchange buffers) and the previous chunk's results are still landing.

Stages: a module chunk may itself be cut into engine-level chunks (`topology.layouts.module_chunks`
says how many: when whole GQA groups leave too few chunks); stage (j, e) is engine chunk e of module
chunk j, and the pipeline runs over the stages in order (K/V travel once per module chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .attention import checked_call
from .comm import acc_dtype
from .headchunk import HeadChunks, chunk_heads, drive, _post_head_to_seq, _post_seq_to_head
from .heads import HeadSplit, head_split
from .ring import block_plan, ring_backward, ring_forward

if TYPE_CHECKING:
    from .mesh import CPMesh

__all__ = ["Projected", "pipelined_module_chunks"]


@dataclass
class Projected:
    """One module chunk's local Q [B, S, h, D], K/V [B, S, h_kv, D] and the hcp.attention keywords the
    module's attention call would have used (causal, softmax_scale, seq_len, cu_seqlens, window)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    call: dict[str, Any]


@dataclass
class _Chunk:
    """A module chunk while it is in flight: its tensors, head split, stages and engine plan."""

    j: int
    x: Projected | None   # None once the chunk's last stage is posted
    split: HeadSplit
    stages: HeadChunks
    lay: Any
    kernel: Any
    plan: Any
    scale: float
    kh: torch.Tensor | None = None
    vh: torch.Tensor | None = None
    out: torch.Tensor | None = None       # the chunk's attention output, back in sequence layout
    dout: torch.Tensor | None = None      # backward: d(out) of the chunk's heads
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self.q_like = torch.empty(0, dtype=self.x.q.dtype, device=self.x.q.device)   # for late allocations
        self.q_shape, self.kv_shape = self.x.q.shape, self.x.k.shape


class _Engine:
    """Per module chunk: the layout, kernel, plan and head split of its attention (forward checks the
    call once per chunk, across ranks with `cp.validate`; backward reuses them)."""

    def __init__(self, cp: "CPMesh", engine_chunks: int, needs_grad: int):
        self.cp, self.engine_chunks, self.needs_grad = cp, engine_chunks, needs_grad
        self.per_chunk: dict[int, tuple] = {}

    def chunk(self, j: int, x: Projected) -> _Chunk:
        cp = self.cp
        if j not in self.per_chunk:
            c = x.call
            lay, kernel, window = checked_call(x.q, x.k, x.v, cp, c["causal"], c.get("softmax_scale"), "auto",
                                               c.get("seq_len"), c.get("cu_seqlens"), c.get("window"), 1,
                                               self.needs_grad)
            split = head_split(x.q.shape[2], x.k.shape[2], cp.ulysses_size)
            plan = block_plan(lay, cp.ring_rank, c["causal"], x.q.device, window)
            scale = c.get("softmax_scale")
            scale = float(scale) if scale is not None else x.q.shape[-1] ** -0.5
            self.per_chunk[j] = (split, self.stages(split), lay, kernel, plan, scale)
        return _Chunk(j, x, *self.per_chunk[j])

    def stages(self, split: HeadSplit) -> HeadChunks:
        return chunk_heads(split, self.engine_chunks, self.cp.ulysses_rank)


def _post_inputs(cp: "CPMesh", c: _Chunk, e: int, parts: list[torch.Tensor], stage: str):
    """Post stage e of module chunk c: `parts` (query-sized, sequence layout) for the stage's query heads,
    and with its first stage the chunk's K/V (they travel once per module chunk). After the chunk's last
    stage is posted its local Q/K/V are dropped (the send buffer holds what is still travelling)."""
    r = c.stages.q[e]
    ranges = [r] * len(parts)
    if e == 0:
        parts, ranges = parts + [c.x.k, c.x.v], ranges + [c.split.kv, c.split.kv]
    flight = _post_seq_to_head(cp, c.lay, parts, ranges, stage)
    if e + 1 == c.stages.count:
        c.x = None
    return flight


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, project, q_ranges, kv_counts, engine, overlap, n_in, *tensors):
        cp = engine.cp
        w_o, b_o = tensors[-2], tensors[-1]
        counts = [engine.stages(head_split(qb - qa, n, cp.ulysses_size)).count
                  for (qa, qb), n in zip(q_ranges, kv_counts)]
        chunks: dict[int, _Chunk] = {}
        y = []

        def post(stage):
            j, e = stage
            if j not in chunks:
                chunks[j] = engine.chunk(j, project(j, tensors))
            c = chunks[j]
            return _post_inputs(cp, c, e, [c.x.q], "ulysses_fwd")

        def compute(stage, got):
            j, e = stage
            c = chunks[j]
            if e == 0:
                c.kh, c.vh = got[1], got[2]
            lo, hi = c.stages.kv_local[e]
            out_h, _, _ = ring_forward(cp, c.kernel, got[0], c.kh[:, :, lo:hi], c.vh[:, :, lo:hi],
                                       list(c.stages.kv_index[e]), c.plan, scale=c.scale)
            del got
            if c.out is None:
                c.out = c.q_like.new_empty(c.q_shape)
            landed = [_post_head_to_seq(cp, c.lay, [out_h], [c.stages.q[e]], [c.out], "ulysses_fwd")]
            if e + 1 < c.stages.count:
                return landed, None
            del chunks[j]   # its Q/K/V and exchanged K/V go with its last stage; the output follows when landed
            c.kh = c.vh = None
            return landed, c

        def finish(c):   # the output projection of the chunk's heads (the bias once)
            qa, qb = q_ranges[c.j]
            d = c.out.shape[-1]
            part = F.linear(c.out.flatten(2), w_o[:, qa * d:qb * d], b_o if not y else None)
            c.out = None
            y.append(part if not y else y.pop().add_(part))

        drive(_stages(counts), post, compute, overlap, finish)
        ctx.save_for_backward(*tensors[:n_in])
        ctx.params = tensors[n_in:]   # parameters: by reference (FSDP2 re-fills their storage for backward)
        ctx.args = (project, q_ranges, counts, engine, overlap)
        return y[0]

    @staticmethod
    def backward(ctx, dy):
        project, q_ranges, counts, engine, overlap = ctx.args
        cp = engine.cp
        # leaves of the recomputed projections: every chunk's gradients accumulate into their .grad in place
        tensors = [x.detach().requires_grad_(x.requires_grad) if x is not None else None
                   for x in (*ctx.saved_tensors, *ctx.params)]
        w_o, b_o = tensors[-2], tensors[-1]
        wanted = [t for t in tensors[:-2] if t.requires_grad]
        dw_o = torch.empty_like(w_o) if w_o.requires_grad else None
        chunks: dict[int, _Chunk] = {}
        dy2 = dy.reshape(-1, dy.shape[-1])

        def post(stage):
            j, e = stage
            if j not in chunks:   # the values only: the projections' graph is built again in finish()
                with torch.no_grad():
                    x = project(j, tensors)
                c = chunks[j] = engine.chunk(j, x)
                qa, qb = q_ranges[j]
                d = x.q.shape[-1]
                c.dout = F.linear(dy, w_o[:, qa * d:qb * d].t()).view(x.q.shape)
            c = chunks[j]
            flight = _post_inputs(cp, c, e, [c.x.q, c.dout], "ulysses_bwd")
            if c.x is None:   # the chunk's last stage is posted: its d(out) travels in the send buffer
                c.dout = None
            return flight

        def compute(stage, got):
            j, e = stage
            c = chunks[j]
            qh, doh = got[0], got[1]
            if e == 0:
                c.kh, c.vh = got[2], got[3]
            del got
            lo, hi = c.stages.kv_local[e]
            kh, vh, kv_index = c.kh[:, :, lo:hi], c.vh[:, :, lo:hi], list(c.stages.kv_index[e])
            oh, lse, halo = ring_forward(cp, c.kernel, qh, kh, vh, kv_index, c.plan, scale=c.scale)  # recomputed
            dqh, dkh, dvh = ring_backward(cp, c.kernel, doh, qh, kh, vh, oh, lse, kv_index, c.plan, halo,
                                          scale=c.scale)
            del qh, doh, lse
            acc = acc_dtype(dkh.dtype)
            if c.stages.count > 1:   # engine stages of one module chunk share its K/V: sum their gradients in fp32
                if "kv_h" not in c.grads:
                    c.grads["kv_h"] = torch.zeros(2, *c.kh.shape, dtype=acc, device=dkh.device)
                dkv = c.grads["kv_h"]
                dkv[0][:, :, lo:hi] += dkh
                dkv[1][:, :, lo:hi] += dvh
                dkh, dvh = dkv[0], dkv[1]
            if c.out is None:
                c.out, c.grads["q"] = c.q_like.new_empty(c.q_shape), c.q_like.new_empty(c.q_shape)
            landed = [_post_head_to_seq(cp, c.lay, [dqh, oh], [c.stages.q[e]] * 2, [c.grads["q"], c.out],
                                        "ulysses_bwd")]
            del dqh, oh
            if e + 1 < c.stages.count:
                return landed, None
            # dK/dV go home once per module chunk; replicated KV heads (H_kv < u) sum their replicas in fp32
            c.grads["k"], c.grads["v"] = (torch.zeros(c.kv_shape, dtype=acc, device=dkh.device) for _ in range(2))
            landed.append(_post_head_to_seq(cp, c.lay, [dkh, dvh], [c.split.kv, c.split.kv],
                                            [c.grads["k"], c.grads["v"]], "ulysses_bwd", accumulate=True))
            del chunks[j], dkh, dvh
            c.grads.pop("kv_h", None)
            c.kh = c.vh = None
            return landed, c

        def finish(c):
            """A chunk's results have landed: the output projection's weight gradient for its heads, and
            dq/dk/dv back through its projections (recomputed with their graph just for this: one chunk's
            graph at a time)."""
            qa, qb = q_ranges[c.j]
            d = c.out.shape[-1]
            if dw_o is not None:
                dw_o[:, qa * d:qb * d] = dy2.t() @ c.out.reshape(-1, (qb - qa) * d)
            c.out = None
            g = c.grads
            with torch.enable_grad():
                x = project(c.j, tensors)
                # one output at a time: the input's gradient from each projection adds into .grad in place,
                # instead of autograd summing three [tokens, hidden] gradients out of place
                for i, (out, grad) in enumerate(((x.q, g["q"]), (x.k, g["k"]), (x.v, g["v"]))):
                    torch.autograd.backward(out, grad.to(out.dtype), inputs=wanted, retain_graph=i < 2)
            del x, g, c.grads

        drive(_stages(counts), post, compute, overlap, finish)
        grads = [t.grad if t is not None and t.requires_grad else None for t in tensors[:-2]]
        db_o = dy2.sum(0) if b_o is not None and b_o.requires_grad else None
        return (None, None, None, None, None, None, *grads, dw_o, db_o)


def _stages(counts: Sequence[int]) -> list[tuple[int, int]]:
    return [(j, e) for j, n in enumerate(counts) for e in range(n)]


def pipelined_module_chunks(project: Callable[[int, Sequence[torch.Tensor]], Projected],
                            q_ranges: Sequence[tuple[int, int]], kv_counts: Sequence[int], cp: "CPMesh",
                            engine_chunks: int, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                            o_weight: torch.Tensor, o_bias: torch.Tensor | None, *,
                            overlap: bool | None = None) -> torch.Tensor:
    """The output of an attention module whose heads run in module chunks: its output projection
    (`o_weight`, `o_bias`) applied to the attention output [B, S_local, H, D] of all chunks.

    `project(j, tensors)` returns chunk j's `Projected` computed from `tensors` (= `inputs`, `params`,
    `o_weight`, `o_bias`, in that order: in backward the inputs are detached copies and the parameters
    the same, recomputed with gradients enabled); `inputs` are all the tensors `project` needs besides
    parameters (saved through autograd, so that checkpointing manages them: `project` must hold no
    tensor of its own); `q_ranges[j]` are chunk j's query heads among the module's H and `kv_counts[j]`
    its KV heads. Gradients reach every tensor that requires them.
    `overlap=None` uses `hybrid_cp.headchunk.OVERLAP`.
    """
    from . import headchunk

    overlap = headchunk.OVERLAP if overlap is None else bool(overlap)
    tensors = [*inputs, *params, o_weight, o_bias]
    needs_grad = int(torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    engine = _Engine(cp, engine_chunks, needs_grad)
    return _Pipelined.apply(project, tuple(q_ranges), tuple(kv_counts), engine, overlap, len(inputs), *tensors)
