"""The cross-rank agreement: every rank of a cp group raises, instead of hanging in a collective, when one
rank rejected its own arguments or the ranks were called differently (docs/errors.md, "Validation").

Each check first runs on the rank alone and raises a `CPError` subclass for inputs the rank can judge by
itself (the attention checks in `validate`, the mesh's in `mesh`, the batch's in `training.batch_checks`,
a model call's in `integrations.model_inputs`); the calls that lead to a collective then agree here.
`checked_on_every_rank` is both steps for a check that returns its signature.

A call is summarised as a signature, a `typing.NamedTuple` of integers whose field labels name what
differs; `digest` turns it, or any text, into one integer the ranks compare. `agree_across_ranks` is the
protocol (one host all-reduce, a full all-gather only when something differs); `history(cp)` is what
validate=True has learned about a mesh's calls. It sits below `layout` and `validate`, which both ask for
agreement, and recognises a mesh by its fields (`MeshLike`), not by its class.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, CPError, InconsistentRanksError, InputTypeError, NonFiniteError, SetupError
from .comm import comm_guard
from .eager import eager_only


@runtime_checkable
class MeshLike(Protocol):
    """What the checks read of a `CPMesh` (hcp.init_cp_mesh's result)."""

    ulysses_size: int
    ring_size: int
    layout: str
    device: torch.device
    validate: bool | str


class DestroyedGroup:
    """Stands in for each process group of a mesh that `hcp.destroy_cp_mesh` destroyed: any use raises (None
    would silently mean the world group to torch.distributed)."""

    def __getattr__(self, name: str):
        raise SetupError(DESTROYED)


DESTROYED = "this CPMesh was destroyed by hcp.destroy_cp_mesh; build a new one with hcp.init_cp_mesh(...)"


def require_mesh(cp: Any) -> None:
    """InputTypeError unless `cp` is a mesh; SetupError if `hcp.destroy_cp_mesh` destroyed it."""
    if not isinstance(cp, MeshLike):
        raise InputTypeError(f"cp must be a CPMesh from hcp.init_cp_mesh(...), got {type(cp).__name__}")
    if type(cp.cp_group) is DestroyedGroup:
        raise SetupError(DESTROYED)


def validates(cp: Any) -> bool:
    """Whether calls on `cp` take part in the cross-rank agreement (a mesh description without process
    groups, `hybrid_cp.testing.mesh_description`, never does)."""
    return (
        isinstance(cp, MeshLike)
        and bool(cp.validate)
        and cp.ulysses_size * cp.ring_size > 1
        and getattr(cp, "check_group", None) is not None
    )


def checked_on_every_rank(cp: Any, check: Callable[[], Sequence[int]], names: Sequence[str], what: str) -> None:
    """Run this rank's own `check` (raises a CPError on a bad argument, returns the call's signature: ints
    labelled by `names`), then with `cp.validate` agree on it across the cp ranks, so that one rank's bad or
    different argument makes every rank raise before the call's first collective instead of leaving the others
    waiting in it. Inside a compiled graph only the rank's own check runs (the graph's arguments are the same on
    every rank)."""
    if torch.compiler.is_compiling():
        check()
        return
    require_mesh(cp)
    error, signature = None, [0] * len(names)
    try:
        signature = [int(x) for x in check()]
    except (ValueError, TypeError) as exc:
        if not validates(cp) or not isinstance(exc, CPError):
            raise
        error = exc
    if validates(cp):
        agree_across_ranks(cp, signature, names, error, what)


# ---- digests and the cross-rank agreement -------------------------------------------------------


def digest(value: Any) -> int:
    """A 56-bit hash of `value`'s repr (the same on every rank for equal values; fits an int64 with
    its negation, which the agreement all-reduce needs)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "big")


def _metadata(tensors) -> list[int]:
    """Checksum of dtype/stride/requires_grad/device type of each tensor, and NaN/inf flags (debug)."""
    meta, flags = [], []
    for t in tensors:
        meta.append(f"{t.dtype}|{t.stride()}|{int(t.requires_grad)}|{t.device.type}")
        flags.append(int(not bool(torch.isfinite(t.detach()).all())))
    return [digest("/".join(meta))] + flags


@dataclass
class ValidationHistory:
    """One mesh's agreed call signatures (the same on every rank), the period they repeat with, and
    how many checks of each kind ran ("skipped", "hash", "full")."""

    signatures: list[int] = field(default_factory=list)
    signature_period: int | None = None
    fields: dict[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)  # recent hash -> its fields
    validation_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


# A record, not a result: validate=True predicts each call from the calls before it on the same
# mesh, and those calls return nothing to the next. Weak keys: a dropped mesh drops its history.
_HISTORIES: "weakref.WeakKeyDictionary[Any, ValidationHistory]" = weakref.WeakKeyDictionary()


def history(cp) -> ValidationHistory:
    """What validation has recorded for mesh `cp` (`validation_calls` counts skipped, cheap and full checks)."""
    return _HISTORIES.setdefault(cp, ValidationHistory())


@eager_only  # a host collective and a history of signatures: never traced
def agree_across_ranks(
    cp,
    values,
    names,
    error: Exception | None,
    what: str,
    tensors: tuple[tuple[str, torch.Tensor], ...] = (),
    *,
    learn: bool = True,
) -> None:
    """Raise on every rank if any cp rank failed its own checks or the ranks disagree on `values`
    (a signature: a NamedTuple of ints, labelled by `names`), so that no rank goes on into a
    collective alone or with different arguments.

    The check is one all-reduce(MAX) of (hash, -hash, failed) on the host group; only if that
    shows a failure or a disagreement (every rank sees the same reduced values, so every rank
    takes this branch) the full all-gather that names the ranks and fields. validate="debug"
    always takes the full all-gather, with the inputs' metadata checksum and NaN/inf flags of
    `tensors` (name, tensor) added. validate=True skips the check when this rank's signature is
    the predicted one (`_predicted`): the prediction depends only on calls that agreed, so it is
    the same on every rank, and a rank whose call differs from it always checks. `learn=False`: a call
    that is checked every time (one per step, e.g. `shard_batch`, whose signature holds a checksum of
    the batch) and stays out of the history the prediction reads.
    """
    values, names = [int(x) for x in values], list(names)
    if cp.validate == "debug":
        extra = _metadata([t for _, t in tensors]) if error is None and tensors else [0] * (len(tensors) + 1)
        if tensors:
            values += [extra[0]]
            names += ["dtype/stride/requires_grad/device (checksum)"]
        _full_check(cp, values, names, error, what, extra[1:], [n for n, _ in tensors])
        return
    h = digest(tuple(values)) if error is None else 0
    hist = history(cp)
    if learn and cp.validate is True and error is None and h == _predicted(hist):
        hist.validation_calls["skipped"] += 1
        _advance(hist, h)
        return
    hist.validation_calls["hash"] += 1
    mine = tuple(zip(names, values))
    if _reduced_agrees(cp, h, error, what, _unlike_prediction(hist, mine) if learn else ""):
        if learn:
            _agreed(hist, h)
            _remember(hist, h, mine)
        return
    _full_check(cp, values, names, error, what, [], [])


def _remember(hist: ValidationHistory, h: int, fields: tuple[tuple[str, int], ...]) -> None:
    """Keep the fields of a few recent agreed signatures: a call that later deviates alone can name them."""
    hist.fields[h] = fields
    if len(hist.fields) > 64:
        del hist.fields[next(iter(hist.fields))]


def _unlike_prediction(hist: ValidationHistory, mine: tuple[tuple[str, int], ...]) -> str:
    """The fields in which this call differs from the predicted one (for the message of a lone check)."""
    predicted = hist.fields.get(_predicted(hist) or 0)
    if predicted is None:
        return ""
    diffs = [
        f"{name}: {ours} here vs {theirs} predicted"
        for (name, ours), (_, theirs) in zip(mine, predicted)
        if ours != theirs
    ]
    return f" It differs from the call the ranks predicted in: {'; '.join(diffs)}." if diffs else ""


def _reduced_agrees(cp, h: int, error: Exception | None, what: str, unlike: str = "") -> bool:
    """The cheap check: one all-reduce(MAX) of (hash, -hash, failed); True when every rank agreed."""
    mine = torch.tensor([h, -h, 0 if error is None else 1], dtype=torch.int64)
    try:
        with comm_guard(cp, f"the {what} agreement check"):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=cp.check_group)
    except CommTimeoutError as exc:
        if cp.validate is not True:
            raise
        # Under validate=True the other ranks skip calls they predicted; a rank that checks alone
        # times out here: its call differed from theirs (or from what they expected).
        if error is not None:
            raise error from exc
        raise CommTimeoutError(
            f"{what}: with validate=True only a call that differs from the one every rank "
            f"predicted from earlier calls is checked, and no other rank joined this check: "
            f'this call most likely differs across ranks (rerun with validate="always" to have '
            f"the differing fields named).{unlike} {exc}"
        ) from exc
    top, neg_low, any_failed = mine.tolist()
    return not any_failed and top == h and -neg_low == h


_HISTORY = 512  # call signatures remembered: a period longer than half of this is not learned


def _predicted(hist: ValidationHistory) -> int | None:
    """The signature every rank expects next: the one a period ago when the recent calls repeat
    with a period (a training step: one batch check, then layers, full and sliding-window layers
    alternating, recomputation in backward), else the same as the last call."""
    seen = hist.signatures
    if not seen:
        return None
    return seen[-hist.signature_period] if hist.signature_period else seen[-1]


def _advance(hist: ValidationHistory, h: int) -> None:
    """A predicted call: the period still holds."""
    hist.signatures.append(h)
    if len(hist.signatures) > 2 * _HISTORY:
        del hist.signatures[:-_HISTORY]


def _agreed(hist: ValidationHistory, h: int) -> None:
    """A checked call that agreed: remember it and find the shortest period the history is consistent
    with (at least one call of overlap). Only agreed or predicted calls enter the history, so it is
    the same on every rank."""
    _advance(hist, h)
    seen = hist.signatures[-_HISTORY:]
    n = len(seen)
    hist.signature_period = next(
        (
            p
            for p in (n - 1 - i for i in range(n - 2, -1, -1) if seen[i] == h)
            if seen[n - min(p, n - p) :] == seen[n - p - min(p, n - p) : n - p]
        ),
        None,
    )


def _full_check(
    cp,
    values: list[int],
    names: list[str],
    error: Exception | None,
    what: str,
    nonfinite: list[int],
    tensor_names: list[str],
) -> None:
    """All-gather every rank's (failed, NaN flags, signature) and raise naming the ranks and fields."""
    history(cp).validation_calls["full"] += 1
    mine = torch.tensor([0 if error is None else 1] + list(nonfinite) + list(values), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(cp.size)]
    with comm_guard(cp, f"the {what} agreement check"):
        dist.all_gather(rows, mine, group=cp.check_group)
    if error is not None:
        raise error
    rows = [r.tolist() for r in rows]
    bad = [rank for rank, r in enumerate(rows) if r[0]]
    if bad:
        raise InconsistentRanksError(
            f"cp ranks {bad} rejected their {what} (their error says why); every rank stops here instead of hanging"
        )
    k = len(nonfinite)
    found = [f"{tensor_names[i]} on cp rank {rank}" for rank, r in enumerate(rows) for i in range(k) if r[1 + i]]
    if found:
        raise NonFiniteError(
            f'NaN or inf in {", ".join(found)} ({what}, validate="debug"); every rank stops '
            f"here; find where that rank's activations overflow"
        )
    for rank, r in enumerate(rows):
        if r[1 + k :] != list(values):
            diffs = [
                f"{name}: {theirs} on cp rank {rank} vs {ours} here"
                for name, theirs, ours in zip(names, r[1 + k :], values)
                if theirs != ours
            ]
            raise InconsistentRanksError(
                f"inconsistent {what} across the cp group ("
                + "; ".join(diffs)
                + "); every rank must pass its shard of the same batch with the same settings"
            )
