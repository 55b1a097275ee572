"""Soak: many training steps of a tiny model on 4 gloo ranks, a new packed layout every step; is anything growing?

    python benchmarks/soak.py --steps 2000            # the figures of docs/errors.md, "Long runs"

A tiny Mistral (sliding-window attention) under `apply_context_parallel(head_chunks=2)` on a (2, 2) mesh trains
on one packed row per step whose document lengths are random (a new layout, so new plans and permutations,
every step). Every `--every` steps each rank samples its resident memory (VmRSS), its threads, the process
groups and the size of every engine cache; printed: those at a few steps, the RSS slope after warm-up (least
squares), and whether the losses equal those of a shorter run where they overlap. tests/test_soak.py runs a
short version.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.distributed as dist

TOKENS = 64  # tokens per packed row (16 per rank)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def cache_sizes(cp) -> dict[str, int]:
    """How many entries each engine cache and record holds now."""
    from hybrid_cp.engine import heads, layout, ring
    from hybrid_cp.engine.agreement import history
    from hybrid_cp.engine.layout import recorded_lengths
    from topology import layouts

    hist = history(cp)
    return {
        "layout perms": layout._perm.cache_info().currsize,
        "ring plans": ring._plan.cache_info().currsize,
        "head maps": heads._head_map.cache_info().currsize,
        "topology layouts": layouts.make_layout.cache_info().currsize,
        "shard records (dense)": sum(len(v) for v in recorded_lengths(cp).values()),
        "shard records (packed)": len(layout._RECORDS[cp].packed) if cp in layout._RECORDS else 0,
        "validation history": len(hist.signatures),
        "validation fields": len(hist.fields),
    }


def _row(step: int, seed: int) -> dict:
    """One packed row of TOKENS tokens with random document lengths (a new layout every step)."""
    rng = random.Random(seed * 100003 + step)
    cuts = sorted(rng.sample(range(1, TOKENS), rng.randint(1, 7)))
    cu = [0, *cuts, TOKENS]
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return {"input_ids": torch.randint(1, 200, (1, TOKENS), generator=g), "cu_seq_lens_q": torch.tensor(cu)}


def run_rank(steps: int, every: int, seed: int = 0) -> dict:
    """Train `steps` steps on this rank; samples every `every` steps (and at the last)."""
    import hybrid_cp as hcp
    from hybrid_cp.integrations.transformers import apply_context_parallel
    from hybrid_cp.testing.families import tiny_model

    torch.manual_seed(seed)
    cp = hcp.init_cp_mesh(2, 2)
    model = apply_context_parallel(tiny_model("mistral", seed=seed, sliding_window=8), cp, head_chunks=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, samples = [], []
    for step in range(1, steps + 1):
        out = model(**hcp.shard_batch(_row(step, seed), cp), use_cache=False)
        out.loss.backward()
        for p in model.parameters():  # no dp: the cp ranks' gradients are summed as DDP/FSDP2 would average them
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp.cp_group)
                p.grad /= cp.size
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if step % every == 0 or step == steps:
            samples.append(
                {
                    "step": step,
                    "rss_kib": _status("VmRSS"),
                    "threads": _status("Threads"),
                    "groups": len(dist.distributed_c10d._world.pg_map),
                    **cache_sizes(cp),
                }
            )
    hcp.destroy_cp_mesh(cp)
    return {"losses": losses, "samples": samples}


def rss_slope(samples: list[dict], after: int) -> float:
    """KiB per 1,000 steps of a least-squares line through the RSS samples after step `after`."""
    pts = [(s["step"], s["rss_kib"]) for s in samples if s["step"] >= after]
    if len(pts) < 2:
        return 0.0
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    return 1000 * sum((x - mx) * (y - my) for x, y in pts) / var if var else 0.0


def main(argv: list[str] | None = None) -> None:
    from hybrid_cp.testing import WorkerPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--short", type=int, default=100, help="steps of the shorter run whose losses must match")
    a = p.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    with WorkerPool(4, extra_paths=[here]) as pool:
        short = pool.run(run_rank, steps=a.short, every=a.short, timeout=3600)
        long = pool.run(run_rank, steps=a.steps, every=a.every, timeout=36000)
    samples = long[0]["samples"]
    keys = [k for k in samples[0] if k != "step"]
    print("step " + " ".join(f"{k:>22s}" for k in keys))
    for s in samples:
        if s["step"] in (a.every, 100, 500, 1000, 2000, a.steps):
            print(f"{s['step']:4d} " + " ".join(f"{s[k]:>22d}" for k in keys))
    for rank, res in enumerate(long):
        print(f"rank {rank}: RSS slope after step 200: {rss_slope(res['samples'], 200):+.1f} KiB per 1,000 steps")
    same = all(res["losses"][: a.short] == ref["losses"] for res, ref in zip(long, short))
    print(f"losses of the first {a.short} steps equal those of a {a.short}-step run: {same}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
