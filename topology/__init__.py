"""Cluster model, cost model and planner for hybrid-cp meshes.

>>> import topology
>>> cluster = topology.Cluster.preset("dgx-h100", nodes=4)
>>> model = topology.ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)
>>> best = topology.plan(cluster, model, seq_len=1 << 20).best   # best.ulysses, best.ring, best.dp

Names are imported on first use, so that the engine can import the torch-free, pydantic-free
`topology.layouts` (head and token arithmetic) without loading the planner. (No submodule shares
an exported name: importing it would replace the name on the package.)
"""

from importlib import import_module

_EXPORTS = {
    "cluster": ["Accelerator", "Cluster", "ClusterError", "LinkSpec"],
    "cost": ["Estimate", "estimate"],
    "degrees": ["degree_table"],
    "discovery": ["discover"],
    "heads": ["head_split"],
    "model_shape": ["ModelShape"],
    "placement": [
        "PlacementError",
        "PlacementReport",
        "PlacementWarning",
        "check_placement",
        "fitting_ulysses_degrees",
        "mesh_ranks",
        "ring_groups",
        "ulysses_groups",
    ],
    "planner": ["Plan", "PlanError", "PlanList", "Rejected", "plan"],
    "schedule": ["Degree", "Group", "MicroBatch", "ScheduleError", "StepSchedule", "schedule_step", "uniform_degrees"],
    "traffic": ["comm_bytes"],
    "units": ["dtype_bytes"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'topology' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
