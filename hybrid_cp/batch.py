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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from topology.layouts import make_layout

from .layout import _record_length, _shard_tensor, positions, row_layout
from .errors import ConfigError, InputTypeError, ShapeError

if TYPE_CHECKING:
    from .mesh import CPMesh

PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _check_right_padding(mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """Return the mask as bool after checking every row is ones then zeros (right padding)."""
    if mask.dtype == torch.bool:
        m = mask
    else:
        if mask.is_floating_point() or mask.is_complex():
            raise ConfigError(f"{name} has dtype {mask.dtype}; pass a 0/1 integer or bool padding mask "
                             f"(additive float masks are not supported under context parallelism)")
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ConfigError(f"{name} holds values other than 0 and 1 (e.g. {mask[bad][0].item()}); pass a "
                             f"0/1 padding mask")
        m = mask != 0
    # right padding: once a row turns 0 it stays 0, i.e. the mask never increases along the row
    if m.shape[-1] > 1 and bool((m[..., 1:] & ~m[..., :-1]).any()):
        rows = torch.nonzero((m[..., 1:] & ~m[..., :-1]).any(-1)).flatten().tolist()
        raise ConfigError(f"{name} is not right padding in batch rows {rows[:8]} (a 0 is followed by a 1: left "
                         f"padding, holes or packed documents). Context-parallel attention is causal over the "
                         f"whole sequence, which is exact only for right padding; right-pad the batch "
                         f"(tokenizer padding_side='right') or drop the mask")
    return m


def shift_labels(labels: torch.Tensor, ignore_index: int = -100,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token targets on the full sequence: out[:, t] = labels[:, t+1], the last is ignored.

    Positions whose input token or target token is masked out by `attention_mask` get
    `ignore_index` as well.
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


def shard_batch(batch: Mapping[str, Any], cp: "CPMesh", *, ignore_index: int = -100, shift: bool = True,
                pad_token_id: int = 0, device: torch.device | str | None = None) -> dict[str, Any]:
    """This rank's shard, in `cp.layout`, of a batch of full-sequence tensors.

    `batch` maps names to tensors shaped [batch, seq, ...] holding the WHOLE sequence (the same on
    every cp rank of a sequence group):

    - ``input_ids`` (required) [B, S] integer token ids;
    - ``labels`` [B, S], Hugging Face style: NOT shifted (the model-side convention where
      labels = input_ids); defaults to ``input_ids``. With ``shift=True`` (default) they are shifted
      here, on the full sequence: out[t] = labels[t+1], the last one `ignore_index`. Pass
      ``shift=False`` if your labels already are next-token targets;
    - ``position_ids`` [B, S] or [1, S] or [S]: default `hcp.positions` (0..S-1 globally); given ones
      must increase by one along each row (an offset is fine; packed documents are not supported);
    - ``attention_mask`` [B, S] 0/1 right-padding mask: masked tokens' labels become `ignore_index`
      (left padding or holes raise ValueError);
    - any other tensor with at least two dims shaped [B, S, ...] is sharded the same way (padding
      with zeros); tensors with fewer dims and non-tensors are passed through unchanged.

    Packed rows: pass ``input_ids`` [1, total] with ``position_ids`` that restart at 0 in every
    document (as `DataCollatorWithFlattening` produces) or ``cu_seq_lens_q`` = [0, len_0, ...,
    total]. The row is sharded with the packed layout, labels are shifted inside each document (the
    last token of every document gets `ignore_index`), ``position_ids`` restart per document, and
    the result holds ``cu_seq_lens_q``/``cu_seq_lens_k`` (the global boundaries, int32, on the host) and
    ``max_length_q``/``max_length_k``: pass them to the model with the rest (they reach the attention
    layers as transformers' flash-attention keywords do).

    Lengths that are not a multiple of the layout's granularity are padded at the end: pad tokens
    get `pad_token_id`, `ignore_index` labels, mask 0 and positions >= S. Results are on `device`
    (default `cp.device`). The returned dict has ``input_ids``, ``labels``, ``position_ids`` (and
    the other keys given); feed ``labels`` to `hcp.cross_entropy`, not to the model.
    """
    if not isinstance(batch, Mapping):
        raise InputTypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    if "input_ids" not in batch or not isinstance(batch["input_ids"], torch.Tensor):
        raise ShapeError(f"batch needs an 'input_ids' tensor [batch, seq] (got keys {sorted(batch)}); "
                         f"pass the full-sequence token ids as batch['input_ids']")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ShapeError(f"batch['input_ids'] must be [batch, seq], got shape {tuple(ids.shape)}; "
                         f"add a batch dimension with input_ids[None]")
    if ids.is_floating_point():
        raise ConfigError(f"batch['input_ids'] has dtype {ids.dtype}; token ids must be integers")
    b, s = ids.shape
    if s == 0 or b == 0:
        raise ShapeError(f"batch['input_ids'] has shape {tuple(ids.shape)}; it needs at least one sequence "
                         f"and one token")
    if not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index={ignore_index!r} must be an int")
    device = torch.device(device) if device is not None else cp.device

    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise ShapeError(f"batch['attention_mask'] must be a [batch, seq] 0/1 padding mask, got "
                         f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}; 4-D or custom masks are "
                         f"not supported under context parallelism (attention is causal over the sequence)")
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if key == "position_ids" and value.shape[0] == 1:
            pass
        elif value.shape[0] != b:
            raise ShapeError(f"batch[{key!r}] has batch size {value.shape[0]} (shape {tuple(value.shape)}) but "
                             f"input_ids has {b}; every per-token tensor must be [{b}, {s}, ...]")
        if value.shape[1] != s:
            raise ShapeError(f"batch[{key!r}] has sequence length {value.shape[1]} (shape {tuple(value.shape)}) "
                             f"but input_ids has {s}; every per-token tensor must be [{b}, {s}, ...] over "
                             f"the same full sequence")
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 1:
        if pos.shape[0] != s:
            raise ShapeError(f"batch['position_ids'] has length {pos.shape[0]} but input_ids has {s}")
        pos = pos[None]
    cu = _packed_boundaries(batch, pos, b, s)
    if cu is not None:
        return _shard_packed(batch, cp, cu, ignore_index=ignore_index, shift=shift, pad_token_id=pad_token_id,
                             device=device)

    mask_bool = None
    if mask is not None:
        mask_bool = _check_right_padding(mask, "batch['attention_mask']")

    labels = batch.get("labels")
    if labels is None:
        labels = ids
    elif not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ShapeError(f"batch['labels'] must be a [batch, seq] integer tensor, got "
                         f"{getattr(labels, 'shape', type(labels).__name__)}")
    elif labels.is_floating_point():
        raise ConfigError(f"batch['labels'] has dtype {labels.dtype}; labels must be integer token ids")
    if shift:
        labels = shift_labels(labels, ignore_index, mask_bool)
    elif mask_bool is not None:
        labels = labels.masked_fill(~mask_bool, ignore_index)

    if pos is not None:
        if pos.is_floating_point():
            raise ConfigError(f"batch['position_ids'] has dtype {pos.dtype}; position ids must be integers")
        if s > 1 and bool((pos[:, 1:] - pos[:, :-1] != 1).any()):
            raise ConfigError("batch['position_ids'] do not increase by one along the sequence, nor restart at 0 "
                             "per document (packed rows); custom positions are not supported: drop position_ids "
                             "(the default is 0..S-1), pass arange-like rows, or pack documents into one row "
                             "whose positions restart at 0 (or give cu_seq_lens_q)")

    _record_length(cp, s)
    lay = make_layout(cp.layout, cp.ulysses_size, cp.ring_size, seq_len=s)

    def take(x: torch.Tensor, pad) -> torch.Tensor:
        return _shard_tensor(x, cp, 1, lay, pad).to(device).contiguous()

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("input_ids", "labels", "position_ids", "attention_mask"):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            out[key] = take(value, 0)
        else:
            out[key] = value
    out["input_ids"] = take(ids, pad_token_id)
    out["labels"] = take(labels, ignore_index)
    if pos is None:
        out["position_ids"] = positions(s, cp, device=device)[None].expand(b, -1).contiguous()
    else:
        def pos_pad(x, extra):  # continue the positions past the end, so pads sit after every token
            return x[:, -1:] + torch.arange(1, extra + 1, device=x.device, dtype=x.dtype)
        out["position_ids"] = take(pos, pos_pad)
    if mask is not None:
        out["attention_mask"] = take(mask, 0)
    return out


def _packed_boundaries(batch: Mapping[str, Any], pos: torch.Tensor | None, b: int, s: int) -> list[int] | None:
    """The packed row's document boundaries: explicit ``cu_seq_lens_q``, or where the position ids
    restart at 0; None for a dense batch."""
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seqlens"))
    if cu is not None:
        if isinstance(cu, torch.Tensor) and cu.dim() != 1:
            raise ShapeError(f"batch['cu_seq_lens_q'] has shape {tuple(cu.shape)}; pass the 1-D boundaries "
                             f"[0, len_0, len_0 + len_1, ..., total] of the one packed row")
        cu = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
        if cu[-1] != s:
            raise ShapeError(f"batch['cu_seq_lens_q'] ends at {cu[-1]} but input_ids has {s} tokens; the boundaries "
                             f"must describe the whole packed row")
        if isinstance(pos, torch.Tensor):  # given positions must be the per-document ones
            want = torch.cat([torch.arange(e - a) for a, e in zip(cu, cu[1:])]).to(pos.device)
            if pos.shape[-1] != s or not torch.equal(pos.reshape(-1, s)[0].to(torch.long), want):
                raise ShapeError("batch['position_ids'] disagree with batch['cu_seq_lens_q']: in a packed row they must "
                                 "restart at 0 in every document; drop one of them or make them agree")
    elif isinstance(pos, torch.Tensor) and s > 1 and not pos.is_floating_point() and \
            bool((pos[:, 1:] - pos[:, :-1] != 1).any()):
        restarts = (pos[:, 1:] - pos[:, :-1] != 1)
        if not bool((pos[:, 1:][restarts] == 0).all()) or bool((pos[:, 0] != 0).any()):
            return None  # not packing: the dense checks below explain what is wrong
        if b != 1 or pos.shape[0] != 1:
            raise ConfigError(f"batch['position_ids'] restart inside rows of a batch of {b} (packed documents); a packed "
                             f"row is a batch of one: concatenate the documents into input_ids [1, total] "
                             f"(DataCollatorWithFlattening does)")
        starts = torch.nonzero(pos[0] == 0).flatten().tolist()
        cu = starts + [s]
    else:
        return None
    if b != 1:
        raise ConfigError(f"packed documents (cu_seq_lens_q) need a batch of one row, got input_ids of batch {b}; "
                         f"concatenate the documents into input_ids [1, total]")
    if batch.get("attention_mask") is not None:
        raise ConfigError("a packed row (position ids restarting per document, or cu_seq_lens_q) takes no "
                         "attention_mask: padding-free rows have no padding; drop batch['attention_mask']")
    return cu


def _shard_packed(batch: Mapping[str, Any], cp: "CPMesh", cu: list[int], *, ignore_index: int, shift: bool,
                  pad_token_id: int, device: torch.device) -> dict[str, Any]:
    lay = row_layout(cp, cu_seqlens=cu, what="hcp.shard_batch")
    ids = batch["input_ids"]
    labels = batch.get("labels")
    labels = ids if labels is None else labels
    if shift:
        labels = shift_labels(labels, ignore_index)
        ends = torch.tensor([e - 1 for a, e in zip(cu, cu[1:]) if e > a], dtype=torch.long)
        labels = labels.index_fill(1, ends.to(labels.device), ignore_index)  # no target across a boundary

    def take(x: torch.Tensor, pad) -> torch.Tensor:
        return _shard_tensor(x, cp, 1, lay, pad).to(device).contiguous()

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("input_ids", "labels", "position_ids", "cu_seqlens") + PACKED_KEYS:
            continue
        out[key] = take(value, 0) if isinstance(value, torch.Tensor) and value.dim() >= 2 else value
    out["input_ids"] = take(ids, pad_token_id)
    out["labels"] = take(labels, ignore_index)
    out["position_ids"] = positions(None, cp, device=device, cu_seqlens=cu)[None]
    # on the host: every attention layer reads the boundaries, and a device tensor would sync each time
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(lay.doc_lens)
    out.update(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=longest, max_length_k=longest)
    return out


__all__ = ["shard_batch", "shift_labels"]
