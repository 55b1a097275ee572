"""Predicted vs measured attention time for every (ulysses, ring) of 8 local gloo ranks.

    hybrid-cp calibrate --out benchmarks/results/cpu8_calibrated.yaml --nprocs 8
    python benchmarks/predict_vs_measured.py --cluster benchmarks/results/cpu8_calibrated.yaml \
        --seq-lens 6144 12288 --rounds 3 --out benchmarks/results/predict_vs_measured_cpu8

Runs what `hybrid-cp bench` runs (hybrid_cp.cli.measure.bench_rank, causal GQA fwd+bwd, slowest rank per
repeat) in one pool of 8 processes, in `--rounds` interleaved rounds so that the spread between
rounds shows the machine's noise. Prints and writes a markdown table (measured median/min, noise,
predicted, error, the 1-minute load average after each case: on a shared machine a figure means
little without it) with the rankings, a JSON file, and a plot (matplotlib, if installed; `--plot`,
default docs/predict_vs_measured_cpu8.png, since the repository keeps images under docs/ only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from hybrid_cp.cli import measure

HEADER = [
    "seq_len",
    "u",
    "r",
    "measured median s",
    "min s",
    "round medians s",
    "noise",
    "predicted s",
    "error",
    "probe vs calibration",
    "load-adjusted predicted s",
    "error",
    "load (1 min) per round",
]


def _cells(row: dict) -> list[str]:
    """One case's cells of the markdown table (``-`` where no calibration probe was timed)."""
    adj = (
        [f"{row['load_factor']:.2f}x", f"{row['predicted_load_adjusted_s']:.3f}", f"{row['error_load_adjusted']:+.0%}"]
        if row["load_factor"]
        else ["-", "-", "-"]
    )
    return [
        str(row["seq_len"]),
        str(row["ulysses"]),
        str(row["ring"]),
        f"{row['measured_s']:.3f}",
        f"{row['measured_min_s']:.3f}",
        " / ".join(f"{m:.3f}" for m in row["round_medians_s"]),
        f"{row['noise']:.0%}",
        f"{row['predicted_s']:.3f}",
        f"{row['error']:+.0%}",
        *adj,
        " / ".join(f"{x:.1f}" for x in row["load_1min"]),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True, help="cluster file written by hybrid-cp calibrate")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[6144, 12288])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case per round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (noise = spread of round medians)")
    p.add_argument("--out", help="path prefix for .md and .json")
    p.add_argument("--plot", default="docs/predict_vs_measured_cpu8.png", help="plot file (needs matplotlib)")
    a = p.parse_args()

    from hybrid_cp.cli.bench import summarize
    from hybrid_cp.cli.table import table_lines
    from hybrid_cp.testing import WorkerPool
    from topology.cluster import Cluster

    cluster = Cluster.load(a.cluster)
    splits = [(u, a.world // u) for u in range(a.world, 0, -1) if a.world % u == 0 and u <= a.heads]
    runs: dict[tuple[int, int, int], list[list[float]]] = {}
    summaries: dict[tuple[int, int, int], dict] = {}
    probes: dict[tuple[int, int, int], list[float]] = {}
    loads: dict[tuple[int, int, int], list[float]] = {}  # 1-minute load average after each run
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    with WorkerPool(a.world) as pool:
        for rnd in range(a.rounds):
            for n in a.seq_lens:
                for u, r in splits:
                    res = pool.run(
                        measure.bench_rank,
                        timeout=3600,
                        ulysses=u,
                        ring=r,
                        seq_len=n,
                        heads=a.heads,
                        kv_heads=a.kv_heads,
                        head_dim=a.head_dim,
                        causal=True,
                        repeats=a.repeats,
                        warmup=1,
                    )
                    runs.setdefault((u, r, n), []).append(res[0]["times"])
                    probes.setdefault((u, r, n), []).append(res[0].get("probe_s") or 0.0)
                    loads.setdefault((u, r, n), []).append(os.getloadavg()[0])
                    summaries[(u, r, n)] = summarize(
                        res, u, r, n, a.heads, a.kv_heads, a.head_dim, True, "float32", 1, cluster
                    )
                    print(
                        f"round {rnd + 1} n={n} u={u} r={r}: "
                        + ", ".join(f"{t:.3f}" for t in res[0]["times"])
                        + f" (load {loads[(u, r, n)][-1]:.1f})",
                        flush=True,
                    )
    wall = time.perf_counter() - t0
    rows = []
    for (u, r, n), rounds in runs.items():
        flat = [t for rr in rounds for t in rr]
        meds = [statistics.median(rr) for rr in rounds]
        med = statistics.median(flat)
        pred = summaries[(u, r, n)]["predicted_s"]
        cal_probe = cluster.calibration.probe_s if cluster.calibration is not None else None
        factor = statistics.median(probes[(u, r, n)]) / cal_probe if cal_probe and all(probes[(u, r, n)]) else None
        rows.append(
            {
                "ulysses": u,
                "ring": r,
                "seq_len": n,
                "measured_s": med,
                "measured_min_s": min(flat),
                "round_medians_s": meds,
                "noise": (max(meds) - min(meds)) / med,
                "predicted_s": pred,
                "error": pred / med - 1,
                "parts": summaries[(u, r, n)]["predicted_parts"],
                "load_factor": factor,
                "predicted_load_adjusted_s": pred * factor if factor else None,
                "error_load_adjusted": pred * factor / med - 1 if factor else None,
                "load_1min": loads[(u, r, n)],
            }
        )
    lines = [
        f"causal GQA attention fwd+bwd per rank, H={a.heads}, H_kv={a.kv_heads}, D={a.head_dim}, fp32, "
        f"{a.world} gloo ranks; {a.rounds} rounds x {a.repeats} repeats; prediction from {a.cluster}",
        "",
    ]
    lines += table_lines(HEADER, (_cells(row) for row in rows), markdown=True)
    lines.append("")
    verdicts = []
    for n in a.seq_lens:
        sub = [row for row in rows if row["seq_len"] == n]
        meas = sorted(sub, key=lambda x: x["measured_s"])
        pred = sorted(sub, key=lambda x: x["predicted_s"])
        name = lambda x: f"u{x['ulysses']}r{x['ring']}"  # noqa: E731
        # pairs whose measured difference exceeds both cases' noise must be ordered the same way
        bad = []
        for i, x in enumerate(sub):
            for y in sub[i + 1 :]:
                gap = abs(x["measured_s"] - y["measured_s"]) / min(x["measured_s"], y["measured_s"])
                if gap > max(x["noise"], y["noise"]) and (x["measured_s"] < y["measured_s"]) != (
                    x["predicted_s"] < y["predicted_s"]
                ):
                    bad.append(f"{name(x)} vs {name(y)} ({gap:.0%} apart)")
        worst = max(abs(x["error"]) for x in sub)
        adj = [abs(x["error_load_adjusted"]) for x in sub if x["error_load_adjusted"] is not None]
        verdicts.append(
            f"seq_len {n}: measured order {' < '.join(map(name, meas))}; predicted order "
            f"{' < '.join(map(name, pred))}; worst error {worst:.0%}"
            + (f" (load-adjusted {max(adj):.0%})" if adj else "")
            + "; pairs ordered wrongly beyond noise: "
            f"{', '.join(bad) or 'none'}"
        )
    lines += verdicts
    lines.append(
        f"\nwall time {wall:.0f} s; load average (1 min) {load0[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(text + "\n")
        with open(a.out + ".json", "w") as f:
            json.dump({"rows": rows, "verdicts": verdicts, "cluster": a.cluster, "wall_s": wall}, f, indent=2)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
            return
        fig, axes = plt.subplots(1, len(a.seq_lens), figsize=(5 * len(a.seq_lens), 4))
        for ax, n in zip(axes if len(a.seq_lens) > 1 else [axes], a.seq_lens):
            sub = [row for row in rows if row["seq_len"] == n]
            labels = [f"u{x['ulysses']} r{x['ring']}" for x in sub]
            xs = range(len(sub))
            med = [x["measured_s"] for x in sub]
            lo = [x["measured_s"] - min(x["round_medians_s"]) for x in sub]
            hi = [max(x["round_medians_s"]) - x["measured_s"] for x in sub]
            ax.bar([i - 0.2 for i in xs], med, 0.4, yerr=[lo, hi], label="measured median (range of rounds)")
            ax.bar([i + 0.2 for i in xs], [x["predicted_s"] for x in sub], 0.4, label="predicted (calibrated)")
            ax.set_xticks(list(xs), labels)
            ax.set_title(f"seq_len {n}")
            ax.set_ylabel("s per attention fwd+bwd")
        axes_list = axes if len(a.seq_lens) > 1 else [axes]
        axes_list[0].legend(fontsize=8)
        fig.suptitle(f"{a.world} gloo ranks on this machine: predicted vs measured")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
