"""Exact counts: bytes each stage sends (vs the cost model), causal work per rank, layouts."""

import dist_cases
import pytest
import torch

import topology
from hybrid_cp.engine.heads import head_split
from hybrid_cp.engine.layout import granularity, local_indices, padded_length
from topology.layouts import make_layout


def block_work(layout, u, r, n, causal=True):
    return make_layout(layout, u, r, seq_len=n).work(causal)


STAGES = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")


@pytest.mark.parametrize(
    "u,r,h,hkv,n,causal",
    [
        (4, 2, 8, 2, 1000, True),
        (2, 4, 8, 8, 512, False),
        (8, 1, 8, 1, 256, True),
        (4, 1, 10, 2, 300, False),
        (1, 8, 8, 2, 256, True),
        (2, 2, 6, 3, 100, True),
    ],
)
def test_counted_bytes_equal_cost_model(pool, u, r, h, hkv, n, causal):
    per_rank = pool.run(
        dist_cases.comm_bytes_case, u=u, r=r, layout="zigzag", b=2, n=n, h=h, hkv=hkv, d=16, causal=causal
    )
    for res in per_rank:
        want = topology.comm_bytes(h, hkv, 16, n, 2, u, r, 4, ulysses_rank=res["ulysses_rank"])
        got = {s: res["total"].get(s, 0) for s in STAGES}
        assert got == {s: want[s] for s in STAGES}, (res["ulysses_rank"], got, want)
        assert {s: res["fwd"].get(s, 0) for s in ("ulysses_fwd", "ring_fwd")} == {
            s: want[s] for s in ("ulysses_fwd", "ring_fwd")
        }


@pytest.mark.parametrize("u,r", [(1, 2), (2, 2), (4, 2), (1, 8), (2, 4), (1, 16), (8, 8)])
def test_zigzag_gives_every_rank_the_same_causal_work(u, r):
    n = 64 * u * r
    work = block_work("zigzag", u, r, n, causal=True)
    per_rank = [sum(row) for row in work]
    assert len(set(per_rank)) == 1, per_rank
    # and every step after the first costs the same on every rank (no idle ring steps)
    assert len({row[s] for row in work for s in range(1, r)}) <= 1, work
    contiguous = [sum(row) for row in block_work("contiguous", u, r, n, causal=True)]
    assert max(contiguous) > 1.5 * min(contiguous)


def test_causal_work_counts_every_visible_pair_once():
    for u, r in [(1, 2), (2, 4), (4, 2)]:
        n = 32 * u * r
        total = sum(map(sum, block_work("zigzag", u, r, n, causal=True)))
        # the diagonal block of each ring rank is computed as a full lower triangle of 2 chunks,
        # which is exactly the causal pairs among its own tokens
        assert total == n * (n + 1) // 2, (u, r, total)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("u,r,n", [(1, 1, 5), (2, 2, 1000), (4, 2, 37), (1, 8, 1001), (8, 1, 8), (2, 4, 512)])
def test_layout_is_a_permutation(layout, u, r, n):
    padded = padded_length(n, layout, u, r)
    assert padded % granularity(layout, u, r) == 0 and n <= padded < n + granularity(layout, u, r)
    idx = torch.cat([local_indices(n, layout, u, r, k) for k in range(u * r)])
    assert torch.equal(idx.sort().values, torch.arange(padded))
    sizes = {local_indices(n, layout, u, r, k).numel() for k in range(u * r)}
    assert sizes == {padded // (u * r)}


def test_zigzag_positions_follow_design():
    # 2r = 4 chunks of 8 tokens, each cut into u = 2 pieces of 4: ring rank 1, ulysses rank 0
    # owns piece 0 of chunks 1 and 2.
    idx = local_indices(32, "zigzag", 2, 2, 2)
    assert idx.tolist() == [8, 9, 10, 11, 16, 17, 18, 19]


def test_head_split_uneven_and_gqa():
    s = head_split(10, 2, 4)  # 3, 3, 2, 2 query heads; groups of 5
    assert s.q == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert s.kv == ((0, 1), (0, 2), (1, 2), (1, 2))
    assert s.kv_index(1) == [0, 0, 1]
    mqa = head_split(8, 1, 8)
    assert all(kv == (0, 1) for kv in mqa.kv)  # the single KV head is replicated, never expanded
    even = head_split(32, 8, 4)
    assert [b - a for a, b in even.kv] == [2, 2, 2, 2]
