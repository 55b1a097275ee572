"""Enumerate every (ulysses, ring, dp) split of a world, price each with :func:`estimate`, rank them.

Feasibility: ``u * r * dp == world``; ``u <= heads`` (each ulysses rank needs a query head; GQA KV
heads are replicated, never the bound); the sequence must not be mostly padding; the training step's
memory (``topology.step_model.step_memory``) must fit the budget, with the given memory options or with some
rung of a ladder of them. Ulysses groups that cross nodes are kept but priced over the NIC and flagged.
Ranking is by the ladder's rung (fewer memory options first), then by throughput of the whole world
(tokens/s), i.e. by ``time_s / dp``; ties go to the larger ulysses degree (fewer ring steps, less exposed
to imperfect overlap).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from .cluster import Cluster
from .cost import Estimate, estimate
from .layouts import granularity
from .memory import first_fitting, option_variants
from .model_shape import ModelShape
from .placement import PlacementWarning, check_placement, divisors
from .split import Split
from .step_model import MemoryEstimate, MemoryOptions, attention_forwards, step_memory
from .units import GiB

__all__ = ["Plan", "PlanList", "Rejected", "PlanError", "plan"]


class PlanError(ValueError):
    """No split of the world is feasible; the message lists why each family was rejected."""


@dataclass(frozen=True)
class Plan:
    """One feasible split. ``ulysses``, ``ring``, ``dp`` are what ``hcp.init_cp_mesh(plan=...)`` reads."""

    ulysses: int
    ring: int
    dp: int
    estimate: Estimate
    memory: MemoryEstimate  # the training step's peak with `options`, what the split was checked with
    options: MemoryOptions
    rank: int = 0
    notes: tuple[str, ...] = ()

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.cp * self.dp

    def explain(self) -> str:
        """A few lines: where the time goes and why."""
        e = self.estimate
        ms = 1e3
        lines = [
            f"ulysses={self.ulysses} ring={self.ring} dp={self.dp}: {e.time_s * ms:.2f} ms/layer "
            f"(fwd+bwd, {e.batch} seq of {e.seq_len} tokens per CP group), {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.0%}",
            f"  compute {e.compute_s * ms:.2f} ms = attention {e.attention_s * ms:.2f} + ring steps "
            f"{e.ring_overhead_s * ms:.2f} + rest of layer {e.rest_s * ms:.2f}"
            + (f" + linear {e.linear_s * ms:.2f}" if e.linear_s else ""),
            f"  all-to-all {e.a2a_s * ms:.2f} ms over {e.a2a_link}; ring {e.ring_comm_s * ms:.2f} ms over "
            f"{e.ring_link}, exposed {e.ring_exposed_s * ms:.2f} ms",
            "  bytes sent per rank per layer: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in e.bytes_per_rank.items()),
            f"  memory per rank {self.memory.peak / GiB:.1f} GiB at {self.memory.peak_phase}: "
            + ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.memory_breakdown.items() if v),
        ]
        if e.linear_share:
            lin = e.linear_s + e.linear_comm_s
            lines.insert(
                3,
                f"  linear layers ({e.linear_share:.0%} of layers): recurrence {e.linear_s * ms:.2f} + summary "
                f"exchange {e.linear_comm_s * ms:.2f} ms per average layer, {lin / e.time_s:.1%} of its time",
            )
        lines += [f"  note: {n}" for n in (*self.notes, *e.notes)]
        return "\n".join(lines)

    @property
    def memory_breakdown(self) -> dict[str, int]:
        """The peak by part: the persistent ones (model states, the layout's permutations) and the rest."""
        parts = {k: v for k, v in self.memory.persistent.items() if k != "activations"}
        parts["activations and working sets"] = self.memory.peak - sum(parts.values())
        return parts

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "ulysses": self.ulysses, "ring": self.ring, "dp": self.dp,
                "notes": list(self.notes), **{k: v for k, v in self.estimate.to_dict().items()
                                              if k not in ("ulysses", "ring", "dp")},
                "memory_bytes": self.memory.peak, "memory_phase": self.memory.peak_phase,
                "memory_breakdown": self.memory_breakdown, "memory_options": self.options.describe()}  # fmt: skip


@dataclass(frozen=True)
class Rejected:
    ulysses: int
    ring: int
    dp: int
    reason: str


@dataclass
class PlanList(list):
    """Feasible plans, best first (a ``list`` of :class:`Plan`), plus what was rejected and why."""

    plans: list[Plan] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    header: str = ""

    def __post_init__(self) -> None:
        list.__init__(self, self.plans)

    @property
    def best(self) -> Plan:
        return self[0]

    def explain(self, top: int | None = None) -> str:
        """A table: time per layer split into compute / exposed all-to-all / exposed ring, and memory."""
        rows = self[:top] if top else list(self)
        head = (
            f"{'#':>3} {'u':>4} {'r':>4} {'dp':>4} {'ms/layer':>10} {'compute':>9} {'a2a':>8} {'ring':>8} "
            f"{'mem GiB':>8} {'tokens/s':>10} {'MFU':>5}  links (a2a / ring)"
        )
        out = [self.header, head] if self.header else [head]
        for p in rows:
            e = p.estimate
            out.append(
                f"{p.rank:>3} {p.ulysses:>4} {p.ring:>4} {p.dp:>4} {e.time_s * 1e3:>10.2f} {e.compute_s * 1e3:>9.2f} "
                f"{e.a2a_s * 1e3:>8.2f} {e.ring_exposed_s * 1e3:>8.2f} {p.memory.peak / GiB:>8.1f} "
                f"{e.tokens_per_s:>10,.0f} {e.mfu:>5.0%}  {e.a2a_link} / {e.ring_link}" + (" *" if p.notes else "")
            )
        if top and len(self) > top:
            out.append(f"    ... {len(self) - top} more feasible")
        out += [f"  * u={p.ulysses} r={p.ring} dp={p.dp}: {n}" for p in rows for n in p.notes]
        if self.rejected:
            out.append(f"rejected ({len(self.rejected)}):")
            out += [f"  u={x.ulysses} r={x.ring} dp={x.dp}: {x.reason}" for x in self.rejected]
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "header": self.header,
            "chosen": self[0].to_dict() if self else None,
            "plans": [p.to_dict() for p in self],
            "rejected": [vars(x) for x in self.rejected],
        }


@dataclass(frozen=True)
class _Request:
    """What :func:`plan` was asked, the same for every split it prices."""

    cluster: Cluster
    model: ModelShape
    world: int
    budget: float
    causal: bool
    options: MemoryOptions | None
    ladder: list[tuple[str, MemoryOptions]] | None
    host_memory: float | None

    @property
    def rungs(self) -> list[tuple[str, MemoryOptions]]:
        return self.ladder or [("", self.options or MemoryOptions())]


def _split(req: _Request, split: Split) -> tuple | Rejected:
    """One split: (its ranking key..., the Plan) when some option set fits it, else why not."""
    model, rungs, (u, r, d) = req.model, req.rungs, (split.ulysses, split.ring, split.dp)
    seq_len, batch, dtype, layout = split.seq_len, split.batch, split.dtype, split.layout
    chosen = first_fitting(
        model, seq_len, u, r, d, batch, rungs, req.budget, host_memory=req.host_memory, dtype=dtype, layout=layout
    )
    if chosen is None:
        least = step_memory(
            model, seq_len, u, r, d, batch, option_variants(model, u, rungs[-1][1])[-1], dtype=dtype, layout=layout
        ).peak  # the most head chunks the last rung allows
        return Rejected(
            u,
            r,
            d,
            f"memory {least / GiB:.1f} GiB > budget {req.budget / GiB:.1f} GiB"
            if least > req.budget
            else "offloaded checkpoints exceed the host memory",
        )
    name, opt, mem = chosen
    forwards = attention_forwards(model, u, opt) if req.options is not None or req.ladder is not None else 1
    est = estimate(
        req.cluster,
        model,
        seq_len,
        u,
        r,
        d,
        batch,
        dtype=dtype,
        layout=layout,
        causal=req.causal,
        attention_forwards=forwards,
    )
    with warnings.catch_warnings():  # the warnings become plan notes instead
        warnings.simplefilter("ignore", PlacementWarning)
        report = check_placement(req.cluster, u, r, d, warn=True, world_size=req.world)
    notes = (*report.problems, *report.notes)
    if req.ladder is not None:
        notes = (f"memory options: {name} ({opt.describe()})", *notes)
    rung = [n for n, _ in rungs].index(name)
    return rung, est.time_s / d, -u, Plan(u, r, d, est, mem, opt, notes=notes)


def _search(
    req: _Request, seq_len: int, batch: int, dp: int | None, dtype: Any, layout: str
) -> tuple[list[tuple[int, float, int, Plan]], list[Rejected]]:
    """Every (ulysses, ring, dp) split priced or rejected, the feasible ones sorted: `plan`'s search loop."""
    model, world = req.model, req.world
    feasible: list[tuple[int, float, int, Plan]] = []
    rejected: list[Rejected] = []
    for cp in divisors(world):
        if dp is not None and world // cp != dp:
            continue
        for u in divisors(cp):
            r, d = cp // u, world // cp
            if u > model.heads:
                rejected.append(Rejected(u, r, d, f"ulysses={u} > heads={model.heads}"))
                continue
            g = granularity(layout, u, r)
            if seq_len < g:
                rejected.append(Rejected(u, r, d, f"seq_len={seq_len} < layout granularity {g}: mostly padding"))
                continue
            one = _split(req, Split(seq_len, u, r, d, batch, dtype, layout))
            (feasible if isinstance(one, tuple) else rejected).append(one)
    feasible.sort(key=lambda t: t[:3])
    return feasible, rejected


def plan(  # noqa: PLR0913 (public entry point)
    cluster: Cluster,
    model: ModelShape,
    seq_len: int,
    batch: int = 1,
    world_size: int | None = None,
    memory_budget: float | None = None,
    *,
    dp: int | None = None,
    dtype: Any = "bf16",
    layout: str = "zigzag",
    causal: bool = True,
    options: MemoryOptions | None = None,
    ladder: list[tuple[str, MemoryOptions]] | None = None,
    host_memory: float | None = None,
) -> PlanList:
    """Rank every feasible (ulysses, ring, dp) split of ``world_size`` GPUs (default: all of them).

    A split fits when its training step's peak (``topology.step_model.step_memory``, the model ``--max-seq``
    searches with) fits the budget. The memory options also set how often attention runs forward per
    layer (with activation checkpointing the recomputation repeats it, ``topology.step_model.attention_forwards``;
    with neither ``options`` nor ``ladder``: once).

    Args:
        cluster: The cluster (`Cluster.preset`, `discover`, or a YAML file's).
        model: The model's shape.
        seq_len: Tokens per sequence.
        batch: Sequences per CP group.
        world_size: GPUs to use; None: all of the cluster's.
        memory_budget: Bytes per GPU; None: 90% of the accelerator's memory (room for the CUDA context,
            communication buffers and fragmentation).
        dp: Fix the data-parallel degree (1: one CP group over all GPUs); None: any.
        dtype: The compute dtype ("bf16", "fp16", "fp32", bytes, or a torch dtype).
        layout: "zigzag" or "contiguous".
        causal: Causal attention.
        options: The training's memory options; None: `MemoryOptions()` (checkpointing under FSDP2).
        ladder: Memory options to try in order (``topology.memory.memory_ladder``): the first that fits is
            used and named in the plan; splits that fit on an earlier rung rank first (the later rungs'
            recomputation, copies and smaller kernels are not in the time model).
        host_memory: Host bytes per GPU for offloaded checkpoints; None: unbounded.

    Returns:
        The feasible splits, best first (`.best`).

    Raises:
        PlanError: No split fits (the message says what to change).
    """
    if options is not None and ladder is not None:
        raise PlanError("give options= (one set of memory options) or ladder= (the first rung that fits), not both")
    world = cluster.world_size if world_size is None else world_size
    if not isinstance(world, int) or world < 1 or world > cluster.world_size:
        raise PlanError(
            f"world_size={world_size!r} must be an integer in [1, {cluster.world_size}] for {cluster.name!r}"
        )
    budget = cluster.accelerator.memory_budget if memory_budget is None else float(memory_budget)
    if dp is not None and (not isinstance(dp, int) or dp < 1 or world % dp):
        raise PlanError(f"dp={dp!r} must be a positive integer dividing world_size={world}")
    if budget <= 0:
        raise PlanError(f"memory_budget={memory_budget!r} must be > 0 bytes")
    req = _Request(cluster, model, world, budget, causal, options, ladder, host_memory)
    feasible, rejected = _search(req, seq_len, batch, dp, dtype, layout)
    plans = [replace(p, rank=k + 1) for k, (*_, p) in enumerate(feasible)]
    header = (
        f"{cluster.describe()}\nmodel {model.name}: heads={model.heads} kv_heads={model.n_kv} head_dim={model.head_dim} "
        f"hidden={model.d_model} layers={model.layers}; seq_len={seq_len} batch={batch} world={world} "
        f"memory budget {budget / GiB:.1f} GiB/GPU"
    )
    if not plans:
        reasons = "\n".join(f"  u={x.ulysses} r={x.ring} dp={x.dp}: {x.reason}" for x in rejected)
        raise PlanError(
            f"no feasible split of {world} GPUs for seq_len={seq_len}:\n{reasons}\n"
            "raise memory_budget, use more GPUs, or shorten the sequence"
        )
    return PlanList(plans=plans, rejected=rejected, header=header)
