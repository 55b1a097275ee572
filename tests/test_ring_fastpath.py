"""The ring engine's whole-block fast path (ring size 1): bitwise what the general loop gives, and without
its fp32 accumulators and fused K/V buffers (StorageTracker, exact bytes).

The general loop runs on the same block through a plan with one extra, empty step: the same task, the same
kernel call, but `whole_block` no longer matches, so the loop (accumulators, fused double buffers, merge)
runs as it did before the fast path existed. The cases run on the session's gloo pool (a real u8 r1 mesh,
ring size 1: neither path communicates)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_cp.engine.kernels import get_kernel
from hybrid_cp.engine.ring import Plan, RingCall, block_plan, ring_backward, ring_forward, whole_block
from hybrid_cp.training.memory import StorageTracker
from topology.layouts import make_layout

HEADS = {"mha": ([0, 1, 2, 3], 4), "gqa": ([0, 0, 1, 1], 2), "ragged": ([0, 0, 1], 2)}


def _inputs(seed: int, n: int, kv_index: list[int], kv_heads: int, dtype: torch.dtype, d: int = 16, dv: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, len(kv_index), d, generator=g).to(dtype)
    k = torch.randn(1, n, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(1, n, kv_heads, dv, generator=g).to(dtype)
    dout = torch.randn(1, n, len(kv_index), dv, generator=g).to(dtype)
    sinks = torch.randn(len(kv_index), generator=g)
    return q, k, v, dout, sinks


def _plans(layout: str, n: int, causal: bool) -> tuple[Plan, Plan]:
    """(the whole-block plan of a u8 r1 block, the same task with an empty second step: the general loop)."""
    plan = block_plan(make_layout(layout, 8, 1, seq_len=n), 0, causal, torch.device("cpu"))
    return plan, Plan((plan.steps[0], ()))


def _run(cp, kernel, plan: Plan, q, k, v, dout, kv_index, causal_sinks, softcap):
    call = RingCall(cp, kernel, plan, scale=0.25, softcap=softcap)
    out, lse, halo = ring_forward(call, q, k, v, kv_index, sinks=causal_sinks)
    grads = ring_backward(call, dout, q, k, v, (out, lse), kv_index, halo)
    return (out, lse, *grads)


def bitwise_cases(n: int = 96) -> list[dict]:
    """This rank's share of the cases: whether the fast path was taken, and whether out, lse, dq, dk, dv are bitwise equal (and of
    the same dtype, shape and strides) to the general loop's."""
    from dist_cases import mesh

    cp = mesh(8, 1)
    rows = []
    cases = itertools.product(
        ("zigzag", "contiguous"), (torch.float32, torch.bfloat16), HEADS, (True, False), (None, 20.0), (False, True)
    )
    for seed, (layout, dtype, heads, causal, softcap, sinks) in enumerate(cases):
        if seed % 8 != cp.rank:  # the cases split over the 8 ranks
            continue
        kv_index, kv_heads = HEADS[heads]
        q, k, v, dout, sink = _inputs(seed, n, kv_index, kv_heads, dtype)
        kernel = get_kernel("math", q.device, dtype, q.shape[3])
        fast, loop = _plans(layout, n, causal)
        got = _run(cp, kernel, fast, q, k, v, dout, kv_index, sink if sinks else None, softcap)
        ref = _run(cp, kernel, loop, q, k, v, dout, kv_index, sink if sinks else None, softcap)
        same = [
            torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            for a, b in zip(got, ref)
        ]
        rows.append(
            dict(
                case=(layout, str(dtype), heads, causal, softcap, sinks),
                same=same,
                fast=whole_block(fast, n, n) is not None,
                loop=whole_block(loop, n, n) is not None,
            )
        )
    return rows


def _peak(fn) -> int:
    with StorageTracker() as t:
        fn()
    return t.peak


def memory_case(n: int = 256, dtype: str = "bf16") -> dict:
    """Peak live bytes (StorageTracker) of the forward and of the backward, fast path and general loop, and the
    bytes of the loop's buffers: fp32 out and lse accumulators and the fused double K|V buffer (forward); fp32
    dq, the fused double K|V and the fused double fp32 dK|dV (backward)."""
    from dist_cases import DTYPES, mesh

    cp, dt = mesh(8, 1), DTYPES[dtype]
    if cp.rank:
        return {}
    kv_index, kv_heads = HEADS["gqa"]
    q, k, v, dout, _ = _inputs(0, n, kv_index, kv_heads, dt, dv=8)
    kernel = get_kernel("math", q.device, dt, q.shape[3])
    fast, loop = _plans("zigzag", n, True)
    out, lse, _ = ring_forward(RingCall(cp, kernel, fast, scale=0.25), q, k, v, kv_index)
    peaks = {}
    for name, plan in (("fast", fast), ("loop", loop)):
        call = RingCall(cp, kernel, plan, scale=0.25)
        peaks[name + "_fwd"] = _peak(lambda: ring_forward(call, q, k, v, kv_index))
        peaks[name + "_bwd"] = _peak(lambda: ring_backward(call, dout, q, k, v, (out, lse), kv_index, None))
    e, kv = dt.itemsize, k.numel() + v.numel()
    peaks["fwd_buffers"] = 4 * out.numel() + 4 * lse.numel() + 2 * kv * e
    peaks["bwd_buffers"] = 4 * q.numel() + 2 * kv * e + 2 * kv * 4
    return peaks


def test_fast_path_is_bitwise_the_general_loop(pool8):
    rows = [row for rank in pool8.run(bitwise_cases) for row in rank]
    assert len(rows) == 96
    for row in rows:
        assert row["fast"] and not row["loop"], row
        assert all(row["same"]), row


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fast_path_drops_the_accumulators_and_fused_buffers(pool8, dtype):
    """The loop's peak (inside the kernel call) holds exactly its buffers on top of the fast path's."""
    m = pool8.run(memory_case, dtype=dtype)[0]
    assert m["loop_fwd"] - m["fast_fwd"] == m["fwd_buffers"], m
    assert m["loop_bwd"] - m["fast_bwd"] == m["bwd_buffers"], m


def test_whole_block_only_at_ring_one():
    """Ring > 1 and halo plans keep the loop; a ring-1 block of either layout, masked or not, takes the fast path."""
    dev = torch.device("cpu")
    for layout, causal in itertools.product(("zigzag", "contiguous"), (True, False)):
        assert whole_block(block_plan(make_layout(layout, 8, 1, seq_len=1024), 0, causal, dev), 1024, 1024)
        assert whole_block(block_plan(make_layout(layout, 1, 1, seq_len=1024), 0, causal, dev), 1024, 1024)
        plan = block_plan(make_layout(layout, 2, 4, seq_len=1024), 1, causal, dev)
        assert whole_block(plan, 256, 256) is None
    assert whole_block(block_plan(make_layout("zigzag", 8, 1, seq_len=1024), 0, True, dev), 1000, 1024) is None
