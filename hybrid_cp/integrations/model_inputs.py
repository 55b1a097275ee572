"""The checks of a context-parallel transformers model call's keyword arguments (`model_inputs`): this
rank's own (labels only as `shift_labels`, no KV cache, position ids that are this rank's, a 0/1 padding
mask, or an `hcp.AttnMask` under `MASK_KEY` with the caller's own positions), the agreement on a
`ModelInputSignature` across the cp group, and right padding over the whole sequence
(`global_right_padding`, one all-reduce)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from topology.layouts import Layout

from ..engine.agreement import agree_across_ranks, digest, validates
from ..engine.layout import positions, row_layout
from ..engine.masks import AttnMask
from ..errors import ConfigError, ShapeError
from ..training.batch import MASK_KEY


class ModelInputSignature(NamedTuple):
    """What every cp rank of one model call must agree on."""

    batch: int = 0
    local_length: int = 0
    has_mask: int = 0
    documents: int = 0  # digest of the packed row's document lengths or of the AttnMask, 0 for a dense row
    loss: int = 0  # labels given: every rank joins the loss's all-reduce

    labels = ("batch", "local length", "has mask", "cu_seq_lens_q or hcp_attn_mask (checksum)", "labels given")


def _model_call_options(kwargs: Mapping[str, Any]) -> None:
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None and shifted is None:
        raise ConfigError(
            "labels= was passed to a context-parallel model without shift_labels=: the model would "
            "shift the labels inside this rank's shard, so the target of its last token (on another "
            "rank) would be wrong. Pass the output of hcp.shard_batch as it is (its labels are "
            "already shifted on the full sequence and it carries them as shift_labels too), or "
            "call the model without labels and use hcp.cross_entropy(logits, batch['labels'], cp)"
        )
    ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if shifted is not None and (not isinstance(shifted, torch.Tensor) or tuple(shifted.shape) != tuple(ref.shape[:2])):
        raise ShapeError(
            f"shift_labels must be this rank's [batch, seq_local] = {list(ref.shape[:2])} next-token "
            f"targets from hcp.shard_batch, got {getattr(shifted, 'shape', type(shifted).__name__)}"
        )
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"{name}= was passed: KV caches (generation) are not supported under context "
                f"parallelism; run generation on one device"
            )
    if kwargs.get("use_cache"):
        raise ConfigError(
            "use_cache=True is not supported under context parallelism (training only); pass use_cache=False"
        )


def _model_positions(cp, kwargs: dict, ref: torch.Tensor, lay: Layout, packed: bool) -> None:
    """Fill in missing position ids with this rank's, or check the given ones are them."""
    b, s = ref.shape[0], ref.shape[1]
    cu = kwargs.get("cu_seq_lens_q")
    expected = positions(None if packed else lay.seq_len, cp, device=ref.device, cu_seqlens=cu)
    pos = kwargs.get("position_ids")
    if pos is None:
        kwargs["position_ids"] = expected[None].expand(b, -1)
        return
    if pos.dim() == 1:
        pos = pos[None]
    if pos.shape[-1] != s:
        raise ShapeError(
            f"position_ids has local length {pos.shape[-1]} but input has {s}; pass "
            f"batch['position_ids'] from hcp.shard_batch"
        )
    offset = pos - expected
    if bool((offset != offset[:, :1]).any()) or (packed and bool((offset != 0).any())):
        raise ShapeError(
            "position_ids are not the positions of this rank's tokens (they differ from "
            "hcp.positions(...) by more than a constant, or for a packed row at all): pass "
            "batch['position_ids'] from hcp.shard_batch, or none (the default is filled in)"
        )


def _masked_row(cp, kwargs: dict, b: int, s: int) -> ModelInputSignature:
    """A call under an `hcp.AttnMask` (`MASK_KEY`): its layout, no other mask or boundaries, the caller's
    position ids (any integers: a completion continues its prompt's positions) or the token indices."""
    mask = kwargs[MASK_KEY]
    if not isinstance(mask, AttnMask):
        raise ConfigError(
            f"{MASK_KEY}={mask!r} must be an hcp.AttnMask (pass the output of "
            f"hcp.shard_batch(batch, cp, mask=m) as it is)"
        )
    given = [name for name in ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(name) is not None]
    if given:
        raise ConfigError(
            f"{given[0]}= with {MASK_KEY}=: the AttnMask says which keys each token sees (documents "
            f"and padding included); drop {given}"
        )
    lay = row_layout(cp, local_len=s, mask=mask, what="the model's input")
    pos = kwargs.get("position_ids")
    if pos is None:
        kwargs["position_ids"] = positions(
            cp, device=kwargs.get("input_ids", kwargs.get("inputs_embeds")).device, mask=mask
        )[None].expand(b, -1)
    elif not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.shape[-1] != s or pos.dim() > 2:
        raise ShapeError(
            f"position_ids must be this rank's [batch, {s}] integer positions from hcp.shard_batch, got "
            f"{getattr(pos, 'dtype', type(pos).__name__)} {tuple(getattr(pos, 'shape', ()))}"
        )
    return ModelInputSignature(b, s, 0, digest((lay.seq_len, mask)), int(kwargs.get("labels") is not None))


def _model_local_checks(cp, kwargs: dict) -> ModelInputSignature:
    """This rank's checks of a model call (filling in missing position ids); returns its signature."""
    ids, embeds, mask = kwargs.get("input_ids"), kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    ref = ids if ids is not None else embeds
    if ref is None:
        raise ConfigError(
            "the model needs input_ids=... (or inputs_embeds=...): this rank's shard from hcp.shard_batch"
        )
    b, s = ref.shape[0], ref.shape[1]
    _model_call_options(kwargs)
    if kwargs.get(MASK_KEY) is not None:
        return _masked_row(cp, kwargs, b, s)
    _prepared_mask(mask)
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    if (
        cu is None
        and isinstance(pos, torch.Tensor)
        and pos.dim() >= 1
        and pos.shape[-1] > 1
        and bool((pos[..., 1:] < pos[..., :-1]).any())
    ):
        raise ConfigError(
            "position_ids decrease inside this rank's row (packed documents, e.g. from "
            "DataCollatorWithFlattening) but no cu_seq_lens_q was passed, so the document boundaries "
            "of the whole row are unknown on this rank: shard the packed batch with hcp.shard_batch "
            "and pass its output as it is (it adds cu_seq_lens_q/cu_seq_lens_k)"
        )
    lay = row_layout(cp, local_len=s, cu_seqlens=cu, causal=True, what="the model's input")
    if cu is not None and (mask is not None or b != 1):
        raise ConfigError(
            "a packed row (cu_seq_lens_q) is one row without attention_mask: pass the output of "
            "hcp.shard_batch for the packed batch as it is"
        )
    _model_positions(cp, kwargs, ref, lay, cu is not None)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape != (b, s):
            raise ShapeError(
                f"attention_mask must be this rank's [batch, seq_local] = [{b}, {s}] 0/1 padding "
                f"mask from hcp.shard_batch, got {getattr(mask, 'shape', type(mask).__name__)}; "
                f"4-D and custom masks are not supported under context parallelism"
            )
        if mask.is_floating_point() or bool(((mask != 0) & (mask != 1)).any()):
            raise ConfigError(
                "attention_mask must hold 0/1 (or bool) padding flags; additive float masks are "
                "not supported under context parallelism"
            )
    return ModelInputSignature(
        b, s, int(mask is not None), 0 if cu is None else digest(lay.doc_lens), int(kwargs.get("labels") is not None)
    )


def _prepared_mask(mask) -> None:
    """A prepared (4-D, additive or boolean) attention mask is refused by name: hcp.attention cannot read it."""
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise ConfigError(
            f"attention_mask of shape {tuple(mask.shape)}: a prepared {mask.dim()}-D mask cannot be "
            f"split over the cp ranks. Pass a 2-D right-padding mask, or describe the mask as an "
            f"hcp.AttnMask and pass hcp.shard_batch(batch, cp, mask=m) to the model"
        )


def model_inputs(cp, kwargs: dict, refusal: str | None = None) -> dict:
    """Check a transformers model call's keyword arguments on this rank, agree on them across the cp
    group, and check a padding mask is right padding over the whole sequence. Returns the arguments
    with missing `position_ids` filled in. `refusal`: this rank's reason to refuse the call (media given to
    the model), raised on every rank through the agreement, so that ranks not given it do not wait."""
    kwargs = dict(kwargs)
    error, signature = None, ModelInputSignature()
    try:
        if refusal:
            raise ConfigError(refusal)
        signature = _model_local_checks(cp, kwargs)
    except ValueError as exc:
        if not validates(cp):
            raise
        error = exc
    if validates(cp):
        agree_across_ranks(cp, signature, ModelInputSignature.labels, error, "model inputs")
    if kwargs.get("attention_mask") is not None:
        global_right_padding(cp, kwargs["attention_mask"], kwargs["position_ids"])
    return kwargs


def global_right_padding(cp, mask: torch.Tensor, pos: torch.Tensor) -> None:
    """Right padding over the whole sequence: every kept token's position < every masked one's."""
    keep = mask.bool()
    pos = pos.expand(keep.shape[0], -1).to(torch.int64)
    big = torch.iinfo(torch.int64).max // 2
    last_kept = torch.where(keep, pos, torch.full_like(pos, -big)).amax(-1)
    first_masked = torch.where(~keep, pos, torch.full_like(pos, big)).amin(-1)
    stats = torch.stack([last_kept, -first_masked], dim=-1).to(cp.device)
    if cp.size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=cp.cp_group)
    rows = torch.nonzero(stats[:, 0] > -stats[:, 1]).flatten().tolist()
    if rows:
        raise ConfigError(
            f"attention_mask is not right padding over the whole sequence in batch rows {rows[:8]} (a "
            f"masked token comes before a kept one): context-parallel attention is causal, exact only "
            f"for right padding; right-pad the batch or drop the mask"
        )
