"""The ring engine: one loop for every layout and mask, forward and backward.

Each ring rank keeps its query block and streams (un-expanded) K/V blocks around the ring; the
next exchange is posted before the current block is computed. What each step computes comes from
the call's block plan (`block_plan`), built once from the layout and reused by forward and
backward: no layout names, no device syncs and no index searches inside the loop. Partial results
merge with an online softmax in fp32. Backward recomputes every block with the final out/lse;
dK/dV accumulate in fp32 buffers that travel the ring with K/V and arrive home after r hops. K and V
(and dK/dV) travel fused in one flat buffer, K's elements then V's, so v's head dim may differ from k's.

Streams (CUDA/NCCL): the exchanges are posted with `batch_isend_irecv` on the ring's own
communicators, whose operations run on NCCL's internal stream; posting makes that stream wait for
the compute stream's work so far (an event: the buffer being sent is complete), and `wait()` makes
the compute stream wait for the transfer (an event, not a host block). So block i + 1's transfer
runs while block i's kernels run, in forward and backward, and the host never waits: the loop
holds no `.item()`, `.tolist()` or `nonzero` (index tensors and varlen boundaries come from the
cached plan, with their host values). Forward and backward exchanges use separate communicators
(`ring_group`, `ring_group_bwd`), so a recomputed forward cannot queue behind backward traffic.
On gloo (CPU) the same calls return asynchronous handles served by gloo's threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from topology.block_masks import Step
from topology.layouts import Layout
from topology.masks import AttnMask

from ..errors import ShapeError
from .comm import RingExchange, acc_dtype, count
from .heads import HeadMap
from .kernels.merge import merge_rows_, merge_sink_
from .kernels.varlen import remember_host

if TYPE_CHECKING:
    from .kernels import AttentionKernel
    from .mesh import CPMesh

Rows = slice | torch.Tensor


@dataclass(frozen=True)
class Task:
    """One kernel call: my query rows against rows of the visiting key block (or, in halo mode, of
    the rows received from that rank). With several (query, key) segment pairs the rows are their
    concatenation and `varlen` holds the kernel's cu_seqlens_q/k and max_seqlen_q/k (flash-attn's
    varlen naming); `window` is flash-attn's bottom-right aligned window_size for the call."""

    q_rows: Rows
    k_rows: Rows
    causal: bool
    window: tuple[int, int] | None = None
    varlen: dict | None = None

    def kernel_kwargs(self, softcap: float | None = None) -> dict:
        """The optional kernel keywords of this task (and the call's soft-cap), only those in use."""
        extra = dict(self.varlen or {})
        if self.window is not None:
            extra["window"] = self.window
        if softcap is not None:
            extra["softcap"] = softcap
        return extra


@dataclass(frozen=True)
class Plan:
    """A call's block plan for one ring rank: the tasks of every ring step, and, in halo mode, the
    rows to receive from / send to each ring peer (by ring step distance) instead of streaming."""

    steps: tuple[tuple[Task, ...], ...]
    halo: bool = False
    recv_rows: tuple[tuple[tuple[int, int], ...], ...] = ()  # per step s: runs of rank (me - s)'s block
    send_rows: tuple[Rows | None, ...] = ()  # per step s: my rows that rank (me + s) reads


@dataclass(frozen=True)
class RingCall:
    """What the ring reads of an attention call besides tensors: the mesh, the kernel, the block plan, the
    scale and the kernels' logit soft-cap (None: off). `pipeline.AttentionCall` carries the same fields and is
    passed as it is; this class is for running the ring alone (tests, benchmarks)."""

    cp: "CPMesh"
    kernel: "AttentionKernel"
    plan: Plan
    scale: float
    softcap: float | None = None


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> Rows:
    """A slice when the ranges are back to back, else an index tensor."""
    if all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][0] + ranges[-1][1])
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in ranges])


def _compact(row: int, runs: list[tuple[int, int]]) -> int:
    """Position of block row `row` inside the concatenation of `runs` (the received halo rows)."""
    offset = 0
    for a, n in runs:
        if a <= row < a + n:
            return offset + row - a
        offset += n
    raise AssertionError((row, runs))


def _task(step: Step, device: torch.device, key_runs: list[tuple[int, int]] | None = None) -> Task:
    q = [(a, n) for a, n, _, _ in step.pairs]
    k = [(a if key_runs is None else _compact(a, key_runs), n) for _, _, a, n in step.pairs]
    varlen = None
    if len(step.pairs) > 1:

        def cu(ranges):
            out = [0]
            for _, n in ranges:
                out.append(out[-1] + n)
            return remember_host(torch.tensor(out, dtype=torch.int32, device=device), out)

        varlen = dict(
            cu_seqlens_q=cu(q), cu_seqlens_k=cu(k), max_seqlen_q=max(n for _, n in q), max_seqlen_k=max(n for _, n in k)
        )
    return Task(_rows(q, device), _rows(k, device), step.causal, step.window, varlen)


def block_plan(
    lay: Layout,
    ring_rank: int,
    causal: bool,
    device: torch.device,
    window=None,  # noqa: PLR0913 (the layout's own arguments)
    chunk_size: int | None = None,
    mask: AttnMask | None = None,
) -> Plan:
    """This rank's plan for one call, cached per (layout, rank, mask, window, chunk size, device): every
    layer of a model asks for the same one (bounded to a few layouts: packed rows bring a new layout every
    step, and a packed plan's row indices take about 28 bytes per local token at u=1 r=8). Halo
    mode when the window, the attention chunks or the `mask` (an `AttnMask`, which then says everything) make it
    move fewer rows."""
    if mask is not None:
        return _plan(lay, ring_rank, False, torch.device(device), None, None, mask)
    return _plan(
        lay,
        ring_rank,
        causal,
        torch.device(device),
        tuple(window) if isinstance(window, list) else window,
        lay.effective_chunk(chunk_size),
    )


@lru_cache(maxsize=16)
def _plan(
    lay: Layout,
    ring_rank: int,
    causal: bool,
    device: torch.device,
    window,
    chunk: int | None,  # noqa: PLR0913
    mask: AttnMask | None = None,
) -> Plan:
    r = lay.ring
    visible = (causal, window, chunk, mask)  # what `Layout.tasks` reads after the ranks

    def tasks(s: int):
        return lay.tasks(ring_rank, s, *visible)

    if not lay.halo(*visible):
        return Plan(tuple(tuple(_task(t, device) for t in tasks(s)) for s in range(r)))
    recv = [lay.needed_rows(ring_rank, s, *visible) if s else [] for s in range(r)]
    send = [None] + [
        (lambda runs: _rows(runs, device) if runs else None)(lay.needed_rows((ring_rank + s) % r, s, *visible))
        for s in range(1, r)
    ]
    steps = tuple(tuple(_task(t, device, recv[s] if s else None) for t in tasks(s)) for s in range(r))
    return Plan(steps, True, tuple(tuple(x) for x in recv), tuple(send))


def _take(x: torch.Tensor, rows: Rows, dim: int = 1) -> torch.Tensor:
    if isinstance(rows, slice):  # all rows: x itself (a whole-block task), else a view
        return x if rows.start == 0 and rows.stop == x.shape[dim] else x[(slice(None),) * dim + (rows,)]
    return x.index_select(dim, rows)


def _add_rows_(target: torch.Tensor, rows: Rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        target[:, rows].add_(value)
    else:
        target.index_add_(1, rows, value.to(target.dtype))


def _split_kv(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K and V views of a fused flat buffer holding K's elements, then V's. One layout for K and V
    of any head dims (v's may differ from k's, MLA): one send moves both, and each view stays contiguous."""
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


def _fused(
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype | None = None,
    rows: int | None = None,
    double: bool = False,
    zero: bool = False,
) -> tuple[torch.Tensor, list]:
    """A flat K|V buffer shaped like k and v (with `rows` rows instead of theirs), in `dtype` (default k's),
    zeroed or empty; with `double` two of them ([2, n], the ring's double buffer). Returns (buffer, [(K view,
    V view)] per buffer)."""
    k_shape, v_shape = list(k.shape), list(v.shape)
    if rows is not None:
        k_shape[1] = v_shape[1] = rows
    n = math.prod(k_shape) + math.prod(v_shape)
    make = torch.zeros if zero else torch.empty
    buf = make((2, n) if double else (n,), dtype=dtype or k.dtype, device=k.device)
    views = [_split_kv(b, k_shape, v_shape) for b in (buf if double else [buf])]
    return buf, views


def _halo_fetch(cp: "CPMesh", plan: Plan, k: torch.Tensor, v: torch.Tensor) -> tuple[list, list]:
    """Send each ring peer the rows of my K/V that it reads (fused, K then V) and receive the rows I read
    from each peer; returns (works, received (K rows, V rows) views by ring step distance)."""
    r, me = cp.ring_size, cp.ring_rank
    ops, bufs = [], [None] * r
    for s in range(1, r):
        if plan.send_rows[s] is not None:
            block = torch.cat([_take(k, plan.send_rows[s]).reshape(-1), _take(v, plan.send_rows[s]).reshape(-1)])
            ops.append(dist.P2POp(dist.isend, block, cp.ring_ranks[(me + s) % r], cp.ring_group))
            count(cp, "ring_fwd", block.numel() * block.element_size())
        n = sum(m for _, m in plan.recv_rows[s])
        if n:
            buf, (bufs[s],) = _fused(k, v, rows=n)
            ops.append(dist.P2POp(dist.irecv, buf, cp.ring_ranks[(me - s) % r], cp.ring_group))
    return (dist.batch_isend_irecv(ops) if ops else []), bufs


def whole_block(plan: Plan, n_q: int, n_k: int) -> Task | None:
    """The plan's only task when it is one kernel call over the whole block (one ring step, one task whose
    query and key rows are all `n_q` / `n_k` rows, not halo mode: ring size 1), else None. Merging that one
    block into -inf/zero accumulators is exact, so the engine then returns the kernel's results directly."""
    if plan.halo or len(plan.steps) != 1 or len(plan.steps[0]) != 1:
        return None
    task = plan.steps[0][0]
    whole = all(isinstance(rows, slice) and rows == slice(0, m) for rows, m in ((task.q_rows, n_q), (task.k_rows, n_k)))
    return task if whole else None


def _contiguous(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`, contiguous (one copy at most; none when it already is): what the accumulators gave.
    (`to` alone keeps a same-dtype tensor's strides, whatever `memory_format` says.)"""
    return x.contiguous() if x.dtype == dtype else x.to(dtype=dtype, memory_format=torch.contiguous_format)


def _task_forward(
    call: RingCall, heads: HeadMap, task: Task, q: torch.Tensor, kb_full: torch.Tensor, vb_full: torch.Tensor
):
    """One task's kernel forward: (out, lse) of my query rows `task.q_rows` against the visiting block's rows."""
    kernel = call.kernel
    kb, vb = (heads.expand(_take(x, task.k_rows)) for x in (kb_full, vb_full))
    qt = _take(q, task.q_rows)
    out, lse = kernel.forward(qt, kb, vb, causal=task.causal, scale=call.scale, **task.kernel_kwargs(call.softcap))
    b, n, h = qt.shape[:3]
    if tuple(out.shape) != (b, n, h, vb.shape[3]) or tuple(lse.shape) != (b, h, n):
        raise ShapeError(
            f"kernel {getattr(kernel, 'name', kernel)!r} returned out {tuple(out.shape)} and lse "
            f"{tuple(lse.shape)} for q {tuple(qt.shape)}; its forward must return out [B, S, H, D_v] = "
            f"{[b, n, h, vb.shape[3]]} and lse [B, H, S] = {[b, h, n]} (hybrid_cp/engine/kernels/protocol.py); "
            f"ring exchanges are in flight: rebuild the mesh (hcp.destroy_cp_mesh, hcp.init_cp_mesh)"
        )
    return out, lse


def _task_backward(
    call: RingCall,
    heads: HeadMap,
    task: Task,
    dout: torch.Tensor,
    q: torch.Tensor,
    kv_block: tuple[torch.Tensor, torch.Tensor],
    result: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One task's kernel backward: (dq of my rows `task.q_rows`, dk and dv of the visiting block's rows
    `task.k_rows`, reduced onto the KV heads). `kv_block`: the visiting (K, V); `result`: forward's final
    (out, lse)."""
    rows = task.q_rows
    (out, lse) = result
    kb, vb = (heads.expand(_take(x, task.k_rows)) for x in kv_block)
    dq_b, dk_b, dv_b = call.kernel.backward(
        _take(dout, rows),
        _take(q, rows),
        kb,
        vb,
        _take(out, rows),
        _take(lse, rows, 2),
        causal=task.causal,
        scale=call.scale,
        **task.kernel_kwargs(call.softcap),
    )
    return dq_b, heads.reduce(dk_b), heads.reduce(dv_b)


def ring_forward(
    call: RingCall,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_index: list[int],
    sinks: torch.Tensor | None = None,
):
    """q [B, L, Hq, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv] (this ring rank's block) -> (out [B, L, Hq, Dv]
    in q.dtype, lse fp32,
    the halo K/V received from each peer (halo mode; kept for backward) or None), over `call`'s block plan
    with its kernel, scale and soft-cap (the same in every block). `sinks` [Hq]: one sink logit per
    query head, merged once after the last block (out and lse include it; `ring_backward` with them
    gives exact dq/dk/dv, and `kernels.merge.sink_grad` the sinks' gradient). A plan of one whole-block
    task (`whole_block`) returns the kernel's out and lse as they are (bitwise what the merge gives) with no
    fp32 accumulator and no K/V copy; with sinks, out goes through one fp32 copy for their merge."""
    cp, plan = call.cp, call.plan
    r = cp.ring_size
    b, n, hq, _ = q.shape
    heads = HeadMap.of(kv_index, k.shape[2], q.device)
    acc = acc_dtype(q.dtype)
    single = whole_block(plan, n, k.shape[1])
    if single is not None:
        o_b, lse_b = _task_forward(call, heads, single, q, k, v)
        lse = _contiguous(lse_b, acc)
        if sinks is not None:
            o_b = _contiguous(o_b, acc)
            merge_sink_(o_b, lse, sinks)
        return _contiguous(o_b, q.dtype), lse, None
    out = torch.zeros(b, n, hq, v.shape[3], dtype=acc, device=q.device)
    lse = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)

    def compute(tasks, kb_full, vb_full):
        for task in tasks:
            o_b, lse_b = _task_forward(call, heads, task, q, kb_full, vb_full)
            merge_rows_(out, lse, task.q_rows, o_b, lse_b.to(acc))

    if plan.halo:
        works, halo = _halo_fetch(cp, plan, k, v)
        compute(plan.steps[0], k, v)
        RingExchange.wait(works)
        for s in range(1, r):
            if halo[s] is not None:
                compute(plan.steps[s], halo[s][0], halo[s][1])
        if sinks is not None:
            merge_sink_(out, lse, sinks)
        return out.to(q.dtype), lse, halo
    kv, kv_views = _fused(k, v, double=True)  # double buffer of fused K/V
    kv_views[0][0].copy_(k)
    kv_views[0][1].copy_(v)
    exchange = RingExchange(cp, cp.ring_group, "ring_fwd")
    for step, tasks in enumerate(plan.steps):
        works = exchange.start(kv[step % 2], kv[(step + 1) % 2]) if step < r - 1 else None
        compute(tasks, *kv_views[step % 2])
        exchange.wait(works)
    if sinks is not None:
        merge_sink_(out, lse, sinks)
    return out.to(q.dtype), lse, None


def ring_backward(
    call: RingCall,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    result: tuple[torch.Tensor, torch.Tensor],
    kv_index: list[int],
    halo: list | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `ring_forward` for this ring rank's block (dq, dk, dv in the inputs' dtypes), from its final
    `result` = (out, lse). `halo`:
    what `ring_forward` received in halo mode, or None to receive those rows again (the compiled op
    cannot keep them: their count depends on the plan, which its fake does not know). A whole-block plan
    (`whole_block`) returns the kernel's gradients cast to the inputs' dtypes: no fp32 accumulators, no
    fused K/V or dK/dV buffers."""
    cp, plan = call.cp, call.plan
    r = cp.ring_size
    heads = HeadMap.of(kv_index, k.shape[2], q.device)
    acc = acc_dtype(q.dtype)
    single = whole_block(plan, q.shape[1], k.shape[1])
    if single is not None:
        grads = _task_backward(call, heads, single, dout, q, (k, v), result)
        return tuple(_contiguous(g, x.dtype) for g, x in zip(grads, (q, k, v)))
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)

    def compute(tasks, kb_full, vb_full) -> list:
        """Run the tasks' backward; dq accumulates here, (key rows, dk, dv) are returned."""
        grads = []
        for task in tasks:
            dq_b, dk_b, dv_b = _task_backward(call, heads, task, dout, q, (kb_full, vb_full), result)
            _add_rows_(dq, task.q_rows, dq_b)
            grads.append((task.k_rows, dk_b, dv_b))
        return grads

    def add(dkv, grads) -> None:
        """Add the tasks' (key rows, dk, dv) into dkv = (dK view, dV view)."""
        for k_rows, dk_b, dv_b in grads:
            _add_rows_(dkv[0], k_rows, dk_b)
            _add_rows_(dkv[1], k_rows, dv_b)

    if plan.halo:
        return _halo_backward(call, compute, add, dq, q.dtype, (k, v), halo)
    kv, kv_views = _fused(k, v, double=True)
    kv_views[0][0].copy_(k)
    kv_views[0][1].copy_(v)
    dkv, dkv_views = _fused(k, v, acc, double=True, zero=True)  # travelling fp32 dK/dV
    kv_exchange = RingExchange(cp, cp.ring_group_bwd, "ring_bwd")
    dkv_exchange = RingExchange(cp, cp.ring_group_bwd, "ring_bwd")
    dkv_works = None
    for step, tasks in enumerate(plan.steps):
        kv_works = kv_exchange.start(kv[step % 2], kv[(step + 1) % 2]) if step < r - 1 else None
        grads = compute(tasks, *kv_views[step % 2])
        dkv_exchange.wait(dkv_works)  # my travelling buffer for this block has arrived
        add(dkv_views[step % 2], grads)
        if r > 1:
            dkv_works = dkv_exchange.start(dkv[step % 2], dkv[(step + 1) % 2])
        kv_exchange.wait(kv_works)
    dkv_exchange.wait(dkv_works)
    home = dkv_views[r % 2] if r > 1 else dkv_views[0]
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)


def _halo_backward(
    call: RingCall,
    compute,
    add,
    dq: torch.Tensor,
    q_dtype: torch.dtype,
    kv: tuple[torch.Tensor, torch.Tensor],
    halo: list | None,
):
    """`ring_backward` in halo mode: the gradients of the rows read from each peer go back to it (fused
    dK|dV), and those of my rows the peers read come home and are added."""
    cp, plan, (k, v) = call.cp, call.plan, kv
    r, acc = cp.ring_size, dq.dtype
    if halo is None:
        works, halo = _halo_fetch(cp, plan, k, v)
        RingExchange.wait(works)
    home = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=k.device))
    add(home, compute(plan.steps[0], k, v))
    ops, grads = [], [None] * r
    for s in range(1, r):
        if halo[s] is not None:  # my gradients for the rows I read from rank me - s go back to it
            g, (g_views,) = _fused(halo[s][0], halo[s][1], acc, zero=True)
            add(g_views, compute(plan.steps[s], halo[s][0], halo[s][1]))
            ops.append(dist.P2POp(dist.isend, g, cp.ring_ranks[(cp.ring_rank - s) % r], cp.ring_group_bwd))
            count(cp, "ring_bwd", g.numel() * g.element_size())
        if plan.send_rows[s] is not None:  # gradients of my rows that rank me + s read
            rows = plan.send_rows[s]
            n = len(range(k.shape[1])[rows]) if isinstance(rows, slice) else rows.numel()
            buf, (grads[s],) = _fused(k, v, acc, rows=n)
            ops.append(dist.P2POp(dist.irecv, buf, cp.ring_ranks[(cp.ring_rank + s) % r], cp.ring_group_bwd))
    RingExchange.wait(dist.batch_isend_irecv(ops) if ops else None)
    for s in range(1, r):
        if grads[s] is not None:
            _add_rows_(home[0], plan.send_rows[s], grads[s][0])
            _add_rows_(home[1], plan.send_rows[s], grads[s][1])
    return dq.to(q_dtype), home[0].to(k.dtype), home[1].to(v.dtype)
