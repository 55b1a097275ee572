"""The calibrated terms of the cost model (docs/planner.md, section 4): one attention call priced from a
cluster's measured `Calibration` (kernel fits, merges, copies, the all-to-all and the ring exchange)."""

from __future__ import annotations

from typing import Any

from .block_masks import visible_entries
from .call_shape import CallShape, LayerTimes, streamed_ring_s
from .cluster import Cluster
from .placement import ulysses_groups
from .rates import kernel_flops
from .traffic import a2a_time, comm_bytes
from .units import dtype_name

__all__ = ["calibrated_times", "engine_known_s"]


def calibrated_times(
    cluster: Cluster,
    call: CallShape,
    dtype: Any,
    window: Any,
    busiest_share: float,
    nbytes: dict[str, int],
    analytic: LayerTimes,
    chunk: int | None = None,
) -> tuple[LayerTimes, list[str]]:
    """The analytic times replaced by the measured ones; a window (or attention chunks) scales the
    calibrated kernel and ring terms by the work and the ring bytes it keeps. A mask's kernels are
    priced call by call (:func:`_calibrated_mask_kernel_s`), its ring by the bytes it moves."""
    parts = _calibrated_parts(cluster.calibration, cluster, call, dtype)
    kernel_fwd, kernel_bwd = parts["kernel_fwd_s"], parts["kernel_bwd_s"]
    ring_comm, ring_exposed = parts["ring_comm_s"], parts["ring_exposed_s"]
    if call.mask is not None:  # the measured exchange streams whole blocks; a halo moves fewer bytes
        moved = (nbytes["ring_fwd"] + nbytes["ring_bwd"]) / max(1, call.streamed_ring_bytes())
        ring_comm, ring_exposed = ring_comm * moved, ring_exposed * moved
    elif window is not None or chunk is not None:
        kernel_fwd, kernel_bwd = kernel_fwd * busiest_share, kernel_bwd * busiest_share
        full = comm_bytes(
            call.heads,
            call.kv_heads,
            call.head_dim,
            call.seq_len,
            call.batch,
            call.ulysses,
            call.ring,
            call.e,
            call.layout,
            causal=call.causal,
        )
        moved = (nbytes["ring_fwd"] + nbytes["ring_bwd"]) / max(1, full["ring_fwd"] + full["ring_bwd"])
        ring_comm, ring_exposed = ring_comm * moved, ring_exposed * moved
    times = LayerTimes(
        kernel_fwd,
        kernel_bwd,
        parts["fixed_s"] + parts["merge_s"] + parts["copy_s"],
        parts["a2a_s"],
        "measured" if call.ulysses > 1 and analytic.a2a_link != "none" else analytic.a2a_link,
        ring_comm,
        ring_exposed,
        "measured" if call.ring > 1 else analytic.ring_link,
    )
    return times, parts["notes"]


def _calibrated_kernel_s(cal: Any, call: CallShape, dtype: Any, notes: list[str]) -> tuple[float, float]:
    """Every kernel call of the slowest ring rank at its real block shape (from the layout's step
    plan), through the fitted ``call overhead + F (1 + tile/Tq) / rate``: (forward, backward) s."""
    name = dtype_name(dtype)
    fits = {(c, d): cal.kernel_fit(c, d, dtype=name) for c in (True, False) for d in ("fwd", "bwd")}
    if any(f is not None and f.dtype != name for f in fits.values()):
        notes.append(f"kernel rates for {name} not calibrated; used {cal.dtype}")
    heads = call.batch * call.busiest_heads[0]
    worst = (0.0, 0.0)
    for j in range(call.ring):
        totals = {"fwd": 0.0, "bwd": 0.0}
        for st in range(call.ring):
            step = call.lay.step(j, st, call.causal)
            if step is None:
                continue
            for _, nq, _, nk in step.pairs:
                for direction in ("fwd", "bwd") if call.backward else ("fwd",):
                    fit = fits[(step.causal, direction)]
                    if fit is None:
                        raise ValueError(
                            f"the calibration has no {'causal' if step.causal else 'full'} {direction} kernel fit; "
                            "re-run hybrid-cp calibrate with the kernels stage"
                        )
                    totals[direction] += fit.seconds(nq, nk, heads, call.head_dim)
        if totals["fwd"] + totals["bwd"] > sum(worst):
            worst = (totals["fwd"], totals["bwd"])
    return worst


def _calibrated_mask_kernel_s(cal: Any, call: CallShape, dtype: Any, notes: list[str]) -> tuple[float, float]:
    """A masked call's kernels from its block plan (`Layout.mask_tasks`): every (query, key) pair of every
    call through the fitted form, a banded pair at its visible cells (the full-block fit less the FLOPs its
    band skips), and the lock-step ring's busiest rank at each step summed over the steps: (fwd, bwd) s."""
    name = dtype_name(dtype)
    fits = {(c, d): cal.kernel_fit(c, d, dtype=name) for c in (True, False) for d in ("fwd", "bwd")}
    if any(f is not None and f.dtype != name for f in fits.values()):
        notes.append(f"kernel rates for {name} not calibrated; used {cal.dtype}")
    heads, d_head = call.batch * call.busiest_heads[0], call.head_dim
    directions = ("fwd", "bwd") if call.backward else ("fwd",)

    def pair_s(step: Any, nq: int, nk: int, direction: str) -> float:
        fit = fits[(step.causal, direction)]
        if fit is None:
            raise ValueError(
                f"the calibration has no {'causal' if step.causal else 'full'} {direction} kernel fit; "
                "re-run hybrid-cp calibrate with the kernels stage"
            )
        skipped = 0.0
        if step.window is not None:  # a band: the block's flops the kernel skips
            full = kernel_flops(nq, nk, heads, d_head, False, direction)
            skipped = full * (1.0 - visible_entries(nq, nk, False, step.window) / (nq * nk))
        return fit.seconds(nq, nk, heads, d_head) - skipped / (fit.tflops * 1e12)

    lay, r, out = call.lay, call.ring, {"fwd": 0.0, "bwd": 0.0}
    for s in range(r):
        for direction in directions:
            out[direction] += max(
                sum(
                    pair_s(t, nq, nk, direction)
                    for t in lay.tasks(j, s, False, mask=call.mask)
                    for _, nq, _, nk in t.pairs
                )
                for j in range(r)
            )
    return out["fwd"], out["bwd"]


def _calibrated_merge_s(cal: Any, call: CallShape) -> float:
    """The online-softmax merges (and the backward's fp32 accumulations) at the measured merge rate."""
    if cal.merge is None:
        return 0.0
    merge_fwd, merge_bwd = call.merge_bytes()
    return call.ring * cal.merge.seconds(merge_fwd) + (
        call.ring * cal.merge.seconds(merge_bwd) if call.backward else 0.0
    )


def _calibrated_a2a_s(
    cal: Any, cluster: Cluster | None, call: CallShape, nbytes: dict[str, int], notes: list[str]
) -> float:
    """The measured all-to-all of this ulysses degree (all groups at once); the cluster's links when
    that degree was not calibrated."""
    if call.ulysses == 1:
        return 0.0
    fit_u = cal.a2a_fit(call.ulysses)
    if fit_u is not None:
        lat, bw = fit_u.link.latency_us * 1e-6, fit_u.link.bandwidth_gb_s * 1e9
        a2a_s = 2 * lat + nbytes["ulysses_fwd"] / bw
        if call.backward:
            a2a_s += 2 * lat + nbytes["ulysses_bwd"] / bw
        return a2a_s
    if cluster is None:
        return 0.0
    notes.append(f"all-to-all of ulysses={call.ulysses} not calibrated; priced with the cluster's links")
    groups = ulysses_groups(call.world, call.ulysses, call.ring, call.dp)
    return a2a_time(cluster, groups, call.heads_per_rank, call.a2a_unit, call.backward)[0]


def _calibrated_ring_s(
    cal: Any, cluster: Cluster | None, call: CallShape, kernel_fwd_s: float, kernel_bwd_s: float, notes: list[str]
) -> tuple[float, float]:
    """The measured neighbour exchange with every rank sending, hidden behind the step's kernels by
    the measured overlap fraction; the last dK/dV hop is always exposed."""
    if call.ring == 1:
        return 0.0, 0.0
    if cal.p2p is not None:
        xfer = cal.p2p.seconds
    elif cluster is not None:
        xfer = cluster.intra_node.transfer_s
        notes.append("ring exchange not calibrated; priced with the cluster's intra_node link")
    else:
        xfer = lambda n: 0.0  # noqa: E731
    return streamed_ring_s(xfer, call, kernel_fwd_s / call.ring, kernel_bwd_s / call.ring, cal.overlap)


def _calibrated_parts(
    cal: Any, cluster: Cluster | None, call: CallShape, dtype: Any, kernels: bool = True
) -> dict[str, Any]:
    """One attention call priced with measured rates, term by term (seconds, slowest rank).

    kernel: :func:`_calibrated_kernel_s`; fixed: ``3 r`` step units (forward 1, backward 2) plus one
    per-call cost; merge: :func:`_calibrated_merge_s`; copy: the engine's packing copies per byte
    sent; a2a: :func:`_calibrated_a2a_s`; ring: :func:`_calibrated_ring_s`. Bytes are the full row's;
    :func:`estimate` scales them for a window.
    """
    notes: list[str] = []
    kernel_s = _calibrated_kernel_s if call.mask is None else _calibrated_mask_kernel_s
    kf, kb = kernel_s(cal, call, dtype, notes) if kernels else (0.0, 0.0)
    units = call.ring * (3 if call.backward else 1)
    fixed = units * cal.step_overhead_us * 1e-6 + cal.call_overhead_us * 1e-6 * (1.0 if call.backward else 0.5)
    nbytes = call.sent_bytes()
    sent = sum(nbytes.values())
    copy_s = sent / (cal.copy_gb_s * 1e9) if cal.copy_gb_s else 0.0
    a2a_s = _calibrated_a2a_s(cal, cluster, call, nbytes, notes)
    ring_comm, ring_exposed = _calibrated_ring_s(cal, cluster, call, kf, kb, notes)
    return {
        "kernel_fwd_s": kf,
        "kernel_bwd_s": kb,
        "fixed_s": fixed,
        "merge_s": _calibrated_merge_s(cal, call),
        "copy_s": copy_s,
        "a2a_s": a2a_s,
        "ring_comm_s": ring_comm,
        "ring_exposed_s": ring_exposed,
        "sent_bytes": sent,
        "notes": notes,
    }


def engine_known_s(
    cal: Any, ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, e: int
) -> tuple[float, int]:
    """The measured parts of a no-arithmetic engine call (all-to-all, ring exchange, merges) as the
    model prices them, and the bytes it sends; calibration fits the fixed costs to the remainder."""
    call = CallShape(heads, kv_heads, head_dim, seq_len, 1, ulysses, ring, e)
    p = _calibrated_parts(cal, None, call, None, kernels=False)
    return p["merge_s"] + p["a2a_s"] + p["ring_exposed_s"], p["sent_bytes"]
