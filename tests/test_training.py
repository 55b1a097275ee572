"""Training under context parallelism equals training on one process: shard_batch, cross_entropy,
the transformers integration and FSDP2, against single-process references."""

import pytest
import torch
import train_cases
from tolerance import within

from hybrid_cp.engine.layout import local_indices, padded_length
from hybrid_cp.engine.mesh import CPMesh
from hybrid_cp.testing import mesh_description
from hybrid_cp.training.batch import shard_batch, shift_labels

pytest.importorskip("transformers")

MESHES = [(2, 1), (1, 2), (2, 2), (4, 2)]
# fp32 round-off of a tiny 2-layer model (loss, logits, every gradient relative to its largest) against one
# process: worst 2.3e-6 in the last session's two runs (gemma3 sliding-window grads; loss 1.7e-7): a 4.4x margin
# (1.3e-6 in the latest recorded run)
TOL = 1e-5
DRIFT = 1e-4


def _fake_mesh(u, r, rank, layout="zigzag") -> CPMesh:
    """A mesh description without process groups: enough for shard_batch (which does no communication)."""
    return mesh_description(u, r, rank, layout)


def _gather(u, r, layout, s, parts, key):
    """Reassemble the full padded sequence of `key` from every rank's shard."""
    n = padded_length(s, layout, u, r)
    first = parts[0][key]
    full = torch.empty(first.shape[0], n, *first.shape[2:], dtype=first.dtype)
    for rank, part in enumerate(parts):
        full[:, local_indices(s, layout, u, r, rank)] = part[key]
    return full


@pytest.mark.parametrize("u,r,layout", [(2, 2, "zigzag"), (4, 2, "zigzag"), (2, 1, "contiguous"), (1, 4, "zigzag")])
@pytest.mark.parametrize("s", [37, 64])
def test_shard_batch_shifts_before_sharding(u, r, layout, s):
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, 256, (3, s), generator=g)
    mask = torch.ones(3, s, dtype=torch.long)
    mask[1, s - 10 :] = 0
    mask[2, 1:] = 0
    extra = torch.randn(3, s, 5, generator=g)
    batch = {
        "input_ids": ids,
        "labels": ids,
        "attention_mask": mask,
        "extra": extra,
        "meta": "kept",
        "per_sample": torch.arange(3),
    }
    parts = [shard_batch(batch, _fake_mesh(u, r, k, layout), ignore_index=-1, pad_token_id=9) for k in range(u * r)]
    n = padded_length(s, layout, u, r)
    assert all(p["input_ids"].shape == (3, n // (u * r)) for p in parts)
    assert all(p["meta"] == "kept" and torch.equal(p["per_sample"], torch.arange(3)) for p in parts)
    full = {
        k: _gather(u, r, layout, s, parts, k)
        for k in ("input_ids", "labels", "position_ids", "attention_mask", "extra")
    }
    assert torch.equal(full["input_ids"][:, :s], ids) and (full["input_ids"][:, s:] == 9).all()
    # labels: next token on the FULL sequence, ignored at masked tokens, the last token and the pads
    expect = torch.full((3, n), -1)
    expect[:, : s - 1] = ids[:, 1:]
    expect[:, :s][~(mask.bool() & torch.cat([mask[:, 1:], torch.zeros(3, 1, dtype=torch.long)], 1).bool())] = -1
    assert torch.equal(full["labels"], expect)
    assert torch.equal(full["position_ids"], torch.arange(n).expand(3, -1))
    assert torch.equal(full["attention_mask"][:, :s], mask) and (full["attention_mask"][:, s:] == 0).all()
    assert torch.equal(full["extra"][:, :s], extra) and (full["extra"][:, s:] == 0).all()


def test_shard_batch_defaults_and_given_positions():
    ids = torch.arange(20)[None] % 7
    parts = [
        shard_batch({"input_ids": ids, "position_ids": torch.arange(5, 25)}, _fake_mesh(2, 2, k)) for k in range(4)
    ]
    full = _gather(2, 2, "zigzag", 20, parts, "position_ids")
    assert torch.equal(full, torch.arange(5, 29)[None])  # offset kept, pads continue after the end
    labels = _gather(2, 2, "zigzag", 20, parts, "labels")  # default labels = input_ids, shifted
    assert torch.equal(labels[0, :19], ids[0, 1:]) and (labels[0, 19:] == -100).all()
    assert torch.equal(shift_labels(torch.tensor([[1, 2, 3]])), torch.tensor([[2, 3, -100]]))
    unshifted = shard_batch({"input_ids": ids, "labels": ids}, _fake_mesh(1, 1, 0), shift=False)
    assert torch.equal(unshifted["labels"][:, :20], ids)


@pytest.mark.parametrize(
    "batch,match",
    [
        ({"labels": torch.zeros(1, 8, dtype=torch.long)}, "input_ids"),
        ({"input_ids": torch.zeros(8, dtype=torch.long)}, r"input_ids\[None\]"),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 9, dtype=torch.long)},
            r"'labels'.*length 9.*8",
        ),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "extra": torch.zeros(3, 8)}, r"'extra'.*batch size 3"),
        (
            {
                "input_ids": torch.zeros(1, 8, dtype=torch.long),
                "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]),
            },
            "not right padding",
        ),
        ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 1, 8, 8)}, "padding mask"),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.tensor([0, 1, 2, 5, 6, 7, 8, 9])},
            "custom positions",
        ),
    ],
)
def test_shard_batch_rejects_bad_input(batch, match):
    with pytest.raises(ValueError, match=match):
        shard_batch(batch, _fake_mesh(2, 2, 0))


@pytest.mark.parametrize("u,r", [(2, 2), (4, 2), (1, 8)])
@pytest.mark.parametrize("reduction,include_dp", [("mean", False), ("sum", False), ("mean", True)])
def test_cross_entropy_matches_full_sequence(pool, u, r, reduction, include_dp):
    # s=5 on (4,2)/(1,8) leaves ranks holding only padding: no valid token there
    for s in (37, 5):
        rows = pool.run(train_cases.loss_parity, u=u, r=r, s=s, reduction=reduction, include_dp=include_dp)
        for rank, row in enumerate(rows):
            assert row["finite"]
            within(abs(row["loss"] - row["ref"]) / max(abs(row["ref"]), 1e-30), TOL, f"s={s} rank {rank} loss", row)
            within(row["grad"], TOL, f"s={s} rank {rank} grad", row)
            if row["grad_zero"] is not None:
                assert row["grad_zero"] == 0.0, (rank, s, row)
        if s == 5 and u * r == 8:
            assert any(row["valid_here"] == 0 for row in rows)


def test_cross_entropy_with_no_valid_token_anywhere(pool):
    for row in pool.run(train_cases.loss_parity, u=2, r=2, s=16, empty=True):
        assert row["loss"] == 0.0 and row["finite"] and row["grad_zero"] == 0.0


@pytest.mark.parametrize("u,r", MESHES)
@pytest.mark.parametrize("fsdp", [False, True])
def test_llama_gqa_matches_single_process(pool, u, r, fsdp):
    hkv = 1 if (u, r) == (4, 2) else 2  # MQA on the widest ulysses degree, GQA elsewhere
    for rank, row in enumerate(pool.run(train_cases.model_parity, u=u, r=r, hkv=hkv, fsdp=fsdp)):
        assert not row["missing"], row
        for key in ("logits", "loss", "grad"):
            within(row[key], TOL, f"rank {rank} {key}", row)


def test_activation_checkpointing_with_fsdp(pool):
    for rank, row in enumerate(pool.run(train_cases.model_parity, u=2, r=2, fsdp=True, checkpoint=True)):
        for key in ("logits", "loss", "grad"):
            within(row[key], TOL, f"rank {rank} {key}", row)


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_other_architectures(pool, kind):
    for rank, row in enumerate(pool.run(train_cases.model_parity, u=2, r=2, kind=kind, hkv=2, s=64, pad=False)):
        for key in ("logits", "loss", "grad"):
            within(row[key], TOL, f"rank {rank} {key}", row)


@pytest.mark.parametrize(
    "kind,config",
    [
        ("mistral", {"sliding_window": 16}),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]},
        ),
        ("gemma3", {}),
    ],
)
def test_sliding_window_models_match_single_process(pool, kind, config):
    # 100 tokens: several windows long; window layers and full layers in one model (qwen2, gemma3)
    for rank, row in enumerate(
        pool.run(train_cases.model_parity, u=2, r=2, kind=kind, hkv=2, s=100, pad=True, config=config)
    ):
        for key in ("logits", "loss", "grad"):
            within(row[key], TOL, f"rank {rank} {key}", row)


@pytest.mark.parametrize("u,r,fsdp", [(2, 2, False), (4, 2, True)])
def test_twenty_steps_track_single_process(pool, u, r, fsdp):
    for rank, row in enumerate(pool.run(train_cases.training_losses, u=u, r=r, steps=20, fsdp=fsdp)):
        assert len(row["cp"]) == 20
        diffs = [abs(a - b) for a, b in zip(row["cp"], row["ref"])]
        # AdamW carries each step's fp32 round-off into the next over 20 steps (losses near 5.5): worst 4.3e-6
        # ((4, 2) with FSDP2), 23x
        within(max(diffs), DRIFT, f"rank {rank} worst step loss difference", diffs)
        assert row["ref"][-1] < row["ref"][0]  # it does train


def test_unsupported_configurations_raise(pool):
    for row in pool.run(train_cases.error_messages, u=2, r=2):
        assert row["ok_after"][0] == 2
        assert "hcp.cross_entropy" in row["labels"]
        assert "right padding" in row["left_padding"]
        assert "4-D" in row["mask_4d"] or "padding mask" in row["mask_4d"]
        assert "position" in row["positions"]
        assert "softcap" in row["softcap_runtime"], row["softcap_runtime"]
        assert "s_aux" in row["sinks_runtime"] and "attention sinks" in row["sinks_runtime"], row["sinks_runtime"]
        assert "attention_temperature=2.0" in row["unknown_runtime"], row["unknown_runtime"]
        assert "attention_dropout" in row["dropout"]
        assert "dropout" in row["dropout_runtime"]
