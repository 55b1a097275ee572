"""Training with a context-parallel degree per group of documents, chosen every step.

    meshes = hcp.init_cp_meshes()                                  # once: a mesh per degree 1, 2, 4, ...
    sched = hcp.schedule_documents(lengths, meshes, tokens_per_rank=C)   # per step, the GLOBAL batch
    for mb in hcp.micro_batches(sched, meshes):                    # digest agreed first; lockstep
        row = {"input_ids": torch.cat([docs[d] for d in mb.docs])[None], "cu_seq_lens_q": mb.cu_seqlens}
        with use_mesh(model, mb.cp):                               # forward AND backward inside
            out = model(**hcp.shard_batch(row, mb.cp))
            hcp.dynamic_loss(out.logits, labels, sched).backward()
    # then average the gradients over the world (FSDP2 / DDP do) and step

The loss contract: N = the step's valid targets (`sched.targets`, known before the first backward), W the
world size. Each rank back-propagates W / N times the sum of its token losses, over all its micro-batches,
so the average of the ranks' gradients is the gradient of (sum of all token losses) / N: one process on the
same global batch, whatever the groups, degrees and micro-batches. No per-micro-batch or per-group mean.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from topology.schedule import Group, ScheduleError, StepSchedule, schedule_step

from ..engine.layout import boundaries
from ..errors import ConfigError, InconsistentRanksError
from .batch import PACKED_KEYS, shard_batch, shift_labels
from .loss import GroupReduced

if TYPE_CHECKING:
    from ..engine.mesh import CPMesh
    from ..engine.meshes import CPMeshes


@dataclass(frozen=True)
class DynamicCP:
    """A dynamic context-parallel degree per group of documents, for `CPTrainer(dynamic_cp=...)`.

    Args:
        tokens_per_rank: C, the tokens one rank holds in a micro-batch: a document of n tokens runs on a group
            of at least ceil(n / C) ranks (a power of two), shorter ones share one rank.
        degrees: The allowed group sizes (powers of two dividing the world, 1 among them); None: every one.
        splits: (ulysses, ring) per degree, e.g. ``{4: (2, 2)}``; None: ulysses inside a node first, bounded
            by the model's heads (`hcp.init_cp_meshes`).

    Raises:
        ConfigError: A tokens_per_rank that is not a positive int, degrees or splits of another form.
    """

    tokens_per_rank: int
    degrees: tuple[int, ...] | None = None
    splits: tuple[tuple[int, tuple[int, int]], ...] | None = None

    def __post_init__(self) -> None:
        c = self.tokens_per_rank
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ConfigError(
                f"DynamicCP(tokens_per_rank={c!r}): pass a positive int, the tokens one rank holds in a micro-batch"
            )
        if self.degrees is not None:
            if isinstance(self.degrees, (str, bytes)) or not isinstance(self.degrees, (list, tuple)):
                raise ConfigError(f"DynamicCP(degrees={self.degrees!r}): pass a list of powers of two, e.g. [1, 2, 4]")
            object.__setattr__(self, "degrees", tuple(self.degrees))
        if self.splits is not None:
            items = self.splits.items() if isinstance(self.splits, Mapping) else self.splits
            try:
                splits = tuple(sorted((int(k), (int(u), int(r))) for k, (u, r) in items))
            except (TypeError, ValueError):
                raise ConfigError(
                    f"DynamicCP(splits={self.splits!r}): pass {{degree: (ulysses, ring)}}, "
                    f"e.g. {{2: (1, 2), 4: (2, 2)}}"
                ) from None
            object.__setattr__(self, "splits", splits)

    @property
    def split_map(self) -> dict[int, tuple[int, int]] | None:
        """`splits` as a dict (what `init_cp_meshes` takes)."""
        return None if self.splits is None else dict(self.splits)


# the keys of a collated batch whose documents a dynamic step can cut out and re-pack (anything else, e.g. media or
# a custom tensor per token, would have to follow its documents to another group: refused)
_DOCUMENT_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids") + PACKED_KEYS


def batch_documents(batch: Mapping[str, Any], ignore_index: int = -100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The documents of one collated batch as (token ids, next-token targets) pairs on the host: the rows of
    a padded batch (right padding, `attention_mask`) or the documents of a packed row (`cu_seq_lens_q`, or
    position ids restarting at 0 as `DataCollatorWithFlattening` makes). Targets are `labels` shifted inside
    each document (or the given `shift_labels`); each document's last target is `ignore_index`, so no target
    crosses a document boundary. Raises ConfigError for keys other than `_DOCUMENT_KEYS` and for batches
    without labels."""
    extra = sorted(k for k, v in batch.items() if k not in _DOCUMENT_KEYS and v is not None)
    if extra:
        raise ConfigError(
            f"the batch holds {extra}: a dynamic step re-packs documents from input_ids, labels, "
            f"shift_labels, attention_mask and position_ids only; drop the other keys in the collator"
        )
    ids = batch["input_ids"].cpu()
    if batch.get("shift_labels") is not None:
        targets = batch["shift_labels"].cpu()
    elif batch.get("labels") is not None:
        targets = shift_labels(batch["labels"].cpu(), ignore_index)
    else:
        raise ConfigError("a dynamic step trains on labels: the collator must give labels (or shift_labels)")
    b, s = ids.shape
    cu = _packed_boundaries(batch, b, s)
    if cu is not None:
        spans = [(0, a, e) for a, e in zip(cu[:-1], cu[1:]) if e > a]
    else:
        mask = batch.get("attention_mask")
        lengths = [s] * b if mask is None else [int(m.sum()) for m in mask.cpu()]
        if mask is not None and any(not bool(m[:n].all()) for m, n in zip(mask.cpu(), lengths)):
            raise ConfigError("attention_mask must be right padding (ones, then zeros) in a dynamic step")
        spans = [(row, 0, n) for row, n in enumerate(lengths) if n]
    out = []
    for row, a, e in spans:
        t = targets[row, a:e].clone()
        t[-1] = ignore_index
        out.append((ids[row, a:e].clone(), t))
    return out


def _packed_boundaries(batch: Mapping[str, Any], b: int, s: int) -> list[int] | None:
    """A packed row's boundaries (explicit, or where the position ids restart at 0); None for rows of one
    document each."""
    if batch.get("cu_seq_lens_q") is not None:
        cu = boundaries(
            batch["cu_seq_lens_q"].cpu() if isinstance(batch["cu_seq_lens_q"], torch.Tensor) else batch["cu_seq_lens_q"]
        )
        if b != 1 or cu[0] != 0 or cu[-1] != s or any(x > y for x, y in zip(cu, cu[1:])):
            raise ConfigError(f"cu_seq_lens_q={cu} does not cut a batch of one row of {s} tokens (batch {b})")
        return cu
    pos = batch.get("position_ids")
    if pos is None:
        return None
    pos = pos.cpu().reshape(-1, pos.shape[-1])
    starts = [t for t in range(1, s) if int(pos[0, t]) == 0] if pos.shape[0] == 1 else []
    if b > 1 and bool((pos[:, 1:] == 0).any()):
        raise ConfigError(f"position_ids restart inside rows of a batch of {b}: pack documents into one row")
    return [0, *starts, s] if starts else None


def schedule_documents(
    lengths: Sequence[int], meshes: "CPMeshes", tokens_per_rank: int, targets: Sequence[int] | None = None
) -> StepSchedule:
    """The step's schedule (`topology.schedule.schedule_step`) for the documents of the GLOBAL batch
    (`lengths`, identical on every rank) over the family's degrees; pure, no communication.
    `targets`: valid targets per document (default ``len - 1``). Raises ConfigError.

    Args:
        lengths: Every document's length in the global batch.
        meshes: The family from `init_cp_meshes`.
        tokens_per_rank: Tokens one rank holds in a micro-batch.
        targets: Valid targets per document; None: ``len - 1`` each.

    Returns:
        The step's schedule.

    Raises:
        ConfigError: The documents cannot be scheduled on these degrees.
    """
    try:
        return schedule_step(list(lengths), meshes.world, tokens_per_rank, meshes.degrees, targets)
    except ScheduleError as exc:
        raise ConfigError(str(exc)) from None


def agree(sched: StepSchedule, meshes: "CPMeshes") -> None:
    """Check, with one host all-reduce over the world, that every rank holds the same schedule (the same
    batch, lengths and groups): a disagreement raises InconsistentRanksError on every rank before any
    collective of the step (instead of a hang or wrong attention)."""
    value = int(sched.digest[:15], 16)  # 60 bits: exact in int64
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=meshes.check_group)
    if -t[1].item() != t[0].item():
        raise InconsistentRanksError(
            f"the ranks hold different step schedules (this rank's digest {sched.digest}): "
            f"every rank must schedule the same global batch (same documents, lengths and "
            f"order) with the same tokens_per_rank and mesh family"
        )


@dataclass(frozen=True)
class RankMicroBatch:
    """This rank's part of one micro-batch: its group's mesh `cp` (an idle rank gets the degree-1 mesh, for
    a placeholder forward), the group and its documents (indices into the step's documents) with their
    packed boundaries."""

    index: int
    cp: "CPMesh"
    group: Group
    cu_seqlens: tuple[int, ...]

    @property
    def docs(self) -> tuple[int, ...]:
        return self.group.docs

    @property
    def idle(self) -> bool:
        """No documents for this rank in this micro-batch (possible when the world has more ranks than
        work); under FSDP2 run a placeholder forward and backward (one token on `cp`, loss * 0) so that
        every rank joins the same parameter gathers and gradient reductions."""
        return not self.group.docs

    def placeholder_batch(self) -> dict:
        """An idle rank's input under FSDP2: one pad token sharded on `cp` (its label ignored); run the model
        on it and back-propagate its output times 0."""
        return shard_batch({"input_ids": torch.zeros(1, 1, dtype=torch.long)}, self.cp)


def micro_batches(sched: StepSchedule, meshes: "CPMeshes", rank: int | None = None) -> Iterator[RankMicroBatch]:
    """This rank's micro-batches, in order, after the digest check (`agree`): the same count on every rank.

    Args:
        sched: The step's schedule (`schedule_documents`).
        meshes: The family from `init_cp_meshes`.
        rank: The rank; None: this process's.

    Returns:
        This rank's micro-batches, in order.

    Raises:
        InconsistentRanksError: The ranks hold different schedules (on every rank).
    """
    agree(sched, meshes)
    me = dist.get_rank() if rank is None else rank
    for i, group in enumerate(sched.for_rank(me)):
        cu = [0]
        for d in group.docs:
            cu.append(cu[-1] + sched.lengths[d])
        yield RankMicroBatch(i, meshes.mesh(group.degree if group.docs else 1), group, tuple(cu))


def dynamic_loss(
    logits: torch.Tensor, labels: torch.Tensor, sched: StepSchedule, ignore_index: int = -100, world: int | None = None
) -> torch.Tensor:
    """This rank's share of the step's token-mean cross entropy: value (sum of its token losses) / N,
    gradient W / N per token loss (module docstring). `logits` [B, S_local, V] and `labels` [B, S_local]
    are this rank's shard with next-token targets (`hcp.shard_batch`'s labels). No communication: sum the
    values over micro-batches and all-reduce them over the world to log the step's loss.

    Args:
        logits: This rank's logits [B, S_local, V].
        labels: This rank's next-token targets [B, S_local].
        sched: The step's schedule.
        ignore_index: Targets with this value count in no loss.
        world: The world size W; None: the schedule's.

    Returns:
        This rank's share of the step's loss (a scalar).
    """
    w = sched.world if world is None else world
    n = max(sched.targets, 1)
    local = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return GroupReduced.apply(local, local.detach() / n, torch.tensor(w / n, device=local.device))


__all__ = [
    "DynamicCP",
    "batch_documents",
    "schedule_documents",
    "agree",
    "micro_batches",
    "dynamic_loss",
    "RankMicroBatch",
]
