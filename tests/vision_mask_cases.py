"""Gemma 3 vision-language cases: a tiny Gemma3ForConditionalGeneration on one row of text and two images, built by
`hybrid_cp.image_row`, sharded under its `AttnMask` and trained one step under CP, against the single-process model on
the same row with transformers' own mask (pixel_values and token_type_ids, eager attention). Run on every rank of the
worker pool; tests/test_vision_masks.py asserts."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from dist_cases import mesh, raised
from train_cases import _full_grad, _grad_errors

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.parity import shared
from hybrid_cp.training.batch import MASK_KEY

VOCAB = 256
IMAGE, BOI, EOI = 255, 253, 254
WINDOW = 8  # the sliding layer's window: shorter than an image block (16 tokens), so both bounds matter
IMAGE_TOKENS = 16  # mm_tokens_per_image: 16 x 16 pixels, 4 x 4 patches, no pooling
TEXT = (9, 11, 7)
# gradients that are zero in exact arithmetic (a key bias adds the same q.b to every score of a query: softmax does not
# see it): their relative error compares round-off with round-off; they count in grad_vs_largest only
ZERO_GRADS = ("self_attn.k_proj.bias",)  # text runs around the two images (each image between its BOI and EOI tokens)


def tiny_config(attn_implementation: str = "eager"):
    """Gemma 3 with a sliding and a full layer, a one-layer SigLIP tower on 16 x 16 images (fp32, no dropout)."""
    from transformers import Gemma3Config

    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attention_dropout=0.0,
        query_pre_attn_scalar=16,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        attention_dropout=0.0,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    return config


def tiny_vlm(seed: int = 0, attn_implementation: str = "eager"):
    """The tiny model, random weights from `seed` (the projector's, zeros by default, too), training mode."""
    from transformers import Gemma3ForConditionalGeneration

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(seed)
            model = Gemma3ForConditionalGeneration(tiny_config(attn_implementation)).float()
    finally:
        logger.setLevel(level)
    with torch.no_grad():
        projector = model.model.multi_modal_projector.mm_input_projection_weight
        projector.copy_(torch.randn(projector.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.2)
    return model.train()


def vl_row(seed: int = 0) -> dict:
    """One row: text, BOI, image 1, EOI, text, BOI, image 2, EOI, text; targets: the next token where it is text
    (image tokens are predicted by no one and predict nothing: -100), -100 at the end; two random images."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(3, BOI, (n,), generator=g)

    image = torch.full((IMAGE_TOKENS,), IMAGE)
    parts = [
        text(TEXT[0]),
        torch.tensor([BOI]),
        image,
        torch.tensor([EOI]),
        text(TEXT[1]),
        torch.tensor([BOI]),
        image,
        torch.tensor([EOI]),
        text(TEXT[2]),
    ]
    ids = torch.cat(parts)[None]
    types = (ids == IMAGE).long()
    nxt = torch.cat([ids[0, 1:], torch.tensor([-100])])
    targets = torch.where((nxt == IMAGE) | (types[0] == 1), -100, nxt)[None]
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    return {
        "input_ids": ids,
        "token_type_ids": types,
        "pixel_values": pixels,
        "shift_labels": targets,
        "position_ids": torch.arange(ids.shape[1])[None],
    }


def reference(model, row: dict) -> tuple[torch.Tensor, dict]:
    """One process, transformers' own path: pixel_values and token_type_ids to the model (its image-block masks);
    the token mean of the cross-entropy over the row's targets, and every parameter's gradient."""
    logits = model(
        input_ids=row["input_ids"],
        pixel_values=row["pixel_values"],
        token_type_ids=row["token_type_ids"],
        position_ids=row["position_ids"],
    ).logits
    loss = F.cross_entropy(logits[0], row["shift_labels"][0], ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def causal_leak(row: dict, ref_grads: dict) -> float:
    """How far one process running the row causally (images without their blocks) is from the reference: the test
    asserts it is large, i.e. that a mask lost on the way would show."""
    model = tiny_vlm()
    logits = model(
        input_ids=row["input_ids"], pixel_values=row["pixel_values"], position_ids=row["position_ids"]
    ).logits  # no token_type_ids: causal masks
    F.cross_entropy(logits[0], row["shift_labels"][0], ignore_index=-100).backward()
    worst = 0.0
    for n, p in model.named_parameters():
        if p.grad is not None and n in ref_grads:
            worst = max(worst, ((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)).item())
    return worst


def vl_parity(u: int, r: int, seed: int = 0) -> dict:
    """Loss and every parameter gradient of one step on the image row under CP (image_row -> shard_batch ->
    model(**shard)) vs `reference`."""
    cp = mesh(u, r)
    row = vl_row(seed)
    [(ref_loss, ref_grads)] = shared([lambda: reference(tiny_vlm(seed), row)])
    model = apply_context_parallel(tiny_vlm(seed), cp)
    vision_impl = model.model.vision_tower.config._attn_implementation
    built = hcp.image_row(model, row["input_ids"], row["pixel_values"], row["token_type_ids"])
    local = hcp.shard_batch(
        {
            "inputs_embeds": built["inputs_embeds"],
            "shift_labels": row["shift_labels"],
            "position_ids": row["position_ids"],
        },
        cp,
        mask=built["mask"],
    )
    loss = model(**local).loss
    loss.backward()
    average_gradients(model)
    grads = {n: _full_grad(p) for n, p in model.named_parameters() if p.grad is not None}
    grad, worst, vs_largest = _grad_errors(grads, ref_grads, exclude=ZERO_GRADS)
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": grad,
        "worst_param": worst,
        "grad_vs_largest": vs_largest,
        "missing": sorted(set(ref_grads) ^ set(grads)),
        "cp_loss": loss.item(),
        "vision_grads": sum(n.startswith("model.vision_tower.") for n in grads),
        "leak": causal_leak(row, ref_grads) if cp.rank == 0 else None,
        "carried": local[MASK_KEY] is built["mask"],
        "vision_impl": vision_impl,
        "text_impl": model.config.text_config._attn_implementation,
    }


def vl_refusals(u: int, r: int) -> dict:
    """Calls that must raise a named error on every rank: images or token_type_ids given to the model,
    inputs_embeds without the row's mask, images given to one rank only; then the right call still works."""
    cp = mesh(u, r, validate="always")
    row = vl_row(3)
    model = apply_context_parallel(tiny_vlm(3), cp)
    built = hcp.image_row(model, row["input_ids"], row["pixel_values"], row["token_type_ids"])
    local = hcp.shard_batch(
        {
            "inputs_embeds": built["inputs_embeds"],
            "shift_labels": row["shift_labels"],
            "position_ids": row["position_ids"],
        },
        cp,
        mask=built["mask"],
    )
    ids = hcp.shard_batch(
        {"input_ids": row["input_ids"], "token_type_ids": row["token_type_ids"], "shift_labels": row["shift_labels"]},
        cp,
        mask=built["mask"],
    )
    out = {"cp_rank": cp.rank}

    def attempt(name, **kwargs):
        out[name] = raised(model, **kwargs)

    attempt("pixel_values", **{k: v for k, v in ids.items() if k != "token_type_ids"}, pixel_values=row["pixel_values"])
    attempt("token_type_ids", **ids)
    attempt("no_mask", **{k: v for k, v in local.items() if k != MASK_KEY})
    # images given on rank 0 only: refused through the input agreement, so the other ranks raise too (no hang)
    lone = {k: v for k, v in ids.items() if k != "token_type_ids"}
    attempt("pixel_values_on_rank_0", **lone, **({"pixel_values": row["pixel_values"]} if cp.rank == 0 else {}))
    out["ok_after"] = model(**local).loss.item()
    return out
