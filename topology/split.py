"""One (ulysses, ring, dp) split of a training step's rows: the values the cost, memory and planner
functions price together.

A frozen value instead of the loose ``(seq_len, ulysses, ring, dp, batch, dtype, layout)`` that used to
travel through every signature: the public entry points (`topology.estimate`, `step_memory`, `plan`)
keep their keyword arguments and build one `Split`; the terms below them read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .layouts import Layout, make_layout
from .units import check_counts, dtype_bytes

__all__ = ["Split"]


@dataclass(frozen=True)
class Split:
    """``batch`` rows of ``seq_len`` tokens per cp group, cut over ``ulysses x ring`` ranks, with ``dp``
    replicas of the group; ``dtype`` the compute dtype (a name, bytes or a torch dtype), ``layout`` the
    sequence layout ("zigzag" or "contiguous")."""

    seq_len: int
    ulysses: int = 1
    ring: int = 1
    dp: int = 1
    batch: int = 1
    dtype: Any = "bf16"
    layout: str = "zigzag"

    def check(self) -> None:
        """Raise ValueError unless every count is an integer >= 1 (where the entry points check them)."""
        check_counts(seq_len=self.seq_len, ulysses=self.ulysses, ring=self.ring, dp=self.dp, batch=self.batch)

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def e(self) -> int:
        """Bytes per element of the compute dtype."""
        return dtype_bytes(self.dtype)

    @property
    def lay(self) -> Layout:
        """The dense layout of one row (cached by `make_layout`)."""
        return make_layout(self.layout, self.ulysses, self.ring, seq_len=self.seq_len)

    @property
    def local_tokens(self) -> int:
        """Tokens one rank holds: ``batch`` rows of the layout's local length."""
        return self.batch * self.lay.local_len

    def with_len(self, seq_len: int) -> "Split":
        """The same split for rows of ``seq_len`` tokens."""
        return replace(self, seq_len=seq_len)
