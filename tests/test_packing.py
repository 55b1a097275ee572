"""Packed documents: the block plan covers exactly the visible pairs, layouts balance realistic
mixes, and hcp.attention on packed rows equals per-document single-device attention."""

from __future__ import annotations

import sys
from pathlib import Path

import dist_cases
import pytest
from dist_cases import assert_errors
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import within

import topology
from hybrid_cp.testing.cases import MESHES
from hybrid_cp.testing.cases import packed_cases as _cases
from topology.layouts import PAD, Packed, make_layout

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from packing_balance import MIXES, measure  # noqa: E402

# fp32 round-off of each document's attention against fp64 (relative to max(|ref|, 1)): worst 1.2e-6 (dq, (1, 4)),
# 8.2x
FP32 = 1e-5
# fp64 round-off only: worst 9.7e-16, 1000x
FP64 = 1e-12


def covered_pairs(lay, ring_rank: int, causal: bool) -> list[tuple]:
    """Every (query token, key token) pair the plan makes `ring_rank` compute, as original token ids."""

    def row_tokens(j):
        toks = []
        for sp in lay.spans(j):
            for pos, n in sp.chunks:
                toks += [None if sp.doc == PAD else (sp.doc, pos + i) for i in range(n)]
        return toks

    mine = row_tokens(ring_rank)
    out = []
    for s in range(lay.ring):
        task = lay.step(ring_rank, s, causal)
        if task is None:
            continue
        keys = row_tokens((ring_rank - s) % lay.ring)
        for qa, nq, ka, nk in task.pairs:
            for i in range(nq):
                for j in range(nk):
                    if not task.causal or j <= i:
                        out.append((mine[qa + i], keys[ka + j]))
    return out


def expected_pairs(lay, ring_rank: int, causal: bool) -> list[tuple]:
    queries = [
        (sp.doc, pos + i) for sp in lay.spans(ring_rank) if sp.doc != PAD for pos, n in sp.chunks for i in range(n)
    ]
    return [((d, p), (d, kp)) for d, p in queries for kp in range(lay.doc_lens[d] if not causal else p + 1)]


@settings(max_examples=150, deadline=None)
@given(
    docs=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    mesh=st.sampled_from(MESHES),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
)
def test_plan_covers_each_visible_pair_exactly_once(docs, mesh, layout, causal):
    u, r = mesh
    lay = make_layout(layout, u, r, doc_lens=tuple(docs))
    for j in range(r):
        got = covered_pairs(lay, j, causal)
        assert None not in {q for q, _ in got} | {k for _, k in got}, "a pad row entered the plan"
        assert sorted(got) == sorted(expected_pairs(lay, j, causal)), (docs, mesh, layout, causal, j)
    # every token sits in exactly one slot, and every cp rank holds the same number of slots
    slots = [run for k in range(u * r) for run in lay.token_runs(k)]
    tokens = sorted(t + i for t, _, n in slots if t != PAD for i in range(n))
    assert tokens == list(range(sum(docs)))
    assert {sum(n for *_, n in lay.token_runs(k)) for k in range(u * r)} == {lay.local_len}


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    mesh=st.sampled_from(MESHES),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
)
def test_dense_plan_covers_each_visible_pair_exactly_once(n, mesh, layout, causal):
    lay = make_layout(layout, *mesh, seq_len=n)
    for j in range(mesh[1]):
        assert sorted(covered_pairs(lay, j, causal)) == sorted(expected_pairs(lay, j, causal))


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("u,r", [(1, 8), (2, 4), (4, 2)])
def test_realistic_mixes_are_balanced(mix, u, r):
    m = measure(MIXES[mix], u, r, "balanced")
    assert m["imbalance"] <= 1.05, m
    assert m["padding_pct"] <= 1.0, m
    assert measure(MIXES[mix], u, r, "contiguous")["imbalance"] > m["imbalance"]


def test_short_documents_stay_whole():
    # a 32K document and 400 short ones on 8 ring ranks: the short ones are not cut into chunks
    m_bal, m_zig = (measure(MIXES["32K + 400 short, 64K row"], 1, 8, p) for p in ("balanced", "zigzag"))
    assert m_bal["segments"] * 10 < m_zig["segments"] and m_bal["imbalance"] <= 1.01


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _check(rows_per_rank, limit: float = FP32) -> None:
    assert_errors(rows_per_rank, limit)
    for rank, rows in enumerate(rows_per_rank):
        for i, row in enumerate(rows):
            assert row["pad_max"] == 0.0 and row.get("lse_pad_is_neg_inf", True), row
            assert row["unshard_ok"], row
            # the unsharded output against the fp64 reference: the output's own error (unshard moves rows)
            within(row["unshard"], FP32, f"rank {rank} case {row['case']} unshard", row)


@pytest.mark.parametrize("u,r", MESHES)
def test_packed_matches_per_document_attention(pool, u, r):
    _check(pool.run(dist_cases.packed_errors, u=u, r=r, layout="zigzag", cases=_cases(u, seed=u * 10 + r)))


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4)])
def test_packed_contiguous_policy(pool, u, r):
    _check(pool.run(dist_cases.packed_errors, u=u, r=r, layout="contiguous", cases=_cases(u, seed=3)))


def test_packed_fp64_math_is_exact(pool8):
    cases = [dict(docs=[5, 1, 40, 17], h=4, hkv=2, d=8, causal=c, dtype="fp64", backend="math") for c in (True, False)]
    _check(pool8.run(dist_cases.packed_errors, u=2, r=4, layout="zigzag", cases=cases), FP64)


def test_hidden_lengths_raise_or_are_explicit(pool):
    for rank, res in enumerate(pool.run(dist_cases.hidden_length_case)):
        assert "ambiguous" in res["attention"] and "seq_len=" in res["attention"], res
        assert "ambiguous" in res["unshard"], res
        assert res["explicit_shape"] == (1, 997, 4, 16), res
        within(res["explicit_err"], FP32, f"rank {rank} explicit seq_len", res)
        within(res["causal_err"], FP32, f"rank {rank} causal", res)


@pytest.mark.parametrize("u,r,lens", [(2, 2, [1, 30, 7, 200, 3]), (4, 2, [513, 2, 2, 90]), (1, 8, [64] * 5 + [1])])
def test_packed_bytes_equal_cost_model(pool, u, r, lens):
    for res in pool.run(dist_cases.packed_comm_bytes_case, u=u, r=r, lens=lens, h=8, hkv=2, d=16, causal=True):
        want = topology.comm_bytes(
            8,
            2,
            16,
            sum(lens),
            1,
            u,
            r,
            4,
            ulysses_rank=res["ulysses_rank"],
            ring_rank=res["ring_rank"],
            cu_seqlens=res["cu"],
        )  # halo: per ring rank
        got = {s: res["total"].get(s, 0) for s in ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")}
        assert got == {s: want[s] for s in got}, (got, want)


def test_packed_layout_rejects_bad_boundaries():
    from topology.layouts import doc_lengths

    with pytest.raises(ValueError, match="must start at 0"):
        doc_lengths([1, 5])
    with pytest.raises(ValueError, match="decreases"):
        doc_lengths([0, 5, 3])
    assert Packed((3, 0, 4), 2, 2).seq_len == 7  # empty documents hold no tokens and are allowed


@settings(max_examples=8, deadline=None, derandomize=True)  # the same draws in every CI run
@given(
    docs=st.lists(st.integers(1, 70), min_size=1, max_size=9),
    mesh=st.sampled_from(MESHES[1:]),
    causal=st.booleans(),
    heads=st.sampled_from([(8, 2), (8, 1), (6, 2)]),
)
def test_random_mixes_match_per_document_attention(pool8, docs, mesh, causal, heads):
    u, r = mesh
    h, hkv = heads if heads[0] >= u else (8, 2)
    case = dict(docs=docs, h=h, hkv=hkv, d=8, causal=causal, seed=len(docs))
    _check(pool8.run(dist_cases.packed_errors, u=u, r=r, layout="zigzag", cases=[case], timeout=300))


def test_a_long_packed_run_keeps_few_plans_on_the_device():
    """Packed rows bring a new layout every step; the engine's caches of block plans and row permutations
    (device index tensors of O(local tokens) each, about 28 bytes per local token for a packed plan at u=1
    r=8) hold a few layouts, not hundreds, so a long run's memory does not grow step by step."""
    import random

    import torch

    from hybrid_cp.engine import layout as engine_layout
    from hybrid_cp.engine import ring

    rng = random.Random(0)
    dev = torch.device("cpu")
    for _ in range(40):  # 40 steps, each with its own packed row
        lens = [rng.randint(50, 400) for _ in range(12)]
        for u, r in ((1, 8), (2, 4)):
            lay = make_layout("zigzag", u, r, doc_lens=tuple(lens))
            ring.block_plan(lay, 0, True, dev)
            engine_layout.gathered_to_ring_block(torch.zeros(1, lay.block_len, 1), lay)
    assert ring._plan.cache_info().currsize <= 16
    assert engine_layout._perm.cache_info().currsize <= 8
