"""The ranks that `hybrid-cp calibrate` and `hybrid-cp bench` measure on: a pool of local gloo
processes started by the command (``--nprocs N``), or the processes torchrun started, of which
this is one (every rank runs the command; rank 0 prints and writes)."""

from __future__ import annotations

import os
from typing import Any

from hybrid_cp.errors import ConfigError

__all__ = ["Ranks"]


def _task(name: str) -> Any:
    """The function `name` of :mod:`hybrid_cp.cli.measure` (imported on first use: it loads torch)."""
    from hybrid_cp.cli import measure

    return getattr(measure, name)


class Ranks:
    """Runs a :mod:`hybrid_cp.cli.measure` task on every rank and returns the per-rank results."""

    def __init__(self, nprocs: int | None, backend: str):
        self.pool = None
        self.nprocs = nprocs
        if nprocs is not None:
            self._start_pool(nprocs, backend)
        else:
            self._join_torchrun(backend)

    def _start_pool(self, nprocs: int, backend: str) -> None:
        if nprocs < 1:
            raise ConfigError(f"--nprocs={nprocs} must be >= 1")
        if backend != "gloo":
            raise ConfigError(
                f"--nprocs starts local gloo processes; --backend={backend} needs torchrun "
                "(e.g. torchrun --nproc-per-node 8 -m hybrid_cp.cli calibrate --backend nccl ...)"
            )
        from hybrid_cp.testing import WorkerPool

        self.pool = WorkerPool(nprocs)
        self.world = nprocs
        self.pool.run(_task("ping"), timeout=600)  # wait until every rank has joined

    def _join_torchrun(self, backend: str) -> None:
        import torch
        import torch.distributed as dist

        if "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                "not under torchrun: pass --nprocs N to start N local processes, or launch with "
                "torchrun --nproc-per-node N -m hybrid_cp.cli ..."
            )
        if not dist.is_initialized():
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        self.world = dist.get_world_size()

    @property
    def is_main(self) -> bool:
        """Whether this process prints and writes (the pool's parent, or torchrun's rank 0)."""
        if self.pool is not None:
            return True
        import torch.distributed as dist

        return dist.get_rank() == 0

    def run(self, task: str, **kwargs: Any) -> list[Any]:
        """``task(**kwargs)`` of :mod:`hybrid_cp.cli.measure` on every rank; the results in rank order."""
        if self.pool is not None:
            return self.pool.run(_task(task), timeout=3600, **kwargs)
        import torch.distributed as dist

        from hybrid_cp.cli import measure

        mine = getattr(measure, task)(**kwargs)
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
