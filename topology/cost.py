"""Time of one transformer layer under a (ulysses, ring, dp) split: the cost model's estimate.

All per layer, forward + backward:

* **Time** (:func:`estimate`): a latency-bandwidth model per link tier (socket / node / NVLink domain /
  fabric), attention FLOPs at the accelerator's achievable rate, ring transfers overlapped with the
  ring step they feed, and the rest of the layer's GEMMs; a cluster's calibration replaces the analytic
  terms with measured ones (`topology.calibrated`); hybrid models' linear layers from `topology.linear_cost`.
* **Bytes** are `topology.traffic`'s (:func:`comm_bytes`, re-exported here), the model's shape
  `topology.model_shape`'s (:class:`ModelShape`).
* **Memory** is not here: :mod:`topology.step_model` prices the training step's peak, and the planner checks
  each split with it.

Conventions (documented in docs/planner.md): causal attention forward costs ``0.5 * 4 * N^2 * D * H``
FLOPs per sequence (half of the dense ``4 N^2 D H``); backward costs 2.5x forward (FlashAttention's
5 vs 2 matmuls); the rest of the layer costs ``6 * params_per_layer`` FLOPs per token (fwd + bwd).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .calibrated import calibrated_times, engine_known_s
from .call_shape import CallShape, LayerTimes, exposed_s, streamed_ring_s
from .cluster import Cluster
from .heads import head_split
from .linear_cost import (
    LINEAR_BWD_FACTOR,
    exporting_runs,
    linear_flops_per_token,
    linear_kernel_bytes,
    linear_layer_bytes,
    linear_mixer_saved,
    linear_mixer_token_bytes,
    linear_runs,
    linear_summary_bytes,
    linear_tokens,
)
from .masks import AttnMask
from .model_shape import MODEL_PRESETS, ModelShape
from .placement import PlacementError, ring_groups, ulysses_groups
from .rates import ATTN_BWD_FACTOR
from .split import Split
from .summary_scan import exchange_kind, summary_scan
from .traffic import a2a_time, bandwidth, comm_bytes, ring_tier
from .units import FP32_BYTES, dtype_bytes

# Re-exported for `from topology.cost import ...`: the shape, the bytes and the linear-layer terms that used
# to live here.
__all__ = [
    "ModelShape",
    "Estimate",
    "comm_bytes",
    "estimate",
    "dtype_bytes",
    "head_split",
    "MODEL_PRESETS",
    "engine_known_s",
    "exporting_runs",
    "linear_layer_bytes",
    "linear_flops_per_token",
    "linear_summary_bytes",
    "linear_runs",
    "linear_kernel_bytes",
    "linear_mixer_token_bytes",
    "linear_mixer_saved",
]

Layout = Literal["zigzag", "contiguous"]


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one layer (forward + backward) for ``batch`` sequences per CP group.

    ``time_s`` = ``compute_s + a2a_s + ring_exposed_s``; ``compute_s`` = attention kernels + ring step
    overheads + the rest of the layer. ``bytes_per_rank`` is the :func:`comm_bytes` dict (worst
    ulysses rank); ``total_bytes`` its sum. Memory is the planner's (``Plan.memory``, ``topology.step_model``).
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


_MODEL_WINDOW: Any = "model"  # estimate's default window: the model's sliding_window / window_layers mix


def estimate(  # noqa: PLR0913 (public entry point)
    cluster: Cluster,
    model: ModelShape,
    seq_len: int,
    ulysses: int,
    ring: int,
    dp: int = 1,
    batch: int = 1,
    *,
    dtype: Any = "bf16",
    layout: Layout | None = None,
    causal: bool | None = None,
    backward: bool = True,
    window: int | None = _MODEL_WINDOW,
    chunk_size: int | None = None,
    attention_forwards: int = 1,
    mask: AttnMask | None = None,
) -> Estimate:
    """Predict time and bytes of one layer for ``batch`` sequences of ``seq_len`` per CP group.

    Uses ranks ``0 .. dp*ulysses*ring - 1`` of ``cluster``, ulysses innermost. By default a model with
    windowed or chunked layers is priced as its average layer; ``window=`` or ``chunk_size=`` prices one
    such layer instead. Memory is :func:`topology.step_model.step_memory`'s, not this (docs/planner.md,
    "Cost model").

    Args:
        cluster: The cluster.
        model: The model's shape.
        seq_len: Tokens per sequence.
        ulysses: The ulysses degree.
        ring: The ring degree.
        dp: The data-parallel degree.
        batch: Sequences per CP group.
        dtype: The compute dtype.
        layout: "zigzag" (None: the default) or "contiguous".
        causal: Causal attention (None: True).
        backward: Price backward too; False: a forward pass only (inference).
        window: A sliding window W for one layer, None for none; "model": the model's own layers.
        chunk_size: An attention chunk size for one layer.
        attention_forwards: Attention forward passes per layer and step (2 with activation checkpointing).
        mask: The row's attention mask (`topology.masks.AttnMask`), priced on its balanced layout;
            ``seq_len`` must be its length.

    Returns:
        Time and bytes of one layer, by stage.

    Raises:
        ValueError: ``mask`` with ``layout``, ``causal`` or ``chunk_size``, a mask of another length than
            ``seq_len``, or a model with chunked or linear layers under a mask and the model's windows.
    """
    _check_mask(mask, seq_len, layout=layout, causal=causal, chunk_size=chunk_size)
    layout, causal = layout or "zigzag", True if causal is None else causal
    if backward and attention_forwards > 1:
        kw: dict[str, Any] = dict(
            dtype=dtype,
            layout=None if mask is not None else layout,
            window=window,
            causal=None if mask is not None else causal,
            chunk_size=chunk_size,
            mask=mask,
        )
        return _recomputed(
            estimate(cluster, model, seq_len, ulysses, ring, dp, batch, **kw),
            estimate(cluster, model, seq_len, ulysses, ring, dp, batch, backward=False, **kw),
            attention_forwards - 1,
        )
    if not isinstance(attention_forwards, int) or attention_forwards < 1 or (attention_forwards > 1 and not backward):
        raise ValueError(f"attention_forwards={attention_forwards!r} must be an integer >= 1 (1 without backward)")
    split = Split(seq_len, ulysses, ring, dp, batch, dtype, layout)
    kw: dict[str, Any] = dict(causal=causal, backward=backward, mask=mask)
    if window is not _MODEL_WINDOW or chunk_size is not None:
        window = None if window is _MODEL_WINDOW else window
        return _one_layer(cluster, model, split, window=window, chunk_size=chunk_size, **kw)
    return _model_layers(cluster, model, split, causal=causal, backward=backward, mask=mask)


def _model_layers(
    cluster: Cluster, model: ModelShape, split: Split, *, causal: bool, backward: bool, mask: AttnMask | None
) -> Estimate:
    """:func:`estimate` with the model's own windows: each kind of layer priced alone, then averaged."""
    kinds = _layer_kinds(model, split.seq_len, causal)
    if mask is not None and (model.linear_layers or any(c is not None for _, _, c, _ in kinds)):
        what = "linear layers" if model.linear_layers else f"attention_chunk_size={model.attention_chunk_size}"
        raise ValueError(
            f"mask= with a model that has {what}: the mask prices attention layers only; pass "
            f"window=None (or window=W) to price one masked attention layer"
        )
    kw: dict[str, Any] = dict(causal=causal, backward=backward)
    layers = [
        (n, _one_layer(cluster, model, split, window=w, chunk_size=c, mask=mask, **kw), what) for n, w, c, what in kinds
    ]
    if model.linear_layers:
        layers.append(
            (model.linear_layers, _linear_layer(cluster, model, split, **kw), f"are linear ({model.linear_kind})")
        )
    if len(layers) == 1:
        return layers[0][1]
    note = (
        ", ".join(f"{n} of {model.layers} layers {what}" for n, _, what in layers)
        + "; the figures are the average layer"
    )
    avg = _average_layer([(n / model.layers, est) for n, est, _ in layers], note)
    return replace(avg, linear_share=model.linear_layers / model.layers)


def _check_mask(mask: Any, seq_len: int, **replaced: Any) -> None:
    """Raise ValueError unless ``mask`` is None or an `AttnMask` of ``seq_len`` tokens given without the
    arguments it replaces (``replaced``: layout, causal, chunk_size, None when not given)."""
    if mask is None:
        return
    if not isinstance(mask, AttnMask):
        raise ValueError(
            f"mask={mask!r} must be a topology.masks.AttnMask (AttnMask.documents, blocks, prefix_lm, "
            f"shared_prefix or from_slices) or None"
        )
    for name, value in replaced.items():
        if value is not None:
            raise ValueError(
                f"{name}={value!r} with mask=: the mask says which keys each query sees and where the "
                f"row's tokens go; drop {name} (build it into the mask, e.g. "
                f"AttnMask.documents(cu_seqlens, causal=..., chunk_size=...))"
            )
    if mask.seq_len != seq_len:
        raise ValueError(
            f"seq_len={seq_len} but the mask covers mask.seq_len={mask.seq_len} tokens; pass seq_len=mask.seq_len"
        )


def _recomputed(step: Estimate, forward: Estimate, extra: int) -> Estimate:
    """``step`` (forward + backward) with ``extra`` more attention forwards (``forward``'s attention-side
    terms: kernels, ring steps, all-to-all, ring transfers); the rest of the layer and the useful FLOPs stay."""
    terms = ("attention_s", "ring_overhead_s", "a2a_s", "ring_comm_s", "ring_exposed_s", "linear_s", "linear_comm_s")
    return replace(
        step,
        **{f: getattr(step, f) + extra * getattr(forward, f) for f in terms},
        notes=step.notes + (f"{1 + extra} attention forwards per layer (recomputation)",),
    )


def _layer_kinds(model: ModelShape, seq_len: int, causal: bool) -> list[tuple[int, Any, Any, str]]:
    """(layer count, window, chunk size, description) of each kind of layer the model has, those with
    layers: window layers, chunked layers, full-attention layers (a window or chunk reaching the whole
    sequence is full attention)."""
    window = model.sliding_window if causal and (model.sliding_window or 0) < seq_len else None
    chunk = model.attention_chunk_size if (model.attention_chunk_size or 0) < seq_len else None
    n_attn = model.attention_layers
    n_win = 0 if window is None else n_attn if model.window_layers is None else model.window_layers
    n_chunk = 0 if chunk is None else n_attn if model.chunked_layers is None else model.chunked_layers
    kinds = [
        (n_win, window, None, f"use the {window}-token window"),
        (n_chunk, None, chunk, f"attend in {chunk}-token chunks"),
        (n_attn - n_win - n_chunk, None, None, "attend in full"),
    ]
    return [kind for kind in kinds if kind[0] > 0]


def _average_layer(layers: list[tuple[float, Estimate]], note: str) -> Estimate:
    """A model with several kinds of layer (``layers``: each kind's share of the layers and its estimate):
    times, FLOPs and bytes averaged over its layers."""
    times = (
        "attention_s",
        "ring_overhead_s",
        "rest_s",
        "a2a_s",
        "ring_comm_s",
        "ring_exposed_s",
        "model_flops",
        "linear_s",
        "linear_comm_s",
    )
    first = layers[0][1]
    keys = dict.fromkeys(k for _, e in layers for k in e.bytes_per_rank)
    return replace(
        first,
        **{f: sum(share * getattr(e, f) for share, e in layers) for f in times},
        bytes_per_rank={k: round(sum(share * e.bytes_per_rank.get(k, 0) for share, e in layers)) for k in keys},
        notes=first.notes + (note,),
    )


def _one_layer(
    cluster: Cluster,
    model: ModelShape,
    split: Split,
    *,
    causal: bool,
    backward: bool,
    window: Any,
    chunk_size: int | None = None,
    mask: AttnMask | None = None,
) -> Estimate:
    """:func:`estimate` of one layer with ``window`` (or none), or under ``mask`` narrowed by ``window``:
    the analytic terms, then the measured ones where the cluster carries a calibration."""
    split.check()
    call = CallShape.of(model, split, causal, backward, None if mask is None else mask.windowed(window))
    ulysses, ring, dp, batch, seq_len = split.ulysses, split.ring, split.dp, split.batch, split.seq_len
    if call.world > cluster.world_size:
        raise PlacementError(
            f"dp*ring*ulysses = {dp}*{ring}*{ulysses} = {call.world} ranks, but cluster {cluster.name!r} has "
            f"{cluster.world_size} GPUs ({cluster.nodes} x {cluster.gpus_per_node})"
        )
    lay, acc = call.lay, cluster.accelerator
    if call.mask is not None:  # the mask holds the window; its plan is priced step by step (_mask_kernel_s)
        window = chunk = None
        halo = lay.halo(False, None, None, call.mask)
        busiest_share, window_share = 1.0, call.mask.cells() / seq_len**2
    else:
        window, chunk = lay.effective_window(causal, window), lay.effective_chunk(chunk_size)
        halo = lay.halo(causal, window, chunk)
        busiest_share, window_share = _window_shares(lay, causal, window, chunk)
    nbytes = call.sent_bytes(window, chunk)
    times = _analytic_times(cluster, call, busiest_share, nbytes, halo)
    notes = _analytic_notes(call, acc, window, halo)
    if chunk is not None:
        notes.append(
            f"{chunk}-token attention chunks: blocks in other chunks are skipped"
            + ("; only the halo rows are exchanged" if halo else "")
        )
    if cluster.calibration is not None:
        times, measured_notes = calibrated_times(
            cluster, call, split.dtype, window, busiest_share, nbytes, times, chunk
        )
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


def _kernel_s(call: CallShape, acc: Any, busiest_share: float) -> tuple[float, float]:
    """Attention kernels of the busiest rank, forward and backward: its FLOPs (padding, the layout's
    own imbalance and the window's share included) at the accelerator's attention rate, plus the
    fixed cost of each kernel call (r forward, r backward), which makes r smaller blocks cost more
    than one large block of the same FLOPs. Under a mask: :func:`_mask_kernel_s`."""
    if call.mask is not None:
        return _mask_kernel_s(call, acc)
    lay, c_max = call.lay, call.busiest_heads[0]
    padded, imbalance = lay.padded_len, lay.work_imbalance(call.causal)
    flops = (
        _causal_factor(call.causal)
        * 4.0
        * call.batch
        * padded
        * (padded / call.ring)
        * call.head_dim
        * c_max
        * imbalance
    ) * busiest_share
    fwd = flops / acc.attention_flops
    bwd = _bwd_factor(call.backward) * fwd
    if acc.kernel_call_overhead_us:
        fwd += call.ring * acc.kernel_call_overhead_us * 1e-6
        bwd += (call.ring if call.backward else 0) * acc.kernel_call_overhead_us * 1e-6
    return fwd, bwd


def _mask_kernel_s(call: CallShape, acc: Any) -> tuple[float, float]:
    """Attention kernels under a mask, forward and backward, from the block plan the engine runs
    (`CallShape.mask_plan`): at each ring step every rank computes its visible cells at the attention
    rate and pays each of its kernel calls; the lock-step ring waits for the busiest rank at that step,
    so the steps' maxima add up (an imbalance no per-rank total shows)."""
    cells, calls = call.mask_plan()
    per_cell = 4.0 * call.batch * call.head_dim * call.busiest_heads[0] / acc.attention_flops
    per_call = acc.kernel_call_overhead_us * 1e-6
    bwd_cell = _bwd_factor(call.backward) * per_cell
    bwd_call = per_call if call.backward else 0.0
    r = call.ring
    fwd = sum(max(per_cell * cells[j][s] + per_call * calls[j][s] for j in range(r)) for s in range(r))
    bwd = sum(max(bwd_cell * cells[j][s] + bwd_call * calls[j][s] for j in range(r)) for s in range(r))
    return fwd, bwd


def _ring_overhead_s(call: CallShape, acc: Any) -> float:
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


def _rest_s(call: CallShape, model: ModelShape, acc: Any) -> float:
    """The layer's GEMMs on the rank's local tokens at the accelerator's dense rate."""
    return _gemm_flops_per_token(model, call.backward) * call.batch * call.lay.local_len / acc.dense_flops


def _model_flops(call: CallShape, model: ModelShape, window_share: float) -> float:
    """Useful FLOPs of one layer for the whole CP group: no padding, the window's share of attention."""
    useful = (
        _causal_factor(call.causal)
        * 4.0
        * call.batch
        * call.seq_len
        * call.seq_len
        * call.head_dim
        * call.heads
        * (1 + _bwd_factor(call.backward))
        * window_share
    )
    return useful + _gemm_flops_per_token(model, call.backward) * call.batch * call.seq_len


def _ring_comm_s(
    cluster: Cluster, call: CallShape, nbytes: dict[str, int], halo: bool, step_fwd_s: float, step_bwd_s: float
) -> tuple[float, float, str]:
    """(transfer, exposed, link name) of the ring over its slowest neighbour hop. With a halo, one
    exchange of the rows peers read, hidden behind the local block; the gradients go back after."""
    if call.ring == 1:
        return 0.0, 0.0, "none"
    tier = ring_tier(cluster, ring_groups(call.world, call.ulysses, call.ring, call.dp))
    link = cluster.tier_link(tier)
    bw = bandwidth(link, call.dp * call.ulysses > 1)
    xfer = lambda n: link.latency_us * 1e-6 + n / bw  # noqa: E731
    overlap = cluster.accelerator.ring_overlap
    if not halo:
        return (*streamed_ring_s(xfer, call, step_fwd_s, step_bwd_s, overlap), cluster.tier_name(tier))
    h_fwd, h_bwd = (
        xfer(nbytes[k]) if nbytes[k] else 0.0 for k in ("ring_fwd", "ring_bwd")
    )  # nothing read: no exchange
    back = h_bwd if call.backward else 0.0
    return h_fwd + back, exposed_s(h_fwd, step_fwd_s, overlap) + back, cluster.tier_name(tier)


def _analytic_times(
    cluster: Cluster, call: CallShape, busiest_share: float, nbytes: dict[str, int], halo: bool
) -> LayerTimes:
    acc = cluster.accelerator
    kernel_fwd, kernel_bwd = _kernel_s(call, acc, busiest_share)
    groups = ulysses_groups(call.world, call.ulysses, call.ring, call.dp)
    a2a_s, a2a_link = a2a_time(cluster, groups, call.heads_per_rank, call.a2a_unit, call.backward)
    ring_comm, ring_exposed, ring_link = _ring_comm_s(
        cluster, call, nbytes, halo, kernel_fwd / call.ring, kernel_bwd / call.ring
    )
    return LayerTimes(
        kernel_fwd, kernel_bwd, _ring_overhead_s(call, acc), a2a_s, a2a_link, ring_comm, ring_exposed, ring_link
    )


def _analytic_notes(call: CallShape, acc: Any, window: Any, halo: bool) -> list[str]:
    """What the analytic terms assumed that a reader of the plan should know."""
    lay, notes = call.lay, []
    if call.mask is not None:
        notes += _mask_notes(call, halo)
    if window is not None:
        notes.append(
            f"{window}-token window: blocks it does not reach are skipped"
            + ("; only the halo rows are exchanged" if halo else "")
        )
    if acc.kernel_call_overhead_us:
        n = sum(map(sum, call.mask_plan()[1])) // call.ring if call.mask is not None else call.ring
        notes.append(
            f"{n * (2 if call.backward else 1)} kernel calls{' (mean rank)' if call.mask is not None else ''}"
            f" at {acc.kernel_call_overhead_us:g} us each"
        )
    if (imbalance := lay.work_imbalance(call.causal)) > 1:
        notes.append(f"contiguous causal ring: slowest rank does {imbalance:.2f}x the mean attention work")
    if lay.padded_len > call.seq_len:
        notes.append(f"padded {call.seq_len} -> {lay.padded_len} tokens")
    return notes


def _mask_notes(call: CallShape, halo: bool) -> list[str]:
    """What a masked call's plan does: its share of the dense row, and how far the lock-step ring sits
    above a perfectly balanced one."""
    cells = call.mask_plan()[0]
    total, r = sum(map(sum, cells)), call.ring
    lock = sum(max(cells[j][s] for j in range(r)) for s in range(r))
    return [
        f"mask: {total:,} visible cells ({total / call.seq_len**2:.1%} of the dense row) on its balanced layout; "
        f"the lock-step ring does {lock * r / max(total, 1):.2f}x the mean rank's work"
        + ("; only the halo rows are exchanged" if halo else "")
    ]


# ---------------------------------------------------------------------------------------------------
# calibrated terms (docs/planner.md, section 4): priced from a Cluster's measured Calibration


def _linear_compute_s(call: CallShape, model: ModelShape, acc: Any) -> float:
    """The busiest rank's recurrence and convolution kernels at the dense rate (the chunked kernels are
    GEMMs of C x d tiles; real kernels reach less, uncalibrated), forward and backward."""
    f0, f1 = linear_flops_per_token(model, False), linear_flops_per_token(model, True)
    worst = max(p * f0 + q * f1 for p, q in linear_tokens(call.lay, call.ulysses * call.ring))
    return worst * call.batch * (1 + (LINEAR_BWD_FACTOR if call.backward else 0)) / acc.dense_flops


def _linear_comm_s(cluster: Cluster, call: CallShape, model: ModelShape, nbytes: dict[str, int]) -> tuple[float, str]:
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
    bw = bandwidth(link, call.dp > 1)
    fwd = nbytes.get("linear_state_fwd", 0) + nbytes.get("linear_halo_fwd", 0)
    bwd = nbytes.get("linear_state_bwd", 0) + nbytes.get("linear_halo_bwd", 0) if call.backward else 0
    hops = (len(summary_scan(lay, size).rounds) if scan else size - 1) * (2 if call.backward else 1)
    return hops * link.latency_us * 1e-6 + (fwd + bwd) / bw, cluster.tier_name(tier)


def _linear_layer(cluster: Cluster, model: ModelShape, split: Split, *, causal: bool, backward: bool) -> Estimate:
    """One linear layer (docs/linear.md): no all-to-all and no ring; local chunked recurrence on the
    rank's shard (the probe's wider values on continuing runs), one summary exchange, the layer's GEMMs."""
    split.check()
    call = CallShape.of(model, split, causal, backward)
    ulysses, ring, dp, batch, seq_len = split.ulysses, split.ring, split.dp, split.batch, split.seq_len
    if call.world > cluster.world_size:
        raise PlacementError(
            f"dp*ring*ulysses = {call.world} ranks, but cluster {cluster.name!r} has {cluster.world_size} GPUs"
        )
    lay, acc, size = call.lay, cluster.accelerator, ulysses * ring
    nbytes = linear_layer_bytes(
        lay,
        size,
        batch,
        model.linear_state_numel,
        model.linear_conv - 1,
        model.linear_conv_channels,
        call.e,
        max(FP32_BYTES, call.e),
        transition_numel=model.linear_transition_numel,
    )
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
