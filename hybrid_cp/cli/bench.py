"""`hybrid-cp bench`: time one attention forward + backward per rank on this machine and put the
planner's prediction (from a `hybrid-cp calibrate` cluster file) next to it.

    hybrid-cp bench --nprocs 8 --ulysses 2 --ring 4 --seq-len 6144 --heads 8 --kv-heads 2 --head-dim 64 \\
        --causal --cluster cpu8.yaml --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from .command import Command, UsageError, fail
from .ranks import Ranks
from .table import table_lines

__all__ = ["COMMAND", "STAGES", "format_bench", "main", "summarize"]

STAGES = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def check_shape(a: argparse.Namespace) -> int:
    """The KV heads (default: --heads) once the flags make a shape the engine can run."""
    kv = a.kv_heads or a.heads
    for name in ("ulysses", "ring", "seq_len", "heads", "head_dim", "repeats"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if kv < 1 or a.heads % kv:
        raise UsageError(f"--heads={a.heads} must be a multiple of --kv-heads={kv} (GQA groups)")
    if a.ulysses > a.heads:
        raise UsageError(
            f"--ulysses={a.ulysses} exceeds --heads={a.heads}: every ulysses rank needs a head; "
            f"use --ulysses <= {a.heads} and put the rest into --ring"
        )
    return kv


def run(a: argparse.Namespace) -> int:
    """`hybrid-cp bench` on parsed flags."""
    kv = check_shape(a)
    cluster = None
    if a.cluster:
        from topology.cluster import Cluster, ClusterError

        try:
            cluster = Cluster.load(a.cluster)
        except ClusterError as exc:
            return fail("bench", str(exc))
    try:
        ranks = Ranks(a.nprocs, a.backend)
    except ValueError as exc:
        return fail("bench", str(exc))
    try:
        world = ranks.world
        if world % (a.ulysses * a.ring):
            return fail(
                "bench",
                f"ulysses={a.ulysses} x ring={a.ring} does not divide the {world} ranks; "
                f"use --nprocs {a.ulysses * a.ring}",
            )
        res = ranks.run(
            "bench_rank",
            ulysses=a.ulysses,
            ring=a.ring,
            seq_len=a.seq_len,
            heads=a.heads,
            kv_heads=kv,
            head_dim=a.head_dim,
            causal=a.causal,
            dtype=a.dtype,
            repeats=a.repeats,
            warmup=a.warmup,
            backend=a.kernel,
        )
    finally:
        ranks.close()
    if not ranks.is_main:
        return 0
    out = summarize(
        res,
        a.ulysses,
        a.ring,
        a.seq_len,
        a.heads,
        kv,
        a.head_dim,
        a.causal,
        a.dtype,
        world // (a.ulysses * a.ring),
        cluster,
    )
    print(json.dumps(out, indent=2) if a.json else format_bench(out))
    return 0


def summarize(  # noqa: PLR0913 (public entry point)
    res: list[dict],
    u: int,
    r: int,
    n: int,
    h: int,
    kv: int,
    d: int,
    causal: bool,
    dtype: str,
    dp: int,
    cluster: Any | None,
) -> dict[str, Any]:
    """One bench result: measured min/median, bytes per stage (worst rank) and the prediction."""
    times = res[0]["times"]  # already the slowest rank per repeat
    nbytes = {s: max(x["bytes"].get(s, 0) for x in res) for s in STAGES}
    out: dict[str, Any] = {
        "ulysses": u,
        "ring": r,
        "dp": dp,
        "seq_len": n,
        "heads": h,
        "kv_heads": kv,
        "head_dim": d,
        "causal": causal,
        "dtype": dtype,
        "kernel": res[0]["kernel"],
        "device": res[0]["device"],
        "repeats": len(times),
        "times_s": times,
        "measured_s": statistics.median(times),
        "measured_min_s": min(times),
        "bytes_per_rank": nbytes,
        "predicted_s": None,
        "predicted_bytes": None,
        "load": list(os.getloadavg()),
    }
    if cluster is not None:
        out.update(_prediction(cluster, res[0].get("probe_s"), out))
    return out


def _prediction(cluster: Any, probe_s: float | None, measured: dict[str, Any]) -> dict[str, Any]:
    """The planner's figures for the measured case, and (with a calibration) the load-adjusted ones."""
    from topology.cost import estimate
    from topology.model_shape import ModelShape
    from topology.traffic import comm_bytes
    from topology.units import dtype_bytes

    m = measured
    h, kv, d, n, u, r, dtype = (m[k] for k in ("heads", "kv_heads", "head_dim", "seq_len", "ulysses", "ring", "dtype"))
    est = estimate(
        cluster,
        ModelShape(heads=h, kv_heads=kv, head_dim=d, layers=1),
        n,
        u,
        r,
        m["dp"],
        dtype=dtype,
        causal=m["causal"],
    )
    out: dict[str, Any] = {
        "predicted_s": est.attention_time_s,
        "predicted_bytes": comm_bytes(h, kv, d, n, 1, u, r, dtype_bytes(dtype)),
        "predicted_parts": {
            "kernels": est.attention_s,
            "fixed_merge_copy": est.ring_overhead_s,
            "a2a": est.a2a_s,
            "ring_exposed": est.ring_exposed_s,
        },
        "error": est.attention_time_s / m["measured_s"] - 1,
        "notes": list(est.notes),
    }
    cal = cluster.calibration
    if cal is not None and cal.probe_s and probe_s:
        # On a machine shared with other jobs a rank's share changes between calibration and bench;
        # the reference kernel timed around the bench says by how much.
        out["load_factor"] = probe_s / cal.probe_s
        out["predicted_load_adjusted_s"] = est.attention_time_s * out["load_factor"]
        out["error_load_adjusted"] = out["predicted_load_adjusted_s"] / m["measured_s"] - 1
    return out


def format_bench(out: dict[str, Any]) -> str:
    """The human table of one bench result."""
    lines = [
        f"hybrid-cp bench: ulysses={out['ulysses']} ring={out['ring']} dp={out['dp']}, {out['seq_len']} tokens, "
        f"H={out['heads']} H_kv={out['kv_heads']} D={out['head_dim']} {'causal' if out['causal'] else 'full'} "
        f"{out['dtype']}, kernel {out['kernel']} on {out['device']}",
        f"  measured  (fwd+bwd, slowest rank): min {out['measured_min_s'] * 1e3:.1f} ms, median "
        f"{out['measured_s'] * 1e3:.1f} ms over {out['repeats']} repeats",
    ]
    if out["predicted_s"] is not None:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in out["predicted_parts"].items())
        lines.append(f"  predicted (cluster file): {out['predicted_s'] * 1e3:.1f} ms ({out['error']:+.0%}): {parts} ms")
        if out.get("load_factor"):
            lines.append(
                f"  reference kernel {out['load_factor']:.2f}x its calibration time (machine shared with other "
                f"jobs): load-adjusted prediction {out['predicted_load_adjusted_s'] * 1e3:.1f} ms "
                f"({out['error_load_adjusted']:+.0%})"
            )
    else:
        lines.append("  predicted: pass --cluster FILE (from hybrid-cp calibrate) for the planner's prediction")
    rows = [["measured", *(out["bytes_per_rank"][s] for s in STAGES)]]
    if out.get("predicted_bytes"):
        rows.append(["cost model", *(out["predicted_bytes"][s] for s in STAGES)])
    lines += table_lines(["bytes sent per rank", *STAGES], rows, formats=["", *[","] * len(STAGES)], indent="  ")
    lines += [f"  note: {n}" for n in out.get("notes") or []]
    return "\n".join(lines)


COMMAND = Command(
    "bench",
    "time one attention fwd+bwd per rank next to the plan's prediction",
    "Time one attention forward + backward per rank on this machine and put the planner's prediction next to it.",
    add_arguments,
    run,
)
main = COMMAND.main
