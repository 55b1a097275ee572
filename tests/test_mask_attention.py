"""Attention under any `hcp.AttnMask` across the mesh: fp64 dense masked reference on every mesh with
u*r <= 8, GQA/MQA/MHA, each builder, rows that see no key, keys only on other ranks, a window folded into the
mask, soft-capping; bytes sent equal `topology.comm_bytes(mask=)` exactly (docs/attention.md, "Masks").
Worst fp32 figure in a recorded run: 1.44e-6 (dq, u=2 r=4), 6.9x under FP32."""

from __future__ import annotations

import pytest
from dist_cases import assert_errors

import hybrid_cp as hcp
import topology
from hybrid_cp.testing import parity
from hybrid_cp.testing.cases import MESHES

# fp32 kernels against the fp64 dense reference: round-off only (worst seen: see the closing note), 3x margin
FP32 = 1e-5
# fp64 end to end: round-off of a few hundred terms
FP64 = 1e-12


def _masks() -> list[tuple[str, hcp.AttnMask, object]]:
    """(name, mask, window) of every builder, with rows that see no key and keys held only by other ranks."""
    m = hcp.AttnMask
    images = [0] * 20 + [1] * 16 + [0] * 30 + [2] * 24 + [0] * 30
    return [
        ("documents", m.documents([0, 40, 43, 120]), None),
        ("documents-window-chunk", m.documents([0, 70, 130], window=9, chunk_size=32), None),
        ("documents-bidirectional", m.documents([0, 50, 121], causal=False, window=(5, 3)), None),
        ("images", m.blocks(images), None),
        ("images-sliding", m.blocks(images, window=17), None),
        ("images-window", m.blocks(images), 11),
        ("prefix-lm", m.prefix_lm([0, 60, 125], [25, 0]), None),
        ("shared-prefix", m.shared_prefix(40, [15, 30, 7, 28]), None),
        ("shared-prefix-window", m.shared_prefix(40, [15, 30, 7, 28]), 12),
        ("full-row-window", m.from_slices(118, [(0, 118, 0, 118, None, None)]), (6, 4)),
        # rows 0-9 and 100-109 see nothing; rows 60-79 read only keys 0-19 (far away on a ring)
        (
            "sparse",
            m.from_slices(110, [(10, 60, 10, 60, None, 0), (60, 80, 0, 20, None, None), (80, 100, 30, 100, -5, 5)]),
            None,
        ),
    ]


def _cases(u: int) -> list[dict]:
    heads = [(8, 2), (8, 8), (8, 1)]
    return [
        dict(
            name=name,
            mask=mask,
            window=window,
            h=heads[i % 3][0],
            hkv=heads[i % 3][1],
            d=8,
            seed=i,
            softcap=30.0 if name == "images" else None,
        )
        for i, (name, mask, window) in enumerate(_masks())
    ]


def _check(rows_per_rank, cases: list[dict], limit: float, label: str) -> None:
    """Errors within `limit`; lse -inf exactly at the rows that see no key; positions the token indices; the
    bytes every stage sent equal `topology.comm_bytes(mask=, window=)` for that rank."""
    assert_errors(rows_per_rank, limit, tensors=("out", "lse", "dq", "dk", "dv", "unshard"), label=label)
    for rows in rows_per_rank:
        for row in rows:  # each dp replica ran its share of the cases (parity.replica_share)
            case = cases[row["case"]]
            assert row["empty_match"], f"{label} {row['name']}: lse is not -inf exactly at the rows that see no key"
            assert row["positions_match"], f"{label} {row['name']}: hcp.positions(cp, mask=m) is not the token index"
            mask, u, r = case["mask"], *label_mesh(label)
            want = topology.comm_bytes(
                case["h"],
                case["hkv"],
                case["d"],
                mask.seq_len,
                1,
                u,
                r,
                8 if case.get("dtype") == "fp64" else 4,
                mask=mask,
                window=case["window"],
                ulysses_rank=row["ulysses_rank"],
                ring_rank=row["ring_rank"],
            )
            got = {s: row["bytes"].get(s, 0) for s in want}
            assert got == want, (label, case["name"], got, want)


def label_mesh(label: str) -> tuple[int, int]:
    """(u, r) from a label '... u=U r=R'."""
    words = dict(w.split("=") for w in label.split() if "=" in w)
    return int(words["u"]), int(words["r"])


@pytest.mark.parametrize("u,r", MESHES)
def test_mask_matches_dense_reference(pool, u, r):
    cases = _cases(u)
    rows = pool.run(parity.mask_errors, u=u, r=r, cases=cases)
    _check(rows, cases, FP32, f"mask u={u} r={r}")
    empty = sum(row["empty_rows"] for rank in rows for row in rank)
    assert empty > 0  # the sparse mask's empty rows reached some rank


def test_mask_fp64_is_exact(pool8):
    cases = [dict(c, dtype="fp64", backend="math") for c in _cases(2)]
    rows = pool8.run(parity.mask_errors, u=2, r=4, cases=cases)
    _check(rows, cases, FP64, "mask fp64 u=2 r=4")


def test_an_int_window_drops_only_earlier_keys():
    """window=W on a mask is transformers' sliding overlay (keys more than W - 1 back dropped): the W keys ending
    at the query on a causal mask, and an image block keeps its later keys (Gemma 3's sliding layers)."""
    images = [0] * 5 + [1] * 6 + [0] * 9
    assert hcp.AttnMask.blocks(images).windowed(4) == hcp.AttnMask.blocks(images, window=4)
    assert hcp.AttnMask.documents([0, 7, 20]).windowed(4) == hcp.AttnMask.documents([0, 7, 20], window=4)
    assert hcp.AttnMask.documents([0, 20], causal=False).windowed((2, 3)) == hcp.AttnMask.documents(
        [0, 20], causal=False, window=(2, 3)
    )
    with pytest.raises(hcp.ConfigError, match="window"):
        hcp.AttnMask.documents([0, 20]).windowed(0)
