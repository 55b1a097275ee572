"""Cost model of one transformer layer under a (ulysses, ring, dp) split.

Three parts, all per layer, forward + backward:

* **Bytes** (:func:`comm_bytes`): exact bytes each rank sends to *other* ranks, with the formulas the
  engine's own byte counter is tested against (uneven heads, GQA replication, zigzag padding).
* **Time** (:func:`estimate`): a latency-bandwidth model per link tier (socket / node / NVLink domain /
  fabric), attention FLOPs at the accelerator's achievable rate, ring transfers overlapped with the
  ring step they feed, and the rest of the layer's GEMMs.
* **Memory** is not here: :mod:`topology.memory` prices the training step's peak, and the planner checks
  each split with it.

Conventions (documented in docs/planner.md): causal attention forward costs ``0.5 * 4 * N^2 * D * H``
FLOPs per sequence (half of the dense ``4 N^2 D H``); backward costs 2.5x forward (FlashAttention's
5 vs 2 matmuls); the rest of the layer costs ``6 * params_per_layer`` FLOPs per token (fwd + bwd).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .cluster import Cluster
from .layouts import head_split, layout_of, make_layout
from .placement import PlacementError, ring_groups, ulysses_groups
from .rates import ATTN_BWD_FACTOR, merge_bwd_bytes, merge_fwd_bytes
from .split import Split
from .summary_scan import exchange_kind, scan_bytes, summary_scan
from .units import FP32_BYTES, check_counts, dtype_bytes, dtype_name

__all__ = ["ModelShape", "Estimate", "comm_bytes", "estimate", "dtype_bytes", "head_split", "MODEL_PRESETS",
           "engine_known_s"]

Layout = Literal["zigzag", "contiguous"]
GRAD_BYTES = FP32_BYTES  # dK/dV travel the ring in fp32 (the engine's default: gradients accumulate in fp32)


def grad_bytes(dtype_bytes: int) -> int:
    """Bytes of one accumulated gradient element: fp32, or fp64 for fp64 inputs (the engine's acc_dtype)."""
    return max(GRAD_BYTES, dtype_bytes)


class ModelShape(BaseModel):
    """The parts of a transformer that decide attention cost, communication and memory.

    ``hidden`` defaults to ``heads * head_dim``; ``intermediate`` (MLP width) to ``4 * hidden`` with a
    plain 2-matrix MLP, else a gated (SwiGLU, 3-matrix) MLP when ``gated_mlp`` is true. For MoE models
    give the *active* width (experts per token x expert width + shared experts), which prices the compute,
    and ``expert_params``, the idle experts' weights, which memory holds. Hybrid models give
    ``linear_layers`` (how many of ``layers`` are linear), ``linear_kind`` and the linear block's sizes;
    the attention terms count the other layers (docs/planner.md, section 4.2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    heads: int = Field(ge=1, description="attention (query) heads")
    kv_heads: int | None = Field(default=None, ge=1, description="key/value heads (default: heads, MHA)")
    head_dim: int = Field(ge=1, description="attention head dimension")
    hidden: int | None = Field(default=None, ge=1, description="model width (default: heads x head_dim)")
    layers: int = Field(default=32, ge=1, description="decoder layers")
    intermediate: int | None = Field(default=None, ge=1, description="MLP width (default: 4 x hidden, plain MLP)")
    gated_mlp: bool = Field(default=True, description="a gated (SwiGLU, 3-matrix) MLP when intermediate is given")
    vocab: int = Field(default=0, ge=0, description="embedding + LM head size, for model-state memory")
    sliding_window: int | None = Field(default=None, ge=1, description="keys each query sees in window layers")
    window_layers: int | None = Field(default=None, ge=0, description="layers with the window (default: all)")
    attention_chunk_size: int | None = Field(
        default=None, ge=1, description="positions of one attention chunk in chunked layers (Llama 4)")
    chunked_layers: int | None = Field(default=None, ge=0, description="layers with chunked attention (default: all)")
    linear_layers: int = Field(default=0, ge=0, description="of `layers`, how many are linear (hybrid models)")
    linear_kind: Literal["gated_delta", "mamba2"] | None = Field(default=None, description="the linear layers' recurrence")
    linear_heads: int | None = Field(default=None, ge=1, description="Gated DeltaNet value heads / Mamba2 heads")
    linear_key_heads: int | None = Field(default=None, ge=1, description="Gated DeltaNet key heads / Mamba2 groups")
    linear_key_dim: int | None = Field(default=None, ge=1, description="Gated DeltaNet dk / Mamba2 state size N")
    linear_value_dim: int | None = Field(default=None, ge=1, description="Gated DeltaNet dv / Mamba2 head dim P")
    linear_conv: int = Field(default=4, ge=1, description="causal convolution kernel of the linear layers")
    linear_chunk: int = Field(default=64, ge=1, description="chunk of the chunked recurrence kernel (tokens)")
    expert_params: int = Field(default=0, ge=0, description="MoE: weights of the experts a token does not use, all "
                               "layers together (held in memory and sharded, never computed)")
    name: str = "custom"

    @model_validator(mode="after")
    def _check(self) -> "ModelShape":
        for name in ("window_layers", "chunked_layers"):
            if (getattr(self, name) or 0) > self.layers:
                raise ValueError(f"{name}={getattr(self, name)} exceeds layers={self.layers}")
        if self.sliding_window and self.attention_chunk_size:
            if self.window_layers is None or self.chunked_layers is None:
                raise ValueError("a model with both sliding_window and attention_chunk_size needs window_layers and "
                                 "chunked_layers: how many layers of each kind")
            if self.window_layers + self.chunked_layers > self.layers:
                raise ValueError(f"window_layers={self.window_layers} + chunked_layers={self.chunked_layers} exceeds "
                                 f"layers={self.layers}")
        self._check_linear()
        kv = self.kv_heads or self.heads
        if kv > self.heads or self.heads % kv:
            raise ValueError(
                f"heads={self.heads} must be a multiple of kv_heads={kv} (grouped-query attention shares "
                "each KV head among heads/kv_heads query heads)"
            )
        return self

    def _check_linear(self) -> None:
        dims = ("linear_heads", "linear_key_heads", "linear_key_dim", "linear_value_dim")
        if self.linear_layers > self.layers:
            raise ValueError(f"linear_layers={self.linear_layers} exceeds layers={self.layers}")
        if self.linear_layers and self.linear_kind is None:
            raise ValueError(f"linear_layers={self.linear_layers} needs linear_kind='gated_delta' or 'mamba2'")
        if self.linear_layers and (missing := [d for d in dims if getattr(self, d) is None]):
            raise ValueError(f"linear_kind={self.linear_kind!r} needs {', '.join(missing)} (the linear block's sizes)")
        if self.linear_layers and self.linear_heads % self.linear_key_heads:
            raise ValueError(f"linear_heads={self.linear_heads} must be a multiple of linear_key_heads="
                             f"{self.linear_key_heads} (key heads / groups are shared by value heads)")
        if self.linear_kind is not None and not self.linear_layers:
            raise ValueError(f"linear_kind={self.linear_kind!r} with linear_layers=0: give how many layers are linear")

    @property
    def attention_layers(self) -> int:
        """Softmax-attention layers (all but the linear ones)."""
        return self.layers - self.linear_layers

    @property
    def linear_state_numel(self) -> int:
        """Numbers of one run's summary (M and E) per batch row, as the engine gathers them: Gated DeltaNet
        Hv*dk*(dk+dv) (dense dk x dk transition, dk x dv state), Mamba2 H*(1+P*N) (scalar decay, P x N)."""
        if not self.linear_layers:
            return 0
        h, dk, dv = self.linear_heads, self.linear_key_dim, self.linear_value_dim
        return h * dk * (dk + dv) if self.linear_kind == "gated_delta" else h * (1 + dv * dk)

    @property
    def linear_transition_numel(self) -> int:
        """The transition M's share of `linear_state_numel` (the scan leaves it out where it is not used):
        Gated DeltaNet Hv*dk*dk, Mamba2 H."""
        if not self.linear_layers:
            return 0
        h, dk = self.linear_heads, self.linear_key_dim
        return h * dk * dk if self.linear_kind == "gated_delta" else h

    @property
    def linear_conv_channels(self) -> int:
        """Channels of the linear block's causal convolution: q|k|v (Gated DeltaNet), x|B|C (Mamba2)."""
        if not self.linear_layers:
            return 0
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_heads * self.linear_value_dim

    @property
    def linear_layer_params(self) -> int:
        """Weights of one linear layer: its input projections (conv channels, the output gate z and the
        per-head gates: beta and g, or dt), its output projection, and the MLP (norms, conv ignored)."""
        inner = self.linear_heads * self.linear_value_dim
        per_head = 2 if self.linear_kind == "gated_delta" else 1
        h = self.d_model
        return h * (self.linear_conv_channels + inner + per_head * self.linear_heads) + inner * h + self._mlp_params

    @property
    def _mlp_params(self) -> int:
        if self.intermediate is None:
            return 8 * self.d_model * self.d_model
        return (3 if self.gated_mlp else 2) * self.d_model * self.intermediate

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_model(self) -> int:
        return self.hidden or self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer: Q, K, V, O projections and the MLP (norms ignored)."""
        h, q, kv = self.d_model, self.heads * self.head_dim, self.n_kv * self.head_dim
        return h * q + 2 * h * kv + q * h + self._mlp_params

    @property
    def params(self) -> int:
        linear = self.linear_layers * self.linear_layer_params if self.linear_layers else 0
        return self.attention_layers * self.layer_params + linear + 2 * self.vocab * self.d_model

    @property
    def held_params(self) -> int:
        """Weights held in memory: `params` (the ones a token computes with) and, for MoE, the other experts."""
        return self.params + self.expert_params

    @property
    def held_layer_params(self) -> int:
        """One layer's weights held when FSDP2 unshards it (MoE: all its experts; spread evenly over the layers)."""
        return self.layer_params + self.expert_params // self.layers

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Known shapes (``llama3-8b``, ``llama3-70b``, ``glm-4.5-air``, ``llama2-7b``, ``qwen3-next-80b``)."""
        key = name.lower()
        if key not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}")
        return cls(name=key, **MODEL_PRESETS[key])


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Values from the models' Hugging Face config.json files.
    "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32, intermediate=14336, vocab=128256),
    "llama3-70b": dict(heads=64, kv_heads=8, head_dim=128, hidden=8192, layers=80, intermediate=28672, vocab=128256),
    "llama2-7b": dict(heads=32, kv_heads=32, head_dim=128, hidden=4096, layers=32, intermediate=11008, vocab=32000),
    # GLM-4.5-Air (MoE, 12B active, 106B in all): 8 of 128 routed experts of width 1408 + 1 shared expert active
    # per token; the other 120 are held in each of the 45 MoE layers (the first layer is dense).
    "glm-4.5-air": dict(heads=96, kv_heads=8, head_dim=128, hidden=4096, layers=46, intermediate=9 * 1408, vocab=151552,
                        expert_params=(128 - 8) * 3 * 4096 * 1408 * 45),
    # Qwen3-Next-80B-A3B: 3 Gated DeltaNet layers to 1 gated-attention layer (full_attention_interval 4); MoE with
    # 10 routed experts + 1 shared expert of width 512 active per token. The attention's output gate is ignored.
    "qwen3-next-80b": dict(heads=16, kv_heads=2, head_dim=256, hidden=2048, layers=48, intermediate=11 * 512,
                           vocab=151936, linear_layers=36, linear_kind="gated_delta", linear_heads=32,
                           linear_key_heads=16, linear_key_dim=128, linear_value_dim=128, linear_conv=4,
                           expert_params=(512 - 10) * 3 * 2048 * 512 * 48),  # 502 of 512 experts idle: 80B in all
}


def _a2a_peer_bytes(split: list[tuple[int, int, int, int]], i: int, p: int, unit: int,
                    unit_v: int) -> tuple[int, int]:
    """Bytes rank ``i`` sends to peer ``p`` in the forward and backward all-to-alls (``unit``: one head of
    q/k for S tokens, ``unit_v``: one head of v, which may be narrower).

    Forward: p's query heads and the KV heads p needs for our S tokens (fused QKV), then our heads'
    output (v's width) for p's tokens. Backward: dO of p's heads, then dQ/dK/dV of our heads for p's tokens.
    """
    c_i, k_i = split[i][0], split[i][3]
    c_p, k_p = split[p][0], split[p][3]
    return unit * (c_p + k_p) + unit_v * (k_p + c_i), unit_v * (c_p + k_i) + unit * (c_i + k_i)


def comm_bytes(heads: int, kv_heads: int, head_dim: int, seq_len: int, batch: int, ulysses: int, ring: int,
               dtype_bytes: int, layout: str = "zigzag", ulysses_rank: int | None = None, cu_seqlens: Any = None,
               causal: bool = True, window: Any = None, ring_rank: int | None = None, v_head_dim: int | None = None,
               chunk_size: int | None = None) -> dict[str, int]:
    """Bytes one rank sends to other ranks for one attention call (one layer), by stage.

    Keys ``ulysses_fwd``, ``ulysses_bwd``, ``ring_fwd``, ``ring_bwd``. With ``ulysses_rank=None`` each
    value is the maximum over ulysses ranks (taken per key). These are the formulas the engine's
    byte counter must satisfy exactly; see docs/planner.md for the derivation. For a packed row pass
    the documents' boundaries as ``cu_seqlens`` (``seq_len`` is then their total): the packed layout's
    padding decides the local length, the formulas are the same. When the layout's halo rule
    (`Layout.halo`: what other ranks' queries can see fits one block) holds, under any mask (packed
    rows of whole documents, a sliding ``window``, attention chunks ``chunk_size``), a rank sends each
    ring peer only the K/V rows that peer reads, and gets back their fp32 gradients; the ring values
    then depend on the ring rank (``ring_rank=None``: the maximum over ring ranks).

    Args:
        heads: Query heads.
        kv_heads: Key/value heads.
        head_dim: q/k head dim.
        seq_len: Tokens per sequence (a packed row's total).
        batch: Sequences.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dtype_bytes: Bytes per element.
        layout: "zigzag" or "contiguous".
        ulysses_rank: One ulysses rank; None: the maximum over them.
        cu_seqlens: Packed documents' boundaries.
        causal: Causal attention.
        window: A sliding window (int, or (left, right) non-causal).
        ring_rank: One ring rank; None: the maximum over them.
        v_head_dim: v's head dim when it differs from `head_dim` (MLA); None: the same.
        chunk_size: Attention chunk size.

    Returns:
        Bytes by stage: "ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd".
    """
    check_counts(heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, batch=batch,
                ulysses=ulysses, ring=ring, dtype_bytes=dtype_bytes)  # fmt: skip
    split = head_split(heads, kv_heads, ulysses)
    lay = layout_of(layout, ulysses, ring, seq_len=seq_len, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None and lay.seq_len != seq_len:
        raise ValueError(f"cu_seqlens ends at {lay.seq_len} but seq_len={seq_len}; pass the packed row's total")
    s = lay.local_len
    dv = head_dim if v_head_dim is None else v_head_dim
    unit, unit_v = batch * s * head_dim * dtype_bytes, batch * s * dv * dtype_bytes
    window = lay.effective_window(causal, window)
    halo = lay.halo(causal, window, chunk_size)
    ring_ranks = range(ring) if ring_rank is None else [ring_rank]
    ranks = range(ulysses) if ulysses_rank is None else [ulysses_rank]
    if ulysses_rank is not None and not 0 <= ulysses_rank < ulysses:
        raise ValueError(f"ulysses_rank={ulysses_rank} must be in [0, {ulysses}) or None for the maximum")
    out = {"ulysses_fwd": 0, "ulysses_bwd": 0, "ring_fwd": 0, "ring_bwd": 0}
    for i in ranks:
        fwd = bwd = 0
        for p in range(ulysses):
            if p != i:
                f, b = _a2a_peer_bytes(split, i, p, unit, unit_v)
                fwd, bwd = fwd + f, bwd + b
        row = batch * split[i][3] * (head_dim + dv)  # K/V elements of one token row
        if halo:  # rows my peers read from me go out; gradients of rows I read go back
            def sent(j: int) -> tuple[int, int]:
                out_rows = sum(n for st in range(1, ring)
                               for _, n in lay.needed_rows((j + st) % ring, st, causal, window, chunk_size))
                back_rows = sum(n for st in range(1, ring) for _, n in lay.needed_rows(j, st, causal, window, chunk_size))
                return out_rows * row * dtype_bytes, back_rows * row * grad_bytes(dtype_bytes)
            ring_fwd, ring_bwd = (max(v) for v in zip(*(sent(j) for j in ring_ranks)))
        else:
            kv_block = (ulysses * s) * row  # elements of one K/V block
            ring_fwd = (ring - 1) * kv_block * dtype_bytes
            ring_bwd = ring_fwd + ring * kv_block * grad_bytes(dtype_bytes) if ring > 1 else 0
        for key, val in (("ulysses_fwd", fwd), ("ulysses_bwd", bwd), ("ring_fwd", ring_fwd), ("ring_bwd", ring_bwd)):
            out[key] = max(out[key], val)
    return out


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one layer (forward + backward) for ``batch`` sequences per CP group.

    ``time_s`` = ``compute_s + a2a_s + ring_exposed_s``; ``compute_s`` = attention kernels + ring step
    overheads + the rest of the layer. ``bytes_per_rank`` is the :func:`comm_bytes` dict (worst
    ulysses rank); ``total_bytes`` its sum. Memory is the planner's (``Plan.memory``, ``topology.memory``).
    """

    ulysses: int
    ring: int
    dp: int
    batch: int
    seq_len: int
    padded_len: int
    layers: int
    attention_s: float
    ring_overhead_s: float
    rest_s: float
    a2a_s: float
    ring_comm_s: float
    ring_exposed_s: float
    bytes_per_rank: dict[str, int]
    a2a_link: str
    ring_link: str
    model_flops: float  # useful FLOPs of one layer fwd+bwd for the whole CP group (no padding)
    peak_flops: float  # per-GPU peak, FLOP/s
    notes: tuple[str, ...] = field(default=())
    linear_s: float = 0.0  # linear layers' recurrence + convolution kernels (0 for softmax layers)
    linear_comm_s: float = 0.0  # linear layers' summary all-gather and its reduce-scatter (not overlapped)
    linear_share: float = 0.0  # share of the model's layers that are linear

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def compute_s(self) -> float:
        return self.attention_s + self.ring_overhead_s + self.rest_s + self.linear_s

    @property
    def time_s(self) -> float:
        return self.compute_s + self.a2a_s + self.ring_exposed_s + self.linear_comm_s

    @property
    def attention_time_s(self) -> float:
        """The attention call alone (what `hybrid-cp bench` measures): ``time_s`` without the rest of the
        layer and without the linear layers' share."""
        return self.time_s - self.rest_s - self.linear_s - self.linear_comm_s

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_rank.values())

    @property
    def step_time_s(self) -> float:
        """All layers, one optimizer micro-step (embedding/head and optimizer ignored)."""
        return self.time_s * self.layers

    @property
    def tokens_per_s(self) -> float:
        """Tokens processed per second by all ``dp * cp`` GPUs."""
        return self.dp * self.batch * self.seq_len / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: useful FLOPs per GPU-second over peak."""
        return self.model_flops / (self.time_s * self.cp * self.peak_flops)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ulysses": self.ulysses, "ring": self.ring, "dp": self.dp, "batch": self.batch,
            "seq_len": self.seq_len, "padded_len": self.padded_len,
            "time_s": self.time_s, "attention_time_s": self.attention_time_s, "compute_s": self.compute_s, "attention_s": self.attention_s,
            "ring_overhead_s": self.ring_overhead_s, "rest_s": self.rest_s, "a2a_s": self.a2a_s,
            "ring_comm_s": self.ring_comm_s, "ring_exposed_s": self.ring_exposed_s,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "bytes_per_rank": dict(self.bytes_per_rank), "total_bytes": self.total_bytes,
            "a2a_link": self.a2a_link, "ring_link": self.ring_link, "notes": list(self.notes),
            "linear_s": self.linear_s, "linear_comm_s": self.linear_comm_s, "linear_share": self.linear_share,
        }  # fmt: skip


def _bandwidth(link: Any, concurrent: bool) -> float:
    """Bytes/s of ``link``; divided by its measured contention when several groups exchange at once."""
    return link.bandwidth_gb_s * 1e9 / (link.contention if concurrent else 1.0)


def _a2a_time(
    cluster: Cluster, groups: list[list[int]], split: list, unit: int, backward: bool = True
) -> tuple[float, str]:
    """Slowest rank's forward + backward all-to-all time over all groups, and the slowest tier used.

    Bytes to peers on different tiers travel concurrently on different links, so a rank's time is the
    max over tiers of bytes/bandwidth, plus one latency of the slowest tier per collective (2 forward,
    2 backward). Groups whose placement repeats (same offset inside a domain) are priced once. When
    more than one group exchanges at once, each link's ``contention`` divides its bandwidth.
    """
    concurrent = sum(1 for g in groups if len(g) > 1) > 1
    dom = cluster.domain_size
    seen: set[int] = set()
    worst, worst_tier = 0.0, -1
    for g in groups:
        key = g[0] % dom
        if key in seen or len(g) < 2:
            continue
        seen.add(key)
        for i in range(len(g)):
            per_tier: dict[int, list[int]] = {}
            for p in range(len(g)):
                if p != i:
                    t = cluster.tier(g[i], g[p])
                    f, b = _a2a_peer_bytes(split, i, p, unit, unit)   # the planner's models: one head dim
                    acc = per_tier.setdefault(t, [0, 0])
                    acc[0] += f
                    acc[1] += b
            lat = max(cluster.tier_link(t).latency_us for t in per_tier) * 1e-6
            fwd = max(v[0] / _bandwidth(cluster.tier_link(t), concurrent) for t, v in per_tier.items())
            bwd = max(v[1] / _bandwidth(cluster.tier_link(t), concurrent) for t, v in per_tier.items())
            total = fwd + 2 * lat + ((bwd + 2 * lat) if backward else 0.0)
            if total > worst:
                worst = total
            worst_tier = max(worst_tier, max(per_tier))
    return worst, cluster.tier_name(worst_tier)


def _ring_tier(cluster: Cluster, groups: list[list[int]]) -> int:
    """Slowest neighbour hop over all ring groups (a ring step waits for its slowest hop)."""
    dom = cluster.domain_size
    seen: set[int] = set()
    worst = -1
    for g in groups:
        if len(g) < 2 or g[0] % dom in seen:
            continue
        seen.add(g[0] % dom)
        worst = max(worst, max(cluster.tier(g[k], g[(k + 1) % len(g)]) for k in range(len(g))))
    return worst


_MODEL_WINDOW: Any = "model"  # estimate's default window: the model's sliding_window / window_layers mix


@dataclass(frozen=True)
class _Call:
    """One attention call (one layer, ``batch`` rows) on a (dp, ring, ulysses) mesh: the shape that
    every cost term prices. ``e`` is bytes per element of the compute dtype."""

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

    @classmethod
    def of(cls, model: ModelShape, split: Split, causal: bool = True, backward: bool = True) -> "_Call":
        """The call of one of ``model``'s attention layers on ``split``."""
        return cls(model.heads, model.n_kv, model.head_dim, split.seq_len, split.batch, split.ulysses, split.ring,
                   split.e, split.layout, causal, backward, split.dp)

    @property
    def world(self) -> int:
        return self.dp * self.ulysses * self.ring

    @property
    def lay(self):  # a topology.layouts.Layout (make_layout is cached)
        return make_layout(self.layout, self.ulysses, self.ring, seq_len=self.seq_len)

    @property
    def split(self) -> list[tuple[int, int, int, int]]:
        return head_split(self.heads, self.kv_heads, self.ulysses)

    @property
    def busiest_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) of the ulysses rank with the most of each."""
        split = self.split
        return max(x[0] for x in split), max(x[3] for x in split)

    @property
    def kv_block(self) -> int:
        """Elements of one K/V block travelling the ring (the ulysses group's tokens, busiest KV heads)."""
        return self.batch * self.ulysses * self.lay.local_len * 2 * self.busiest_heads[1] * self.head_dim

    @property
    def a2a_unit(self) -> int:
        """Bytes of one head's local rows: what :func:`_a2a_peer_bytes` counts in."""
        return self.batch * self.lay.local_len * self.head_dim * self.e

    def sent_bytes(self, window: Any = None, chunk_size: int | None = None) -> dict[str, int]:
        """:func:`comm_bytes` of this call (the backward's zero for a forward-only call)."""
        nbytes = comm_bytes(self.heads, self.kv_heads, self.head_dim, self.seq_len, self.batch, self.ulysses,
                            self.ring, self.e, self.layout, causal=self.causal, window=window, chunk_size=chunk_size)
        if not self.backward:
            nbytes.update(ulysses_bwd=0, ring_bwd=0)
        return nbytes

    def merge_bytes(self) -> tuple[int, int]:
        """Bytes one ring step's online-softmax merge moves, forward and backward (0 forward-only)."""
        tokens, (c_max, k_max) = self.batch * self.ulysses * self.lay.local_len, self.busiest_heads
        bwd = merge_bwd_bytes(tokens, c_max, k_max, self.head_dim, self.e) if self.backward else 0
        return merge_fwd_bytes(tokens, c_max, self.head_dim, self.e), bwd


@dataclass(frozen=True)
class _Times:
    """The time terms of one layer, before they become an :class:`Estimate`."""

    kernel_fwd_s: float
    kernel_bwd_s: float
    ring_overhead_s: float
    a2a_s: float
    a2a_link: str
    ring_comm_s: float
    ring_exposed_s: float
    ring_link: str


def estimate(
    cluster: Cluster,
    model: ModelShape,
    seq_len: int,
    ulysses: int,
    ring: int,
    dp: int = 1,
    batch: int = 1,
    *,
    dtype: Any = "bf16",
    layout: Layout = "zigzag",
    causal: bool = True,
    backward: bool = True,
    window: int | None = _MODEL_WINDOW,
    chunk_size: int | None = None,
    attention_forwards: int = 1,
) -> Estimate:
    """Predict time and bytes of one layer for ``batch`` sequences of ``seq_len`` per CP group.

    Ranks ``0 .. dp*ulysses*ring - 1`` of ``cluster`` are used, placed as in
    :func:`topology.placement.mesh_ranks` (ulysses innermost). See the module docstring for the model.
    ``backward=False`` prices a forward pass only (inference, or forward-only benchmarks).
    A model with ``sliding_window`` (causal) or ``attention_chunk_size`` is priced as its average
    layer: ``window_layers`` of its ``layers`` with the window (skipped blocks, halo exchange),
    ``chunked_layers`` in chunks (Llama 4), the rest full.
    ``window=W`` (or None) or ``chunk_size=C`` prices one layer with that window or chunk size
    (from the same block plan the engine runs) instead.
    ``attention_forwards`` is how often attention runs forward per layer and step (1 plain; 2 with
    activation checkpointing, whose recomputation repeats it; ``topology.memory.attention_forwards``):
    each extra one adds a forward pass's attention kernels, ring steps and exchanges (not useful FLOPs).
    Memory is not part of it: the training step's peak is :func:`topology.memory.step_memory`'s, which
    :func:`topology.planner.plan` checks each split with (``Plan.memory``).

    Args:
        cluster: The cluster.
        model: The model's shape.
        seq_len: Tokens per sequence.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dp: The data-parallel degree.
        batch: Sequences per CP group.
        dtype: The compute dtype.
        layout: "zigzag" or "contiguous".
        causal: Causal attention.
        backward: Price backward too.
        window: A sliding window W for one layer, None for none; "model": the model's own layers.
        chunk_size: An attention chunk size for one layer.
        attention_forwards: Attention forward passes per layer and step.

    Returns:
        Time and bytes of one layer, by stage.
    """
    if backward and attention_forwards > 1:
        kw: dict[str, Any] = dict(dtype=dtype, layout=layout, causal=causal, window=window, chunk_size=chunk_size)
        return _recomputed(estimate(cluster, model, seq_len, ulysses, ring, dp, batch, **kw),
                           estimate(cluster, model, seq_len, ulysses, ring, dp, batch, backward=False, **kw),
                           attention_forwards - 1)
    if not isinstance(attention_forwards, int) or attention_forwards < 1 or (attention_forwards > 1 and not backward):
        raise ValueError(f"attention_forwards={attention_forwards!r} must be an integer >= 1 (1 without backward)")
    split = Split(seq_len, ulysses, ring, dp, batch, dtype, layout)
    kw: dict[str, Any] = dict(causal=causal, backward=backward)
    if window is not _MODEL_WINDOW or chunk_size is not None:
        window = None if window is _MODEL_WINDOW else window
        return _one_layer(cluster, model, split, window=window, chunk_size=chunk_size, **kw)
    kinds = _layer_kinds(model, seq_len, causal)
    layers = [(n, _one_layer(cluster, model, split, window=w, chunk_size=c, **kw), what) for n, w, c, what in kinds]
    if model.linear_layers:
        layers.append((model.linear_layers, _linear_layer(cluster, model, split, **kw),
                       f"are linear ({model.linear_kind})"))
    if len(layers) == 1:
        return layers[0][1]
    note = ", ".join(f"{n} of {model.layers} layers {what}" for n, _, what in layers) + "; the figures are the average layer"
    avg = _average_layer([(n / model.layers, est) for n, est, _ in layers], note)
    return replace(avg, linear_share=model.linear_layers / model.layers)


def _recomputed(step: Estimate, forward: Estimate, extra: int) -> Estimate:
    """``step`` (forward + backward) with ``extra`` more attention forwards (``forward``'s attention-side
    terms: kernels, ring steps, all-to-all, ring transfers); the rest of the layer and the useful FLOPs stay."""
    terms = ("attention_s", "ring_overhead_s", "a2a_s", "ring_comm_s", "ring_exposed_s", "linear_s", "linear_comm_s")
    return replace(step, **{f: getattr(step, f) + extra * getattr(forward, f) for f in terms},
                   notes=step.notes + (f"{1 + extra} attention forwards per layer (recomputation)",))


def _layer_kinds(model: ModelShape, seq_len: int, causal: bool) -> list[tuple[int, Any, Any, str]]:
    """(layer count, window, chunk size, description) of each kind of layer the model has, those with
    layers: window layers, chunked layers, full-attention layers (a window or chunk reaching the whole
    sequence is full attention)."""
    window = model.sliding_window if causal and (model.sliding_window or 0) < seq_len else None
    chunk = model.attention_chunk_size if (model.attention_chunk_size or 0) < seq_len else None
    n_attn = model.attention_layers
    n_win = 0 if window is None else n_attn if model.window_layers is None else model.window_layers
    n_chunk = 0 if chunk is None else n_attn if model.chunked_layers is None else model.chunked_layers
    kinds = [(n_win, window, None, f"use the {window}-token window"),
             (n_chunk, None, chunk, f"attend in {chunk}-token chunks"),
             (n_attn - n_win - n_chunk, None, None, "attend in full")]
    return [kind for kind in kinds if kind[0] > 0]


def _average_layer(layers: list[tuple[float, Estimate]], note: str) -> Estimate:
    """A model with several kinds of layer (``layers``: each kind's share of the layers and its estimate):
    times, FLOPs and bytes averaged over its layers."""
    times = ("attention_s", "ring_overhead_s", "rest_s", "a2a_s", "ring_comm_s", "ring_exposed_s", "model_flops",
             "linear_s", "linear_comm_s")
    first = layers[0][1]
    keys = dict.fromkeys(k for _, e in layers for k in e.bytes_per_rank)
    return replace(first, **{f: sum(share * getattr(e, f) for share, e in layers) for f in times},
                   bytes_per_rank={k: round(sum(share * e.bytes_per_rank.get(k, 0) for share, e in layers))
                                   for k in keys},
                   notes=first.notes + (note,))


def _one_layer(cluster: Cluster, model: ModelShape, split: Split, *, causal: bool, backward: bool, window: Any,
               chunk_size: int | None = None) -> Estimate:
    """:func:`estimate` of one layer with ``window`` (or none): the analytic terms, then the measured
    ones where the cluster carries a calibration."""
    split.check()
    call = _Call.of(model, split, causal, backward)
    ulysses, ring, dp, batch, seq_len = split.ulysses, split.ring, split.dp, split.batch, split.seq_len
    if call.world > cluster.world_size:
        raise PlacementError(
            f"dp*ring*ulysses = {dp}*{ring}*{ulysses} = {call.world} ranks, but cluster {cluster.name!r} has "
            f"{cluster.world_size} GPUs ({cluster.nodes} x {cluster.gpus_per_node})"
        )
    lay, acc = call.lay, cluster.accelerator
    window, chunk = lay.effective_window(causal, window), lay.effective_chunk(chunk_size)
    halo = lay.halo(causal, window, chunk)
    busiest_share, window_share = _window_shares(lay, causal, window, chunk)
    nbytes = call.sent_bytes(window, chunk)
    times = _analytic_times(cluster, call, busiest_share, nbytes, halo)
    notes = _analytic_notes(call, acc, window, halo)
    if chunk is not None:
        notes.append(f"{chunk}-token attention chunks: blocks in other chunks are skipped"
                     + ("; only the halo rows are exchanged" if halo else ""))
    if cluster.calibration is not None:
        times, measured_notes = _calibrated_times(cluster, call, split.dtype, window, busiest_share, nbytes, times,
                                                  chunk)
        notes += measured_notes
    return Estimate(
        ulysses=ulysses, ring=ring, dp=dp, batch=batch, seq_len=seq_len, padded_len=lay.padded_len, layers=model.layers,
        attention_s=times.kernel_fwd_s + times.kernel_bwd_s, ring_overhead_s=times.ring_overhead_s,
        rest_s=_rest_s(call, model, acc), a2a_s=times.a2a_s, ring_comm_s=times.ring_comm_s,
        ring_exposed_s=times.ring_exposed_s, bytes_per_rank=nbytes, a2a_link=times.a2a_link, ring_link=times.ring_link,
        model_flops=_model_flops(call, model, window_share), peak_flops=acc.peak_tflops * 1e12, notes=tuple(notes),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# analytic terms (docs/planner.md, sections 2-3): priced from the cluster's links and accelerator


def _window_shares(lay: Any, causal: bool, window: Any, chunk_size: int | None = None) -> tuple[float, float]:
    """Of the unmasked attention work, the share a window (and attention chunks) keep on the busiest
    ring rank (which sets the time) and over all ranks (which sets the useful FLOPs); (1, 1) without."""
    if window is None and chunk_size is None:
        return 1.0, 1.0
    with_w, without = lay.work(causal, window, chunk_size), lay.work(causal)
    return max(map(sum, with_w)) / max(map(sum, without)), sum(map(sum, with_w)) / sum(map(sum, without))


def _causal_factor(causal: bool) -> float:
    """Share of the dense ``4 N^2 D H`` FLOPs a mask leaves: half for causal attention."""
    return 0.5 if causal else 1.0


def _bwd_factor(backward: bool) -> float:
    return ATTN_BWD_FACTOR if backward else 0.0


def _kernel_s(call: _Call, acc: Any, busiest_share: float) -> tuple[float, float]:
    """Attention kernels of the busiest rank, forward and backward: its FLOPs (padding, the layout's
    own imbalance and the window's share included) at the accelerator's attention rate, plus the
    fixed cost of each kernel call (r forward, r backward), which makes r smaller blocks cost more
    than one large block of the same FLOPs."""
    lay, c_max = call.lay, call.busiest_heads[0]
    padded, imbalance = lay.padded_len, lay.work_imbalance(call.causal)
    flops = (_causal_factor(call.causal) * 4.0 * call.batch * padded * (padded / call.ring) * call.head_dim * c_max
             * imbalance) * busiest_share
    fwd = flops / acc.attention_flops
    bwd = _bwd_factor(call.backward) * fwd
    if acc.kernel_call_overhead_us:
        fwd += call.ring * acc.kernel_call_overhead_us * 1e-6
        bwd += (call.ring if call.backward else 0) * acc.kernel_call_overhead_us * 1e-6
    return fwd, bwd


def _ring_overhead_s(call: _Call, acc: Any) -> float:
    """Per ring step: its launches (forward 1, backward 2 step units) and the online-softmax merge,
    which a single flash-attention call does in registers, at the device's memory bandwidth."""
    if call.ring == 1:
        return 0.0
    merge_fwd, merge_bwd = call.merge_bytes()
    launches = 3 if call.backward else 1
    return call.ring * (launches * (acc.ring_step_overhead_us * 1e-6) + (merge_fwd + merge_bwd) / (acc.hbm_gb_s * 1e9))


def _gemm_flops_per_token(model: ModelShape, backward: bool) -> float:
    """The rest of the layer: 2 FLOPs per parameter and token forward, 4 backward."""
    return (6.0 if backward else 2.0) * model.layer_params


def _rest_s(call: _Call, model: ModelShape, acc: Any) -> float:
    """The layer's GEMMs on the rank's local tokens at the accelerator's dense rate."""
    return _gemm_flops_per_token(model, call.backward) * call.batch * call.lay.local_len / acc.dense_flops


def _model_flops(call: _Call, model: ModelShape, window_share: float) -> float:
    """Useful FLOPs of one layer for the whole CP group: no padding, the window's share of attention."""
    useful = (_causal_factor(call.causal) * 4.0 * call.batch * call.seq_len * call.seq_len * call.head_dim
              * call.heads * (1 + _bwd_factor(call.backward)) * window_share)
    return useful + _gemm_flops_per_token(model, call.backward) * call.batch * call.seq_len


def _streamed_ring_s(xfer: Callable[[float], float], call: _Call, step_fwd_s: float, step_bwd_s: float,
                     overlap: float) -> tuple[float, float]:
    """(transfer, exposed) seconds of whole K/V blocks streamed around the ring: r - 1 forward hops,
    r - 1 backward hops carrying K/V and the travelling fp32 dK/dV, each hidden behind its step's
    kernels by ``overlap``, and the last dK/dV hop home, which nothing is left to hide."""
    kv, e, ring = call.kv_block, call.e, call.ring
    g = grad_bytes(e)
    c_fwd, c_bwd, c_home = xfer(kv * e), xfer(kv * (e + g)), xfer(kv * g)
    comm = (ring - 1) * c_fwd
    exposed = (ring - 1) * _exposed(c_fwd, step_fwd_s, overlap)
    if call.backward:
        comm += (ring - 1) * c_bwd + c_home
        exposed += (ring - 1) * _exposed(c_bwd, step_bwd_s, overlap) + c_home
    return comm, exposed


def _ring_comm_s(cluster: Cluster, call: _Call, nbytes: dict[str, int], halo: bool, step_fwd_s: float,
                 step_bwd_s: float) -> tuple[float, float, str]:
    """(transfer, exposed, link name) of the ring over its slowest neighbour hop. With a halo, one
    exchange of the rows peers read, hidden behind the local block; the gradients go back after."""
    if call.ring == 1:
        return 0.0, 0.0, "none"
    tier = _ring_tier(cluster, ring_groups(call.world, call.ulysses, call.ring, call.dp))
    link = cluster.tier_link(tier)
    bw = _bandwidth(link, call.dp * call.ulysses > 1)
    xfer = lambda n: link.latency_us * 1e-6 + n / bw  # noqa: E731
    overlap = cluster.accelerator.ring_overlap
    if not halo:
        return (*_streamed_ring_s(xfer, call, step_fwd_s, step_bwd_s, overlap), cluster.tier_name(tier))
    h_fwd, h_bwd = (xfer(nbytes[k]) if nbytes[k] else 0.0 for k in ("ring_fwd", "ring_bwd"))  # nothing read: no exchange
    back = h_bwd if call.backward else 0.0
    return h_fwd + back, _exposed(h_fwd, step_fwd_s, overlap) + back, cluster.tier_name(tier)


def _analytic_times(cluster: Cluster, call: _Call, busiest_share: float, nbytes: dict[str, int],
                    halo: bool) -> _Times:
    acc = cluster.accelerator
    kernel_fwd, kernel_bwd = _kernel_s(call, acc, busiest_share)
    groups = ulysses_groups(call.world, call.ulysses, call.ring, call.dp)
    a2a_s, a2a_link = _a2a_time(cluster, groups, call.split, call.a2a_unit, call.backward)
    ring_comm, ring_exposed, ring_link = _ring_comm_s(cluster, call, nbytes, halo, kernel_fwd / call.ring,
                                                      kernel_bwd / call.ring)
    return _Times(kernel_fwd, kernel_bwd, _ring_overhead_s(call, acc), a2a_s, a2a_link, ring_comm, ring_exposed,
                  ring_link)


def _analytic_notes(call: _Call, acc: Any, window: Any, halo: bool) -> list[str]:
    """What the analytic terms assumed that a reader of the plan should know."""
    lay, notes = call.lay, []
    if window is not None:
        notes.append(f"{window}-token window: blocks it does not reach are skipped"
                     + ("; only the halo rows are exchanged" if halo else ""))
    if acc.kernel_call_overhead_us:
        notes.append(f"{call.ring * (2 if call.backward else 1)} kernel calls at {acc.kernel_call_overhead_us:g} us each")
    if (imbalance := lay.work_imbalance(call.causal)) > 1:
        notes.append(f"contiguous causal ring: slowest rank does {imbalance:.2f}x the mean attention work")
    if lay.padded_len > call.seq_len:
        notes.append(f"padded {call.seq_len} -> {lay.padded_len} tokens")
    return notes


# ---------------------------------------------------------------------------------------------------
# calibrated terms (docs/planner.md, section 4): priced from a Cluster's measured Calibration


def _exposed(comm: float, compute: float, overlap: float) -> float:
    """Transfer time a step cannot hide: all of it beyond the step's compute, and ``1 - overlap`` of
    the part the compute could have hidden (overlap = 1: today's ``max(0, comm - compute)``)."""
    return comm - overlap * min(comm, compute)


def _calibrated_times(cluster: Cluster, call: _Call, dtype: Any, window: Any, busiest_share: float,
                      nbytes: dict[str, int], analytic: _Times, chunk: int | None = None) -> tuple[_Times, list[str]]:
    """The analytic times replaced by the measured ones; a window (or attention chunks) scales the
    calibrated kernel and ring terms by the work and the ring bytes it keeps."""
    parts = _calibrated_parts(cluster.calibration, cluster, call, dtype)
    kernel_fwd, kernel_bwd = parts["kernel_fwd_s"], parts["kernel_bwd_s"]
    ring_comm, ring_exposed = parts["ring_comm_s"], parts["ring_exposed_s"]
    if window is not None or chunk is not None:
        kernel_fwd, kernel_bwd = kernel_fwd * busiest_share, kernel_bwd * busiest_share
        full = comm_bytes(call.heads, call.kv_heads, call.head_dim, call.seq_len, call.batch, call.ulysses, call.ring,
                          call.e, call.layout, causal=call.causal)
        moved = (nbytes["ring_fwd"] + nbytes["ring_bwd"]) / max(1, full["ring_fwd"] + full["ring_bwd"])
        ring_comm, ring_exposed = ring_comm * moved, ring_exposed * moved
    times = _Times(
        kernel_fwd, kernel_bwd, parts["fixed_s"] + parts["merge_s"] + parts["copy_s"], parts["a2a_s"],
        "measured" if call.ulysses > 1 and analytic.a2a_link != "none" else analytic.a2a_link,
        ring_comm, ring_exposed, "measured" if call.ring > 1 else analytic.ring_link,
    )
    return times, parts["notes"]


def _calibrated_kernel_s(cal: Any, call: _Call, dtype: Any, notes: list[str]) -> tuple[float, float]:
    """Every kernel call of the slowest ring rank at its real block shape (from the layout's step
    plan), through the fitted ``call overhead + F (1 + tile/Tq) / rate``: (forward, backward) s."""
    name = dtype_name(dtype)
    fits = {(c, d): cal.kernel_fit(c, d, dtype=name) for c in (True, False) for d in ("fwd", "bwd")}
    if any(f is not None and f.dtype != name for f in fits.values()):
        notes.append(f"kernel rates for {name} not calibrated; used {cal.dtype}")
    heads = call.batch * call.busiest_heads[0]
    worst = (0.0, 0.0)
    for j in range(call.ring):
        totals = {"fwd": 0.0, "bwd": 0.0}
        for st in range(call.ring):
            step = call.lay.step(j, st, call.causal)
            if step is None:
                continue
            for _, nq, _, nk in step.pairs:
                for direction in ("fwd", "bwd") if call.backward else ("fwd",):
                    fit = fits[(step.causal, direction)]
                    if fit is None:
                        raise ValueError(
                            f"the calibration has no {'causal' if step.causal else 'full'} {direction} kernel fit; "
                            "re-run hybrid-cp calibrate with the kernels stage")
                    totals[direction] += fit.seconds(nq, nk, heads, call.head_dim)
        if totals["fwd"] + totals["bwd"] > sum(worst):
            worst = (totals["fwd"], totals["bwd"])
    return worst


def _calibrated_merge_s(cal: Any, call: _Call) -> float:
    """The online-softmax merges (and the backward's fp32 accumulations) at the measured merge rate."""
    if cal.merge is None:
        return 0.0
    merge_fwd, merge_bwd = call.merge_bytes()
    return call.ring * cal.merge.seconds(merge_fwd) + (call.ring * cal.merge.seconds(merge_bwd) if call.backward else 0.0)


def _calibrated_a2a_s(cal: Any, cluster: Cluster | None, call: _Call, nbytes: dict[str, int], notes: list[str]) -> float:
    """The measured all-to-all of this ulysses degree (all groups at once); the cluster's links when
    that degree was not calibrated."""
    if call.ulysses == 1:
        return 0.0
    fit_u = cal.a2a_fit(call.ulysses)
    if fit_u is not None:
        lat, bw = fit_u.link.latency_us * 1e-6, fit_u.link.bandwidth_gb_s * 1e9
        a2a_s = 2 * lat + nbytes["ulysses_fwd"] / bw
        if call.backward:
            a2a_s += 2 * lat + nbytes["ulysses_bwd"] / bw
        return a2a_s
    if cluster is None:
        return 0.0
    notes.append(f"all-to-all of ulysses={call.ulysses} not calibrated; priced with the cluster's links")
    groups = ulysses_groups(call.world, call.ulysses, call.ring, call.dp)
    return _a2a_time(cluster, groups, call.split, call.a2a_unit, call.backward)[0]


def _calibrated_ring_s(cal: Any, cluster: Cluster | None, call: _Call, kernel_fwd_s: float, kernel_bwd_s: float,
                       notes: list[str]) -> tuple[float, float]:
    """The measured neighbour exchange with every rank sending, hidden behind the step's kernels by
    the measured overlap fraction; the last dK/dV hop is always exposed."""
    if call.ring == 1:
        return 0.0, 0.0
    if cal.p2p is not None:
        xfer = cal.p2p.seconds
    elif cluster is not None:
        xfer = cluster.intra_node.transfer_s
        notes.append("ring exchange not calibrated; priced with the cluster's intra_node link")
    else:
        xfer = lambda n: 0.0  # noqa: E731
    return _streamed_ring_s(xfer, call, kernel_fwd_s / call.ring, kernel_bwd_s / call.ring, cal.overlap)


def _calibrated_parts(cal: Any, cluster: Cluster | None, call: _Call, dtype: Any,
                      kernels: bool = True) -> dict[str, Any]:
    """One attention call priced with measured rates, term by term (seconds, slowest rank).

    kernel: :func:`_calibrated_kernel_s`; fixed: ``3 r`` step units (forward 1, backward 2) plus one
    per-call cost; merge: :func:`_calibrated_merge_s`; copy: the engine's packing copies per byte
    sent; a2a: :func:`_calibrated_a2a_s`; ring: :func:`_calibrated_ring_s`. Bytes are the full row's;
    :func:`estimate` scales them for a window.
    """
    notes: list[str] = []
    kf, kb = _calibrated_kernel_s(cal, call, dtype, notes) if kernels else (0.0, 0.0)
    units = call.ring * (3 if call.backward else 1)
    fixed = units * cal.step_overhead_us * 1e-6 + cal.call_overhead_us * 1e-6 * (1.0 if call.backward else 0.5)
    nbytes = call.sent_bytes()
    sent = sum(nbytes.values())
    copy_s = sent / (cal.copy_gb_s * 1e9) if cal.copy_gb_s else 0.0
    a2a_s = _calibrated_a2a_s(cal, cluster, call, nbytes, notes)
    ring_comm, ring_exposed = _calibrated_ring_s(cal, cluster, call, kf, kb, notes)
    return {"kernel_fwd_s": kf, "kernel_bwd_s": kb, "fixed_s": fixed, "merge_s": _calibrated_merge_s(cal, call),
            "copy_s": copy_s, "a2a_s": a2a_s, "ring_comm_s": ring_comm, "ring_exposed_s": ring_exposed,
            "sent_bytes": sent, "notes": notes}


def engine_known_s(cal: Any, ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                   e: int) -> tuple[float, int]:
    """The measured parts of a no-arithmetic engine call (all-to-all, ring exchange, merges) as the
    model prices them, and the bytes it sends; calibration fits the fixed costs to the remainder."""
    call = _Call(heads, kv_heads, head_dim, seq_len, 1, ulysses, ring, e)
    p = _calibrated_parts(cal, None, call, None, kernels=False)
    return p["merge_s"] + p["a2a_s"] + p["ring_exposed_s"], p["sent_bytes"]


# ---- linear-attention / state-space layers (hybrid models; docs/linear.md) ------------------------------------------

def exporting_runs(lay: Any, size: int) -> int:
    """Gather slots of a linear layer's summary exchange: the most runs of one document on a rank that
    the document continues after (the engine's `recurrence.scan_plan(...).slots`, tested equal)."""
    starts, lens = lay.doc_starts, lay.doc_lens
    return max(sum(tok >= 0 and pos + n < lens[bisect.bisect_right(starts, tok) - 1]
                   for tok, pos, n in lay.document_runs(rank)) for rank in range(size))


def linear_layer_bytes(lay: Any, size: int, batch: int, state_numel: int, halo_rows: int = 0, channels: int = 0,
                       act_bytes: int = 2, state_bytes: int = FP32_BYTES, *, transition_numel: int = 0,
                       rank: int | None = None, exchange: str | None = None) -> dict[str, int]:
    """Bytes one rank sends per linear layer, forward and backward: the exchange of every exporting run's summary
    (`state_numel` numbers per batch row, of which `transition_numel` are M: Gated DeltaNet Hv*dk*(dk+dv) with
    Hv*dk*dk, Mamba2 H*(1+P*N) with H) in fp32, and the all-gather of its last `halo_rows` pre-convolution rows
    of `channels`. The summaries travel as `topology.summary_scan.exchange_kind` picks (`exchange` forces one):
    all-gathered, each direction (P - 1) x slots x the summary on every rank, or by the log-step scan, what
    `rank` sends (None: the busiest rank, per stage). Keys as `hcp.comm_bytes` reports them; stages that send
    nothing are left out."""
    if size == 1:
        return {}
    slots = exporting_runs(lay, size)
    if not slots:
        return {}
    m, e = transition_numel, state_numel - transition_numel
    if (exchange or exchange_kind(lay, size, slots, m, e)) == "scan":
        sent = [scan_bytes(lay, size, r, m, e) for r in (range(size) if rank is None else [rank])]
        fwd, bwd = (max(x[d] for x in sent) * batch * state_bytes for d in (0, 1))
    else:
        fwd = bwd = (size - 1) * slots * batch * state_numel * state_bytes
    out = {"linear_state_fwd": fwd, "linear_state_bwd": bwd}
    if halo_rows and channels:
        halo = (size - 1) * slots * batch * halo_rows * channels * act_bytes
        out.update(linear_halo_fwd=halo, linear_halo_bwd=halo)
    return {k: v for k, v in out.items() if v}


# FLOPs per token of the chunked recurrences (forward; backward is LINEAR_BWD_FACTOR x forward: each forward
# product has two in backward, the inputs' and the weights'/states' gradients). C is the kernel's chunk.
#   Gated DeltaNet, per value head (fla's chunked delta rule, WY form): the three state products (the
#   output q S, the delta term k S, the update k^T v) 3 x 2 dk dv, and the intra-chunk C x C products
#   (k k^T, q k^T against dk; A u and the masked attention times the values against dv) 4 C (dk + dv).
#   Mamba2 SSD, per head: the state update and the output against the state 2 x 2 N P, the masked
#   intra-chunk C B^T (2 C N, shared by the H/G heads of a group) and its product with x (2 C P).
# The probe of a continuing Gated DeltaNet run widens the values from dv to dv + dk (same formula with
# dv + dk); the correction of a continuing run is one state product per token (2 dk dv, or 2 N P).
LINEAR_BWD_FACTOR = 2.0


def linear_flops_per_token(model: ModelShape, probed: bool) -> float:
    """Forward FLOPs of one linear layer's recurrence for one token (all heads), the causal convolution
    included (2 K per channel); ``probed``: the token is on a run that continues its document."""
    h, g, dk, dv, c = (model.linear_heads, model.linear_key_heads, model.linear_key_dim, model.linear_value_dim,
                       model.linear_chunk)
    if model.linear_kind == "gated_delta":
        width = dv + dk if probed else dv
        head = 6 * dk * width + 4 * c * (dk + width) + (2 * dk * dv if probed else 0)
    else:  # mamba2: dk is the state size N, dv the head dim P, g the groups
        head = 4 * dk * dv + 2 * c * dv + 2 * c * dk * g / h + (2 * dk * dv if probed else 0)
    return h * head + 2 * model.linear_conv * model.linear_conv_channels


def _linear_tokens(lay: Any, size: int) -> list[tuple[int, int]]:
    """(plain, probed) real tokens of each cp rank: probed ones sit on runs that continue their document
    (`recurrence.scan_plan`'s `continues`). One rank is no context parallelism: the plain kernel throughout."""
    if size == 1:
        return [(lay.seq_len, 0)]
    out = []
    for rank in range(size):
        runs = [(pos, n) for tok, pos, n in lay.document_runs(rank) if tok >= 0]
        out.append((sum(n for pos, n in runs if pos == 0), sum(n for pos, n in runs if pos > 0)))
    return out


def _linear_compute_s(call: _Call, model: ModelShape, acc: Any) -> float:
    """The busiest rank's recurrence and convolution kernels at the dense rate (the chunked kernels are
    GEMMs of C x d tiles; real kernels reach less, uncalibrated), forward and backward."""
    f0, f1 = linear_flops_per_token(model, False), linear_flops_per_token(model, True)
    worst = max(p * f0 + q * f1 for p, q in _linear_tokens(call.lay, call.ulysses * call.ring))
    return worst * call.batch * (1 + (LINEAR_BWD_FACTOR if call.backward else 0)) / acc.dense_flops


def _linear_comm_s(cluster: Cluster, call: _Call, model: ModelShape, nbytes: dict[str, int]) -> tuple[float, str]:
    """The summary exchange (forward) and its gradients (backward) over the cp group, nothing to hide behind
    (the correction waits for it): the all-gather as the ring algorithm runs it, P - 1 hops at the slowest
    hop's link, or the log-step scan, one latency per round at the slowest link a transfer takes. Bytes are
    :func:`linear_layer_bytes`' (the busiest rank's)."""
    size, lay = call.ulysses * call.ring, call.lay
    if size == 1 or not nbytes:
        return 0.0, "none"
    m = model.linear_transition_numel
    scan = exchange_kind(lay, size, exporting_runs(lay, size), m, model.linear_state_numel - m) == "scan"
    if scan:
        plan = summary_scan(lay, size)
        pairs = {(plan.elements[j][0], plan.elements[i][0]) for t in plan.rounds for j, i, _ in t}
        pairs = [(a, b) for a, b in pairs if a != b] or [(0, 1)]
    else:
        pairs = [(k, (k + 1) % size) for k in range(size)]
    tier = max(cluster.tier(a, b) for a, b in pairs)
    link = cluster.tier_link(tier)
    bw = _bandwidth(link, call.dp > 1)
    fwd = nbytes.get("linear_state_fwd", 0) + nbytes.get("linear_halo_fwd", 0)
    bwd = nbytes.get("linear_state_bwd", 0) + nbytes.get("linear_halo_bwd", 0) if call.backward else 0
    hops = (len(summary_scan(lay, size).rounds) if scan else size - 1) * (2 if call.backward else 1)
    return hops * link.latency_us * 1e-6 + (fwd + bwd) / bw, cluster.tier_name(tier)


def linear_kernel_bytes(model: ModelShape, probed: bool, e: int) -> tuple[int, int, int]:
    """(saved, forward and backward working set) bytes per head and token of a run of the chunked kernel."""
    C, g, h, fp32 = model.linear_chunk, model.linear_key_heads, model.linear_heads, e >= FP32_BYTES
    if model.linear_kind == "gated_delta":
        dk, dv = model.linear_key_dim, model.linear_value_dim
        w = dv + dk if probed else dv
        extra = 16 * dk + (0 if g < h else 4 * dv + 4) if fp32 else 0
        return 32 * dk + 12 * w + 20 * C + 4 * dk * w // C + 24 + extra, 8 * dk + 16 * w, 16 * dk + 16 * w + 8 * C
    P, N = model.linear_value_dim, model.linear_key_dim
    saved = 20 * P + 20 * N + 12 * C + 8 * P * N // C + 30 + (8 * g * N // h if fp32 else 0) + \
        (4 * N + 12 if probed else 0)
    return saved, 20 * P + 8 * N + 4 * P * N // C + 32, 12 * P + 8 * P * N // C


def linear_mixer_token_bytes(model: ModelShape, e: int) -> tuple[int, int]:
    """Bytes per token a linear mixer saves outside the kernel, and per probed token on top.

    Both kinds: the convolution's input (with the halo) and the silu's input, its output (conv channels each).
    Gated DeltaNet: the gates (softplus in and out in fp32, sigmoid out), the gated RMSNorm (its fp32 input,
    normalised value, weighted value, fp32 gate and silu(gate); the output projection's input); a probed run's
    correction keeps the probe's output (fp32) or, cast, its fp32 aux (dk). Mamba2: the gate (fp32; in fp32 the
    whole in_proj output, of which it is a view), the gated norm (y, silu(gate), their product, the normalised
    value, all fp32; the output projection's input) and dt; a probed run keeps its decayed C (N, fp32)."""
    c, h = model.linear_conv_channels, model.linear_heads
    inner = h * model.linear_value_dim
    if model.linear_kind == "gated_delta":
        dk, w = model.linear_key_dim, model.linear_value_dim + model.linear_key_dim
        return 2 * c * e + h * (8 + e) + inner * (12 + 3 * e), h * (4 * w if e >= FP32_BYTES else 4 * dk)
    gate = inner * FP32_BYTES + ((c + h) * FP32_BYTES if e >= FP32_BYTES else 0)
    return 2 * c * e + gate + inner * (16 + e) + h * (8 + e), h * (4 * model.linear_key_dim + 4)


def linear_mixer_saved(model: ModelShape, runs: list[tuple[int, bool]], e: int) -> int:
    """Bytes one linear mixer keeps for backward over one batch row of `runs` ((tokens, probed) each, as
    `topology.cost.linear_runs` gives them) in a compute dtype of `e` bytes, the gathered summaries apart: the
    per-token terms (`linear_mixer_token_bytes`), the kernel's per run and the convolution's halo rows."""
    token, probed_extra = linear_mixer_token_bytes(model, e)
    h, c = model.linear_heads, model.linear_conv_channels
    return sum(n * (token + h * linear_kernel_bytes(model, p, e)[0] + (probed_extra if p else 0)) for n, p in runs) + \
        len(runs) * (model.linear_conv - 1) * c * e


def linear_runs(lay: Any, size: int, rank: int) -> list[tuple[int, bool]]:
    """(tokens, probed) of each run of `rank`'s local rows, as `recurrence.linear_scan` runs them
    (`Layout.document_runs`: adjacent pieces of one document are one run, so on one rank a zigzag row is one
    unprobed run): probed runs continue their document (the probe's wider values), padding runs go
    through the plain kernel."""
    return [(n, tok >= 0 and pos > 0) for tok, pos, n in lay.document_runs(rank)]


def linear_summary_bytes(lay: Any, size: int, batch: int, model: ModelShape, state_bytes: int = FP32_BYTES) -> int:
    """Bytes of the gathered summaries one rank holds per linear layer: P x slots x B x numel."""
    return size * exporting_runs(lay, size) * batch * model.linear_state_numel * state_bytes if size > 1 else 0


def _linear_layer(cluster: Cluster, model: ModelShape, split: Split, *, causal: bool, backward: bool) -> Estimate:
    """One linear layer (docs/linear.md): no all-to-all and no ring; local chunked recurrence on the
    rank's shard (the probe's wider values on continuing runs), one summary exchange, the layer's GEMMs."""
    split.check()
    call = _Call.of(model, split, causal, backward)
    ulysses, ring, dp, batch, seq_len = split.ulysses, split.ring, split.dp, split.batch, split.seq_len
    if call.world > cluster.world_size:
        raise PlacementError(f"dp*ring*ulysses = {call.world} ranks, but cluster {cluster.name!r} has "
                             f"{cluster.world_size} GPUs")
    lay, acc, size = call.lay, cluster.accelerator, ulysses * ring
    nbytes = linear_layer_bytes(lay, size, batch, model.linear_state_numel, model.linear_conv - 1,
                                model.linear_conv_channels, call.e, max(FP32_BYTES, call.e),
                                transition_numel=model.linear_transition_numel)
    if not backward:
        nbytes = {k: v for k, v in nbytes.items() if not k.endswith("_bwd")}
    comm_s, link = _linear_comm_s(cluster, call, model, nbytes)
    gemm = (6.0 if backward else 2.0) * model.linear_layer_params
    useful = linear_flops_per_token(model, False) * (1 + (LINEAR_BWD_FACTOR if backward else 0)) + gemm
    return Estimate(
        ulysses=ulysses, ring=ring, dp=dp, batch=batch, seq_len=seq_len, padded_len=lay.padded_len,
        layers=model.layers, attention_s=0.0, ring_overhead_s=0.0,
        rest_s=gemm * batch * lay.local_len / acc.dense_flops, a2a_s=0.0, ring_comm_s=0.0, ring_exposed_s=0.0,
        bytes_per_rank=nbytes, a2a_link="none",
        ring_link=link, model_flops=useful * batch * seq_len, peak_flops=acc.peak_tflops * 1e12,
        linear_s=_linear_compute_s(call, model, acc), linear_comm_s=comm_s, linear_share=1.0,
    )  # fmt: skip


__all__ += ["exporting_runs", "linear_layer_bytes", "linear_flops_per_token", "linear_summary_bytes",
            "linear_runs", "linear_kernel_bytes", "linear_mixer_token_bytes", "linear_mixer_saved"]
