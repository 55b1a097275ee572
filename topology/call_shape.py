"""One attention call on a (dp, ring, ulysses) mesh: the shape every time term prices, and the ring's
streaming arithmetic that both the analytic terms (`topology.cost`) and the measured ones
(`topology.calibrated`) use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .heads import head_split
from .layouts import make_layout
from .mask_layout import mask_layout
from .masks import AttnMask
from .model_shape import ModelShape
from .rates import merge_bwd_bytes, merge_fwd_bytes
from .split import Split
from .traffic import comm_bytes, grad_bytes, whole_block_bytes

__all__ = ["CallShape", "LayerTimes", "exposed_s", "streamed_ring_s"]


@dataclass(frozen=True)
class CallShape:
    """One attention call (one layer, ``batch`` rows) on a (dp, ring, ulysses) mesh: the shape that
    every cost term prices. ``e`` is bytes per element of the compute dtype. ``mask`` (an `AttnMask`, its
    window already folded in) replaces ``layout`` and ``causal``: the row is then the mask's balanced
    layout (`mask_layout`), as the engine runs it."""

    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    batch: int
    ulysses: int
    ring: int
    e: int
    layout: str = "zigzag"
    causal: bool = True
    backward: bool = True
    dp: int = 1
    mask: AttnMask | None = None

    @classmethod
    def of(
        cls, model: ModelShape, split: Split, causal: bool = True, backward: bool = True, mask: AttnMask | None = None
    ) -> "CallShape":
        """The call of one of ``model``'s attention layers on ``split`` (under ``mask``, not causal: the
        mask says which keys each query sees)."""
        return cls(
            model.heads,
            model.n_kv,
            model.head_dim,
            split.seq_len,
            split.batch,
            split.ulysses,
            split.ring,
            split.e,
            split.layout,
            causal and mask is None,
            backward,
            split.dp,
            mask,
        )

    @property
    def world(self) -> int:
        return self.dp * self.ulysses * self.ring

    @property
    def lay(self):  # a topology.layouts.Layout (make_layout and mask_layout are cached)
        if self.mask is not None:
            return mask_layout(self.mask, self.ulysses, self.ring)
        return make_layout(self.layout, self.ulysses, self.ring, seq_len=self.seq_len)

    @property
    def heads_per_rank(self) -> list[tuple[int, int, int, int]]:
        """`topology.heads.head_split` of this call's heads over its ulysses ranks."""
        return head_split(self.heads, self.kv_heads, self.ulysses)

    @property
    def busiest_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) of the ulysses rank with the most of each."""
        per_rank = self.heads_per_rank
        return max(x[0] for x in per_rank), max(x[3] for x in per_rank)

    @property
    def kv_block(self) -> int:
        """Elements of one K/V block travelling the ring (the ulysses group's tokens, busiest KV heads)."""
        return self.batch * self.ulysses * self.lay.local_len * 2 * self.busiest_heads[1] * self.head_dim

    @property
    def a2a_unit(self) -> int:
        """Bytes of one head's local rows: what :func:`a2a_peer_bytes` counts in."""
        return self.batch * self.lay.local_len * self.head_dim * self.e

    def sent_bytes(self, window: Any = None, chunk_size: int | None = None) -> dict[str, int]:
        """:func:`comm_bytes` of this call (the backward's zero for a forward-only call)."""
        nbytes = comm_bytes(
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.seq_len,
            self.batch,
            self.ulysses,
            self.ring,
            self.e,
            self.layout,
            causal=self.causal,
            window=window,
            chunk_size=chunk_size,
            mask=self.mask,
        )
        if not self.backward:
            nbytes.update(ulysses_bwd=0, ring_bwd=0)
        return nbytes

    def streamed_ring_bytes(self) -> int:
        """Ring bytes (forward + backward) of whole K/V blocks streamed around the ring, what
        :func:`comm_bytes` gives when the layout's halo rule does not hold (0 without a ring)."""
        fwd, bwd = whole_block_bytes(self.kv_block, self.ring, self.e)
        return fwd + (bwd if self.backward else 0)

    def mask_plan(self) -> tuple[list[list[int]], list[list[int]]]:
        """(visible cells, kernel calls) of each ring rank at each ring step under the call's mask: the
        block plan the engine runs (`Layout.mask_tasks`), per batch row and head."""
        lay, r = self.lay, self.ring
        tasks = [[lay.tasks(j, s, False, mask=self.mask) for s in range(r)] for j in range(r)]
        return [[sum(t.work() for t in at) for at in row] for row in tasks], [[len(at) for at in row] for row in tasks]

    def merge_bytes(self) -> tuple[int, int]:
        """Bytes one ring step's online-softmax merge moves, forward and backward (0 forward-only)."""
        tokens, (c_max, k_max) = self.batch * self.ulysses * self.lay.local_len, self.busiest_heads
        bwd = merge_bwd_bytes(tokens, c_max, k_max, self.head_dim, self.e) if self.backward else 0
        return merge_fwd_bytes(tokens, c_max, self.head_dim, self.e), bwd


@dataclass(frozen=True)
class LayerTimes:
    """The time terms of one layer, before they become an :class:`Estimate`."""

    kernel_fwd_s: float
    kernel_bwd_s: float
    ring_overhead_s: float
    a2a_s: float
    a2a_link: str
    ring_comm_s: float
    ring_exposed_s: float
    ring_link: str


def exposed_s(comm: float, compute: float, overlap: float) -> float:
    """Transfer time a step cannot hide: all of it beyond the step's compute, and ``1 - overlap`` of
    the part the compute could have hidden (overlap = 1: today's ``max(0, comm - compute)``)."""
    return comm - overlap * min(comm, compute)


def streamed_ring_s(
    xfer: Callable[[float], float], call: CallShape, step_fwd_s: float, step_bwd_s: float, overlap: float
) -> tuple[float, float]:
    """(transfer, exposed) seconds of whole K/V blocks streamed around the ring: r - 1 forward hops,
    r - 1 backward hops carrying K/V and the travelling fp32 dK/dV, each hidden behind its step's
    kernels by ``overlap``, and the last dK/dV hop home, which nothing is left to hide."""
    kv, e, ring = call.kv_block, call.e, call.ring
    g = grad_bytes(e)
    c_fwd, c_bwd, c_home = xfer(kv * e), xfer(kv * (e + g)), xfer(kv * g)
    comm = (ring - 1) * c_fwd
    exposed = (ring - 1) * exposed_s(c_fwd, step_fwd_s, overlap)
    if call.backward:
        comm += (ring - 1) * c_bwd + c_home
        exposed += (ring - 1) * exposed_s(c_bwd, step_bwd_s, overlap) + c_home
    return comm, exposed
