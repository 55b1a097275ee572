"""`hybrid-cp demo`: train a small Llama-style model with context parallelism on local CPU processes
and on one process, from the same seed, and show the two loss curves side by side.

The CP run uses `ulysses * ring` gloo processes (both degrees > 1), `hcp.shard_batch`,
`apply_context_parallel` (transformers' attention registry -> `hcp.attention`), FSDP2 over the
dp x cp ranks and `hcp.cross_entropy`. The data is real text that every machine has: the Python
standard library's source files, as byte-level tokens (vocabulary 256).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from hybrid_cp.cli import demo

from ..testing.data import VOCAB, build_model, sample_batch, stdlib_corpus, tiny_llama_config
from .command import Command, UsageError
from .table import format_table

__all__ = [
    "COMMAND",
    "VOCAB",
    "build_model",
    "cp_rank_train",
    "main",
    "sample_batch",
    "single_process_train",
    "stdlib_corpus",
    "tiny_llama_config",
]


# --------------------------------------------------------------------------------------- runs


def cp_rank_train(ulysses: int, ring: int, seq_len: int, steps: int, seed: int, lr: float, model_kwargs: dict) -> dict:
    """One rank of the context-parallel run (executed by every process of the pool)."""
    import torch.distributed as dist

    import hybrid_cp as hcp
    from hybrid_cp.integrations.fsdp import shard_model
    from hybrid_cp.integrations.transformers import apply_context_parallel
    from hybrid_cp.training.batch import shard_batch
    from hybrid_cp.training.loss import cross_entropy

    cp = hcp.init_cp_mesh(ulysses, ring)
    cp.validate = False  # the inputs come from shard_batch; skip the per-call agreement check
    corpus = stdlib_corpus()
    model = apply_context_parallel(build_model(tiny_llama_config(seq_len, **model_kwargs), seed), cp)
    shard_model(model, cp)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for step in range(steps):
        local = shard_batch(sample_batch(corpus, step, 1, seq_len, seed), cp)
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = cross_entropy(logits, local["labels"], cp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if cp.rank == 0 and cp.dp_rank == 0:
            print(
                f"  [cp u={ulysses} r={ring}] step {step + 1:3d}/{steps}  loss {value:.4f}  "
                f"{seq_len / times[-1]:8.0f} tok/s",
                flush=True,
            )
    return {"losses": losses, "times": times}


def single_process_train(
    seq_len: int, steps: int, seed: int, lr: float, model_kwargs: dict, threads: int | None = None
) -> dict:
    """The reference: the same model, data and optimizer on one process, no context parallelism."""
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    corpus = stdlib_corpus()
    model = build_model(tiny_llama_config(seq_len, **model_kwargs), seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for step in range(steps):
        ids = sample_batch(corpus, step, 1, seq_len, seed)["input_ids"]
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(
            f"  [1 process] step {step + 1:3d}/{steps}  loss {losses[-1]:.4f}  {seq_len / times[-1]:8.0f} tok/s",
            flush=True,
        )
    return {"losses": losses, "times": times}


def _plot(path: str, ref: list[float], cp: list[float], label: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(ref) + 1)
    ax.plot(steps, ref, "o-", label="1 process", linewidth=2)
    ax.plot(steps, cp, "x--", label=label, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/byte)")
    ax.set_title("hybrid-cp: context-parallel training = single-process training")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ulysses", type=int, default=2, help="ulysses degree (default 2)")
    parser.add_argument("--ring", type=int, default=4, help="ring degree (default 4)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--out", default="hybrid_cp_demo.png", help="PNG of the two loss curves ('' to skip)")


def _train_both(args: argparse.Namespace) -> tuple[dict, dict, float, float]:
    """The CP run on a worker pool, then the single-process run; their results and wall times."""
    from hybrid_cp.testing import WorkerPool

    world = args.ulysses * args.ring
    model_kwargs = {"hidden": args.hidden, "layers": args.layers}
    print(
        f"Training a {args.layers}-layer Llama-style model (hidden {args.hidden}, 4 heads, 2 KV heads, byte "
        f"vocabulary) on {args.seq_len}-token sequences of Python standard-library source, {args.steps} AdamW "
        f"steps, seed {args.seed}:"
    )
    print(
        f"  1) context parallel on {world} local CPU processes (ulysses={args.ulysses} x ring={args.ring}, "
        f"zigzag layout, FSDP2 over all {world} ranks)"
    )
    t0 = time.perf_counter()
    with WorkerPool(world) as pool:
        results = pool.run(
            demo.cp_rank_train,
            timeout=1800,
            ulysses=args.ulysses,
            ring=args.ring,
            seq_len=args.seq_len,
            steps=args.steps,
            seed=args.seed,
            lr=args.lr,
            model_kwargs=model_kwargs,
        )
    cp_wall = time.perf_counter() - t0
    print("  2) the same model, seed and data on 1 process")
    t1 = time.perf_counter()
    ref = single_process_train(args.seq_len, args.steps, args.seed, args.lr, model_kwargs, threads=os.cpu_count() or 1)
    ref_wall = time.perf_counter() - t1
    if any(r["losses"] != results[0]["losses"] for r in results):
        print("warning: the cp ranks reported different losses", file=sys.stderr)
    return results[0], ref, cp_wall, ref_wall


def _report(args: argparse.Namespace, cp: dict, ref: dict, cp_wall: float, ref_wall: float) -> float:
    """Print the two loss curves side by side and the throughput; the largest loss difference."""
    world = args.ulysses * args.ring
    diffs = [abs(a - b) for a, b in zip(cp["losses"], ref["losses"])]
    rows = [[i + 1, a, b, d] for i, (a, b, d) in enumerate(zip(ref["losses"], cp["losses"], diffs))]
    print()
    print(
        format_table(
            ["step", "1 process", f"CP {args.ulysses}x{args.ring}", "|diff|"],
            rows,
            formats=["", ".5f", ".5f", ".2e"],
            align=">>>>",
        )
    )

    def rate(times):  # skip the first step (allocation and thread warm-up) in the throughput
        tail = times[1:] or times
        return args.seq_len * len(tail) / sum(tail)

    print()
    print(f"largest |loss difference| over {args.steps} steps: {max(diffs):.2e}")
    print(
        f"tokens/s: 1 process {rate(ref['times']):,.0f}; CP on {world} processes {rate(cp['times']):,.0f} "
        f"(all {world} share this machine's {os.cpu_count()} cores: the point here is equality, not speed)"
    )
    print(f"wall time: CP run {cp_wall:.0f}s (including process start), 1-process run {ref_wall:.0f}s")
    return max(diffs)


def run(args: argparse.Namespace) -> int:
    """`hybrid-cp demo` on parsed flags: 0 when the CP losses track the single-process losses."""
    for name in ("ulysses", "ring", "seq_len", "steps", "hidden", "layers"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hybrid-cp demo needs transformers: pip install 'hybrid-cp[hf]'", file=sys.stderr)
        return 1
    cp, ref, cp_wall, ref_wall = _train_both(args)
    worst = _report(args, cp, ref, cp_wall, ref_wall)
    if args.out:
        problem = _plot(args.out, ref["losses"], cp["losses"], f"CP ulysses={args.ulysses} x ring={args.ring}")
        print(problem or f"wrote {args.out}")
    ok = worst <= 1e-3 and all(math.isfinite(x) for x in cp["losses"])
    if not ok:
        print("the CP losses do not track the single-process losses", file=sys.stderr)
    return 0 if ok else 1


COMMAND = Command(
    "demo",
    "the README's main job: train a small Llama with CP on 8 CPU processes vs 1",
    __doc__.split("\n\n")[0],
    add_arguments,
    run,
)
main = COMMAND.main
