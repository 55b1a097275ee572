"""Vision-language rows under context parallelism (Gemma 3): the images are encoded on the whole row, then sharded.

A vision tower and its projector mix the patches of an image, so they cannot run on a shard of the row. Gemma 3
places each image's features at its placeholder tokens of the text embeddings and lets the tokens of one image see
each other both ways (transformers' ``token_type_ids`` -> ``block_sequence_ids`` -> an or-mask of image blocks). So
`image_row` runs, on every rank and on the FULL row, what `Gemma3Model.forward` runs before its language model: the
token embeddings (with Gemma's embedding scale), the vision tower (with its own attention implementation, not
context-parallel) and the projector, and scatters the image features into the embeddings; it returns them with the
row's `hcp.AttnMask` (`AttnMask.blocks`: each image its own bidirectional block, text causal), which is exactly
transformers' mask for the full-attention layers and, narrowed by each sliding layer's window in the engine
(`AttnMask.windowed`), for the sliding ones (AND(window, OR(causal, block))). Shard the two with
`hcp.shard_batch(..., mask=row["mask"])` and call the model under `apply_context_parallel` with the shard.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.masks import AttnMask
from ..errors import ConfigError, InputTypeError, ShapeError
from .model_support import VISION_LANGUAGE_FAMILIES

# model_type -> the class of the model's multimodal body (model.model) image_row runs: the family's stem + "Model"
_BODIES = {model_type: family[0] + "Model" for model_type, family in VISION_LANGUAGE_FAMILIES.items()}


def _body(model: torch.nn.Module) -> torch.nn.Module:
    """The multimodal body of a Gemma 3 vision-language model (`Gemma3ForConditionalGeneration.model`, or a
    `Gemma3Model` itself); ConfigError for any other model."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _BODIES:
        raise ConfigError(
            f"hybrid_cp.image_row supports model_type {sorted(_BODIES)} (Gemma3ForConditionalGeneration), "
            f"got {type(model).__name__} (model_type={model_type!r}); other vision-language families "
            f"are refused under context parallelism (docs/training.md, 'Vision-language rows')"
        )
    body = model if type(model).__name__ == _BODIES[model_type] else getattr(model, "model", None)
    if body is None or type(body).__name__ != _BODIES[model_type]:
        raise ConfigError(
            f"hybrid_cp.image_row: {type(model).__name__} holds no {_BODIES[model_type]} as .model; "
            f"pass the Gemma3ForConditionalGeneration"
        )
    return body


def image_blocks(token_type_ids: torch.Tensor) -> AttnMask:
    """The `hcp.AttnMask` of Gemma 3's image blocks: every contiguous run of image tokens (token_type_ids == 1) is
    its own bidirectional block, the rest causal; transformers' `get_block_sequence_ids_for_mask` + 1.

    Args:
        token_type_ids: [B, S] or [S] integers, 1 at image tokens; every row the same (the rows share one mask).

    Returns:
        The mask over the S tokens.

    Raises:
        ShapeError: Not one or two dims.
        ConfigError: Float ids, or rows whose image tokens sit at different places.
    """
    if not isinstance(token_type_ids, torch.Tensor):
        raise InputTypeError(f"token_type_ids must be a tensor [batch, seq], got {type(token_type_ids).__name__}")
    types = token_type_ids if token_type_ids.dim() == 2 else token_type_ids[None]
    if types.dim() != 2 or types.shape[1] == 0:
        raise ShapeError(f"token_type_ids must be [batch, seq] or [seq], got shape {tuple(token_type_ids.shape)}")
    if types.is_floating_point():
        raise ConfigError(
            f"token_type_ids has dtype {types.dtype}; pass the processor's integer ids (1 at image tokens)"
        )
    image = (types == 1).cpu()
    if bool((image != image[:1]).any()):
        rows = torch.nonzero((image != image[:1]).any(-1)).flatten().tolist()
        raise ConfigError(
            f"token_type_ids: rows {rows[:8]} have their image tokens elsewhere than row 0; the rows of "
            f"one batch share one hcp.AttnMask: call image_row per row (a batch of one) or group rows "
            f"with the same image positions"
        )
    image = image[0]
    start = image & ~torch.cat([torch.zeros(1, dtype=torch.bool), image[:-1]])
    ids = torch.where(image, torch.cumsum(start.long(), 0), torch.zeros((), dtype=torch.long))
    return AttnMask.blocks(ids.tolist())


def image_row(
    model: torch.nn.Module, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, token_type_ids: torch.Tensor
) -> dict[str, Any]:
    """The full row of a Gemma 3 vision-language batch, ready to shard: text embeddings with the image features in
    place, and the row's attention mask.

    Runs on every rank, on the whole row, what `Gemma3Model.forward` runs before its language model: the token
    embeddings (the image placeholder id mapped to 0 when it lies outside the vocabulary, then Gemma's embedding
    scale), `get_image_features` (the vision tower with its own attention implementation, and the projector) and
    the `masked_scatter` of the features into the placeholder tokens. Gradients flow back through it: each rank's
    shard of the embeddings reaches the vision tower's and the embedding's parameters, as the token embeddings of a
    text row do. Then::

        row = hybrid_cp.image_row(model, input_ids, pixel_values, token_type_ids)
        local = hcp.shard_batch({"inputs_embeds": row["inputs_embeds"], "shift_labels": targets,
                                 "position_ids": pos}, cp, mask=row["mask"])
        loss = model(**local).loss

    Args:
        model: A `Gemma3ForConditionalGeneration` (patched by `apply_context_parallel` or not: the vision tower
            keeps its own attention implementation either way).
        input_ids: [B, S] token ids of the whole row, with `config.image_token_id` at each image token.
        pixel_values: [images, channels, height, width], the images in row order (None: a row without images).
        token_type_ids: [B, S] (or [S]), 1 at image tokens (the processor's); the same in every row.

    Returns:
        ``{"inputs_embeds": [B, S, hidden], "mask": hcp.AttnMask}``: the mask is `AttnMask.blocks` with each
        contiguous run of image tokens its own bidirectional block and text causal (transformers' mask; each sliding
        layer's window narrows it in the attention engine, as transformers' AND(window, OR(causal, block))).

    Raises:
        ConfigError: A model other than Gemma 3's vision-language one, image tokens that token_type_ids does not
            mark (or the reverse), rows with images at different places.
        ShapeError: input_ids not [B, S]; token_type_ids of another shape; image features that do not fill the
            image tokens (transformers' own check).
    """
    body = _body(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ShapeError(
            f"input_ids must be integer token ids [batch, seq], got "
            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if not isinstance(token_type_ids, torch.Tensor) or tuple(token_type_ids.shape[-1:]) != tuple(input_ids.shape[1:]):
        raise ShapeError(
            f"token_type_ids must be [batch, seq] = {list(input_ids.shape)} (1 at image tokens), got "
            f"{tuple(getattr(token_type_ids, 'shape', ())) or type(token_type_ids).__name__}"
        )
    types = token_type_ids.expand_as(input_ids) if token_type_ids.dim() == 1 else token_type_ids
    placeholder = input_ids == body.config.image_token_id
    if not torch.equal(placeholder.cpu(), (types == 1).cpu()):
        raise ConfigError(
            f"token_type_ids marks {int((types == 1).sum())} image tokens but input_ids holds "
            f"{int(placeholder.sum())} image_token_id={body.config.image_token_id} tokens, or at other "
            f"places; pass the processor's input_ids and token_type_ids together"
        )
    mask = image_blocks(types)
    ids = input_ids
    if body.config.image_token_id >= body.vocab_size:  # Gemma3Model.forward: an out-of-vocabulary placeholder -> 0
        ids = input_ids.masked_fill(placeholder, 0)
    embeds = body.get_input_embeddings()(ids)  # Gemma3TextScaledWordEmbedding: times sqrt(hidden)
    if pixel_values is not None:
        features = body.get_image_features(pixel_values, return_dict=True).pooler_output
        features = features.to(embeds.device, embeds.dtype)
        try:
            where = body.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
        except (ValueError, RuntimeError) as exc:
            raise ShapeError(f"hybrid_cp.image_row: {exc}") from exc
        embeds = embeds.masked_scatter(where, features)
    elif bool(placeholder.any()):
        raise ConfigError(f"input_ids holds {int(placeholder.sum())} image tokens but pixel_values is None")
    return {"inputs_embeds": embeds, "mask": mask}


__all__ = ["image_row", "image_blocks"]
