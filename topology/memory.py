"""The longest sequence that fits: searches over the step model (`topology.step_model`, whose public
names are re-exported here) for the longest sequence, the split and the memory options whose training
step fits a device budget (and, with offloaded checkpoints, the host memory), and the ladder of memory
options the planner climbs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .heads import head_split
from .model_shape import ModelShape
from .split import Split
from .step_model import (
    MemoryEstimate,
    MemoryOptions,
    attention_forwards,
    host_bytes,
    keeps_output,
    module_chunked,
    step_memory,
)
from .units import GiB

# with the step model's names, re-exported for `from topology.memory import ...`
__all__ = [
    "MemoryOptions",
    "MemoryEstimate",
    "step_memory",
    "max_seq_len",
    "MaxSeq",
    "max_seq_table",
    "host_bytes",
    "attention_forwards",
    "module_chunked",
    "keeps_output",
    "memory_ladder",
    "first_fitting",
    "option_variants",
]


@dataclass(frozen=True)
class MaxSeq:
    """The longest sequence found and the configuration that reaches it."""

    seq_len: int
    ulysses: int
    ring: int
    dp: int
    options: MemoryOptions
    estimate: MemoryEstimate

    def explain(self) -> str:
        e = self.estimate
        return (
            f"max seq {self.seq_len:,} tokens ({self.seq_len / 2**20:.2f}M) with ulysses={self.ulysses} "
            f"ring={self.ring} dp={self.dp}, {self.options.describe()}: peak {e.peak / GiB:.1f} GiB "
            f"({e.peak_phase})"
        )


def max_seq_len(  # noqa: PLR0913 (public entry point)
    model: ModelShape,
    world: int,
    memory_budget: float,
    options: MemoryOptions | None = None,
    *,
    heads_bound: bool = True,
    dtype: Any = "bf16",
    layout: str = "zigzag",
    dp: int = 1,
    splits: list[tuple[int, int]] | None = None,
    granularity: int = 1024,
    host_memory: float | None = None,
    pins: tuple[bool, ...] | None = None,
) -> MaxSeq | None:
    """Longest sequence (a multiple of ``granularity`` tokens) whose :func:`step_memory` peak fits
    ``memory_budget`` bytes per rank (the budget as given: no further margin) and whose offloaded
    checkpoints fit ``host_memory`` bytes of host RAM per rank (None: unbounded), over every (ulysses,
    ring) split of ``world // dp`` ranks (or ``splits``). ``options.head_chunks`` is an upper bound: every
    k <= it that the heads allow is tried; with offload and ``options.pin_memory``, pageable host buffers
    too (pinned ones win a tie; ``pins`` fixes the choices). Returns None when not even ``granularity``
    tokens fit."""
    o = options or MemoryOptions()
    if world % dp:
        raise ValueError(f"dp={dp} must divide world={world}")
    cp = world // dp
    if splits is None:
        splits = [(u, cp // u) for u in range(1, cp + 1) if cp % u == 0 and (not heads_bound or u <= model.heads)]
    best: MaxSeq | None = None
    for u, r in splits:
        for opt in option_variants(model, u, o, pins):

            def fits(n: int) -> bool:
                return (
                    _fitting(model, Split(n * granularity, u, r, dp, 1, dtype, layout), opt, memory_budget, host_memory)
                    is not None
                )

            if not fits(1):
                continue
            lo, hi = 1, 2
            while fits(hi):
                lo, hi = hi, hi * 2
                if hi > 1 << 24:
                    break
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            n = lo * granularity
            if (
                best is None
                or n > best.seq_len
                or (n == best.seq_len and (u > best.ulysses or opt.head_chunks < best.options.head_chunks))
            ):
                best = MaxSeq(n, u, r, dp, opt, step_memory(model, n, u, r, dp, 1, opt, dtype=dtype, layout=layout))
    return best


def _fitting(
    model: ModelShape, split: Split, o: MemoryOptions, memory_budget: float, host_memory: float | None
) -> MemoryEstimate | None:
    """The step's estimate if its device peak fits ``memory_budget`` and its offloaded checkpoints fit
    ``host_memory`` (None: unbounded), else None."""
    s = split
    if (
        host_memory is not None
        and host_bytes(model, s.seq_len, s.ulysses, s.ring, s.batch, o, dtype=s.dtype, layout=s.layout) > host_memory
    ):
        return None
    est = step_memory(model, s.seq_len, s.ulysses, s.ring, s.dp, s.batch, o, dtype=s.dtype, layout=s.layout)
    return est if est.peak <= memory_budget else None


def memory_ladder(
    head_chunks: int = 8, tiled_mlp: int = 8192, loss_chunk: int | None = None, prefetch: bool = True
) -> list[tuple[str, MemoryOptions]]:
    """Option sets, each adding one memory saving to the last: checkpointing only, + tiled loss, + tiled
    MLP, + head chunks (up to ``head_chunks``, the serial schedule: the least memory; 1 keeps every rung
    unchunked), + checkpoint offload, + tiled RMSNorm. Every rung is an option hybrid-cp runs."""
    base: dict[str, Any] = dict(loss_chunk=loss_chunk, prefetch=prefetch)
    rungs = [
        ("activation checkpointing", {}),
        ("+ tiled loss", dict(tiled_loss=True)),
        ("+ tiled MLP", dict(tiled_mlp=tiled_mlp)),
        (f"+ head_chunks <= {head_chunks}, serial", dict(head_chunks=head_chunks, overlap=False)),
        ("+ checkpoint offload", dict(offload_checkpoints=True)),
        ("+ tiled RMSNorm", dict(tiled_norm=True)),
    ]
    ladder = []
    for name, extra in rungs:
        base.update(extra)
        ladder.append((name, MemoryOptions(**base)))
    return ladder


def first_fitting(  # noqa: PLR0913 (public entry point)
    model: ModelShape,
    seq_len: int,
    ulysses: int,
    ring: int,
    dp: int,
    batch: int,
    ladder: list[tuple[str, MemoryOptions]],
    memory_budget: float,
    *,
    host_memory: float | None = None,
    dtype: Any = "bf16",
    layout: str = "zigzag",
) -> tuple[str, MemoryOptions, MemoryEstimate] | None:
    """The first rung of ``ladder`` (and within it the fewest head chunks, then pinned host buffers before
    pageable ones) whose step fits the device budget and the host memory: (its name, the options, the
    estimate), or None when none does. What `hybrid-cp plan --seq-len` reports per split."""
    for name, o in ladder:
        for opt in option_variants(model, ulysses, o):
            est = _fitting(
                model, Split(seq_len, ulysses, ring, dp, batch, dtype, layout), opt, memory_budget, host_memory
            )
            if est is not None:
                return name, opt, est
    return None


def option_variants(
    model: ModelShape, ulysses: int, o: MemoryOptions, pins: tuple[bool, ...] | None = None
) -> list[MemoryOptions]:
    """What ``o`` offers on ``ulysses`` ranks, least invasive first: every ``head_chunks`` from 1 up to its own
    (capped at the rank's query heads), each with pinned host buffers, then pageable ones when it offloads to
    pinned memory (``pins`` fixes the choices)."""
    c = head_split(model.heads, model.n_kv, ulysses)[0][0]
    tried = pins or ((True, False) if o.offload_checkpoints and o.pin_memory else (o.pin_memory,))
    return [
        MemoryOptions(**{**o.__dict__, "head_chunks": hc, "pin_memory": pin})
        for hc in sorted({min(k, c) for k in range(1, o.head_chunks + 1)})
        for pin in tried
    ]


def max_seq_table(  # noqa: PLR0913 (public entry point)
    model: ModelShape,
    world: int,
    memory_budget: float,
    *,
    dtype: Any = "bf16",
    layout: str = "zigzag",
    dp: int = 1,
    head_chunks: int = 8,
    tiled_mlp: int = 8192,
    loss_chunk: int | None = None,
    granularity: int = 1024,
    host_memory: float | None = None,
    prefetch: bool = True,
) -> list[tuple[str, MaxSeq | None]]:
    """The longest sequence for each rung of :func:`memory_ladder` (offload bounded by ``host_memory`` per
    rank)."""
    return [
        (
            name,
            max_seq_len(
                model,
                world,
                memory_budget,
                o,
                dtype=dtype,
                layout=layout,
                dp=dp,
                granularity=granularity,
                host_memory=host_memory,
            ),
        )
        for name, o in memory_ladder(head_chunks, tiled_mlp, loss_chunk, prefetch)
    ]
