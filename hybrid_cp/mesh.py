"""CPMesh: the 2-D (ring x ulysses) context-parallel mesh, with an outer data-parallel dim.

Ulysses ranks are contiguous global ranks (one node, fast links); ring ranks stride across
nodes. Every process group and coordinate comes from the ("dp", "ring", "ulysses") DeviceMesh.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from topology.layouts import LAYOUTS, check_layout


@dataclass
class CPMesh:
    """Context-parallel mesh: who my ulysses and ring peers are, and how sequences are laid out.

    `validate` makes every attention call all-gather a few integers of metadata over the cp
    group first, so that ranks called with inconsistent shapes all raise instead of hanging.
    It costs one tiny collective per call; set it to False once a training loop is known good.

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
    validate: bool = True
    sharded_lengths: dict[int, set[int]] = field(default_factory=dict, repr=False)
    sent_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int), repr=False)

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
                 validate: bool = True) -> CPMesh:
    """Build the ("dp", "ring", "ulysses") mesh after `torch.distributed.init_process_group`.

    `plan` may be a `topology` plan (anything with integer `ulysses`, `ring`, `dp` attributes)
    instead of explicit degrees. `dp` defaults to world_size // (ulysses * ring).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_cp_mesh needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) first (or launch with torchrun)")
    if plan is not None:
        if ulysses is not None or ring is not None:
            raise ValueError("pass either plan=... or ulysses=/ring=, not both")
        ulysses, ring = int(plan.ulysses), int(plan.ring)
        dp = int(getattr(plan, "dp", 0)) or dp
    if ulysses is None or ring is None:
        raise ValueError("init_cp_mesh needs ulysses= and ring= (or plan=)")
    check_layout(layout)
    world = dist.get_world_size()
    for name, value in (("ulysses", ulysses), ("ring", ring)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    cp = ulysses * ring
    if world % cp != 0:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {cp} does not divide the world size "
                         f"{world}; degrees that would work: {_divisor_hint(world)}")
    if dp is None:
        dp = world // cp
    if dp * cp != world:
        raise ValueError(f"dp={dp} x ulysses={ulysses} x ring={ring} = {dp * cp} != world size "
                         f"{world}; use dp={world // cp} (or leave dp unset)")
    if device is None:
        if torch.cuda.is_available() and dist.get_backend() != "gloo":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (dp, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank, ring_rank, ulysses_rank = mesh.get_coordinate()
    grid = mesh.mesh.tolist()  # [dp][ring][ulysses] -> global rank
    ring_ranks = [grid[dp_rank][j][ulysses_rank] for j in range(ring)]
    # The ring gets a second communicator for backward so that forward and backward exchanges
    # (e.g. with activation checkpointing or pipelining) cannot serialise on each other.
    ring_bwd = _my_group([[grid[d][j][i] for j in range(ring)] for d in range(dp) for i in range(ulysses)])
    cp_group = _my_group([[x for row in grid[d] for x in row] for d in range(dp)])
    return CPMesh(
        ulysses_size=ulysses, ring_size=ring, dp_size=dp, layout=layout, device=device,
        device_mesh=mesh, ulysses_group=mesh.get_group("ulysses"), ring_group=mesh.get_group("ring"),
        ring_group_bwd=ring_bwd, cp_group=cp_group,
        ulysses_rank=ulysses_rank, ring_rank=ring_rank, dp_rank=dp_rank, ring_ranks=ring_ranks,
        validate=validate)


def _my_group(rank_lists: list[list[int]]):
    """Create one group per list (every rank must create all of them, in the same order) and
    return the one holding this rank."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if me in ranks:
            mine = g
    return mine


def agree_across_ranks(cp: CPMesh, values: list[int], names: list[str], error: Exception | None,
                       what: str) -> None:
    """All-gather each cp rank's `values` and whether its own checks failed; raise on every rank
    if any rank failed or the ranks disagree, so that no rank goes on into a collective alone."""
    mine = torch.tensor([0 if error is None else 1] + list(values), dtype=torch.int64, device=cp.device)
    rows = [torch.empty_like(mine) for _ in range(cp.size)]
    dist.all_gather(rows, mine, group=cp.cp_group)
    if error is not None:
        raise error
    rows = [row.tolist() for row in rows]
    bad = [rank for rank, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(f"cp ranks {bad} rejected their {what} (their error says why); "
                         f"every rank stops here instead of hanging")
    for rank, row in enumerate(rows):
        if row[1:] != list(values):
            diffs = [f"{name}: {theirs} on cp rank {rank} vs {ours} here"
                     for name, theirs, ours in zip(names, row[1:], values) if theirs != ours]
            raise ValueError(f"inconsistent {what} across the cp group (" + "; ".join(diffs) +
                             "); every rank must pass its shard of the same batch with the same settings")
