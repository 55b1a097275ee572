"""Communication: the ulysses all-to-all, the ring exchange, byte accounting.

Every byte sent to another rank goes through `count`, so `comm_bytes(cp)` is the exact traffic
of this rank by stage; `topology.comm_bytes` predicts the same numbers from the shapes.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, CPError

if TYPE_CHECKING:
    from .mesh import CPMesh

Ranges = tuple[tuple[int, int], ...]  # a head range per ulysses rank


@dataclass
class CommCounters:
    """What one mesh's communication has done on this rank: bytes sent to other ranks by stage, and
    the seconds head-chunk schedules sat blocked in all-to-all waits (exposed communication)."""

    sent_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    chunk_wait_s: float = 0.0


# Kept beside the mesh, not on it: a CPMesh holds only its groups. Weak keys, so a mesh that is
# dropped takes its counters with it.
_COUNTERS: "weakref.WeakKeyDictionary[CPMesh, CommCounters]" = weakref.WeakKeyDictionary()


def counters(cp: "CPMesh") -> CommCounters:
    """This rank's communication counters for `cp` (`sent_bytes`, `chunk_wait_s`; assignable)."""
    return _COUNTERS.setdefault(cp, CommCounters())


def count(cp: "CPMesh", stage: str, nbytes: int) -> None:
    counters(cp).sent_bytes[stage] += int(nbytes)


def comm_bytes(cp: "CPMesh") -> dict[str, int]:
    """Bytes this rank has sent to other ranks, by stage, since the last `reset_comm_bytes`.

    Args:
        cp: The mesh.

    Returns:
        Bytes by stage: "ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd".
    """
    return dict(counters(cp).sent_bytes)


def reset_comm_bytes(cp: "CPMesh") -> None:
    """Set `comm_bytes(cp)` back to zero (e.g. to count one step).

    Args:
        cp: The mesh.
    """
    counters(cp).sent_bytes.clear()


@contextmanager
def comm_guard(cp: "CPMesh", what: str) -> Iterator[None]:
    """Turn a backend failure inside a collective (peer died, timed out, connection reset) into
    `hcp.CommTimeoutError` naming the collective, this rank and the timeout in effect."""
    try:
        yield
    except CPError:
        raise
    except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
        raise CommTimeoutError(
            f"{what} failed on cp rank {cp.rank} (ulysses {cp.ulysses_rank}, ring {cp.ring_rank}) within the "
            f"group timeout {getattr(cp, 'timeout', None)}: a peer rank died, hung, or raised on its own. "
            f"Backend said: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. Look for the first "
            f"error on the other ranks; set init_cp_mesh(timeout=...) to fail sooner"
        ) from exc


class Posted:
    """An all-to-all in flight (posted with async_op=True); `wait()` returns what `finish` makes of the
    receive buffer, then drops the buffers. A lost peer raises hcp.CommTimeoutError, as everywhere in the
    engine. With `timed`, the time blocked in `wait()` is what a head-chunk schedule left exposed
    (`counters(cp).chunk_wait_s`)."""

    def __init__(self, cp: "CPMesh", work, keep: tuple, finish: Callable[[], list], stage: str, timed: bool = False):
        self.cp, self.work, self.keep, self.finish, self.stage, self.timed = cp, work, keep, finish, stage, timed

    @classmethod
    def done(cls, cp: "CPMesh", result: list) -> "Posted":
        """A handle with nothing to wait for (ulysses = 1: the exchange is local)."""
        return cls(cp, None, (), lambda: result, "")

    def wait(self) -> list:
        if self.work is not None:
            start = time.perf_counter()
            with comm_guard(self.cp, f"the ulysses all-to-all ({self.stage})"):
                self.work.wait()
            if self.timed:
                counters(self.cp).chunk_wait_s += time.perf_counter() - start
        # the work object holds both buffers: dropped with the send buffer before `finish` makes its copies
        self.keep, self.work = (), None
        result, self.finish = self.finish(), None  # drop the receive buffer with the closure
        return result


def _post(
    cp: "CPMesh",
    send: torch.Tensor,
    send_sizes: list[int],
    recv_sizes: list[int],
    stage: str,
    finish: Callable[[torch.Tensor], list],
    timed: bool,
) -> Posted:
    """Post the ulysses all-to-all of `send`; the handle's result is `finish(receive buffer)`."""
    recv = send.new_empty(sum(recv_sizes))
    count(cp, stage, (sum(send_sizes) - send_sizes[cp.ulysses_rank]) * send.element_size())
    with comm_guard(cp, f"the ulysses all-to-all ({stage})"):
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=cp.ulysses_group, async_op=True)
    return Posted(cp, work, (send,), lambda: finish(recv), stage, timed)


def post_seq_to_head(
    cp: "CPMesh",
    parts: list[torch.Tensor],
    ranges: list[Ranges],
    stage: str,
    *,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
    timed: bool = False,
) -> Posted:
    """Post one fused all-to-all: [B, S, h_i, D_i] per part -> [B, u*S, own heads of part i, D_i].

    `ranges[i][p]` is the head range of part i that ulysses rank p receives; each part keeps its own head
    dim (v's may differ from q/k's). The sequence comes back rank-major (rank 0's tokens first), i.e. in
    "gathered" order; `then` is applied to each received part (e.g. the reordering into ring-block rows)
    while the receive buffer is still held. `parts` (the list) is emptied once packed.
    """
    u, me = cp.ulysses_size, cp.ulysses_rank
    then = then or (lambda x: x)
    if u == 1:  # no exchange; a part whose range is all its heads is passed on as it is (no view)
        return Posted.done(
            cp, [then(x if r[0] == (0, x.shape[2]) else x[:, :, r[0][0] : r[0][1]]) for x, r in zip(parts, ranges)]
        )
    b, s = parts[0].shape[:2]
    dims = [x.shape[3] for x in parts]
    send_sizes = [b * s * sum((r[p][1] - r[p][0]) * d for r, d in zip(ranges, dims)) for p in range(u)]
    send = parts[0].new_empty(sum(send_sizes))
    offset = 0
    for p, size in enumerate(send_sizes):  # peer p's block: [B, S, its heads of part 0 | of part 1 | ...]
        block, col = send[offset : offset + size].view(b, s, size // (b * s)), 0
        offset += size
        for x, r, d in zip(parts, ranges, dims):
            h = r[p][1] - r[p][0]
            block[:, :, col : col + h * d].view(b, s, h, d).copy_(x[:, :, r[p][0] : r[p][1]])
            col += h * d
    parts.clear()  # consumed: what the caller handed over is freed before the receive buffer is allocated
    mine = [r[me][1] - r[me][0] for r in ranges]
    widths = [h * d for h, d in zip(mine, dims)]

    def finish(recv: torch.Tensor) -> list:
        full = recv.view(u, b, s, sum(widths)).transpose(0, 1).reshape(b, u * s, sum(widths))
        return [then(x.view(b, u * s, h, d)) for x, h, d in zip(full.split(widths, dim=2), mine, dims)]

    return _post(cp, send, send_sizes, [b * s * sum(widths)] * u, stage, finish, timed)


def seq_to_head(cp: "CPMesh", parts: list[torch.Tensor], ranges: list[Ranges], stage: str) -> list[torch.Tensor]:
    """`post_seq_to_head`, waited for."""
    return post_seq_to_head(cp, parts, ranges, stage).wait()


def post_head_to_seq(
    cp: "CPMesh",
    parts: list[torch.Tensor],
    ranges: list[Ranges],
    targets: list[torch.Tensor],
    stage: str,
    accumulate: bool = False,
    *,
    timed: bool = False,
) -> Posted:
    """Post the inverse all-to-all: [B, u*S (gathered order), own heads, D_i] -> write (or, with
    `accumulate`, add: the gradient of a replicated KV head is the sum of its replicas') each rank's
    heads into targets[i] [B, S, heads, D] at ranges[i][p]. The handle's result is `targets`. `parts` (the
    list) is emptied once packed."""
    if cp.ulysses_size == 1:
        for x, r, t in zip(parts, ranges, targets):
            view = t[:, :, r[0][0] : r[0][1]]
            view.add_(x) if accumulate else view.copy_(x)
        return Posted.done(cp, targets)
    send, sizes_out, sizes_in = pack_head_to_seq(parts, ranges, cp.ulysses_size)
    parts.clear()  # consumed: what the caller handed over is freed before the receive buffer is allocated

    def finish(recv: torch.Tensor) -> list:
        unpack_head_to_seq_(recv, targets, ranges, sizes_in, accumulate)
        return targets

    return _post(cp, send, sizes_out, sizes_in, stage, finish, timed)


def head_to_seq(
    cp: "CPMesh",
    parts: list[torch.Tensor],
    ranges: list[Ranges],
    heads: list[int],
    stage: str,
    accumulate: bool = False,
) -> list[torch.Tensor]:
    """`post_head_to_seq` into new [B, S, heads[i], D] tensors (fp32 sums with `accumulate`), waited for;
    with ulysses = 1 the parts themselves."""
    u = cp.ulysses_size
    if u == 1:
        return list(parts)
    b, n = parts[0].shape[:2]
    dtypes = [x.dtype for x in parts]
    outs = [
        torch.zeros(b, n // u, h, x.shape[3], dtype=acc_dtype(x.dtype) if accumulate else x.dtype, device=x.device)
        for x, h in zip(parts, heads)
    ]
    post_head_to_seq(cp, parts, ranges, outs, stage, accumulate).wait()
    return [o.to(dt) for o, dt in zip(outs, dtypes)]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results and gradients accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_head_to_seq(
    parts: list[torch.Tensor], ranges: list[Ranges], u: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """The send buffer of the head -> sequence all-to-all (rank-major tokens, my heads of every part
    fused, each part with its own head dim), its per-peer sizes, and the per-peer sizes to receive (peer
    p's heads of each part)."""
    b, n = parts[0].shape[:2]
    s = n // u
    widths = [x.shape[2] * x.shape[3] for x in parts]
    send = torch.cat([x.reshape(b, u, s, w) for x, w in zip(parts, widths)], dim=3).transpose(0, 1).reshape(-1)
    sizes_in = [b * s * sum((r[p][1] - r[p][0]) * x.shape[3] for x, r in zip(parts, ranges)) for p in range(u)]
    return send, [b * s * sum(widths)] * u, sizes_in


def unpack_head_to_seq_(
    recv: torch.Tensor, targets: list[torch.Tensor], ranges: list[Ranges], sizes_in: list[int], accumulate: bool
) -> None:
    """Write (or, for replicated KV gradients, add) each peer's heads into targets[i] [B, S, heads, D_i]."""
    b, s = targets[0].shape[:2]
    offset = 0
    for p, size in enumerate(sizes_in):
        heads = [r[p][1] - r[p][0] for r in ranges]
        widths = [h * t.shape[3] for h, t in zip(heads, targets)]
        block = recv[offset : offset + size].view(b, s, sum(widths))
        offset += size
        for t, r, h, piece in zip(targets, ranges, heads, block.split(widths, dim=2)):
            view = t[:, :, r[p][0] : r[p][1]]
            piece = piece.view(b, s, h, t.shape[3])
            view.add_(piece) if accumulate else view.copy_(piece)


class RingExchange:
    """Asynchronous send to the next ring rank and receive from the previous one."""

    def __init__(self, cp: "CPMesh", group, stage: str):
        self.cp, self.group, self.stage = cp, group, stage

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        count(self.cp, self.stage, send.numel() * send.element_size())
        ops = [
            dist.P2POp(dist.isend, send, self.cp.ring_next, self.group),
            dist.P2POp(dist.irecv, recv, self.cp.ring_prev, self.group),
        ]
        with comm_guard(self.cp, f"the ring exchange ({self.stage})"):
            return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list | None, cp: "CPMesh | None" = None) -> None:
        if not works:
            return
        try:
            for w in works:
                w.wait()
        except CPError:
            raise
        except RuntimeError as exc:
            raise CommTimeoutError(
                f"a ring exchange failed{'' if cp is None else f' on cp rank {cp.rank} (timeout {cp.timeout})'}: "
                f"a peer rank died, hung, or raised on its own. Backend said: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. Look for the first error on "
                f"the other ranks; set init_cp_mesh(timeout=...) to fail sooner"
            ) from exc


class _GatherSummaries(torch.autograd.Function):
    """All-gather over the cp group; the backward sums every rank's gradient of my rows
    (reduce-scatter). Both directions are counted: (P - 1) x my rows' bytes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: "CPMesh", stage: str) -> torch.Tensor:
        ctx.cp, ctx.stage = cp, stage
        x = x.contiguous()
        out = x.new_empty(cp.size * x.shape[0], *x.shape[1:])
        count(cp, stage + "_fwd", (cp.size - 1) * x.numel() * x.element_size())
        with comm_guard(cp, f"the summary all-gather ({stage})"):
            dist.all_gather_single(out, x, group=cp.cp_group)
        return out.view(cp.size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        grad = grad.contiguous().flatten(0, 1)
        mine = grad.new_empty(grad.shape[0] // cp.size, *grad.shape[1:])
        count(cp, ctx.stage + "_bwd", (cp.size - 1) * mine.numel() * mine.element_size())
        with comm_guard(cp, f"the summary reduce-scatter ({ctx.stage})"):
            dist.reduce_scatter_single(mine, grad, group=cp.cp_group)
        return mine, None, None


def gather_summaries(cp: "CPMesh", x: torch.Tensor, stage: str) -> torch.Tensor:
    """[cp.size, *x.shape]: every cp rank's `x` (small per-segment summaries of a linear recurrence or
    a convolution's halo), differentiable; stages `<stage>_fwd` / `<stage>_bwd` in `comm_bytes`.
    Under grad mode the result always requires grad, so that the backward's collective runs on every rank,
    also on one whose own rows are constants (nothing of it is needed elsewhere)."""
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return _GatherSummaries.apply(x, cp, stage)


class _SummaryExchange(torch.autograd.Function):
    """One round of point-to-point summary transfers over the cp group: `sent[k]` to cp rank `to[k]`, a flat
    tensor of `sizes[k]` numbers from cp rank `frm[k]`; the backward returns each received tensor's gradient to
    its sender. `tie` chains the rounds, so that every rank runs their backwards in the same order."""

    @staticmethod
    def forward(
        ctx, tie: torch.Tensor, cp: "CPMesh", stage: str, to: tuple, frm: tuple, sizes: tuple, *sent: torch.Tensor
    ):
        ctx.cp, ctx.stage, ctx.to, ctx.frm = cp, stage, to, frm
        ctx.sent = [(t.numel(), t.dtype, t.device) for t in sent]
        dtype = sent[0].dtype if sent else tie.dtype
        got = [torch.empty(n, dtype=dtype, device=tie.device) for n in sizes]
        _p2p(cp, stage + "_fwd", [t.contiguous() for t in sent], to, got, frm)
        return (tie.clone(), *got)

    @staticmethod
    def backward(ctx, tie_grad: torch.Tensor, *grads: torch.Tensor):
        back = [torch.zeros(n, dtype=d, device=dev) for n, d, dev in ctx.sent]
        out = [torch.zeros_like(g) if g is None else g.contiguous() for g in grads]
        _p2p(ctx.cp, ctx.stage + "_bwd", out, ctx.frm, back, ctx.to)
        return (tie_grad, None, None, None, None, None, *back)


def _p2p(cp: "CPMesh", stage: str, send: list, to: tuple, recv: list, frm: tuple) -> None:
    """Post every send and receive of one round at once and wait for them (counted: the bytes sent)."""
    if not send and not recv:
        return
    count(cp, stage, sum(t.numel() * t.element_size() for t in send))
    peer = [dist.get_global_rank(cp.cp_group, r) for r in range(cp.size)]
    ops = [dist.P2POp(dist.isend, t, peer[r], cp.cp_group) for t, r in zip(send, to)]
    ops += [dist.P2POp(dist.irecv, t, peer[r], cp.cp_group) for t, r in zip(recv, frm)]
    with comm_guard(cp, f"the summary scan ({stage})"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def exchange_summaries(
    cp: "CPMesh", tie: torch.Tensor, send: dict[int, torch.Tensor], recv: dict[int, int], stage: str
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One round of a summary scan: send `send[r]` (flat) to cp rank r, receive `recv[r]` numbers from cp rank
    r; differentiable (the gradients travel back). Returns (the next round's `tie`, {r: received}); stages
    `<stage>_fwd` / `<stage>_bwd` in `comm_bytes`."""
    to, frm = tuple(sorted(send)), tuple(sorted(recv))
    tie, *got = _SummaryExchange.apply(tie, cp, stage, to, frm, tuple(recv[r] for r in frm), *(send[r] for r in to))
    return tie, dict(zip(frm, got))
