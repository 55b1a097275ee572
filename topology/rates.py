"""What a calibration measured, in the units the cost model prices with (the data, no measuring).

:class:`Calibration` is what `hybrid-cp calibrate` stores and a :class:`~topology.Cluster` carries in its
``calibration`` field; :func:`topology.estimate` prices with it (docs/planner.md, section 4,
"calibrated terms"). The fitted forms are defined here, next to the FLOP and byte counts they are rates
of (:func:`kernel_flops`, :func:`merge_bytes`), so that the cost model and the fit
(:mod:`topology.calibration`, which measures and fits) count the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .units import FP32_BYTES

__all__ = [
    "StrictModel",
    "KernelFit",
    "LinkFit",
    "A2AFit",
    "Calibration",
    "kernel_flops",
    "merge_fwd_bytes",
    "merge_bwd_bytes",
    "PROBE",
    "ATTN_BWD_FACTOR",
]

ATTN_BWD_FACTOR = 2.5  # backward attention FLOPs / forward (FlashAttention's 5 vs 2 matmuls)


class StrictModel(BaseModel):
    """Frozen, and unknown fields are errors: a typo in a stored calibration fails loudly."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class KernelFit(StrictModel):
    """One attention kernel's time per call:
    ``call_overhead + head_call_overhead H + io (Tq + Tk) H D + F (1 + tile / Tq) / rate``.

    ``F`` counts useful FLOPs (``4 Tq Tk D H``, half for a causal square block, 2.5x for backward).
    ``causal_tile_tokens`` is the extra work a causal block does on its diagonal tiles (a tiled kernel
    computes whole tiles, so a T x T causal block costs ``T (T + tile) / 2`` entries, not ``T^2 / 2``);
    together with the per-call overhead it is the kernel's efficiency as a function of block size.
    ``head_call_overhead_us`` makes it a function of the query heads per call too: a ulysses degree u
    hands the kernel H/u heads (and H_kv/u KV heads it expands to them), and the candidate splits of one
    model trade heads for block length, so a cost paid per head and call weighs on u=1's many-head short
    blocks and vanishes on u=H's one long block. A per-head factor on the rate was tried first; it
    over-penalized many-head calls of longer blocks (docs/planner.md, section 4.1).
    """

    backend: str
    dtype: str
    causal: bool
    direction: Literal["fwd", "bwd"]
    tflops: float = Field(gt=0, description="asymptotic rate, TFLOP/s, with every rank computing at once")
    call_overhead_us: float = Field(ge=0)
    head_call_overhead_us: float = Field(default=0.0, ge=0, description="per query head per call")
    causal_tile_tokens: float = Field(default=0.0, ge=0)
    io_ns_per_elem: float = Field(
        default=0.0,
        ge=0,
        description="per element of q and k/v rows x heads x D "
        "(loads, GQA expansion): what makes short blocks memory-bound",
    )
    samples: int = 0
    rms_rel_error: float = 0.0

    def seconds(self, tq: int, tk: int, heads: int, head_dim: int) -> float:
        """Predicted time of one call on a (tq x tk) block with ``heads`` query heads."""
        f = kernel_flops(tq, tk, heads, head_dim, self.causal, self.direction)
        tile = self.causal_tile_tokens / tq if self.causal else 0.0
        io = (tq + tk) * heads * head_dim * self.io_ns_per_elem * 1e-9
        fixed = (self.call_overhead_us + self.head_call_overhead_us * heads) * 1e-6
        return fixed + io + f * (1.0 + tile) / (self.tflops * 1e12)

    def efficiency(self, tq: int, tk: int, heads: int, head_dim: int) -> float:
        """Fraction of the asymptotic rate this block shape and head count reach."""
        f = kernel_flops(tq, tk, heads, head_dim, self.causal, self.direction)
        return f / (self.tflops * 1e12) / self.seconds(tq, tk, heads, head_dim)


class LinkFit(StrictModel):
    """``latency + bytes / bandwidth``, fitted from timed transfers of several sizes."""

    bandwidth_gb_s: float = Field(gt=0)
    latency_us: float = Field(ge=0)

    def seconds(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)


class A2AFit(StrictModel):
    """One all-to-all of a ulysses group of ``ulysses`` ranks while ``groups`` groups exchange at once;
    ``bytes`` are what one rank sends to the others. ``alone`` is the same with one group only."""

    ulysses: int = Field(ge=2)
    groups: int = Field(ge=1)
    link: LinkFit
    alone: LinkFit | None = None

    @property
    def contention(self) -> float:
        """Bandwidth of one group alone over bandwidth with every group exchanging (1 = none)."""
        return 1.0 if self.alone is None else self.alone.bandwidth_gb_s / self.link.bandwidth_gb_s


class Calibration(StrictModel):
    """What `hybrid-cp calibrate` measured, in the units the cost model prices with."""

    world: int = Field(ge=1, description="ranks that were measured together")
    backend: str = Field(description="torch.distributed backend (gloo or nccl)")
    device: str = "cpu"
    kernel: str = Field(description="the kernel `auto` resolves to; priced when the user does not say")
    dtype: str = Field(description="dtype the merge/engine figures were measured in")
    head_dim: int = 64
    kernels: list[KernelFit] = Field(default_factory=list)
    merge: LinkFit | None = Field(
        default=None, description="kernels.merge.merge_ by bytes moved (block out + fp32 running out)"
    )
    step_overhead_us: float = Field(default=0.0, ge=0, description="fixed cost per ring step unit (fwd 1, bwd 2)")
    call_overhead_us: float = Field(default=0.0, ge=0, description="fixed cost per attention fwd+bwd call")
    copy_gb_s: float | None = Field(default=None, gt=0, description="engine packing copies, per byte sent")
    a2a: list[A2AFit] = Field(default_factory=list)
    p2p: LinkFit | None = Field(default=None, description="ring-neighbour exchange, every rank at once")
    p2p_alone: LinkFit | None = None
    overlap: float = Field(default=1.0, ge=0, le=1, description="fraction of a ring transfer a kernel call hides")
    not_measured: list[str] = Field(default_factory=list)
    seconds: float = Field(default=0.0, ge=0, description="how long the calibration took, starting the ranks included")
    startup_s: float = Field(default=0.0, ge=0, description="of which starting and joining the ranks")
    stage_seconds: dict[str, float] = Field(default_factory=dict, description="measurement time of each stage")
    load: list[float] = Field(default_factory=list, description="1/5/15-min load average when it ran")
    probe_s: float | None = Field(
        default=None,
        gt=0,
        description="time of the reference kernel call (PROBE) with every rank computing, "
        "mean of the start and the end of the calibration: the machine's share per rank when it was calibrated",
    )

    @property
    def p2p_contention(self) -> float:
        """Neighbour-exchange bandwidth of one pair alone over that with every rank sending."""
        if self.p2p is None or self.p2p_alone is None:
            return 1.0
        return self.p2p_alone.bandwidth_gb_s / self.p2p.bandwidth_gb_s

    def kernel_fit(
        self, causal: bool, direction: str, dtype: str | None = None, backend: str | None = None
    ) -> KernelFit | None:
        """The fit for this kernel call, falling back to the calibration's own kernel and dtype."""
        for want_b, want_d in ((backend or self.kernel, dtype or self.dtype), (self.kernel, self.dtype)):
            for k in self.kernels:
                if (k.backend, k.dtype, k.causal, k.direction) == (want_b, want_d, causal, direction):
                    return k
        return None

    def a2a_fit(self, ulysses: int) -> A2AFit | None:
        for a in self.a2a:
            if a.ulysses == ulysses:
                return a
        return None

    def summary(self) -> str:
        """A few lines for the CLI."""
        stages = ", ".join(f"{k} {v:.1f}" for k, v in self.stage_seconds.items())
        lines = [
            f"calibration: {self.world} {self.backend} ranks on {self.device}, kernel {self.kernel} "
            f"{self.dtype}, {self.seconds:.0f} s ({self.startup_s:.0f} s starting the ranks"
            + (f"; measuring: {stages} s" if stages else "")
            + ")"
        ]
        for k in self.kernels:
            lines.append(
                f"  kernel {k.backend} {k.dtype} {'causal' if k.causal else 'full  '} {k.direction}: "
                f"{k.tflops * 1e3:8.2f} GFLOP/s per rank, {k.call_overhead_us:7.0f} us per call + "
                f"{k.head_call_overhead_us:5.0f} us per head, causal tile {k.causal_tile_tokens:5.0f} tokens, "
                f"io {k.io_ns_per_elem:.2f} ns/elem (fit rms {k.rms_rel_error:.0%}, {k.samples} pts)"
            )
        if self.merge:
            lines.append(f"  merge: {self.merge.bandwidth_gb_s:.2f} GB/s, {self.merge.latency_us:.0f} us")
        lines.append(
            f"  per ring step {self.step_overhead_us:.0f} us, per call {self.call_overhead_us:.0f} us, "
            "packing copies "
            + (f"{self.copy_gb_s:.2f} GB/s" if self.copy_gb_s else "too fast to separate (0 s)")
            + f", overlap {self.overlap:.2f}"
        )
        for a in self.a2a:
            lines.append(
                f"  all-to-all u={a.ulysses} ({a.groups} groups at once): {a.link.bandwidth_gb_s:.2f} GB/s, "
                f"{a.link.latency_us:.0f} us; contention x{a.contention:.2f}"
            )
        if self.p2p:
            lines.append(
                f"  ring p2p (all ranks at once): {self.p2p.bandwidth_gb_s:.2f} GB/s, {self.p2p.latency_us:.0f} us; "
                f"contention x{self.p2p_contention:.2f}"
            )
        for item in self.not_measured:
            lines.append(f"  not measured: {item}")
        return "\n".join(lines)


PROBE = (1024, 1024, 2, 1, True)  # (Tq, Tk, heads, kv heads, causal): the reference kernel call, forward


def kernel_flops(tq: int, tk: int, heads: int, head_dim: int, causal: bool, direction: str) -> float:
    """Useful FLOPs of one kernel call (the cost model's convention)."""
    f = 4.0 * tq * tk * head_dim * heads * (0.5 if causal else 1.0)
    return f * (ATTN_BWD_FACTOR if direction == "bwd" else 1.0)


def merge_fwd_bytes(tokens: int, heads: int, head_dim: int, e: int) -> int:
    """Bytes one forward online-softmax merge moves for ``tokens`` rows of ``heads`` heads (``e`` bytes
    per element): the block's output read in its dtype, the fp32 running output read and written.
    A single flash-attention call does this in registers; a ring step pays it in device memory."""
    return tokens * heads * head_dim * (e + 2 * FP32_BYTES)


def merge_bwd_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, e: int) -> int:
    """Bytes one backward ring step's accumulations move: fp32 dQ read and written for the query
    heads, fp32 dK/dV read and written plus the block's K/V gradients in their dtype for the KV heads."""
    return tokens * head_dim * (heads * 2 * FP32_BYTES + 2 * kv_heads * (2 * FP32_BYTES + e))
