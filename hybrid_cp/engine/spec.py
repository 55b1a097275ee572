"""`AttentionSpec`: one attention call's settings (everything `hcp.attention` takes besides the tensors and
the mesh) as one frozen value, built once from the call's keywords and carried by everything that runs the
call: the checks (`validate.checked_call`), the plan (`pipeline.plan_call`, `AttentionCall.spec`), head
chunks, module chunks, the compiled op and the transformers attention function. The public function stays
flat, as flash-attn's does; below it the settings travel together, under the same names.

The value rules of each setting live in `validate.py` (with the signature the ranks agree on); the compiled
op's flat encoding lives here only (`OP_SCHEMA`, `op_args`, `from_op_args`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from topology.masks import AttnMask

from .masks import decode_mask

__all__ = ["AttentionSpec"]


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """The settings of one attention call, as the caller gave them (the checks judge them; nothing is
    normalised here, so a bad value reaches the check that names it).

    `sinks` is not a setting but a learnable tensor whose gradient flows: it travels beside q/k/v.
    `overlap` (head chunks only) posts the next head chunk's all-to-all before this chunk computes
    (`hybrid_cp/engine/headchunk.py`), at the price of another chunk's buffers alive.
    `mask` (an `hcp.AttnMask`) says which keys each query sees in place of causal/cu_seqlens/chunk_size.
    """

    causal: bool = False
    softmax_scale: float | None = None
    return_lse: bool = False
    backend: Any = "auto"
    seq_len: int | None = None
    cu_seqlens: Any = None
    window: Any = None
    head_chunks: int = 1
    softcap: float | None = None
    chunk_size: int | None = None
    overlap: bool = False
    mask: Any = None

    def key(self) -> tuple:
        """A hashable key that equals another spec's only when every setting is the same value of the same type
        (True and 1 differ: the checks judge them differently); a packed row's boundaries by value (reads a
        tensor's values: a host sync for a device tensor, as the layout does anyway). Raises TypeError for
        settings that have no such key (a caller then checks the call in full)."""
        cu = self.cu_seqlens
        if isinstance(cu, torch.Tensor):
            cu = ("tensor", cu.dtype, cu.dim(), tuple(cu.tolist()))
        elif cu is not None:
            cu = _typed(list(cu) if isinstance(cu, (list, tuple)) else cu)
        backend = self.backend if type(self.backend) is str else ("object", id(self.backend))
        values = (
            self.causal,
            self.softmax_scale,
            self.return_lse,
            self.seq_len,
            self.head_chunks,
            self.softcap,
            self.chunk_size,
            self.overlap,
        )
        kinds = tuple(map(type, values))
        if not _SCALARS.issuperset(kinds):
            raise TypeError("a setting of no plain scalar type")
        if self.mask is not None and not isinstance(self.mask, AttnMask):
            raise TypeError("a mask that is not an AttnMask")
        return values, kinds, backend, cu, _typed(self.window), self.mask

    # ---- the compiled op's flat encoding (hybrid_cp/engine/compiled.py): the only place that knows its order ----

    OP_SCHEMA = (
        "Tensor? cu_seqlens, str backend, bool causal, float? softmax_scale, int? seq_len, int[]? window, "
        "float? softcap, int? chunk_size, bool return_lse, Tensor? mask"
    )

    def op_args(self) -> tuple:
        """The spec as the compiled op's arguments (`OP_SCHEMA`): `backend` must already be a str (a kernel
        name or the op's registry key), `cu_seqlens` a tensor or None and `mask` an encoded mask
        (`engine.masks.encode_mask`) or None; a window int W is [W], (left, right) is [left, right]. Head chunks
        and their schedule are not op arguments (such calls run eagerly)."""
        window = None if self.window is None else [self.window] if isinstance(self.window, int) else list(self.window)
        return (
            self.cu_seqlens,
            self.backend,
            self.causal,
            None if self.softmax_scale is None else float(self.softmax_scale),
            self.seq_len,
            window,
            None if self.softcap is None else float(self.softcap),
            self.chunk_size,
            self.return_lse,
            self.mask,
        )

    @classmethod
    def from_op_args(cls, *args: Any, values: bool = True) -> "AttentionSpec":
        """The spec back from `op_args()` (inside the op), the mask decoded into an `hcp.AttnMask`. The fake
        implementations pass `values=False`: a fake tensor has no values, so the mask stays encoded."""
        cu_seqlens, backend, causal, softmax_scale, seq_len, window, softcap, chunk_size, return_lse, mask = args
        if window is not None:
            window = window[0] if len(window) == 1 else (window[0], window[1])
        if mask is not None and values:
            mask = decode_mask(mask)
        return cls(
            causal=causal,
            softmax_scale=softmax_scale,
            return_lse=return_lse,
            backend=backend,
            seq_len=seq_len,
            cu_seqlens=cu_seqlens,
            window=window,
            softcap=softcap,
            chunk_size=chunk_size,
            mask=mask,
        )


_SCALARS = frozenset((type(None), bool, int, float, str))


def _typed(value: Any) -> Any:
    """`value` with its type alongside (recursively in lists and tuples), so that keys of equal values of
    different types differ; anything but plain scalars is refused (TypeError)."""
    if type(value) in _SCALARS:
        return (type(value), value)
    if type(value) in (list, tuple):
        return (type(value), tuple(_typed(x) for x in value))
    raise TypeError(f"no key for {type(value).__name__}")
