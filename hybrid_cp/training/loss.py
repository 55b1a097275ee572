"""Context-parallel cross entropy: the token mean over the whole sequence group, on every rank.

Gradient convention (docs/training.md): per-rank parameter gradients AVERAGE to the single-device
gradient over the ranks that reduce gradients (the flattened dp x ring x ulysses group). So the
backward of `cross_entropy` scales each rank's share by the number of ranks in the reduction,
which makes the stock reductions exact: DDP's all-reduce average, FSDP2's reduce-scatter average,
and `hybrid_cp.integrations.fsdp.shard_model` (which keeps FSDP2's default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..engine.agreement import checked_on_every_rank, digest, require_mesh
from ..engine.comm import comm_guard
from ..errors import ConfigError, InputTypeError, ShapeError

if TYPE_CHECKING:
    from ..engine.mesh import CPMesh

REDUCTIONS = ("mean", "sum", "none")


class GroupReduced(torch.autograd.Function):
    """Value: the group-reduced `total` (identical on every rank). Gradient to `local`: `scale`."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, total: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return total.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None, None


def reduction_group(cp: "CPMesh", include_dp: bool):
    """(process group, its size) a loss is reduced over: the cp group, or with `include_dp` every rank
    of the mesh (its flattened dp x ring x ulysses dimension)."""
    require_mesh(cp)
    if include_dp:
        return cp.dp_cp_group, cp.size * cp.dp_size
    return cp.cp_group, cp.size


def check_ignore_index(ignore_index: Any) -> None:
    """ConfigError unless `ignore_index` is an int (a bool or a float label value is a mistake)."""
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ConfigError(f"ignore_index={ignore_index!r} must be an int (the label of tokens that do not count)")


def _local_arguments(logits: Any, labels: Any, ignore_index: Any, reduction: Any) -> None:
    """This rank's own checks of a `cross_entropy` call."""
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise InputTypeError(
            f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise InputTypeError(
            f"labels must be an integer tensor of token ids, got {getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ShapeError(
            f"logits.shape={tuple(logits.shape)} does not match labels.shape={tuple(labels.shape)}; "
            f"logits must be labels.shape + (vocab,), e.g. [B, S_local, V] with labels [B, S_local] "
            f"from the same shard"
        )
    check_ignore_index(ignore_index)


def _agreed_arguments(
    logits: Any, labels: Any, cp: "CPMesh", ignore_index: Any, reduction: Any, include_dp: bool
) -> None:
    """This rank's checks, then (with `cp.validate`) the cp ranks' agreement on the call: one rank's bad
    argument makes every rank raise instead of leaving the others in the loss's all-reduce."""

    def check() -> list[int]:
        _local_arguments(logits, labels, ignore_index, reduction)
        return [digest(reduction), ignore_index, int(bool(include_dp)), logits.shape[-1], labels.dim()]

    checked_on_every_rank(
        cp, check, ("reduction", "ignore_index", "include_dp", "vocab", "label dims"), "hcp.cross_entropy arguments"
    )


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cp: "CPMesh",
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    include_dp: bool = False,
) -> torch.Tensor:
    """Cross entropy of this rank's logits against its (already shifted) labels, reduced over the
    sequence group.

    `logits` [B, S_local, V] (or [N, V]) and `labels` [B, S_local] (or [N]) are this rank's shard,
    e.g. from `hcp.shard_batch`, whose labels are already next-token targets: do NOT shift again.

    - reduction="mean": the mean over every non-ignored token of the whole sequence group (of
      every dp replica too with `include_dp=True`), the same value on every rank. If the group has
      no valid token at all the loss is 0 (with zero gradients) instead of NaN. Ranks holding no
      valid token are fine: they contribute 0 to the sum and their logits get zero gradients.
    - reduction="sum": the sum over the group, the same value on every rank.
    - reduction="none": this rank's per-token losses, shaped like `labels` (0 at ignored tokens),
      with no communication and no scaling.

    Gradient convention: for "mean"/"sum" the gradient reaching this rank's logits is W times the
    single-device gradient of those logits, where W is the number of ranks reduced over (cp.size,
    or dp*cp with `include_dp`): averaging per-rank parameter gradients over the dp x cp ranks
    (DDP, FSDP2, `shard_model`) then gives exactly the single-device gradient.
    The loss is computed in fp32 whatever the logits' dtype.

    Args:
        logits: This rank's logits [B, S_local, V] (or [N, V]).
        labels: This rank's next-token targets [B, S_local] (or [N]).
        cp: The mesh.
        ignore_index: Targets with this value count in no loss.
        reduction: "mean", "sum" or "none".
        include_dp: Reduce over the dp replicas too.

    Returns:
        The loss (a scalar, the same on every rank; per token for "none"), in fp32.

    Raises:
        ConfigError: An unknown reduction, or labels outside the vocabulary.
        InputTypeError: Logits that are not floating point, labels that are not integers.
        ShapeError: Logits and labels that do not match.
    """
    _agreed_arguments(logits, labels, cp, ignore_index, reduction, include_dp)
    vocab = logits.shape[-1]
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    out_of_range = valid & ((flat_labels < 0) | (flat_labels >= vocab))
    per_token = (
        F.cross_entropy(
            logits.float().reshape(-1, vocab), flat_labels.masked_fill(~valid | out_of_range, 0), reduction="none"
        )
        * valid
    )
    if reduction == "none":
        return per_token.reshape(labels.shape)
    group, world = reduction_group(cp, include_dp)
    local_sum = per_token.sum()
    stats = torch.stack([local_sum.detach().double(), valid.sum().double()])
    # labels outside the vocabulary fail loudly (on every rank when validating), not as a device assert
    check = cp.validate or world == 1
    if check:
        stats = torch.cat([stats, out_of_range.any().to(stats.dtype)[None]])
    if world > 1:
        with comm_guard(cp, "hcp.cross_entropy's all-reduce"):
            dist.all_reduce(stats, group=group)
    if check and stats[2].item() > 0:
        raise ConfigError(
            f"labels on some rank hold ids outside the vocabulary [0, {vocab}) other than "
            f"ignore_index={ignore_index}; fix the labels or the ignore_index"
        )
    total, count = stats[0], stats[1]
    if reduction == "mean":
        denom = count.clamp_min(1.0)
        return GroupReduced.apply(local_sum, (total / denom).float(), (world / denom).float())
    return GroupReduced.apply(local_sum, total.float(), torch.tensor(float(world), device=local_sum.device))


__all__ = ["cross_entropy", "reduction_group", "GroupReduced"]
