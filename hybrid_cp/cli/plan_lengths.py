"""``hybrid-cp plan --lengths``: the dynamic-degree schedule of one step next to the best fixed split.

    hybrid-cp plan --preset dgx-h100 --model llama3-8b --lengths lengths.txt --tokens-per-rank 8K
    hybrid-cp plan --preset dgx-h100 --model llama3-8b --lengths lognormal:median=2K,sigma=1.5,total=512K

`--lengths` is a file of document lengths (integers separated by spaces, commas or newlines; ``#``
comments) or a lognormal distribution; it is one global batch. Prints `StepSchedule.explain` (groups,
degrees, predicted times, idle share per micro-batch) and every fixed split that holds the longest document:
predicted time, bytes per token, padding, idle share.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from typing import Any

from topology.degrees import degree_table
from topology.schedule import schedule_step
from topology.schedule_report import Shape, compare, explain
from topology.units import dtype_bytes

__all__ = ["read_lengths", "lengths_main"]


def read_lengths(spec: str, count: Any) -> list[int]:
    """Document lengths from a file, or from ``lognormal:median=M,sigma=S,total=T[,seed=N]`` (lengths
    drawn until T tokens, the last one cut); `count` parses ``2K``-style numbers."""
    if spec.startswith("lognormal:"):
        fields = dict(kv.split("=", 1) for kv in spec.split(":", 1)[1].split(",") if kv)
        try:
            median, total = count(fields["median"]), count(fields["total"])
            sigma, seed = float(fields.get("sigma", "1.0")), int(fields.get("seed", "0"))
        except (KeyError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(
                f"--lengths {spec!r}: expected lognormal:median=2K,sigma=1.5,total=512K[,seed=0] ({exc})"
            ) from None
        rng, out = random.Random(seed), []
        while sum(out) < total:
            out.append(max(1, int(rng.lognormvariate(math.log(median), sigma))))
        out[-1] -= sum(out) - total
        return [n for n in out if n > 0]
    try:
        with open(spec) as f:
            text = re.sub(r"#[^\n]*", "", f.read())
    except OSError as exc:
        raise ValueError(f"--lengths {spec!r}: {exc.strerror}; pass a file of lengths or lognormal:...") from None
    try:
        return [int(x) for x in re.split(r"[\s,]+", text) if x]
    except ValueError as exc:
        raise ValueError(f"--lengths {spec!r}: {exc}; the file holds integer document lengths") from None


def lengths_main(args: argparse.Namespace, cluster: Any, model: Any, count: Any) -> int:
    """Schedule the lengths on the cluster's GPUs and print (or --json) the comparison."""
    lengths = read_lengths(args.lengths, count)
    world = args.world_size or cluster.world_size
    C = args.tokens_per_rank
    degrees = degree_table(cluster, model, world, C, dtype=args.dtype, memory_budget=args.memory_budget)
    sched = schedule_step(lengths, world, C, degrees)
    cmp = compare(sched, Shape(model.heads, model.n_kv, model.head_dim, dtype_bytes(args.dtype)))
    rows = [cmp.schedule, *cmp.candidates]
    if args.json:
        print(
            json.dumps(
                {
                    "digest": sched.digest,
                    "microbatches": len(sched.microbatches),
                    "targets": sched.targets,
                    "bound_bytes": cmp.bound_bytes,
                    "best_fixed": cmp.fixed.label,
                    "runs": [{**vars(t), "bytes_per_token": t.bytes_per_token} for t in rows],
                },
                indent=2,
            )
        )
        return 0
    print(explain(sched, cmp))
    print()
    print(f"{'run':<16} {'predicted ms':>13} {'bytes/token':>12} {'padding':>8} {'idle':>6}")
    for t in rows:
        ms = "-" if t.predicted_s is None else f"{t.predicted_s * 1e3:.2f}"
        idle = "-" if t.idle_share is None else f"{t.idle_share:.1%}"
        print(f"{t.label:<16} {ms:>13} {t.bytes_per_token:>12.0f} {t.padding:>8} {idle:>6}")
    print(
        "(times: one layer, forward + backward, from the calibrated cost model; bytes: all ranks' all-to-all and "
        "ring; '-': that split is not the planner's for its degree, so it is not priced)"
    )
    return 0
