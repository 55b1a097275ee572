"""Call patterns: an attention call is checked in full once per pattern, and its plan is built once.

A pattern is everything the checks and the plan read: the settings (`AttentionSpec.key`: values with their
types), q/k/v's and the sinks' shapes, strides, dtypes and devices, whether a backward will run, the mesh's
validate mode, the kernel registry's state and, for a dense row without `seq_len`, the lengths `hcp.shard`
recorded. Two calls with equal patterns get the same verdict from the checks, so a repeated call reuses the
first one's result (layout, kernel, window, signature and plan) and runs only what can differ between calls
with equal patterns: the mesh still alive, the shards' provenance, the sinks' values under
validate="always"/"debug", and the cross-rank agreement itself (which predicts or checks every call, as
docs/errors.md says). Only calls that passed their checks are remembered, the most recent `_PATTERNS` per mesh.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import SetupError
from .agreement import DESTROYED, DestroyedGroup, validates
from .kernels.registry import registry_version
from .layout import check_shards, recorded_lengths
from .mesh import CPMesh
from .validate import AttentionSignature, Checked, agree_on_attention, own_attention_checks, sinks_digest

if TYPE_CHECKING:
    from .pipeline import AttentionCall
    from .spec import AttentionSpec

__all__ = ["Prepared", "prepared"]

_PATTERNS = 64  # per mesh: a model's layer kinds times forward/backward recomputation fit; packed rows add one a step


@dataclass
class Prepared:
    """A checked call pattern: what the checks decided, the signature the ranks agree on, and the plan
    (built on the pattern's first call that runs the pipeline)."""

    spec: "AttentionSpec"
    checked: Checked
    signature: AttentionSignature
    agrees: bool  # whether calls on this mesh take part in the agreement
    call: "AttentionCall | None" = None

    def plan(self, build: Callable[[], "AttentionCall"]) -> "AttentionCall":
        """The pattern's plan, built by `build` the first time."""
        if self.call is None:
            self.call = build()
        return self.call


# Weak keys: a dropped mesh drops its patterns. A record, not a result: the calls are independent to the caller.
_BY_MESH: "weakref.WeakKeyDictionary[Any, OrderedDict]" = weakref.WeakKeyDictionary()


def _tensor_key(x: Any) -> tuple:
    return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)


def _pattern(q, k, v, cp: "CPMesh", spec: "AttentionSpec", sinks, needs_grad: int) -> tuple | None:
    """The call's pattern key, or None for a call that has none (checked in full every time)."""
    tensor = torch.Tensor
    if (
        type(q) is not tensor
        or type(k) is not tensor
        or type(v) is not tensor
        or (sinks is not None and type(sinks) is not tensor)
    ):
        return None
    try:
        settings = spec.key()
    except TypeError:
        return None
    lengths = ()
    if spec.seq_len is None and spec.cu_seqlens is None:  # the length comes from what `hcp.shard` recorded
        lengths = tuple(sorted(recorded_lengths(cp).get(q.shape[1] * cp.size, ())))
    return (
        settings,
        _tensor_key(q),
        _tensor_key(k),
        _tensor_key(v),
        None if sinks is None else _tensor_key(sinks),
        int(needs_grad),
        (type(cp.validate), cp.validate),
        registry_version(),
        lengths,
    )


def prepared(q, k, v, cp: "CPMesh", spec: "AttentionSpec", sinks=None, needs_grad: int = 0) -> Prepared:
    """The checked call (`validate.checked_call`'s checks and agreement), from its pattern's first call when this
    one repeats it. Raises what the checks raise."""
    key = _pattern(q, k, v, cp, spec, sinks, needs_grad) if isinstance(cp, CPMesh) else None
    seen = _BY_MESH.get(cp) if key is not None else None
    entry = seen.get(key) if seen is not None else None
    tensors = (("q", q), ("k", k), ("v", v))
    if entry is not None:
        if type(cp.cp_group) is DestroyedGroup:
            raise SetupError(DESTROYED)
        try:
            check_shards(cp, tensors, 1, entry.checked.lay, "hcp.attention")  # provenance: per tensor, every call
        except (TypeError, ValueError):
            entry = None  # the full checks raise it, agreed across the ranks
    if entry is not None:
        seen.move_to_end(key)
        if entry.agrees:
            signature = entry.signature
            if sinks is not None and cp.validate in ("always", "debug"):  # their values, every call
                signature = signature._replace(sinks=sinks_digest(cp, sinks))
            agree_on_attention(cp, signature, None, tensors)
        return entry
    result, signature, error = own_attention_checks(q, k, v, cp, spec, sinks, needs_grad)
    agree_on_attention(cp, signature, error, tensors)
    entry = Prepared(spec, result, signature, validates(cp))
    if key is not None:
        seen = _BY_MESH.setdefault(cp, OrderedDict())
        seen[key] = entry
        while len(seen) > _PATTERNS:
            seen.popitem(last=False)
    return entry
