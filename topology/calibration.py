"""Measured rates of one machine or cluster, and how they are fitted from timings.

`hybrid-cp calibrate` times the engine's own pieces on every rank (see ``hybrid_cp.bench``): the
attention kernel at the block shapes ring steps use, the online-softmax merge, the all-to-all inside
every candidate ulysses group (all groups at once, and one alone), the ring-neighbour exchange (every
rank at once, and one pair alone), a transfer posted around a kernel call (overlap), and the whole
engine with a kernel that does no arithmetic (fixed costs per call and per ring step, and the
engine's own packing copies). :func:`collect` asks a :class:`RateSource` for those timings in a fixed
order and :func:`fit` turns them into a :class:`Calibration`, which a :class:`~topology.Cluster`
carries in its ``calibration`` field and :func:`topology.estimate` prices with (docs/planner.md,
section 4, "calibrated terms").

This module is torch-free: the real rate source lives in ``hybrid_cp.bench``; tests feed a fake,
deterministic one and check that the fit returns exactly the rates it was fed.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KernelFit", "LinkFit", "A2AFit", "Calibration", "RateSource", "CalibrationSpec", "collect", "fit",
           "kernel_flops", "default_spec", "kernel_grid", "heads_per_call", "PROBE"]

ATTN_BWD_FACTOR = 2.5  # same convention as topology.cost: backward = 2.5x forward FLOPs
_E = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KernelFit(_Strict):
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
    io_ns_per_elem: float = Field(default=0.0, ge=0, description="per element of q and k/v rows x heads x D "
                                  "(loads, GQA expansion): what makes short blocks memory-bound")
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


class LinkFit(_Strict):
    """``latency + bytes / bandwidth``, fitted from timed transfers of several sizes."""

    bandwidth_gb_s: float = Field(gt=0)
    latency_us: float = Field(ge=0)

    def seconds(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)


class A2AFit(_Strict):
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


class Calibration(_Strict):
    """What `hybrid-cp calibrate` measured, in the units the cost model prices with."""

    world: int = Field(ge=1, description="ranks that were measured together")
    backend: str = Field(description="torch.distributed backend (gloo or nccl)")
    device: str = "cpu"
    kernel: str = Field(description="the kernel `auto` resolves to; priced when the user does not say")
    dtype: str = Field(description="dtype the merge/engine figures were measured in")
    head_dim: int = 64
    kernels: list[KernelFit] = Field(default_factory=list)
    merge: LinkFit | None = Field(default=None, description="ring.merge_ by bytes moved (block out + fp32 running out)")
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
        default=None, gt=0, description="time of the reference kernel call (PROBE) with every rank computing, "
        "mean of the start and the end of the calibration: the machine's share per rank when it was calibrated")

    @property
    def p2p_contention(self) -> float:
        """Neighbour-exchange bandwidth of one pair alone over that with every rank sending."""
        if self.p2p is None or self.p2p_alone is None:
            return 1.0
        return self.p2p_alone.bandwidth_gb_s / self.p2p.bandwidth_gb_s

    def kernel_fit(self, causal: bool, direction: str, dtype: str | None = None,
                   backend: str | None = None) -> KernelFit | None:
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
        lines = [f"calibration: {self.world} {self.backend} ranks on {self.device}, kernel {self.kernel} "
                 f"{self.dtype}, {self.seconds:.0f} s ({self.startup_s:.0f} s starting the ranks"
                 + (f"; measuring: {stages} s" if stages else "") + ")"]
        for k in self.kernels:
            lines.append(f"  kernel {k.backend} {k.dtype} {'causal' if k.causal else 'full  '} {k.direction}: "
                         f"{k.tflops * 1e3:8.2f} GFLOP/s per rank, {k.call_overhead_us:7.0f} us per call + "
                         f"{k.head_call_overhead_us:5.0f} us per head, causal tile {k.causal_tile_tokens:5.0f} tokens, "
                         f"io {k.io_ns_per_elem:.2f} ns/elem (fit rms {k.rms_rel_error:.0%}, {k.samples} pts)")
        if self.merge:
            lines.append(f"  merge: {self.merge.bandwidth_gb_s:.2f} GB/s, {self.merge.latency_us:.0f} us")
        lines.append(f"  per ring step {self.step_overhead_us:.0f} us, per call {self.call_overhead_us:.0f} us, "
                     "packing copies " + (f"{self.copy_gb_s:.2f} GB/s" if self.copy_gb_s else "too fast to separate (0 s)")
                     + f", overlap {self.overlap:.2f}")
        for a in self.a2a:
            lines.append(f"  all-to-all u={a.ulysses} ({a.groups} groups at once): {a.link.bandwidth_gb_s:.2f} GB/s, "
                         f"{a.link.latency_us:.0f} us; contention x{a.contention:.2f}")
        if self.p2p:
            lines.append(f"  ring p2p (all ranks at once): {self.p2p.bandwidth_gb_s:.2f} GB/s, {self.p2p.latency_us:.0f} us; "
                         f"contention x{self.p2p_contention:.2f}")
        for item in self.not_measured:
            lines.append(f"  not measured: {item}")
        return "\n".join(lines)


PROBE = (1024, 1024, 2, 1, True)  # (Tq, Tk, heads, kv heads, causal): the reference kernel call, forward


def kernel_flops(tq: int, tk: int, heads: int, head_dim: int, causal: bool, direction: str) -> float:
    """Useful FLOPs of one kernel call (the cost model's convention)."""
    f = 4.0 * tq * tk * head_dim * heads * (0.5 if causal else 1.0)
    return f * (ATTN_BWD_FACTOR if direction == "bwd" else 1.0)


# ------------------------------------------------------------------------------------------------
# what is measured


class RateSource(Protocol):
    """Something that can time the engine's pieces. Every method returns seconds (the slowest rank's
    time, fastest of the repeats). Implemented on real ranks by ``hybrid_cp.bench.TorchRateSource``."""

    def kernel(self, backend: str, dtype: str, causal: bool, tq: int, tk: int, heads: int, kv_heads: int,
               head_dim: int) -> tuple[float, float]:
        """(forward, backward) seconds of one call."""

    def merge(self, tokens: int, heads: int, head_dim: int, dtype: str) -> float: ...

    def a2a(self, ulysses: int, nbytes: int, alone: bool) -> float:
        """One all_to_all_single where each rank sends ``nbytes`` to the others in its group."""

    def p2p(self, nbytes: int, alone: bool) -> float:
        """Batched isend/irecv of ``nbytes`` to the next rank and from the previous one."""

    def overlap(self, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: str, backend: str,
                nbytes: int) -> tuple[float, float, float]:
        """(transfer alone, kernel forward alone, transfer posted around the kernel) seconds."""

    def engine(self, ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
               dtype: str) -> float:
        """`hcp.attention` fwd+bwd (causal, zigzag) with a kernel that does no arithmetic."""


def kernel_grid(head_counts: Iterable[int], lengths: Iterable[int] = (512, 1024, 2048, 4096),
                diagonals: Iterable[int] = (4096, 8192), min_tokens: int = 64) -> list[tuple[int, int, int, bool]]:
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
    return sorted({-(-heads // u) for u in _divisors(world) if u <= heads})


class CalibrationSpec(_Strict):
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
        description="(query tokens, key tokens, query heads, causal) per timed kernel call; KV heads = heads / gqa")
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
        base.update(dtypes=["bfloat16", "float16"], heads=8, kv_heads=2, head_dim=128,
                    kernel_shapes=kernel_grid(heads, (2048, 4096, 8192, 16384), (32768, 131072), min_tokens=1024),
                    merge_tokens=[4096, 16384, 65536], a2a_bytes=[1 << 16, 1 << 20, 1 << 24, 1 << 26],
                    p2p_bytes=[1 << 16, 1 << 20, 1 << 24, 1 << 26], overlap_tokens=8192, overlap_bytes=1 << 25,
                    engine_heads=16, engine_kv_heads=4, engine_lengths=[4096 * world, 16384 * world])
    base.update(overrides)
    return CalibrationSpec(**base)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


Progress = Callable[[str], None]


def collect(source: RateSource, spec: CalibrationSpec, progress: Progress = lambda _msg: None) -> list[dict]:
    """Ask ``source`` for every timing of ``spec``, in a fixed order (all ranks run the same calls).

    A stage that raises is recorded as ``{"kind": "skip", "what": ..., "why": ...}`` and the rest goes
    on, so the calibration can say what it could not measure. Each stage's own run time is recorded as
    ``{"kind": "time", "stage": ..., "seconds": ...}``, so a slow calibration says where the time went.
    """
    out: list[dict] = []

    def stage(name: str, fn: Callable[[], Iterable[dict]], gate: str | None = None) -> None:
        if (gate or name) not in spec.stages:
            if gate is None:
                out.append({"kind": "skip", "what": name, "why": "not requested (--stages)"})
            return
        t0 = time.perf_counter()
        try:
            out.extend(fn())
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out.append({"kind": "skip", "what": name, "why": f"{type(exc).__name__}: {exc}"})
            progress(f"{name}: could not measure ({type(exc).__name__}: {exc})")
        dt = time.perf_counter() - t0
        out.append({"kind": "time", "stage": name, "seconds": dt})
        progress(f"{name}: {dt:.1f} s")

    def kernels() -> Iterable[dict]:
        rows = []
        for backend in spec.backends:
            for dtype in spec.dtypes:
                try:
                    # Passes over all shapes, fastest per shape: each shape's samples are spread over
                    # the whole stage, so a burst of other jobs' load cannot spoil all of them.
                    best: dict[tuple, list[float]] = {}
                    for p in range(spec.kernel_passes):
                        for tq, tk, h, causal in spec.kernel_shapes:
                            kv = max(1, h // spec.gqa) if h % max(1, h // spec.gqa) == 0 else h
                            f, b = source.kernel(backend, dtype, causal, tq, tk, h, kv, spec.head_dim)
                            old = best.get((tq, tk, h, causal), [math.inf, math.inf])
                            best[(tq, tk, h, causal)] = [min(old[0], f), min(old[1], b)]
                        progress(f"kernels {backend} {dtype}: pass {p + 1}/{spec.kernel_passes} over "
                                 f"{len(spec.kernel_shapes)} block shapes")
                    for (tq, tk, h, causal), (f, b) in best.items():
                        for direction, t in (("fwd", f), ("bwd", b)):
                            rows.append({"kind": "kernel", "backend": backend, "dtype": dtype, "causal": causal,
                                         "direction": direction, "tq": tq, "tk": tk, "heads": h,
                                         "head_dim": spec.head_dim, "seconds": t})
                        progress(f"  {'causal' if causal else 'full'} {tq}x{tk} x{h} heads: "
                                 f"fwd {f * 1e3:.1f} ms, bwd {b * 1e3:.1f} ms")
                except (ValueError, TypeError, RuntimeError) as exc:
                    rows.append({"kind": "skip", "what": f"kernel {backend} {dtype}", "why": str(exc)})
                    progress(f"kernel {backend} {dtype}: could not measure ({exc})")
        return rows

    def merge() -> Iterable[dict]:
        rows = [{"kind": "merge", "tokens": t, "heads": spec.heads, "head_dim": spec.head_dim, "dtype": spec.dtypes[0],
                 "seconds": source.merge(t, spec.heads, spec.head_dim, spec.dtypes[0])} for t in spec.merge_tokens]
        progress(f"merge: {len(rows)} sizes")
        return rows

    def a2a() -> Iterable[dict]:
        rows = []
        for u in _divisors(spec.world)[1:]:
            groups = spec.world // u
            for alone in ((False, True) if groups > 1 else (False,)):
                for nbytes in spec.a2a_bytes:
                    rows.append({"kind": "a2a", "ulysses": u, "groups": groups, "alone": alone, "bytes": nbytes,
                                 "seconds": source.a2a(u, nbytes, alone)})
            progress(f"all-to-all ulysses={u}: {groups} group(s) at once" + (" and one alone" if groups > 1 else ""))
        return rows

    def p2p() -> Iterable[dict]:
        if spec.world < 2:
            raise RuntimeError("a ring needs at least 2 ranks")
        rows = [{"kind": "p2p", "alone": alone, "bytes": n, "seconds": source.p2p(n, alone)}
                for alone in (False, True) for n in spec.p2p_bytes]
        progress("ring neighbour exchange: every rank at once and one pair alone")
        return rows

    def overlap() -> Iterable[dict]:
        if spec.world < 2:
            raise RuntimeError("a ring needs at least 2 ranks")
        c, k, both = source.overlap(spec.overlap_tokens, spec.heads, spec.kv_heads, spec.head_dim, spec.dtypes[0],
                                    spec.backends[0], spec.overlap_bytes)
        progress(f"overlap: transfer {c * 1e3:.1f} ms, kernel {k * 1e3:.1f} ms, together {both * 1e3:.1f} ms")
        return [{"kind": "overlap", "comm": c, "compute": k, "both": both}]

    def engine() -> Iterable[dict]:
        rows = []
        for u in _divisors(spec.world):
            if u > spec.engine_heads:
                continue
            r = spec.world // u
            for n in spec.engine_lengths:
                rows.append({"kind": "engine", "ulysses": u, "ring": r, "seq_len": n, "heads": spec.engine_heads,
                             "kv_heads": spec.engine_kv_heads, "head_dim": spec.head_dim, "dtype": spec.dtypes[0],
                             "seconds": source.engine(u, r, n, spec.engine_heads, spec.engine_kv_heads,
                                                      spec.head_dim, spec.dtypes[0])})
            progress(f"engine without arithmetic u={u} r={r}: {len(spec.engine_lengths)} lengths")
        return rows

    def probe() -> Iterable[dict]:
        tq, tk, h, kv, causal = PROBE
        t = min(source.kernel(spec.backends[0], spec.dtypes[0], causal, tq, tk, h, kv, spec.head_dim)[0]
                for _ in range(spec.probe_passes))
        return [{"kind": "probe", "seconds": t}]

    stage("probe", probe, gate="kernels")
    for name, fn in (("kernels", kernels), ("merge", merge), ("a2a", a2a), ("p2p", p2p), ("overlap", overlap),
                     ("engine", engine)):
        stage(name, fn)
    stage("probe", probe, gate="kernels")
    return out


# ------------------------------------------------------------------------------------------------
# fitting


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares by the normal equations, each row and target scaled by 1/y (relative error)."""
    n = len(rows[0])
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for row, t in zip(rows, y):
        w = 1.0 / (t * t) if t > 0 else 1.0
        for i in range(n):
            b[i] += w * row[i] * t
            for j in range(n):
                a[i][j] += w * row[i] * row[j]
    # Gaussian elimination with partial pivoting (n <= 3)
    m = [a[i] + [b[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            raise ValueError("singular fit: too few distinct sizes measured")
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * yv for x, yv in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nonneg_fit(rows: list[list[float]], y: list[float], keep: int = 1) -> list[float]:
    """Least squares with every coefficient >= 0: drop (set to 0) a negative one and refit. The
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


def _merge_bytes(tokens: int, heads: int, head_dim: int, dtype: str) -> int:
    """Bytes one merge moves: the block output in its dtype plus the fp32 running output (read+write).
    The cost model prices ``merge_fwd`` with the same count."""
    return tokens * heads * head_dim * (_E.get(dtype, 4) + 8)


def _fit_kernel(backend: str, dtype: str, causal: bool, direction: Literal["fwd", "bwd"], pts: list[dict],
                skipped: list[str]) -> KernelFit:
    """One kernel's terms by non-negative least squares on relative error.

    Features by priority: the rate, the per-call overhead, the causal tile or (full blocks) the
    per-element IO (on a square causal block F / Tq is proportional to the IO, so one term carries both
    there), then the per-head-per-call overhead when more than one head count was timed (with one, it
    is the per-call overhead again). As many features as the distinct shapes can determine.
    """
    flops = [kernel_flops(p["tq"], p["tk"], p["heads"], p["head_dim"], causal, direction) for p in pts]
    y = [p["seconds"] for p in pts]
    names = ["rate", "call", "tile" if causal else "io"] + (["head"] if len({p["heads"] for p in pts}) > 1 else [])
    names = names[:max(1, len({(p["tq"], p["tk"], p["heads"]) for p in pts}))]
    feats = {"rate": lambda f, p: f, "call": lambda f, p: 1.0, "head": lambda f, p: float(p["heads"]),
             "tile": lambda f, p: f / p["tq"], "io": lambda f, p: float((p["tq"] + p["tk"]) * p["heads"] * p["head_dim"])}
    rows = [[feats[n](f, p) for n in names] for f, p in zip(flops, pts)]
    label = f"kernel {backend} {dtype} {'causal' if causal else 'full'} {direction}"
    try:
        coef = dict(zip(names, _nonneg_fit(rows, y)))
    except ValueError:
        coef = {}
    if coef.get("rate", 0.0) <= 0:
        # too noisy to separate the terms: keep a plain rate (time proportional to FLOPs) and say so
        coef = {"rate": sum(t / f for t, f in zip(y, flops)) / len(y)}
        skipped.append(f"{label}: times did not grow with block size (noise?); only a mean rate was fitted, "
                       "no per-call/per-head/tile/IO terms")
    k = KernelFit(backend=backend, dtype=dtype, causal=causal, direction=direction, tflops=1.0 / coef["rate"] / 1e12,
                  call_overhead_us=coef.get("call", 0.0) * 1e6, head_call_overhead_us=coef.get("head", 0.0) * 1e6,
                  io_ns_per_elem=coef.get("io", 0.0) * 1e9,
                  causal_tile_tokens=coef.get("tile", 0.0) / coef["rate"] if causal else 0.0, samples=len(pts))
    pred = [k.seconds(p["tq"], p["tk"], p["heads"], p["head_dim"]) for p in pts]
    return k.model_copy(update={"rms_rel_error": _rms_rel(pred, y)})


def fit(samples: list[dict], spec: CalibrationSpec, *, backend: str, device: str = "cpu",
        kernel_names: dict[str, str] | None = None, seconds: float = 0.0, startup_s: float = 0.0,
        load: list[float] | None = None) -> Calibration:
    """Fit every term of :class:`Calibration` from :func:`collect`'s samples; say what is missing.

    ``kernel_names`` maps a requested backend ("auto") to the kernel it resolved to ("sdpa").
    """
    names = kernel_names or {}
    skipped = [f"{s['what']}: {s['why']}" for s in samples if s["kind"] == "skip"]
    by_kind: dict[str, list[dict]] = {}
    for s in samples:
        by_kind.setdefault(s["kind"], []).append(s)

    kernels = []
    groups: dict[tuple, list[dict]] = {}
    for s in by_kind.get("kernel", []):
        groups.setdefault((names.get(s["backend"], s["backend"]), s["dtype"], s["causal"], s["direction"]), []).append(s)
    for (kb, dt, causal, direction), pts in sorted(groups.items()):
        kernels.append(_fit_kernel(kb, dt, causal, direction, pts, skipped))

    merge = None
    if by_kind.get("merge"):
        pts = [(_merge_bytes(s["tokens"], s["heads"], s["head_dim"], s["dtype"]), s["seconds"]) for s in by_kind["merge"]]
        try:
            merge = _fit_link(pts)
        except ValueError as exc:
            skipped.append(f"merge: {exc}")

    a2a = []
    for u in sorted({s["ulysses"] for s in by_kind.get("a2a", [])}):
        rows_u = [s for s in by_kind["a2a"] if s["ulysses"] == u]
        try:
            link = _fit_link([(s["bytes"], s["seconds"]) for s in rows_u if not s["alone"]])
            alone_pts = [(s["bytes"], s["seconds"]) for s in rows_u if s["alone"]]
            alone = _fit_link(alone_pts) if alone_pts else None
        except ValueError as exc:
            skipped.append(f"all-to-all u={u}: {exc}")
            continue
        a2a.append(A2AFit(ulysses=u, groups=rows_u[0]["groups"], link=link, alone=alone))

    p2p = p2p_alone = None
    if by_kind.get("p2p"):
        try:
            p2p = _fit_link([(s["bytes"], s["seconds"]) for s in by_kind["p2p"] if not s["alone"]])
            p2p_alone = _fit_link([(s["bytes"], s["seconds"]) for s in by_kind["p2p"] if s["alone"]])
        except ValueError as exc:
            skipped.append(f"ring p2p: {exc}")

    overlap = 1.0
    if by_kind.get("overlap"):
        o = by_kind["overlap"][0]
        hidden = o["comm"] + o["compute"] - o["both"]
        overlap = min(1.0, max(0.0, hidden / max(1e-12, min(o["comm"], o["compute"]))))
    else:
        skipped.append("overlap: not measured; the model assumes a ring transfer hides fully behind compute")

    probes = [s["seconds"] for s in by_kind.get("probe", [])]
    stage_seconds: dict[str, float] = {}
    for s in by_kind.get("time", []):
        stage_seconds[s["stage"]] = stage_seconds.get(s["stage"], 0.0) + s["seconds"]
    main_kernel = names.get(spec.backends[0], spec.backends[0])
    cal = Calibration(world=spec.world, backend=backend, device=device, kernel=main_kernel, dtype=spec.dtypes[0],
                      head_dim=spec.head_dim, kernels=kernels, merge=merge, a2a=a2a, p2p=p2p, p2p_alone=p2p_alone,
                      overlap=overlap, seconds=seconds, load=list(load or []), stage_seconds=stage_seconds,
                      startup_s=startup_s,
                      probe_s=sum(probes) / len(probes) if probes else None)
    step = call = 0.0
    copy = None
    if by_kind.get("engine"):
        from .cost import engine_known_s  # the model's own pricing of the measured parts

        rows, y = [], []
        for s in by_kind["engine"]:
            known, nbytes = engine_known_s(cal, s["ulysses"], s["ring"], s["seq_len"], s["heads"], s["kv_heads"],
                                           s["head_dim"], _E.get(s["dtype"], 4))
            rows.append([3.0 * s["ring"], 1.0, float(nbytes)])
            y.append(max(1e-9, s["seconds"] - known))
        coef = _nonneg_fit(rows, y, keep=0)
        step, call = coef[0] * 1e6, coef[1] * 1e6
        copy = 1.0 / coef[2] / 1e9 if coef[2] > 1e-15 else None  # faster than 1e6 GB/s: not measurable
    else:
        skipped.append("engine fixed costs: not measured; per-step and per-call overheads taken as 0")
    if not kernels:
        skipped.append("kernel rates: none measured; the accelerator's peak x attention_efficiency is used")
    if not a2a and spec.world > 1:
        skipped.append("all-to-all: none measured; the cluster's intra_node link is used")
    skipped.append("rest of the layer (GEMMs): not measured; the accelerator's dense_efficiency is used")
    if spec.world > 1 and "a2a" in spec.stages and len(a2a) < len(_divisors(spec.world)) - 1:
        skipped.append("all-to-all: some ulysses degrees failed to fit")
    return cal.model_copy(update={"step_overhead_us": step, "call_overhead_us": call, "copy_gb_s": copy,
                                  "not_measured": skipped})
