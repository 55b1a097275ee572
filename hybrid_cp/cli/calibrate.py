"""`hybrid-cp calibrate`: measure this machine's kernel, merge, all-to-all and ring rates with the
engine's own code paths, and write a cluster file for `hybrid-cp plan` and `hybrid-cp bench`.

    hybrid-cp calibrate --out cpu8.yaml --nprocs 8            # local gloo processes
    torchrun --nproc-per-node 8 -m hybrid_cp.cli calibrate --out h200.yaml --backend nccl
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import threading
import time
from typing import Any, Iterator

from .command import Command, fail
from .ranks import Ranks

__all__ = ["COMMAND", "ProgressDisplay", "calibrated_cluster", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="cluster file to write (.yaml, or .json)")
    p.add_argument("--nprocs", type=int, help="start N local gloo processes (default: run under torchrun)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--kernels", default="auto", help="comma-separated kernel backends to time (default: auto)")
    p.add_argument("--dtypes", help="comma-separated dtypes (default: float32 on CPU, bfloat16,float16 on CUDA)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repeats per transfer/merge/engine figure (fastest kept; kernels use the spec's passes)",
    )
    p.add_argument("--quick", action="store_true", help="smallest sizes only (tests, smoke runs)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: LOCAL_WORLD_SIZE or all ranks)")


class ProgressDisplay:
    """Rank 0's progress lines, printed as they arrive, above a tqdm status line (on a terminal) that
    shows the stage being measured and the time since the ranks started measuring."""

    def __init__(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(bar_format="  {desc} [{elapsed}]", disable=None, leave=False, dynamic_ncols=True)

    def put(self, line: str) -> None:
        self.bar.write(line)
        self.bar.set_description_str(line.partition("] ")[2].strip()[:72])

    def tick(self) -> None:
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _show(lines: Any, display: ProgressDisplay) -> None:
    """Move the ranks' lines from the queue to the display until the None that ends them."""
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            display.tick()
            continue
        if line is None:
            return
        display.put(line)


@contextlib.contextmanager
def progress_channel(ranks: Ranks) -> Iterator[Any]:
    """Where rank 0 puts its progress lines. A pool's rank 0 is another process: it gets a manager
    queue that a thread here drains into the display. Under torchrun rank 0 is this process and gets
    the display itself; the other ranks get None (they report nothing)."""
    display = ProgressDisplay() if ranks.is_main else None
    try:
        if ranks.pool is None or display is None:
            yield display
            return
        with multiprocessing.Manager() as manager:
            lines = manager.Queue()
            drain = threading.Thread(target=_show, args=(lines, display), daemon=True)
            drain.start()
            try:
                yield lines
            finally:
                lines.put(None)
                drain.join(timeout=5)
    finally:
        if display is not None:
            display.close()


def _spec(args: argparse.Namespace, world: int) -> Any:
    """What to time: topology's default spec, with the flags' backends and dtypes (or the quick sizes)."""
    from topology.calibration import default_spec, heads_per_call, kernel_grid

    device = "cuda" if args.backend == "nccl" else "cpu"
    over: dict[str, Any] = {"backends": args.kernels.split(",")}
    if args.dtypes:
        over["dtypes"] = args.dtypes.split(",")
    if args.quick:
        over.update(
            kernel_shapes=kernel_grid(heads_per_call(world, 8), (128, 256, 512), (512, 1024)),
            merge_tokens=[512, 2048],
            a2a_bytes=[1 << 12, 1 << 18],
            p2p_bytes=[1 << 12, 1 << 18],
            overlap_tokens=512,
            overlap_bytes=1 << 18,
            engine_lengths=[256, 1024],
        )
    return default_spec(world, device, **over)


def run(args: argparse.Namespace) -> int:
    """`hybrid-cp calibrate` on parsed flags."""
    from topology.calibration import fit

    t0 = time.perf_counter()
    print(f"hybrid-cp calibrate: starting {args.nprocs or 'torchrun'} {args.backend} ranks ...", flush=True)
    try:
        ranks = Ranks(args.nprocs, args.backend)
    except ValueError as exc:
        return fail("calibrate", str(exc))
    startup = time.perf_counter() - t0
    try:
        spec = _spec(args, ranks.world)
        print(f"  ranks up after {startup:.1f} s; measuring (progress below)", flush=True)
        with progress_channel(ranks) as progress:
            r0 = ranks.run("measure_rank", spec=spec.model_dump(), repeats=args.repeats, progress=progress)[0]
        seconds = time.perf_counter() - t0
        cal = fit(
            r0["samples"],
            spec,
            backend=r0["backend"],
            device=r0["device"],
            kernel_names=r0["kernel_names"],
            seconds=seconds,
            startup_s=startup,
            load=r0["load"],
        )
        if ranks.is_main:
            gpn = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
            path = calibrated_cluster(cal, max(1, ranks.world // gpn), gpn, args.backend).save(args.out)
            print(cal.summary())
            print(
                f"wrote {path} ({seconds:.1f} s); use it with: hybrid-cp plan --cluster {path} ... "
                f"or hybrid-cp bench --cluster {path} ..."
            )
    finally:
        ranks.close()
    return 0


def calibrated_cluster(cal: Any, nodes: int, gpus_per_node: int, backend: str) -> Any:
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
        intra = LinkSpec(
            kind=intra.kind,
            bandwidth_gb_s=widest.link.bandwidth_gb_s,
            latency_us=widest.link.latency_us,
            contention=max(1.0, cal.p2p_contention),
        )
    return base.model_copy(
        update={
            "name": "calibrated",
            "accelerator": acc.model_copy(update=upd),
            "intra_node": intra,
            "backend": backend,
            "calibration": cal,
            "sources": [
                f"hybrid-cp calibrate on {cal.world} {cal.backend} ranks ({cal.device}), "
                f"load average {', '.join(f'{x:.1f}' for x in cal.load)}"
            ],
        }
    )


COMMAND = Command(
    "calibrate",
    "measure this machine's rates and write a cluster file for plan",
    "Measure this machine's kernel, merge, all-to-all and ring rates with the engine's own code "
    "paths; write a cluster file.",
    add_arguments,
    run,
)
main = COMMAND.main
