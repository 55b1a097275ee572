"""CPMesh: the 2-D (ring x ulysses) context-parallel mesh, with an outer data-parallel dim.

Ulysses ranks are contiguous global ranks (one node, fast links); ring ranks stride across
nodes. Every process group and coordinate comes from the ("dp", "ring", "ulysses") DeviceMesh.
"""

from __future__ import annotations

import datetime
import logging
import os
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from topology.layouts import check_layout
from .comm import comm_guard
from .errors import CommTimeoutError, ConfigError, InconsistentRanksError, NonFiniteError, SetupError

log = logging.getLogger("hybrid_cp")


@dataclass
class CPMesh:
    """Context-parallel mesh: who my ulysses and ring peers are, and how sequences are laid out.

    `validate` (True, "always", "debug" or False) makes attention calls check, before their first
    collective, that all cp ranks were called with the same signature, so that inconsistent ranks
    raise instead of hanging or computing wrong attention (docs/errors.md, "Validation"). True: a
    call whose signature every rank can predict from the earlier calls (they repeat with a period:
    layers, steps) is not checked again, so a training loop checks on its first steps only; any
    other call all-reduces 3 integers on a host-side group. "always": that all-reduce on every
    call. "debug": a full all-gather of the signature, a checksum of the inputs' metadata and
    NaN/inf flags per tensor. False: nothing.

    `timeout` is the timeout of every group the mesh created: a collective that a peer never
    joins (dead, hung, or raised alone) raises `hcp.CommTimeoutError` after it.

    `sharded_lengths` records, by padded size, the dense lengths `hcp.shard` has seen, so that
    `attention`/`unshard` without `seq_len=` can tell a unique length from an ambiguous one.
    """

    ulysses_size: int
    ring_size: int
    dp_size: int
    layout: str
    device: torch.device
    device_mesh: DeviceMesh | None
    ulysses_group: Any
    ring_group: Any
    ring_group_bwd: Any
    cp_group: Any
    ulysses_rank: int
    ring_rank: int
    dp_rank: int
    ring_ranks: list[int] = field(default_factory=list)
    validate: bool | str = True
    timeout: datetime.timedelta | None = None
    check_group: Any = None
    signatures: list[int] = field(default_factory=list, repr=False)  # recent call hashes (the same on every rank)
    signature_period: int | None = field(default=None, repr=False)  # the period they repeat with, if any
    validation_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int), repr=False)
    sharded_lengths: dict[int, set[int]] = field(default_factory=dict, repr=False)
    sent_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int), repr=False)
    chunk_wait_s: float = field(default=0.0, repr=False)  # time blocked on head-chunk all-to-alls (exposed comm)

    @property
    def size(self) -> int:
        """Context-parallel degree u * r (the number of ranks that share one sequence)."""
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        """Rank within the cp group, 0..size-1: ring-major, ulysses-minor."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    @property
    def ring_next(self) -> int:
        """Global rank that receives my ring messages."""
        return self.ring_ranks[(self.ring_rank + 1) % self.ring_size]

    @property
    def ring_prev(self) -> int:
        """Global rank whose ring messages I receive."""
        return self.ring_ranks[(self.ring_rank - 1) % self.ring_size]

    def __repr__(self) -> str:
        return (f"CPMesh(ulysses={self.ulysses_size}, ring={self.ring_size}, dp={self.dp_size}, "
                f"layout={self.layout!r}, rank={self.rank}, device={self.device})")


def _divisor_hint(world: int) -> str:
    pairs = [f"(ulysses={u}, ring={d // u})" for d in range(1, world + 1) if world % d == 0
             for u in range(1, d + 1) if d % u == 0]
    return ", ".join(pairs[-12:])


def init_cp_mesh(ulysses: int | None = None, ring: int | None = None, *, dp: int | None = None,
                 layout: str = "zigzag", plan: Any = None, device: str | torch.device | None = None,
                 validate: bool | str = True, timeout: datetime.timedelta | None = None) -> CPMesh:
    """Build the ("dp", "ring", "ulysses") mesh after `torch.distributed.init_process_group`.

    `plan` may be a `topology` plan (anything with integer `ulysses`, `ring`, `dp` attributes)
    instead of explicit degrees. `dp` defaults to world_size // (ulysses * ring).
    `timeout` applies to every group the mesh creates; by default they inherit the default
    process group's timeout (torch's `new_group` would otherwise give them its 30-minute default,
    so a rank that stops calling would hang the others far past the timeout you chose).
    Logs the resolved configuration once on logger "hybrid_cp" (INFO) and warns about settings
    that silently cost performance.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SetupError("init_cp_mesh needs torch.distributed: call "
                         "torch.distributed.init_process_group(...) first (or launch with torchrun)")
    if plan is not None:
        if ulysses is not None or ring is not None:
            raise ConfigError("pass either plan=... or ulysses=/ring=, not both")
        ulysses, ring = int(plan.ulysses), int(plan.ring)
        dp = int(getattr(plan, "dp", 0)) or dp
    if ulysses is None or ring is None:
        raise ConfigError("init_cp_mesh needs ulysses= and ring= (or plan=)")
    try:
        check_layout(layout)
    except ValueError as exc:
        raise ConfigError(f"layout={layout!r}: {exc}") from None
    if not (isinstance(validate, bool) or validate in ("always", "debug")):
        raise ConfigError(f"validate={validate!r} must be True (check each new call signature), \"always\" (a "
                          f"cheap check on every call), \"debug\" (full check, metadata checksum, NaN/inf) or "
                          f"False (no check)")
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
        raise ConfigError(f"timeout={timeout!r} must be a positive datetime.timedelta (or None to inherit "
                          f"the default process group's timeout)")
    world = dist.get_world_size()
    for name, value in (("ulysses", ulysses), ("ring", ring)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    cp = ulysses * ring
    if world % cp != 0:
        raise ConfigError(f"ulysses={ulysses} x ring={ring} = {cp} does not divide the world size "
                          f"{world}; degrees that would work: {_divisor_hint(world)}")
    if dp is None:
        dp = world // cp
    if dp * cp != world:
        raise ConfigError(f"dp={dp} x ulysses={ulysses} x ring={ring} = {dp * cp} != world size "
                          f"{world}; use dp={world // cp} (or leave dp unset)")
    if device is None:
        if torch.cuda.is_available() and dist.get_backend() != "gloo":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    if timeout is None:
        timeout = default_timeout()
    mesh = _device_mesh(device, (dp, ring, ulysses), timeout)
    dp_rank, ring_rank, ulysses_rank = mesh.get_coordinate()
    grid = mesh.mesh.tolist()  # [dp][ring][ulysses] -> global rank
    ring_ranks = [grid[dp_rank][j][ulysses_rank] for j in range(ring)]
    # The ring gets a second communicator for backward so that forward and backward exchanges
    # (e.g. with activation checkpointing or pipelining) cannot serialise on each other.
    ring_bwd = _my_group([[grid[d][j][i] for j in range(ring)] for d in range(dp) for i in range(ulysses)], timeout)
    cp_lists = [[x for row in grid[d] for x in row] for d in range(dp)]
    cp_group = _my_group(cp_lists, timeout)
    # The validation all-reduce has a host (gloo) group of its own: it never syncs the device, and a
    # rank that checks while the others skip (validate=True) can only time out, never pair its
    # check with another collective.
    check_group = _my_group(cp_lists, timeout, backend="gloo")
    out = CPMesh(
        ulysses_size=ulysses, ring_size=ring, dp_size=dp, layout=layout, device=device,
        device_mesh=mesh, ulysses_group=mesh.get_group("ulysses"), ring_group=mesh.get_group("ring"),
        ring_group_bwd=ring_bwd, cp_group=cp_group,
        ulysses_rank=ulysses_rank, ring_rank=ring_rank, dp_rank=dp_rank, ring_ranks=ring_ranks,
        validate=validate, timeout=timeout, check_group=check_group)
    _announce(out, grid)
    return out


def default_timeout() -> datetime.timedelta:
    """The default process group's timeout (what `init_process_group(timeout=...)` set)."""
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group()
    for dev in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(dev).options._timeout
        except Exception:  # no backend for this device type, or an older torch
            continue
    return c10d.default_pg_timeout


def _device_mesh(device: torch.device, shape: tuple[int, int, int], timeout: datetime.timedelta) -> DeviceMesh:
    """The DeviceMesh with `timeout` built into its groups' options: setting it afterwards is not
    enough (gloo's point-to-point waits keep the timeout their context was created with)."""
    names = ("dp", "ring", "ulysses")
    backend = dist.get_backend()
    opts = None
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
        if opts is not None:
            opts._timeout = timeout
    except Exception:  # an older torch: no such options
        opts = None
    if opts is not None:
        try:
            return init_device_mesh(device.type, shape, mesh_dim_names=names,
                                    backend_override={n: (backend, opts) for n in names})
        except TypeError:  # torch without backend_override
            pass
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    for dim in ("ulysses", "ring"):
        _set_timeout(mesh.get_group(dim), timeout)
    return mesh


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._set_pg_timeout(timeout, group)
    except Exception as exc:  # torch without per-group timeouts: say so once instead of hanging silently
        log.warning("could not set timeout=%s on a DeviceMesh group (%s); that group keeps its own timeout",
                    timeout, exc)


def _announce(cp: CPMesh, grid: list) -> None:
    """One INFO line with the resolved configuration; a WARNING for placements that cost speed."""
    try:
        backend = dist.get_backend()
    except Exception:
        backend = "?"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    me = dist.get_rank()
    ulysses_ranks = grid[cp.dp_rank][cp.ring_rank]
    nodes = sorted({r // local for r in ulysses_ranks}) if local > 0 else None
    placement = (f"ulysses ranks {ulysses_ranks} on node(s) {nodes}" if nodes is not None
                 else f"ulysses ranks {ulysses_ranks} (LOCAL_WORLD_SIZE unset: node placement unknown)")
    if me == 0 or log.isEnabledFor(logging.DEBUG):
        log.info("hybrid-cp mesh: ulysses=%d ring=%d dp=%d layout=%s backend=%s device=%s validate=%s "
                 "timeout=%s; rank %d: %s, ring ranks %s", cp.ulysses_size, cp.ring_size, cp.dp_size, cp.layout,
                 backend, cp.device, cp.validate, cp.timeout, me, placement, cp.ring_ranks)
    if nodes is not None and len(nodes) > 1:
        log.warning("the ulysses group %s spans nodes %s (LOCAL_WORLD_SIZE=%d): its all-to-all runs over the "
                    "inter-node network; use ulysses <= %d and put the rest of the degree into ring",
                    ulysses_ranks, nodes, local, local)


def _my_group(rank_lists: list[list[int]], timeout: datetime.timedelta | None = None, backend: str | None = None):
    """Create one group per list (every rank must create all of them, in the same order) and
    return the one holding this rank."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        g = dist.new_group(ranks, timeout=timeout, backend=backend)
        if me in ranks:
            mine = g
    return mine


_BIG = (1 << 62) - 1


def _digest(values: list[int]) -> int:
    """A 62-bit hash of a signature (the same on every rank for the same values)."""
    data = ",".join(str(int(x)) for x in values).encode()
    return (zlib.crc32(data) << 30) ^ zlib.adler32(data) ^ len(values)


def _metadata(tensors) -> list[int]:
    """Checksum of dtype/stride/requires_grad/device type of each tensor, and NaN/inf flags (debug)."""
    meta, flags = [], []
    for t in tensors:
        meta.append(f"{t.dtype}|{t.stride()}|{int(t.requires_grad)}|{t.device.type}")
        flags.append(int(not bool(torch.isfinite(t.detach()).all())))
    return [zlib.crc32("/".join(meta).encode())] + flags


@torch.compiler.disable  # a host collective and a history of signatures: never traced
def agree_across_ranks(cp: CPMesh, values: list[int], names: list[str], error: Exception | None,
                       what: str, tensors: tuple[tuple[str, torch.Tensor], ...] = ()) -> None:
    """Raise on every rank if any cp rank failed its own checks or the ranks disagree on `values`,
    so that no rank goes on into a collective alone or with different arguments.

    The check is one all-reduce(MAX) of (hash, -hash, failed) on the host group; only if that
    shows a failure or a disagreement (every rank sees the same reduced values, so every rank
    takes this branch) the full all-gather that names the ranks and fields. validate="debug"
    always takes the full all-gather, with the inputs' metadata checksum and NaN/inf flags of
    `tensors` (name, tensor) added. validate=True skips the check when this rank's signature is
    the predicted one (`_predicted`): the prediction depends only on calls that agreed, so it is
    the same on every rank, and a rank whose call differs from it always checks.
    """
    debug = cp.validate == "debug"
    failed = 0 if error is None else 1
    values = list(values)
    names = list(names)
    if debug:
        extra = _metadata([t for _, t in tensors]) if error is None and tensors else [0] * (len(tensors) + 1)
        if tensors:
            values += [extra[0]]
            names += ["dtype/stride/requires_grad/device (checksum)"]
        _full_check(cp, values, names, error, what, extra[1:], [n for n, _ in tensors])
        return
    h = _digest(values) if error is None else 0
    if cp.validate is True and error is None and h == _predicted(cp):
        cp.validation_calls["skipped"] += 1
        _advance(cp, h)
        return
    cp.validation_calls["hash"] += 1
    mine = torch.tensor([h, -h, failed], dtype=torch.int64)
    try:
        with comm_guard(cp, f"the {what} agreement check"):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=cp.check_group)
    except CommTimeoutError as exc:
        if cp.validate is not True:
            raise
        # Under validate=True the other ranks skip calls they predicted; a rank that checks alone
        # times out here: its call differed from theirs (or from what they expected).
        if error is not None:
            raise error from exc
        raise CommTimeoutError(f"{what}: with validate=True only a call that differs from the one every rank "
                               f"predicted from earlier calls is checked, and no other rank joined this check: "
                               f"this call most likely differs across ranks (rerun with validate=\"always\" to have "
                               f"the differing fields named). {exc}") from exc
    top, neg_low, any_failed = mine.tolist()
    if not any_failed and top == h and -neg_low == h:
        _agreed(cp, h)
        return
    _full_check(cp, values, names, error, what, [], [])


_HISTORY = 512  # call signatures remembered: a period longer than half of this is not learned


def _predicted(cp: CPMesh) -> int | None:
    """The signature every rank expects next: the one a period ago when the recent calls repeat
    with a period (a training step: one batch check, then layers, full and sliding-window layers
    alternating, recomputation in backward), else the same as the last call."""
    hist = cp.signatures
    if not hist:
        return None
    return hist[-cp.signature_period] if cp.signature_period else hist[-1]


def _advance(cp: CPMesh, h: int) -> None:
    """A predicted call: the period still holds."""
    cp.signatures.append(h)
    if len(cp.signatures) > 2 * _HISTORY:
        del cp.signatures[:-_HISTORY]


def _agreed(cp: CPMesh, h: int) -> None:
    """A checked call that agreed: remember it and find the shortest period the history is consistent
    with (at least one call of overlap). Only agreed or predicted calls enter the history, so it is
    the same on every rank."""
    _advance(cp, h)
    hist = cp.signatures[-_HISTORY:]
    n = len(hist)
    cp.signature_period = next((p for p in (n - 1 - i for i in range(n - 2, -1, -1) if hist[i] == h)
                                if hist[n - min(p, n - p):] == hist[n - p - min(p, n - p):n - p]), None)


def _full_check(cp: CPMesh, values: list[int], names: list[str], error: Exception | None, what: str,
                nonfinite: list[int], tensor_names: list[str]) -> None:
    cp.validation_calls["full"] += 1
    row = [0 if error is None else 1] + list(nonfinite) + list(values)
    mine = torch.tensor(row, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(cp.size)]
    with comm_guard(cp, f"the {what} agreement check"):
        dist.all_gather(rows, mine, group=cp.check_group)
    if error is not None:
        raise error
    rows = [r.tolist() for r in rows]
    bad = [rank for rank, r in enumerate(rows) if r[0]]
    if bad:
        raise InconsistentRanksError(f"cp ranks {bad} rejected their {what} (their error says why); "
                                     f"every rank stops here instead of hanging")
    k = len(nonfinite)
    found = [f"{tensor_names[i]} on cp rank {rank}" for rank, r in enumerate(rows) for i in range(k) if r[1 + i]]
    if found:
        raise NonFiniteError(f"NaN or inf in {', '.join(found)} ({what}, validate=\"debug\"); every rank stops "
                             f"here; find where that rank's activations overflow")
    for rank, r in enumerate(rows):
        if r[1 + k:] != list(values):
            diffs = [f"{name}: {theirs} on cp rank {rank} vs {ours} here"
                     for name, theirs, ours in zip(names, r[1 + k:], values) if theirs != ours]
            raise InconsistentRanksError(f"inconsistent {what} across the cp group (" + "; ".join(diffs) +
                                         "); every rank must pass its shard of the same batch with the same settings")
