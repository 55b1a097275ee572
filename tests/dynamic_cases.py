"""Dynamic context-parallel degrees on every rank of a worker pool: a tiny Llama trained on a schedule of
mixed degrees against one process on the same global batch. They return errors; the tests assert."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from linear_cases import HYBRIDS, scan_case
from linear_more_cases import MORE, kinds_case
from train_cases import _full_grad, _rel, tiny_model

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients, shard_model
from hybrid_cp.integrations.transformers import apply_context_parallel, use_mesh
from hybrid_cp.training.batch import shard_batch
from topology.schedule import Degree

# per step: documents of the GLOBAL batch (C = 24 tokens per rank: 70 and 50 need 4 ranks, 40 and 33 two)
STEPS = [[70, 9, 1, 23, 4, 40, 2, 14, 33, 11, 20, 5], [50, 30, 12, 3, 24, 8, 17, 6, 1, 26]]
SPLITS = {1: (1, 1), 2: (1, 2), 4: (2, 2)}  # ring-only, and ulysses x ring
C = 24


def _docs(step: int, lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step + 1000 * seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _model(kind: str, seed: int = 0):
    """The tiny model of `kind`: a hand-made one (llama, gemma3), a hybrid family's (linear_cases.HYBRIDS,
    linear_more_cases.MORE), or Llama 4's (chunked attention layers of 8 tokens, counted from each document's start,
    and NoPE layers)."""
    if kind == "llama4_text":
        return tiny_model(kind, None, seed=seed, generic=True, attention_chunk_size=8)
    configs = {**MORE, **HYBRIDS}
    return tiny_model(kind, 2, seed, generic=True, **configs[kind]) if kind in configs else tiny_model(kind, seed=seed)


def _reference(model, docs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """One process: the sum of every document's token losses over the step's N valid targets."""
    total, n = 0.0, 0
    for ids in docs:
        logits = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits
        total = total + F.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")
        n += len(ids) - 1
    loss = total / n
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _step(model, meshes, sched, docs) -> tuple[torch.Tensor, int]:
    """This rank's micro-batches; returns the step's loss (summed over the world). An idle rank runs a
    one-token placeholder (loss * 0): FSDP2 needs every rank in every micro-batch's gathers. Also returns
    how many placeholders this rank ran."""
    total, idle = torch.zeros(()), 0
    for mb in hcp.micro_batches(sched, meshes):
        if mb.idle:
            with use_mesh(model, mb.cp):
                inputs = {k: v for k, v in mb.placeholder_batch().items() if k not in ("labels", "shift_labels")}
                (model(**inputs).logits.sum() * 0).backward()
            idle += 1
            continue
        row = {
            "input_ids": torch.cat([docs[d] for d in mb.docs])[None],
            "cu_seq_lens_q": torch.tensor(mb.cu_seqlens, dtype=torch.int32),
        }
        with use_mesh(model, mb.cp):
            local = shard_batch(row, mb.cp)
            logits = model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}).logits
            loss = hcp.dynamic_loss(logits, local["labels"], sched)
            loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    return total, idle


SPLITS8 = {**SPLITS, 8: (2, 4)}
STEPS8 = [[150, 70, 9, 1, 23, 4, 40, 2, 14, 33, 11, 20, 5, 60, 18, 7], [180, 50, 30, 12, 3, 24, 8, 17, 6, 1, 26, 44]]


def dynamic_training(
    checkpoint: bool = False,
    fsdp: bool = False,
    flat_cost: bool = False,
    eight: bool = False,
    kind: str = "llama",
    head_chunks: int = 1,
    resync: bool = False,
    seed: int = 0,
) -> dict:
    """Two SGD steps on mixed degrees 1/2/4 vs one process: loss and every gradient per step (`fsdp`: the
    model sharded by FSDP2 over the family's shared all-ranks mesh; `flat_cost`: degrees priced alike, so
    idle blocks are not doubled and idle ranks run placeholders; `kind`: `_model`'s; `head_chunks`: chunks of
    heads inside hcp.attention, which reads the call's mesh; `resync`: after each SGD step the model takes the
    reference's parameters, so that every step compares gradients at the same point: the round-off of that step,
    not two fp32 trajectories drifting apart in a sharp tiny model; `seed`: the model's initialization and the
    documents' tokens)."""
    splits = SPLITS8 if eight else SPLITS  # eight: the 8-rank pool, degrees 1/2/4/8
    cost = [Degree(k, u, r) for k, (u, r) in splits.items()] if flat_cost else None
    meshes = hcp.init_cp_meshes(sorted(splits), splits=splits, cost=cost)
    model = apply_context_parallel(_model(kind, seed), meshes.mesh(1), head_chunks=head_chunks, chunk_projections=False)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp:
        shard_model(model, meshes.mesh(1))
    ref = _model(kind, seed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    out = {"loss": [], "grad": [], "degrees": [], "microbatches": [], "idle": 0}
    steps = STEPS8 if eight else STEPS + ([[50, 40, 3]] if flat_cost else [])  # 3rd: rank 3 idle once
    for step, lengths in enumerate(steps):
        docs = _docs(step, lengths, ref.config.vocab_size, seed)
        sched = hcp.schedule_documents(lengths, meshes, tokens_per_rank=C)
        loss, idle = _step(model, meshes, sched, docs)
        out["idle"] += idle
        if not fsdp:
            average_gradients(model)
        ref_loss, ref_grads = _reference(ref, docs)
        out["loss"].append(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        errs = {k: _rel(_full_grad(p), ref_grads[k]) for k, p in model.named_parameters()}
        out["grad"].append(max(errs.values()))
        out.setdefault("worst", []).append(max(errs, key=errs.get))
        out["degrees"].append(sorted({g.degree for mb in sched.microbatches for g in mb.groups if g.docs}))
        out["microbatches"].append(len(sched.microbatches))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if resync:
            with torch.no_grad():
                for p, q in zip(model.parameters(), ref.parameters()):
                    p.copy_(q)
    hcp.destroy_cp_mesh(meshes)
    return out


# the routed mixers' token-mixing cores at op level: (part, the names of its errors: forward, then the gradient of
# each input and parameter) per kinds_case kind (linear_more_cases: LFM2's C * conv(B * x), Mamba-1's conv + selective
# scan, lightning attention's block-wise decayed linear attention)
KIND_ERRORS = {
    "short_conv": ("conv", ("out", "dB", "dC", "dx", "dw", "dbias")),
    "mamba": ("mamba", ("out", "dx", "ddt", "dB", "dC", "dconv_w", "dconv_b", "dA", "dD", "ddt_bias")),
    "lightning": ("lightning", ("out", "dq", "dk", "dv")),
}
MIXERS = ("gated_delta", "kimi_delta", *KIND_ERRORS)


def _mixer_case(cp, docs: tuple[int, ...], mixer: str) -> tuple[dict, tuple]:
    """One row of `mixer_on_groups`: ({part: {name: error}}, (bytes sent, bytes the cost model predicts))."""
    if mixer in ("gated_delta", "kimi_delta"):  # the rule (KDA: its decay per key channel) and the causal conv
        row = scan_case(cp, cp.layout, docs, "naive", per_channel=mixer == "kimi_delta")
        return row, row.pop("bytes")
    kind, names = KIND_ERRORS[mixer]
    row = kinds_case(cp, cp.layout, docs, "fp64", kinds=(kind,))[kind]
    return {kind: dict(zip(names, row["errors"], strict=True))}, row["bytes"]


def mixer_on_groups(mixer: str = "gated_delta") -> dict:
    """A routed mixer's token-mixing core in fp64 (`MIXERS`: the Gated DeltaNet rule and the causal convolution,
    linear_cases.scan_case; Kimi Delta Attention's rule with its per-channel decay and the convolution; LFM2's
    short convolution, Mamba-1's convolution and selective scan, lightning attention, linear_more_cases.kinds_case:
    forward and every input's and parameter's gradient against one device, each document on its own) on the
    micro-batch groups a dynamic schedule gives this rank (the family's mesh of the group's degree, the packed row
    of its documents, as `micro_batches` and `shard_batch` lay it out), then on single rows of awkward documents
    (shorter than the group, odd, several starting mid-row) on every degree. {degree: {"gdn.out": worst, ...}}
    and the cases whose bytes differ from the cost model's."""
    meshes = hcp.init_cp_meshes(sorted(SPLITS), splits=SPLITS)
    rows = []
    for step, lengths in enumerate(STEPS):
        sched = hcp.schedule_documents(lengths, meshes, tokens_per_rank=C)
        rows += [
            (mb.cp, tuple(sched.lengths[d] for d in mb.docs)) for mb in hcp.micro_batches(sched, meshes) if not mb.idle
        ]
    rows += [(meshes.mesh(k), docs) for k in sorted(SPLITS) for docs in [(3,), (5,), (2, 9, 1), (13, 5, 40)]]
    out, bytes_off = {}, []
    for cp, docs in rows:
        row, (sent, predicted) = _mixer_case(cp, docs, mixer)
        if sent != predicted:
            bytes_off.append((cp.size, docs, sent, predicted))
        worst = out.setdefault(cp.size, {})
        for part, errs in row.items():
            for name, err in errs.items():
                worst[f"{part}.{name}"] = max(worst.get(f"{part}.{name}", 0.0), err)
    hcp.destroy_cp_mesh(meshes)
    return {"worst": out, "bytes_off": bytes_off}


def disagreeing_batch() -> dict:
    """Rank 1 schedules a different batch: every rank must raise the typed error, no rank may hang."""
    meshes = hcp.init_cp_meshes([1, 2, 4], splits=SPLITS)
    lengths = list(STEPS[0])
    if dist.get_rank() == 1:
        lengths[3] += 1
    sched = hcp.schedule_documents(lengths, meshes, tokens_per_rank=C)
    try:
        next(iter(hcp.micro_batches(sched, meshes)))
        got = "no error"
    except hcp.InconsistentRanksError as exc:
        got = type(exc).__name__ + ": " + str(exc)
    hcp.destroy_cp_mesh(meshes)
    return {"error": got}


def family_shape() -> dict:
    """The family's meshes: their splits, the aligned cp blocks, and the shared all-ranks group."""
    meshes = hcp.init_cp_meshes(splits=SPLITS)
    me = dist.get_rank()
    out = {
        k: {
            "split": (m.ulysses_size, m.ring_size),
            "cp_rank": m.rank,
            "block": me // k,
            "shared_world": m.dp_cp_group is meshes.mesh(1).dp_cp_group,
        }
        for k, m in meshes.meshes.items()
    }
    chunked = apply_context_parallel(tiny_model("llama"), meshes.mesh(1))
    chunked.config.attention_chunk_size = 8  # as Llama 4's chunked layers
    models = {
        "head_chunks": apply_context_parallel(tiny_model("llama"), meshes.mesh(1), head_chunks=2),
        "engine_head_chunks": apply_context_parallel(
            tiny_model("llama"), meshes.mesh(1), head_chunks=2, chunk_projections=False
        ),
        "attention_chunks": chunked,
        "gated_delta": apply_context_parallel(_model("qwen3_next"), meshes.mesh(1)),
        "short_conv": apply_context_parallel(tiny_model("lfm2", 2, generic=True, **MORE["lfm2"]), meshes.mesh(1)),
    }
    for name, model in models.items():  # module chunks cut heads for the patch-time mesh: refused before a forward
        try:
            with use_mesh(model, meshes.mesh(2)):
                pass
            out[name] = "no error"
        except hcp.ConfigError as exc:
            out[name] = str(exc)
    hcp.destroy_cp_mesh(meshes)
    return out


__all__ = ["dynamic_training", "disagreeing_batch", "family_shape", "mixer_on_groups"]
