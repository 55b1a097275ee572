"""Chunked attention (hcp.attention(chunk_size=C), Llama 4's attention_chunk_size) across the mesh:
fp64 parity of out, lse, dq, dk, dv on every mesh with u * r <= 8 (dense and packed rows, both
layouts), halo traffic equal to the cost model's, the compiled op, and the refusals."""

from __future__ import annotations

import chunk_cases
import compile_cases
import pytest
from dist_cases import assert_errors
from test_compile import EXACT, _check_parity

import topology
from hybrid_cp.testing.cases import MESHES

BOTH_LAYOUTS = {(2, 2), (1, 4)}
# fp64 round-off only: worst 1.7e-15, 600x
FP64 = 1e-12
# lse of fp64 calls with head chunks, carried home in fp32 (one rounding, 6e-8 relative): worst 3.5e-16 in the
# recorded runs
LSE_IN_FP32 = 1e-6
# fp32 round-off against fp64: worst 5.5e-7 (dq, (1, 8)), 18x
FP32 = 1e-5


def _predicted_bytes(row: dict, u: int, r: int) -> dict[str, int]:
    n = sum(row["docs"]) if "docs" in row else row["n"]
    cu = None
    if "docs" in row:
        cu = [0]
        for m in row["docs"]:
            cu.append(cu[-1] + m)
    return topology.comm_bytes(
        row["h"],
        row["hkv"],
        row["d"],
        n,
        1,
        u,
        r,
        4 if row.get("dtype") == "fp32" else 8,
        row["layout"],
        ulysses_rank=row["ulysses_rank"],
        cu_seqlens=cu,
        causal=row["causal"],
        window=row.get("window"),
        ring_rank=row["ring_rank"],
        chunk_size=row["chunk"],
    )


@pytest.mark.parametrize("u,r", MESHES)
def test_chunked_matches_single_device(pool, u, r):
    layouts = ("zigzag", "contiguous") if (u, r) in BOTH_LAYOUTS else ("zigzag",)
    rows = pool.run(chunk_cases.chunk_errors, u=u, r=r, layouts=layouts, pick=MESHES.index((u, r)), timeout=300)
    fp64 = [[row for row in rank if row.get("dtype") != "fp32"] for rank in rows]
    assert_errors(fp64, FP64, ("out", "dq", "dk", "dv"), "fp64")
    # head chunks keep lse in fp32 on its way home (hybrid_cp/engine/headchunk.py), as without chunk_size
    assert_errors(
        [[row for row in rank if row.get("head_chunks", 1) == 1] for rank in fp64],
        FP64,
        ("lse",),
        "fp64 no head chunks",
    )
    assert_errors(fp64, LSE_IN_FP32, ("lse",), "fp64")
    assert_errors([[row for row in rank if row.get("dtype") == "fp32"] for rank in rows], FP32, label="fp32")
    for rank in rows:
        for row in rank:
            # the engine's byte counter equals the cost model's (fp32 and fp64 calls)
            if row.get("head_chunks", 1) == 1:
                got = {s: row["bytes"].get(s, 0) for s in ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")}
                want = _predicted_bytes(row, u, r)
                assert got == {s: want[s] for s in got}, (row, want)
    if r > 1:  # a chunk below the ring block reads only the neighbours' edge rows: halo mode
        assert all(row["halo"] for rank in rows for row in rank if row["chunk"] == 3), rows[0]


def test_chunked_model_compiles(pool):
    """fullgraph, no recompiles over 3 steps of new packings, exact against eager; C = 8 on 64 tokens
    (u = r = 2) takes the halo exchange, which the compiled backward receives again."""
    rows = pool.run(compile_cases.parity, u=2, r=2, packed=True, chunk_size=8)
    _check_parity(rows, EXACT, halo=True)


def test_chunk_size_refusals(pool):
    for rank, row in enumerate(pool.run(chunk_cases.chunk_refusals, u=2, r=2)):
        for value in ("0", "-3", "True", "2.5", "'8'"):
            msg = row[f"bad {value}"]
            assert msg.startswith("ConfigError") and f"chunk_size={value}" in msg and "or None" in msg, (rank, msg)
            assert row[f"bad {value} bytes"] == 0, (rank, row)
        for name in ("one rank 8", "one rank None"):
            msg = row[name]
            assert msg.startswith("InconsistentRanksError") and "chunk_size" in msg, (rank, msg)
            assert row[name + " bytes"] == 0, (rank, row)
        assert row["callable"].startswith("ConfigError") and "attention chunks" in row["callable"], (rank, row)
