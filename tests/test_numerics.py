"""Numerics: extreme logits, all-equal scores, fp16/bf16 inputs, NaN confinement, property tests of
the online-softmax merge and of shard/positions, determinism."""

from __future__ import annotations

import random

import pytest
import reliability_cases
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerance import allclose_ratio, within

import hybrid_cp as hcp
from hybrid_cp.engine.kernels import get_kernel
from hybrid_cp.engine.kernels.merge import merge_
from hybrid_cp.engine.mesh import CPMesh
from hybrid_cp.testing import mesh_description

MATH = get_kernel("math", torch.device("cpu"), torch.float64, 8)
# fp64 merges of fp64 partial softmaxes: round-off only, as allclose(rtol=atol=1e-12): worst 1.9% of the allowance
MERGE_RTOL = MERGE_ATOL = 1e-12
# fp16/bf16 inputs against fp64 on the same rounded inputs: one rounding of the output, fp32 accumulation: worst
# 4.9e-3 (bf16), 4.1x
HALF = 2e-2
# fp32 against fp64: round-off of sums over the keys: worst 5.5e-8 (equal scores), 180x
FP32 = 1e-5
# large softmax scales amplify the scores' fp32 round-off; CP's merges of partial softmaxes round once more, so
# its error reaches 1.43x the single-device one (scale 100): the excess over the single-device error is checked,
# <= 1.5x it (+1e-6 for a zero single-device error): worst 7.8e-7 against 3.7e-6 (scale 100 on (4, 2)), 4.8x
SCALED_VS_SINGLE_DEVICE = 2.5


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_merge_in_any_order_and_grouping_is_one_softmax(sizes, seed, scale):
    """Partial (out, lse) over key blocks (empty blocks included: lse = -inf), merged in a random
    order and a random tree grouping, equal the softmax over all keys."""
    if sum(sizes) == 0:
        sizes = sizes + [1]
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    b, s, h, d = 1, 3, 2, 8
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, sum(sizes), h, d, generator=g, dtype=torch.float64)
    v = torch.randn_like(k)
    full_out, full_lse = MATH.forward(q, k, v, causal=False, scale=scale)
    parts, start = [], 0
    for size in sizes:
        if size == 0:
            parts.append(
                (
                    torch.zeros(b, s, h, d, dtype=torch.float64),
                    torch.full((b, h, s), float("-inf"), dtype=torch.float64),
                )
            )
        else:
            parts.append(
                MATH.forward(q, k[:, start : start + size], v[:, start : start + size], causal=False, scale=scale)
            )
        start += size
    rnd.shuffle(parts)
    while len(parts) > 1:  # merge two random partial results into one, until one is left
        i, j = sorted(rnd.sample(range(len(parts)), 2))
        (o1, l1), (o2, l2) = parts[i], parts.pop(j)
        o, l = o1.clone(), l1.clone()
        merge_(o, l, o2, l2)
        parts[i] = (o, l)
    out, lse = parts[0]
    within(allclose_ratio(out, full_out, MERGE_RTOL, MERGE_ATOL), 1.0, "out / allclose allowance")
    within(allclose_ratio(lse, full_lse, MERGE_RTOL, MERGE_ATOL), 1.0, "lse / allclose allowance")


def test_merge_of_empty_blocks_stays_zero():
    out = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    lse = torch.full((1, 1, 2), float("-inf"), dtype=torch.float64)
    merge_(out, lse, torch.zeros_like(out), lse.clone())
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


def _fake_mesh(u: int, r: int, layout: str, cp_rank: int) -> CPMesh:
    """A CPMesh without process groups: enough for the local arithmetic of shard/positions."""
    return mesh_description(u, r, cp_rank, layout)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    u=st.sampled_from([1, 2, 4]),
    r=st.sampled_from([1, 2, 3, 4]),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    docs=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    packed=st.booleans(),
)
def test_shard_then_place_back_is_the_identity(u, r, layout, docs, packed):
    """Every rank's shard, put back at its `positions`, rebuilds the row exactly: each real token is
    owned by exactly one rank, pads are zero (dense lengths and packed cu_seqlens alike)."""
    n = sum(docs)
    if n == 0:
        return
    cu = [0]
    for length in docs:
        cu.append(cu[-1] + length)
    x = torch.arange(1, n + 1, dtype=torch.float64).view(1, n, 1)  # token i holds i + 1; pads hold 0
    starts = torch.tensor(cu[:-1]).repeat_interleave(torch.tensor(docs))
    owners = torch.zeros(n + 1, dtype=torch.int64)
    for rank in range(u * r):
        cp = _fake_mesh(u, r, layout, rank)
        local = hcp.shard(x, cp, cu_seqlens=cu if packed else None)[0, :, 0]
        idx = local.long() - 1  # global index of each real token, -1 on pads
        real = idx >= 0
        owners.index_add_(0, local.long(), torch.ones_like(idx))
        if packed:  # positions restart in each document
            pos = hcp.positions(None, cp, cu_seqlens=cu)
            assert torch.equal(pos[real], idx[real] - starts[idx[real]])
        else:  # dense: the positions are the global indices, pads get ids >= n
            pos = hcp.positions(n, cp)
            assert torch.equal(pos[real], idx[real]) and torch.all(pos[~real] >= n)
    assert torch.all(owners[1:] == 1), owners  # every token on exactly one rank


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4), (4, 2)])
def test_extreme_logits_equal_scores_and_half_precision(pool, u, r):
    for rank, res in enumerate(pool.run(reliability_cases.numerics_extremes, u=u, r=r, timeout=300)):
        for key, err in res.items():
            if "finite" in key:
                assert err, (key, res)
            elif key.startswith(("fp16", "bf16")):
                within(err, HALF, f"rank {rank} {key}")
            elif key.startswith("scale="):
                base = res["base " + key]
                within(err - base, (SCALED_VS_SINGLE_DEVICE - 1) * base + 1e-6, f"rank {rank} {key} excess")
            elif not key.startswith("base"):
                within(err, FP32, f"rank {rank} {key}")


@pytest.mark.parametrize("u,r", [(2, 2), (1, 8)])
def test_nan_stays_in_the_rows_it_reaches(pool, u, r):
    """NaN at one token of q, k or v, causal and not: exactly the rows (and heads) it reaches."""
    combos = [(t, c) for t in ("q", "k", "v") for c in (True, False)]
    for per_rank in pool.run(reliability_cases.nan_confinements, u=u, r=r, combos=combos, timeout=300):
        for (tensor, causal), res in zip(combos, per_rank):
            assert res["missing"] == 0, (u, r, tensor, causal, res)  # every row the NaN reaches shows it
            if tensor == "v" and causal:
                # A NaN value times a probability of exactly 0 is NaN: inside one kernel block, rows
                # that mask the key out still get it (as in any matmul-based kernel). Blocks that the
                # causal plan skips stay clean, so the leak is bounded by one ring block of rows.
                assert res["extra_rows"] <= res["block_rows"], (u, r, res)
            else:
                assert res["exact"], (u, r, tensor, causal, res)


@pytest.mark.parametrize(
    "u,r,layout,packed,window",
    [
        (2, 2, "zigzag", False, None),
        (1, 4, "zigzag", True, None),
        (4, 2, "contiguous", False, 7),
        (2, 4, "zigzag", True, 9),
        (8, 1, "zigzag", False, None),
    ],
)
def test_bitwise_deterministic_reruns(pool, u, r, layout, packed, window):
    assert all(
        pool.run(reliability_cases.determinism, u=u, r=r, layout=layout, packed=packed, window=window, timeout=300)
    )
