"""A pool of local gloo worker processes, started once and reused for many distributed checks.

Used by the test-suite (pools started once per pytest session) and by `hybrid-cp demo`. A task is a module-level
function (passed as the object; the workers import it by its module and name); every rank runs it and
returns a picklable result.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def mesh_description(ulysses: int, ring: int, rank: int = 0, layout: str = "zigzag"):
    """A CPMesh of cp rank `rank` without process groups: enough for code that does no communication
    (shard_batch, shard/positions arithmetic, the model guard), on a single process."""
    import torch

    from ..engine.mesh import CPMesh

    ring_rank, ulysses_rank = divmod(rank, ulysses)
    return CPMesh(
        ulysses_size=ulysses,
        ring_size=ring,
        dp_size=1,
        layout=layout,
        device=torch.device("cpu"),
        device_mesh=None,
        ulysses_group=None,
        ring_group=None,
        ring_group_bwd=None,
        cp_group=None,
        ulysses_rank=ulysses_rank,
        ring_rank=ring_rank,
        dp_rank=0,
    )


def local_rendezvous() -> tuple[str, str]:
    """A `file://` init method for processes on this machine, and the folder to delete afterwards.

    A file store needs no port: picking a free TCP port and handing it to the children races with
    every other process on the machine (gloo's own connections included) that may take it first.
    """
    folder = tempfile.mkdtemp(prefix="hybrid-cp-rdzv-")
    return f"file://{os.path.join(folder, 'store')}", folder


def _worker(rank: int, world: int, init_method: str, tasks, results, paths: list[str], threads: int) -> None:
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        target, kwargs = task
        try:
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(**kwargs)))
        except BaseException as exc:  # report, keep serving
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


def task_path(task: Callable[..., Any]) -> str:
    """ "module:function" of a module-level function, what the workers import (a script run as __main__ is
    imported by its file name)."""
    if not callable(task) or "<" in getattr(task, "__qualname__", "<"):
        raise TypeError(f"a pool task must be a module-level function, got {task!r}")
    module = task.__module__
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        module = spec.name if spec is not None else Path(main.__file__).stem
    return f"{module}:{task.__qualname__}"


# Imported once by the fork server that starts the workers, not by each worker: 8 workers spawned took 5.8 s to
# start on a 2-core machine, 0.6 s forked from a server that has these (benchmarks/pool_size.py).
PRELOAD = ("torch", "torch.distributed", "hybrid_cp", "hybrid_cp.testing")


def _context(preload: Sequence[str], start_method: str | None):
    """Workers forked from a fork server that has imported `preload` (spawned where there is no fork server, or
    when asked). The fork server is one per process: it imports the preload list of the first pool that starts it,
    and its workers see that moment's environment variables, not later changes."""
    method = start_method or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *preload])))  # a module not installed: skipped
    return ctx


class WorkerPool:
    """`world` gloo processes on this machine; `run` executes one task on all of them.

    Args:
        world: the number of ranks.
        threads: torch's intra-op threads per rank.
        extra_paths: folders put first on the workers' `sys.path` (where their tasks' modules are).
        preload: modules the workers' fork server imports once, beside torch and hybrid_cp (e.g. transformers).
        start_method: "forkserver" (the default where there is one) or "spawn" (each worker imports everything).
    """

    def __init__(
        self,
        world: int,
        *,
        threads: int = 1,
        extra_paths: list[str] | None = None,
        preload: Sequence[str] = (),
        start_method: str | None = None,
    ):
        ctx = _context(preload, start_method)
        self.world = world
        self.broken = ""
        self.paused = False
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        init_method, self.folder = local_rendezvous()
        paths = list(extra_paths or []) + [p for p in sys.path if p]
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, init_method, self.tasks[r], self.results, paths, threads), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, task: Callable[..., Any], timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run `task(**kwargs)` on every rank; return the per-rank results in rank order.

        `task` is a module-level function; the workers import it by module and name, so its module must be
        importable there (the pool's `extra_paths` and this process's `sys.path`; a script run as __main__ by
        its file name). Raises RuntimeError with each failing rank's traceback, or TimeoutError if a rank hangs
        (the pool is then closed, and later calls fail at once instead of waiting again).
        """
        target = task_path(task)
        if self.broken:
            raise RuntimeError(
                f"the worker pool was closed after an earlier hang ({self.broken}); not running {target}"
            )
        self._resume()
        for q in self.tasks:
            q.put((target, kwargs))
        out: list[Any] = [None] * self.world
        failures = []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                self.broken = f"{target} timed out"
                raise TimeoutError(f"{target} did not finish on every rank within {timeout}s (a hang?)")
            if ok:
                out[rank] = value
            else:
                failures.append((rank, value))
        if failures:
            raise RuntimeError("\n".join(f"rank {r}: {msg}" for r, msg in sorted(failures)))
        return out

    def pause(self) -> None:
        """Stop the workers (SIGSTOP) until the next `run`. Every gloo group keeps a thread that wakes 100 times a
        second with nothing to do (about 1 ms of CPU per group and second): a pool of 8 holding four meshes kept
        16-19% of a 2-core machine busy while idle, 0.3% paused (benchmarks/pool_size.py). Call it between runs
        only (a rank stopped inside a collective would time out); a no-op where there is no SIGSTOP."""
        if self.paused or self.broken or not hasattr(signal, "SIGSTOP"):
            return
        for p in self.procs:
            os.kill(p.pid, signal.SIGSTOP)
        self.paused = True

    def _resume(self) -> None:
        if self.paused:
            for p in self.procs:
                os.kill(p.pid, signal.SIGCONT)
            self.paused = False

    def close(self, force: bool = False) -> None:
        self._resume()  # a stopped worker neither reads its queue nor acts on SIGTERM
        if not force:
            for q in self.tasks:
                q.put(None)
            deadline = time.monotonic() + 10  # one wait for all: a worker slow to leave gloo is terminated below
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)
