"""Host time per `hcp.attention` call (what a GPU user pays in Python on every layer), next to torch SDPA.

    python benchmarks/host_overhead.py [--calls 300] [--repeats 5] [--no-mesh]

1 x 1 mesh (one gloo process, this one): tiny tensors [1, 64, 8, 64], causal, fp32, CPU, one thread, where the
kernel's own work is small and the call's host work shows. Forward (no grad) and forward + backward, hcp and
`torch.nn.functional.scaled_dot_product_attention` on the same tensors, interleaved: each repeat times `calls`
calls of each of the four in turn, so that a load spike from other processes hits all four alike. Printed: the
per-call time, minimum and median over the repeats, and the ratio hcp / SDPA of each.

2 x 2 mesh (4 local gloo processes, `hybrid_cp.testing.WorkerPool`): the same per-rank shards ([1, 64, 8, 64]
on every rank, a 256-token row). A call's host time there is its wall time minus the time spent inside the
collectives: every torch.distributed collective the engine calls (and the `wait()` of the work it returns) is
wrapped with a timer for the measurement, and that time (the transfer plus waiting for the slower peers) is
subtracted. What is left is the Python and kernel work of the call on that rank; SDPA on the rank's own shard is
printed next to it for scale (it is not the same computation: the rank computes a ring over 4 blocks). Slowest
rank, minimum and median over the repeats.

Every figure comes twice: wall time, and "[cpu]": the CPU time of the calling thread (`time.thread_time`), which
a machine shared with other processes inflates far less (waiting to be scheduled is not counted, nor is time
blocked in a collective: gloo's transfers run on its own threads). On a quiet machine the two agree for 1 x 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = (1, 64, 8, 64)
COLLECTIVES = (
    "all_to_all_single",
    "batch_isend_irecv",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
)


class _Timed:
    """A work object whose `wait()` adds its time to the collective clock."""

    def __init__(self, work, clock: list[float]):
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock[0] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.work, name)


def _time_collectives(clock: list[float]) -> None:
    """Wrap torch.distributed's collectives so that the time inside them (and their works' waits) adds to clock[0]."""
    import torch.distributed as dist

    def wrap(fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - t0
            if isinstance(out, list):
                return [_Timed(w, clock) for w in out]
            return None if out is None else _Timed(out, clock)

        return timed

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name)))


def _cases(cp):
    """The four timed callables: hcp and SDPA, forward (no grad) and forward + backward."""
    import torch
    import torch.nn.functional as F

    import hybrid_cp as hcp

    torch.manual_seed(0)
    q, k, v = (torch.randn(SHAPE, requires_grad=True) for _ in range(3))
    seq_len = SHAPE[1] * cp.size

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True
        ).transpose(1, 2)

    def hcp_fwd():
        with torch.no_grad():
            hcp.attention(q, k, v, cp, causal=True, seq_len=seq_len)

    def sdpa_fwd():
        with torch.no_grad():
            sdpa(q, k, v)

    def hcp_bwd():
        hcp.attention(q, k, v, cp, causal=True, seq_len=seq_len).sum().backward()

    def sdpa_bwd():
        sdpa(q, k, v).sum().backward()

    return {"hcp fwd": hcp_fwd, "sdpa fwd": sdpa_fwd, "hcp fwd+bwd": hcp_bwd, "sdpa fwd+bwd": sdpa_bwd}


def measure(ulysses: int = 1, ring: int = 1, calls: int = 300, repeats: int = 5) -> dict[str, list[float]]:
    """Per-call microseconds of each case, one entry per repeat; on a mesh larger than 1 x 1 also the host
    time of the hcp cases (the wall time minus the time inside collectives)."""
    import torch
    import torch.distributed as dist

    import hybrid_cp as hcp

    torch.set_num_threads(1)
    clock = [0.0]
    if ulysses * ring > 1:
        _time_collectives(clock)
    cp = hcp.init_cp_mesh(ulysses=ulysses, ring=ring, device="cpu")
    cases = _cases(cp)
    for fn in cases.values():  # warm: the first call of a pattern agrees across ranks and plans
        for _ in range(5):
            fn()
    out: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, fn in cases.items():
            if dist.get_world_size() > 1:
                dist.barrier()
            clock[0] = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            out.setdefault(name, []).append(wall / calls * 1e6)
            out.setdefault(name + " [cpu]", []).append(cpu / calls * 1e6)
            if ulysses * ring > 1 and name.startswith("hcp"):
                out.setdefault(name + " (host)", []).append((wall - clock[0]) / calls * 1e6)
    hcp.destroy_cp_mesh(cp)
    return out


def _single_process(calls: int, repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    from hybrid_cp.testing import local_rendezvous

    init, folder = local_rendezvous()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        return measure(1, 1, calls, repeats)
    finally:
        dist.destroy_process_group()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _table(title: str, figures: dict[str, list[float]]) -> None:
    print(title)
    print(f"  {'case':24s} {'min us':>9s} {'median us':>10s}   ratio hcp/sdpa (min, median)")
    for clock in ("", " [cpu]"):
        for mode in ("fwd", "fwd+bwd"):
            ref = figures[f"sdpa {mode}{clock}"]
            for name in (f"hcp {mode}{clock}", f"hcp {mode} (host)" if not clock else "", f"sdpa {mode}{clock}"):
                if name not in figures:
                    continue
                xs = figures[name]
                ratio = ""
                if name.startswith("hcp"):
                    ratio = f"   {min(xs) / min(ref):5.2f}x  {statistics.median(xs) / statistics.median(ref):5.2f}x"
                print(f"  {name:24s} {min(xs):9.1f} {statistics.median(xs):10.1f}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per timed batch")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches of each case (interleaved)")
    ap.add_argument("--no-mesh", action="store_true", help="only the 1 x 1 figures")
    args = ap.parse_args()
    _table(
        f"1 x 1 mesh, q/k/v {list(SHAPE)}, causal, fp32, CPU, 1 thread; per call over {args.calls} calls, "
        f"{args.repeats} repeats",
        _single_process(args.calls, args.repeats),
    )
    if args.no_mesh:
        return
    from hybrid_cp.testing import WorkerPool

    with WorkerPool(4, extra_paths=[str(Path(__file__).parent)]) as pool:
        per_rank = pool.run(measure, ulysses=2, ring=2, calls=args.calls // 3, repeats=args.repeats)
    slowest = {name: [max(r[name][i] for r in per_rank) for i in range(args.repeats)] for name in per_rank[0]}
    _table(
        "2 x 2 gloo mesh, [1, 64, 8, 64] per rank (256 tokens), slowest of 4 ranks; (host): wall minus the "
        "time inside collectives; sdpa: on the rank's own shard, for scale",
        slowest,
    )


if __name__ == "__main__":
    main()
