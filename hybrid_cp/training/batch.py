"""Shard a training batch over the cp group: labels shifted first, positions and padding right.

The three places where context-parallel training usually goes wrong are handled here, once:

- labels are shifted on the FULL sequence (labels[t] = next token), so the target of the last
  token of a shard, which lives on another rank, is not lost or taken from the wrong token;
- position ids are the global positions of this rank's tokens (`hcp.positions`), not 0..S_local-1;
- tokens added to reach the layout's granularity, and right-padding tokens of an attention
  mask, get `ignore_index` labels, so they never enter the loss.

Packed rows (documents concatenated into one row, "padding-free" training) are recognised from
position ids that restart at 0 (transformers' `DataCollatorWithFlattening`) or from explicit
``cu_seq_lens_q`` boundaries; no label crosses a document boundary.

A row under an `hcp.AttnMask` (``mask=``: a prompt and its completions, prefix-LM, image blocks) is cut
with the mask's layout and carries the mask to the model's attention layers under `MASK_KEY`; its
targets come from the caller (``shift_labels``), since only the caller knows which token follows which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from topology.layouts import Layout

from ..engine.agreement import require_mesh, validates
from ..engine.layout import boundaries, positions, record_packed, row_layout, shard_layout, shard_tokens
from ..engine.masks import AttnMask
from ..errors import ConfigError, CPError, ShapeError
from .batch_checks import agree_on_batch, batch_arguments, dense_labels, dense_positions, right_padding

if TYPE_CHECKING:
    from ..engine.mesh import CPMesh

PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_LABEL_KEYS = ("shift_labels",)
# the key under which shard_batch's result carries an `hcp.AttnMask`: `model(**shard)` passes it, with the other
# keywords, down to every attention layer (transformers forwards unknown keywords there, as it does cu_seq_lens_q)
MASK_KEY = "hcp_attn_mask"


def shift_labels(
    labels: torch.Tensor, ignore_index: int = -100, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token targets on the full sequence: out[:, t] = labels[:, t+1], the last is ignored.

    Positions whose input token or target token is masked out by `attention_mask` get
    `ignore_index` as well.

    Args:
        labels: Labels [B, S], not shifted.
        ignore_index: The label of tokens that count in no loss.
        attention_mask: Optional 0/1 mask [B, S].

    Returns:
        The targets [B, S].
    """
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        m = attention_mask.bool()
        keep = m.clone()
        keep[:, :-1] &= m[:, 1:]
        keep[:, -1] = False
        out = out.masked_fill(~keep, ignore_index)
    return out


def shard_batch(
    batch: Mapping[str, Any],
    cp: "CPMesh",
    *,
    ignore_index: int = -100,
    shift: bool = True,  # noqa: PLR0913 (public entry point)
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    mask: AttnMask | None = None,
) -> dict[str, Any]:
    """This rank's shard, in `cp.layout`, of a batch of full-sequence tensors (docs/training.md).

    `batch` maps names to tensors [B, S, ...] holding the WHOLE sequence (the same on every cp rank of
    a sequence group):

    - ``input_ids`` [B, S] (required; with ``mask=``, ``inputs_embeds`` [B, S, hidden] can take their place);
    - ``labels`` [B, S], NOT shifted (default ``input_ids``); shifted here on the full sequence unless
      ``shift=False`` (a ``shift_labels`` entry is taken as next-token targets);
    - ``position_ids``: default `hcp.positions`; given ones must increase by one along each row;
    - ``attention_mask`` [B, S] 0/1, right padding only: masked tokens' labels become `ignore_index`;
    - any other tensor [B, S, ...] is sharded the same way; others pass through unchanged.

    Packed rows (``input_ids`` [1, total] with ``position_ids`` restarting at 0 per document, or
    ``cu_seq_lens_q``) are cut with the packed layout, labels shifted inside each document, and the
    result holds ``cu_seq_lens_q/k`` and ``max_length_q/k`` for the model call. With ``mask=`` the
    targets must be given (``shift_labels``, or ``labels`` with ``shift=False``), ``position_ids`` are
    kept as given, and the result carries the mask under `MASK_KEY` for the model's attention layers.

    Args:
        batch: Full-sequence tensors by name, as above.
        cp: The mesh.
        ignore_index: The label of tokens that count in no loss.
        shift: Shift ``labels`` to next-token targets here, on the full sequence.
        pad_token_id: The token id of the padding slots that lengths not a multiple of the layout's
            granularity get at the end (with `ignore_index` labels, mask 0 and positions >= S).
        device: Where the results live; None: `cp.device`.
        mask: The rows' attention mask (`hcp.AttnMask`); None: causal rows (dense or packed).

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` (and the other keys given), ``shift_labels`` (the
        same tensor as ``labels``: it tells a model under `apply_context_parallel` that they are already
        next-token targets, so ``model(**out).loss`` is the cp group's token mean; or feed ``labels`` to
        `hcp.cross_entropy`), the packed keys for packed rows, and `MASK_KEY` for masked rows.

    Raises:
        ShapeError: Tensors whose batch or sequence dims disagree; media (`MEDIA_KEYS`: pixel_values, ...).
        ConfigError: Left padding or holes in ``attention_mask``, position ids that do not count up; with
            ``mask``: ``labels`` to be shifted, an ``attention_mask`` or packed keys (the mask says it all).
        InputTypeError: ``mask`` is not an `hcp.AttnMask`.
        InconsistentRanksError: The ranks of a cp group were given different batches or masks (checked on
            every call with `cp.validate`: one host all-reduce of a few integers).
    """
    error, out = None, {}
    try:
        if mask is not None:
            out = _shard_masked(
                batch, cp, mask, ignore_index=ignore_index, shift=shift, pad_token_id=pad_token_id, device=device
            )
        else:
            out = _shard_batch(
                batch, cp, ignore_index=ignore_index, shift=shift, pad_token_id=pad_token_id, device=device
            )
    except (ValueError, TypeError) as exc:
        if not validates(cp) or not isinstance(exc, CPError):
            raise
        error = exc
    agree_on_batch(cp, batch, error, mask)
    return out


def _shard_batch(
    batch: Mapping[str, Any],
    cp: "CPMesh",
    *,
    ignore_index: int,
    shift: bool,
    pad_token_id: int,
    device: torch.device | str | None,
) -> dict[str, Any]:
    require_mesh(cp)
    _refuse_media(batch)
    ids, mask, pos = batch_arguments(batch, ignore_index)
    if ids.is_floating_point():
        raise ConfigError(
            "shard_batch got batch['inputs_embeds'] without mask=: an embedded row (hybrid_cp.image_row) "
            "is sharded under its hcp.AttnMask; pass mask=row['mask'] (a causal row: "
            "hcp.AttnMask.blocks([0] * seq)), or pass input_ids"
        )
    if batch.get("shift_labels") is not None:  # next-token targets already (a collator's, or shard_batch's own)
        batch = {**batch, "labels": batch["shift_labels"]}
        shift = False
    device = torch.device(device) if device is not None else cp.device
    b, s = ids.shape
    cu = _packed_boundaries(batch, pos, b, s)
    if cu is not None:
        return _shard_packed(
            batch, cp, cu, ignore_index=ignore_index, shift=shift, pad_token_id=pad_token_id, device=device
        )
    mask_bool = None if mask is None else right_padding(mask, "batch['attention_mask']")
    labels = batch.get("labels")
    dense_labels(labels)
    labels = ids if labels is None else labels
    if shift:
        labels = shift_labels(labels, ignore_index, mask_bool)
    elif mask_bool is not None:
        labels = labels.masked_fill(~mask_bool, ignore_index)
    dense_positions(pos)
    lay = shard_layout(cp, s)
    out = _shard_rest(
        batch, cp, lay, device, skip=("input_ids", "labels", "position_ids", "attention_mask", *_LABEL_KEYS)
    )
    out["input_ids"] = _take(ids, cp, lay, device, pad_token_id)
    out["labels"] = _take(labels, cp, lay, device, ignore_index)
    if pos is None:
        out["position_ids"] = positions(s, cp, device=device)[None].expand(b, -1).contiguous()
    else:
        out["position_ids"] = _take(pos, cp, lay, device, _continue_positions)
    if mask is not None:
        out["attention_mask"] = _take(mask, cp, lay, device, 0)
    out["shift_labels"] = out["labels"]
    return out


def _masked_targets(batch: Mapping[str, Any], shift: bool) -> torch.Tensor | None:
    """A masked row's next-token targets: ``shift_labels``, or ``labels`` with shift=False; None without either."""
    targets = batch.get("shift_labels")
    if targets is None and batch.get("labels") is not None:
        if shift:
            raise ConfigError(
                "shard_batch(mask=...) got batch['labels'] to shift: under a mask the next token of a "
                "token is not the next one in the row (with a prompt and several completions the last "
                "prompt token has no single next token). Pass the targets as batch['shift_labels'] (or "
                "labels with shift=False): for each token the token it predicts, or ignore_index"
            )
        targets = batch["labels"]
    dense_labels(targets)
    return targets


def _shard_masked(
    batch: Mapping[str, Any],
    cp: "CPMesh",
    mask: AttnMask,
    *,
    ignore_index: int,
    shift: bool,
    pad_token_id: int,
    device: torch.device | str | None,
) -> dict[str, Any]:
    """`shard_batch` of rows that share one `hcp.AttnMask`: the mask's layout, the caller's positions and targets."""
    require_mesh(cp)
    _refuse_media(batch)
    ids, attention_mask, pos = batch_arguments(batch, ignore_index)
    lay = row_layout(cp, mask=mask, what="hcp.shard_batch")
    b, s = ids.shape[:2]
    key = "inputs_embeds" if ids.is_floating_point() else "input_ids"  # embeddings: hybrid_cp.image_row's row
    if s != mask.seq_len:
        raise ShapeError(
            f"batch[{key!r}] has {s} tokens per row but mask describes a row of {mask.seq_len}; "
            f"build the mask over the whole row"
        )
    if attention_mask is not None:
        raise ConfigError(
            "shard_batch(mask=...) takes no batch['attention_mask']: the mask says which keys each "
            "token sees (a token it leaves out sees nothing); drop attention_mask and set the "
            "targets of padding to ignore_index"
        )
    packed = [key for key in (*PACKED_KEYS, "cu_seqlens") if batch.get(key) is not None]
    if packed:
        raise ConfigError(
            f"shard_batch(mask=...) got batch[{packed[0]!r}]: a mask replaces packed-document "
            f"boundaries (AttnMask.documents(cu_seqlens) holds them); drop {packed}"
        )
    if pos is not None and pos.is_floating_point():
        raise ConfigError(f"batch['position_ids'] has dtype {pos.dtype}; position ids must be integers")
    targets = _masked_targets(batch, shift)
    device = torch.device(device) if device is not None else cp.device
    out = _shard_rest(batch, cp, lay, device, skip=(key, "labels", "position_ids", *_LABEL_KEYS))
    out[key] = _take(ids, cp, lay, device, pad_token_id if key == "input_ids" else 0)
    if pos is None:
        out["position_ids"] = positions(cp, device=device, mask=mask)[None].expand(b, -1).contiguous()
    else:  # pad slots see no key and no token sees them: any position
        out["position_ids"] = _take(pos, cp, lay, device, 0)
    if targets is not None:
        out["labels"] = _take(targets, cp, lay, device, ignore_index)
        out["shift_labels"] = out["labels"]
    out[MASK_KEY] = mask
    return out


def _take(x: torch.Tensor, cp: "CPMesh", lay: Layout, device: torch.device, pad) -> torch.Tensor:
    """This rank's tokens of the [B, S, ...] tensor `x` on `device`."""
    return shard_tokens(x, cp, 1, lay, pad).to(device).contiguous()


# batch entries that hold media or per-item metadata, never one value per token: sharding them along dim 1 would cut
# channels or grid rows (multimodal models need their features placed on the right shard, not supported yet)
MEDIA_KEYS = (
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "image_sizes",
    "pixel_attention_mask",
    "input_features",
    "input_features_mask",
    "feature_attention_mask",
    "audio_values",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "cross_attention_mask",
    "image_embeds",
)


def _refuse_media(batch: Mapping[str, Any]) -> None:
    """Media tensors (`MEDIA_KEYS`) raise by name, before any shape check could call them mis-shaped tokens."""
    media = [key for key in MEDIA_KEYS if isinstance(batch, Mapping) and isinstance(batch.get(key), torch.Tensor)]
    if media:
        raise ShapeError(
            f"batch[{media[0]!r}] (shape {tuple(batch[media[0]].shape)}) holds media, not one value per "
            f"token: hcp.shard_batch would cut it along its dim 1. Gemma 3's images: build the row with "
            f"hybrid_cp.image_row and shard its inputs_embeds under its mask; other media inputs are "
            f"not supported under context parallelism: drop {media} from the batch (a text-only "
            f"row), or train the multimodal model without context parallelism"
        )


def _shard_rest(
    batch: Mapping[str, Any], cp: "CPMesh", lay: Layout, device: torch.device, skip: tuple[str, ...]
) -> dict[str, Any]:
    """The other entries: per-token tensors (two dims or more) sharded with zero padding, the rest as they are."""
    return {
        key: _take(value, cp, lay, device, 0) if isinstance(value, torch.Tensor) and value.dim() >= 2 else value
        for key, value in batch.items()
        if key not in skip
    }


def _continue_positions(x: torch.Tensor, extra: int) -> torch.Tensor:
    """Positions past the end of the row, so that pad tokens sit after every real token."""
    return x[:, -1:] + torch.arange(1, extra + 1, device=x.device, dtype=x.dtype)


def _packed_boundaries(batch: Mapping[str, Any], pos: torch.Tensor | None, b: int, s: int) -> list[int] | None:
    """The packed row's document boundaries: explicit ``cu_seq_lens_q``, or where the position ids
    restart at 0; None for a dense batch."""
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seqlens"))
    if cu is not None:
        if isinstance(cu, torch.Tensor) and cu.dim() != 1:
            raise ShapeError(
                f"batch['cu_seq_lens_q'] has shape {tuple(cu.shape)}; pass the 1-D boundaries "
                f"[0, len_0, len_0 + len_1, ..., total] of the one packed row"
            )
        cu = boundaries(cu)
        if cu[-1] != s:
            raise ShapeError(
                f"batch['cu_seq_lens_q'] ends at {cu[-1]} but input_ids has {s} tokens; the boundaries "
                f"must describe the whole packed row"
            )
        if isinstance(pos, torch.Tensor):  # given positions must be the per-document ones
            want = torch.cat([torch.arange(e - a) for a, e in zip(cu, cu[1:])]).to(pos.device)
            if pos.shape[-1] != s or not torch.equal(pos.reshape(-1, s)[0].to(torch.long), want):
                raise ShapeError(
                    "batch['position_ids'] disagree with batch['cu_seq_lens_q']: in a packed row they must "
                    "restart at 0 in every document; drop one of them or make them agree"
                )
    elif (
        isinstance(pos, torch.Tensor)
        and s > 1
        and not pos.is_floating_point()
        and bool((pos[:, 1:] - pos[:, :-1] != 1).any())
    ):
        restarts = pos[:, 1:] - pos[:, :-1] != 1
        if not bool((pos[:, 1:][restarts] == 0).all()) or bool((pos[:, 0] != 0).any()):
            return None  # not packing: the dense checks below explain what is wrong
        if b != 1 or pos.shape[0] != 1:
            raise ConfigError(
                f"batch['position_ids'] restart inside rows of a batch of {b} (packed documents); a packed "
                f"row is a batch of one: concatenate the documents into input_ids [1, total] "
                f"(DataCollatorWithFlattening does)"
            )
        starts = torch.nonzero(pos[0] == 0).flatten().tolist()
        cu = starts + [s]
    else:
        return None
    if b != 1:
        raise ConfigError(
            f"packed documents (cu_seq_lens_q) need a batch of one row, got input_ids of batch {b}; "
            f"concatenate the documents into input_ids [1, total]"
        )
    if batch.get("attention_mask") is not None:
        raise ConfigError(
            "a packed row (position ids restarting per document, or cu_seq_lens_q) takes no "
            "attention_mask: padding-free rows have no padding; drop batch['attention_mask']"
        )
    return cu


def _shard_packed(
    batch: Mapping[str, Any],
    cp: "CPMesh",
    cu: list[int],
    *,
    ignore_index: int,
    shift: bool,
    pad_token_id: int,
    device: torch.device,
) -> dict[str, Any]:
    lay = row_layout(cp, cu_seqlens=cu, what="hcp.shard_batch")
    record_packed(cp, lay)
    ids = batch["input_ids"]
    labels = batch.get("labels")
    labels = ids if labels is None else labels
    if shift:
        labels = shift_labels(labels, ignore_index)
        ends = torch.tensor([e - 1 for a, e in zip(cu, cu[1:]) if e > a], dtype=torch.long)
        labels = labels.index_fill(1, ends.to(labels.device), ignore_index)  # no target across a boundary

    out = _shard_rest(
        batch, cp, lay, device, skip=("input_ids", "labels", "position_ids", "cu_seqlens", *_LABEL_KEYS) + PACKED_KEYS
    )
    out["input_ids"] = _take(ids, cp, lay, device, pad_token_id)
    out["labels"] = _take(labels, cp, lay, device, ignore_index)
    out["position_ids"] = positions(None, cp, device=device, cu_seqlens=cu)[None]
    # on the host: every attention layer reads the boundaries, and a device tensor would sync each time
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(lay.doc_lens)
    out.update(
        cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=longest, max_length_k=longest, shift_labels=out["labels"]
    )
    return out


__all__ = ["shard_batch", "shift_labels", "MASK_KEY"]
