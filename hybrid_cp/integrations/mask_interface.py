"""hybrid-cp in transformers' attention-mask interface: masks we read from the call, and masks we would drop.

transformers builds no mask for an attention implementation missing from its mask interface, so without
this registration a model whose mask is more than causal (Gemma 3's image blocks from ``token_type_ids``,
``config.is_causal=False``, any ``or_mask_function``) would reach the attention function with no mask and
run causally: silently wrong. Registered, transformers hands us the mask function it composed; we never
evaluate it (a dense mask is what context parallelism avoids) but read which parts it is made of:

- only parts the attention function reads from its own arguments (causal, a sliding window, attention
  chunks, packed documents, padding, which `_pre_forward` checks is right padding): `None`, as before;
- anything else: an `UnreadMask` naming the parts; the attention function refuses it by name unless the
  batch carries the row's `hcp.AttnMask` (`hcp.shard_batch(..., mask=m)`), which then says everything.

The known parts are an allow-list of transformers' own mask functions (by qualified name): a part that a
later transformers adds is refused until it is read here.

Under torch.compile the closures are hidden (dynamo cannot read ``__closure__``, nor run a function whose
closure holds tensors at trace time), so a traced call reads what stays visible: the outer function's name,
transformers' ``allow_is_causal_skip`` (cleared by every or/and/packed/block part) and whether the model's
modeling code can pass an or/and mask at all (`note_model`, scanned eagerly by `apply_context_parallel`).
Plain causal, sliding and chunked masks are read; an and-mask with the skip cleared is read as packing only
for a model whose code never passes extra parts; anything else is an `UnreadMask`.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

# transformers.masking_utils functions whose mask the attention function rebuilds from its own arguments
READ_PARTS = frozenset(
    {
        "causal_mask_function",
        "and_masks.<locals>.and_mask",
        "sliding_window_overlay.<locals>.inner_mask",
        "chunked_overlay.<locals>.inner_mask",
        "padding_mask_function.<locals>.inner_mask",
        "packed_sequence_mask_function.<locals>.inner_mask",
    }
)
_PACKED_REMAP = "remap_positions_for_packed_sequence.<locals>."
_AND = "and_masks.<locals>.and_mask"
# how a modeling file hands transformers' mask builders parts beyond causal/window/chunk/packing
_EXTRA_PARTS = re.compile(r"\b(or_mask_function|and_mask_function|block_sequence_ids)\s*=")
# config class -> whether a modeling file that uses it may compose extra parts (filled by note_model)
_COMPOSES_EXTRA: dict[type, bool] = {}


@dataclass(frozen=True)
class UnreadMask:
    """What transformers passes as ``attention_mask`` when its mask has parts the attention function does
    not read (`parts`: their qualified names)."""

    parts: tuple[str, ...]

    def describe(self) -> str:
        return ", ".join(self.parts)


def mask_parts(mask_function: Callable) -> set[str]:
    """The qualified names of the functions a composed transformers mask function is made of (its closures,
    recursively; tuples of functions, as `and_masks`/`or_masks` keep them, included)."""
    seen: set[int] = set()
    names: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
            return
        if not callable(value) or id(value) in seen or not hasattr(value, "__qualname__"):
            return
        seen.add(id(value))
        names.add(value.__qualname__)
        for cell in getattr(value, "__closure__", None) or ():
            try:
                walk(cell.cell_contents)
            except ValueError:  # an empty cell
                continue

    walk(mask_function)
    return names


def note_model(model: torch.nn.Module) -> None:
    """Record, per config class, whether the model's modeling code can pass or/and masks or image blocks to
    transformers' mask builders (read eagerly: a traced call cannot see the parts themselves)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            extra = _composes_extra(type(module).__module__)
            _COMPOSES_EXTRA[type(config)] = _COMPOSES_EXTRA.get(type(config), False) or extra


@functools.cache
def _composes_extra(module_name: str) -> bool:
    """Whether a module's source passes extra parts to transformers' mask builders (unreadable: assume so)."""
    try:
        return bool(_EXTRA_PARTS.search(inspect.getsource(sys.modules[module_name])))
    except (KeyError, OSError, TypeError):
        return True


def _traced_mask(mask_function: Callable, allow_is_causal_skip: bool, config: Any) -> UnreadMask | None:
    """The decision of `transformers_mask` while torch.compile traces (see the module docstring)."""
    name = mask_function.__code__.co_qualname
    if name == "causal_mask_function" or (name == _AND and allow_is_causal_skip):
        return None  # causal, or transformers' own sliding/chunked builders (and_mask of an overlay and causal)
    if name == _AND and not _COMPOSES_EXTRA.get(type(config), True):
        return None  # a model that never passes extra parts: the cleared skip is packing
    return UnreadMask((f"{name} (its parts are hidden while torch.compile traces)",))


def transformers_mask(
    *, mask_function: Callable, allow_is_causal_skip: bool = True, config: Any = None, **_: Any
) -> UnreadMask | None:
    """transformers' mask-interface entry for hybrid-cp: None when the attention function's own arguments
    describe the mask, else an `UnreadMask` naming the parts it would drop."""
    if torch.compiler.is_compiling():
        return _traced_mask(mask_function, allow_is_causal_skip, config)
    unread = sorted(
        name for name in mask_parts(mask_function) if name not in READ_PARTS and not name.startswith(_PACKED_REMAP)
    )
    if "causal_mask_function" not in mask_parts(mask_function) and not unread:
        unread = ["(no causal part)"]
    return UnreadMask(tuple(unread)) if unread else None


__all__ = ["UnreadMask", "mask_parts", "note_model", "transformers_mask", "READ_PARTS"]
