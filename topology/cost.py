"""Cost model of one transformer layer under a (ulysses, ring, dp) split.

Three parts, all per layer, forward + backward:

* **Bytes** (:func:`comm_bytes`): exact bytes each rank sends to *other* ranks, with the formulas the
  engine's own byte counter is tested against (uneven heads, GQA replication, zigzag padding).
* **Time** (:func:`estimate`): a latency-bandwidth model per link tier (socket / node / NVLink domain /
  fabric), attention FLOPs at the accelerator's achievable rate, ring transfers overlapped with the
  ring step they feed, and the rest of the layer's GEMMs.
* **Memory**: the attention stage's working set plus checkpointed layer inputs and sharded model
  states (see :class:`Estimate.memory_breakdown`).

Conventions (documented in docs/planner.md): causal attention forward costs ``0.5 * 4 * N^2 * D * H``
FLOPs per sequence (half of the dense ``4 N^2 D H``); backward costs 2.5x forward (FlashAttention's
5 vs 2 matmuls); the rest of the layer costs ``6 * params_per_layer`` FLOPs per token (fwd + bwd).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .cluster import Cluster
from .layouts import doc_lengths, head_split, make_layout
from .placement import PlacementError, ring_groups, ulysses_groups

__all__ = ["ModelShape", "Estimate", "comm_bytes", "estimate", "dtype_bytes", "head_split", "MODEL_PRESETS",
           "engine_known_s"]

Layout = Literal["zigzag", "contiguous"]
_DTYPE_BYTES = {
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp32": 4, "float32": 4, "float": 4, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
GRAD_BYTES = 4  # dK/dV travel the ring in fp32 (the engine's default: gradients accumulate in fp32)
ATTN_BWD_FACTOR = 2.5  # backward attention FLOPs / forward attention FLOPs
MODEL_STATE_BYTES_PER_PARAM = 16  # bf16 param + bf16 grad + fp32 master + 2 fp32 Adam moments (ZeRO-3/FSDP)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: an int, a name like ``"bf16"`` or a ``torch.dtype``."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in (1, 2, 4, 8):
            raise ValueError(f"dtype bytes={dtype} must be 1, 2, 4 or 8")
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPE_BYTES))} or a byte count")
    return _DTYPE_BYTES[name]


class ModelShape(BaseModel):
    """The parts of a transformer that decide attention cost, communication and memory.

    ``hidden`` defaults to ``heads * head_dim``; ``intermediate`` (MLP width) to ``4 * hidden`` with a
    plain 2-matrix MLP, else a gated (SwiGLU, 3-matrix) MLP when ``gated_mlp`` is true. For MoE models
    give the *active* width (experts per token x expert width + shared experts).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    heads: int = Field(ge=1)
    kv_heads: int | None = Field(default=None, ge=1, description="defaults to heads (MHA)")
    head_dim: int = Field(ge=1)
    hidden: int | None = Field(default=None, ge=1)
    layers: int = Field(default=32, ge=1)
    intermediate: int | None = Field(default=None, ge=1)
    gated_mlp: bool = True
    vocab: int = Field(default=0, ge=0, description="embedding + LM head size, for model-state memory")
    sliding_window: int | None = Field(default=None, ge=1, description="keys each query sees in window layers")
    window_layers: int | None = Field(default=None, ge=0, description="layers with the window (default: all)")
    name: str = "custom"

    @model_validator(mode="after")
    def _check(self) -> "ModelShape":
        if self.window_layers is not None and self.window_layers > self.layers:
            raise ValueError(f"window_layers={self.window_layers} exceeds layers={self.layers}")
        kv = self.kv_heads or self.heads
        if kv > self.heads or self.heads % kv:
            raise ValueError(
                f"heads={self.heads} must be a multiple of kv_heads={kv} (grouped-query attention shares "
                "each KV head among heads/kv_heads query heads)"
            )
        return self

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
        if self.intermediate is None:
            mlp = 8 * h * h
        else:
            mlp = (3 if self.gated_mlp else 2) * h * self.intermediate
        return h * q + 2 * h * kv + q * h + mlp

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.d_model

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Known shapes (``llama3-8b``, ``llama3-70b``, ``glm-4.5-air``, ``llama2-7b``)."""
        key = name.lower()
        if key not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}")
        return cls(name=key, **MODEL_PRESETS[key])


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Values from the models' Hugging Face config.json files.
    "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32, intermediate=14336, vocab=128256),
    "llama3-70b": dict(heads=64, kv_heads=8, head_dim=128, hidden=8192, layers=80, intermediate=28672, vocab=128256),
    "llama2-7b": dict(heads=32, kv_heads=32, head_dim=128, hidden=4096, layers=32, intermediate=11008, vocab=32000),
    # GLM-4.5-Air (MoE, 12B active): 8 routed experts of width 1408 + 1 shared expert active per token.
    "glm-4.5-air": dict(heads=96, kv_heads=8, head_dim=128, hidden=4096, layers=46, intermediate=9 * 1408, vocab=151552),
}


def _local_tokens(seq_len: int, ulysses: int, ring: int, layout: str, cu_seqlens=None) -> tuple[int, int]:
    """``(padded_len, local_tokens)`` of a dense row of `seq_len` tokens, or of packed documents."""
    lay = make_layout(layout, ulysses, ring, seq_len=None if cu_seqlens is not None else seq_len,
                      doc_lens=doc_lengths(cu_seqlens) if cu_seqlens is not None else None)
    return lay.padded_len, lay.local_len


def _check_ints(**kw: int) -> None:
    for name, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")


def _a2a_peer_bytes(split: list[tuple[int, int, int, int]], i: int, p: int, unit: int) -> tuple[int, int]:
    """Bytes rank ``i`` sends to peer ``p`` in the forward and backward all-to-alls.

    Forward: p's query heads and the KV heads p needs for our S tokens (fused QKV), then our heads'
    output for p's tokens. Backward: dO of p's heads, then dQ/dK/dV of our heads for p's tokens.
    """
    c_i, k_i = split[i][0], split[i][3]
    c_p, k_p = split[p][0], split[p][3]
    return unit * (c_p + 2 * k_p + c_i), unit * (c_p + c_i + 2 * k_i)


def comm_bytes(
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch: int,
    ulysses: int,
    ring: int,
    dtype_bytes: int,
    layout: str = "zigzag",
    ulysses_rank: int | None = None,
    cu_seqlens: Any = None,
    causal: bool = True,
    window: Any = None,
    ring_rank: int | None = None,
) -> dict[str, int]:
    """Bytes one rank sends to other ranks for one attention call (one layer), by stage.

    Keys ``ulysses_fwd``, ``ulysses_bwd``, ``ring_fwd``, ``ring_bwd``. With ``ulysses_rank=None`` each
    value is the maximum over ulysses ranks (taken per key). These are the formulas the engine's
    byte counter must satisfy exactly; see docs/planner.md for the derivation. For a packed row pass
    the documents' boundaries as ``cu_seqlens`` (``seq_len`` is then their total): the packed layout's
    padding decides the local length, the formulas are the same. With a sliding ``window`` (an int W
    with ``causal``, or ``(left, right)``) short enough for the engine's halo exchange, a rank sends
    each ring peer only the K/V rows that peer reads, and gets back their fp32 gradients; the ring
    values then depend on the ring rank (``ring_rank=None``: the maximum over ring ranks).
    """
    _check_ints(heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, batch=batch,
                ulysses=ulysses, ring=ring, dtype_bytes=dtype_bytes)  # fmt: skip
    split = head_split(heads, kv_heads, ulysses)
    if cu_seqlens is not None and doc_lengths(cu_seqlens) and sum(doc_lengths(cu_seqlens)) != seq_len:
        raise ValueError(f"cu_seqlens ends at {sum(doc_lengths(cu_seqlens))} but seq_len={seq_len}; pass the packed row's total")
    lay = make_layout(layout, ulysses, ring, seq_len=None if cu_seqlens is not None else seq_len,
                      doc_lens=doc_lengths(cu_seqlens) if cu_seqlens is not None else None)
    s = lay.local_len
    unit = batch * s * head_dim * dtype_bytes
    window = lay.effective_window(causal, window)
    halo = lay.halo(causal, window)
    ring_ranks = range(ring) if ring_rank is None else [ring_rank]
    ranks = range(ulysses) if ulysses_rank is None else [ulysses_rank]
    if ulysses_rank is not None and not 0 <= ulysses_rank < ulysses:
        raise ValueError(f"ulysses_rank={ulysses_rank} must be in [0, {ulysses}) or None for the maximum")
    out = {"ulysses_fwd": 0, "ulysses_bwd": 0, "ring_fwd": 0, "ring_bwd": 0}
    for i in ranks:
        fwd = bwd = 0
        for p in range(ulysses):
            if p != i:
                f, b = _a2a_peer_bytes(split, i, p, unit)
                fwd, bwd = fwd + f, bwd + b
        row = batch * 2 * split[i][3] * head_dim  # K/V elements of one token row
        if halo:  # rows my peers read from me go out; gradients of rows I read go back
            def sent(j: int) -> tuple[int, int]:
                out_rows = sum(n for st in range(1, ring) for _, n in lay.needed_rows((j + st) % ring, st, causal, window))
                back_rows = sum(n for st in range(1, ring) for _, n in lay.needed_rows(j, st, causal, window))
                return out_rows * row * dtype_bytes, back_rows * row * GRAD_BYTES
            ring_fwd, ring_bwd = (max(v) for v in zip(*(sent(j) for j in ring_ranks)))
        else:
            kv_block = (ulysses * s) * row  # elements of one K/V block
            ring_fwd = (ring - 1) * kv_block * dtype_bytes
            ring_bwd = ring_fwd + ring * kv_block * GRAD_BYTES if ring > 1 else 0
        for key, val in (("ulysses_fwd", fwd), ("ulysses_bwd", bwd), ("ring_fwd", ring_fwd), ("ring_bwd", ring_bwd)):
            out[key] = max(out[key], val)
    return out


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one layer (forward + backward) for ``batch`` sequences per CP group.

    ``time_s`` = ``compute_s + a2a_s + ring_exposed_s``; ``compute_s`` = attention kernels + ring step
    overheads + the rest of the layer. ``bytes_per_rank`` is the :func:`comm_bytes` dict (worst
    ulysses rank); ``total_bytes`` its sum. ``memory_bytes`` is the peak per-rank memory estimate.
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
    memory_bytes: int
    memory_breakdown: dict[str, int]
    a2a_link: str
    ring_link: str
    model_flops: float  # useful FLOPs of one layer fwd+bwd for the whole CP group (no padding)
    peak_flops: float  # per-GPU peak, FLOP/s
    notes: tuple[str, ...] = field(default=())

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def compute_s(self) -> float:
        return self.attention_s + self.ring_overhead_s + self.rest_s

    @property
    def time_s(self) -> float:
        return self.compute_s + self.a2a_s + self.ring_exposed_s

    @property
    def attention_time_s(self) -> float:
        """The attention call alone (what `hybrid-cp bench` measures): ``time_s`` without the rest of the layer."""
        return self.time_s - self.rest_s

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
            "memory_bytes": self.memory_bytes, "memory_breakdown": dict(self.memory_breakdown),
            "a2a_link": self.a2a_link, "ring_link": self.ring_link, "notes": list(self.notes),
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
                    f, b = _a2a_peer_bytes(split, i, p, unit)
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
) -> Estimate:
    """Predict time, bytes and memory of one layer for ``batch`` sequences of ``seq_len`` per CP group.

    Ranks ``0 .. dp*ulysses*ring - 1`` of ``cluster`` are used, placed as in
    :func:`topology.placement.mesh_ranks` (ulysses innermost). See the module docstring for the model.
    ``backward=False`` prices a forward pass only (inference, or forward-only benchmarks).
    A model with ``sliding_window`` (causal) is priced as its average layer: ``window_layers`` of
    its ``layers`` with the window (skipped blocks, halo exchange), the rest full; memory is the
    larger of the two. ``window=W`` (or None) prices one layer with that window (or none) instead.
    """
    if window is _MODEL_WINDOW:
        kw = dict(dtype=dtype, layout=layout, causal=causal, backward=backward)
        window = model.sliding_window if causal and (model.sliding_window or 0) < seq_len else None
        n_win = model.layers if model.window_layers is None else model.window_layers
        win = estimate(cluster, model, seq_len, ulysses, ring, dp, batch, window=window, **kw)
        if window is None or n_win == model.layers:
            return win
        full = estimate(cluster, model, seq_len, ulysses, ring, dp, batch, window=None, **kw)
        a = n_win / model.layers

        def mix(x, y):
            return a * x + (1 - a) * y

        times = ("attention_s", "ring_overhead_s", "rest_s", "a2a_s", "ring_comm_s", "ring_exposed_s", "model_flops")
        return replace(win, **{f: mix(getattr(win, f), getattr(full, f)) for f in times},
                       bytes_per_rank={k: round(mix(win.bytes_per_rank[k], full.bytes_per_rank[k]))
                                       for k in win.bytes_per_rank},
                       memory_bytes=max(win.memory_bytes, full.memory_bytes),
                       notes=win.notes + (f"{n_win} of {model.layers} layers use the {window}-token window; the "
                                          f"figures are the average layer",))

    _check_ints(seq_len=seq_len, ulysses=ulysses, ring=ring, dp=dp, batch=batch)
    e = dtype_bytes(dtype)
    world = dp * ulysses * ring
    if world > cluster.world_size:
        raise PlacementError(
            f"dp*ring*ulysses = {dp}*{ring}*{ulysses} = {world} ranks, but cluster {cluster.name!r} has "
            f"{cluster.world_size} GPUs ({cluster.nodes} x {cluster.gpus_per_node})"
        )
    H, Hkv, D = model.heads, model.n_kv, model.head_dim
    split = head_split(H, Hkv, ulysses)
    padded, s = _local_tokens(seq_len, ulysses, ring, layout)
    c_max, k_max = max(x[0] for x in split), max(x[3] for x in split)
    acc = cluster.accelerator
    notes: list[str] = []

    # --- compute -------------------------------------------------------------------------------
    causal_factor = 0.5 if causal else 1.0
    imbalance = (2.0 - 1.0 / ring) if (causal and layout == "contiguous" and ring > 1) else 1.0
    attn_fwd_flops = causal_factor * 4.0 * batch * padded * (padded / ring) * D * c_max * imbalance
    lay = make_layout(layout, ulysses, ring, seq_len=seq_len)
    window = lay.effective_window(causal, window)
    halo = lay.halo(causal, window)
    window_share = busiest_share = 1.0  # of the useful work, and of the busiest rank's, that a window keeps
    if window is not None:
        with_w, without = lay.work(causal, window), lay.work(causal)
        busiest_share = max(map(sum, with_w)) / max(map(sum, without))
        attn_fwd_flops *= busiest_share
        window_share = sum(map(sum, with_w)) / sum(map(sum, without))
        notes.append(f"{window}-token window: blocks it does not reach are skipped"
                     + ("; only the halo rows are exchanged" if halo else ""))
    attn_fwd_s = attn_fwd_flops / acc.attention_flops
    bwd_factor = ATTN_BWD_FACTOR if backward else 0.0
    attn_bwd_s = bwd_factor * attn_fwd_s
    overhead = acc.ring_step_overhead_us * 1e-6
    ring_overhead_s = 0.0
    if acc.kernel_call_overhead_us:
        # Kernel efficiency vs block size: every kernel call (r forward, r backward) pays a fixed cost,
        # so r smaller blocks cost more than one large block of the same FLOPs.
        calls = ring * (2 if backward else 1)
        attn_fwd_s += ring * acc.kernel_call_overhead_us * 1e-6
        attn_bwd_s += (ring if backward else 0) * acc.kernel_call_overhead_us * 1e-6
        notes.append(f"{calls} kernel calls at {acc.kernel_call_overhead_us:g} us each")
    if ring > 1:
        # r forward steps + r backward steps (at 2x the launches), plus the online-softmax merge, which
        # a single flash-attention call does in registers: per step it reads the block's output and
        # reads+writes the fp32 running output (fwd), and reads+writes fp32 dQ and dK/dV (bwd).
        merge_fwd = batch * ulysses * s * c_max * D * (e + 8)
        merge_bwd = batch * ulysses * s * D * (c_max * 8 + 2 * k_max * (8 + e)) if backward else 0
        launches = 3 if backward else 1
        ring_overhead_s = ring * (launches * overhead + (merge_fwd + merge_bwd) / (acc.hbm_gb_s * 1e9))
    gemm_flops_per_token = (6.0 if backward else 2.0) * model.layer_params  # fwd 2/param, bwd 4/param
    rest_s = gemm_flops_per_token * batch * s / acc.dense_flops
    useful = causal_factor * 4.0 * batch * seq_len * seq_len * D * H * (1 + bwd_factor) * window_share
    model_flops = useful + gemm_flops_per_token * batch * seq_len
    if imbalance > 1:
        notes.append(f"contiguous causal ring: slowest rank does {imbalance:.2f}x the mean attention work")
    if padded > seq_len:
        notes.append(f"padded {seq_len} -> {padded} tokens")

    # --- communication -------------------------------------------------------------------------
    nbytes = comm_bytes(H, Hkv, D, seq_len, batch, ulysses, ring, e, layout, causal=causal, window=window)
    if not backward:
        nbytes.update(ulysses_bwd=0, ring_bwd=0)
    unit = batch * s * D * e
    a2a_s, a2a_link = _a2a_time(cluster, ulysses_groups(world, ulysses, ring, dp), split, unit, backward)
    ring_comm_s = ring_exposed_s = 0.0
    ring_link = "none"
    if ring > 1:
        tier = _ring_tier(cluster, ring_groups(world, ulysses, ring, dp))
        link = cluster.tier_link(tier)
        ring_link = cluster.tier_name(tier)
        bw = _bandwidth(link, dp * ulysses > 1)
        kv_elems = batch * ulysses * s * 2 * k_max * D
        xfer = lambda n: link.latency_us * 1e-6 + n / bw  # noqa: E731
        c_fwd = xfer(kv_elems * e)
        c_bwd = xfer(kv_elems * (e + GRAD_BYTES))  # K/V and the travelling fp32 dK/dV
        c_home = xfer(kv_elems * GRAD_BYTES)  # last dK/dV hop home: nothing left to hide it
        step_fwd, step_bwd = attn_fwd_s / ring, attn_bwd_s / ring
        if halo:  # one exchange of the halo rows, hidden behind the local block; gradients go back after
            h_fwd, h_bwd = xfer(nbytes["ring_fwd"]), xfer(nbytes["ring_bwd"])
            ring_comm_s = h_fwd + (h_bwd if backward else 0.0)
            ring_exposed_s = _exposed(h_fwd, step_fwd, acc.ring_overlap) + (h_bwd if backward else 0.0)
        else:
            ring_comm_s = (ring - 1) * c_fwd
            ring_exposed_s = (ring - 1) * _exposed(c_fwd, step_fwd, acc.ring_overlap)
            if backward:
                ring_comm_s += (ring - 1) * c_bwd + c_home
                ring_exposed_s += (ring - 1) * _exposed(c_bwd, step_bwd, acc.ring_overlap) + c_home

    # --- memory (per rank) ---------------------------------------------------------------------
    us = ulysses * s
    kv_blk = batch * us * 2 * k_max * D
    mem = {
        "model_states": MODEL_STATE_BYTES_PER_PARAM * model.params // world,
        "checkpointed_inputs": model.layers * batch * s * model.d_model * e,
        "attention_local_io": batch * s * (H + 2 * Hkv + H) * D * e,  # q,k,v,out before/after all-to-all
        "attention_heads": batch * us * D * (3 * c_max * e + 2 * k_max * e) + batch * c_max * us * 4,
        "attention_grads_fp32": (batch * us * c_max * D * GRAD_BYTES + kv_blk * GRAD_BYTES) if backward else 0,
        "ring_buffers": (2 * kv_blk * e + 2 * kv_blk * GRAD_BYTES * backward + batch * us * c_max * D * 4)
        if ring > 1
        else 0,
        "mlp_recompute": batch * s * ((3 if model.gated_mlp else 2) * (model.intermediate or 4 * model.d_model)) * e,
    }
    if cluster.calibration is not None:
        parts = _calibrated_parts(cluster.calibration, cluster, world, dp, H, Hkv, D, seq_len, batch, ulysses, ring,
                                  e, layout, causal, backward, dtype)
        attn_fwd_s, attn_bwd_s = parts["kernel_fwd_s"], parts["kernel_bwd_s"]
        ring_overhead_s, a2a_s = parts["fixed_s"] + parts["merge_s"] + parts["copy_s"], parts["a2a_s"]
        ring_comm_s, ring_exposed_s = parts["ring_comm_s"], parts["ring_exposed_s"]
        if window is not None:  # the calibrated kernel and ring terms, for the work and bytes a window keeps
            attn_fwd_s, attn_bwd_s = attn_fwd_s * busiest_share, attn_bwd_s * busiest_share
            full = comm_bytes(H, Hkv, D, seq_len, batch, ulysses, ring, e, layout, causal=causal)
            moved = (nbytes["ring_fwd"] + nbytes["ring_bwd"]) / max(1, full["ring_fwd"] + full["ring_bwd"])
            ring_comm_s, ring_exposed_s = ring_comm_s * moved, ring_exposed_s * moved
        a2a_link = "measured" if ulysses > 1 and a2a_link != "none" else a2a_link
        ring_link = "measured" if ring > 1 else ring_link
        notes += parts["notes"]
    return Estimate(
        ulysses=ulysses, ring=ring, dp=dp, batch=batch, seq_len=seq_len, padded_len=padded, layers=model.layers,
        attention_s=attn_fwd_s + attn_bwd_s, ring_overhead_s=ring_overhead_s, rest_s=rest_s, a2a_s=a2a_s,
        ring_comm_s=ring_comm_s, ring_exposed_s=ring_exposed_s, bytes_per_rank=nbytes,
        memory_bytes=int(sum(mem.values())), memory_breakdown=mem, a2a_link=a2a_link, ring_link=ring_link,
        model_flops=model_flops, peak_flops=acc.peak_tflops * 1e12, notes=tuple(notes),
    )  # fmt: skip



# ---------------------------------------------------------------------------------------------------
# calibrated terms (docs/planner.md, section 4): priced from a Cluster's measured Calibration


def _exposed(comm: float, compute: float, overlap: float) -> float:
    """Transfer time a step cannot hide: all of it beyond the step's compute, and ``1 - overlap`` of
    the part the compute could have hidden (overlap = 1: today's ``max(0, comm - compute)``)."""
    return comm - overlap * min(comm, compute)


def _calibrated_parts(cal: Any, cluster: Cluster | None, world: int, dp: int, H: int, Hkv: int, D: int,
                      seq_len: int, batch: int, ulysses: int, ring: int, e: int, layout: str, causal: bool,
                      backward: bool, dtype: Any, kernels: bool = True) -> dict[str, Any]:
    """One attention call priced with measured rates, term by term (seconds, slowest rank).

    kernel: every kernel call of the slowest ring rank at its real block shape (from the layout's
    step plan) through the fitted ``call overhead + F (1 + tile/Tq) / rate``; fixed: ``3 r`` step
    units (forward 1, backward 2) plus one per-call cost; merge: the online-softmax merge (and the
    backward's fp32 accumulations) at the measured merge rate; copy: the engine's packing copies per
    byte sent; a2a: the measured all-to-all of this ulysses degree (all groups at once); ring: the
    measured neighbour exchange with every rank sending, hidden behind the step's kernels by the
    measured overlap fraction; the last dK/dV hop is always exposed.
    """
    split = head_split(H, Hkv, ulysses)
    c_max, k_max = max(x[0] for x in split), max(x[3] for x in split)
    lay = make_layout(layout, ulysses, ring, seq_len=seq_len)
    s = lay.local_len
    notes: list[str] = []
    name = str(dtype).removeprefix("torch.").lower()
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(name, name)
    fits = {(c, d): cal.kernel_fit(c, d, dtype=name) for c in (True, False) for d in ("fwd", "bwd")}
    if kernels and any(f is not None and f.dtype != name for f in fits.values()):
        notes.append(f"kernel rates for {name} not calibrated; used {cal.dtype}")
    kf = kb = 0.0
    if kernels:
        worst = (0.0, 0.0)
        for j in range(ring):
            tf = tb = 0.0
            for st in range(ring):
                step = lay.step(j, st, causal)
                if step is None:
                    continue
                for _, nq, _, nk in step.pairs:
                    for direction in ("fwd", "bwd") if backward else ("fwd",):
                        fit = fits[(step.causal, direction)]
                        if fit is None:
                            raise ValueError(
                                f"the calibration has no {'causal' if step.causal else 'full'} {direction} kernel fit; "
                                "re-run hybrid-cp calibrate with the kernels stage")
                        t = fit.seconds(nq, nk, batch * c_max, D)
                        if direction == "fwd":
                            tf += t
                        else:
                            tb += t
            if tf + tb > sum(worst):
                worst = (tf, tb)
        kf, kb = worst
    units = ring * (3 if backward else 1)
    fixed = units * cal.step_overhead_us * 1e-6 + cal.call_overhead_us * 1e-6 * (1.0 if backward else 0.5)
    merge_s = 0.0
    if cal.merge is not None:
        t = ulysses * s
        merge_s = ring * cal.merge.seconds(batch * t * c_max * D * (e + 8))
        if backward:
            merge_s += ring * cal.merge.seconds(batch * t * D * (c_max * 8 + 2 * k_max * (8 + e)))
    nbytes = comm_bytes(H, Hkv, D, seq_len, batch, ulysses, ring, e, layout, causal=causal)  # full row; estimate() scales for a window
    if not backward:
        nbytes.update(ulysses_bwd=0, ring_bwd=0)
    sent = sum(nbytes.values())
    copy_s = sent / (cal.copy_gb_s * 1e9) if cal.copy_gb_s else 0.0
    a2a_s = 0.0
    if ulysses > 1:
        fit_u = cal.a2a_fit(ulysses)
        if fit_u is not None:
            a2a_s = 2 * fit_u.link.latency_us * 1e-6 + nbytes["ulysses_fwd"] / (fit_u.link.bandwidth_gb_s * 1e9)
            if backward:
                a2a_s += 2 * fit_u.link.latency_us * 1e-6 + nbytes["ulysses_bwd"] / (fit_u.link.bandwidth_gb_s * 1e9)
        elif cluster is not None:
            unit = batch * s * D * e
            a2a_s = _a2a_time(cluster, ulysses_groups(world, ulysses, ring, dp), split, unit, backward)[0]
            notes.append(f"all-to-all of ulysses={ulysses} not calibrated; priced with the cluster's links")
    ring_comm = ring_exposed = 0.0
    if ring > 1:
        kv_elems = batch * ulysses * s * 2 * k_max * D
        if cal.p2p is not None:
            xfer = cal.p2p.seconds
        elif cluster is not None:
            xfer = cluster.intra_node.transfer_s
            notes.append("ring exchange not calibrated; priced with the cluster's intra_node link")
        else:
            xfer = lambda n: 0.0  # noqa: E731
        c_fwd, c_bwd, c_home = xfer(kv_elems * e), xfer(kv_elems * (e + GRAD_BYTES)), xfer(kv_elems * GRAD_BYTES)
        ring_comm = (ring - 1) * c_fwd
        ring_exposed = (ring - 1) * _exposed(c_fwd, kf / ring, cal.overlap)
        if backward:
            ring_comm += (ring - 1) * c_bwd + c_home
            ring_exposed += (ring - 1) * _exposed(c_bwd, kb / ring, cal.overlap) + c_home
    return {"kernel_fwd_s": kf, "kernel_bwd_s": kb, "fixed_s": fixed, "merge_s": merge_s, "copy_s": copy_s,
            "a2a_s": a2a_s, "ring_comm_s": ring_comm, "ring_exposed_s": ring_exposed, "sent_bytes": sent,
            "notes": notes}


def engine_known_s(cal: Any, ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                   e: int) -> tuple[float, int]:
    """The measured parts of a no-arithmetic engine call (all-to-all, ring exchange, merges) as the
    model prices them, and the bytes it sends; calibration fits the fixed costs to the remainder."""
    p = _calibrated_parts(cal, None, ulysses * ring, 1, heads, kv_heads, head_dim, seq_len, 1, ulysses, ring, e,
                          "zigzag", True, True, e, kernels=False)
    return p["merge_s"] + p["a2a_s"] + p["ring_exposed_s"], p["sent_bytes"]
