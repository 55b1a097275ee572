"""Module-level head chunks, pipelined: each chunk of an attention module projects only its heads,
exchanges them, runs the ring and sends its output back, and chunk i + 1's projection and
all-to-all run while chunk i's ring computes, in forward and in backward.

Why a Function that owns the chunk loop: with the module's own forward run once per chunk (each under
checkpointing) the chunks can only run one after another, because the module calls attention in
the middle of its forward. Here the loop asks `project(j, tensors)` for chunk j's Q/K/V (the
integration runs the module's own code up to its attention call, so projections, norms and rotary
embeddings stay the model's), and owns everything after it, so it can post chunk j + 1's exchange
before chunk j's ring. The output projection runs once on all heads, outside (it is linear in them).

Memory, as with checkpointed chunks: forward keeps the module's inputs, the attention output of all
local heads (which the output projection keeps anyway) and each stage's lse; Q/K/V exist for one
chunk at a time, two while the next one's exchange is in flight. Backward recomputes one chunk's
projections at a time, exchanges q, out and d(out) per stage (`hybrid_cp/headchunk.py`'s schedule)
and K/V once per module chunk, and back-propagates through the projections when that chunk's
gradients have landed, while the next chunk's ring runs.

Stages: a module chunk may itself be cut into engine-level chunks (`topology.layouts.module_chunks`
says how many: when whole GQA groups leave too few chunks); stage (j, e) is engine chunk e of module
chunk j, and the pipeline runs over the stages in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .attention import checked_call
from .comm import acc_dtype
from .headchunk import HeadChunks, chunk_heads, _post_head_to_seq, _post_seq_to_head
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
    x: Projected
    split: HeadSplit
    stages: HeadChunks
    lay: Any
    kernel: Any
    plan: Any
    scale: float
    kh: torch.Tensor | None = None
    vh: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


class _Engine:
    """What forward learns per module chunk and backward reuses (layout, kernel, plan, scale, split)."""

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
            stages = chunk_heads(split, self.engine_chunks, cp.ulysses_rank)
            plan = block_plan(lay, cp.ring_rank, c["causal"], x.q.device, window)
            scale = c.get("softmax_scale")
            scale = float(scale) if scale is not None else x.q.shape[-1] ** -0.5
            self.per_chunk[j] = (split, stages, lay, kernel, plan, scale)
        return _Chunk(j, x, *self.per_chunk[j])


def _stages(counts: Sequence[int]) -> list[tuple[int, int]]:
    return [(j, e) for j, n in enumerate(counts) for e in range(n)]


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, project, q_ranges, engine, overlap, n_in, *tensors):
        cp = engine.cp
        out = None
        chunks: dict[int, _Chunk] = {}
        lses, halos, counts = {}, {}, []

        def post(stage):
            j, e = stage
            if j not in chunks:
                chunks[j] = engine.chunk(j, project(j, tensors))
                counts.append(chunks[j].stages.count)
            c = chunks[j]
            parts, ranges = [c.x.q], [c.stages.q[e]]
            if e == 0:   # K/V of a module chunk travel once, with its first stage's queries
                parts, ranges = parts + [c.x.k, c.x.v], ranges + [c.split.kv, c.split.kv]
            return _post_seq_to_head(cp, c.lay, parts, ranges, "ulysses_fwd")

        stage, flight, back = (0, 0), None, []
        flight = post(stage)
        while stage is not None:
            j, e = stage
            c = chunks[j]
            got = flight.wait()
            if e == 0:
                c.kh, c.vh = got[1], got[2]
            qh = got[0]
            if out is None:
                b, s, _, d = c.x.q.shape
                out = c.x.q.new_empty(b, s, q_ranges[-1][1], d)
            nxt = (j, e + 1) if e + 1 < c.stages.count else (j + 1, 0) if j + 1 < len(q_ranges) else None
            if overlap and nxt is not None:   # the next stage's projection and exchange run while this one computes
                flight = post(nxt)
            lo, hi = c.stages.kv_local[e]
            out_h, lses[stage], halos[stage] = ring_forward(cp, c.kernel, qh, c.kh[:, :, lo:hi], c.vh[:, :, lo:hi],
                                                            list(c.stages.kv_index[e]), c.plan, scale=c.scale)
            del qh, got
            qa, qb = q_ranges[j]
            landed = _post_head_to_seq(cp, c.lay, [out_h], [c.stages.q[e]], [out[:, :, qa:qb]], "ulysses_fwd")
            del out_h
            if nxt is None or nxt[0] != j:
                del chunks[j]   # this module chunk's Q/K/V and exchanged K/V go with its last stage
                c = None
            if overlap:   # at most one stage's output in flight
                for f in back:
                    f.wait()
                back = [landed]
            else:
                landed.wait()
                if nxt is not None:
                    flight = post(nxt)
            stage = nxt
        for f in back:
            f.wait()
        ctx.save_for_backward(out, *tensors[:n_in])
        ctx.params = tensors[n_in:]   # parameters: by reference (FSDP2 re-fills their storage for backward)
        ctx.args = (project, q_ranges, engine, overlap, lses, halos, counts)
        return out

    @staticmethod
    def backward(ctx, dout):
        out, *inputs = ctx.saved_tensors
        project, q_ranges, engine, overlap, lses, halos, counts = ctx.args
        cp = engine.cp
        dout = dout.contiguous()
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        tensors = [*inputs, *ctx.params]
        wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
        total: list[torch.Tensor | None] = [None] * len(tensors)
        chunks: dict[int, _Chunk] = {}
        order = _stages(counts)

        def post(stage):
            j, e = stage
            if j not in chunks:
                with torch.enable_grad():
                    x = project(j, tensors)
                c = chunks[j] = engine.chunk(j, x)
                acc = acc_dtype(x.q.dtype)
                c.grads = {"q": torch.empty_like(x.q), "k": torch.zeros(x.k.shape, dtype=acc, device=x.k.device),
                           "v": torch.zeros(x.v.shape, dtype=acc, device=x.v.device)}
            c = chunks[j]
            qa, qb = q_ranges[j]
            r = c.stages.q[e]
            parts, ranges = [c.x.q.detach(), out[:, :, qa:qb], dout[:, :, qa:qb]], [r, r, r]
            if e == 0:
                parts, ranges = parts + [c.x.k.detach(), c.x.v.detach()], ranges + [c.split.kv, c.split.kv]
            return _post_seq_to_head(cp, c.lay, parts, ranges, "ulysses_bwd")

        def finish(c: _Chunk):
            """Back-propagate a module chunk's dq/dk/dv through its projections (all its gradients have landed)."""
            x, g = c.x, c.grads
            grads = torch.autograd.grad([x.q, x.k, x.v], [tensors[i] for i in wanted],
                                        [g["q"], g["k"].to(x.k.dtype), g["v"].to(x.v.dtype)], allow_unused=True)
            for i, gi in zip(wanted, grads):
                if gi is not None:
                    total[i] = gi if total[i] is None else total[i] + gi

        flight, back, done = post(order[0]), [], None
        for at, stage in enumerate(order):
            j, e = stage
            c = chunks[j]
            got = flight.wait()
            qh, oh, doh = got[:3]
            if e == 0:
                c.kh, c.vh = got[3], got[4]
                c.grads["kv_h"] = torch.zeros(2, *c.kh.shape, dtype=acc_dtype(c.kh.dtype), device=c.kh.device)
            nxt = order[at + 1] if at + 1 < len(order) else None
            if overlap and nxt is not None:
                flight = post(nxt)
            lo, hi = c.stages.kv_local[e]
            dqh, dkh, dvh = ring_backward(cp, c.kernel, doh, qh, c.kh[:, :, lo:hi], c.vh[:, :, lo:hi], oh, lses[stage],
                                          list(c.stages.kv_index[e]), c.plan, halos[stage], scale=c.scale)
            del qh, oh, doh, got
            dkv = c.grads["kv_h"]
            dkv[0][:, :, lo:hi] += dkh
            dkv[1][:, :, lo:hi] += dvh
            del dkh, dvh
            landed = [_post_head_to_seq(cp, c.lay, [dqh], [c.stages.q[e]], [c.grads["q"]], "ulysses_bwd")]
            del dqh
            last = nxt is None or nxt[0] != j
            if last:   # dK/dV go home once per module chunk; replicated KV heads sum their replicas in fp32
                landed.append(_post_head_to_seq(cp, c.lay, [dkv[0], dkv[1]], [c.split.kv, c.split.kv],
                                                [c.grads["k"], c.grads["v"]], "ulysses_bwd", accumulate=True))
                c.kh = c.vh = None
                del chunks[j], dkv, c.grads["kv_h"]
            if overlap:   # the previous stage's gradients land; a finished chunk back-propagates meanwhile
                for f in back:
                    f.wait()
                if done is not None:
                    finish(done)
                back, done = landed, (c if last else None)
            else:
                for f in landed:
                    f.wait()
                if last:
                    finish(c)
                if nxt is not None:
                    flight = post(nxt)
            c = None
        for f in back:
            f.wait()
        if done is not None:
            finish(done)
        return (None, None, None, None, None, *total)


def pipelined_module_chunks(project: Callable[[int, Sequence[torch.Tensor]], Projected],
                            q_ranges: Sequence[tuple[int, int]], cp: "CPMesh", engine_chunks: int,
                            inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor], *,
                            overlap: bool | None = None) -> torch.Tensor:
    """Attention output [B, S_local, H, D] of an attention module whose heads run in module chunks.

    `project(j, tensors)` returns chunk j's `Projected` computed from `tensors` (= `inputs` then
    `params`, in that order: in backward they are detached inputs and the same parameters, recomputed
    with gradients enabled); `q_ranges[j]` are chunk j's query heads among the module's H. Gradients
    reach every tensor of `inputs` and `params` that requires them. `overlap=None` uses
    `hybrid_cp.headchunk.OVERLAP`.
    """
    from . import headchunk

    overlap = headchunk.OVERLAP if overlap is None else bool(overlap)
    tensors = [*inputs, *params]
    needs_grad = int(torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    engine = _Engine(cp, engine_chunks, needs_grad)
    return _Pipelined.apply(project, tuple(q_ranges), engine, overlap, len(inputs), *tensors)
