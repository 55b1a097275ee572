"""A context-parallel degree per group of documents, chosen every step: the pure scheduler.

For one step's global batch of documents, `schedule_step` builds *micro-batches*: in each, the world's
ranks are cut into aligned blocks ("groups") of the allowed degrees (1, 2, 4, ...); a group of degree k
runs its documents as one packed row on its own (ulysses, ring) mesh, at most k * C tokens
(C = tokens per rank). A document longer than C goes to a group of at least ceil(len / C) ranks; short
ones run on one rank (no exchange at all). Every micro-batch is a partition of all ranks, so every rank
runs the same number of micro-batches (lockstep: FSDP2's gathers and the gradient sync stay aligned).

The algorithm (the packing-aware greedy of Megatron's dynamic CP, priced by this package's calibrated
cost model instead of ``s^2 / k``): documents longest first; each goes at its minimum degree to a new
aligned block of free ranks or, when none is left, to the least busy group of that degree with room;
one that fits nowhere waits for the next micro-batch. Then idle blocks are taken by doubling the
slowest group whose buddy block is free, while that lowers its predicted time. Pure and deterministic
(stable sorts, integer keys); the digest is what the ranks compare before running it.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Any, Sequence


class ScheduleError(ValueError):
    """The batch cannot be scheduled as asked (a document longer than the largest group holds, a degree
    that does not tile the world, a capacity the memory model refuses)."""


@dataclass(frozen=True)
class Degree:
    """One allowed group size with its mesh split and its cost: a group of `size` ranks running
    packed documents of lengths s_i takes ``quad * sum(s_i^2) + lin * sum(s_i) + fixed`` seconds per
    step (`time_s`). The coefficients come from the calibrated model (`degree_table`); the default
    (1, 0, 0) orders groups by attention work alone."""

    size: int
    ulysses: int
    ring: int
    quad: float = 1.0
    lin: float = 0.0
    fixed: float = 0.0

    def time_s(self, squares: int, tokens: int) -> float:
        return self.quad * squares + self.lin * tokens + (self.fixed if tokens else 0.0)


@dataclass(frozen=True)
class Group:
    """Ranks ``first_rank .. first_rank + degree - 1`` running documents `docs` (indices into the step's
    lengths) as one packed row on a (ulysses, ring) mesh; `docs` empty: an idle rank block."""

    first_rank: int
    degree: int
    ulysses: int
    ring: int
    docs: tuple[int, ...]
    tokens: int
    time_s: float

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.degree)


@dataclass(frozen=True)
class MicroBatch:
    """One lockstep micro-batch: groups that partition the ranks, in rank order."""

    groups: tuple[Group, ...]

    @property
    def time_s(self) -> float:
        """The slowest group's predicted time: every rank waits for it before the next micro-batch."""
        return max(g.time_s for g in self.groups)

    @property
    def idle_share(self) -> float:
        """Share of the ranks' time spent waiting for the slowest group."""
        world, slowest = sum(g.degree for g in self.groups), self.time_s
        busy = sum(g.time_s * g.degree for g in self.groups)
        return 1.0 - busy / (world * slowest) if slowest > 0 else 0.0

    def group_of(self, rank: int) -> Group:
        return next(g for g in self.groups if rank in g.ranks)


@dataclass(frozen=True)
class StepSchedule:
    """The step's micro-batches; `targets` is N, the step's valid target tokens (the loss divides the
    summed token losses by it on every rank, whatever the groups). Iterate `for_rank(rank)` for this
    rank's group per micro-batch."""

    world: int
    tokens_per_rank: int
    lengths: tuple[int, ...]
    targets: int
    degrees: tuple[Degree, ...]
    microbatches: tuple[MicroBatch, ...]
    digest: str = field(default="")

    @property
    def predicted_s(self) -> float:
        return sum(mb.time_s for mb in self.microbatches)

    def for_rank(self, rank: int) -> list[Group]:
        """This rank's group in each micro-batch, in order (the same count on every rank)."""
        return [mb.group_of(rank) for mb in self.microbatches]

    def explain(self, shape: Any = None) -> str:
        """A table per micro-batch: groups as degree(u x r)@first rank: documents, predicted time and
        idle share; then the bytes against the best fixed split, counted for the attention `shape`
        (`schedule_report.Shape`; default Llama-3-8B's, bf16)."""
        from .schedule_report import Shape, compare, explain  # the byte counts load the cost model

        return explain(self, compare(self, shape or Shape()))


def schedule_step(
    lengths: Sequence[int],
    world: int,
    tokens_per_rank: int,
    degrees: Sequence[Degree],
    targets: Sequence[int] | None = None,
) -> StepSchedule:
    """Micro-batches of aligned groups for one step's documents (`lengths`, the global batch); see the
    module docstring. `degrees`: the allowed group sizes with their splits and costs (powers of two
    dividing `world`; `degree_table` or `uniform_degrees`). `targets`: valid targets per document
    (default ``len - 1``: `shard_batch` ignores each document's last label). Raises `ScheduleError`."""
    lengths = tuple(_check_lengths(lengths))
    table = _check_degrees(degrees, world, tokens_per_rank)
    need = [_min_degree(n, table, tokens_per_rank, d) for d, n in enumerate(lengths)]
    order = sorted((d for d in range(len(lengths)) if lengths[d] > 0), key=lambda d: (-lengths[d], d))
    mbs: list[MicroBatch] = []
    while order:
        mb, order = _micro_batch(order, lengths, need, table, world, tokens_per_rank)
        mbs.append(mb)
    if not mbs:  # an empty step still runs one (idle) micro-batch on every rank
        mbs.append(MicroBatch(tuple(_idle(table[1], r) for r in range(world))))
    n_targets = sum(max(n - 1, 0) for n in lengths) if targets is None else sum(int(t) for t in targets)
    sched = StepSchedule(world, tokens_per_rank, lengths, n_targets, tuple(table.values()), tuple(mbs))
    return StepSchedule(**{**sched.__dict__, "digest": schedule_digest(sched)})


def schedule_digest(sched: StepSchedule) -> str:
    """A 64-bit hex digest of everything the ranks must agree on: the batch, the groups and their documents."""
    body = repr(
        (
            sched.world,
            sched.tokens_per_rank,
            sched.lengths,
            sched.targets,
            [[(g.first_rank, g.degree, g.ulysses, g.ring, g.docs) for g in mb.groups] for mb in sched.microbatches],
        )
    )
    return hashlib.blake2b(body.encode(), digest_size=8).hexdigest()


def uniform_degrees(world: int, splits: dict[int, tuple[int, int]] | None = None) -> list[Degree]:
    """Every power of two up to `world`, split ``(ulysses, ring)`` as given (default all ulysses), with
    the attention-work cost (no calibration: for tests and torch-free callers without a cluster)."""
    out, k = [], 1
    while k <= world:
        u, r = (splits or {}).get(k, (k, 1))
        out.append(Degree(k, u, r, quad=1.0 / k, lin=0.0))
        k *= 2
    return out


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = []
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ScheduleError(f"lengths[{i}]={n!r}: document lengths must be ints >= 0")
        out.append(n)
    return out


def _check_degrees(degrees: Sequence[Degree], world: int, capacity: int) -> dict[int, Degree]:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ScheduleError(f"tokens_per_rank={capacity!r} must be an int >= 1 (tokens one rank holds per micro-batch)")
    table = {d.size: d for d in sorted(degrees, key=lambda d: d.size)}
    bad = [k for k in table if k < 1 or k & (k - 1) or world % k or table[k].ulysses * table[k].ring != k]
    if bad or 1 not in table:
        raise ScheduleError(
            f"degrees {sorted(table)} (world={world}): each must be a power of two dividing the world "
            f"with ulysses * ring == size, and 1 must be allowed (short documents run alone)"
        )
    return table


def _min_degree(n: int, table: dict[int, Degree], capacity: int, doc: int) -> int:
    for k in table:
        if n <= k * capacity:
            return k
    raise ScheduleError(
        f"document {doc} has {n} tokens > {max(table)} ranks x tokens_per_rank={capacity}: raise "
        f"tokens_per_rank, allow a larger degree, or cut the document"
    )


def _idle(deg: Degree, rank: int) -> Group:
    return Group(rank, 1, deg.ulysses, deg.ring, (), 0, 0.0)


def _micro_batch(
    order: list[int], lengths: tuple[int, ...], need: list[int], table: dict[int, Degree], world: int, capacity: int
) -> tuple[MicroBatch, list[int]]:
    """One micro-batch from the documents in `order` (longest first); returns it and the deferred ones."""
    free = bytearray(b"\x01") * world
    groups: list[list] = []  # [first, degree, docs, tokens, squares]
    heaps: dict[int, list] = {}  # degree -> heap of (time, first, group index, its document count)
    most_room: dict[int, int] = {}  # degree -> its groups' largest free tokens, known once one was refused
    later: list[int] = []
    last = {need[d]: i for i, d in enumerate(order)}
    at = 0
    while at < len(order):
        d = order[at]
        k, n = need[d], lengths[d]
        gi = _place(free, groups, heaps, most_room, k, n, k * capacity)
        at += 1
        if gi is None:
            later.append(d)
            end = last[k] + 1  # longest first is also degree-major: degree k's documents end there
            if free.find(1) < 0 and most_room.get(k, 0) < lengths[order[end - 1]]:
                later += order[at:end]  # no free ranks and no group of degree k holds even its shortest
                at = end
            continue
        grp = groups[gi]
        grp[2].append(d)
        grp[3] += n
        grp[4] += n * n
        heapq.heappush(heaps.setdefault(k, []), (table[k].time_s(grp[4], grp[3]), grp[0], gi, len(grp[2])))
    _expand(groups, free, table)
    out = [
        Group(f, k, table[k].ulysses, table[k].ring, tuple(docs), t, table[k].time_s(sq, t))
        for f, k, docs, t, sq in groups
    ]
    out += [_idle(table[1], r) for r in range(world) if free[r]]
    return MicroBatch(tuple(sorted(out, key=lambda g: g.first_rank))), later


def _place(
    free: bytearray, groups: list[list], heaps: dict[int, list], most_room: dict[int, int], k: int, n: int, room: int
) -> int | None:
    """The group a document of `n` tokens at degree `k` joins: a new aligned block while free ranks last
    (the least busy place of all), else the least busy group of degree k with room; None: defer it."""
    first = _open_block(free, k)
    if first is not None:
        groups.append([first, k, [], 0, 0])
        return len(groups) - 1
    if n > most_room.get(k, n) or k not in heaps:
        most_room.setdefault(k, 0)
        return None
    gi = _roomiest(heaps.get(k, []), groups, n, room)
    if gi is None:  # rooms only shrink within a micro-batch: remember the largest one left
        most_room[k] = max((room - g[3] for g in groups if g[1] == k), default=0)
    return gi


def _open_block(free: bytearray, k: int) -> int | None:
    """The lowest aligned block of `k` free ranks (taken), or None."""
    if k == 1:
        r = free.find(1)
        if r < 0:
            return None
        free[r] = 0
        return r
    full = b"\x01" * k
    for first in range(0, len(free), k):
        if free[first : first + k] == full:
            free[first : first + k] = bytes(k)
            return first
    return None


def _roomiest(heap: list, groups: list[list], n: int, room: int) -> int | None:
    """The least busy group in `heap` with room for `n` more tokens. Entries are (time, first rank,
    group index, its document count when pushed); one whose group has grown since is stale and dropped."""
    kept, found = [], None
    while heap:
        entry = heapq.heappop(heap)
        grp = groups[entry[2]]
        if entry[3] != len(grp[2]):
            continue
        kept.append(entry)
        if grp[3] + n <= room:
            found = entry[2]
            break
    for entry in kept:
        heapq.heappush(heap, entry)
    return found


def _expand(groups: list[list], free: bytearray, table: dict[int, Degree]) -> None:
    """Give idle ranks to the slowest groups: double a group (into its free buddy block, or moved to a
    free aligned block of twice its size: a group's place within a micro-batch is free to choose) while
    the doubled degree is allowed and its predicted time falls."""
    changed = True
    while changed:
        changed = False
        for grp in sorted(groups, key=lambda g: (-table[g[1]].time_s(g[4], g[3]), g[0])):
            first, k, _, tokens, squares = grp
            if 2 * k not in table or table[2 * k].time_s(squares, tokens) >= table[k].time_s(squares, tokens):
                continue
            free[first : first + k] = b"\x01" * k  # released, then taken back as part of the doubled block
            start = _open_block(free, 2 * k)
            if start is None:
                free[first : first + k] = bytes(k)
                continue
            grp[0], grp[1] = start, 2 * k
            changed = True
            break


__all__ = [
    "Degree",
    "Group",
    "MicroBatch",
    "StepSchedule",
    "ScheduleError",
    "schedule_step",
    "schedule_digest",
    "uniform_degrees",
]
