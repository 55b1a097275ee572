"""The block plan of chunked attention (torch-free): every query sees exactly the keys of its own
attention chunk, blocks in other chunks are skipped, the work counted is the brute-force count, the
halo exchange moves only the edge rows, and the cost model prices the same plan."""

from __future__ import annotations

import random

import pytest
from tolerance import relative_difference, within

import topology
from hybrid_cp.testing.cases import MESHES
from topology.layouts import PAD, band, make_layout

# Model predictions compared with `within(relative_difference(...))`: the same closed form evaluated two ways,
# so fp64 round-off only (rel 1e-12, 1e-9, or pytest.approx's 1e-6): worst 5.1e-16 (at 1e-12), 2.2e-16 (at 1e-9)


def _row_tokens(lay, ring_rank: int) -> list:
    """(document, position) of each row of a ring block, None for padding."""
    return [
        None if sp.doc == PAD else (sp.doc, pos + i)
        for sp in lay.spans(ring_rank)
        for pos, n in sp.chunks
        for i in range(n)
    ]


def _seen(nq: int, nk: int, causal: bool, window, i: int, j: int) -> bool:
    """Whether a kernel call's mask shows key j to query i (flash-attn's bottom-right aligned window)."""
    if causal:
        return j <= i
    if window is None:
        return True
    left, right = window
    d = j - i - (nk - nq)
    return (left < 0 or d >= -left) and (right < 0 or d <= right)


def _plan_pairs(lay, ring_rank: int, causal: bool, window, chunk) -> tuple[list, int]:
    """Every (query token, key token) the plan computes on `ring_rank`, and the work it counts; checks on
    the way that a call never repeats a query row and every block lies inside one attention chunk."""
    mine, pairs, work = _row_tokens(lay, ring_rank), [], 0
    for s in range(lay.ring):
        keys = _row_tokens(lay, (ring_rank - s) % lay.ring)
        for step in lay.tasks(ring_rank, s, causal, window, chunk):
            rows = [qa + i for qa, nq, _, _ in step.pairs for i in range(nq)]
            assert len(rows) == len(set(rows)), step
            work += step.work()
            for qa, nq, ka, nk in step.pairs:
                block = {mine[qa + i] for i in range(nq)} | {keys[ka + j] for j in range(nk)}
                assert None not in block and len({(d, p // chunk) for d, p in block}) == 1, (step, block)
                pairs += [
                    (mine[qa + i], keys[ka + j])
                    for i in range(nq)
                    for j in range(nk)
                    if _seen(nq, nk, step.causal, step.window, i, j)
                ]
    return pairs, work


def _brute_force(lay, ring_rank: int, causal: bool, window, chunk) -> list:
    lo, hi = band(causal, window)
    return [
        ((d, p), (d, kp))
        for d, p in filter(None, _row_tokens(lay, ring_rank))
        for kp in range(lay.doc_lens[d])
        if kp // chunk == p // chunk and lo <= kp - p <= hi
    ]


def _configs(count: int):
    rng = random.Random(7)
    masks = [(True, None), (False, None), (True, 1), (True, 6), (False, (2, 3)), (False, (0, 9))]
    for i in range(count):
        u, r = MESHES[i % len(MESHES)]
        layout = ("zigzag", "contiguous")[i % 2]
        docs = None if i % 3 == 0 else tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 6)))
        n = rng.randint(1, 160) if docs is None else None
        causal, window = rng.choice(masks)
        yield u, r, layout, n, docs, causal, window, rng.choice([1, 2, 3, 5, 8, 13, 32, 50])


def test_plan_sees_exactly_each_chunk():
    for u, r, layout, n, docs, causal, window, chunk in _configs(160):
        lay = make_layout(layout, u, r, seq_len=n, doc_lens=docs)
        for j in range(r):
            got, work = _plan_pairs(lay, j, causal, window, chunk)
            want = _brute_force(lay, j, causal, window, chunk)
            assert sorted(got) == sorted(want), (u, r, layout, n, docs, causal, window, chunk, j)
            assert work == len(want) == sum(lay.work(causal, window, chunk)[j])


def test_chunk_beyond_every_document_is_the_plain_plan():
    lay = make_layout("zigzag", 2, 4, doc_lens=(30, 1, 90, 7))
    assert lay.effective_chunk(90) is None and lay.effective_chunk(89) == 89
    for j in range(4):
        for s in range(4):
            assert lay.tasks(j, s, True, None, 90) == lay.tasks(j, s, True)
            assert lay.tasks(j, s, False, (3, 4), 1000) == lay.tasks(j, s, False, (3, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        lay.effective_chunk(0)


def test_small_chunks_skip_blocks_and_take_the_halo():
    # 8K tokens on ring 4, C = 1024 (Llama 4 uses 8192 of far longer rows): every query sees its own
    # chunk only, so each rank computes (and reads) a small fraction of the full causal plan
    lay = make_layout("zigzag", 1, 4, seq_len=8192)
    work = [sum(row) for row in lay.work(True, None, 1024)]
    assert sum(work) == 8 * 1024 * 1025 // 2 and max(work) == min(work)  # zigzag balances whole chunks
    assert lay.halo(True, None, 256) and not lay.halo(True, None, 8000) and not lay.halo(True, None)
    assert lay.tasks(1, 2, True, None, 256) == ()  # far blocks lie in other chunks: skipped
    rows = sum(n for s in range(1, 4) for _, n in lay.needed_rows(1, s, True, None, 256))
    assert rows == 0  # C = 256 divides the 1024-row zigzag pieces: nothing crosses a rank boundary
    assert sum(n for s in range(1, 4) for _, n in lay.needed_rows(1, s, True, None, 1000)) < 1024


def test_cost_model_prices_the_chunked_plan():
    cluster = topology.Cluster.preset("dgx-h100", nodes=4)
    model = topology.ModelShape.preset("llama3-8b")
    full = topology.estimate(cluster, model, 1 << 18, 8, 4)
    assert topology.estimate(cluster, model, 1 << 18, 8, 4, chunk_size=None) == full
    chunked = topology.estimate(cluster, model, 1 << 18, 8, 4, chunk_size=8192)
    lay = make_layout("zigzag", 8, 4, seq_len=1 << 18)
    share = max(map(sum, lay.work(True, None, 8192))) / max(map(sum, lay.work(True)))
    within(relative_difference(chunked.attention_s, full.attention_s * share), 1e-9, "chunked.attention_s")
    assert chunked.bytes_per_rank == topology.comm_bytes(32, 8, 128, 1 << 18, 1, 8, 4, 2, causal=True, chunk_size=8192)
    assert chunked.bytes_per_rank["ring_fwd"] < 0.01 * full.bytes_per_rank["ring_fwd"]
    assert any("8192-token attention chunks" in note for note in chunked.notes)


def _shape(**kw) -> topology.ModelShape:
    return topology.ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32, **kw)


def test_a_model_with_chunked_layers_is_priced_as_its_average_layer():
    cluster = topology.Cluster.preset("dgx-h100", nodes=2)
    n = 1 << 17
    full = topology.estimate(cluster, _shape(), n, 8, 2)
    chunked = topology.estimate(cluster, _shape(), n, 8, 2, chunk_size=8192)
    model = topology.estimate(cluster, _shape(attention_chunk_size=8192, chunked_layers=24), n, 8, 2)
    within(relative_difference(model.time_s, 0.75 * chunked.time_s + 0.25 * full.time_s), 1e-9, "model.time_s")
    assert chunked.time_s < full.time_s
    assert any("24 of 32 layers attend in 8192-token chunks" in note for note in model.notes)
    # three kinds: window, chunked and full layers, each priced from its own plan
    mix = topology.estimate(
        cluster, _shape(sliding_window=1024, window_layers=8, attention_chunk_size=8192, chunked_layers=16), n, 8, 2
    )
    win = topology.estimate(cluster, _shape(), n, 8, 2, window=1024)
    within(
        relative_difference(mix.time_s, 0.25 * win.time_s + 0.5 * chunked.time_s + 0.25 * full.time_s),
        1e-9,
        "mix.time_s",
    )
    # a chunk reaching the whole sequence is full attention
    whole = topology.estimate(cluster, _shape(attention_chunk_size=n), n, 8, 2)
    within(relative_difference(whole.time_s, full.time_s, floor=1e-6), 1e-6, "whole-sequence chunk time_s")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(attention_chunk_size=8192, chunked_layers=40), "chunked_layers=40 exceeds layers=32"),
        (dict(attention_chunk_size=8192, sliding_window=1024), "needs window_layers and chunked_layers"),
        (
            dict(attention_chunk_size=8192, chunked_layers=20, sliding_window=1024, window_layers=20),
            "exceeds layers=32",
        ),
    ],
)
def test_model_shape_chunk_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        _shape(**kw)


def test_plan_cli_takes_chunked_layers(capsys):
    from hybrid_cp.cli.plan import main

    args = [
        "--preset",
        "dgx-h100",
        "--nodes",
        "4",
        "--heads",
        "40",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--layers",
        "48",
        "--seq-len",
        "1M",
        "--top",
        "1",
    ]
    assert main(args) == 0
    full = capsys.readouterr().out
    assert main([*args, "--attention-chunk-size", "8K", "--chunked-layers", "36"]) == 0
    chunked = capsys.readouterr().out
    assert "36 of 48 layers attend in 8192-token chunks" in chunked and "chunks" not in full
