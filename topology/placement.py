"""Rank placement of the (dp, ring, ulysses) mesh and the checks that keep all-to-alls on fast links.

The mesh is laid out with ulysses innermost: global rank ``d*(u*r) + j*u + i`` is data-parallel
replica ``d``, ring rank ``j``, ulysses rank ``i``. Ulysses groups are therefore runs of ``u``
consecutive ranks (one node, or one NVLink domain, when ``u`` divides its size) and ring groups
stride by ``u`` across nodes. This matches ``DeviceMesh(("dp", "ring", "ulysses"))`` built from a
row-major ``arange(world).reshape(dp, r, u)``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .cluster import TIER_DOMAIN, TIER_FABRIC, TIER_NODE, Cluster

__all__ = [
    "PlacementError",
    "PlacementWarning",
    "PlacementReport",
    "mesh_ranks",
    "ulysses_groups",
    "ring_groups",
    "fitting_ulysses_degrees",
    "check_placement",
    "divisors",
]


class PlacementError(ValueError):
    """A (ulysses, ring, dp) split that does not fit the cluster as asked."""


class PlacementWarning(UserWarning):
    """Emitted instead of :class:`PlacementError` when ``check_placement(..., warn=True)``."""


def divisors(n: int) -> list[int]:
    """The degrees ``n`` ranks split into evenly (ascending): candidate ulysses, ring and cp sizes."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _validate_degrees(world: int, ulysses: int, ring: int, dp: int | None) -> int:
    for name, v in (("ulysses", ulysses), ("ring", ring)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlacementError(f"{name}={v!r} must be an integer >= 1")
    cp = ulysses * ring
    if dp is None:
        if world % cp:
            raise PlacementError(
                f"ulysses*ring = {ulysses}*{ring} = {cp} does not divide the world size {world}; "
                f"choose degrees whose product divides {world}"
            )
        return world // cp
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise PlacementError(f"dp={dp!r} must be an integer >= 1")
    if dp * cp != world:
        raise PlacementError(
            f"dp*ring*ulysses = {dp}*{ring}*{ulysses} = {dp * cp} must equal the world size {world}; "
            f"use dp={world // cp}" + ("" if world % cp == 0 else f" with a cp size dividing {world}")
        )
    return dp


def mesh_ranks(world: int, ulysses: int, ring: int, dp: int | None = None) -> list[list[list[int]]]:
    """Global ranks as ``[dp][ring][ulysses]`` (ulysses innermost, contiguous).

    Args:
        world: Ranks in all.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dp: The data-parallel degree; None: world // (ulysses * ring).

    Returns:
        The ranks, indexed ``[dp][ring][ulysses]``.
    """
    dp = _validate_degrees(world, ulysses, ring, dp)
    return [[[d * ulysses * ring + j * ulysses + i for i in range(ulysses)] for j in range(ring)] for d in range(dp)]


def ulysses_groups(world: int, ulysses: int, ring: int, dp: int | None = None) -> list[list[int]]:
    """Every ulysses group (the ranks of one all-to-all).

    Args:
        world: Ranks in all.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dp: The data-parallel degree; None: world // (ulysses * ring).

    Returns:
        The groups' ranks.
    """
    return [grp for rep in mesh_ranks(world, ulysses, ring, dp) for grp in rep]


def ring_groups(world: int, ulysses: int, ring: int, dp: int | None = None) -> list[list[int]]:
    """Every ring group, in ring order (rank j sends to rank j+1 mod r).

    Args:
        world: Ranks in all.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dp: The data-parallel degree; None: world // (ulysses * ring).

    Returns:
        The groups' ranks.
    """
    return [[rep[j][i] for j in range(ring)] for rep in mesh_ranks(world, ulysses, ring, dp) for i in range(ulysses)]


def fitting_ulysses_degrees(cluster: Cluster, cp_size: int | None = None) -> list[int]:
    """Ulysses degrees whose groups stay inside one NVLink domain (one node when there is none).

    With ``cp_size`` only degrees that divide it are returned, so ``ring = cp_size // u`` is integral.

    Args:
        cluster: The cluster.
        cp_size: Keep only degrees dividing it.

    Returns:
        The degrees, ascending.
    """
    dom = min(cluster.domain_size, cluster.world_size)
    out = [u for u in range(1, dom + 1) if dom % u == 0]
    if cp_size is not None:
        out = [u for u in out if cp_size % u == 0]
    return out


@dataclass(frozen=True)
class PlacementReport:
    """What :func:`check_placement` found: the worst link each dimension uses."""

    ulysses: int
    ring: int
    dp: int
    ulysses_link: str
    ring_link: str
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def worst_tier(cluster: Cluster, ranks: list[int], pairs: str) -> int:
    """Slowest tier used by a group: among all pairs (``"all"``) or ring neighbours (``"ring"``)."""
    if len(ranks) < 2:
        return -1
    if pairs == "ring":
        return max(cluster.tier(ranks[k], ranks[(k + 1) % len(ranks)]) for k in range(len(ranks)))
    # all pairs: the first and last rank of a contiguous group bound the span
    return max(cluster.tier(ranks[0], b) for b in ranks[1:])


def check_placement(
    cluster: Cluster,
    ulysses: int,
    ring: int = 1,
    dp: int | None = None,
    *,
    warn: bool = False,
    world_size: int | None = None,
) -> PlacementReport:
    """Check that every ulysses group sits inside one node or NVLink domain.

    Raises :class:`PlacementError` (or, with ``warn=True``, emits a :class:`PlacementWarning` and
    returns) naming the offending group, its nodes, and the ulysses degrees that would fit. A ring
    that crosses nodes is expected and fine. Splitting a group across the two sockets of a PCIe box is
    only warned about (slow, but sometimes still the best choice: the planner prices it).
    ``world_size`` (default: the whole cluster) uses only the first ranks of the cluster.

    Args:
        cluster: The cluster.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dp: The data-parallel degree; None: what the world leaves.
        warn: Warn instead of raising.
        world_size: Ranks used; None: the whole cluster.

    Returns:
        What was checked, with the groups' nodes.

    Raises:
        PlacementError: A ulysses group spans nodes (unless `warn`).
    """
    world = cluster.world_size if world_size is None else world_size
    if not 1 <= world <= cluster.world_size:
        raise PlacementError(f"world_size={world} must be in [1, {cluster.world_size}] for cluster {cluster.name!r}")
    dp = _validate_degrees(world, ulysses, ring, dp)
    problems: list[str] = []
    notes: list[str] = []
    groups = ulysses_groups(world, ulysses, ring, dp)
    u_tier = max((worst_tier(cluster, g, "all") for g in groups), default=-1)
    r_tier = max((worst_tier(cluster, g, "ring") for g in ring_groups(world, ulysses, ring, dp)), default=-1)
    fits = fitting_ulysses_degrees(cluster, ulysses * ring)
    fits_txt = ", ".join(str(u) for u in fits)
    if u_tier >= TIER_FABRIC or (u_tier == TIER_DOMAIN and cluster.domain_size == cluster.gpus_per_node):
        bad = next(g for g in groups if worst_tier(cluster, g, "all") == u_tier)
        nodes = sorted({r // cluster.gpus_per_node for r in bad})
        best = max(fits)
        problems.append(
            f"ulysses={ulysses} puts ranks {bad[0]}-{bad[-1]} on nodes {nodes[0]}-{nodes[-1]} "
            f"({cluster.gpus_per_node} GPUs per node, NVLink domain {cluster.domain_size}): its all-to-all "
            f"would cross the inter-node fabric. Ulysses degrees that fit: {fits_txt}; "
            f"e.g. ulysses={best}, ring={ulysses * ring // best} keeps cp={ulysses * ring}"
        )
    elif u_tier == TIER_NODE and cluster.cross_socket is not None:
        notes.append(
            f"ulysses={ulysses} spans both CPU sockets of a node ({cluster.socket_gpus} GPUs per socket): "
            f"its all-to-all crosses {cluster.cross_socket.kind}; ulysses <= {cluster.socket_gpus} keeps it on one switch"
        )
    elif ulysses > 1 and fits and ulysses not in fits:
        problems.append(
            f"ulysses={ulysses} does not divide the NVLink domain of {cluster.domain_size} GPUs, so some "
            f"groups straddle domains; ulysses degrees that fit: {fits_txt}"
        )
    report = PlacementReport(
        ulysses,
        ring,
        dp,
        cluster.tier_name(u_tier),
        cluster.tier_name(r_tier),
        tuple(problems),
        tuple(notes),
    )
    for note in notes:  # slow but legal: always a warning, never an error
        warnings.warn(note, PlacementWarning, stacklevel=2)
    if problems:
        msg = "; ".join(problems)
        if warn:
            warnings.warn(msg, PlacementWarning, stacklevel=2)
        else:
            raise PlacementError(msg)
    return report
