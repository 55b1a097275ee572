"""A family of context-parallel meshes, one per allowed degree, for per-step dynamic degrees.

Degree k's mesh is ``(dp = world / k, ring, ulysses)`` with ulysses innermost, so its cp groups are
exactly the aligned rank blocks ``[b * k, (b + 1) * k)`` the scheduler (`topology.schedule`) hands out.
Every mesh shares the first one's all-ranks group and mesh (the loss's statistics, FSDP2's sharding),
and all are created in one fixed order (ascending degree) on every rank, then warmed with one
collective per group, so no communicator is first used mid-step.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from topology.schedule import Degree, uniform_degrees

from ..errors import ConfigError, SetupError
from .mesh import CPMesh, destroy_cp_mesh, init_cp_mesh


@dataclass(eq=False)
class CPMeshes:
    """One `CPMesh` per degree (`mesh(k)`), the degrees' splits and costs for the scheduler (`degrees`),
    a host (gloo) group over the world for the schedule's digest check (`check_group`), and the shared
    all-ranks mesh FSDP2 shards over (`world_mesh`)."""

    meshes: dict[int, CPMesh]
    degrees: tuple[Degree, ...]
    world: int
    check_group: Any = None

    def mesh(self, degree: int) -> CPMesh:
        if degree not in self.meshes:
            raise ConfigError(f"degree {degree} has no mesh; this family holds degrees {sorted(self.meshes)}")
        return self.meshes[degree]

    @property
    def world_mesh(self):
        """The all-ranks DeviceMesh every degree shares (pass it to FSDP2: `hcp.shard_model`)."""
        return self.meshes[min(self.meshes)].dp_cp_mesh

    def destroy(self) -> None:
        """Destroy every group of the family (every rank calls it, through `hcp.destroy_cp_mesh`); the
        shared all-ranks group goes with the mesh that created it."""
        owner = min(self.meshes)
        for k in sorted(self.meshes, reverse=True):
            cp = self.meshes[k]
            if k != owner:
                cp.dp_cp_group = cp.dp_cp_mesh = None
            destroy_cp_mesh(cp)
        if self.check_group is not None:
            dist.destroy_process_group(self.check_group)
            self.check_group = None

    def __repr__(self) -> str:
        splits = ", ".join(f"{k}: {m.ulysses_size}x{m.ring_size}" for k, m in sorted(self.meshes.items()))
        return f"CPMeshes(world={self.world}, degree: ulysses x ring = {{{splits}}})"


def default_splits(
    world: int, degrees: list[int], heads: int | None = None, per_node: int | None = None
) -> dict[int, tuple[int, int]]:
    """(ulysses, ring) per degree without a cost model: ulysses inside a node first (`per_node`,
    default LOCAL_WORLD_SIZE, else the world), as large as divides the heads, the rest ring."""
    node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world
    out = {}
    for k in degrees:
        u = 1
        while u * 2 <= min(k, node) and k % (u * 2) == 0 and (heads is None or heads % (u * 2) == 0):
            u *= 2
        out[k] = (u, k // u)
    return out


def _degree_list(degrees: list[int] | None, world: int) -> list[int]:
    if degrees is None:
        out, k = [], 1
        while k <= world and world % k == 0:
            out.append(k)
            k *= 2
        return out
    bad = [k for k in degrees if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k & (k - 1) or world % k]
    if bad or 1 not in degrees:
        raise ConfigError(
            f"degrees={degrees!r}: each must be a power of two dividing the world size {world}, and "
            f"1 must be among them (short documents run on one rank); e.g. degrees=[1, 2, 4]"
        )
    return sorted(set(degrees))


def init_cp_meshes(
    degrees: list[int] | None = None,
    *,
    splits: dict[int, tuple[int, int]] | None = None,
    heads: int | None = None,
    per_node: int | None = None,
    cost: list[Degree] | None = None,
    layout: str = "zigzag",
    validate: bool | str = True,
    timeout: datetime.timedelta | None = None,
) -> CPMeshes:
    """Build, collectively on every rank, one mesh per allowed degree (default every power of two that
    divides the world). Each degree's (ulysses, ring): `cost` (from `topology.degree_table`, which asks the
    planner and the memory model, and also prices the groups for the scheduler), else `splits`, else
    `default_splits` (ulysses inside a node, bounded by `heads`). Free it with `hcp.destroy_cp_mesh`.

    Args:
        degrees: The allowed degrees (powers of two dividing the world); None: all of them.
        splits: (ulysses, ring) per degree, when `cost` is not given.
        heads: Query heads: bounds the default splits' ulysses degree.
        per_node: Ranks per node for the default splits; None: LOCAL_WORLD_SIZE, else the world.
        cost: `topology.degree_table`'s degrees (splits and costs).
        layout: "zigzag" or "contiguous".
        validate: As `init_cp_mesh`'s.
        timeout: As `init_cp_mesh`'s.

    Returns:
        The family of meshes, one per degree.

    Raises:
        ConfigError: A degree that is not a power of two dividing the world size.
        SetupError: No process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SetupError("init_cp_meshes needs torch.distributed: call torch.distributed.init_process_group(...) first")
    world = dist.get_world_size()
    ks = _degree_list(degrees if cost is None else [d.size for d in cost], world)
    if cost is None:
        table = {d.size: d for d in uniform_degrees(world, splits or default_splits(world, ks, heads, per_node))}
        cost = [table[k] for k in ks]
    meshes: dict[int, CPMesh] = {}
    for d in sorted(cost, key=lambda d: d.size):  # one fixed order on every rank
        first = meshes[min(meshes)] if meshes else None
        meshes[d.size] = init_cp_mesh(
            d.ulysses, d.ring, layout=layout, validate=validate, timeout=timeout, share_world_with=first
        )
    check = dist.new_group(list(range(world)), backend="gloo", timeout=meshes[min(meshes)].timeout)
    out = CPMeshes(meshes, tuple(sorted(cost, key=lambda d: d.size)), world, check)
    _warm(out)
    return out


def _warm(family: CPMeshes) -> None:
    """One small all-reduce on every group, in a fixed order: communicators exist before the first step."""
    for k in sorted(family.meshes):
        cp = family.meshes[k]
        for group in (cp.ulysses_group, cp.ring_group, cp.ring_group_bwd, cp.cp_group):
            if group is not None and cp.size > 1:
                dist.all_reduce(torch.zeros(1, device=cp.device), group=group)
    dist.all_reduce(torch.zeros(1), group=family.check_group)


__all__ = ["CPMeshes", "init_cp_meshes", "default_splits"]
