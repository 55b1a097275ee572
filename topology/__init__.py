"""Cluster model, cost model and planner for hybrid-cp meshes.

>>> import topology
>>> cluster = topology.Cluster.preset("dgx-h100", nodes=4)
>>> model = topology.ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)
>>> best = topology.plan(cluster, model, seq_len=1 << 20).best   # best.ulysses, best.ring, best.dp
"""

from .cluster import Accelerator, Cluster, ClusterError, LinkSpec
from .cost import Estimate, ModelShape, comm_bytes, dtype_bytes, estimate, head_split
from .discover import discover
from .placement import (
    PlacementError,
    PlacementReport,
    PlacementWarning,
    check_placement,
    fitting_ulysses_degrees,
    mesh_ranks,
    ring_groups,
    ulysses_groups,
)
from .planner import Plan, PlanError, PlanList, Rejected, plan

__all__ = [
    "Accelerator",
    "Cluster",
    "ClusterError",
    "LinkSpec",
    "Estimate",
    "ModelShape",
    "comm_bytes",
    "dtype_bytes",
    "estimate",
    "head_split",
    "discover",
    "PlacementError",
    "PlacementReport",
    "PlacementWarning",
    "check_placement",
    "fitting_ulysses_degrees",
    "mesh_ranks",
    "ring_groups",
    "ulysses_groups",
    "Plan",
    "PlanError",
    "PlanList",
    "Rejected",
    "plan",
]
