"""Train a small random-initialised Llama-style model on long sequences with hybrid context parallelism.

Launch with torchrun, on one node or many (NCCL on GPU, gloo on CPU):

    # 8 CPU processes on this machine: ulysses 2 x ring 4, 16K-token sequences
    torchrun --nproc_per_node 8 examples/train_llama.py --ulysses 2 --ring 4 --seq-len 16384 --device cpu

    # 2 nodes x 8 GPUs: ulysses inside a node, ring across nodes (see examples/slurm_train.sh)
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        examples/train_llama.py --ulysses 8 --ring 2 --seq-len 262144 --dtype bf16 --checkpoint-activations

Data: byte-level tokens of the Python standard library's source files, which exist on every
machine without a download. Each dp replica reads different windows; the cp ranks of one
replica share one sequence, sharded by `hcp.shard_batch`. Which windows a step reads depends on
the global step only (`hcp.replica_samples`), so a run resumed on another mesh sees the same data.

Checkpoints and restarts (docs/training.md): `--save-dir DIR --save-every K --resume` writes a
sharded checkpoint every K steps and, at start, continues from the newest complete one in DIR, so
the same command line serves the first launch and every `torchrun --max-restarts N` restart:

    torchrun --nproc_per_node 4 --max-restarts 3 examples/train_llama.py --ulysses 2 --ring 2 \
        --device cpu --save-dir ckpt --save-every 50 --keep 3 --resume --metrics metrics.jsonl

The five lines that make a transformers model context parallel are marked "CP:" below.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients, shard_model
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.data import sample_batch, stdlib_corpus
from hybrid_cp.training.batch import shard_batch
from hybrid_cp.training.checkpoint import load_checkpoint, replica_samples, restart_store, save_checkpoint
from hybrid_cp.training.loss import cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ulysses",
        type=int,
        default=None,
        help="ulysses degree (intra-node all-to-all); default: GPUs/processes per node, at most the heads",
    )
    p.add_argument("--ring", type=int, default=None, help="ring degree (across nodes); default: the rest of the world")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence (default 16384)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--batch", type=int, default=1, help="sequences per dp replica and step (default 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="compute dtype (bf16: FSDP2 mixed precision, fp32 master weights and gradient reduction)",
    )
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute each decoder layer in backward")
    p.add_argument(
        "--tiled-loss",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="TOKENS",
        help="loss from the final hidden states in chunks of TOKENS tokens (default chunk: 256 MiB of fp32 "
        "logits), never the full [tokens, vocab] logits (hcp.lm_loss)",
    )
    p.add_argument(
        "--head-chunks",
        type=int,
        default=1,
        metavar="K",
        help="run each attention module's heads in K chunks from the Q/K/V projections on (less attention "
        "memory; each chunk is recomputed in backward)",
    )
    p.add_argument(
        "--tiled-mlp",
        type=int,
        default=0,
        metavar="TOKENS",
        help="run each MLP over chunks of TOKENS tokens with recomputation (hcp.tile_mlp; 0: off)",
    )
    p.add_argument(
        "--offload-checkpoints",
        action="store_true",
        help="keep each checkpointed layer's input in host memory (hcp.offload_checkpoints; needs "
        "--checkpoint-activations)",
    )
    p.add_argument(
        "--tiled-norm",
        type=int,
        default=0,
        metavar="TOKENS",
        help="run each RMSNorm over chunks of TOKENS tokens with recomputation (hcp.tile_norm; 0: off)",
    )
    p.add_argument(
        "--no-fsdp", action="store_true", help="replicate the weights and average gradients instead of FSDP2"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warmup steps (default 0)")
    p.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="learning rate after the warmup: constant, or cosine down to lr/10 at --steps",
    )
    add_checkpoint_args(p)
    args = p.parse_args(argv)
    if args.resume and not args.save_dir:
        p.error("--resume continues from the newest checkpoint in --save-dir DIR: pass --save-dir")
    if args.save_every < 0 or (args.keep is not None and args.keep < 1):
        p.error(f"--save-every {args.save_every} / --keep {args.keep}: --save-every >= 0, --keep >= 1")
    if args.offload_checkpoints and not args.checkpoint_activations:
        p.error("--offload-checkpoints moves what checkpointing keeps: add --checkpoint-activations")
    return args


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and restarts")
    g.add_argument(
        "--save-dir",
        default=None,
        metavar="DIR",
        help="write sharded checkpoints to DIR/step-NNNNNNNN (a folder every rank sees)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="K",
        help="checkpoint every K optimizer steps and after the last (0: only after the last)",
    )
    g.add_argument("--keep", type=int, default=None, metavar="N", help="keep only the newest N checkpoints")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --save-dir if there is one, else start "
        "fresh (the same command line for the first launch and every torchrun restart)",
    )
    g.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help='rank 0 appends one JSON object per optimizer step: {"step", "loss", "lr", "time"}',
    )


def lr_schedule(opt: torch.optim.Optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup then constant or cosine; part of the checkpoint (resume continues the curve)."""

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        if args.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def replica_batch(corpus: torch.Tensor, step: int, args, cp) -> dict:
    """This dp replica's full sequences at optimizer step `step`: one window per global sample index."""
    parts = [
        sample_batch(corpus, i, 1, args.seq_len, args.seed)["input_ids"]
        for i in replica_samples(step, args.batch * cp.dp_size, cp)
    ]
    ids = torch.cat(parts)
    return {"input_ids": ids, "labels": ids}


def resume(args, model, opt, scheduler, cp) -> int:
    """The optimizer steps already done: those of the newest checkpoint with --resume, else 0."""
    if not args.resume:
        return 0
    os.makedirs(args.save_dir, exist_ok=True)  # a first run: load_checkpoint refuses a folder that does not exist
    info = load_checkpoint(args.save_dir, model, opt, cp, scheduler=scheduler, global_batch=args.batch * cp.dp_size)
    start = info.step if info is not None else 0
    if dist.get_rank() == 0:
        if info is not None:
            print(
                f"resumed from {info.path} (step {info.step}, written on dp={info.dp} ulysses={info.ulysses} "
                f"ring={info.ring})",
                flush=True,
            )
        if args.metrics and os.path.exists(args.metrics):  # the steps after `start` are trained again
            with open(args.metrics) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
            with open(args.metrics, "w") as f:
                f.writelines(kept)
    return start


def after_step(args, done: int, value: float, lr: float, model, opt, scheduler, cp) -> None:
    """Metrics line (rank 0) and, every --save-every steps and after the last, a checkpoint."""
    if args.metrics and dist.get_rank() == 0:
        with open(args.metrics, "a") as f:
            f.write(json.dumps({"step": done, "loss": value, "lr": lr, "time": time.time()}) + "\n")
    if args.save_dir and ((args.save_every and done % args.save_every == 0) or done == args.steps):
        save_checkpoint(
            args.save_dir,
            done,
            model,
            opt,
            cp,
            scheduler=scheduler,
            global_batch=args.batch * cp.dp_size,
            keep=args.keep,
        )


def setup(args):
    """Process group from torchrun's environment (or a 1-process group when run directly)."""
    if "RANK" not in os.environ:  # plain `python examples/train_llama.py`: one process
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
        )
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        sys.exit("--device cuda was asked for but CUDA is not available")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    timeout = datetime.timedelta(minutes=10)
    store = restart_store(timeout)  # torchrun restarts on one node: a store prefix per attempt
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        timeout=timeout,
        **({"device_id": device} if use_cuda else {}),
        **(
            {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
            if store is not None
            else {}
        ),
    )
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ulysses = args.ulysses or max(
        d for d in range(1, min(per_node, args.heads) + 1) if per_node % d == 0 and args.heads % d == 0
    )
    ring = args.ring or world // ulysses
    return device, ulysses, ring


def main(argv=None) -> int:
    args = parse_args(argv)
    device, ulysses, ring = setup(args)
    cp = hcp.init_cp_mesh(ulysses=ulysses, ring=ring, device=device)  # CP: the mesh
    rank0 = dist.get_rank() == 0
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rope_theta=500000.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(device):
        model = LlamaForCausalLM(config).float()
    model.train()
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_context_parallel(model, cp, head_chunks=args.head_chunks)  # CP: attention -> hcp.attention
    if args.tiled_mlp:
        hcp.tile_mlp(model, args.tiled_mlp)  # MLP one token chunk at a time
    if args.tiled_norm:
        hcp.tile_norm(model, args.tiled_norm)  # RMSNorm one token chunk at a time
    if args.offload_checkpoints:
        hcp.offload_checkpoints(model)  # layer inputs in host memory
    if args.no_fsdp:
        model.to(DTYPES[args.dtype])
    else:
        kwargs = {}
        if args.dtype != "fp32":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[args.dtype], reduce_dtype=torch.float32)
        shard_model(model, cp, **kwargs)  # CP: FSDP2 over dp x cp
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = lr_schedule(opt, args)
    start = resume(args, model, opt, scheduler, cp)  # --resume: the newest checkpoint
    corpus = stdlib_corpus()
    n_params = sum(p.numel() for p in model.parameters())
    if rank0:
        print(
            f"{cp} world={dist.get_world_size()} params={n_params / 1e6:.2f}M seq_len={args.seq_len} "
            f"batch={args.batch}/replica dtype={args.dtype} fsdp={not args.no_fsdp} "
            f"checkpoint_activations={args.checkpoint_activations} "
            f"tiled_loss={args.tiled_loss is not None} tiled_mlp={args.tiled_mlp or 'off'} head_chunks={args.head_chunks} "
            f"offload_checkpoints={args.offload_checkpoints} tiled_norm={args.tiled_norm or 'off'}",
            flush=True,
        )

    progress = contextlib.nullcontext()
    bar = None
    if rank0:
        try:
            from tqdm import tqdm

            bar = progress = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
        except ImportError:
            pass
    tokens_per_step = args.seq_len * args.batch * cp.dp_size
    value = float("nan")
    with progress:
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            full = replica_batch(corpus, step, args, cp)  # defined by the global step
            local = shard_batch(full, cp)  # CP: shift labels, shard
            if args.tiled_loss is not None:  # no [tokens, vocab] logits
                loss = hcp.lm_loss(model, local, cp, chunk_tokens=args.tiled_loss or None, include_dp=True)
            else:
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
                loss = cross_entropy(logits, local["labels"], cp, include_dp=True)  # CP: global token mean
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if args.no_fsdp:
                average_gradients(model)  # = DDP's average; exact with hcp.cross_entropy's convention
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            lr = scheduler.get_last_lr()[0]
            opt.step()
            scheduler.step()
            value = loss.item()  # identical on every rank; also synchronises the step
            after_step(args, step + 1, value, lr, model, opt, scheduler, cp)
            dt = time.perf_counter() - t0
            if rank0:
                stats = f"loss={value:.4f} tok/s={tokens_per_step / dt:,.0f}"
                if bar is not None:
                    bar.set_postfix_str(stats)
                    bar.update(1)
                else:
                    print(f"step {step + 1}/{args.steps} {stats}", flush=True)
    if rank0:
        print(f"final loss {value:.4f} (bytes: ln 256 = 5.545 is chance)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
