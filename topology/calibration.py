"""How a machine's rates are measured and fitted (the fitted data lives in :mod:`topology.rates`).

`hybrid-cp calibrate` times the engine's own pieces on every rank (see ``hybrid_cp.cli.measure``): the
attention kernel at the block shapes ring steps use, the online-softmax merge, the all-to-all inside
every candidate ulysses group (all groups at once, and one alone), the ring-neighbour exchange (every
rank at once, and one pair alone), a transfer posted around a kernel call (overlap), and the whole
engine with a kernel that does no arithmetic (fixed costs per call and per ring step, and the
engine's own packing copies). :func:`collect` asks a :class:`RateSource` for those timings in a fixed
order and :func:`fit` turns them into a :class:`~topology.rates.Calibration`, which a
:class:`~topology.Cluster` carries in its ``calibration`` field and :func:`topology.estimate` prices
with (docs/planner.md, section 4, "calibrated terms"). The fit uses the cost model's own pricing of
the parts it measured separately (:func:`topology.calibrated.engine_known_s`), so this module sits above
the cost model; the data classes sit below the cluster, which stores them.

This module is torch-free: the real rate source lives in ``hybrid_cp.cli.measure``; tests feed a fake,
deterministic one and check that the fit returns exactly the rates it was fed.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Literal, Protocol

import numpy as np
from pydantic import Field

from .calibrated import engine_known_s
from .placement import divisors
from .rates import PROBE, A2AFit, Calibration, KernelFit, LinkFit, StrictModel, kernel_flops, merge_fwd_bytes
from .units import dtype_bytes

__all__ = [
    "KernelFit",
    "LinkFit",
    "A2AFit",
    "Calibration",
    "RateSource",
    "CalibrationSpec",
    "collect",
    "fit",
    "kernel_flops",
    "default_spec",
    "kernel_grid",
    "heads_per_call",
    "PROBE",
]


# ------------------------------------------------------------------------------------------------
# what is measured


class RateSource(Protocol):
    """Something that can time the engine's pieces. Every method returns seconds (the slowest rank's
    time, fastest of the repeats). Implemented on real ranks by ``hybrid_cp.cli.measure.TorchRateSource``."""

    def kernel(
        self, backend: str, dtype: str, causal: bool, tq: int, tk: int, heads: int, kv_heads: int, head_dim: int
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one call."""

    def merge(self, tokens: int, heads: int, head_dim: int, dtype: str) -> float: ...

    def a2a(self, ulysses: int, nbytes: int, alone: bool) -> float:
        """One all_to_all_single where each rank sends ``nbytes`` to the others in its group."""

    def p2p(self, nbytes: int, alone: bool) -> float:
        """Batched isend/irecv of ``nbytes`` to the next rank and from the previous one."""

    def overlap(
        self, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: str, backend: str, nbytes: int
    ) -> tuple[float, float, float]:
        """(transfer alone, kernel forward alone, transfer posted around the kernel) seconds."""

    def engine(
        self, ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype: str
    ) -> float:
        """`hcp.attention` fwd+bwd (causal, zigzag) with a kernel that does no arithmetic."""


def kernel_grid(
    head_counts: Iterable[int],
    lengths: Iterable[int] = (512, 1024, 2048, 4096),
    diagonals: Iterable[int] = (4096, 8192),
    min_tokens: int = 64,
) -> list[tuple[int, int, int, bool]]:
    """Kernel shapes: a causal T x T and a full T/2 x T block (the zigzag ring's two block kinds) for
    the fewest heads per call at every T in ``lengths``, and for every other head count h at
    ``T = c / h`` for each c in ``diagonals``.

    The candidate splits of one model trade heads for block length (u ulysses ranks: H/u heads per call,
    blocks N/r long, so ``T h`` is the same for all of them), so the other head counts are timed on
    such lines: that is where a per-head cost shows. The lengths of the fewest head count pin the rate
    and the per-call and per-tile (or IO) terms.
    """
    heads = sorted(set(head_counts))
    shapes: list[tuple[int, int, int, bool]] = []
    for t in lengths:
        shapes += [(t, t, heads[0], True), (t // 2, t, heads[0], False)]
    for h in heads[1:]:
        for c in diagonals:
            t = max(min_tokens, c // h)
            shapes += [(t, t, h, True), (t // 2, t, h, False)]
    return shapes


def heads_per_call(world: int, heads: int) -> list[int]:
    """Query heads one kernel call gets for every ulysses degree a world of ``world`` ranks allows."""
    return sorted({-(-heads // u) for u in divisors(world) if u <= heads})


class CalibrationSpec(StrictModel):
    """Which shapes and sizes a calibration times (defaults: 8 CPU ranks, about 40 s of measuring on
    2 quiet cores)."""

    world: int = Field(ge=1)
    backends: list[str] = Field(default_factory=lambda: ["auto"])
    dtypes: list[str] = Field(default_factory=lambda: ["float32"])
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    kernel_shapes: list[tuple[int, int, int, bool]] = Field(
        default_factory=lambda: kernel_grid([1, 2, 4, 8]),
        description="(query tokens, key tokens, query heads, causal) per timed kernel call; KV heads = heads / gqa",
    )
    gqa: int = Field(default=4, ge=1, description="query heads per KV head in the kernel shapes")
    kernel_passes: int = Field(default=3, ge=1, description="passes over all kernel shapes (fastest kept)")
    probe_passes: int = Field(default=2, ge=1)
    merge_tokens: list[int] = Field(default_factory=lambda: [1024, 4096, 16384])
    a2a_bytes: list[int] = Field(default_factory=lambda: [1 << 14, 1 << 20, 1 << 23])
    p2p_bytes: list[int] = Field(default_factory=lambda: [1 << 14, 1 << 20, 1 << 23])
    overlap_tokens: int = 2048
    overlap_bytes: int = 1 << 22
    engine_heads: int = 8
    engine_kv_heads: int = 2
    engine_lengths: list[int] = Field(default_factory=lambda: [512, 2048])
    stages: list[str] = Field(default_factory=lambda: ["kernels", "merge", "a2a", "p2p", "overlap", "engine"])


def default_spec(world: int, device: str = "cpu", **overrides: Any) -> CalibrationSpec:
    """The spec `hybrid-cp calibrate` uses: fp32 on CPU; bf16 (and fp16) and larger blocks on GPUs.
    Kernel shapes cover the heads per call of every ulysses degree of ``world`` ranks for a model of
    ``engine_heads`` query heads (8 on CPU, 32 on GPUs)."""
    base: dict[str, Any] = {"world": world, "kernel_shapes": kernel_grid(heads_per_call(world, 8))}
    if device.startswith("cuda"):
        heads = heads_per_call(world, 32)
        base.update(
            dtypes=["bfloat16", "float16"],
            heads=8,
            kv_heads=2,
            head_dim=128,
            kernel_shapes=kernel_grid(heads, (2048, 4096, 8192, 16384), (32768, 131072), min_tokens=1024),
            merge_tokens=[4096, 16384, 65536],
            a2a_bytes=[1 << 16, 1 << 20, 1 << 24, 1 << 26],
            p2p_bytes=[1 << 16, 1 << 20, 1 << 24, 1 << 26],
            overlap_tokens=8192,
            overlap_bytes=1 << 25,
            engine_heads=16,
            engine_kv_heads=4,
            engine_lengths=[4096 * world, 16384 * world],
        )
    base.update(overrides)
    return CalibrationSpec(**base)


Progress = Callable[[str], None]


def _kv_heads(heads: int, gqa: int) -> int:
    """KV heads of a timed kernel call: ``heads / gqa`` when that divides, else one per query head."""
    kv = max(1, heads // gqa)
    return kv if heads % kv == 0 else heads


def _time_kernels(
    source: RateSource, spec: CalibrationSpec, backend: str, dtype: str, progress: Progress
) -> list[dict]:
    """Every kernel shape of ``spec`` for one (backend, dtype), forward and backward.

    Passes over all shapes, fastest per shape: each shape's samples are spread over the whole stage,
    so a burst of other jobs' load cannot spoil all of them."""
    best: dict[tuple, list[float]] = {}
    for p in range(spec.kernel_passes):
        for tq, tk, h, causal in spec.kernel_shapes:
            f, b = source.kernel(backend, dtype, causal, tq, tk, h, _kv_heads(h, spec.gqa), spec.head_dim)
            old = best.get((tq, tk, h, causal), [math.inf, math.inf])
            best[(tq, tk, h, causal)] = [min(old[0], f), min(old[1], b)]
        progress(
            f"kernels {backend} {dtype}: pass {p + 1}/{spec.kernel_passes} over {len(spec.kernel_shapes)} block shapes"
        )
    rows = []
    for (tq, tk, h, causal), (f, b) in best.items():
        for direction, t in (("fwd", f), ("bwd", b)):
            rows.append(
                {
                    "kind": "kernel",
                    "backend": backend,
                    "dtype": dtype,
                    "causal": causal,
                    "direction": direction,
                    "tq": tq,
                    "tk": tk,
                    "heads": h,
                    "head_dim": spec.head_dim,
                    "seconds": t,
                }
            )
        progress(f"  {'causal' if causal else 'full'} {tq}x{tk} x{h} heads: fwd {f * 1e3:.1f} ms, bwd {b * 1e3:.1f} ms")
    return rows


def _kernels_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    """Kernel timings of every requested backend and dtype; one that cannot run is a skip row."""
    rows = []
    for backend in spec.backends:
        for dtype in spec.dtypes:
            try:
                rows += _time_kernels(source, spec, backend, dtype, progress)
            except (ValueError, TypeError, RuntimeError) as exc:
                rows.append({"kind": "skip", "what": f"kernel {backend} {dtype}", "why": str(exc)})
                progress(f"kernel {backend} {dtype}: could not measure ({exc})")
    return rows


def _merge_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    rows = [
        {
            "kind": "merge",
            "tokens": t,
            "heads": spec.heads,
            "head_dim": spec.head_dim,
            "dtype": spec.dtypes[0],
            "seconds": source.merge(t, spec.heads, spec.head_dim, spec.dtypes[0]),
        }
        for t in spec.merge_tokens
    ]
    progress(f"merge: {len(rows)} sizes")
    return rows


def _a2a_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    rows = []
    for u in divisors(spec.world)[1:]:
        groups = spec.world // u
        for alone in (False, True) if groups > 1 else (False,):
            for nbytes in spec.a2a_bytes:
                rows.append(
                    {
                        "kind": "a2a",
                        "ulysses": u,
                        "groups": groups,
                        "alone": alone,
                        "bytes": nbytes,
                        "seconds": source.a2a(u, nbytes, alone),
                    }
                )
        progress(f"all-to-all ulysses={u}: {groups} group(s) at once" + (" and one alone" if groups > 1 else ""))
    return rows


def _need_ring(spec: CalibrationSpec) -> None:
    if spec.world < 2:
        raise RuntimeError("a ring needs at least 2 ranks")


def _p2p_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    _need_ring(spec)
    rows = [
        {"kind": "p2p", "alone": alone, "bytes": n, "seconds": source.p2p(n, alone)}
        for alone in (False, True)
        for n in spec.p2p_bytes
    ]
    progress("ring neighbour exchange: every rank at once and one pair alone")
    return rows


def _overlap_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    _need_ring(spec)
    c, k, both = source.overlap(
        spec.overlap_tokens,
        spec.heads,
        spec.kv_heads,
        spec.head_dim,
        spec.dtypes[0],
        spec.backends[0],
        spec.overlap_bytes,
    )
    progress(f"overlap: transfer {c * 1e3:.1f} ms, kernel {k * 1e3:.1f} ms, together {both * 1e3:.1f} ms")
    return [{"kind": "overlap", "comm": c, "compute": k, "both": both}]


def _engine_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    rows = []
    for u in divisors(spec.world):
        if u > spec.engine_heads:
            continue
        r = spec.world // u
        for n in spec.engine_lengths:
            rows.append(
                {
                    "kind": "engine",
                    "ulysses": u,
                    "ring": r,
                    "seq_len": n,
                    "heads": spec.engine_heads,
                    "kv_heads": spec.engine_kv_heads,
                    "head_dim": spec.head_dim,
                    "dtype": spec.dtypes[0],
                    "seconds": source.engine(
                        u, r, n, spec.engine_heads, spec.engine_kv_heads, spec.head_dim, spec.dtypes[0]
                    ),
                }
            )
        progress(f"engine without arithmetic u={u} r={r}: {len(spec.engine_lengths)} lengths")
    return rows


def _probe_stage(source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    tq, tk, h, kv, causal = PROBE
    t = min(
        source.kernel(spec.backends[0], spec.dtypes[0], causal, tq, tk, h, kv, spec.head_dim)[0]
        for _ in range(spec.probe_passes)
    )
    return [{"kind": "probe", "seconds": t}]


Stage = Callable[[RateSource, CalibrationSpec, Progress], list[dict]]
# (name, stage, the --stages entry that gates it; None: its own name), in the order they run. The probe
# runs first and last, so the machine's share per rank is taken at both ends of the calibration.
_STAGES: tuple[tuple[str, Stage, str | None], ...] = (
    ("probe", _probe_stage, "kernels"),
    ("kernels", _kernels_stage, None),
    ("merge", _merge_stage, None),
    ("a2a", _a2a_stage, None),
    ("p2p", _p2p_stage, None),
    ("overlap", _overlap_stage, None),
    ("engine", _engine_stage, None),
    ("probe", _probe_stage, "kernels"),
)


def _run_stage(name: str, fn: Stage, source: RateSource, spec: CalibrationSpec, progress: Progress) -> list[dict]:
    """One stage's rows and its own run time; a stage that raises becomes a skip row, not an error."""
    t0 = time.perf_counter()
    try:
        rows = list(fn(source, spec, progress))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        rows = [{"kind": "skip", "what": name, "why": f"{type(exc).__name__}: {exc}"}]
        progress(f"{name}: could not measure ({type(exc).__name__}: {exc})")
    dt = time.perf_counter() - t0
    progress(f"{name}: {dt:.1f} s")
    return rows + [{"kind": "time", "stage": name, "seconds": dt}]


def collect(source: RateSource, spec: CalibrationSpec, progress: Progress = lambda _msg: None) -> list[dict]:
    """Ask ``source`` for every timing of ``spec``, in a fixed order (all ranks run the same calls).

    A stage that raises is recorded as ``{"kind": "skip", "what": ..., "why": ...}`` and the rest goes
    on, so the calibration can say what it could not measure. Each stage's own run time is recorded as
    ``{"kind": "time", "stage": ..., "seconds": ...}``, so a slow calibration says where the time went.
    """
    out: list[dict] = []
    for name, fn, gate in _STAGES:
        if (gate or name) in spec.stages:
            out += _run_stage(name, fn, source, spec, progress)
        elif gate is None:
            out.append({"kind": "skip", "what": name, "why": "not requested (--stages)"})
    return out


# ------------------------------------------------------------------------------------------------
# fitting


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares on relative error: each row and target scaled by 1/y (numpy's SVD solver, on
    columns scaled to unit norm so that FLOP, byte and constant features weigh alike)."""
    a, t = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    w = np.where(t > 0, 1.0 / np.where(t > 0, t, 1.0), 1.0)
    a, t = a * w[:, None], t * w
    norms = np.linalg.norm(a, axis=0)
    if (norms == 0).any():
        raise ValueError("singular fit: too few distinct sizes measured")
    coef, _, rank, _ = np.linalg.lstsq(a / norms, t, rcond=None)
    if rank < a.shape[1]:
        raise ValueError("singular fit: too few distinct sizes measured")
    return [float(c) for c in coef / norms]


def _nonneg_fit(rows: list[list[float]], y: list[float], keep: int = 1) -> list[float]:
    """Least squares with every coefficient >= 0: drop (set to 0) the most negative one and refit. The
    first ``keep`` coefficients (the rates) are never dropped."""
    active = list(range(len(rows[0])))
    while True:
        coef = _lstsq([[r[i] for i in active] for r in rows], y)
        full = [0.0] * len(rows[0])
        for i, c in zip(active, coef):
            full[i] = c
        neg = [i for i in active[keep:] if full[i] < 0]
        if not neg:
            return full
        active.remove(min(neg, key=lambda i: full[i]))


def _rms_rel(pred: list[float], y: list[float]) -> float:
    return math.sqrt(sum(((p - t) / t) ** 2 for p, t in zip(pred, y)) / len(y)) if y else 0.0


def _fit_link(points: list[tuple[float, float]]) -> LinkFit:
    """bytes -> seconds: latency + bytes / bandwidth."""
    if len({b for b, _ in points}) < 2:
        raise ValueError("a link fit needs at least two message sizes")
    inv_bw, lat = _nonneg_fit([[b, 1.0] for b, _ in points], [t for _, t in points])
    if inv_bw <= 0:
        raise ValueError("transfer time did not grow with size; measure larger messages")
    return LinkFit(bandwidth_gb_s=1.0 / inv_bw / 1e9, latency_us=lat * 1e6)


def _fit_kernel(
    backend: str, dtype: str, causal: bool, direction: Literal["fwd", "bwd"], pts: list[dict], skipped: list[str]
) -> KernelFit:
    """One kernel's terms by non-negative least squares on relative error.

    Features by priority: the rate, the per-call overhead, the causal tile or (full blocks) the
    per-element IO (on a square causal block F / Tq is proportional to the IO, so one term carries both
    there), then the per-head-per-call overhead when more than one head count was timed (with one, it
    is the per-call overhead again). As many features as the distinct shapes can determine.
    """
    flops = [kernel_flops(p["tq"], p["tk"], p["heads"], p["head_dim"], causal, direction) for p in pts]
    y = [p["seconds"] for p in pts]
    names = ["rate", "call", "tile" if causal else "io"] + (["head"] if len({p["heads"] for p in pts}) > 1 else [])
    names = names[: max(1, len({(p["tq"], p["tk"], p["heads"]) for p in pts}))]
    feats = {
        "rate": lambda f, p: f,
        "call": lambda f, p: 1.0,
        "head": lambda f, p: float(p["heads"]),
        "tile": lambda f, p: f / p["tq"],
        "io": lambda f, p: float((p["tq"] + p["tk"]) * p["heads"] * p["head_dim"]),
    }
    rows = [[feats[n](f, p) for n in names] for f, p in zip(flops, pts)]
    label = f"kernel {backend} {dtype} {'causal' if causal else 'full'} {direction}"
    try:
        coef = dict(zip(names, _nonneg_fit(rows, y)))
    except ValueError:
        coef = {}
    if coef.get("rate", 0.0) <= 0:
        # too noisy to separate the terms: keep a plain rate (time proportional to FLOPs) and say so
        coef = {"rate": sum(t / f for t, f in zip(y, flops)) / len(y)}
        skipped.append(
            f"{label}: times did not grow with block size (noise?); only a mean rate was fitted, "
            "no per-call/per-head/tile/IO terms"
        )
    k = KernelFit(
        backend=backend,
        dtype=dtype,
        causal=causal,
        direction=direction,
        tflops=1.0 / coef["rate"] / 1e12,
        call_overhead_us=coef.get("call", 0.0) * 1e6,
        head_call_overhead_us=coef.get("head", 0.0) * 1e6,
        io_ns_per_elem=coef.get("io", 0.0) * 1e9,
        causal_tile_tokens=coef.get("tile", 0.0) / coef["rate"] if causal else 0.0,
        samples=len(pts),
    )
    pred = [k.seconds(p["tq"], p["tk"], p["heads"], p["head_dim"]) for p in pts]
    return k.model_copy(update={"rms_rel_error": _rms_rel(pred, y)})


Samples = dict[str, list[dict]]  # collect()'s rows by kind


def _fit_kernels(by_kind: Samples, names: dict[str, str], skipped: list[str]) -> list[KernelFit]:
    """One :class:`KernelFit` per (kernel, dtype, causal, direction) timed."""
    groups: dict[tuple, list[dict]] = {}
    for s in by_kind.get("kernel", []):
        groups.setdefault((names.get(s["backend"], s["backend"]), s["dtype"], s["causal"], s["direction"]), []).append(
            s
        )
    return [
        _fit_kernel(kb, dt, causal, direction, pts, skipped)
        for (kb, dt, causal, direction), pts in sorted(groups.items())
    ]


def _fit_merge(by_kind: Samples, skipped: list[str]) -> LinkFit | None:
    """The merge's rate by bytes moved (the count the cost model prices ``merge_fwd`` with)."""
    if not by_kind.get("merge"):
        return None
    pts = [
        (merge_fwd_bytes(s["tokens"], s["heads"], s["head_dim"], dtype_bytes(s["dtype"])), s["seconds"])
        for s in by_kind["merge"]
    ]
    try:
        return _fit_link(pts)
    except ValueError as exc:
        skipped.append(f"merge: {exc}")
        return None


def _fit_a2a(by_kind: Samples, skipped: list[str]) -> list[A2AFit]:
    """One all-to-all fit per ulysses degree: every group at once, and (when measured) one alone."""
    out = []
    for u in sorted({s["ulysses"] for s in by_kind.get("a2a", [])}):
        rows_u = [s for s in by_kind["a2a"] if s["ulysses"] == u]
        try:
            link = _fit_link([(s["bytes"], s["seconds"]) for s in rows_u if not s["alone"]])
            alone_pts = [(s["bytes"], s["seconds"]) for s in rows_u if s["alone"]]
            alone = _fit_link(alone_pts) if alone_pts else None
        except ValueError as exc:
            skipped.append(f"all-to-all u={u}: {exc}")
            continue
        out.append(A2AFit(ulysses=u, groups=rows_u[0]["groups"], link=link, alone=alone))
    return out


def _fit_p2p(by_kind: Samples, skipped: list[str]) -> tuple[LinkFit | None, LinkFit | None]:
    """The ring-neighbour exchange with every rank sending, and one pair alone."""
    if not by_kind.get("p2p"):
        return None, None
    try:
        return (
            _fit_link([(s["bytes"], s["seconds"]) for s in by_kind["p2p"] if not s["alone"]]),
            _fit_link([(s["bytes"], s["seconds"]) for s in by_kind["p2p"] if s["alone"]]),
        )
    except ValueError as exc:
        skipped.append(f"ring p2p: {exc}")
        return None, None


def _fit_overlap(by_kind: Samples, skipped: list[str]) -> float:
    """Fraction of the shorter of (transfer, kernel) that posting them together hid."""
    if not by_kind.get("overlap"):
        skipped.append("overlap: not measured; the model assumes a ring transfer hides fully behind compute")
        return 1.0
    o = by_kind["overlap"][0]
    hidden = o["comm"] + o["compute"] - o["both"]
    return min(1.0, max(0.0, hidden / max(1e-12, min(o["comm"], o["compute"]))))


def _fit_engine_fixed(cal: Calibration, by_kind: Samples, skipped: list[str]) -> dict[str, Any]:
    """Per-ring-step and per-call overheads and the packing-copy rate: what a no-arithmetic engine call
    costs beyond the parts the model already prices from ``cal`` (:func:`topology.calibrated.engine_known_s`)."""
    if not by_kind.get("engine"):
        skipped.append("engine fixed costs: not measured; per-step and per-call overheads taken as 0")
        return {"step_overhead_us": 0.0, "call_overhead_us": 0.0, "copy_gb_s": None}
    rows, y = [], []
    for s in by_kind["engine"]:
        known, nbytes = engine_known_s(
            cal,
            s["ulysses"],
            s["ring"],
            s["seq_len"],
            s["heads"],
            s["kv_heads"],
            s["head_dim"],
            dtype_bytes(s["dtype"]),
        )
        rows.append([3.0 * s["ring"], 1.0, float(nbytes)])
        y.append(max(1e-9, s["seconds"] - known))
    step, call, per_byte = _nonneg_fit(rows, y, keep=0)
    copy = 1.0 / per_byte / 1e9 if per_byte > 1e-15 else None  # faster than 1e6 GB/s: not measurable
    return {"step_overhead_us": step * 1e6, "call_overhead_us": call * 1e6, "copy_gb_s": copy}


def _unmeasured_notes(spec: CalibrationSpec, kernels: list[KernelFit], a2a: list[A2AFit]) -> list[str]:
    """What the model prices without a measurement, so the user knows which figures are presets."""
    notes = []
    if not kernels:
        notes.append("kernel rates: none measured; the accelerator's peak x attention_efficiency is used")
    if not a2a and spec.world > 1:
        notes.append("all-to-all: none measured; the cluster's intra_node link is used")
    notes.append("rest of the layer (GEMMs): not measured; the accelerator's dense_efficiency is used")
    if spec.world > 1 and "a2a" in spec.stages and len(a2a) < len(divisors(spec.world)) - 1:
        notes.append("all-to-all: some ulysses degrees failed to fit")
    return notes


def fit(
    samples: list[dict],
    spec: CalibrationSpec,
    *,
    backend: str,
    device: str = "cpu",
    kernel_names: dict[str, str] | None = None,
    seconds: float = 0.0,
    startup_s: float = 0.0,
    load: list[float] | None = None,
) -> Calibration:
    """Fit every term of :class:`Calibration` from :func:`collect`'s samples; say what is missing.

    ``kernel_names`` maps a requested backend ("auto") to the kernel it resolved to ("sdpa").
    """
    names = kernel_names or {}
    skipped = [f"{s['what']}: {s['why']}" for s in samples if s["kind"] == "skip"]
    by_kind: Samples = {}
    for s in samples:
        by_kind.setdefault(s["kind"], []).append(s)
    kernels = _fit_kernels(by_kind, names, skipped)
    merge = _fit_merge(by_kind, skipped)
    a2a = _fit_a2a(by_kind, skipped)
    p2p, p2p_alone = _fit_p2p(by_kind, skipped)
    overlap = _fit_overlap(by_kind, skipped)
    probes = [s["seconds"] for s in by_kind.get("probe", [])]
    stage_seconds: dict[str, float] = {}
    for s in by_kind.get("time", []):
        stage_seconds[s["stage"]] = stage_seconds.get(s["stage"], 0.0) + s["seconds"]
    cal = Calibration(
        world=spec.world,
        backend=backend,
        device=device,
        kernel=names.get(spec.backends[0], spec.backends[0]),
        dtype=spec.dtypes[0],
        head_dim=spec.head_dim,
        kernels=kernels,
        merge=merge,
        a2a=a2a,
        p2p=p2p,
        p2p_alone=p2p_alone,
        overlap=overlap,
        seconds=seconds,
        load=list(load or []),
        stage_seconds=stage_seconds,
        startup_s=startup_s,
        probe_s=sum(probes) / len(probes) if probes else None,
    )
    fixed = _fit_engine_fixed(cal, by_kind, skipped)
    return cal.model_copy(update={**fixed, "not_measured": skipped + _unmeasured_notes(spec, kernels, a2a)})
