"""Masks under torch.compile and with head chunks (issue #30): the compiled custom op takes an `hcp.AttnMask` as
its encoded tensor (`AttnMask.encoded`), so a model fed a new mask every step, of a different slice count each
time, compiles once (fullgraph, error_on_recompile) and matches eager loss and gradients; masked head chunks
(one after another or overlapped) match the one-chunk call and the fp64 dense reference."""

from __future__ import annotations

import mask_compile_cases
import pytest
import torch
from tolerance import within

import hybrid_cp as hcp
from hybrid_cp.engine.masks import decode_mask, encode_mask
from hybrid_cp.engine.spec import AttentionSpec
from topology.masks import AttnMask as RangeMask

# aot_eager runs eager's ops: compiled vs eager is 0.0 in recorded runs. Head chunks run the same kernels on fewer
# heads, their fp32 sums merged in another order: worst 2.3e-7 (vs one chunk, u=2 r=2), 4.3x
EXACT = 1e-6
# fp32 kernels against the fp64 dense reference: round-off only, as tests/test_mask_attention.py's FP32: worst
# 5.6e-7 here, 18x
FP32 = 1e-5


def _mine(rows):
    """The compile cases run on the first cp group only (dp rank 0); the other replicas return None."""
    rows = [row for row in rows if row is not None]
    assert rows, "no rank compiled"
    return rows


def _check_parity(rows) -> None:
    for rank, row in enumerate(_mine(rows)):
        assert row["frames"] == 1, (rank, row["frames"])  # one compile for four masks
        assert row["graph_breaks"] == {}, (rank, row["graph_breaks"])
        assert row["op_in_graph"], rank
        assert len({s["slices"] for s in row["steps"]}) > 1, row  # the masks differ in slice count too
        for s, step in enumerate(row["steps"]):
            within(step["loss"], EXACT, f"rank {rank} step {s} loss", step)
            within(step["grads"], EXACT, f"rank {rank} step {s} grads", step)


def test_encoded_mask_round_trips():
    """decode(encode(m)) == m for every builder (the open bands' sentinels come back as None), for hcp's and
    topology's AttnMask alike; the spec's op arguments carry the encoding and give the mask back."""
    m = hcp.AttnMask
    masks = [
        m.documents([0, 40, 43, 120]),
        m.documents([0, 50, 121], causal=False, window=(5, 3)),
        m.blocks([0] * 20 + [1] * 16 + [0] * 30),
        m.prefix_lm([0, 60, 125], [25, 0]),
        m.shared_prefix(40, [15, 30, 7, 28]).windowed(12),
        m.from_slices(110, [(10, 60, 10, 60, None, 0), (80, 100, 30, 100, -5, 5)]),
        m.from_slices(5, []),
    ]
    for mask in masks:
        assert mask.encoded.dtype == torch.int64 and mask.encoded.shape == (1 + 6 * len(mask.slices),)
        assert decode_mask(mask.encoded) == mask
        plain = RangeMask.from_slices(mask.seq_len, mask.slices)
        assert decode_mask(encode_mask(plain)).slices == plain.slices
        spec = AttentionSpec.from_op_args(*AttentionSpec(mask=mask.encoded, window=7).op_args())
        assert spec.mask == mask and spec.window == 7
    with pytest.raises(hcp.ConfigError, match="6 ints per slice"):
        decode_mask(torch.tensor([8, 0, 4], dtype=torch.int64))


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4)])
def test_masked_model_compiles_once(pool, u, r):
    """fullgraph=True, error_on_recompile=True; four steps, each with a new mask (documents, shared prefix,
    prefix-LM, image blocks: 3 to 9 slices), GQA (4 query heads, 2 KV heads)."""
    _check_parity(pool.run(mask_compile_cases.parity, u=u, r=r))


def test_masked_model_with_window_softcap_sinks_compiles_once(pool):
    """The mask with a window folded in, logit soft-capping and learnable sinks, in one compiled graph."""
    _check_parity(pool.run(mask_compile_cases.parity, u=2, r=2, window=9, softcap=20.0, sinks=True))


def test_topology_masks_compile_as_constants(pool):
    """A `topology.masks.AttnMask` (no `encoded` tensor) is encoded while tracing: a constant, so each new mask
    recompiles (no graph break), with eager's results."""
    for rank, row in enumerate(_mine(pool.run(mask_compile_cases.parity, u=2, r=2, plain=True))):
        assert row["frames"] == len(row["steps"]) and row["graph_breaks"] == {} and row["op_in_graph"], (rank, row)
        for s, step in enumerate(row["steps"]):
            within(step["loss"], EXACT, f"rank {rank} step {s} loss", step)
            within(step["grads"], EXACT, f"rank {rank} step {s} grads", step)


def test_masked_ops_pass_opcheck(pool):
    """Schema, fake vs real shapes and strides, autograd registration and AOT dispatch with a mask argument."""
    for row in _mine(pool.run(mask_compile_cases.opcheck, u=2, r=2)):
        for op in ("fwd", "bwd"):
            assert set(row[op].values()) == {"SUCCESS"}, row


def _head_chunk_cases() -> list[dict]:
    m = hcp.AttnMask
    masks = [
        ("documents", m.documents([0, 40, 43, 120]), None, None),
        ("shared-prefix-window-softcap", m.shared_prefix(40, [15, 30, 7, 28]), 12, 30.0),
        (
            "sparse",
            m.from_slices(110, [(10, 60, 10, 60, None, 0), (60, 80, 0, 20, None, None), (80, 100, 30, 100, -5, 5)]),
            None,
            None,
        ),
    ]
    return [
        dict(
            name=name,
            mask=mask,
            window=window,
            softcap=softcap,
            h=8,
            hkv=2,
            d=8,
            seed=i,
            head_chunks=2,
            overlap=overlap,
        )
        for i, (name, mask, window, softcap) in enumerate(masks)
        for overlap in (False, True)
    ]


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4)])
def test_masked_head_chunks(pool, u, r):
    """head_chunks=2, one after another and overlapped: the same results as one chunk, and the fp64 reference."""
    cases = _head_chunk_cases()
    for rank, rows in enumerate(pool.run(mask_compile_cases.head_chunk_errors, u=u, r=r, cases=cases)):
        for row in rows:
            label = f"u={u} r={r} rank {rank} {row['name']} overlap={row['overlap']}"
            assert row["lse -inf match"], label
            for key, value in row.items():
                if key.endswith("vs one chunk"):
                    within(value, EXACT, f"{label} {key}", row)
                elif key.endswith("vs fp64"):
                    within(value, FP32, f"{label} {key}", row)
