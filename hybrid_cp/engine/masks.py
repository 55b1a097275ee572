"""`hcp.AttnMask`: topology's range-slice mask, raising hybrid-cp's typed ConfigError and carrying its slices as a
tensor for the compiled op.

The representation, its builders and the planner's queries live once in `topology.masks` (torch-free,
read by the layout arithmetic); this subclass swaps the error class, so a bad mask built through
`hybrid_cp` is a `ConfigError` (still a ValueError) like every other bad setting, and keeps its encoding
(`encoded`, `encode_mask`): under `torch.compile` the mask reaches the custom op as that tensor, a graph
input like `cu_seqlens`, so a new mask every step is new data, not a recompile (`engine/compiled.py`).
"""

from __future__ import annotations

import functools
import sys

import torch

from topology import masks as range_masks

from ..errors import ConfigError

_FIELDS = 6  # (q_start, q_end, k_start, k_end, lo, hi) per slice


def encode_mask(mask: range_masks.AttnMask) -> torch.Tensor:
    """A mask as an int64 CPU tensor [1 + 6 * slices]: seq_len, then each slice's six fields, an open band
    (None) as -UNBOUNDED (lo) or +UNBOUNDED (hi), which `decode_mask` turns back into None."""
    values = [mask.seq_len]
    for s in mask.slices:
        lo, hi = s.offsets()
        values += [s.q_start, s.q_end, s.k_start, s.k_end, lo, hi]
    return torch.tensor(values, dtype=torch.int64)


def decode_mask(encoded: torch.Tensor) -> AttnMask:
    """The `hcp.AttnMask` of `encode_mask(m)`: equal to `m` (for an `hcp.AttnMask` `m`), rebuilt through
    `AttnMask.from_slices`, which checks the slices and gives the canonical form (sentinel bands -> None)."""
    values = tuple(encoded.tolist())
    if len(values) < 1 or (len(values) - 1) % _FIELDS:
        raise ConfigError(
            f"an encoded mask holds seq_len and {_FIELDS} ints per slice, got {len(values)} ints; "
            f"build it with hybrid_cp.engine.masks.encode_mask"
        )
    return _decoded(values)


@functools.lru_cache(maxsize=16)
def _decoded(values: tuple[int, ...]) -> AttnMask:
    """The mask of valid encoded `values`, remembered: the compiled op decodes each mask in forward and again
    in backward, and `from_slices`' checks cost about 25 ms for 4000 slices."""
    slices = [values[i : i + _FIELDS] for i in range(1, len(values), _FIELDS)]
    return AttnMask.from_slices(values[0], slices)


class AttnMask(range_masks.AttnMask):
    """Which keys each query sees, as disjoint range slices over the global rows of one sequence.

    Query i sees key j iff, for some slice ``(q_start, q_end, k_start, k_end, lo, hi)``,
    q_start <= i < q_end, k_start <= j < k_end and lo <= j - i <= hi (None: unbounded). Build one
    with `from_slices`, `documents`, `blocks`, `prefix_lm` or `shared_prefix`; a row that no slice
    covers sees no key. Immutable and hashable. See docs/attention.md, "Masks".

    Args:
        seq_len: Tokens in the row.
        slices: The canonical slices (sorted, each cut to the cells its band reaches).

    Attributes:
        encoded: `encode_mask(self)`, built with the mask (not a field: equality and hashing ignore it).
            Under `torch.compile` it is what the compiled op receives; its length is marked dynamic when
            dynamo is loaded, so masks of any slice count share one graph (a mask built before dynamo was
            loaded costs one recompile at the first other slice count: automatic dynamic shapes).
    """

    error = ConfigError
    encoded: torch.Tensor

    def __post_init__(self) -> None:
        super().__post_init__()
        encoded = encode_mask(self)
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:  # loaded by a torch.compile; otherwise left out (about 1 s of import)
            dynamo.maybe_mark_dynamic(encoded, 0)
        object.__setattr__(self, "encoded", encoded)


__all__ = ["AttnMask", "decode_mask", "encode_mask"]
