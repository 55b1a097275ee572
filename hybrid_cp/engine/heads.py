"""Head arithmetic, in one place: which heads each ulysses rank works on, and GQA groups.

The split itself is `topology.heads.head_split` (shared with the cost model, so the engine's
traffic and `topology.comm_bytes` cannot disagree); this module turns it into ranges and indices
and expands/reduces KV heads for kernels that need plain query groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from topology.heads import head_split as _split

from ..errors import ConfigError


@dataclass(frozen=True)
class HeadSplit:
    """Which query heads and which (replicated) KV heads each ulysses rank works on."""

    q: tuple[tuple[int, int], ...]  # per ulysses rank: [start, end) of its query heads
    kv: tuple[tuple[int, int], ...]  # per ulysses rank: [start, end) of the KV heads it needs
    heads: int
    kv_heads: int

    def kv_index(self, rank: int) -> list[int]:
        """For each local query head of `rank`, the index of its KV head among the local ones."""
        group = self.heads // self.kv_heads
        (qs, qe), (ks, _) = self.q[rank], self.kv[rank]
        return [h // group - ks for h in range(qs, qe)]


def head_split(heads: int, kv_heads: int, ulysses: int) -> HeadSplit:
    """Uneven split of H query heads over u ranks (counts differ by at most one); each rank gets
    exactly the KV heads its query heads use, so KV is replicated only when H_kv < u (or a
    group straddles two ranks), never expanded to H.

    Args:
        heads: Query heads H.
        kv_heads: Key/value heads H_kv (H a multiple of H_kv).
        ulysses: The ulysses degree u (at most H).

    Returns:
        The split: each ulysses rank's query heads and the KV heads they use.
    """
    try:
        ranks = _split(heads, kv_heads, ulysses)
    except ValueError as exc:  # topology's arithmetic raises plain ValueErrors; hybrid-cp raises CPErrors
        raise ConfigError(str(exc)) from None
    return HeadSplit(
        tuple((start, start + c) for c, start, _, _ in ranks),
        tuple((lo, lo + k) for _, _, lo, k in ranks),
        heads,
        kv_heads,
    )


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, H_kv, D] -> [B, S, H, D] by repeating each KV head for its query group."""
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def reduce_kv(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of `expand_kv` for gradients: sum each query group onto its KV head."""
    b, s, h, d = x.shape
    return x if h == kv_heads else x.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


class HeadMap:
    """Maps a rank's local query heads to its local KV heads for the kernel.

    Kernels take contiguous GQA groups; when an uneven head split gives a rank a ragged group
    (e.g. 3 query heads over 2 KV heads) the visiting KV block is expanded for the kernel call
    only, and the gradient is summed back. The ring still streams un-expanded KV.
    """

    def __init__(self, kv_index: list[int], kv_heads: int, device: torch.device):
        hq = len(kv_index)
        uniform = hq % kv_heads == 0 and kv_index == [h // (hq // kv_heads) for h in range(hq)]
        self.index = None if uniform else torch.tensor(kv_index, device=device)
        self.kv_heads = kv_heads

    @staticmethod
    def of(kv_index: list[int], kv_heads: int, device: torch.device) -> "HeadMap":
        """The cached map for these heads (its index tensor is copied to the device once, not per call)."""
        return _head_map(tuple(kv_index), kv_heads, torch.device(device))

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is None else x.index_select(2, self.index)

    def reduce(self, g: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return g
        out = g.new_zeros(*g.shape[:2], self.kv_heads, g.shape[3])
        return out.index_add_(2, self.index, g)


@lru_cache(maxsize=64)
def _head_map(kv_index: tuple[int, ...], kv_heads: int, device: torch.device) -> HeadMap:
    return HeadMap(list(kv_index), kv_heads, device)


__all__ = ["HeadSplit", "head_split", "expand_kv", "reduce_kv", "HeadMap"]
