"""hybrid-cp: exact context-parallel attention (Ulysses inside a node x ring across nodes)."""

from .attention import attention
from .batch import shard_batch, shift_labels
from .loss import cross_entropy
from .comm import comm_bytes, reset_comm_bytes
from .errors import (CommTimeoutError, ConfigError, CPError, InconsistentRanksError, InputTypeError,
                     NonFiniteError, SetupError, ShapeError)
from .heads import head_split
from .kernels import AttentionKernel, available_kernels, get_kernel, register_kernel
from .layout import granularity, padded_length, positions, shard, unshard
from .mesh import CPMesh, init_cp_mesh
from .tiled import lm_loss, tile_mlp, tiled_cross_entropy, untile_mlp

__version__ = "0.1.0"

__all__ = ["tiled_cross_entropy", "lm_loss", "tile_mlp", "untile_mlp", "attention", "shard_batch", "shift_labels", "cross_entropy", "init_cp_mesh", "CPMesh", "shard", "unshard", "positions", "granularity",
           "padded_length", "comm_bytes", "reset_comm_bytes", "head_split", "AttentionKernel",
           "register_kernel", "get_kernel", "available_kernels", "CPError", "ConfigError", "ShapeError",
           "InputTypeError", "InconsistentRanksError", "SetupError", "CommTimeoutError", "NonFiniteError"]
