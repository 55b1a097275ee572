"""FSDP2 over the flattened (dp, ring, ulysses) mesh, and gradient averaging without FSDP.

Parameters, gradients and optimizer state are sharded over every rank of the mesh (ZeRO-3 over
the data + sequence group, as in the Ulysses paper): the cp ranks of one sequence hold the same
weights, so they can share one copy of them.

Gradient convention (see docs/training.md): per-rank gradients AVERAGE over the dp x cp ranks to
the single-device gradient. `hcp.cross_entropy` scales its backward for that, so FSDP2's default
reduce-scatter (an average over the mesh) is exact, as is DDP's all-reduce average and
`average_gradients` below.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.mesh import CPMesh
from ..errors import ConfigError, InputTypeError


def flat_mesh(cp: CPMesh):
    """The 1-D DeviceMesh over all dp x ring x ulysses ranks (the FSDP2 sharding group): the mesh's
    flattened dimension, built once by `hcp.init_cp_mesh`."""
    if cp.device_mesh is None or cp.dp_cp_mesh is None:
        raise ConfigError("this CPMesh has no device_mesh; build it with hcp.init_cp_mesh")
    return cp.dp_cp_mesh


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: transformers' `_no_split_modules` (the outermost ones: Mamba lists its
    block and the mixer inside it, and a parameter can be sharded once), else ModuleList items."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names] if names else []
    inner = {id(d) for m in found for d in m.modules() if d is not m}
    found = [m for m in found if id(m) not in inner]
    if not found:
        for m in model.modules():
            if isinstance(m, nn.ModuleList):
                found.extend(m)
    return found


def shard_model(model: nn.Module, cp: CPMesh, **fully_shard_kwargs: Any) -> nn.Module:
    """Apply FSDP2 `fully_shard` to each block of `model` and to the model, over all dp x cp ranks.

    Extra keyword arguments go to `torch.distributed.fsdp.fully_shard` (e.g. `mp_policy`,
    `reshard_after_forward`, `offload_policy`); `mesh` is chosen here. Call it after
    `apply_context_parallel` and before building the optimizer. FSDP2 averages gradients over the
    mesh, which with `hcp.cross_entropy` gives the single-device gradient.

    Args:
        model: The model, after `apply_context_parallel`.
        cp: The mesh.
        **fully_shard_kwargs: Passed to `fully_shard`.

    Returns:
        The model.
    """
    from torch.distributed.fsdp import fully_shard

    if not isinstance(cp, CPMesh):
        raise InputTypeError(f"cp must be a CPMesh from hcp.init_cp_mesh(...), got {type(cp).__name__}")
    if "mesh" in fully_shard_kwargs:
        raise ConfigError(
            "shard_model picks the mesh (all dp x ring x ulysses ranks); drop mesh=... or call fully_shard yourself"
        )
    mesh = flat_mesh(cp)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce-average the gradients of a replicated (non-FSDP, non-DDP) model, as DDP does; with
    `hcp.cross_entropy` it yields the single-device gradient.

    Args:
        model: The model, after backward.
        group: The ranks to average over: all of them by default (dp replicas that each ran their share of the
            batch); a mesh's `cp.cp_group` where each replica wants the gradient of its own batch.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():  # one bucket per dtype
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


__all__ = ["shard_model", "flat_mesh", "average_gradients"]
