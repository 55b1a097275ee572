"""Communication: the ulysses all-to-all, the ring exchange, byte accounting.

Every byte sent to another rank goes through `count`, so `comm_bytes(cp)` is the exact traffic
of this rank by stage; `topology.comm_bytes` predicts the same numbers from the shapes.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from .errors import CommTimeoutError, CPError

if TYPE_CHECKING:
    from .mesh import CPMesh


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
    """Bytes this rank has sent to other ranks, by stage, since the last `reset_comm_bytes`."""
    return dict(counters(cp).sent_bytes)


def reset_comm_bytes(cp: "CPMesh") -> None:
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
            f"error on the other ranks; set init_cp_mesh(timeout=...) to fail sooner") from exc


def _a2a(cp: "CPMesh", send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], stage: str) -> torch.Tensor:
    recv = send.new_empty(sum(recv_sizes))
    me = cp.ulysses_rank
    count(cp, stage, (sum(send_sizes) - send_sizes[me]) * send.element_size())
    with comm_guard(cp, f"the ulysses all-to-all ({stage})"):
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=cp.ulysses_group)
    return recv


def seq_to_head(cp: "CPMesh", parts: list[torch.Tensor], ranges: list[tuple[tuple[int, int], ...]],
                stage: str) -> list[torch.Tensor]:
    """One fused all-to-all: [B, S, h_i, D] per part -> [B, u*S, own heads of part i, D].

    `ranges[i][p]` is the head range of part i that ulysses rank p receives. The sequence comes
    back rank-major (rank 0's tokens first), i.e. in "gathered" order.
    """
    u, me = cp.ulysses_size, cp.ulysses_rank
    if u == 1:
        return [x[:, :, r[0][0]:r[0][1]] for x, r in zip(parts, ranges)]
    b, s, _, d = parts[0].shape
    chunks = [torch.cat([x[:, :, r[p][0]:r[p][1]] for x, r in zip(parts, ranges)], dim=2).reshape(-1)
              for p in range(u)]
    mine = [r[me][1] - r[me][0] for r in ranges]
    per_peer = b * s * sum(mine) * d
    recv = _a2a(cp, torch.cat(chunks), [c.numel() for c in chunks], [per_peer] * u, stage)
    recv = recv.view(u, b, s, sum(mine), d).transpose(0, 1).reshape(b, u * s, sum(mine), d)
    return list(recv.split(mine, dim=2))


def head_to_seq(cp: "CPMesh", parts: list[torch.Tensor], ranges: list[tuple[tuple[int, int], ...]],
                heads: list[int], stage: str, accumulate: bool = False) -> list[torch.Tensor]:
    """Inverse all-to-all: [B, u*S (gathered order), own heads, D] -> [B, S, heads[i], D].

    With `accumulate`, head ranges that several ranks hold (replicated KV) are summed in fp32:
    the gradient of a replicated KV head is the sum of its replicas' gradients.
    """
    u = cp.ulysses_size
    if u == 1:
        return list(parts)
    send, sizes_out, sizes_in = pack_head_to_seq(parts, ranges, u)
    recv = _a2a(cp, send, sizes_out, sizes_in, stage)
    b, n, _, d = parts[0].shape
    outs = [torch.zeros(b, n // u, h, d, dtype=acc_dtype(x.dtype) if accumulate else x.dtype, device=x.device)
            for x, h in zip(parts, heads)]
    unpack_head_to_seq_(recv, outs, ranges, sizes_in, accumulate)
    return [o.to(x.dtype) for o, x in zip(outs, parts)]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results and gradients accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_head_to_seq(parts: list[torch.Tensor], ranges: list[tuple[tuple[int, int], ...]],
                     u: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """The send buffer of the head -> sequence all-to-all (rank-major tokens, my heads of every part
    fused), its per-peer sizes, and the per-peer sizes to receive (peer p's heads of each part)."""
    b, n, _, d = parts[0].shape
    s = n // u
    mine = [x.shape[2] for x in parts]
    send = torch.cat([x.reshape(b, u, s, h, d) for x, h in zip(parts, mine)], dim=3).transpose(0, 1).reshape(-1)
    sizes_in = [b * s * sum(r[p][1] - r[p][0] for r in ranges) * d for p in range(u)]
    return send, [b * s * sum(mine) * d] * u, sizes_in


def unpack_head_to_seq_(recv: torch.Tensor, targets: list[torch.Tensor], ranges: list[tuple[tuple[int, int], ...]],
                        sizes_in: list[int], accumulate: bool) -> None:
    """Write (or, for replicated KV gradients, add) each peer's heads into targets[i] [B, S, heads, D]."""
    b, s, _, d = targets[0].shape
    offset = 0
    for p, size in enumerate(sizes_in):
        widths = [r[p][1] - r[p][0] for r in ranges]
        block = recv[offset:offset + size].view(b, s, sum(widths), d)
        offset += size
        for t, r, piece in zip(targets, ranges, block.split(widths, dim=2)):
            view = t[:, :, r[p][0]:r[p][1]]
            view.add_(piece) if accumulate else view.copy_(piece)


class RingExchange:
    """Asynchronous send to the next ring rank and receive from the previous one."""

    def __init__(self, cp: "CPMesh", group, stage: str):
        self.cp, self.group, self.stage = cp, group, stage

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        count(self.cp, self.stage, send.numel() * send.element_size())
        ops = [dist.P2POp(dist.isend, send, self.cp.ring_next, self.group),
               dist.P2POp(dist.irecv, recv, self.cp.ring_prev, self.group)]
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
                f"the other ranks; set init_cp_mesh(timeout=...) to fail sooner") from exc
