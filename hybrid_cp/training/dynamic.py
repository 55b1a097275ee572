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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from topology.schedule import Group, ScheduleError, StepSchedule, schedule_step

from ..errors import ConfigError, InconsistentRanksError
from .batch import shard_batch
from .loss import GroupReduced

if TYPE_CHECKING:
    from ..engine.mesh import CPMesh
    from ..engine.meshes import CPMeshes


def schedule_documents(lengths: Sequence[int], meshes: "CPMeshes", tokens_per_rank: int,
                       targets: Sequence[int] | None = None) -> StepSchedule:
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
    value = int(sched.digest[:15], 16)   # 60 bits: exact in int64
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=meshes.check_group)
    if -t[1].item() != t[0].item():
        raise InconsistentRanksError(f"the ranks hold different step schedules (this rank's digest {sched.digest}): "
                                     f"every rank must schedule the same global batch (same documents, lengths and "
                                     f"order) with the same tokens_per_rank and mesh family")


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


def dynamic_loss(logits: torch.Tensor, labels: torch.Tensor, sched: StepSchedule, ignore_index: int = -100,
                 world: int | None = None) -> torch.Tensor:
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
    local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).to(logits.device),
                            ignore_index=ignore_index, reduction="sum")
    return GroupReduced.apply(local, local.detach() / n, torch.tensor(w / n, device=local.device))


__all__ = ["schedule_documents", "agree", "micro_batches", "dynamic_loss", "RankMicroBatch"]
