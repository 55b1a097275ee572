"""hybrid-cp: exact context-parallel attention (Ulysses inside a node x ring across nodes)."""

from . import errors
from .engine.attention import attention
from .engine.comm import comm_bytes, reset_comm_bytes
from .engine.heads import head_split
from .engine.kernels import AttentionKernel, available_kernels, get_kernel, register_kernel
from .engine.layout import granularity, padded_length, positions, shard, unshard
from .engine.masks import AttnMask
from .engine.mesh import CPMesh, destroy_cp_mesh, init_cp_mesh
from .engine.meshes import CPMeshes, init_cp_meshes
from .errors import *  # noqa: F403 (the error classes: errors.__all__)
from .integrations.vision import image_row
from .training.batch import shard_batch, shift_labels
from .training.checkpoint import (
    CheckpointInfo,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    replica_samples,
    restart_store,
    save_checkpoint,
)
from .training.dynamic import DynamicCP, dynamic_loss, micro_batches, schedule_documents
from .training.loss import cross_entropy
from .training.offload import offload_checkpoints, unoffload_checkpoints
from .training.tiled import lm_loss, tile_mlp, tile_norm, tiled_cross_entropy, untile_mlp, untile_norm

__version__ = "0.1.0"

__all__ = [
    "tiled_cross_entropy",
    "lm_loss",
    "tile_mlp",
    "untile_mlp",
    "attention",
    "shard_batch",
    "shift_labels",
    "cross_entropy",
    "init_cp_mesh",
    "destroy_cp_mesh",
    "CPMesh",
    "shard",
    "unshard",
    "positions",
    "granularity",
    "padded_length",
    "comm_bytes",
    "reset_comm_bytes",
    "head_split",
    "AttentionKernel",
    "register_kernel",
    "get_kernel",
    "available_kernels",
]
__all__ += ["AttnMask"]
__all__ += ["init_cp_meshes", "CPMeshes", "schedule_documents", "micro_batches", "dynamic_loss", "DynamicCP"]
__all__ += ["offload_checkpoints", "unoffload_checkpoints", "tile_norm", "untile_norm"]
__all__ += [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "prune_checkpoints",
    "replica_samples",
    "restart_store",
    "CheckpointInfo",
]
__all__ += ["image_row"]
__all__ += errors.__all__
