"""Worker-side cases of the MoE router's load-balancing loss under context parallelism (run on every rank of the
session pool, see conftest.py): one training step with ``output_router_logits=True`` against the same model on
one process. They return errors; tests/test_moe_aux.py asserts on them.

The step is `model(**shard, output_router_logits=True).loss` (the model's own cross entropy, replaced by
`hcp.cross_entropy`, plus the coefficient times the auxiliary loss), with the coefficient raised to 1 so that the
auxiliary loss's gradients weigh as much as the cross entropy's."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from dist_cases import mesh
from linear_cases import HYBRIDS
from linear_more_cases import MORE
from train_cases import VOCAB, _full_grad, _grad_errors, make_batch, packed_row, tiny_model

from hybrid_cp.integrations.fsdp import average_gradients
from hybrid_cp.integrations.router_aux import AUX_FUNCTION, aux_settings
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.parity import replica_part, shared
from hybrid_cp.training.batch import shard_batch

COEF = 1.0
# the hybrids' linear-layer sizes of their parity tests
CONFIGS = {**HYBRIDS, **MORE}
PACKED_KEYS = (
    "input_ids",
    "position_ids",
    "labels",
    "shift_labels",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def moe_model(kind: str):
    """The family's tiny model (hybrids: the linear-layer sizes of their parity tests) with the coefficient 1."""
    extra = CONFIGS.get(kind, {})
    model = tiny_model(
        kind, 2 if kind in HYBRIDS or kind in MORE else None, generic=True, output_router_logits=True, **extra
    )
    setattr(model, aux_settings(model)[0], COEF)
    return model


def _family_loss(model, router_logits, mask=None) -> torch.Tensor:
    """The family's own `load_balancing_loss_func` (the single-process value, or one rank's shard before #32)."""
    fn = getattr(sys.modules[type(model).__module__], AUX_FUNCTION)
    return fn(tuple(router_logits), model.num_experts, model.num_experts_per_tok, mask)


def dense_reference(model, batch):
    """One process, the whole right-padded batch: (loss = cross entropy + COEF * aux, aux, gradients)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    loss = ce + COEF * out.aux_loss
    loss.backward()
    return (
        loss.detach(),
        out.aux_loss.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def packed_reference(model, batch, doc_lens):
    """One process, each document on its own (the packed-row contract for attention); the auxiliary loss's
    statistics over every token of the row, as transformers' one-process call on the packed row counts them
    (the router acts per token, so its logits are the same in both)."""
    total, count, start, layers = 0.0, 0, 0, []
    for n in doc_lens:
        ids, labels = batch["input_ids"][:, start : start + n], batch["labels"][0, start + 1 : start + n]
        out = model(input_ids=ids, position_ids=torch.arange(n)[None], output_router_logits=True)
        total = total + F.cross_entropy(out.logits[0, :-1], labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
        layers.append(out.router_logits)
        start += n
    aux = _family_loss(model, [torch.cat(per_layer) for per_layer in zip(*layers)])
    loss = total / count + COEF * aux
    loss.backward()
    return loss.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(model, out, ref, group=None) -> dict:
    ref_loss, ref_aux, ref_grads = ref
    out.loss.backward()
    average_gradients(model, group)
    grads = {n: _full_grad(p) for n, p in model.named_parameters() if p.grad is not None}
    grad, worst, vs_largest = _grad_errors(grads, ref_grads)
    shard_aux = _family_loss(model, out.router_logits).item()  # what one rank's model computed on its own
    return {
        "loss": abs(out.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "aux": abs(out.aux_loss.item() - ref_aux.item()) / abs(ref_aux.item()),
        "shard_aux": abs(shard_aux - ref_aux.item()) / abs(ref_aux.item()),
        "grad": grad,
        "worst_param": worst,
        "grad_vs_largest": vs_largest,
        "missing": sorted(set(ref_grads) ^ set(grads)),
    }


def aux_parity(u: int, r: int, kinds: list[str], packed: bool = False) -> dict:
    """{kind: errors} of one step with the auxiliary loss, dense right-padded rows (batch 2, 100 tokens, not a
    multiple of the layout's granularity) or the packed row of train_cases (documents 9, 1, 23, 4, 61, 2, 14)."""
    cp, out = mesh(u, r), {}
    lens = (9, 1, 23, 4, 61, 2, 14)
    batch = packed_row(4321, lens) if packed else make_batch(1234, 2, 100, pad=True)
    local = shard_batch(batch, cp)
    for kind in replica_part(cp, kinds):  # one replica each
        [ref] = shared(
            [
                lambda: (
                    packed_reference(moe_model(kind), batch, lens)
                    if packed
                    else dense_reference(moe_model(kind), batch)
                )
            ],
            cp.cp_group,
        )
        model = apply_context_parallel(moe_model(kind), cp)
        keys = PACKED_KEYS if packed else ("input_ids", "position_ids", "attention_mask", "labels", "shift_labels")
        out[kind] = _errors(model, model(**{k: local[k] for k in keys}, output_router_logits=True), ref, cp.cp_group)
    return out
