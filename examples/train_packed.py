"""Train a tiny Llama on packed documents ("padding-free" rows) with hybrid context parallelism.

Each step packs documents of random lengths into ONE row, as transformers' DataCollatorWithFlattening
does (ids concatenated, position ids restarting at 0 in every document, -100 as the label of every
document's first token); `hcp.shard_batch` shards the row over the (ulysses, ring) mesh and returns
the document boundaries, which the model passes to `hcp.attention` so that no token attends across a
document. Afterwards rank 0 trains the same model on one process, one document at a time, and prints
both loss curves: they agree to float rounding (the script exits 1 if they do not).

    # 4 local CPU processes (gloo), ulysses 2 x ring 2
    python examples/train_packed.py --nprocs 4

    # the same under torchrun, any mesh (on GPUs: --device cuda)
    torchrun --nproc_per_node 8 examples/train_packed.py --ulysses 4 --ring 2

Data: byte-level tokens of the Python standard library's sources (no download).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients, shard_model
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing import local_rendezvous
from hybrid_cp.testing.data import build_model, stdlib_corpus, tiny_llama_config
from hybrid_cp.training.batch import shard_batch
from hybrid_cp.training.loss import cross_entropy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nprocs", type=int, default=4, help="without torchrun: start this many local gloo processes (default 4)"
    )
    p.add_argument("--ulysses", type=int, default=2, help="ulysses degree (default 2)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: world // ulysses)")
    p.add_argument("--row-tokens", type=int, default=768, help="tokens per packed row (default 768)")
    p.add_argument("--mean-doc", type=int, default=60, help="mean document length in tokens (default 60)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-fsdp", action="store_true", help="replicate the weights and average gradients instead")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed |cp loss - reference loss| (default 1e-4)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ data


def sample_documents(corpus: torch.Tensor, step: int, row_tokens: int, mean_doc: int, seed: int) -> list[torch.Tensor]:
    """Documents of random (lognormal) lengths, cut from random places of the corpus, that fill one row.

    The same on every rank (seeded by step). A few are 1-3 tokens long, as real packed data has."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    docs, used = [], 0
    while used < row_tokens:
        n = int(torch.empty(1).log_normal_(mean=0.0, std=1.0, generator=g).item() * mean_doc * 0.6) + 1
        if torch.rand(1, generator=g).item() < 0.1:
            n = int(torch.randint(1, 4, (1,), generator=g))
        n = min(n, row_tokens - used)
        start = int(torch.randint(0, corpus.numel() - n, (1,), generator=g))
        docs.append(corpus[start : start + n])
        used += n
    return docs


def flatten_documents(docs: list[torch.Tensor], separator_id: int = -100) -> dict[str, torch.Tensor]:
    """One packed row in DataCollatorWithFlattening's format (our own code, same convention):
    input_ids [1, total], position_ids restarting at 0 per document, labels = ids with
    `separator_id` at every document's first token (so no target crosses into the next document)."""
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = ids.clone()
    labels[pos == 0] = separator_id
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


# ---------------------------------------------------------------------------------------- training


def train_cp(args: argparse.Namespace, device: torch.device, rows: list[dict]) -> list[float]:
    """The context-parallel run: every rank of the mesh takes its shard of each packed row."""
    world = dist.get_world_size()
    ring = args.ring or world // args.ulysses
    cp = hcp.init_cp_mesh(ulysses=args.ulysses, ring=ring, device=device)
    model = build_model(tiny_llama_config(args.row_tokens), args.seed).to(device)
    apply_context_parallel(model, cp)
    if not args.no_fsdp:
        shard_model(model, cp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if dist.get_rank() == 0:
        print(f"{cp}  world={world}  fsdp={not args.no_fsdp}  row={args.row_tokens} tokens", flush=True)
    losses = []
    for step, row in enumerate(rows):
        t0 = time.perf_counter()
        local = shard_batch(row, cp)  # shard + shift labels per document; adds cu_seq_lens_q/k, max_length_q/k
        logits = model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            cu_seq_lens_q=local["cu_seq_lens_q"],
            cu_seq_lens_k=local["cu_seq_lens_k"],
            max_length_q=local["max_length_q"],
            max_length_k=local["max_length_k"],
        ).logits
        loss = cross_entropy(logits, local["labels"], cp)  # token mean over the whole row
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.no_fsdp:
            average_gradients(model)
        opt.step()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            lens = (row["position_ids"][0] == 0).sum().item()
            print(
                f"  [cp] step {step + 1}/{len(rows)}  docs={lens:3d}  loss {losses[-1]:.5f}  "
                f"({time.perf_counter() - t0:.2f} s)",
                flush=True,
            )
    return losses


def train_reference(args: argparse.Namespace, rows: list[dict]) -> list[float]:
    """One process, one document at a time (positions 0..len-1): the token-loss sum over the
    documents divided by the number of valid targets, the same optimizer."""
    model = build_model(tiny_llama_config(args.row_tokens), args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for row in rows:
        starts = torch.nonzero(row["position_ids"][0] == 0).flatten().tolist() + [row["input_ids"].shape[1]]
        total, count = 0.0, 0
        for a, b in zip(starts, starts[1:]):
            logits = model(input_ids=row["input_ids"][:, a:b], position_ids=torch.arange(b - a)[None]).logits
            targets = row["labels"][0, a + 1 : b]
            total = total + F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum")
            count += int((targets != -100).sum())
        loss = total / max(count, 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run(args: argparse.Namespace) -> int:
    """Body of every rank (torchrun or --nprocs); returns the exit code."""
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(minutes=5),
        init_method=os.environ.get("HCP_INIT_METHOD"),
    )  # None under torchrun: env://
    try:
        corpus = stdlib_corpus(1 << 20)
        rows = [
            flatten_documents(sample_documents(corpus, s, args.row_tokens, args.mean_doc, args.seed))
            for s in range(args.steps)
        ]
        t0 = time.perf_counter()
        cp_losses = train_cp(args, device, rows)
        cp_time = time.perf_counter() - t0
        ok = True
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            ref = train_reference(args, rows)
            print(
                f"\nstep  cp loss     1-process per-document loss   |diff|   (cp {cp_time:.1f} s, "
                f"reference {time.perf_counter() - t0:.1f} s)"
            )
            for i, (a, b) in enumerate(zip(cp_losses, ref)):
                print(f"{i + 1:4d}  {a:.6f}    {b:.6f}                      {abs(a - b):.1e}")
            worst = max(abs(a - b) for a, b in zip(cp_losses, ref))
            ok = worst <= args.tol
            print(f"largest difference {worst:.1e} ({'within' if ok else 'ABOVE'} --tol {args.tol:g})", flush=True)
        flag = torch.tensor([int(ok)])
        dist.broadcast(flag, src=0)
        return 0 if flag.item() else 1
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        HCP_INIT_METHOD=f"{init_method}?rank={rank}&world_size={world}",
    )
    code = run(args)
    if code:
        sys.exit(code)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        return run(args)
    init_method, folder = local_rendezvous()
    try:
        torch.multiprocessing.spawn(_spawned, args=(args.nprocs, init_method, args), nprocs=args.nprocs)
    except torch.multiprocessing.ProcessExitedException as exc:
        print(f"a rank failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
