"""Send only what is read: the ring exchanges a rank's K/V rows only when another rank's queries can
see them (`Layout.needed_rows`, the one visibility rule), for every mask. A packed row whose documents
each sit whole on one ring rank moves no ring bytes; the engine's counted bytes equal
`topology.comm_bytes` exactly, and its output and gradients match an fp64 single-device reference."""

from __future__ import annotations

import random

import dist_cases
import pytest
from dist_cases import assert_errors as _check

import topology
from topology.layouts import make_layout

_rng = random.Random(1)
# fp64 math kernel against the fp64 reference: round-off only (worst seen 1.8e-15 over 3 runs, 550x)
FP64 = 1e-12
SHORT = [_rng.randint(5, 40) for _ in range(24)]  # 492 tokens: whole documents balance on every ring size
CASES = {
    "short": SHORT,  # every document whole on one ring rank: 0 ring bytes
    "one-split": [90] + SHORT,  # one document crosses ring blocks (halo on r = 2, stream on r >= 4)
    "long": [400] + SHORT,  # one long document: halo on r = 2, streamed whole blocks on r >= 4
}


def _cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def test_whole_documents_move_no_ring_bytes():
    # (ring 8 splits one document of SHORT to balance the work: then only its rows move)
    for u, r in [(1, 2), (1, 4), (2, 2), (2, 4), (4, 2)]:
        lay = make_layout("zigzag", u, r, doc_lens=tuple(SHORT))
        assert lay.halo(True, None) and lay.halo(False, None), (u, r)
        got = topology.comm_bytes(4, 2, 8, sum(SHORT), 1, u, r, 2, cu_seqlens=_cu(SHORT))
        assert got["ring_fwd"] == got["ring_bwd"] == 0, (u, r, got)


def test_dense_rows_still_stream():
    """Causal zigzag: ring rank 0's second chunk reads every other block whole, so the halo would move
    as much as the stream; full (non-causal) attention reads everything."""
    for u, r in [(1, 2), (1, 4), (2, 4)]:
        lay = make_layout("zigzag", u, r, seq_len=4096)
        assert not lay.halo(True, None) and not lay.halo(False, None)


def test_split_document_sends_only_its_rows():
    lay = make_layout("zigzag", 1, 2, doc_lens=tuple([90] + SHORT))
    assert lay.halo(True, None)
    got = topology.comm_bytes(4, 2, 8, 90 + sum(SHORT), 1, 1, 2, 2, cu_seqlens=_cu([90] + SHORT))
    stream = (lay.ring - 1) * lay.block_len * 2 * 2 * 8 * 2  # one K|V block of 2 KV heads, dim 8, bf16
    assert 0 < got["ring_fwd"] < stream / 2, (got, stream)


def test_halo_stays_within_the_double_buffer():
    """The halo is chosen only while, on every rank, the rows received plus the rows sent fit in one
    block: its buffers then never exceed the streaming ring's, which the memory model prices."""
    for docs in ([90] + SHORT, [400] + SHORT, SHORT):
        for u, r in [(1, 2), (1, 4), (2, 4), (1, 8)]:
            lay = make_layout("zigzag", u, r, doc_lens=tuple(docs))
            moved = [
                sum(
                    n
                    for s in range(1, r)
                    for _, n in lay.needed_rows(j, s, True) + lay.needed_rows((j + s) % r, s, True)
                )
                for j in range(r)
            ]
            assert lay.halo(True, None) == (max(moved) <= lay.block_len), (docs[0], u, r, moved)


@pytest.mark.parametrize("u,r", [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_packed_full_attention_exact_and_bytes_predicted(pool, u, r):
    cases = [
        dict(docs=docs, h=4, hkv=2, d=8, causal=causal, window=None, dtype="fp64", backend="math", name=name)
        for name, docs in CASES.items()
        for causal in (True, False)
    ]
    rows = pool.run(dist_cases.window_errors, u=u, r=r, layout="zigzag", cases=cases)
    _check(rows, FP64)
    for rank in rows:
        for row in rank:
            want = topology.comm_bytes(
                4,
                2,
                8,
                sum(row["docs"]),
                1,
                u,
                r,
                8,
                cu_seqlens=_cu(row["docs"]),
                ulysses_rank=row["ulysses_rank"],
                ring_rank=row["ring_rank"],
                causal=row["causal"],
            )
            got = {s: row["bytes"].get(s, 0) for s in want}
            assert got == want, (row["name"], row["causal"], got, want)
            if row["name"] == "short":
                assert got["ring_fwd"] == got["ring_bwd"] == 0, row
