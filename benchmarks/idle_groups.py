"""What idle process groups cost: CPU time a process spends while its main thread sleeps, with N gloo
groups alive, then after `destroy_process_group` on them (what `hcp.destroy_cp_mesh` does for a mesh).

    python benchmarks/idle_groups.py [--groups 50 100 200] [--seconds 3] [--repeat 3]

One process (world size 1), so no other rank shares the CPU. Prints min/median idle CPU per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist


def idle_cpu(seconds: float) -> float:
    """CPU seconds per second this process used while its main thread slept."""
    start = time.process_time()
    time.sleep(seconds)
    return (time.process_time() - start) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29761")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"{'groups':>6} {'threads':>7} {'idle CPU/s min':>14} {'median':>7} {'per group, ms/s':>15}")
    for n in [0, *args.groups]:
        groups = [dist.new_group([0]) for _ in range(n)]
        runs = [idle_cpu(args.seconds) for _ in range(args.repeat)]
        threads = len(os.listdir("/proc/self/task"))
        per = f"{1e3 * min(runs) / n:.3f}" if n else "-"
        print(f"{n:>6} {threads:>7} {min(runs):>14.4f} {statistics.median(runs):>7.4f} {per:>15}")
        while groups:  # a destroyed group's threads end when its last reference goes
            dist.destroy_process_group(groups.pop())
    runs = [idle_cpu(args.seconds) for _ in range(args.repeat)]
    print(f"after destroying them: {len(os.listdir('/proc/self/task'))} threads, idle CPU/s min {min(runs):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
