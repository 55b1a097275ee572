"""What `hybrid-cp bench` and `hybrid-cp calibrate` measure, on every rank.

Everything here times the engine through its public entry points (`init_cp_mesh`, `shard`,
`attention`, the kernels' `forward`/`backward`, `kernels.merge.merge_`) so that what the planner is
calibrated on is what a user runs. Each task function runs on every rank (a `WorkerPool` task
"hybrid_cp.cli.measure:NAME", or directly under torchrun) and returns plain Python data; the parent
combines ranks. Timings are taken between barriers and reported per repeat as the slowest rank,
because a collective-bound step finishes when its slowest rank does; compute that no collective
ends (a calibration's kernel calls and merges) is timed as the group's span instead.
"""

from __future__ import annotations

import math
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

import hybrid_cp as hcp
from hybrid_cp.engine.kernels import get_kernel
from hybrid_cp.engine.spec import AttentionSpec

__all__ = ["NullKernel", "TorchRateSource", "bench_rank", "measure_rank", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

_MESHES: dict[tuple, Any] = {}


def _mesh(u: int, r: int, dp: int | None = None, layout: str = "zigzag") -> Any:
    """Meshes are cached per process: building one creates process groups, which must not repeat."""
    key = (u, r, dp, layout)
    if key not in _MESHES:
        _MESHES[key] = hcp.init_cp_mesh(u, r, dp=dp, layout=layout)
    return _MESHES[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slowest(seconds: float) -> float:
    """The slowest rank's time (all ranks call this the same number of times)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def ping() -> int:
    """A task that returns at once: the ranks are up and joined."""
    return dist.get_rank()


class NullKernel:
    """A kernel that does no arithmetic: the engine's cost without attention compute.

    `hcp.attention(..., backend=NullKernel())` still runs the all-to-alls, the layout permutes,
    the ring exchange, the merges and the autograd plumbing, so its time is the engine's overhead
    at that shape. The lse is 0 (not -inf) so that the merge takes its normal path.
    """

    name = "null"

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        return None

    def forward(self, q, k, v, *, causal: bool, scale: float):
        return q.new_zeros(q.shape), q.new_zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)


def _inputs(n: int, h: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, hh, d, generator=g).to(device=device, dtype=dtype) for hh in (h, hkv, hkv, h)]


def _time_attention(
    cp: Any, spec: AttentionSpec, h: int, hkv: int, d: int, dtype: torch.dtype, repeats: int, warmup: int
) -> tuple[list[float], dict[str, int]]:
    """Per repeat, the slowest rank's time of one attention forward + backward over `spec.seq_len` tokens
    (`spec.causal`, `spec.backend`)."""
    device = cp.device
    q, k, v, dout = _inputs(spec.seq_len, h, hkv, d, dtype, device)
    ql, kl, vl = (hcp.shard(x, cp).requires_grad_() for x in (q, k, v))
    dl = hcp.shard(dout, cp)
    times = []
    for i in range(warmup + repeats):
        for x in (ql, kl, vl):
            x.grad = None
        hcp.reset_comm_bytes(cp)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = hcp.attention(ql, kl, vl, cp, causal=spec.causal, backend=spec.backend, seq_len=spec.seq_len)
        out.backward(dl)
        _sync(device)
        t = _slowest(time.perf_counter() - t0)
        if i >= warmup:
            times.append(t)
    return times, hcp.comm_bytes(cp)


def bench_rank(  # noqa: PLR0913 (public entry point)
    ulysses: int,
    ring: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool = True,
    dtype: str = "float32",
    repeats: int = 5,
    warmup: int = 1,
    backend: str = "auto",
    layout: str = "zigzag",
) -> dict[str, Any]:
    """`hybrid-cp bench` on one rank: slowest-rank time of each repeat, and this rank's bytes."""
    world = dist.get_world_size()
    cp = _mesh(ulysses, ring, world // (ulysses * ring), layout)
    source = TorchRateSource(repeats=3)
    probe = [_probe(source, backend, dtype)]
    spec = AttentionSpec(causal=causal, backend=backend, seq_len=seq_len)
    times, nbytes = _time_attention(cp, spec, heads, kv_heads, head_dim, DTYPES[dtype], repeats, warmup)
    probe.append(_probe(source, backend, dtype))
    kernel = get_kernel(backend, cp.device, DTYPES[dtype], head_dim)
    return {
        "rank": dist.get_rank(),
        "times": times,
        "bytes": nbytes,
        "kernel": kernel.name,
        "device": str(cp.device),
        "probe_s": sum(probe) / 2,
    }


def _probe(source: "TorchRateSource", backend: str, dtype: str) -> float:
    """The calibration's reference kernel call, timed now: how much of the machine each rank gets."""
    from topology.calibration import PROBE

    tq, tk, h, kv, causal = PROBE
    return min(source.kernel(backend, dtype, causal, tq, tk, h, kv, 64)[0] for _ in range(3))


# ------------------------------------------------------------------------------------------------
# calibration measurements (topology.calibration.collect decides what is timed, and fits it)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


class TorchRateSource:
    """Times the engine's pieces on this rank; every rank must make the same calls in the same order
    (each timing ends in a collective). Implements ``topology.calibration.RateSource``."""

    def __init__(self, repeats: int = 3, min_kernel_flops: float = 2.5e8):
        self.repeats = repeats
        self.min_kernel_flops = min_kernel_flops
        self.device = _device()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.kernel_names: dict[str, str] = {}
        self._seen: set[tuple] = set()
        hosts: list[Any] = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname())
        self.one_host = len(set(hosts)) == 1

    def _span(self, t0: float, t1: float) -> float:
        """Seconds from the first rank's start to the last rank's end when all ranks share a clock (one
        host: ``perf_counter`` is the system-wide monotonic clock), else the slowest rank's own time.

        Ranks sharing cores may run one after another: each rank's own time is then short although the
        group needed the whole span; inside the engine a ring step ends with a collective, so the span
        is what a step costs."""
        if not self.one_host:
            return _slowest(t1 - t0)
        t = torch.tensor([t1, -t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0] + t[1])

    def _timeit(self, fn, repeats: int | None = None, warm: bool = True, span: bool = False) -> float:
        """Fastest over repeats of the slowest rank's time of `fn()` started together on all ranks; with
        ``span``, of the group's time (:meth:`_span`: for compute, which no collective synchronizes).

        The minimum, not the median: on a machine shared with other jobs a load spike during one
        repeat would bend the fitted curve; the minimum is this job's rate at its fair share, and
        the reference probe (``bench`` times it too) measures how far a later run is from that."""
        if warm:
            fn()  # warm-up
        times = []
        for _ in range(self.repeats if repeats is None else repeats):
            dist.barrier()
            _sync(self.device)
            t0 = time.perf_counter()
            fn()
            _sync(self.device)
            t1 = time.perf_counter()
            times.append(self._span(t0, t1) if span else _slowest(t1 - t0))
        return min(times)

    def kernel(self, backend, dtype, causal, tq, tk, heads, kv_heads, head_dim):
        """One timed run per call (the caller makes passes, keeping the fastest, so a shape's first, cold
        run needs no separate warm-up); the kernel itself is warmed up once, on its first call.
        A run is as many back-to-back calls as make ``min_kernel_flops`` (at least one): a lone call of
        a small block lasts less than a scheduler slice on shared cores. Returns seconds per call."""
        from topology.calibration import kernel_flops

        calls = max(1, math.ceil(self.min_kernel_flops / kernel_flops(tq, tk, heads, head_dim, causal, "fwd")))
        key = (backend, dtype)
        first = key not in self._seen
        self._seen.add(key)
        dt = DTYPES[dtype]
        kernel = get_kernel(backend, self.device, dt, head_dim)
        self.kernel_names[backend] = kernel.name
        q, k, v, dout = _inputs(max(tq, tk), heads, kv_heads, head_dim, dt, self.device)
        q, dout, k, v = q[:, :tq], dout[:, :tq], k[:, :tk], v[:, :tk]
        scale = 1 / math.sqrt(head_dim)
        res: dict = {}

        def fwd():
            for _ in range(calls):
                res["o"] = kernel.forward(q, k, v, causal=causal, scale=scale)

        def bwd():
            for _ in range(calls):
                kernel.backward(dout, q, k, v, o, lse, causal=causal, scale=scale)

        tf = self._timeit(fwd, 1, first, span=True)
        o, lse = res["o"]
        tb = self._timeit(bwd, 1, first, span=True)
        return tf / calls, tb / calls

    def merge(self, tokens, heads, head_dim, dtype):
        from hybrid_cp.engine.kernels.merge import merge_

        acc = torch.zeros(1, tokens, heads, head_dim, device=self.device)
        lse = torch.zeros(1, heads, tokens, device=self.device)
        blk = torch.randn(1, tokens, heads, head_dim, device=self.device).to(DTYPES[dtype])
        blk_lse = torch.randn(1, heads, tokens, device=self.device)
        return self._timeit(lambda: merge_(acc, lse, blk, blk_lse), span=True)

    def a2a(self, ulysses, nbytes, alone):
        cp = _mesh(ulysses, 1, self.world // ulysses)
        per_peer = max(1, nbytes // (4 * (ulysses - 1)))
        send = torch.randn(ulysses * per_peer, device=self.device)
        recv = torch.empty_like(send)
        active = not alone or self.rank < ulysses

        def fn():
            if active:
                dist.all_to_all_single(recv, send, group=cp.ulysses_group)

        return self._timeit(fn)

    def p2p(self, nbytes, alone):
        send = torch.randn(max(1, nbytes // 4), device=self.device)
        recv = torch.empty_like(send)
        me, w = self.rank, self.world

        def fn():
            if alone and me >= 2:
                return
            nxt, prv = ((1 - me), (1 - me)) if alone else ((me + 1) % w, (me - 1) % w)
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return self._timeit(fn)

    def overlap(self, tokens, heads, kv_heads, head_dim, dtype, backend, nbytes):
        dt = DTYPES[dtype]
        kernel = get_kernel(backend, self.device, dt, head_dim)
        q, k, v, _ = _inputs(tokens, heads, kv_heads, head_dim, dt, self.device)
        send = torch.randn(max(1, nbytes // 4), device=self.device)
        recv = torch.empty_like(send)
        me, w = self.rank, self.world

        def post():
            ops = [dist.P2POp(dist.isend, send, (me + 1) % w), dist.P2POp(dist.irecv, recv, (me - 1) % w)]
            return dist.batch_isend_irecv(ops)

        def comm():
            for work in post():
                work.wait()

        compute = lambda: kernel.forward(q, k, v, causal=False, scale=1 / math.sqrt(head_dim))  # noqa: E731

        def both():
            works = post()
            compute()
            for work in works:
                work.wait()

        return self._timeit(comm, span=True), self._timeit(compute, span=True), self._timeit(both, span=True)

    def engine(self, ulysses, ring, seq_len, heads, kv_heads, head_dim, dtype):
        cp = _mesh(ulysses, ring, 1)
        spec = AttentionSpec(causal=True, backend=NullKernel(), seq_len=seq_len)
        times, _ = _time_attention(cp, spec, heads, kv_heads, head_dim, DTYPES[dtype], self.repeats, 1)
        return min(times)


def measure_rank(spec: dict, repeats: int = 3, progress: Any | None = None) -> dict[str, Any]:
    """Every calibration timing of ``spec`` (a ``CalibrationSpec`` as a dict) on this rank.

    Rank 0 hands each progress line to ``progress.put`` (a queue that the parent of a worker pool
    drains, or the display itself under torchrun); without ``progress`` it prints them."""
    import os

    from topology.calibration import CalibrationSpec, collect

    source = TorchRateSource(repeats)
    t_start = time.perf_counter()

    def report(msg: str) -> None:
        if source.rank != 0:
            return
        line = f"[{time.perf_counter() - t_start:6.1f} s] {msg}"
        if progress is not None:
            progress.put(line)
        else:
            print(line, flush=True)

    torch.manual_seed(0)
    samples = collect(source, CalibrationSpec(**spec), report)
    device = source.device
    return {
        "samples": samples,
        "kernel_names": source.kernel_names,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "load": list(os.getloadavg()),
    }
