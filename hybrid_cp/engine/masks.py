"""`hcp.AttnMask`: topology's range-slice mask, raising hybrid-cp's typed ConfigError.

The representation, its builders and the planner's queries live once in `topology.masks` (torch-free,
read by the layout arithmetic); this subclass only swaps the error class, so a bad mask built through
`hybrid_cp` is a `ConfigError` (still a ValueError) like every other bad setting.
"""

from __future__ import annotations

from topology import masks as range_masks

from ..errors import ConfigError


class AttnMask(range_masks.AttnMask):
    """Which keys each query sees, as disjoint range slices over the global rows of one sequence.

    Query i sees key j iff, for some slice ``(q_start, q_end, k_start, k_end, lo, hi)``,
    q_start <= i < q_end, k_start <= j < k_end and lo <= j - i <= hi (None: unbounded). Build one
    with `from_slices`, `documents`, `blocks`, `prefix_lm` or `shared_prefix`; a row that no slice
    covers sees no key. Immutable and hashable. See docs/attention.md, "Masks".

    Args:
        seq_len: Tokens in the row.
        slices: The canonical slices (sorted, each cut to the cells its band reaches).
    """

    error = ConfigError


__all__ = ["AttnMask"]
