"""Peak memory of one training step by stage (attention, MLP, loss), measured exactly, beside the
planner's analytic estimate (topology.memory).

CPU: `hybrid_cp.memory.StorageTracker` counts live tensor storage exactly (not RSS). CUDA: the caching
allocator's statistics (`--device cuda`). One process (cp = 1) for the loss/MLP/checkpointing options;
8 gloo processes (`--cp u,r`) for head-chunked attention.

    python benchmarks/memory_step.py --table options        # tiled loss / tiled MLP / checkpointing
    python benchmarks/memory_step.py --table heads           # head_chunks in 1, 2, 4, 8 on 8 gloo ranks
    python benchmarks/memory_step.py --table all --out benchmarks/results/memory_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybrid_cp as hcp  # noqa: E402
from hybrid_cp.memory import CudaStageStats, StorageTracker, mark, mark_stages  # noqa: E402

MiB = 1 << 20

# the measured model: small enough for a 2-core CPU, shaped like a Llama (GQA, SwiGLU, untied head)
SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def build_model(device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides: Any):
    import transformers

    cfg = dict(SHAPE, max_position_embeddings=1 << 16, attention_dropout=0.0, tie_word_embeddings=False,
               rms_norm_eps=1e-5)
    cfg.update(overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(dtype)
    model.train()
    return model


def one_step(model, batch: dict, cp, tracker, *, tiled_loss: bool, loss_chunk: int | None,
             optimizer: torch.optim.Optimizer | None) -> float:
    """Forward, loss, backward (and the optimizer step) with the loss region bracketed as a stage."""
    inner = model.model
    hidden = inner(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    with tracker.stage("loss"):
        h = mark(hidden, tracker, "loss.bwd", "exit")
        if tiled_loss:
            loss = hcp.tiled_cross_entropy(h, model.lm_head.weight, batch["labels"], cp, chunk_tokens=loss_chunk)
        else:
            loss = hcp.cross_entropy(model.lm_head(h), batch["labels"], cp)
        loss = mark(loss, tracker, "loss.bwd", "enter")
    tracker.enter("backward")
    loss.backward()
    tracker.exit("backward")
    if optimizer is not None:
        with tracker.stage("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _mesh(u: int, r: int):
    key = (u, r)
    cache = globals().setdefault("_MESHES", {})
    if key not in cache:
        cache[key] = hcp.init_cp_mesh(u, r)
    return cache[key]


def measure(u: int = 1, r: int = 1, seq_len: int = 4096, layers: int = 2, tiled_loss: bool = False,
            loss_chunk: int | None = 512, tiled_mlp: int = 0, checkpoint: bool = False, head_chunks: int = 1,
            device: str = "cpu", shape: dict | None = None) -> dict:
    """One measured training step (the second: Adam's state exists) on this rank; returns bytes.

    Runs inside a worker of `hybrid_cp.testing.WorkerPool` (gloo is initialised): the model is a
    transformers Llama with `apply_context_parallel` on a (u, r) mesh, replicated weights, AdamW.
    """
    import torch.distributed as dist

    from hybrid_cp.integrations.transformers import apply_context_parallel

    dtype = torch.float32
    cp = _mesh(u, r)
    dev = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    model = build_model(str(dev), dtype, num_hidden_layers=layers, **(shape or {}))
    kwargs = {"head_chunks": head_chunks} if head_chunks != 1 else {}
    apply_context_parallel(model, cp, **kwargs)
    if tiled_mlp:
        hcp.tile_mlp(model, tiled_mlp)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    local = {k: v.to(dev) if isinstance(v, torch.Tensor) else v
             for k, v in hcp.shard_batch({"input_ids": ids}, cp).items()}

    class _Null:  # stage calls of the untracked warm-up step
        def stage(self, name):
            import contextlib

            return contextlib.nullcontext()

        def enter(self, name):
            pass

        def exit(self, name):
            pass

    one_step(model, local, cp, _Null(), tiled_loss=tiled_loss, loss_chunk=loss_chunk, optimizer=opt)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        tracker = CudaStageStats(dev)
        handles = mark_stages(model, tracker)
        base = torch.cuda.memory_allocated(dev)
        one_step(model, local, cp, tracker, tiled_loss=tiled_loss, loss_chunk=loss_chunk, optimizer=opt)
        peak = tracker.finish()
    else:
        tracker = StorageTracker()
        with tracker:
            tracker.track(list(model.parameters()), [list(s.values()) for s in opt.state.values()], local)
            base = tracker.live
            handles = mark_stages(model, tracker)
            one_step(model, local, cp, tracker, tiled_loss=tiled_loss, loss_chunk=loss_chunk, optimizer=opt)
        peak = tracker.peak
    for h in handles:
        h.remove()
    dist.barrier()
    return {"rank": dist.get_rank(), "base": base, "peak": peak, "stages": tracker.report()}
