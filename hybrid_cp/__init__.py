"""hybrid-cp: exact context-parallel attention (Ulysses inside a node x ring across nodes)."""

from .attention import attention
from .batch import shard_batch, shift_labels
from .loss import cross_entropy, token_count
from .comm import comm_bytes, head_split, reset_comm_bytes
from .kernels import AttentionKernel, available_kernels, get_kernel, register_kernel
from .layout import granularity, padded_length, positions, shard, unshard
from .mesh import CPMesh, init_cp_mesh

__version__ = "0.1.0"

__all__ = ["attention", "shard_batch", "shift_labels", "cross_entropy", "token_count", "init_cp_mesh", "CPMesh", "shard", "unshard", "positions", "granularity",
           "padded_length", "comm_bytes", "reset_comm_bytes", "head_split", "AttentionKernel",
           "register_kernel", "get_kernel", "available_kernels"]
