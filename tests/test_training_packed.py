"""Packed-document training ("padding-free" rows, as transformers' DataCollatorWithFlattening builds
them) under context parallelism equals training each document on its own in one process.

The reference never sees a packed row: it runs the model on every document separately (positions
0..len-1) and divides the summed token losses by the number of valid targets, so a leak across a
document boundary, a wrong position or a label shifted over a boundary shows up as a gradient error.
"""

import pytest
import torch
import train_cases
from tolerance import within

from hybrid_cp.engine.mesh import CPMesh
from hybrid_cp.training.batch import shard_batch

pytest.importorskip("transformers")

# fp32 round-off of a tiny model, packed row vs each document alone: worst 9.3e-7 in one run of this file
# (grads, one long document among tiny ones; loss 8.8e-8): a 10x margin
# (the same figures in a second run: fixed seeds, deterministic on CPU)
TOL = 1e-5
LENS = (9, 1, 23, 4, 61, 2, 14)  # = train_cases.PACKED_DOC_LENS (not imported: it pulls in dist_cases)


def _check(rows, what) -> None:
    for rank, row in enumerate(rows):
        assert not row["missing"], (what, row)
        within(row["loss"], TOL, f"rank {rank} loss", (what, row))
        within(row["grad"], TOL, f"rank {rank} grad", (what, row))
        # the check has teeth: attending across the documents moves some gradient by far more than TOL
        assert row["leak"] is None or row["leak"] > 1e3 * TOL, (what, row)
    assert len({row["cp_loss"] for row in rows}) == 1, (what, [row["cp_loss"] for row in rows])


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4), (4, 2)])
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp2"])
@pytest.mark.parametrize("form", ["positions", "cu_seq_lens_q"])
def test_packed_llama_step_matches_per_document_reference(pool, u, r, fsdp, form):
    rows = pool.run(train_cases.packed_model_parity, u=u, r=r, fsdp=fsdp, explicit_cu=form == "cu_seq_lens_q")
    _check(rows, (u, r, fsdp, form))


@pytest.mark.parametrize("form", ["positions", "cu_seq_lens_q"])
def test_packed_qwen2_step_matches_per_document_reference(pool, form):
    rows = pool.run(train_cases.packed_model_parity, u=2, r=2, kind="qwen2", explicit_cu=form == "cu_seq_lens_q")
    _check(rows, ("qwen2", form))


@pytest.mark.parametrize(
    "u,r,doc_lens,explicit_cu",
    [
        (4, 2, (1, 3, 2, 1), False),  # 7 tokens on 8 ranks: some ranks hold only padding
        (2, 2, (150, 1, 1, 3, 1, 2), False),  # one long document among tiny ones
        (4, 2, (5, 0, 7), True),  # an empty document (a repeated boundary)
    ],
    ids=["fewer-tokens-than-ranks", "one-long-many-tiny", "empty-document"],
)
def test_packed_extreme_document_mixes(pool, u, r, doc_lens, explicit_cu):
    rows = pool.run(train_cases.packed_model_parity, u=u, r=r, doc_lens=doc_lens, explicit_cu=explicit_cu)
    _check(rows, doc_lens)


@pytest.mark.parametrize("u,r,fsdp", [(2, 2, True), (1, 4, False)])
def test_packed_tiled_lm_loss_matches_per_document_reference(pool, u, r, fsdp):
    # hcp.lm_loss(model, shard_batch(...), cp) must hand the document boundaries to the model
    rows = pool.run(train_cases.packed_model_parity, u=u, r=r, fsdp=fsdp, tiled_loss=True)
    _check(rows, ("lm_loss", u, r, fsdp))


def test_packed_activation_checkpointing_with_fsdp(pool8):
    rows = pool8.run(train_cases.packed_model_parity, u=4, r=2, fsdp=True, checkpoint=True)
    _check(rows, "checkpoint")


@pytest.mark.parametrize("u,r", [(2, 2), (4, 2)])
@pytest.mark.parametrize("explicit_cu", [False, True])
def test_packed_labels_never_cross_a_document_boundary(pool, u, r, explicit_cu):
    cu = [0] + torch.tensor(LENS).cumsum(0).tolist()
    for row in pool.run(train_cases.packed_labels, u=u, r=r, explicit_cu=explicit_cu):
        full = row["full"]
        ids, labels = full["input_ids"][0], full["labels"][0]
        assert ids.shape == (cu[-1],) and labels.shape == (cu[-1],)
        expect = torch.full_like(ids, -7)
        for a, b in zip(cu, cu[1:]):
            expect[a : b - 1] = ids[a + 1 : b]  # next token inside the document; the last one has none
        assert torch.equal(labels, expect)
        assert all(labels[b - 1] == -7 for b in cu[1:])
        assert torch.equal(full["position_ids"][0], torch.cat([torch.arange(n) for n in LENS]))
        assert row["cu_q"] == cu and row["cu_k"] == cu and row["cu_dtype"] == "torch.int32"
        assert row["max_q"] == row["max_k"] == max(LENS)


def _one_rank_mesh_description(u: int, r: int, rank: int = 0) -> CPMesh:
    """A mesh description without process groups: shard_batch does no communication."""
    ring_rank, ulysses_rank = divmod(rank, u)
    return CPMesh(
        ulysses_size=u,
        ring_size=r,
        dp_size=1,
        layout="zigzag",
        device=torch.device("cpu"),
        device_mesh=None,
        ulysses_group=None,
        ring_group=None,
        ring_group_bwd=None,
        cp_group=None,
        ulysses_rank=ulysses_rank,
        ring_rank=ring_rank,
        dp_rank=0,
    )


_IDS = torch.arange(12)[None] % 5
_POS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]])
_CU = torch.tensor([0, 3, 5, 9, 12], dtype=torch.int32)


@pytest.mark.parametrize(
    "batch,match",
    [
        ({"input_ids": _IDS.expand(2, -1), "position_ids": _POS.expand(2, -1)}, r"batch of one.*\[1, total\]"),
        ({"input_ids": _IDS.expand(2, -1), "position_ids": _POS}, r"batch of one.*\[1, total\]"),
        ({"input_ids": _IDS.expand(2, -1), "cu_seq_lens_q": _CU}, r"batch of one.*\[1, total\]"),
        (
            {"input_ids": _IDS, "position_ids": _POS, "attention_mask": torch.ones(1, 12, dtype=torch.long)},
            "takes no attention_mask",
        ),
        (
            {"input_ids": _IDS, "cu_seq_lens_q": _CU, "attention_mask": torch.ones(1, 12, dtype=torch.long)},
            "takes no attention_mask",
        ),
        (
            {"input_ids": _IDS, "cu_seq_lens_q": torch.tensor([0, 3, 5, 9, 11], dtype=torch.int32)},
            r"ends at 11 but input_ids has 12 tokens",
        ),
        ({"input_ids": _IDS, "cu_seq_lens_q": [0, 3, 5, 9, 12, 13]}, r"ends at 13 but input_ids has 12 tokens"),
    ],
    ids=["positions_b2", "positions_1row_b2", "cu_b2", "positions_mask", "cu_mask", "cu_short", "cu_long"],
)
def test_packed_shard_batch_rejects_bad_input(batch, match):
    with pytest.raises(ValueError, match=match):
        shard_batch(batch, _one_rank_mesh_description(2, 2))


def test_packed_shard_batch_accepts_the_collator_output():
    """All the keys DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns, at once."""
    batch = {
        "input_ids": _IDS,
        "labels": _IDS.masked_fill(_POS == 0, -100),
        "position_ids": _POS,
        "cu_seq_lens_q": _CU,
        "cu_seq_lens_k": _CU,
        "max_length_q": 4,
        "max_length_k": 4,
    }
    for rank in range(4):
        out = shard_batch(batch, _one_rank_mesh_description(2, 2, rank))
        assert out["cu_seq_lens_q"].tolist() == _CU.tolist() and out["max_length_q"] == 4
        assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape
