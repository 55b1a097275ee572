"""The allowed group sizes of a dynamic schedule, priced by the calibrated cost model.

For each degree k (a power of two up to the world), `topology.plan` picks the (ulysses, ring) split of
k GPUs for a packed row of k * C tokens, with dp = world / k (the aligned blocks; FSDP2 over the world) (ulysses inside a node first, bounded by the heads, checked
against the step-memory model: a degree whose row does not fit is a `ScheduleError` naming C), and
the time of one layer (forward and backward) is fitted exactly through three lengths as
``quad * L^2 + lin * L + fixed``. A group's packed documents then cost ``quad * sum(s^2) + lin * sum(s)
+ fixed``: attention is quadratic per document, the rest per token. (The fit prices a dense row: a
group of short documents on a ring > 1 pays ring bytes it does not send, so the prices lean towards
small degrees, the direction the schedule prefers anyway.)
"""

from __future__ import annotations

from typing import Any

from .cluster import Cluster
from .cost import estimate
from .model_shape import ModelShape
from .planner import PlanError, plan
from .schedule import Degree, ScheduleError


def powers_of_two(world: int) -> list[int]:
    out, k = [], 1
    while k <= world and world % k == 0:
        out.append(k)
        k *= 2
    return out


def degree_table(
    cluster: Cluster,
    model: ModelShape,
    world: int,
    tokens_per_rank: int,
    degrees: list[int] | None = None,
    *,
    dtype: Any = "bf16",
    memory_budget: float | None = None,
) -> list[Degree]:
    """One `Degree` per allowed size (default every power of two dividing `world`), its split chosen by
    the planner for k * `tokens_per_rank` tokens and its cost fitted from `topology.cost.estimate`."""
    out = []
    for k in sorted(degrees or powers_of_two(world)):
        seq = k * tokens_per_rank
        try:
            best = plan(
                cluster, model, seq_len=seq, world_size=world, dp=world // k, dtype=dtype, memory_budget=memory_budget
            ).best  # model states sharded over the world (FSDP2)
        except PlanError as exc:
            raise ScheduleError(
                f"degree {k}: no split of {k} GPUs holds tokens_per_rank={tokens_per_rank} "
                f"({seq} tokens per group): lower tokens_per_rank\n{exc}"
            ) from exc
        out.append(fitted_degree(cluster, model, k, best.ulysses, best.ring, seq, dtype))
    return out


def fitted_degree(cluster: Cluster, model: ModelShape, k: int, u: int, r: int, seq: int, dtype: Any = "bf16") -> Degree:
    """Degree k on split (u, r), priced by the quadratic through its layer times at seq / 4, seq / 2 and
    seq (exact for a quadratic model)."""
    xs = [max(seq // 4, 2 * k), max(seq // 2, 4 * k), seq]
    ys = [estimate(cluster, model, x, u, r, dtype=dtype).time_s for x in xs]
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    quad = max((d12 - d01) / (x2 - x0), 0.0)
    lin = max(d01 - quad * (x0 + x1), 0.0)
    fixed = max(y0 - quad * x0 * x0 - lin * x0, 0.0)
    return Degree(k, u, r, quad=quad, lin=lin, fixed=fixed)


__all__ = ["degree_table", "fitted_degree", "powers_of_two"]
