"""Model-level cases under an `hcp.AttnMask`, run on every rank of the worker pool: a tiny Llama trained on one
row that holds a prompt and its completions (`AttnMask.shared_prefix`) against each prompt + completion run
alone on one process. They return figures and messages; tests/test_mask_models.py asserts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_cases import mesh, raised
from train_cases import VOCAB, _full_grad, _grad_errors, _rel, tiny_model

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.parity import shared
from hybrid_cp.training.batch import MASK_KEY

PROMPT = 20
COMPLETIONS = (9, 1, 14, 5, 23)


def tree_row(seed: int, prompt: int = PROMPT, completions: tuple = COMPLETIONS) -> tuple[dict, hcp.AttnMask]:
    """One row: the prompt, then its completions; positions continue from the prompt in every completion;
    targets: the next token inside the prompt and inside each completion, -100 at the prompt's last token
    (it has no single next token) and at each completion's last."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (prompt, *completions)]

    def targets(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[1:], torch.tensor([-100])])

    ids = torch.cat(parts)[None]
    pos = torch.cat([torch.arange(prompt)] + [torch.arange(prompt, prompt + n) for n in completions])[None]
    labels = torch.cat([targets(x) for x in parts])[None]
    batch = {"input_ids": ids, "position_ids": pos, "shift_labels": labels}
    return batch, hcp.AttnMask.shared_prefix(prompt, list(completions))


def tree_reference(model, batch: dict, prompt: int = PROMPT, completions: tuple = COMPLETIONS):
    """One process, prompt + completion i as its own causal row (positions 0..P+len-1): the summed token losses
    over the mask row's targets (the prompt's counted once, from the first run) over their count; the
    gradients."""
    ids, labels = batch["input_ids"][0], batch["shift_labels"][0]
    total, count, start = 0.0, 0, prompt
    for i, n in enumerate(completions):
        row = torch.cat([ids[:prompt], ids[start : start + n]])
        want = torch.cat([labels[:prompt] if i == 0 else torch.full((prompt,), -100), labels[start : start + n]])
        logits = model(input_ids=row[None], position_ids=torch.arange(prompt + n)[None]).logits[0]
        total = total + F.cross_entropy(logits, want, ignore_index=-100, reduction="sum")
        count += int((want != -100).sum())
        start += n
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _leak(batch: dict, ref_grads: dict) -> float:
    """How far the reference's gradients are from one causal pass over the whole row (completions seeing each
    other): the test asserts it is large, i.e. that a mask lost on the way would show."""
    model = tiny_model("llama")
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    F.cross_entropy(logits[0], batch["shift_labels"][0], ignore_index=-100).backward()
    return max(_rel(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.grad is not None)


def tree_model_parity(u: int, r: int, tiled_loss: bool = False) -> dict:
    """Loss (`model(**shard).loss`, or `hcp.lm_loss(model, shard, cp)` with `tiled_loss`) and every parameter
    gradient of one step on the masked row under CP vs `tree_reference`."""
    cp = mesh(u, r)
    batch, mask = tree_row(2024)
    [(ref_loss, ref_grads)] = shared([lambda: tree_reference(tiny_model("llama"), batch)])
    model = apply_context_parallel(tiny_model("llama"), cp)
    local = hcp.shard_batch(batch, cp, mask=mask)
    loss = hcp.lm_loss(model, local, cp, chunk_tokens=8) if tiled_loss else model(**local).loss
    loss.backward()
    average_gradients(model)
    grads = {n: _full_grad(p) for n, p in model.named_parameters() if p.grad is not None}
    grad, worst, vs_largest = _grad_errors(grads, ref_grads)
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": grad,
        "worst_param": worst,
        "grad_vs_largest": vs_largest,
        "missing": sorted(set(ref_grads) ^ set(grads)),
        "cp_loss": loss.item(),
        "leak": _leak(batch, ref_grads),
        "carried": local[MASK_KEY] is mask,
    }


def tree_model_refusals(u: int, r: int) -> dict:
    """Masked model calls that must raise a named error on every rank (no hang, nothing computed wrong):
    the error's class name and message of each; then a correct call still works."""
    cp = mesh(u, r, validate="always")
    batch, mask = tree_row(7)
    local = hcp.shard_batch(batch, cp, mask=mask)
    model = apply_context_parallel(tiny_model("llama"), cp)
    s = local["input_ids"].shape[1]
    out = {}

    def attempt(name, **kwargs):
        out[name] = raised(model, **kwargs)

    plain = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    attempt("mask_4d", **plain, attention_mask=torch.ones(1, 1, s, mask.seq_len))
    attempt("mask_4d_with_mask", **local, attention_mask=torch.ones(1, 1, s, mask.seq_len))
    attempt("wrong_type", **{**local, MASK_KEY: [(0, 4, 0, 4, None, 0)]})
    attempt("padding_with_mask", **local, attention_mask=torch.ones(1, s, dtype=torch.long))
    other = hcp.AttnMask.shared_prefix(PROMPT + 1, [n - 1 if i == 0 else n for i, n in enumerate(COMPLETIONS)])
    attempt("other_mask_on_rank0", **{**local, MASK_KEY: other if cp.rank == 0 else mask})
    bidirectional = tiny_model("llama")
    bidirectional.config.is_causal = False  # transformers then composes a bidirectional mask we do not read
    bidirectional = apply_context_parallel(bidirectional, cp)
    dense = hcp.shard_batch({"input_ids": batch["input_ids"][:, :32]}, cp)
    try:
        bidirectional(input_ids=dense["input_ids"], position_ids=dense["position_ids"])
        out["bidirectional_config"] = ("no error", "")
    except ValueError as exc:
        out["bidirectional_config"] = (type(exc).__name__, str(exc))
    out["bidirectional_config_with_mask"] = tuple(bidirectional(**local).logits.shape)  # the AttnMask decides
    out["ok_after"] = tuple(model(**local).logits.shape)
    out["cp_rank"] = cp.rank
    return out
