"""`hybrid-cp calibrate` and `hybrid-cp bench`: measure this machine, then compare with the planner.

    hybrid-cp calibrate --out cpu8.yaml --nprocs 8            # local gloo processes
    torchrun --nproc-per-node 8 -m hybrid_cp.cli calibrate --out h200.yaml --backend nccl
    hybrid-cp bench --nprocs 8 --ulysses 2 --ring 4 --seq-len 6144 --heads 8 --kv-heads 2 --head-dim 64 \
        --causal --cluster cpu8.yaml --json

Under torchrun every rank runs the same code and rank 0 prints/writes; with ``--nprocs N`` the
command starts N local gloo processes (a `WorkerPool`) and drives them from this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

STAGES = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")


class _Runner:
    """Runs a `hybrid_cp.bench` task on every rank: a local pool, or this torchrun process."""

    def __init__(self, nprocs: int | None, backend: str):
        self.pool = None
        self.nprocs = nprocs
        if nprocs is not None:
            if nprocs < 1:
                raise ValueError(f"--nprocs={nprocs} must be >= 1")
            if backend != "gloo":
                raise ValueError(f"--nprocs starts local gloo processes; --backend={backend} needs torchrun "
                                 "(e.g. torchrun --nproc-per-node 8 -m hybrid_cp.cli calibrate --backend nccl ...)")
            from hybrid_cp.testing import WorkerPool

            self.pool = WorkerPool(nprocs)
            self.world = nprocs
            self.pool.run("hybrid_cp.bench:ping", timeout=600)  # wait until every rank has joined
        else:
            import torch
            import torch.distributed as dist

            if "WORLD_SIZE" not in os.environ:
                raise ValueError("not under torchrun: pass --nprocs N to start N local processes, or launch with "
                                 "torchrun --nproc-per-node N -m hybrid_cp.cli ...")
            if not dist.is_initialized():
                if backend == "nccl":
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
                dist.init_process_group(backend)
            self.world = dist.get_world_size()

    @property
    def is_main(self) -> bool:
        if self.pool is not None:
            return True
        import torch.distributed as dist

        return dist.get_rank() == 0

    def run(self, target: str, **kwargs: Any) -> list[Any]:
        if self.pool is not None:
            return self.pool.run(f"hybrid_cp.bench:{target}", timeout=3600, **kwargs)
        import torch.distributed as dist

        from hybrid_cp import bench

        mine = getattr(bench, target)(**kwargs)
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _error(prog: str, msg: str) -> int:
    """Print a usage error the same way for every subcommand; the exit status for it."""
    print(f"hybrid-cp {prog}: error: {msg}", file=sys.stderr)
    return 2


def _start(prog: str, nprocs: int | None, backend: str) -> "_Runner | None":
    """Start (or join) the ranks; None after printing why they cannot be started."""
    try:
        return _Runner(nprocs, backend)
    except ValueError as exc:
        _error(prog, str(exc))
        return None


def _tail(path: str, stop: threading.Event, echo: Callable[[str], None]) -> None:
    """Show the ranks' progress lines as they appear (the pool's rank 0 appends them to a file)."""
    pos = 0
    while not stop.is_set():
        time.sleep(0.3)
        try:
            with open(path) as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
        except FileNotFoundError:
            continue
        for line in chunk.splitlines():
            echo(line)


# ------------------------------------------------------------------------------------------------ calibrate


def calibrate_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hybrid-cp calibrate`."""
    p = argparse.ArgumentParser(prog="hybrid-cp calibrate", description="Measure this machine's kernel, merge, "
                                "all-to-all and ring rates with the engine's own code paths; write a cluster file.")
    p.add_argument("--out", required=True, help="cluster file to write (.yaml, or .json)")
    p.add_argument("--nprocs", type=int, help="start N local gloo processes (default: run under torchrun)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--kernels", default="auto", help="comma-separated kernel backends to time (default: auto)")
    p.add_argument("--dtypes", help="comma-separated dtypes (default: float32 on CPU, bfloat16,float16 on CUDA)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per transfer/merge/engine figure "
                   "(fastest kept; kernels use the spec's passes)")
    p.add_argument("--quick", action="store_true", help="smallest sizes only (tests, smoke runs)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: LOCAL_WORLD_SIZE or all ranks)")
    a = p.parse_args(argv)
    from topology.calibration import default_spec, fit, heads_per_call, kernel_grid

    t0 = time.perf_counter()
    print(f"hybrid-cp calibrate: starting {a.nprocs or 'torchrun'} {a.backend} ranks ...", flush=True)
    runner = _start("calibrate", a.nprocs, a.backend)
    if runner is None:
        return 2
    startup = time.perf_counter() - t0
    try:
        device = "cuda" if a.backend == "nccl" else "cpu"
        over: dict[str, Any] = {"backends": a.kernels.split(",")}
        if a.dtypes:
            over["dtypes"] = a.dtypes.split(",")
        if a.quick:
            over.update(kernel_shapes=kernel_grid(heads_per_call(runner.world, 8), (128, 256, 512), (512, 1024)),
                        merge_tokens=[512, 2048], a2a_bytes=[1 << 12, 1 << 18], p2p_bytes=[1 << 12, 1 << 18],
                        overlap_tokens=512, overlap_bytes=1 << 18, engine_lengths=[256, 1024])
        spec = default_spec(runner.world, device, **over)
        progress_file = None
        stop = threading.Event()
        watcher = None
        if runner.pool is not None:
            with tempfile.NamedTemporaryFile(prefix="hcp-calibrate-", suffix=".log", delete=False) as f:
                progress_file = f.name
            watcher = threading.Thread(target=_tail, args=(progress_file, stop, lambda s: print(s, flush=True)),
                                       daemon=True)
            watcher.start()
        print(f"  ranks up after {startup:.1f} s; measuring (progress below)", flush=True)
        res = runner.run("measure_rank", spec=spec.model_dump(), repeats=a.repeats, progress_file=progress_file)
        stop.set()
        if watcher is not None:
            watcher.join(timeout=2)
            Path(progress_file).unlink(missing_ok=True)
        r0 = res[0]
        seconds = time.perf_counter() - t0
        cal = fit(r0["samples"], spec, backend=r0["backend"], device=r0["device"], kernel_names=r0["kernel_names"],
                  seconds=seconds, startup_s=startup, load=r0["load"])
        if runner.is_main:
            gpn = a.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", runner.world))
            nodes = max(1, runner.world // gpn)
            cluster = _calibrated_cluster(cal, nodes, gpn, a.backend)
            path = cluster.save(a.out)
            print(cal.summary())
            print(f"wrote {path} ({seconds:.1f} s); use it with: hybrid-cp plan --cluster {path} ... "
                  f"or hybrid-cp bench --cluster {path} ...")
    finally:
        runner.close()
    return 0


def _calibrated_cluster(cal: Any, nodes: int, gpus_per_node: int, backend: str) -> Any:
    """A Cluster whose links and accelerator carry the measured figures (so the plain model is close
    too), with the full Calibration attached for the calibrated model."""
    from topology.cluster import Cluster, LinkSpec

    base = Cluster.preset("cpu" if cal.device == "cpu" else "dgx-h200", nodes=nodes, gpus_per_node=gpus_per_node)
    acc = base.accelerator
    fwd = cal.kernel_fit(False, "fwd")
    upd: dict[str, Any] = {"name": f"{cal.device} (calibrated)"}
    if fwd is not None:
        upd.update(peak_tflops=fwd.tflops, attention_efficiency=1.0, kernel_call_overhead_us=fwd.call_overhead_us)
    if cal.merge is not None:
        upd["hbm_gb_s"] = cal.merge.bandwidth_gb_s
    upd["ring_step_overhead_us"] = cal.step_overhead_us
    upd["ring_overlap"] = cal.overlap
    intra = base.intra_node
    widest = max(cal.a2a, key=lambda f: f.ulysses, default=None)
    if widest is not None:
        intra = LinkSpec(kind=intra.kind, bandwidth_gb_s=widest.link.bandwidth_gb_s, latency_us=widest.link.latency_us,
                         contention=max(1.0, cal.p2p_contention))
    return base.model_copy(update={
        "name": "calibrated", "accelerator": acc.model_copy(update=upd), "intra_node": intra, "backend": backend,
        "calibration": cal,
        "sources": [f"hybrid-cp calibrate on {cal.world} {cal.backend} ranks ({cal.device}), "
                    f"load average {', '.join(f'{x:.1f}' for x in cal.load)}"],
    })


# ------------------------------------------------------------------------------------------------ bench


def bench_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hybrid-cp bench`."""
    p = argparse.ArgumentParser(prog="hybrid-cp bench", description="Time one attention forward + backward per "
                                "rank on this machine and put the planner's prediction next to it.")
    p.add_argument("--ulysses", type=int, required=True)
    p.add_argument("--ring", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, help="default: --heads")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kernel", default="auto", help="kernel backend (default auto)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nprocs", type=int, help="start N local gloo processes (default: run under torchrun)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--cluster", metavar="FILE", help="cluster file (from hybrid-cp calibrate) for the prediction")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    kv = a.kv_heads or a.heads
    for name in ("ulysses", "ring", "seq_len", "heads", "head_dim", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if kv < 1 or a.heads % kv:
        p.error(f"--heads={a.heads} must be a multiple of --kv-heads={kv} (GQA groups)")
    if a.ulysses > a.heads:
        p.error(f"--ulysses={a.ulysses} exceeds --heads={a.heads}: every ulysses rank needs a head; "
                f"use --ulysses <= {a.heads} and put the rest into --ring")
    cluster = None
    if a.cluster:
        from topology.cluster import Cluster, ClusterError

        try:
            cluster = Cluster.load(a.cluster)
        except ClusterError as exc:
            return _error("bench", str(exc))
    runner = _start("bench", a.nprocs, a.backend)
    if runner is None:
        return 2
    try:
        world = runner.world
        if world % (a.ulysses * a.ring):
            return _error("bench", f"ulysses={a.ulysses} x ring={a.ring} does not divide the {world} ranks; "
                          f"use --nprocs {a.ulysses * a.ring}")
        res = runner.run("bench_rank", ulysses=a.ulysses, ring=a.ring, seq_len=a.seq_len, heads=a.heads, kv_heads=kv,
                         head_dim=a.head_dim, causal=a.causal, dtype=a.dtype, repeats=a.repeats, warmup=a.warmup,
                         backend=a.kernel)
    finally:
        runner.close()
    if not runner.is_main:
        return 0
    out = summarize(res, a.ulysses, a.ring, a.seq_len, a.heads, kv, a.head_dim, a.causal, a.dtype, world // (a.ulysses * a.ring),
                    cluster)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_bench(out))
    return 0


def summarize(res: list[dict], u: int, r: int, n: int, h: int, kv: int, d: int, causal: bool, dtype: str, dp: int,
              cluster: Any | None) -> dict[str, Any]:
    """One bench result: measured min/median, bytes per stage (worst rank) and the prediction."""
    times = res[0]["times"]  # already the slowest rank per repeat
    nbytes = {s: max(x["bytes"].get(s, 0) for x in res) for s in STAGES}
    out: dict[str, Any] = {
        "ulysses": u, "ring": r, "dp": dp, "seq_len": n, "heads": h, "kv_heads": kv, "head_dim": d, "causal": causal,
        "dtype": dtype, "kernel": res[0]["kernel"], "device": res[0]["device"], "repeats": len(times),
        "times_s": times, "measured_s": statistics.median(times), "measured_min_s": min(times),
        "bytes_per_rank": nbytes, "predicted_s": None, "predicted_bytes": None, "load": list(os.getloadavg()),
    }
    if cluster is not None:
        from topology.cost import ModelShape, comm_bytes, dtype_bytes, estimate

        e = dtype_bytes(dtype)
        est = estimate(cluster, ModelShape(heads=h, kv_heads=kv, head_dim=d, layers=1), n, u, r, dp, dtype=dtype,
                       causal=causal)
        out["predicted_s"] = est.attention_time_s
        out["predicted_bytes"] = comm_bytes(h, kv, d, n, 1, u, r, e)
        out["predicted_parts"] = {"kernels": est.attention_s, "fixed_merge_copy": est.ring_overhead_s,
                                  "a2a": est.a2a_s, "ring_exposed": est.ring_exposed_s}
        out["error"] = est.attention_time_s / out["measured_s"] - 1
        out["notes"] = list(est.notes)
        cal = cluster.calibration
        if cal is not None and cal.probe_s and res[0].get("probe_s"):
            # On a machine shared with other jobs a rank's share changes between calibration and bench;
            # the reference kernel timed around the bench says by how much.
            out["load_factor"] = res[0]["probe_s"] / cal.probe_s
            out["predicted_load_adjusted_s"] = est.attention_time_s * out["load_factor"]
            out["error_load_adjusted"] = out["predicted_load_adjusted_s"] / out["measured_s"] - 1
    return out


def format_bench(out: dict[str, Any]) -> str:
    """The human table of one bench result."""
    lines = [f"hybrid-cp bench: ulysses={out['ulysses']} ring={out['ring']} dp={out['dp']}, {out['seq_len']} tokens, "
             f"H={out['heads']} H_kv={out['kv_heads']} D={out['head_dim']} {'causal' if out['causal'] else 'full'} "
             f"{out['dtype']}, kernel {out['kernel']} on {out['device']}",
             f"  measured  (fwd+bwd, slowest rank): min {out['measured_min_s'] * 1e3:.1f} ms, median "
             f"{out['measured_s'] * 1e3:.1f} ms over {out['repeats']} repeats"]
    if out["predicted_s"] is not None:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in out["predicted_parts"].items())
        lines.append(f"  predicted (cluster file): {out['predicted_s'] * 1e3:.1f} ms ({out['error']:+.0%}): {parts} ms")
        if out.get("load_factor"):
            lines.append(f"  reference kernel {out['load_factor']:.2f}x its calibration time (machine shared with other "
                         f"jobs): load-adjusted prediction {out['predicted_load_adjusted_s'] * 1e3:.1f} ms "
                         f"({out['error_load_adjusted']:+.0%})")
    else:
        lines.append("  predicted: pass --cluster FILE (from hybrid-cp calibrate) for the planner's prediction")
    lines.append(f"  {'bytes sent per rank':22}" + "".join(f"{s:>14}" for s in STAGES))
    lines.append(f"  {'measured':22}" + "".join(f"{out['bytes_per_rank'][s]:>14,}" for s in STAGES))
    if out.get("predicted_bytes"):
        lines.append(f"  {'cost model':22}" + "".join(f"{out['predicted_bytes'][s]:>14,}" for s in STAGES))
    for n in out.get("notes") or []:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(bench_main())
