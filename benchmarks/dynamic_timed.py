"""Dynamic degrees timed on this machine: world 2 (degrees 1 and 2), one thread per rank, a tiny Llama.

For one global batch (one document longer than C among short ones), a step's forward + backward over all
its micro-batches: on the fixed split (2, 1) and (1, 2) (rows of 2C tokens packed first-fit decreasing)
and on the dynamic schedule (short documents alone on one rank, the long one on 2). The three run
interleaved (A B C A B C ...) after a warm-up; the ratio static / dynamic per round, then its median and
spread, next to the cost model's predicted ratio (the calibrated CPU cluster,
benchmarks/results/cpu8_calibrated.yaml; per layer, one attention layer's time model).

Biases: gloo over loopback makes exchanges relatively dearer than NVLink (inflates what skipping them
saves); two ranks on two cores with one thread each are not oversubscribed, but other processes on the
machine add noise (the load average is printed). A CPU ratio is not a GPU speedup.

    python benchmarks/dynamic_timed.py [--rounds 7] [--out benchmarks/results/dynamic_timed.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

C = 1024
LENGTHS = [1800, 300, 120, 700, 260, 90, 410, 500, 150, 330, 60, 640, 220, 380, 240, 100, 530, 290]
SPLITS = [(2, 1), (1, 2)]
MODEL = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


def _fixed_rows(lengths: list[int], room: int) -> list[list[int]]:
    from topology.schedule_report import pack_rows

    order = sorted(range(len(lengths)), key=lambda d: -lengths[d])
    rows = pack_rows(tuple(lengths), room)  # the same first-fit decreasing, on indices
    out, free = [[] for _ in rows], [room] * len(rows)
    for d in order:
        at = next(i for i, f in enumerate(free) if f >= lengths[d])
        out[at].append(d)
        free[at] -= lengths[d]
    return out


def _run(model, docs, rows, loss_of) -> None:
    import torch

    from hybrid_cp.integrations.transformers import use_mesh
    from hybrid_cp.training.batch import shard_batch

    for mesh, row in rows:
        cu = [0]
        for d in row:
            cu.append(cu[-1] + len(docs[d]))
        batch = {"input_ids": torch.cat([docs[d] for d in row])[None], "cu_seq_lens_q": torch.tensor(cu)}
        with use_mesh(model, mesh):
            local = shard_batch(batch, mesh)
            logits = model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}).logits
            loss_of(logits, local["labels"]).backward()


def timed_rounds(rounds: int) -> dict:
    """On every rank: per round, seconds of a step on each fixed split and on the schedule (rank 0's)."""
    import torch
    import torch.distributed as dist
    import transformers

    import hybrid_cp as hcp
    from hybrid_cp.integrations.transformers import apply_context_parallel

    torch.manual_seed(0)
    model = apply_context_parallel(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).float(), hcp.init_cp_mesh(1, 1)
    )
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, MODEL["vocab_size"], (n,), generator=g) for n in LENGTHS]
    static = {s: hcp.init_cp_mesh(*s) for s in SPLITS}
    meshes = hcp.init_cp_meshes([1, 2], splits={2: (2, 1)})
    sched = hcp.schedule_documents(LENGTHS, meshes, tokens_per_rank=C)
    mine = [(mb.cp, mb.docs) for mb in hcp.micro_batches(sched, meshes) if not mb.idle]
    rows = _fixed_rows(LENGTHS, 2 * C)
    plans = {f"fixed u{u}r{r}": [(static[(u, r)], row) for row in rows] for u, r in SPLITS}  # dp = 1: every row
    plans["dynamic"] = mine
    ce = torch.nn.functional.cross_entropy
    loss_of = lambda logits, labels: ce(logits[0].float(), labels[0], ignore_index=-100, reduction="sum")  # noqa: E731
    times: dict[str, list[float]] = {k: [] for k in plans}
    for i in range(rounds + 1):  # round 0 warms up every path
        for name, rows_of in plans.items():
            dist.barrier()
            t0 = time.perf_counter()
            _run(model, docs, rows_of, loss_of)
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    return times


def predicted() -> dict:
    from topology import Cluster, ModelShape
    from topology.degrees import degree_table, fitted_degree
    from topology.schedule import schedule_step
    from topology.schedule_report import Shape, fixed_traffic

    cluster = Cluster.load(os.path.join(os.path.dirname(__file__), "results", "cpu8_calibrated.yaml"))
    shape = ModelShape(heads=4, kv_heads=2, head_dim=32, hidden=128, layers=2, intermediate=256, vocab=1024)
    table = {d.size: d for d in degree_table(cluster, shape, 2, C, dtype="fp32", memory_budget=1e12)}
    table[2] = fitted_degree(cluster, shape, 2, 2, 1, 2 * C, "fp32")  # the split the timed run uses
    sched = schedule_step(LENGTHS, 2, C, list(table.values()))
    out = {"dynamic": sched.predicted_s}
    for u, r in SPLITS:
        deg = fitted_degree(cluster, shape, 2, u, r, 2 * C, "fp32")
        out[f"fixed u{u}r{r}"] = fixed_traffic(tuple(LENGTHS), 2, C, u, r, Shape(4, 2, 32, 4), deg).predicted_s
    return out


def main() -> None:
    from hybrid_cp.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    load = os.getloadavg()
    pool = WorkerPool(2, threads=1, extra_paths=[os.path.dirname(os.path.abspath(__file__))])
    try:
        times = pool.run(timed_rounds, rounds=args.rounds, timeout=1800)[0]
    finally:
        pool.close()
    pred = predicted()
    lines = [
        f"world 2, one thread per rank, {len(LENGTHS)} documents ({sum(LENGTHS)} tokens), C = {C}; "
        f"{args.rounds} interleaved rounds after a warm-up; load average before {load[0]:.1f}",
        "",
        "| run | median step s | predicted per-layer ms | measured static / dynamic (median, min-max) "
        "| predicted static / dynamic |",
        "|---|---|---|---|---|",
    ]
    for name in times:
        ratio = [a / b for a, b in zip(times[name], times["dynamic"])]
        lines.append(
            f"| {name} | {statistics.median(times[name]):.3f} | {pred[name] * 1e3:.2f} | "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
            f"{pred[name] / pred['dynamic']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
