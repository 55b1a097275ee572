"""What the test-suite's worker pools cost on this machine: starting one (workers spawned, each importing torch,
against workers forked from a server that imported it once), and the same parity runs on meshes of up to 4 ranks
(with their fp64 references) on a pool of 4 ranks against a pool of 8 (two replicas of each mesh side by side,
each running half the cases); then what a pool of 8 holding four meshes costs while it waits for its next task,
running and paused (`WorkerPool.pause`: every gloo group keeps a thread that wakes 100 times a second).

    python benchmarks/pool_size.py [--repeat 3]

Prints min/median wall seconds and the CPU seconds (user + system, all ranks) of each, measured in one run; the
idle pool's share of the machine's CPU time (all cores, /proc/stat, Linux) over 5 seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from hybrid_cp.testing import WorkerPool, parity
from hybrid_cp.testing.cases import attention_cases, packed_cases

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]


def cpu_seconds() -> float:
    """This rank's CPU seconds so far (user + system, all its threads)."""
    return time.process_time()


def parity_runs(meshes: list[tuple[int, int]]) -> float:
    """The suite's fp32 attention and packed-document parity on each mesh, references included (computed once
    per pool, as in a test module); this rank's CPU seconds."""
    start = time.process_time()
    for u, r in meshes:
        parity.attention_errors(u, r, "zigzag", attention_cases(u))
        parity.packed_errors(u, r, "zigzag", packed_cases(u, seed=3))
    parity.end_module()
    return time.process_time() - start


def hold_meshes(meshes: list[tuple[int, int]]) -> int:
    """Build (and keep, in parity's cache) these meshes; the gloo groups this rank now holds threads for."""
    for u, r in meshes:
        parity.mesh(u, r)
    return len(os.listdir("/proc/self/task"))


def machine_busy(seconds: float = 5.0) -> float:
    """The share of the whole machine's CPU time that was busy (not idle or waiting) over `seconds`."""

    def sample() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]

    before = sample()
    time.sleep(seconds)
    delta = [b - a for a, b in zip(before, sample())]
    return 1 - (delta[3] + delta[4]) / sum(delta)


def start_pool(world: int, start_method: str = "forkserver") -> tuple[WorkerPool, float]:
    """A started pool (every rank has answered once) and the seconds it took."""
    start = time.perf_counter()
    pool = WorkerPool(world, extra_paths=[HERE], start_method=start_method)
    pool.run(cpu_seconds)
    return pool, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    starts: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    runs: dict[int, list[tuple[float, float]]] = {4: [], 8: []}
    for _ in range(args.repeat):
        for name in starts:
            pool, seconds = start_pool(8, name)
            starts[name].append(seconds)
            pool.close(force=True)
        for world in runs:
            pool, _ = start_pool(world)
            begin = time.perf_counter()
            cpu = sum(pool.run(parity_runs, meshes=MESHES, timeout=900))
            runs[world].append((time.perf_counter() - begin, cpu))
            pool.close(force=True)
    pool, _ = start_pool(8)
    threads = pool.run(hold_meshes, meshes=[(8, 1), (2, 4), (1, 8), (4, 2)])[0]
    time.sleep(1)
    idle = {"running": machine_busy()}
    pool.pause()
    time.sleep(1)
    idle["paused"] = machine_busy()
    pool.close(force=True)
    print(f"{'what':<44} {'wall min':>8} {'median':>7} {'CPU s':>6}")
    for name, times in starts.items():
        print(f"{'start 8 workers, ' + name:<44} {min(times):>8.2f} {statistics.median(times):>7.2f} {'-':>6}")
    for world, times in runs.items():
        walls = [w for w, _ in times]
        label = f"parity on {len(MESHES)} meshes of <= 4 ranks, pool of {world}"
        print(f"{label:<44} {min(walls):>8.2f} {statistics.median(walls):>7.2f} {min(c for _, c in times):>6.1f}")
    for name, busy in idle.items():
        label = f"idle pool of 8, 4 meshes ({threads} threads a rank), {name}"
        print(f"{label:<60} {100 * busy:.1f}% of the machine busy")


if __name__ == "__main__":
    main()
