"""CPMesh: the 2-D (ring x ulysses) context-parallel mesh, with an outer data-parallel dim.

Ulysses ranks are contiguous global ranks (one node, fast links); ring ranks stride across
nodes. Every process group and coordinate comes from the ("dp", "ring", "ulysses") DeviceMesh.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from topology.layouts import check_layout

from ..errors import ConfigError, SetupError
from .agreement import DestroyedGroup
from .rules import is_int, positive_int

log = logging.getLogger("hybrid_cp")
_SERIAL = itertools.count()  # meshes built by this process, in order (the same on every rank)


# ---- init_cp_mesh's arguments ------------------------------------------------------------------

VALIDATE_MODES = (True, "always", "debug", False)


def _divisor_hint(world: int) -> str:
    pairs = [
        f"(ulysses={u}, ring={d // u})"
        for d in range(1, world + 1)
        if world % d == 0
        for u in range(1, d + 1)
        if d % u == 0
    ]
    return ", ".join(pairs[-12:])


def mesh_arguments(
    ulysses: Any, ring: Any, dp: Any, plan: Any, layout: Any, validate: Any, timeout: Any, world: int
) -> tuple[int, int, int]:
    """`init_cp_mesh`'s arguments checked against the world size; returns (ulysses, ring, dp)."""
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
        raise ConfigError(
            f'validate={validate!r} must be True (check each new call signature), "always" (a '
            f'cheap check on every call), "debug" (full check, metadata checksum, NaN/inf) or '
            f"False (no check)"
        )
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
        raise ConfigError(
            f"timeout={timeout!r} must be a positive datetime.timedelta (or None to inherit "
            f"the default process group's timeout)"
        )
    positive_int("ulysses", ulysses)
    positive_int("ring", ring)
    if dp is not None and not is_int(dp):  # ints are judged against the world size below
        positive_int("dp", dp)
    cp = ulysses * ring
    if world % cp != 0:
        raise ConfigError(
            f"ulysses={ulysses} x ring={ring} = {cp} does not divide the world size "
            f"{world}; degrees that would work: {_divisor_hint(world)}"
        )
    if dp is None:
        dp = world // cp
    if dp * cp != world:
        raise ConfigError(
            f"dp={dp} x ulysses={ulysses} x ring={ring} = {dp * cp} != world size "
            f"{world}; use dp={world // cp} (or leave dp unset)"
        )
    return ulysses, ring, dp


def mesh_device(device: Any) -> torch.device:
    """`init_cp_mesh(device=...)` as a torch.device this process can use (ConfigError otherwise)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a device: {exc}") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise ConfigError(
            f"device={str(device)!r}: this process has no {device.type} device; pass device='cpu' (gloo) "
            f"or run where {device.type} is available"
        )
    return device


@dataclass(eq=False)  # identity: a mesh is one set of process groups (and a weak-dictionary key)
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

    Every group is a dimension of `device_mesh` or a flattening of some (`cp_group`: ring x ulysses,
    `dp_cp_group`/`dp_cp_mesh`: all ranks, for the loss and FSDP2), except two that a DeviceMesh cannot
    give: `ring_group_bwd`, a second communicator over the ring ranks, and `check_group`, a host (gloo)
    group for the validation check. Run-time records live with their owners: bytes sent and head-chunk
    waits in `hybrid_cp.engine.comm.counters(cp)`, the lengths `hcp.shard` saw in
    `hybrid_cp.engine.layout.recorded_lengths(cp)`, the validation history in `hybrid_cp.engine.agreement.history(cp)`.
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
    dp_cp_group: Any = None
    dp_cp_mesh: DeviceMesh | None = None

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
        return (
            f"CPMesh(ulysses={self.ulysses_size}, ring={self.ring_size}, dp={self.dp_size}, "
            f"layout={self.layout!r}, rank={self.rank}, device={self.device})"
        )


def init_cp_mesh(  # noqa: PLR0913 (public entry point)
    ulysses: int | None = None,
    ring: int | None = None,
    *,
    dp: int | None = None,
    layout: str = "zigzag",
    plan: Any = None,
    device: str | torch.device | None = None,
    validate: bool | str = True,
    timeout: datetime.timedelta | None = None,
    share_world_with: CPMesh | None = None,
) -> CPMesh:
    """Build the ("dp", "ring", "ulysses") mesh after `torch.distributed.init_process_group`.

    `plan` may be a `topology` plan (anything with integer `ulysses`, `ring`, `dp` attributes)
    instead of explicit degrees. `dp` defaults to world_size // (ulysses * ring).
    `timeout` applies to every group the mesh creates; by default they inherit the default
    process group's timeout (torch's `new_group` would otherwise give them its 30-minute default,
    so a rank that stops calling would hang the others far past the timeout you chose).
    `share_world_with`: a mesh over the same world whose all-ranks group and mesh (`dp_cp_group`,
    `dp_cp_mesh`: the loss's and FSDP2's) this one reuses instead of creating its own (`hcp.init_cp_meshes`).
    Logs the resolved configuration once on logger "hybrid_cp" (INFO) and warns about settings
    that silently cost performance.

    Args:
        ulysses: Ulysses (all-to-all) degree, inside a node; at most the head count.
        ring: Ring degree, across nodes.
        dp: Data-parallel degree; None: world_size // (ulysses * ring).
        layout: "zigzag" (balanced causal work) or "contiguous".
        plan: A `topology` plan instead of `ulysses`, `ring` and `dp`.
        device: The device tensors live on; None: CUDA's current device, else CPU.
        validate: True (agree on each new call pattern), "always", "debug" or False (docs/errors.md).
        timeout: Timeout of every process group the mesh creates; None: the default group's.
        share_world_with: A mesh whose all-ranks group and mesh this one reuses (`hcp.init_cp_meshes`).

    Returns:
        The mesh, with dims ("dp", "ring", "ulysses").

    Raises:
        ConfigError: Degrees that do not divide the world size, an unknown layout or validate mode,
            a timeout that is not a `datetime.timedelta`.
        SetupError: No process group (call `torch.distributed.init_process_group` first).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SetupError(
            "init_cp_mesh needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (or launch with torchrun)"
        )
    world = dist.get_world_size()
    ulysses, ring, dp = mesh_arguments(ulysses, ring, dp, plan, layout, validate, timeout, world)
    if device is None:
        if torch.cuda.is_available() and dist.get_backend() != "gloo":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    device = mesh_device(device)
    if timeout is None:
        timeout = default_timeout()
    groups, grid = _mesh_groups(device, dp, ring, ulysses, timeout, share_world_with)
    out = CPMesh(
        ulysses_size=ulysses,
        ring_size=ring,
        dp_size=dp,
        layout=layout,
        device=device,
        validate=validate,
        timeout=timeout,
        **groups,
    )
    _announce(out, grid)
    return out


def _mesh_groups(
    device: torch.device,
    dp: int,
    ring: int,
    ulysses: int,
    timeout: datetime.timedelta,
    share_world_with: CPMesh | None,
) -> tuple[dict[str, Any], list]:
    """`CPMesh`'s group and coordinate fields, and the [dp][ring][ulysses] rank grid: every group, in one order."""
    mesh = _device_mesh(device, (dp, ring, ulysses), timeout)
    dp_rank, ring_rank, ulysses_rank = mesh.get_coordinate()
    grid = mesh.mesh.tolist()  # [dp][ring][ulysses] -> global rank
    ring_ranks = [grid[dp_rank][j][ulysses_rank] for j in range(ring)]
    # The ring gets a second communicator for backward so that forward and backward exchanges
    # (e.g. with activation checkpointing or pipelining) cannot serialise on each other.
    ring_bwd = _my_group([[grid[d][j][i] for j in range(ring)] for d in range(dp) for i in range(ulysses)], timeout)
    cp_lists = [[x for row in grid[d] for x in row] for d in range(dp)]
    # DTensor (FSDP2) caches plans by mesh equality (shape and dim names, not groups): a name of its own per
    # mesh keeps a destroyed mesh's cached plans (and groups) from reaching this one (destroy_cp_mesh)
    serial = next(_SERIAL)
    cp_flat = _flattened(mesh, ("ring", "ulysses"), f"cp_{serial}", timeout)
    dp_cp = (
        share_world_with.dp_cp_mesh
        if share_world_with is not None  # the loss's and FSDP2's
        else _flattened(mesh, ("dp", "ring", "ulysses"), f"dp_cp_{serial}", timeout)
    )
    # The validation all-reduce has a host (gloo) group of its own: it never syncs the device, and a
    # rank that checks while the others skip (validate=True) can only time out, never pair its
    # check with another collective.
    check_group = _my_group(cp_lists, timeout, backend="gloo")
    groups = dict(
        device_mesh=mesh,
        ulysses_group=mesh.get_group("ulysses"),
        ring_group=mesh.get_group("ring"),
        ring_group_bwd=ring_bwd,
        cp_group=cp_flat.get_group(),
        dp_cp_group=dp_cp.get_group(),
        dp_cp_mesh=dp_cp,
        ulysses_rank=ulysses_rank,
        ring_rank=ring_rank,
        dp_rank=dp_rank,
        ring_ranks=ring_ranks,
        check_group=check_group,
    )
    return groups, grid


def destroy_cp_mesh(cp: CPMesh) -> None:
    """Destroy the process groups `cp` created (every rank of the world calls it; the mesh must not be used
    afterwards; the default group stays). Why: every group keeps threads and sockets for the life of the
    process (gloo: three threads that wake up periodically, measured at 0.4-0.8 ms of CPU per group and
    second while idle, benchmarks/idle_groups.py), so a program that builds meshes again and again (a test
    harness, re-meshing after a lost worker) should destroy those it no longer uses.
    A family of meshes (`hcp.init_cp_meshes`) is destroyed whole.

    Args:
        cp: The mesh (or family of meshes) to destroy.
    """
    if isinstance(getattr(cp, "meshes", None), dict):  # a CPMeshes (engine/meshes.py): it knows what it shares
        cp.destroy()
        return
    default = dist.distributed_c10d._get_default_group()
    groups = [cp.ulysses_group, cp.ring_group, cp.ring_group_bwd, cp.cp_group, cp.dp_cp_group, cp.check_group]
    if cp.device_mesh is not None:
        groups += [cp.device_mesh.get_group(name) for name in cp.device_mesh.mesh_dim_names]
    seen: set[int] = set()
    for group in groups:
        if group is None or group is default or group == dist.GroupMember.NON_GROUP_MEMBER or id(group) in seen:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)
    del groups, group
    if cp.device_mesh is not None:  # DTensor's caches may keep the DeviceMesh: it must not keep the groups
        getattr(cp.device_mesh, "_pg_registry", {}).clear()
    # a destroyed group's threads end with its last reference: the mesh lets go of them (using it raises)
    for name in (
        "ulysses_group",
        "ring_group",
        "ring_group_bwd",
        "cp_group",
        "dp_cp_group",
        "check_group",
        "device_mesh",
        "dp_cp_mesh",
    ):
        setattr(cp, name, DestroyedGroup())


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


def _group_options(timeout: datetime.timedelta) -> tuple[str, Any] | None:
    """(backend, options with `timeout`) for new DeviceMesh groups; None on a torch without them."""
    backend = dist.get_backend()
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
        else:
            return None
        opts._timeout = timeout
    except Exception:  # an older torch: no such options
        return None
    return backend, opts


def _device_mesh(device: torch.device, shape: tuple[int, int, int], timeout: datetime.timedelta) -> DeviceMesh:
    """The DeviceMesh with `timeout` built into its groups' options: setting it afterwards is not
    enough (gloo's point-to-point waits keep the timeout their context was created with)."""
    names = ("dp", "ring", "ulysses")
    options = _group_options(timeout)
    if options is not None:
        try:
            return init_device_mesh(
                device.type, shape, mesh_dim_names=names, backend_override={n: options for n in names}
            )
        except TypeError:  # torch without backend_override
            pass
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    for dim in ("ulysses", "ring"):
        _set_timeout(mesh.get_group(dim), timeout)
    return mesh


def _flattened(mesh: DeviceMesh, dims: tuple[str, ...], name: str, timeout: datetime.timedelta) -> DeviceMesh:
    """The 1-D mesh over `dims` of `mesh` (row-major: the cp rank order ring-major, ulysses-minor),
    its group with `timeout`."""
    sub = mesh[dims]
    options = _group_options(timeout)
    try:
        flat = sub._flatten(name, backend_override=options) if options is not None else sub._flatten(name)
    except TypeError:  # torch without backend_override
        flat = sub._flatten(name)
        _set_timeout(flat.get_group(), timeout)
    return flat


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._set_pg_timeout(timeout, group)
    except Exception as exc:  # torch without per-group timeouts: say so once instead of hanging silently
        log.warning(
            "could not set timeout=%s on a DeviceMesh group (%s); that group keeps its own timeout", timeout, exc
        )


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
    placement = (
        f"ulysses ranks {ulysses_ranks} on node(s) {nodes}"
        if nodes is not None
        else f"ulysses ranks {ulysses_ranks} (LOCAL_WORLD_SIZE unset: node placement unknown)"
    )
    if me == 0 or log.isEnabledFor(logging.DEBUG):
        log.info(
            "hybrid-cp mesh: ulysses=%d ring=%d dp=%d layout=%s backend=%s device=%s validate=%s "
            "timeout=%s; rank %d: %s, ring ranks %s",
            cp.ulysses_size,
            cp.ring_size,
            cp.dp_size,
            cp.layout,
            backend,
            cp.device,
            cp.validate,
            cp.timeout,
            me,
            placement,
            cp.ring_ranks,
        )
    if nodes is not None and len(nodes) > 1:
        log.warning(
            "the ulysses group %s spans nodes %s (LOCAL_WORLD_SIZE=%d): its all-to-all runs over the "
            "inter-node network; use ulysses <= %d and put the rest of the degree into ring",
            ulysses_ranks,
            nodes,
            local,
            local,
        )


def _my_group(rank_lists: list[list[int]], timeout: datetime.timedelta | None = None, backend: str | None = None):
    """Create one group per list (every rank must create all of them, in the same order) and
    return the one holding this rank."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        g = dist.new_group(ranks, timeout=timeout, backend=backend)
        if me in ranks:
            mine = g
    return mine
