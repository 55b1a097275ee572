"""The context-parallel trainer's mesh: the given degrees or the planner's split for "auto" (`auto_degrees`,
`resolve_mesh`), the mesh of accelerate's device mesh (`cp_mesh_from_device_mesh`,
`cp_mesh_from_accelerator`), and the groups' timeout from `TrainingArguments.ddp_timeout` (`ddp_timeout`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..engine.mesh import CPMesh, init_cp_mesh
from ..errors import ConfigError, SetupError
from .config_shape import model_shape

log = logging.getLogger("hybrid_cp")


def auto_degrees(
    config: Any, ulysses: int | str, ring: int | str, world: int, seq_len: int, cp_size: int | None = None
) -> tuple[int, int]:
    """(ulysses, ring) from the planner (`topology.planner.plan`) for the detected cluster and the model's shape,
    honouring a degree that was given (and `cp_size`, a fixed ulysses x ring); logs the choice and why. A split
    fits when some rung of `hybrid-cp plan`'s memory ladder fits it, as on the command line."""
    from topology.discovery import discover
    from topology.memory import memory_ladder
    from topology.planner import plan

    for name, value in (("ulysses", ulysses), ("ring", ring)):
        if value != "auto" and not (isinstance(value, int) and value >= 1):
            raise ConfigError(f'{name}={value!r}: expected a positive int or "auto"')
    if not (isinstance(seq_len, int) and seq_len >= 1):
        raise ConfigError(
            f'cp_seq_len={seq_len!r}: "auto" needs the training sequence length (a positive int) '
            f"to plan for; pass cp_seq_len=... or explicit ulysses= and ring="
        )
    cluster = discover()
    plans = plan(
        cluster,
        model_shape(config),
        seq_len,
        world_size=world,  # memory: the first rung that fits
        dp=None if cp_size is None else world // cp_size,
        ladder=memory_ladder(),
    )
    fits = [p for p in plans if (ulysses == "auto" or p.ulysses == ulysses) and (ring == "auto" or p.ring == ring)]
    if not fits:
        raise ConfigError(
            f"ulysses={ulysses!r}, ring={ring!r}: the planner found no feasible split of {world} ranks "
            f"with that degree for seq_len={seq_len}:\n{plans.explain(top=8)}"
        )
    best = fits[0]
    log.info(
        "hybrid_cp: ulysses=%r ring=%r resolved by the planner to ulysses=%d ring=%d dp=%d for seq_len=%d on "
        "%s: the fastest feasible split (time per layer / dp, ties to more ulysses)\n%s",
        ulysses,
        ring,
        best.ulysses,
        best.ring,
        best.dp,
        seq_len,
        cluster.name,
        best.explain(),
    )
    return best.ulysses, best.ring


def resolve_mesh(
    model: torch.nn.Module,
    ulysses: int | str,
    ring: int | str,
    layout: str,
    validate: bool | str,
    seq_len: int | None = None,
    timeout: Any = None,
) -> CPMesh:
    """The cp mesh of the trainer: the given degrees, or the planner's choice for "auto"; its groups time out
    after `timeout` (None: the default group's)."""
    if not dist.is_available() or not dist.is_initialized():
        hint = ""
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":  # set by accelerate launch --cpu / use_cpu
            hint = (
                " (accelerate launch --cpu, or a config with use_cpu: true, starts ONE process per machine "
                "unless given --mpirun_hostfile; on CPU use accelerate launch --multi_gpu --num_processes N, "
                "torchrun underneath, with TrainingArguments(use_cpu=True))"
            )
        raise SetupError(
            "the context-parallel trainer needs torch.distributed: launch with torchrun or accelerate "
            "launch (on CPU with TrainingArguments(use_cpu=True): gloo)" + hint
        )
    if ulysses == "auto" or ring == "auto":
        ulysses, ring = auto_degrees(model.config, ulysses, ring, dist.get_world_size(), seq_len)
    return init_cp_mesh(ulysses, ring, layout=layout, validate=validate, timeout=timeout)


def cp_mesh_from_device_mesh(
    mesh: Any,
    ulysses: int | str,
    *,
    config: Any = None,
    seq_len: int | None = None,
    layout: str = "zigzag",
    validate: bool | str = True,
) -> CPMesh:
    """A `CPMesh` whose cp groups are the "cp" groups of `mesh` (accelerate's DeviceMesh), that dimension
    unflattened into (ring, ulysses) with ulysses innermost (consecutive ranks: inside a node). `ulysses` is
    an int dividing the cp size, or "auto" (the planner, for the model `config` and `seq_len`)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" not in names:
        raise ConfigError(
            f"the device mesh has dimensions {names} and no 'cp': configure "
            f"ParallelismConfig(cp_size=...) (accelerate) or build the mesh with hcp.init_cp_mesh"
        )
    for other in ("tp", "sp"):
        if other in names and mesh[other].size() > 1:
            raise ConfigError(
                f"the device mesh has {other}={mesh[other].size()}: hybrid-cp does not combine with "
                f"accelerate's {other} dimension; set {other}_size=1"
            )
    cp_size = mesh["cp"].size()
    grid = mesh.mesh.movedim(names.index("cp"), -1).reshape(-1, cp_size)
    if not torch.equal(grid, torch.arange(grid.numel()).reshape(-1, cp_size)):
        raise ConfigError(
            f"the device mesh's cp groups {grid.tolist()} are not consecutive ranks in order; hybrid-cp "
            f"puts dp outermost and ulysses innermost (accelerate's order with tp = sp = 1)"
        )
    if ulysses == "auto":
        ulysses, _ = auto_degrees(config, "auto", "auto", grid.numel(), seq_len, cp_size=cp_size)
    if not (isinstance(ulysses, int) and ulysses >= 1 and cp_size % ulysses == 0):
        raise ConfigError(f"ulysses={ulysses!r} must be a positive int dividing the mesh's cp size {cp_size}")
    return init_cp_mesh(ulysses, cp_size // ulysses, dp=grid.shape[0], layout=layout, validate=validate)


def cp_mesh_from_accelerator(accelerator: Any, ulysses: int | str, **kwargs: Any) -> CPMesh:
    """`cp_mesh_from_device_mesh` for `accelerate.Accelerator(parallelism_config=ParallelismConfig(cp_size=...))`:
    its `torch_device_mesh`. (accelerate builds that mesh only with FSDP2 or on GPUs: not run on CPU here.)"""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        raise ConfigError(
            "the accelerator has no device mesh: create it with "
            "Accelerator(parallelism_config=ParallelismConfig(cp_size=...))"
        )
    return cp_mesh_from_device_mesh(mesh, ulysses, **kwargs)


def ddp_timeout(args: Any) -> Any:
    """The Trainer's `ddp_timeout` (a timedelta) where it was set, else None: every group then keeps the default
    group's timeout. transformers gives it to the default group on GPUs only; on CPU it is set here, so that the
    stock Trainer's own collectives (its count of label tokens) give up when the mesh's do (docs/errors.md)."""
    field = getattr(type(args), "__dataclass_fields__", {}).get("ddp_timeout")
    if args is None or field is None or args.ddp_timeout == field.default:
        return None
    from torch.distributed import distributed_c10d as c10d

    if getattr(args, "use_cpu", False) and dist.is_initialized() and hasattr(c10d, "_set_pg_timeout"):
        c10d._set_pg_timeout(args.ddp_timeout_delta)
    return args.ddp_timeout_delta
