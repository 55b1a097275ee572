"""Functions run on every rank of the worker pool for the memory-saving features (tiled loss, tiled MLP,
head-chunked attention). They return errors; the tests assert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_cases import mesh
from train_cases import _full_grad, _rel, make_batch, reference, tiny_model

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients, shard_model
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.parity import shared
from hybrid_cp.training.batch import shard_batch
from hybrid_cp.training.loss import cross_entropy
from hybrid_cp.training.tiled import lm_loss, tile_mlp, tiled_cross_entropy


def tiled_loss_parity(
    u: int,
    r: int,
    s: int = 37,
    b: int = 2,
    include_dp: bool = False,
    reduction: str = "mean",
    chunk: int = 5,
    bias: bool = True,
    empty: bool = False,
) -> dict:
    """tiled_cross_entropy on this rank's shard vs hcp.cross_entropy of the same shard's full logits:
    loss value and the gradients of hidden, weight and bias."""
    cp = mesh(u, r)
    g = torch.Generator().manual_seed(300 + (cp.dp_rank if include_dp else 0))
    hidden_full = torch.randn(b, s, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64) / 4
    bvec = torch.randn(50, generator=g, dtype=torch.float64) if bias else None
    ids = torch.randint(0, 50, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s // 2 :] = 0
    if empty:
        mask[:] = 0
    local = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, cp, ignore_index=-5)
    hidden = hcp.shard(hidden_full, cp, dim=1)

    def run(tiled: bool):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        bb = bvec.clone().requires_grad_() if bias else None
        if tiled:
            loss = tiled_cross_entropy(
                h, w, local["labels"], cp, -5, reduction, include_dp=include_dp, bias=bb, chunk_tokens=chunk
            )
        else:
            loss = cross_entropy(F.linear(h, w, bb), local["labels"], cp, -5, reduction, include_dp=include_dp)
        loss.backward()
        return loss.detach(), h.grad, w.grad, (bb.grad if bias else None)

    ref, got = run(False), run(True)
    errs = {
        "loss": abs(got[0].item() - ref[0].item()) / max(abs(ref[0].item()), 1e-30),
        "hidden": _rel(got[1], ref[1]) if ref[1].abs().max() > 0 else got[1].abs().max().item(),
        "weight": _rel(got[2], ref[2]) if ref[2].abs().max() > 0 else got[2].abs().max().item(),
    }
    if bias:
        errs["bias"] = _rel(got[3], ref[3]) if ref[3].abs().max() > 0 else got[3].abs().max().item()
    errs["finite"] = bool(torch.isfinite(got[0]).item())
    errs["value"] = got[0].item()
    return errs


def tiled_model_parity(
    u: int,
    r: int,
    hkv: int = 2,
    fsdp: bool = False,
    tiled_loss: bool = True,
    mlp_chunk: int | None = 7,
    checkpoint: bool = False,
    s: int = 100,
    b: int = 2,
    head_chunks: int = 1,
    heads: int = 4,
    chunk_projections: bool = True,
    kind: str = "llama",
    overlap: bool = True,
    offload: bool = False,
    norm_chunk: int | None = None,
) -> dict:
    """A tiny model under CP with lm_loss(tiled), tile_mlp and head_chunks (`overlap`: the head-chunk
    pipeline's schedule) vs the plain single-process run."""
    cp = mesh(u, r)
    batch = make_batch(1234, b, s, pad=True)
    [(_, ref_loss, ref_grads)] = shared([lambda: reference(tiny_model(kind, hkv, num_attention_heads=heads), batch)])
    model = apply_context_parallel(
        tiny_model(kind, hkv, num_attention_heads=heads),
        cp,
        overlap=overlap,
        **({"head_chunks": head_chunks, "chunk_projections": chunk_projections} if head_chunks != 1 else {}),
    )
    if mlp_chunk:
        tile_mlp(model, mlp_chunk)
    if norm_chunk:
        hcp.tile_norm(model, norm_chunk)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        hcp.offload_checkpoints(model, prefetch=True)
    if fsdp:
        shard_model(model, cp)
    widths = set()  # query heads x head_dim each q projection produced (forward and recomputation)
    hooks = [
        m.register_forward_hook(lambda mod, a, out: widths.add(out.shape[-1]))
        for name, m in model.named_modules()
        if name.endswith("q_proj")
    ]
    local = shard_batch(batch, cp)
    loss = lm_loss(model, local, cp, tiled=tiled_loss, chunk_tokens=9)
    loss.backward()
    for h in hooks:
        h.remove()
    if not fsdp:
        average_gradients(model)
    grads = {n: _full_grad(p) for n, p in model.named_parameters()}
    errs = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errs, key=errs.get)
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": errs[worst],
        "worst_param": worst,
        "missing": sorted(set(ref_grads) ^ set(grads)),
        "q_widths": sorted(widths),
    }


def module_chunks_refuse_other_structure(u: int, r: int) -> str | None:
    """An attention module that does more than o_proj(attention output) after attention (here: doubles
    the result) cannot run module-level chunks: the first forward raises, on every rank."""
    cp = mesh(u, r)
    model = tiny_model("llama", 2, num_attention_heads=8)
    cls = type(model.model.layers[0].self_attn)  # patched in place: a subclass would be refused by the model guard
    base = cls.forward

    def doubled(self, *args, **kwargs):
        out, weights = base(self, *args, **kwargs)
        return out * 2, weights

    cls.forward = doubled
    try:
        apply_context_parallel(model, cp, head_chunks=2)
        local = shard_batch(make_batch(7, 1, 40, pad=False), cp)
        model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    except ValueError as exc:
        return str(exc)
    finally:
        cls.forward = base
    return None


def tiled_loss_bad_label(u: int, r: int) -> str | None:
    """A label outside the vocabulary on one rank raises on every rank (no hang)."""
    cp = mesh(u, r)
    labels = torch.zeros(1, 4, dtype=torch.long)
    if cp.rank == 1:  # one rank of every cp group
        labels[0, 2] = 99
    try:
        tiled_cross_entropy(torch.randn(1, 4, 8), torch.randn(10, 8), labels, cp)
    except ValueError as exc:
        return str(exc)
    return None


def measure_step(**kwargs) -> dict:
    """benchmarks/memory_step.py:measure (one exactly measured training step) on this rank."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from memory_step import measure

    return measure(**kwargs)


def headchunk_parity(
    u: int,
    r: int,
    h: int = 8,
    hkv: int = 2,
    chunks: tuple = (2, 4),
    causal: bool = True,
    s: int = 96,
    b: int = 2,
    d: int = 16,
    return_lse: bool = False,
    overlap: bool = True,
    cu_seqlens: list | None = None,
    window: int | None = None,
) -> dict:
    """hcp.attention with head_chunks=k vs head_chunks=1 on the same shards: out (lse) and dq/dk/dv, and the
    bytes each sent."""
    cp = mesh(u, r)
    g = torch.Generator().manual_seed(11 + h + hkv + s)
    full = [torch.randn(b, s, n, d, generator=g) for n in (h, hkv, hkv, h)]
    extra = {k_: v_ for k_, v_ in (("cu_seqlens", cu_seqlens), ("window", window)) if v_ is not None}
    q, k, v, dout = (hcp.shard(x, cp, dim=1, **({"cu_seqlens": cu_seqlens} if cu_seqlens else {})) for x in full)

    def run(kc: int, schedule: bool = False):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        hcp.reset_comm_bytes(cp)
        res = hcp.attention(*xs, cp, causal=causal, head_chunks=kc, return_lse=return_lse, overlap=schedule, **extra)
        out, lse = res if return_lse else (res, None)
        out.backward(dout)
        return out.detach(), lse, [x.grad for x in xs], hcp.comm_bytes(cp)

    ref = run(1)
    rows = {}
    for kc in chunks:
        got = run(kc, overlap)
        errs = {"out": _rel(got[0], ref[0])}
        if return_lse:
            errs["lse"] = _rel(got[1], ref[1])
        for name, a, bb in zip(("dq", "dk", "dv"), got[2], ref[2]):
            errs[name] = _rel(a, bb)
        errs["bytes"] = got[3]
        rows[kc] = errs
    rows["ref_bytes"] = ref[3]
    return rows


def attention_forward_counts(
    u: int, r: int, head_chunks: int = 2, checkpoint: bool = True, keep: bool | None = None
) -> dict:
    """Attention forwards per layer in one training step with module-level head chunks (the ring forwards
    of a step divided by those of one forward pass without gradients), and the largest gradient
    difference to the same step with keep_attention_output=False (recomputed attention)."""
    from hybrid_cp.engine import modulechunk

    cp = mesh(u, r)
    local = shard_batch(make_batch(3, 1, 64, pad=False), cp)
    calls = [0]
    original = modulechunk.stage_forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    grads = []
    modulechunk.stage_forward = counted
    try:
        for keep_output in (keep, False):
            model = apply_context_parallel(
                tiny_model("llama", 2, num_attention_heads=8),
                cp,
                head_chunks=head_chunks,
                keep_attention_output=keep_output,
            )
            if checkpoint:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            calls[0] = 0
            with torch.no_grad():
                lm_loss(model, local, cp)
            one_pass, calls[0] = calls[0], 0
            lm_loss(model, local, cp).backward()
            grads.append([p.grad for p in model.parameters()])
            if len(grads) == 1:
                count = calls[0] / one_pass
    finally:
        modulechunk.stage_forward = original
    return {"count": count, "diff": max((a - b).abs().max().item() for a, b in zip(*grads))}


def _memory_step():
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import memory_step

    return memory_step


def engine_step(**kwargs) -> dict:
    """benchmarks/memory_step.py:engine_memory (one exactly measured hcp.attention call) on this rank."""
    return _memory_step().engine_memory(**kwargs)


def module_backward(**kwargs) -> dict | None:
    """benchmarks/memory_step.py:module_backward (one attention module with module chunks) on the mesh's first
    replica; the pool's other replicas would measure the same call (None there)."""
    cp = mesh(kwargs["u"], kwargs["r"])  # every rank: building a mesh is collective
    return _memory_step().module_backward(**kwargs) if cp.dp_rank == 0 else None
