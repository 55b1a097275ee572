"""Module-level head chunks, pipelined: each chunk of an attention module projects only its heads,
exchanges them, runs the ring and sends its output back, and chunk i + 1's projection and
all-to-all run while chunk i's ring computes, in forward and in backward.

Why a Function that owns the chunk loop: with the module's own forward run once per chunk (each under
checkpointing) the chunks can only run one after another, because the module calls attention in
the middle of its forward. Here the loop asks `project(j, tensors)` for chunk j's Q/K/V (the
integration runs the module's own code up to its attention call, so projections, norms and rotary
embeddings stay the model's), and owns everything after it, so it can post chunk j + 1's exchange
before chunk j's ring. The output projection is linear in the heads: each chunk applies its columns.

Memory: forward keeps the module's inputs and, with `keep_output`, per stage the attention output in
head layout and its fp32 lse (together one `[tokens, heads x head_dim]` tensor, as UPipe keeps; saved
through autograd, so inside a checkpointed layer the first forward's copies are dropped and the
layer's recomputation keeps them). Backward takes one chunk at a time: it recomputes the chunk's
projections (values only, for the exchange), runs the ring backward with the kept output and lse (or,
without `keep_output`, with those of the chunk's attention forward run again), and back-propagates
through the projections recomputed once more with their graph, so one chunk's graph exists at a time.
So attention runs forward twice per checkpointed layer with `keep_output` (three times without), and
once per unchecked layer with it (twice without, at one output-sized tensor less per layer).
Overlapped, one more stage is in flight (its exchange buffers) and the previous chunk's results are
still landing.

Stages: a module chunk may itself be cut into engine-level chunks (`topology.heads.module_chunks`
says how many: when whole GQA groups leave too few chunks); stage (j, e) is engine chunk e of module
chunk j, and the pipeline runs over the stages in order (K/V travel once per module chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .comm import Posted, acc_dtype
from .heads import head_split
from .patterns import prepared
from .pipeline import (
    AttentionCall,
    HeadChunks,
    Saved,
    chunk_heads,
    drive,
    plan_call,
    post_heads,
    post_home,
    stage_backward,
    stage_forward,
)
from .spec import AttentionSpec

if TYPE_CHECKING:
    from .mesh import CPMesh

__all__ = ["Projected", "pipelined_module_chunks"]


@dataclass
class Projected:
    """One module chunk's local Q [B, S, h, D], K/V [B, S, h_kv, D], the settings of the attention call the
    module would have made and its sinks (refused here). `spec` may also be given as a dict of hcp.attention
    keywords (`sinks` among them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: AttentionSpec | dict[str, Any]
    sinks: torch.Tensor | None = None

    def __post_init__(self):
        if isinstance(self.spec, dict):
            keywords = dict(self.spec)
            self.sinks = keywords.pop("sinks", self.sinks)
            self.spec = AttentionSpec(**keywords)


@dataclass
class _Chunk:
    """A module chunk while it is in flight: its tensors and its attention call (head split, stages, plan)."""

    j: int
    x: Projected | None  # None once the chunk's last stage is posted
    call: AttentionCall
    kh: torch.Tensor | None = None
    vh: torch.Tensor | None = None
    out: torch.Tensor | None = None  # the chunk's attention output, back in sequence layout
    dout: torch.Tensor | None = None  # backward: d(out) of the chunk's heads
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self.q_like = torch.empty(0, dtype=self.x.q.dtype, device=self.x.q.device)  # for late allocations
        self.q_shape, self.kv_shape, self.v_shape = self.x.q.shape, self.x.k.shape, self.x.v.shape
        self.out_shape = (*self.q_shape[:3], self.v_shape[3])  # the attention output has v's head dim

    @property
    def stages(self) -> HeadChunks:
        return self.call.stages

    def last(self, e: int) -> bool:
        return e + 1 == self.stages.count


class _Engine:
    """Per module chunk: the plan handle of its attention (forward checks the call once per chunk, across
    ranks with `cp.validate`; backward reuses it)."""

    def __init__(self, cp: "CPMesh", engine_chunks: int, needs_grad: int):
        self.cp, self.engine_chunks, self.needs_grad = cp, engine_chunks, needs_grad
        self.per_chunk: dict[int, AttentionCall] = {}

    def chunk(self, j: int, x: Projected) -> _Chunk:
        if j not in self.per_chunk:
            if x.sinks is not None:
                raise ConfigError(
                    "module-level head chunks do not take attention sinks (the sinks' gradient would "
                    "have to flow back through the chunk's recomputed projections); use engine-level "
                    "head chunks (chunk_projections=False) or head_chunks=1 for models with sinks"
                )
            spec = replace(x.spec, backend="auto", head_chunks=1, return_lse=False)
            checked = prepared(x.q, x.k, x.v, self.cp, spec, None, self.needs_grad).checked
            self.per_chunk[j] = plan_call(
                self.cp,
                replace(spec, head_chunks=self.engine_chunks),
                checked,
                tuple(x.q.shape),
                x.k.shape[2],
                x.q.device,
            )
        return _Chunk(j, x, self.per_chunk[j])

    def stage_count(self, heads: int, kv_heads: int) -> int:
        return chunk_heads(
            head_split(heads, kv_heads, self.cp.ulysses_size), self.engine_chunks, self.cp.ulysses_rank
        ).count


def _post_inputs(c: _Chunk, e: int, parts: list[torch.Tensor], stage: str) -> Posted:
    """Post stage e of module chunk c: `parts` (query-sized, sequence layout) for the stage's query heads,
    and with its first stage the chunk's K/V (they travel once per module chunk). After the chunk's last
    stage is posted its local Q/K/V are dropped (the send buffer holds what is still travelling)."""
    call = c.call
    ranges = [c.stages.q[e]] * len(parts)
    if e == 0:  # in place: the caller's list is the one handed over
        parts.extend([c.x.k, c.x.v])
        ranges += [call.split.kv, call.split.kv]
    if c.last(e):  # handed over with `parts`: freed once packed, before the receive buffer is allocated
        c.x = None
    return post_heads(call.cp, call.lay, parts, ranges, stage)


def _stages(counts: Sequence[int]) -> list[tuple[int, int]]:
    return [(j, e) for j, n in enumerate(counts) for e in range(n)]


class _Forward:
    """The forward stages: chunk j's projection when its first stage is posted, the ring per stage, the
    output home per stage, and the chunk's share of the output projection once its output has landed."""

    def __init__(self, project, q_ranges, engine: _Engine, tensors, keep: bool):
        self.project, self.q_ranges, self.engine, self.tensors, self.keep = project, q_ranges, engine, tensors, keep
        self.chunks: dict[int, _Chunk] = {}
        self.y: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []  # with keep, per stage in order: its output (head layout) and lse

    def post(self, stage) -> Posted:
        j, e = stage
        if j not in self.chunks:
            self.chunks[j] = self.engine.chunk(j, self.project(j, self.tensors))
        c = self.chunks[j]
        return _post_inputs(c, e, [c.x.q], "ulysses_fwd")

    def compute(self, stage, got):
        j, e = stage
        c = self.chunks[j]
        if e == 0:
            c.kh, c.vh = got[1], got[2]
        out_h, lse, _ = stage_forward(c.call, e, got[0], c.kh, c.vh)
        if self.keep:
            self.kept += [out_h, lse]
        del got, lse
        if c.out is None:
            c.out = c.q_like.new_empty(c.out_shape)
        landed = [post_home(c.call.cp, c.call.lay, [out_h], [c.stages.q[e]], [c.out], "ulysses_fwd")]
        if not c.last(e):
            return landed, None
        del self.chunks[j]  # its Q/K/V and exchanged K/V go with its last stage; the output follows when landed
        c.kh = c.vh = None
        return landed, c

    def finish(self, c: _Chunk) -> None:  # the output projection of the chunk's heads (the bias once)
        w_o, b_o = self.tensors[-2], self.tensors[-1]
        qa, qb = self.q_ranges[c.j]
        d = c.out.shape[-1]
        part = F.linear(c.out.flatten(2), w_o[:, qa * d : qb * d], b_o if not self.y else None)
        c.out = None
        self.y.append(part if not self.y else self.y.pop().add_(part))


class _Backward:
    """The backward stages, one module chunk's graph at a time: the chunk's projections recomputed (values
    only) and d(out) from the output projection, then per stage the ring backward with forward's kept
    output and lse, the gradients home, and back through the projections once the chunk's gradients have landed."""

    def __init__(self, project, q_ranges, engine: _Engine, tensors, dy: torch.Tensor, kept: dict, overlap: bool):
        self.project, self.q_ranges, self.engine, self.tensors, self.dy = project, q_ranges, engine, tensors, dy
        self.overlap = overlap
        self.kept = kept  # stage -> (output in head layout, lse) from forward; empty: recompute them
        self.w_o = tensors[-2]
        self.wanted = [t for t in tensors[:-2] if t.requires_grad]
        self.dw_o = torch.empty_like(self.w_o) if self.w_o.requires_grad else None
        self.dy2 = dy.reshape(-1, dy.shape[-1])
        self.chunks: dict[int, _Chunk] = {}

    def _start(self, j: int) -> _Chunk:
        """Chunk j's values (the projections' graph is built again in finish()) and its d(out)."""
        with torch.no_grad():
            x = self.project(j, self.tensors)
        c = self.chunks[j] = self.engine.chunk(j, x)
        qa, qb = self.q_ranges[j]
        d = x.v.shape[-1]  # the output projection reads the attention output, v's head dim
        c.dout = F.linear(self.dy, self.w_o[:, qa * d : qb * d].t()).view(c.out_shape)
        return c

    def post(self, stage) -> Posted:
        j, e = stage
        c = self.chunks[j] if j in self.chunks else self._start(j)
        parts = [c.x.q, c.dout]
        if c.last(e):  # the chunk's last stage: its d(out) travels in the send buffer
            c.dout = None
        return _post_inputs(c, e, parts, "ulysses_bwd")

    def compute(self, stage, got):
        j, e = stage
        c = self.chunks[j]
        qh, doh = got[0], got[1]
        if e == 0:
            c.kh, c.vh = got[2], got[3]
        del got
        if stage in self.kept:  # kept by forward: no attention forward again (a halo is received again)
            (oh, lse), halo = self.kept.pop(stage), None
        else:
            oh, lse, halo = stage_forward(c.call, e, qh, c.kh, c.vh)  # recomputed
        dqh, dkh, dvh, _ = stage_backward(c.call, e, doh, Saved(qh, c.kh, c.vh, oh, lse, halo))
        del halo
        del qh, doh, lse
        dkh, dvh = self._kv_grads(c, e, dkh, dvh)
        if c.out is None:
            c.out, c.grads["q"] = c.q_like.new_empty(c.out_shape), c.q_like.new_empty(c.q_shape)
        cp, lay = c.call.cp, c.call.lay
        if c.last(e):  # the chunk's K/V are done with
            c.kh = c.vh = None
        parts = [dqh, oh]  # handed over: post_home frees each as it is reordered
        del dqh, oh
        landed = [post_home(cp, lay, parts, [c.stages.q[e]] * 2, [c.grads["q"], c.out], "ulysses_bwd")]
        if not c.last(e):
            return landed, None
        del self.chunks[j]
        if not self.overlap:  # serial: dq and the output land before dK/dV's exchange is packed
            for f in landed:
                f.wait()
            landed = []
        # dK/dV go home once per module chunk; replicated KV heads (H_kv < u) sum their replicas in fp32
        acc, kv, device = acc_dtype(dkh.dtype), c.call.split.kv, dkh.device
        c.grads.pop("kv_h", None)
        parts = [dkh, dvh]
        del dkh, dvh
        c.grads["k"], c.grads["v"] = (torch.zeros(shape, dtype=acc, device=device) for shape in (c.kv_shape, c.v_shape))
        landed.append(post_home(cp, lay, parts, [kv, kv], [c.grads["k"], c.grads["v"]], "ulysses_bwd", accumulate=True))
        return landed, c

    @staticmethod
    def _kv_grads(c: _Chunk, e: int, dkh: torch.Tensor, dvh: torch.Tensor):
        """Engine stages of one module chunk share its K/V: sum their gradients in fp32 (the whole range)."""
        if c.stages.count == 1:
            return dkh, dvh
        if "kv_h" not in c.grads:
            c.grads["kv_h"] = [
                torch.zeros(x.shape, dtype=acc_dtype(dkh.dtype), device=dkh.device) for x in (c.kh, c.vh)
            ]
        dkv = c.grads["kv_h"]
        lo, hi = c.stages.kv_local[e]
        dkv[0][:, :, lo:hi] += dkh
        dkv[1][:, :, lo:hi] += dvh
        return dkv[0], dkv[1]

    def finish(self, c: _Chunk) -> None:
        """A chunk's results have landed: the output projection's weight gradient for its heads, and
        dq/dk/dv back through its projections (recomputed with their graph just for this: one chunk's
        graph at a time)."""
        qa, qb = self.q_ranges[c.j]
        d = c.out.shape[-1]
        if self.dw_o is not None:
            self.dw_o[:, qa * d : qb * d] = self.dy2.t() @ c.out.reshape(-1, (qb - qa) * d)
        c.out = None
        g = c.grads
        with torch.enable_grad():
            x = self.project(c.j, self.tensors)
            # one output at a time: the input's gradient from each projection adds into .grad in place,
            # instead of autograd summing three [tokens, hidden] gradients out of place
            for i, (out, grad) in enumerate(((x.q, g["q"]), (x.k, g["k"]), (x.v, g["v"]))):
                torch.autograd.backward(out, grad.to(out.dtype), inputs=self.wanted, retain_graph=i < 2)
        del x, g, c.grads


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, project, q_ranges, kv_counts, engine, overlap, keep, n_in, *tensors):
        counts = [engine.stage_count(qb - qa, n) for (qa, qb), n in zip(q_ranges, kv_counts)]
        run = _Forward(project, q_ranges, engine, tensors, keep)
        drive(_stages(counts), run.post, run.compute, overlap, run.finish)
        ctx.save_for_backward(*tensors[:n_in], *run.kept)
        ctx.params = tensors[n_in:]  # parameters: by reference (FSDP2 re-fills their storage for backward)
        ctx.args = (project, q_ranges, counts, engine, overlap, n_in)
        return run.y[0]

    @staticmethod
    def backward(ctx, dy):
        project, q_ranges, counts, engine, overlap, n_in = ctx.args
        saved = ctx.saved_tensors
        stages = _stages(counts)
        kept = {
            stage: (saved[n_in + 2 * i], saved[n_in + 2 * i + 1]) for i, stage in enumerate(stages) if len(saved) > n_in
        }
        # leaves of the recomputed projections: every chunk's gradients accumulate into their .grad in place
        tensors = [
            x.detach().requires_grad_(x.requires_grad) if x is not None else None for x in (*saved[:n_in], *ctx.params)
        ]
        del saved
        run = _Backward(project, q_ranges, engine, tensors, dy, kept, overlap)
        drive(stages, run.post, run.compute, overlap, run.finish)
        b_o = tensors[-1]
        grads = [t.grad if t is not None and t.requires_grad else None for t in tensors[:-2]]
        db_o = run.dy2.sum(0) if b_o is not None and b_o.requires_grad else None
        return (None, None, None, None, None, None, None, *grads, run.dw_o, db_o)


def pipelined_module_chunks(  # noqa: PLR0913 (public entry point)
    project: Callable[[int, Sequence[torch.Tensor]], Projected],
    q_ranges: Sequence[tuple[int, int]],
    kv_counts: Sequence[int],
    cp: "CPMesh",
    engine_chunks: int,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    *,
    overlap: bool = False,
    keep_output: bool = True,
) -> torch.Tensor:
    """The output of an attention module whose heads run in module chunks: its output projection
    (`o_weight`, `o_bias`) applied to the attention output [B, S_local, H, D] of all chunks.

    `project(j, tensors)` returns chunk j's `Projected` computed from `tensors` (= `inputs`, `params`,
    `o_weight`, `o_bias`, in that order: in backward the inputs are detached copies and the parameters
    the same, recomputed with gradients enabled); `inputs` are all the tensors `project` needs besides
    parameters (saved through autograd, so that checkpointing manages them: `project` must hold no
    tensor of its own); `q_ranges[j]` are chunk j's query heads among the module's H and `kv_counts[j]`
    its KV heads. Gradients reach every tensor that requires them.
    `overlap`: the stage schedule (`AttentionSpec.overlap`, the same on every rank). `keep_output`: keep
    each stage's attention output and lse for backward instead of running the chunk's attention forward
    again there (one output-sized tensor kept; free inside a checkpointed layer, whose first forward keeps
    nothing).
    """
    overlap = bool(overlap)
    tensors = [*inputs, *params, o_weight, o_bias]
    needs_grad = int(torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    engine = _Engine(cp, engine_chunks, needs_grad)
    return _Pipelined.apply(
        project, tuple(q_ranges), tuple(kv_counts), engine, overlap, bool(keep_output), len(inputs), *tensors
    )
