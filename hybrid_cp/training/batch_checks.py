"""`hcp.shard_batch`'s checks of the full batch: this rank's own (`batch_arguments`, `right_padding`,
`dense_labels`, `dense_positions`), then the agreement that every rank of the cp group was given the same
batch (`agree_on_batch`, on a `BatchSignature` that carries a checksum of the token ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..engine.agreement import agree_across_ranks, digest, validates
from ..errors import ConfigError, InputTypeError, ShapeError


def batch_arguments(batch: Any, ignore_index: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`shard_batch`'s checks of the whole batch; returns (input_ids, attention_mask, position_ids as
    [B or 1, S])."""
    if not isinstance(batch, Mapping):
        raise InputTypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    if "input_ids" not in batch and isinstance(batch.get("inputs_embeds"), torch.Tensor):
        return _embeds_arguments(batch, ignore_index)
    if "input_ids" not in batch or not isinstance(batch["input_ids"], torch.Tensor):
        raise ShapeError(
            f"batch needs an 'input_ids' tensor [batch, seq] (or 'inputs_embeds' [batch, seq, hidden]; "
            f"got keys {sorted(batch)}); pass the full-sequence token ids as batch['input_ids']"
        )
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ShapeError(
            f"batch['input_ids'] must be [batch, seq], got shape {tuple(ids.shape)}; "
            f"add a batch dimension with input_ids[None]"
        )
    if ids.is_floating_point():
        raise ConfigError(f"batch['input_ids'] has dtype {ids.dtype}; token ids must be integers")
    b, s = ids.shape
    if s == 0 or b == 0:
        raise ShapeError(
            f"batch['input_ids'] has shape {tuple(ids.shape)}; it needs at least one sequence and one token"
        )
    if not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index={ignore_index!r} must be an int")
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise ShapeError(
            f"batch['attention_mask'] must be a [batch, seq] 0/1 padding mask, got "
            f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}; 4-D or custom masks are "
            f"not supported under context parallelism (attention is causal over the sequence)"
        )
    return ids, mask, _row_positions(batch, b, s)


def _embeds_arguments(batch: Mapping[str, Any], ignore_index: Any) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """`batch_arguments` of a batch given as ``inputs_embeds`` [B, S, hidden] (a vision-language row from
    `hybrid_cp.image_row`): returns it in place of the token ids; no attention_mask (embedded rows come with their
    mask, `shard_batch(..., mask=m)`)."""
    embeds = batch["inputs_embeds"]
    if embeds.dim() != 3 or not embeds.is_floating_point() or 0 in embeds.shape[:2]:
        raise ShapeError(
            f"batch['inputs_embeds'] must be floating [batch, seq, hidden] with at least one token, got "
            f"{embeds.dtype} {tuple(embeds.shape)}"
        )
    if not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index={ignore_index!r} must be an int")
    if batch.get("attention_mask") is not None:
        raise ConfigError(
            "batch['attention_mask'] with batch['inputs_embeds']: an embedded row takes no padding "
            "mask; pass its hcp.AttnMask (shard_batch(..., mask=m)) and ignore_index targets at padding"
        )
    b, s = embeds.shape[:2]
    return embeds, None, _row_positions(batch, b, s)


def _row_positions(batch: Mapping[str, Any], b: int, s: int) -> torch.Tensor | None:
    """The per-token shape check of every tensor, then ``position_ids`` as [B or 1, S] (None when not given)."""
    _check_per_token_shapes(batch, b, s)
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 1:
        if pos.shape[0] != s:
            raise ShapeError(f"batch['position_ids'] has length {pos.shape[0]} but input_ids has {s}")
        pos = pos[None]
    return pos


class BatchSignature(NamedTuple):
    """What every cp rank's `shard_batch` call must agree on: the same full batch (a checksum of its ids)."""

    batch: int = 0
    length: int = 0
    input_ids: int = 0  # checksum of the token ids
    labels: int = 0  # checksum of the labels (0: none)
    keys: int = 0  # digest of the batch's keys
    mask: int = 0  # digest of shard_batch's mask= (0: none)

    labels_ = ("batch", "length", "input_ids (checksum)", "labels (checksum)", "keys", "mask (checksum)")


def content_checksum(t: Any) -> int:
    """A position-weighted checksum of an integer tensor's values (0 for anything else): two ranks given
    different batches disagree on it (one pass over the tokens; a host sync for a device tensor)."""
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.numel() == 0:
        return 0
    flat = t.reshape(-1).to(torch.int64)
    weights = (torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 2654435761) % 2147483647
    return int((flat * weights).sum()) & (2**62 - 1)


def batch_signature(batch: Mapping[str, Any], mask: Any = None) -> BatchSignature:
    """The signature of a batch (and its `hcp.AttnMask`, if any) that passed this rank's checks."""
    ids = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]  # embeddings: no checksum
    return BatchSignature(
        ids.shape[0],
        ids.shape[1],
        content_checksum(ids),
        content_checksum(batch.get("shift_labels", batch.get("labels"))),
        digest(sorted(batch)),
        0 if mask is None else digest(mask),
    )


def agree_on_batch(cp, batch: Any, error: Exception | None, mask: Any = None) -> None:
    """Every cp rank raises if one rank's batch failed its checks or the ranks were given different batches
    or masks (checked on every call: the batch changes every step, so no call is predicted)."""
    if validates(cp):
        signature = batch_signature(batch, mask) if error is None else BatchSignature()
        agree_across_ranks(
            cp,
            signature,
            BatchSignature.labels_,
            error,
            "hcp.shard_batch batch (the same full batch on every rank of a cp group)",
            learn=False,
        )


def _check_per_token_shapes(batch: Mapping[str, Any], b: int, s: int) -> None:
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if key == "position_ids" and value.shape[0] == 1:
            pass
        elif value.shape[0] != b:
            raise ShapeError(
                f"batch[{key!r}] has batch size {value.shape[0]} (shape {tuple(value.shape)}) but "
                f"input_ids has {b}; every per-token tensor must be [{b}, {s}, ...]"
            )
        if value.shape[1] != s:
            raise ShapeError(
                f"batch[{key!r}] has sequence length {value.shape[1]} (shape {tuple(value.shape)}) "
                f"but input_ids has {s}; every per-token tensor must be [{b}, {s}, ...] over "
                f"the same full sequence"
            )


def right_padding(mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """Return the mask as bool after checking every row is ones then zeros (right padding)."""
    if mask.dtype == torch.bool:
        m = mask
    else:
        if mask.is_floating_point() or mask.is_complex():
            raise ConfigError(
                f"{name} has dtype {mask.dtype}; pass a 0/1 integer or bool padding mask "
                f"(additive float masks are not supported under context parallelism)"
            )
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ConfigError(
                f"{name} holds values other than 0 and 1 (e.g. {mask[bad][0].item()}); pass a 0/1 padding mask"
            )
        m = mask != 0
    # right padding: once a row turns 0 it stays 0, i.e. the mask never increases along the row
    if m.shape[-1] > 1 and bool((m[..., 1:] & ~m[..., :-1]).any()):
        rows = torch.nonzero((m[..., 1:] & ~m[..., :-1]).any(-1)).flatten().tolist()
        raise ConfigError(
            f"{name} is not right padding in batch rows {rows[:8]} (a 0 is followed by a 1: left "
            f"padding, holes or packed documents). Context-parallel attention is causal over the "
            f"whole sequence, which is exact only for right padding; right-pad the batch "
            f"(tokenizer padding_side='right') or drop the mask"
        )
    return m


def dense_labels(labels: Any) -> None:
    """A dense batch's labels: a [batch, seq] integer tensor (or None: the input ids)."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ShapeError(
            f"batch['labels'] must be a [batch, seq] integer tensor, got "
            f"{getattr(labels, 'shape', type(labels).__name__)}"
        )
    if labels.is_floating_point():
        raise ConfigError(f"batch['labels'] has dtype {labels.dtype}; labels must be integer token ids")


def dense_positions(pos: torch.Tensor | None) -> None:
    """A dense batch's position ids increase by one along each row (an offset is fine)."""
    if pos is None:
        return
    if pos.is_floating_point():
        raise ConfigError(f"batch['position_ids'] has dtype {pos.dtype}; position ids must be integers")
    if pos.shape[-1] > 1 and bool((pos[:, 1:] - pos[:, :-1] != 1).any()):
        raise ConfigError(
            "batch['position_ids'] do not increase by one along the sequence, nor restart at 0 "
            "per document (packed rows); custom positions are not supported: drop position_ids "
            "(the default is 0..S-1), pass arange-like rows, or pack documents into one row "
            "whose positions restart at 0 (or give cu_seq_lens_q)"
        )
