"""Peak memory of one training step by stage (attention, MLP, loss), measured exactly, beside the
planner's analytic estimate (topology.step_model).

CPU: `hybrid_cp.training.memory.StorageTracker` counts live tensor storage exactly (not RSS). CUDA: the caching
allocator's statistics (`--device cuda`). One process (cp = 1) for the loss/MLP/checkpointing options;
8 gloo processes (`--cp u,r`) for head-chunked attention.

    python benchmarks/memory_step.py --table options        # tiled loss / tiled MLP / checkpointing
    python benchmarks/memory_step.py --table runtime         # + offload, tiled norm, head chunks (device and host)
    python benchmarks/memory_step.py --table bf16            # every option in bf16 at u8 r1, u2 r4, u1 r8
    python benchmarks/memory_step.py --table bf16 --alive-at-peak 20   # and what is alive at each peak
    python benchmarks/memory_step.py --table heads           # head_chunks in 1, 2, 4, 8 on 8 gloo ranks
    python benchmarks/memory_step.py --table all --out benchmarks/results/memory_cpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybrid_cp as hcp  # noqa: E402
from hybrid_cp.cli.table import table_lines  # noqa: E402
from hybrid_cp.engine.comm import counters  # noqa: E402
from hybrid_cp.testing.parity import mesh  # noqa: E402  (the worker's cached meshes; the tests release them per module)
from hybrid_cp.training.memory import CudaStageStats, StorageTracker, mark, mark_stages  # noqa: E402

MiB = 1 << 20

# the measured model: small enough for a 2-core CPU, shaped like a Llama (GQA, SwiGLU, untied head)
SHAPE = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


def build_model(device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides: Any):
    import transformers

    cfg = dict(
        SHAPE, max_position_embeddings=1 << 16, attention_dropout=0.0, tie_word_embeddings=False, rms_norm_eps=1e-5
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(dtype)
    model.train()
    return model


def one_step(
    model,
    batch: dict,
    cp,
    tracker,
    *,
    tiled_loss: bool,
    loss_chunk: int | None,
    optimizer: torch.optim.Optimizer | None,
    fsdp: bool = False,
) -> float:
    """Forward, loss, backward (and the optimizer step) with the loss region bracketed as a stage. Under FSDP2
    the root module must run (its hooks gather the embedding and the LM head): `hcp.lm_loss`, no loss stage."""
    if fsdp:
        return _backward_and_step(
            hcp.lm_loss(model, batch, cp, tiled=tiled_loss, chunk_tokens=loss_chunk), tracker, optimizer
        )
    inner = model.model
    hidden = inner(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    with tracker.stage("loss"):
        h = mark(hidden, tracker, "loss.bwd", "exit")
        if tiled_loss:
            loss = hcp.tiled_cross_entropy(h, model.lm_head.weight, batch["labels"], cp, chunk_tokens=loss_chunk)
        else:
            loss = hcp.cross_entropy(model.lm_head(h), batch["labels"], cp)
        loss = mark(loss, tracker, "loss.bwd", "enter")
    del hidden, h  # as in hcp.lm_loss: the final hidden states live only in the loss's graph, freed by its backward
    return _backward_and_step(loss, tracker, optimizer)


class NullTracker:
    """The tracker's stage calls, doing nothing: the untracked warm-up step."""

    def stage(self, name):
        return contextlib.nullcontext()

    def enter(self, name):
        pass

    def exit(self, name):
        pass


def _backward_and_step(loss: torch.Tensor, tracker, optimizer: torch.optim.Optimizer | None) -> float:
    """The step's backward and optimizer stages, bracketed for the tracker."""
    tracker.enter("backward")
    loss.backward()
    tracker.exit("backward")
    if optimizer is not None:
        with tracker.stage("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.item()


class _engine_stage:
    """Bracket every `hcp.attention` call of the transformers integration as the stage "engine" (forward)
    and "engine.bwd" (backward): the engine's own working set, without the Q/K/V projections (with
    module-level head chunks: the chunk pipeline, whose projections run inside it)."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        import hybrid_cp.integrations.transformers as tf

        self.module, self.original = tf, tf.run_attention
        tracker, original = self.tracker, self.original

        def wrapped(q, k, v, cp, spec, sinks):
            q, k, v = (mark(x, tracker, "engine.bwd", "exit") for x in (q, k, v))
            with tracker.stage("engine"):
                out = original(q, k, v, cp, spec, sinks)
            return mark(out, tracker, "engine.bwd", "enter")

        def wrapped_chunks(project, q_ranges, kv_counts, cp, engine_chunks, inputs, *rest, **kw):
            # module-level head chunks: the pipeline holds the engine and each chunk's projections
            inputs = [mark(x, tracker, "engine.bwd", "exit") for x in inputs]
            with tracker.stage("engine"):
                out = original_chunks(project, q_ranges, kv_counts, cp, engine_chunks, inputs, *rest, **kw)
            return mark(out, tracker, "engine.bwd", "enter")

        original_chunks = self.original_chunks = tf.pipelined_module_chunks
        tf.run_attention, tf.pipelined_module_chunks = wrapped, wrapped_chunks
        return self

    def __exit__(self, *exc):
        self.module.run_attention, self.module.pipelined_module_chunks = self.original, self.original_chunks


def measure(
    u: int = 1,
    r: int = 1,
    seq_len: int = 4096,
    layers: int = 2,
    tiled_loss: bool = False,
    loss_chunk: int | None = 512,
    tiled_mlp: int = 0,
    checkpoint: bool = False,
    head_chunks: int = 1,
    device: str = "cpu",
    shape: dict | None = None,
    offload: bool = False,
    tiled_norm: int = 0,
    dtype: str = "fp32",
    fsdp: bool = False,
    alive_at_peak: int = 0,
) -> dict:
    """One measured training step (the second: Adam's state exists) on this rank; returns bytes (`peak`:
    all live storage; `device_peak` and `host_peak`: outside and inside the offload's host buffers) and, with
    `alive_at_peak`, that many of the largest groups of storages alive at the device peak (CPU only).

    Runs inside a worker of `hybrid_cp.testing.WorkerPool` (gloo is initialised): the model is a
    transformers Llama with `apply_context_parallel` on a (u, r) mesh, replicated weights in `dtype` ("fp32" or
    "bf16": the model cast to it, AdamW's state in it too: the planner's `master_weights=False`), AdamW. With
    `fsdp`, FSDP2 over all ranks instead (`shard_model`), fp32 master weights, computing in `dtype`
    (mixed precision, gradients reduced in fp32).
    """
    import torch.distributed as dist

    from hybrid_cp.integrations.transformers import apply_context_parallel

    cp = mesh(u, r)
    dev = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model(str(dev), torch.float32 if fsdp else compute, num_hidden_layers=layers, **(shape or {}))
    kwargs = {"head_chunks": head_chunks} if head_chunks != 1 else {}
    apply_context_parallel(model, cp, **kwargs)
    if tiled_mlp:
        hcp.tile_mlp(model, tiled_mlp)
    if tiled_norm:
        hcp.tile_norm(model, tiled_norm)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        hcp.offload_checkpoints(model, prefetch=True)  # the CUDA default; on CPU the same order, synchronous
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from hybrid_cp.integrations.fsdp import shard_model

        shard_model(model, cp, mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    local = {
        k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in hcp.shard_batch({"input_ids": ids}, cp).items()
    }

    one_step(model, local, cp, NullTracker(), tiled_loss=tiled_loss, loss_chunk=loss_chunk, optimizer=opt, fsdp=fsdp)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        tracker = CudaStageStats(dev)
        handles = mark_stages(model, tracker)
        base = torch.cuda.memory_allocated(dev)
        one_step(model, local, cp, tracker, tiled_loss=tiled_loss, loss_chunk=loss_chunk, optimizer=opt)
        peak = tracker.finish()
    else:
        tracker = StorageTracker(record_peak=alive_at_peak > 0)
        with tracker, _engine_stage(tracker):
            tracker.track(_locals(model.parameters()), [_locals(s.values()) for s in opt.state.values()], local)
            if offload:  # the host buffers the first step left in the pool: held from the start
                from hybrid_cp.training.offload import offloader_of

                tracker.track(offloader_of(model).pool.free)
            base = tracker.live
            handles = mark_stages(model, tracker)
            one_step(model, local, cp, tracker, tiled_loss=tiled_loss, loss_chunk=loss_chunk, optimizer=opt, fsdp=fsdp)
        peak = tracker.peak
    split = {"device_peak": getattr(tracker, "device_peak", peak), "host_peak": getattr(tracker, "host_peak", 0)}
    for h in handles:
        h.remove()
    dist.barrier()
    if alive_at_peak and dev.type == "cpu":
        split["alive_at_peak"] = [g.__dict__ for g in tracker.alive_at_peak()[:alive_at_peak]]
    return {"rank": dist.get_rank(), "base": base, "peak": peak, "stages": tracker.report(), **split}


def _locals(tensors) -> list:
    """The tensors, FSDP2's sharded DTensors as their local shards (the storage a rank holds)."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def time_overlap(
    level: str = "engine",
    u: int = 2,
    r: int = 1,
    heads: int = 16,
    kv_heads: int = 4,
    head_dim: int = 64,
    hidden: int = 1024,
    seq_len: int = 4096,
    chunks: tuple = (2, 4),
    repeats: int = 5,
) -> dict:
    """Forward + backward of one head-chunked call, overlapped and serial schedules interleaved in every
    repeat (so load changes hit both alike): per schedule, this rank's wall times and the time it sat in
    head-chunk all-to-all waits (the communication the schedule left exposed). `level="engine"`: one
    hcp.attention call; `"module"`: one attention module of a Llama layer with module-level chunks (the
    projections inside the pipeline). Runs in a WorkerPool worker."""
    import time

    import torch.distributed as dist

    cp = mesh(u, r)
    g = torch.Generator().manual_seed(cp.rank)
    if level == "engine":
        cp, (q, k, v, dout) = _attention_case(u, r, heads, kv_heads, head_dim, seq_len)

        def run(kc, overlap):
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            hcp.attention(*xs, cp, causal=True, head_chunks=kc, overlap=overlap).backward(dout)
    else:
        from hybrid_cp.integrations.transformers import apply_context_parallel

        shape = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden)
        modules = {}
        for kc, overlap, _ in _schedules((1,) + tuple(chunks)):
            model = build_model("cpu", torch.float32, num_hidden_layers=1, **shape)
            modules[kc, overlap] = (
                apply_context_parallel(model, cp, head_chunks=kc, overlap=overlap).model.layers[0].self_attn
            )
        hidden_x = torch.randn(1, seq_len // cp.size, hidden, generator=g)
        dout = torch.randn(hidden_x.shape, generator=g)
        pe = model.model.rotary_emb(hidden_x, hcp.positions(seq_len, cp)[None])

        def run(kc, overlap):
            x = hidden_x.clone().requires_grad_()
            modules[kc, overlap](hidden_states=x, position_embeddings=pe, attention_mask=None)[0].backward(dout)

    out: dict[str, list] = {}
    for rep in range(repeats + 1):  # the first round warms up (kernels, buffers) and is dropped
        for kc, overlap, name in _schedules((1,) + tuple(chunks)):
            dist.barrier()
            counters(cp).chunk_wait_s = 0.0
            t0 = time.perf_counter()
            run(kc, overlap)
            wall = time.perf_counter() - t0
            dist.barrier()
            if rep:
                out.setdefault(name, []).append((wall, counters(cp).chunk_wait_s))
    return out


def _attention_case(
    u: int, r: int, heads: int, kv_heads: int, head_dim: int, seq_len: int, dtype: torch.dtype = torch.float32
):
    """The mesh and this rank's shards of fixed random q, k, v and dout."""
    cp = mesh(u, r)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, n, head_dim, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads, heads)]
    return cp, [hcp.shard(x, cp, dim=1) for x in full]


def _schedules(chunks: tuple):
    """(head_chunks, overlapped, result key): both schedules for every k > 1."""
    for kc in chunks:
        for overlap in (True, False) if kc > 1 else (True,):
            yield kc, overlap, f"{kc}{'' if overlap else '-serial'}"


def engine_memory(
    u: int = 4,
    r: int = 2,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 16,
    seq_len: int = 8192,
    chunks: tuple = (1, 2, 4, 8),
    dtype: str = "fp32",
) -> dict:
    """Exact working set of one hcp.attention call (forward, then backward) per head_chunks, with and without
    the overlap: bytes allocated above the inputs, including the output (forward) and the input gradients
    (backward), in `dtype` ("fp32" or "bf16"). Runs in a WorkerPool worker."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cp, (q, k, v, dout) = _attention_case(u, r, heads, kv_heads, head_dim, seq_len, dt)
    res = {"output": q.numel() * dt.itemsize, "input_grads": (q.numel() + k.numel() + v.numel()) * dt.itemsize}
    for kc, overlap, name in _schedules(chunks):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        t = StorageTracker()
        with t:
            t.track(xs, dout)
            ins = [mark(x, t, "bwd", "exit") for x in xs]
            with t.stage("fwd"):
                out = hcp.attention(*ins, cp, causal=True, head_chunks=kc, overlap=overlap)
            mark(out, t, "bwd", "enter").backward(dout)
        rep = t.report()
        res[name] = (rep["fwd"]["transient"], rep["bwd"]["transient"])
    return res


def _module_case(
    u: int, r: int, seq_len: int, head_chunks: int, keep: bool | None, dtype: torch.dtype, overlap: bool = False
):
    """One attention module of the HEADS_SHAPE model under apply_context_parallel on a (u, r) mesh, and this
    rank's hidden states (requiring a gradient), d(output), rotary tables and the module's weights."""
    from hybrid_cp.integrations.transformers import apply_context_parallel

    cp = mesh(u, r)
    model = build_model("cpu", dtype, num_hidden_layers=1, **HEADS_SHAPE)
    apply_context_parallel(model, cp, head_chunks=head_chunks, keep_attention_output=keep, overlap=overlap)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(cp.rank)
    hidden = torch.randn(1, seq_len // cp.size, model.config.hidden_size, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(hidden.shape, generator=g).to(dtype)
    pe = model.model.rotary_emb(hidden, hcp.positions(seq_len, cp)[None])
    return attn, hidden, dout, pe, list(attn.parameters())


def module_memory(
    u: int = 4, r: int = 2, seq_len: int = 8192, chunks: tuple = (1, 2, 4, 8), keep: bool | None = None
) -> dict:
    """Exact memory of one attention module (Q/K/V projections, rotary, hcp.attention, output projection) of
    the HEADS_SHAPE model, forward then backward, per head_chunks as `apply_context_parallel` runs them
    (module-level chunks): what forward leaves alive for backward, and the peak over forward and
    backward, both above the module's inputs; with the sizes of its output, d(input) and the weight
    gradients, which every k allocates alike. `keep`: apply_context_parallel's keep_attention_output (the
    module alone is in no checkpointed layer: None keeps nothing). Runs in a WorkerPool worker."""

    res = {}
    for kc, overlap, name in _schedules(chunks):
        attn, hidden, dout, pe, weights = _module_case(u, r, seq_len, kc, keep, torch.float32, overlap)
        t = StorageTracker()
        with t:
            t.track(hidden, dout, list(pe), weights)
            start = t.live
            out = attn(hidden_states=hidden, position_embeddings=pe, attention_mask=None)[0]
            kept = t.live - start
            out.backward(dout)
        res[name] = {
            "kept": kept,
            "peak": t.peak - start,
            "output": out.numel() * 4,
            "input_grad": hidden.numel() * 4,
            "weight_grads": sum(p.numel() * 4 for p in weights),
        }
    return res


def module_backward(u: int = 8, r: int = 1, seq_len: int = 16384, head_chunks: int = 4, dtype: str = "bf16") -> dict:
    """One attention module of the HEADS_SHAPE model with module-level chunks that keep their outputs (as in a
    checkpointed layer's recomputation), serial schedule, in `dtype`, after a warm-up: the bytes its forward
    leaves (`kept`, the output included) and the peak of its backward (`bwd_peak`), both above the inputs
    (hidden states, d(output), rotary tables, weights), with the sizes of the output and the weight gradients.
    Runs in a WorkerPool worker."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    attn, hidden, dout, pe, weights = _module_case(u, r, seq_len, head_chunks, True, dt)

    def step():
        attn(hidden_states=hidden, position_embeddings=pe, attention_mask=None)[0].backward(dout)

    t = StorageTracker()
    step()  # warm-up (the serial schedule: apply_context_parallel's default)
    for x in (hidden, *weights):
        x.grad = None
    with t:
        t.track(hidden, dout, list(pe), weights)
        start = t.live
        out = attn(hidden_states=hidden, position_embeddings=pe, attention_mask=None)[0]
        kept = t.live - start
        t.reset_peak()
        out.backward(dout)
    return {
        "kept": kept,
        "bwd_peak": t.peak - start,
        "output": out.numel() * dt.itemsize,
        "weight_grads": sum(w.numel() * dt.itemsize for w in weights),
        "tokens": hidden.shape[1],
    }


OPTION_ROWS = [
    ("plain", dict()),
    ("tiled loss", dict(tiled_loss=True)),
    ("tiled loss + MLP", dict(tiled_loss=True, tiled_mlp=512)),
    ("checkpointing + tiled loss + MLP", dict(checkpoint=True, tiled_loss=True, tiled_mlp=512)),
]
HEADS_TOKENS = 8192
RUNTIME_TOKENS, RUNTIME_LAYERS = 16384, 8
# few parameters for the tokens (hidden 128, SwiGLU 256, vocabulary 1024): with replicated weights each
# layer's gradient appears in backward as its input goes; where a layer's gradient outweighs its input
# the step's peak is the first layer's backward (all gradients, no inputs left) and offload cannot lower it
RUNTIME_SHAPE = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16
)
MODULE_TOKENS = 32768  # long enough that activations, not the fixed weight-sized gradients, dominate
HEADS_SHAPE = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=16, hidden_size=512)


def _estimate(u, r, seq_len, kw, shape=None, dtype: str = "fp32"):
    from topology.model_shape import ModelShape
    from topology.step_model import MemoryOptions, step_memory

    cfg = dict(SHAPE, **(shape or {}))
    model = ModelShape(
        heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        hidden=cfg["hidden_size"],
        layers=kw.get("layers", 2),
        intermediate=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
    )
    opts = MemoryOptions(
        checkpoint=kw.get("checkpoint", False),
        tiled_loss=kw.get("tiled_loss", False),
        loss_chunk=512,
        tiled_mlp=kw.get("tiled_mlp", 0),
        head_chunks=kw.get("head_chunks", 1),
        fsdp=False,
        foreach_optimizer=False,
        offload_checkpoints=kw.get("offload", False),
        tiled_norm=bool(kw.get("tiled_norm", 0)),
        master_weights=dtype == "fp32",
        pin_memory=False,
    )  # the CPU offload's buffers are pageable, exact sizes
    return step_memory(model, seq_len, u, r, 8 // (u * r), 1, opts, dtype=dtype)


def mib(x) -> str:
    return f"{x / MiB:.1f}"


def options_table(pool, raw: dict) -> Iterator[str]:
    """Tiled loss / tiled MLP / checkpointing on u=2 x r=2, measured beside the estimate."""
    yield (
        "### One training step, u=2 x r=2 (dp=2), 4096 and 8192 tokens, fp32, AdamW (exact live storage, MiB "
        "per rank, worst rank)"
    )
    yield ""

    def rows():
        for name, kw in OPTION_ROWS:
            for n in (4096, 8192):
                worst = max(pool.run(measure, u=2, r=2, seq_len=n, loss_chunk=512, **kw), key=lambda x: x["peak"])
                st = worst["stages"]
                est = _estimate(2, 2, n, kw)
                raw[f"options/{name}/{n}"] = {"measured": worst, "estimate": est.to_dict()}

                def tr(key):
                    return mib(st.get(key, {}).get("transient", 0))

                yield [
                    name,
                    str(n),
                    mib(worst["peak"]),
                    mib(est.peak),
                    f"{est.peak / worst['peak'] - 1:+.1%}",
                    f"{tr('attention')} / {tr('attention.bwd')}",
                    f"{tr('mlp')} / {tr('mlp.bwd')}",
                    f"{tr('loss')} / {tr('loss.bwd')}",
                ]

    yield from table_lines(
        [
            "options",
            "tokens",
            "measured peak",
            "estimate",
            "error",
            "attention fwd / bwd",
            "MLP fwd / bwd",
            "loss fwd / bwd",
        ],
        rows(),
        markdown=True,
    )
    yield ""


RUNTIME_BASE = dict(checkpoint=True, tiled_loss=True, tiled_mlp=512, layers=RUNTIME_LAYERS)
RUNTIME_ROWS = [
    ("checkpointing + tiled loss + MLP", RUNTIME_BASE),
    ("+ offload", dict(RUNTIME_BASE, offload=True)),
    ("+ offload + tiled norm", dict(RUNTIME_BASE, offload=True, tiled_norm=512)),
    (
        "+ offload + tiled norm + head chunks 2 (everything)",
        dict(RUNTIME_BASE, offload=True, tiled_norm=512, head_chunks=2),
    ),
]


def runtime_table(pool, raw: dict) -> Iterator[str]:
    """The runtime options (offloaded checkpoints, tiled norm, head chunks) on top of checkpointing and
    tiled loss + MLP: device-resident and host peaks measured beside the estimate's device peak and host bytes."""
    yield (
        f"### Every option, u=2 x r=2 (dp=2), {RUNTIME_TOKENS} tokens, {RUNTIME_LAYERS} layers, hidden 128, 8/2 heads "
        "of 16, SwiGLU 256, vocabulary 1024, fp32, AdamW (exact live storage, MiB per rank, worst rank; device = all "
        "but the offload's host buffers, host = those buffers)"
    )
    yield ""

    def rows():
        for name, kw in RUNTIME_ROWS:
            res = pool.run(
                measure, u=2, r=2, seq_len=RUNTIME_TOKENS, loss_chunk=512, timeout=3600, shape=RUNTIME_SHAPE, **kw
            )
            worst = max(res, key=lambda x: x["device_peak"])
            host = max(x["host_peak"] for x in res)
            est = _estimate(2, 2, RUNTIME_TOKENS, kw, RUNTIME_SHAPE)
            raw[f"runtime/{name}"] = {"measured": worst, "host": host, "estimate": est.to_dict()}
            st = worst["stages"]
            host_err = f"{est.host / host - 1:+.1%}" if host else ("0" if not est.host else "-")
            yield [
                name,
                mib(worst["device_peak"]),
                mib(est.peak),
                f"{est.peak / worst['device_peak'] - 1:+.1%}",
                mib(host),
                mib(est.host),
                host_err,
                mib(st.get("attention.bwd", {}).get("transient", 0)),
            ]

    yield from table_lines(
        ["options", "device peak", "estimate", "error", "host peak", "host estimate", "error", "attention bwd"],
        rows(),
        markdown=True,
    )
    yield ""


BF16_TOKENS, BF16_LAYERS = 16384, 4
# Llama-3-8B's head ratio (32 query / 8 KV heads, so u=8 gives each rank 4 query heads and 1 KV head), few
# parameters for the tokens and a 256-token MLP/norm tile, so that the attention stage, not the MLP or the
# gradients, decides the layer's backward
BF16_SHAPE = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=4
)
BF16_OPTIONS = dict(
    checkpoint=True, tiled_loss=True, tiled_mlp=256, layers=BF16_LAYERS, offload=True, tiled_norm=256, head_chunks=4
)


def bf16_table(pool, raw: dict, alive_at_peak: int = 0) -> Iterator[str]:
    """Every option (offload, tiled norm, tiled MLP, tiled loss, head chunks 4) in bf16 at u8 r1, u2 r4 and
    u1 r8, with the fp32 u8 r1 step beside it: device-resident and host peaks measured beside the estimate.
    The model is cast to the dtype (replicated weights, AdamW's state in it: `master_weights=False`).
    `alive_at_peak`: after the table, the largest groups of tensors alive at each row's worst-rank peak."""
    yield (
        f"### Every option in bf16, {BF16_TOKENS} tokens, {BF16_LAYERS} layers, hidden 128, 32/8 heads of 4, "
        "SwiGLU 256, vocabulary 512, head chunks 4, replicated weights in the compute dtype, AdamW (exact live "
        "storage, MiB per rank, worst rank; device = all but the offload's host buffers)"
    )
    yield ""

    def rows():
        for u, r, dtype in ((8, 1, "bf16"), (2, 4, "bf16"), (1, 8, "bf16"), (8, 1, "fp32")):
            res = pool.run(
                measure,
                u=u,
                r=r,
                seq_len=BF16_TOKENS,
                loss_chunk=512,
                timeout=3600,
                shape=BF16_SHAPE,
                dtype=dtype,
                alive_at_peak=alive_at_peak,
                **BF16_OPTIONS,
            )
            worst = max(res, key=lambda x: x["device_peak"])
            alive.append((f"u={u} r={r} {dtype}, rank {worst['rank']}", worst.get("alive_at_peak", [])))
            host = max(x["host_peak"] for x in res)
            est = _estimate(u, r, BF16_TOKENS, BF16_OPTIONS, BF16_SHAPE, dtype)
            raw[f"bf16/{u}x{r}/{dtype}"] = {"measured": worst, "host": host, "estimate": est.to_dict()}
            yield [
                f"u={u} r={r}",
                dtype,
                mib(worst["device_peak"]),
                mib(est.peak),
                f"{est.peak / worst['device_peak'] - 1:+.1%}",
                est.peak_phase,
                mib(host),
                mib(est.host),
                f"{est.host / host - 1:+.1%}" if host else "-",
            ]

    alive: list = []
    yield from table_lines(
        [
            "mesh",
            "dtype",
            "device peak",
            "estimate",
            "error",
            "estimate's peak phase",
            "host peak",
            "host estimate",
            "error",
        ],
        rows(),
        markdown=True,
    )
    yield ""
    for name, groups in alive if alive_at_peak else ():
        yield f"Alive at the device peak, {name} (MiB, count, shape, dtype, created at):"
        yield from (f"    {mib(g['bytes'])} x{g['count']} {g['shape']} {g['dtype']} {g['site']}" for g in groups)
        yield ""


def heads_table(pool, raw: dict) -> Iterator[str]:
    """head_chunks in 1, 2, 4, 8 on u=4 x r=2, measured beside the estimate."""
    yield (
        f"### Head chunks, u=4 x r=2, 32 heads / 8 KV heads (head_dim 16), {HEADS_TOKENS} tokens, fp32, tiled loss + "
        "MLP, checkpointing (MiB per rank, worst rank; default serial schedule)"
    )
    yield ""

    def rows():
        first = None
        for kc in (1, 2, 4, 8):
            kw = dict(checkpoint=True, tiled_loss=True, tiled_mlp=512, head_chunks=kc)
            worst = max(
                pool.run(
                    measure, u=4, r=2, seq_len=HEADS_TOKENS, loss_chunk=512, shape=HEADS_SHAPE, timeout=3600, **kw
                ),  # slow: the tracker sees every op
                key=lambda x: x["peak"],
            )
            st = worst["stages"]
            est = _estimate(4, 2, HEADS_TOKENS, kw, HEADS_SHAPE)
            raw[f"heads/{kc}"] = {"measured": worst, "estimate": est.to_dict()}
            module_bwd = st["attention.bwd"]["transient"]
            first = first or module_bwd
            yield [
                str(kc),
                mib(worst["peak"]),
                mib(est.peak),
                f"{est.peak / worst['peak'] - 1:+.1%}",
                mib(st["engine"]["transient"]),
                mib(st["engine.bwd"]["transient"]),
                mib(st["attention"]["transient"]),
                mib(module_bwd),
                f"{module_bwd / first - 1:+.0%}",
            ]

    yield from table_lines(
        [
            "head_chunks",
            "measured peak",
            "estimate",
            "error",
            "engine fwd",
            "engine bwd",
            "attention module fwd",
            "attention module bwd",
            "attention module bwd vs k=1",
        ],
        rows(),
        markdown=True,
    )
    yield ""


def module_table(pool, raw: dict, keep: bool | None = None) -> Iterator[str]:
    """The attention module alone, by head_chunks and schedule."""
    res = pool.run(module_memory, seq_len=MODULE_TOKENS, keep=keep, timeout=3600)
    raw["module"] = res
    yield (
        f"### The attention module alone (projections, rotary, hcp.attention, output projection; chunks from "
        f"the projections on), u=4 x r=2, {MODULE_TOKENS} tokens, 32/8 heads, head_dim 16, hidden 512, fp32 (exact MiB "
        "above the module's inputs, worst rank; 'intermediate' = the peak less the output, d(input) and the "
        "weight gradients)"
    )
    yield ""
    worst = {key: max((r_[key] for r_ in res), key=lambda x: x["peak"]) for key in res[0]}
    rows, base = [], None
    for key, w in worst.items():
        kc = int(key.split("-")[0])
        inter = w["peak"] - w["output"] - w["input_grad"] - w["weight_grads"]
        base = base or inter
        sched = "-" if kc == 1 else "serial" if key.endswith("serial") else "overlapped"
        rows.append(
            [
                str(kc),
                sched,
                mib(w["kept"]),
                mib(w["peak"]),
                mib(inter),
                f"{inter / base - 1:+.0%}",
                f"{-0.8 * (1 - 1 / kc):+.0%}",
            ]
        )
    yield from table_lines(
        [
            "head_chunks",
            "schedule",
            "kept after forward",
            "peak over forward + backward",
            "intermediate",
            "vs k=1",
            "target 0.8 x (1 - 1/k)",
        ],
        rows,
        markdown=True,
    )
    yield ""


def engine_table(pool, raw: dict) -> Iterator[str]:
    """One hcp.attention call alone, by head_chunks and overlap."""
    res = pool.run(engine_memory)
    raw["engine"] = res
    yield (
        "### The engine alone: one hcp.attention call, u=4 x r=2, 8192 tokens, 32/8 heads, head_dim 16, "
        "fp32 (exact MiB above the inputs, worst rank; 'intermediate' leaves out the output (forward) "
        "and the input gradients (backward))"
    )
    yield ""
    o, gi = res[0]["output"], res[0]["input_grads"]
    worst = {
        key: (max(r[key][0] for r in res), max(r[key][1] for r in res))
        for key in res[0]
        if key not in ("output", "input_grads")
    }
    f1, b1 = worst["1"][0] - o, worst["1"][1] - gi
    rows = []
    for key, (f, b) in worst.items():
        kc = int(key.split("-")[0])
        fi, bi = f - o, b - gi
        rows.append(
            [
                str(kc),
                "no" if "serial" in key else "yes",
                mib(f),
                mib(b),
                f"{mib(fi)} / {mib(bi)}",
                f"{fi / f1 - 1:+.0%} / {bi / b1 - 1:+.0%}",
                f"{-0.8 * (1 - 1 / kc):+.0%}",
            ]
        )
    yield from table_lines(
        [
            "head_chunks",
            "overlap",
            "forward",
            "backward",
            "intermediate fwd / bwd",
            "vs k=1 fwd / bwd",
            "target 0.8 x (1 - 1/k)",
        ],
        rows,
        markdown=True,
    )
    yield ""


def overlap_tables(pool, raw: dict, u: int, r: int, repeats: int) -> Iterator[str]:
    """Wall time and exposed all-to-all of the serial and overlapped schedules (engine, then module)."""
    for level, what in (
        ("engine", "one hcp.attention call (q, k, v given)"),
        ("module", "one Llama attention module, chunks from the projections on"),
    ):
        res = pool.run(time_overlap, level=level, u=u, r=r, repeats=repeats, timeout=3600)
        raw[f"overlap/{level}"] = res
        yield (
            f"### Overlap, {what}: forward + backward, u={u} x r={r}, 4096 tokens, 16/4 heads x 64, hidden "
            f"1024, fp32, {u * r} gloo CPU processes ({repeats} interleaved repeats; seconds, slowest "
            f"rank per repeat; exposed = time blocked in head-chunk all-to-all waits, median)"
        )
        yield ""
        walls = {key: [max(rank[key][i][0] for rank in res) for i in range(repeats)] for key in res[0]}
        waits = {key: [max(rank[key][i][1] for rank in res) for i in range(repeats)] for key in res[0]}
        med = {key: sorted(w)[len(w) // 2] for key, w in walls.items()}
        rows = []
        for key in walls:
            kc, serial = key.split("-")[0], key.endswith("serial")
            vs = "-" if kc == "1" or serial else f"{med[key] / med[kc + '-serial'] - 1:+.1%}"
            rows.append(
                [
                    kc,
                    "serial" if serial else "overlapped" if kc != "1" else "-",
                    f"{min(walls[key]):.3f}",
                    f"{med[key]:.3f}",
                    "-" if kc == "1" else f"{sorted(waits[key])[len(waits[key]) // 2]:.3f}",
                    vs,
                ]
            )
        yield from table_lines(
            ["head_chunks", "schedule", "wall min", "wall median", "exposed all-to-all", "wall vs serial (median)"],
            rows,
            markdown=True,
        )
        yield ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--table", choices=("options", "runtime", "bf16", "heads", "module", "engine", "overlap", "all"), default="all"
    )
    p.add_argument("--out", help="also write the markdown tables here")
    p.add_argument("--json", help="write the raw measurements here")
    p.add_argument("--overlap-mesh", default="2,1", help="u,r of the overlap timing (its own u*r processes)")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats of the overlap table")
    p.add_argument(
        "--alive-at-peak",
        type=int,
        default=0,
        metavar="N",
        help="bf16 table: list the N largest groups of tensors alive at each row's device peak",
    )
    p.add_argument(
        "--keep-attention-output",
        action="store_true",
        help="module table: keep the chunks' attention outputs (apply_context_parallel keep_attention_output=True)",
    )
    args = p.parse_args(argv)
    from hybrid_cp.testing import WorkerPool

    here = os.path.dirname(os.path.abspath(__file__))
    lines: list[str] = []
    raw: dict = {}

    def show(section: Iterator[str]) -> None:
        for line in section:  # each line as soon as its row is measured
            print(line, flush=True)
            lines.append(line)

    with WorkerPool(8, extra_paths=[here]) if args.table != "overlap" else contextlib.nullcontext() as pool:
        for name, section in (
            ("options", options_table),
            ("runtime", runtime_table),
            ("bf16", bf16_table),
            ("heads", heads_table),
            ("module", module_table),
            ("engine", engine_table),
        ):
            if args.table in (name, "all"):
                extra = {"keep": True} if name == "module" and args.keep_attention_output else {}
                if name == "bf16" and args.alive_at_peak:
                    extra = {"alive_at_peak": args.alive_at_peak}
                show(section(pool, raw, **extra))
    if args.table in ("overlap", "all"):
        u, r = (int(x) for x in args.overlap_mesh.split(","))
        with WorkerPool(u * r, extra_paths=[here]) as pool:
            show(overlap_tables(pool, raw, u, r, args.repeats))
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
