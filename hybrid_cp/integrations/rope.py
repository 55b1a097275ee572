"""Rotary embeddings whose value depends on the row's extent, computed from the whole row under context parallelism.

transformers' dynamic rope types (`modeling_rope_utils.dynamic_rope_update`: ``longrope`` and every type whose
name contains ``dynamic``) choose their frequencies and attention scaling from the largest position id the
rotary module is called with (longrope: short or long factors past ``original_max_position_embeddings``;
dynamic NTK: a base stretched to that length past ``max_position_embeddings``), and so does Phi-3.5-MoE's own
rotary (its long or short mscale). Under context parallelism each rank calls the rotary with its own shard's
positions, whose largest one is not the row's: without this module a rank whose shard stays below the threshold
would rotate with other frequencies than the single process (gradients off by percents, the loss by ~1e-6).

So each such rotary module is called with the row's extent: its positions plus one extra position, the row's
largest (its output for that one is dropped), so that the module's own rule sees what one process sees:

- a dense row: the whole row's largest position (`seq_len` - 1 plus the rows' offset), on every rank;
- a packed row: per document, the document's own length, as if each document were trained alone (the packed-row
  contract): the rotary runs once per distinct document length on this rank, each time from its initial state
  (a one-position call first: dynamic NTK keeps the frequencies of the longest row it has seen until a row
  shorter than its original length). transformers' own one-process packed row differs: its rotary sees the
  longest document's last position and gives that choice to every document.

Layout pad slots (positions past the row) are clamped to the extent: their outputs reach no real token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from topology.layouts import PAD, granularity

from ..engine.eager import eager_only
from ..engine.layout import positions, recorded_lengths, row_layout
from ..engine.mesh import CPMesh
from ..errors import ConfigError, SetupError

# rotary classes whose own forward reads the largest position id, whatever their rope type
EXTENT_ROTARIES = ("PhimoeRotaryEmbedding",)


def extent_dependent(module: torch.nn.Module) -> bool:
    """Whether the rotary `module`'s output depends on the largest position id it is called with: transformers'
    `dynamic_rope_update` rule (longrope, any type named *dynamic*, per layer type too) or `EXTENT_ROTARIES`."""
    if type(module).__name__ in EXTENT_ROTARIES:
        return True
    kinds = getattr(module, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return any(isinstance(k, str) and (k == "longrope" or "dynamic" in k) for k in kinds)


@dataclass(frozen=True)
class RowExtent:
    """What the rotaries of one model call need: the local length, and (extent, local slots) groups: one group
    without slots (all of them) for a dense row, one per distinct document length for a packed row."""

    local_len: int
    groups: tuple[tuple[Any, torch.Tensor | None], ...]

    @property
    def packed(self) -> bool:
        return self.groups[0][1] is not None


def row_extent(cp: CPMesh, kwargs: dict) -> RowExtent:
    """The extent of the row of a model call whose inputs `model_inputs.model_inputs` has checked (position ids
    filled in): the largest position + 1 of a dense row, each document's length in a packed row."""
    ref = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    s, cu = ref.shape[1], kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return _packed_extent(cp, s, cu, ref.device)
    lay = row_layout(cp, local_len=s, causal=True, what="the model's input")
    seen = sorted(recorded_lengths(cp).get(lay.padded_len, ()))
    if len(seen) > 1:
        raise ConfigError(
            f"the model has a rotary embedding whose frequencies depend on the row's length (a dynamic "
            f"rope type: longrope, dynamic NTK) but this row's length is ambiguous: hcp.shard_batch has "
            f"sharded lengths {seen} that all pad to {lay.padded_len} tokens on this mesh; pad every "
            f"batch to a multiple of {granularity(cp.layout, cp.ulysses_size, cp.ring_size)} "
            f"tokens with an attention_mask (e.g. DataCollatorWithPadding(pad_to_multiple_of=...)) so "
            f"that each padded size has one length"
        )
    pos = kwargs["position_ids"].reshape(-1, s)
    first = positions(lay.seq_len, cp, pos.device)[0]
    return RowExtent(s, ((lay.seq_len + (pos[:, 0] - first).max(), None),))


def _packed_extent(cp: CPMesh, s: int, cu: Any, device: torch.device) -> RowExtent:
    """One group per distinct document length on this rank (pad slots join the longest)."""
    lay = row_layout(cp, local_len=s, cu_seqlens=cu, causal=True, what="the model's input")
    starts = lay.doc_starts
    slots: dict[int, list[int]] = {}
    pads, at = [], 0
    for tok, _, n in lay.token_runs(cp.rank):
        if tok == PAD:
            pads += range(at, at + n)
        else:
            slots.setdefault(lay.doc_lens[bisect.bisect_right(starts, tok) - 1], []).extend(range(at, at + n))
        at += n
    if not slots:  # a shard of pad slots only
        slots[1] = []
    slots[max(slots)] += pads
    return RowExtent(
        s, tuple((e, torch.tensor(sorted(ix), dtype=torch.long, device=device)) for e, ix in sorted(slots.items()))
    )


class RowRotary:
    """The forward of a rotary module whose output depends on the row's extent (module docstring): the module's
    own forward, called with the positions of this rank's tokens plus the row's (or document's) last one."""

    def __init__(self, module: torch.nn.Module, original, holder):
        self.module, self.original, self.holder = module, original, holder

    @eager_only  # host-side grouping of a packed row; the rotary is small
    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        row = self.holder.row
        name = type(self.module).__name__
        if row is None:
            raise SetupError(
                f"{name} ran outside a call of the model apply_context_parallel prepared (its forward "
                f"pre-hook tells the rotary the row's extent); call the model itself"
            )
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != row.local_len:
            raise ConfigError(
                f"{name} has a rope type whose frequencies depend on the row's length, and was called "
                f"with position_ids of shape {getattr(position_ids, 'shape', None)}, not this rank's "
                f"[batch, {row.local_len}]: such rotaries (e.g. multi-axis position ids) are not supported "
                f"under context parallelism; use a static rope type (default, linear, yarn, llama3)"
            )
        if not row.packed:
            return self._with_extent(x, position_ids, row.groups[0][0], args, kwargs)
        self.original(self.module, x, position_ids[:, :1] * 0, *args, **kwargs)  # back to the initial frequencies
        out = None
        for extent, slots in row.groups:
            if not len(slots):
                continue
            got = self._with_extent(x, position_ids[:, slots], extent, args, kwargs)
            if out is None:
                out = tuple(g.new_empty(*g.shape[:-2], row.local_len, g.shape[-1]) for g in got)
            for o, g in zip(out, got):
                o[..., slots, :] = g
        return out

    def _with_extent(self, x, pos: torch.Tensor, extent, args, kwargs) -> tuple:
        last = torch.as_tensor(extent, device=pos.device, dtype=pos.dtype) - 1
        full = torch.cat([pos.clamp(max=last), last.expand(pos.shape[0], 1)], dim=-1)
        out = self.original(self.module, x, full, *args, **kwargs)
        n = pos.shape[-1]
        if not isinstance(out, tuple) or any(o.dim() < 2 or o.shape[-2] != n + 1 for o in out):
            raise SetupError(
                f"{type(self.module).__name__} returned {type(out).__name__} without the [..., positions, "
                f"dim] tensors of a rotary embedding; its row extent cannot be applied"
            )
        return tuple(o[..., :n, :] for o in out)


def route_rotaries(model: torch.nn.Module, holder) -> int:
    """Make every extent-dependent rotary of `model` read the row's extent from `holder.row` (set by the
    model's forward pre-hook, `row_extent`); returns how many there are."""
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), RowRotary):  # applied before: start from the class's
            del module.__dict__["forward"]
        if extent_dependent(module):
            module.__dict__["forward"] = RowRotary(module, type(module).forward, holder)
            count += 1
    return count


__all__ = ["EXTENT_ROTARIES", "RowExtent", "RowRotary", "extent_dependent", "route_rotaries", "row_extent"]
