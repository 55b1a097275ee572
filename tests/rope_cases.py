"""Rotary embeddings of every rope type of transformers' `ROPE_INIT_FUNCTIONS` under context parallelism
against one process, in fp64: run on every rank of the worker pool; they return errors, the tests assert.

The dynamic types (longrope, dynamic NTK) choose their frequencies and attention scaling from the largest
position id the rotary module sees; each size below makes that choice matter inside the test's rows: a
threshold (THRESHOLD) that the whole row crosses and that some shard, and some documents, stay below.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_cases import mesh
from train_cases import VOCAB, _full_grad, _rel, make_batch, packed_row

from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.parity import replica_part, shared
from hybrid_cp.training.batch import shard_batch, shift_labels

THRESHOLD = 64  # original_max_position_embeddings (longrope, yarn, llama3), max_position_embeddings (dynamic)
DENSE_LEN = 96  # zigzag on (2, 2): one rank holds positions 24..47 only, below THRESHOLD
DOC_LENS = (70, 9, 1, 23, 4, 21)  # one document past THRESHOLD, the others below it
_THETA = dict(rope_theta=10000.0)
_HALF = 8  # rotary pairs of the tiny head dim 16
# rope type -> (model type, configuration overrides): Phi-3 is the case (longrope checkpoints such as
# Phi-3-128k), Llama's rotary takes every other type
ROPE_TYPES = {
    "default": ("llama", dict(rope_parameters=dict(rope_type="default", **_THETA))),
    "linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, **_THETA))),
    "dynamic": (
        "llama",
        dict(max_position_embeddings=THRESHOLD, rope_parameters=dict(rope_type="dynamic", factor=2.0, **_THETA)),
    ),
    "yarn": (
        "llama",
        dict(
            max_position_embeddings=4 * THRESHOLD,
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=THRESHOLD, **_THETA),
        ),
    ),
    "longrope": (
        "phi3",
        dict(
            max_position_embeddings=4 * THRESHOLD,
            original_max_position_embeddings=THRESHOLD,
            rope_parameters=dict(
                rope_type="longrope",
                factor=4.0,
                original_max_position_embeddings=THRESHOLD,
                short_factor=[1.0 + 0.1 * i for i in range(_HALF)],
                long_factor=[1.0 + 0.5 * i for i in range(_HALF)],
                **_THETA,
            ),
        ),
    ),
    "llama3": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=THRESHOLD,
                **_THETA,
            )
        ),
    ),
    "proportional": (
        "llama",
        dict(rope_parameters=dict(rope_type="proportional", partial_rotary_factor=0.5, **_THETA)),
    ),
}


def rope_model(rope_type: str, seed: int = 0):
    """The tiny fp64 model of `rope_type` (ROPE_TYPES)."""
    from hybrid_cp.testing import families

    model_type, overrides = ROPE_TYPES[rope_type]
    return families.tiny_model(model_type, seed=seed, **overrides).double()


def _grads(model) -> dict:
    return {n: _full_grad(p) for n, p in model.named_parameters()}


def _cp_step(model, logits: torch.Tensor, labels: torch.Tensor, cp) -> torch.Tensor:
    """The token-mean loss over the cp group and its gradients (summed over the group), all in fp64
    (`hcp.cross_entropy` computes in fp32, which would bound the comparison at ~1e-7)."""
    total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    count = (labels != -100).sum().to(logits.dtype)
    dist.all_reduce(count, group=cp.cp_group)
    share = total / count
    share.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=cp.cp_group)
    loss = share.detach().clone()
    dist.all_reduce(loss, group=cp.cp_group)
    return loss


def _worst(grads: dict, ref: dict) -> tuple[float, str]:
    errs = {n: _rel(grads[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def _dense_reference(rope_type: str, batch: dict) -> tuple[torch.Tensor, dict]:
    """The single-process model on the same rows: the loss and every gradient."""
    ref = rope_model(rope_type)
    mask = batch.get("attention_mask")
    ref_logits = ref(input_ids=batch["input_ids"], attention_mask=mask).logits
    targets = shift_labels(batch["labels"], attention_mask=mask)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    ref_loss.backward()
    return ref_loss.detach(), _grads(ref)


def dense_errors(cp, rope_type: str, s: int = DENSE_LEN, b: int = 2, pad: bool = True) -> dict:
    """One step on dense rows (right-padded: `pad`): CP vs the single-process model on the same rows."""
    batch = make_batch(77, b, s, pad=pad)
    [(ref_loss, ref_grads)] = shared([lambda: _dense_reference(rope_type, batch)], cp.cp_group)
    model = apply_context_parallel(rope_model(rope_type), cp)
    local = shard_batch(batch, cp)
    logits = model(
        input_ids=local["input_ids"], position_ids=local["position_ids"], attention_mask=local.get("attention_mask")
    ).logits
    loss = _cp_step(model, logits, local["labels"], cp)
    grad, where = _worst(_grads(model), ref_grads)
    return {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "grad": grad, "worst_param": where}


def _document_reference(model, batch: dict, doc_lens) -> tuple[torch.Tensor, dict]:
    """Each document on its own (our packed-row contract), in order of length: a dynamic-NTK rotary keeps the
    frequencies of the longest row it has seen until a row shorter than its original length, so ascending
    lengths give every document the frequencies a fresh model computes for it alone."""
    starts = [sum(doc_lens[:i]) for i in range(len(doc_lens))]
    total, count = 0.0, 0
    for i in sorted(range(len(doc_lens)), key=lambda i: doc_lens[i]):
        a, n = starts[i], doc_lens[i]
        logits = model(input_ids=batch["input_ids"][:, a : a + n], position_ids=torch.arange(n)[None]).logits
        labels = batch["labels"][0, a + 1 : a + n]
        total = total + F.cross_entropy(logits[0, :-1], labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return loss.detach(), _grads(model)


def _stock_packed_row(rope_type: str, batch: dict, doc_lens) -> dict:
    """transformers' own one-process packed row (position ids restarting per document, a block-causal 4-D mask
    keeping attention inside each document): its rotary sees the whole row's largest position, so every document
    gets the choice the longest one makes."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    n = len(doc)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    model = rope_model(rope_type)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask).logits
    F.cross_entropy(logits[0], shift_labels(batch["labels"])[0], ignore_index=-100).backward()
    return _grads(model)


def packed_errors(cp, rope_type: str, doc_lens=DOC_LENS, stock: bool = False) -> dict:
    """One step on a packed row: CP vs each document trained alone; with `stock`, also `stock_row`: how far
    transformers' own one-process packed row is from that reference (worst gradient)."""
    batch = packed_row(4321, doc_lens)

    def reference():
        loss, grads = _document_reference(rope_model(rope_type), batch, doc_lens)
        return loss, grads, _worst(_stock_packed_row(rope_type, batch, doc_lens), grads)[0] if stock else None

    [(ref_loss, ref_grads, stock_row)] = shared([reference], cp.cp_group)
    model = apply_context_parallel(rope_model(rope_type), cp)
    local = shard_batch(batch, cp)
    logits = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        cu_seq_lens_q=local["cu_seq_lens_q"],
        cu_seq_lens_k=local["cu_seq_lens_k"],
        max_length_q=local["max_length_q"],
        max_length_k=local["max_length_k"],
    ).logits
    loss = _cp_step(model, logits, local["labels"], cp)
    grad, where = _worst(_grads(model), ref_grads)
    out = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "grad": grad, "worst_param": where}
    if stock:
        out["stock_row"] = stock_row
    return out


def rope_table(
    u: int,
    r: int,
    layouts=("zigzag", "contiguous", "packed"),
    rope_types=None,
    stock: bool = False,
    routed: bool = True,
) -> dict:
    """{(rope type, layout): errors} for one mesh shape; 'packed' runs a packed row on the zigzag mesh (with
    `stock`, also transformers' own packed row against the per-document reference). `routed` False: the
    control, every rotary left to see its own shard's positions only."""
    off = mock.patch("hybrid_cp.integrations.transformers.route_rotaries", lambda model, holder: 0)
    with contextlib.nullcontext() if routed else off:
        return _table(u, r, layouts, rope_types, stock)


def _table(u: int, r: int, layouts, rope_types, stock: bool) -> dict:
    """{(rope type, layout): errors}, each pair on one replica of the mesh (`replica_part`)."""
    meshes = {layout: mesh(u, r, "zigzag" if layout == "packed" else layout) for layout in layouts}  # every rank
    pairs = [(t, layout) for layout in layouts for t in rope_types or ROPE_TYPES]
    out = {}
    for rope_type, layout in replica_part(meshes[layouts[0]], pairs):
        cp = meshes[layout]
        if layout == "packed":
            out[rope_type, layout] = packed_errors(cp, rope_type, stock=stock)
        else:
            out[rope_type, layout] = dense_errors(cp, rope_type)
    return out
