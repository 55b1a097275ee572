"""Gemma 3 vision-language rows under context parallelism (`hybrid_cp.image_row` -> `hcp.shard_batch(...,
mask=row["mask"])` -> `model(**shard)`): one training step equals the single-process model given pixel_values and
token_type_ids (transformers' own image-block masks), and the calls that cannot be exact raise a named error on every
rank (tests/vision_mask_cases.py)."""

import pytest
import torch
import vision_mask_cases as cases
from tolerance import within

import hybrid_cp as hcp
from hybrid_cp.errors import ConfigError, ShapeError
from hybrid_cp.integrations.model_support import VISION_LANGUAGE_FAMILIES, check_model
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.integrations.vision import image_blocks
from hybrid_cp.testing import mesh_description
from hybrid_cp.testing.parity import mask_visibility
from hybrid_cp.training.batch import MASK_KEY

pytest.importorskip("transformers")

# fp32 round-off of the tiny Gemma 3 (a sliding and a full layer, a one-layer SigLIP tower) on a 63-token row with two
# 16-token images, CP step vs one process, over 3 recorded runs (fixed seeds: each run gave the same figures): worst
# loss 8.6e-8 (2x2; 1x4: 0; 117x under), worst gradient 2.2e-6 (2x2; 1x4: 1.4e-6; 45x under). The vision tower's key
# bias, zero in exact arithmetic, counts only against the largest gradient (vision_mask_cases.ZERO_GRADS)
LOSS = 1e-5
GRAD = 1e-4


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
def test_gemma3_image_row_step_matches_single_process(pool, u, r):
    rows = pool.run(cases.vl_parity, u=u, r=r)
    for rank, row in enumerate(rows):
        assert not row["missing"] and row["carried"], (u, r, row)
        assert row["vision_grads"] > 0, row  # the vision tower trains through the sharded embeddings
        assert row["vision_impl"] == "eager" and row["text_impl"] == "hybrid_cp", row  # the tower is not CP
        within(row["loss"], LOSS, f"u={u} r={r} rank {rank} loss", row)
        within(row["grad"], GRAD, f"u={u} r={r} rank {rank} grad", row)
    # teeth: the images run causally (their blocks lost on the way) would move some gradient far more
    assert rows[0]["leak"] > 1e2 * GRAD, rows[0]
    assert len({row["cp_loss"] for row in rows}) == 1, [row["cp_loss"] for row in rows]


def test_gemma3_media_calls_are_refused_on_every_rank(pool):
    rows = pool.run(cases.vl_refusals, u=2, r=2)
    for row in rows:
        for case in ("pixel_values", "token_type_ids", "no_mask"):
            assert row[case][0] == "ConfigError", (case, row[case])
            assert "hybrid_cp.image_row" in row[case][1], (case, row[case])
        assert "vision tower would run on this rank's shard" in row["pixel_values"][1]
        assert f"no {MASK_KEY}" in row["no_mask"][1]
        lone = row["pixel_values_on_rank_0"]  # the others learn it through the input agreement
        if row["cp_rank"] == 0:
            assert lone[0] == "ConfigError" and "hybrid_cp.image_row" in lone[1], lone
        else:
            assert lone[0] == "InconsistentRanksError" and "cp ranks [0] rejected their model inputs" in lone[1], lone
        assert row["ok_after"] > 0
    assert len({row["ok_after"] for row in rows}) == 1


def test_gemma3_refusals_come_before_any_collective():
    """A mesh description has no process groups: the refusal is raised before any collective is needed (with
    process groups it travels through the input agreement, so a rank not given images raises as well)."""
    model = apply_context_parallel(cases.tiny_vlm(), mesh_description(2, 2))
    row = cases.vl_row()
    with pytest.raises(ConfigError, match=r"\['pixel_values'\] under context parallelism.*hybrid_cp.image_row"):
        model(input_ids=row["input_ids"][:, :16], pixel_values=row["pixel_values"])
    with pytest.raises(ConfigError, match=r"token_type_ids under context parallelism.*hybrid_cp.image_row"):
        model(input_ids=row["input_ids"][:, :16], token_type_ids=row["token_type_ids"][:, :16])


def test_image_blocks_equal_transformers_masks():
    """Full layers: OR(causal, block); sliding layers: AND(window, OR(causal, block)), the engine's `windowed` of
    the same mask; cell by cell against the dense masks transformers' Gemma 3 builds from token_type_ids."""
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    row = cases.vl_row()
    types = row["token_type_ids"].clone()
    types[0, 30:32] = 1  # a third, two-token image right after text: its own block
    mask = image_blocks(types)
    dense = create_masks_for_vision_model(
        config=cases.tiny_config().get_text_config(),
        inputs_embeds=torch.zeros(1, types.shape[1], 8),
        attention_mask=None,
        cache=None,
        position_ids=row["position_ids"],
        block_sequence_ids=get_block_sequence_ids_for_mask(types),
    )
    for kind, window in (("full_attention", None), ("sliding_attention", cases.WINDOW)):
        visible = dense[kind][0, 0] == 0  # transformers' eager mask: 0 where a key is seen, -inf elsewhere
        assert torch.equal(mask_visibility(mask.windowed(window)), visible), kind
    assert len([s for s in mask.slices if s.hi is None]) == 3  # three images, three blocks


def test_image_row_places_features_as_transformers_does():
    """The model given image_row's inputs_embeds (and transformers' mask from token_type_ids) gives the logits of the
    model given input_ids and pixel_values: embedding scale, placeholder ids, scatter order."""
    model = cases.tiny_vlm().eval()
    row = cases.vl_row()
    built = hcp.image_row(model, row["input_ids"], row["pixel_values"], row["token_type_ids"])
    with torch.no_grad():
        want = model(
            input_ids=row["input_ids"], pixel_values=row["pixel_values"], token_type_ids=row["token_type_ids"]
        ).logits
        got = model(inputs_embeds=built["inputs_embeds"], token_type_ids=row["token_type_ids"]).logits
    assert torch.equal(got, want)


def test_image_row_refusals():
    model = cases.tiny_vlm()
    row = cases.vl_row()
    ids, pixels, types = row["input_ids"], row["pixel_values"], row["token_type_ids"]
    with pytest.raises(ConfigError, match="image tokens"):
        hcp.image_row(model, ids, pixels, torch.zeros_like(types))
    with pytest.raises(ConfigError, match="pixel_values is None"):
        hcp.image_row(model, ids, None, types)
    with pytest.raises(ShapeError, match="Image features and image tokens do not match"):
        hcp.image_row(model, ids, pixels[:1], types)
    with pytest.raises(ConfigError, match="elsewhere than row 0"):
        hcp.image_row(
            model, torch.cat([ids, ids.roll(1, 1)]), torch.cat([pixels, pixels]), torch.cat([types, types.roll(1, 1)])
        )
    with pytest.raises(ConfigError, match=r"supports model_type \['gemma3'\]"):
        hcp.image_row(torch.nn.Linear(2, 2), ids, pixels, types)


def test_shard_batch_takes_inputs_embeds_under_a_mask():
    """inputs_embeds [B, S, H] in place of input_ids: cut along dim 1 with the mask's layout (zeros in pad slots),
    differentiable back to the full row; refused without mask= (it would run causally) and with an attention_mask."""
    mask = image_blocks(cases.vl_row()["token_type_ids"])
    n = mask.seq_len
    embeds = torch.arange(n, dtype=torch.float64)[None, :, None].expand(2, n, 3).clone().requires_grad_()
    targets = torch.arange(n)[None].expand(2, -1)
    seen = torch.zeros(n, dtype=torch.long)
    total = 0
    for rank in range(4):
        out = hcp.shard_batch(
            {"inputs_embeds": embeds, "shift_labels": targets}, mesh_description(2, 2, rank), mask=mask
        )
        assert "input_ids" not in out and out[MASK_KEY] is mask
        real = out["labels"][0] >= 0
        index = out["inputs_embeds"][0, real, 0].long()
        assert torch.equal(index, out["labels"][0, real]) and torch.equal(out["position_ids"][0, real], index)
        assert bool((out["inputs_embeds"][:, ~real] == 0).all())
        seen[index] += 1
        total = total + out["inputs_embeds"].sum()
    assert bool((seen == 1).all())  # every token on exactly one rank
    total.backward()
    assert bool((embeds.grad == 1).all())
    with pytest.raises(ConfigError, match="without mask="):
        hcp.shard_batch({"inputs_embeds": embeds, "shift_labels": targets}, mesh_description(2, 2))
    with pytest.raises(ConfigError, match="takes no padding mask"):
        hcp.shard_batch(
            {"inputs_embeds": embeds, "attention_mask": torch.ones(2, n, dtype=torch.long)},
            mesh_description(2, 2),
            mask=mask,
        )
    with pytest.raises(ShapeError, match="floating"):
        hcp.shard_batch({"inputs_embeds": embeds.detach().long()}, mesh_description(2, 2), mask=mask)


def test_gemma3_is_a_vision_language_family_and_gemma4_paligemma_are_refused():
    from transformers import AutoConfig, AutoModelForImageTextToText

    assert "gemma3" in VISION_LANGUAGE_FAMILIES
    check_model(cases.tiny_vlm())  # the vision tower and projector are image_row's, not checked
    for model_type, named in (("gemma4", "per-layer embeddings"), ("paligemma", "prefix-LM")):
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type))
        with pytest.raises(
            ConfigError, match=f"vision-language family that hybrid_cp.image_row does not carry.*{named}"
        ):
            check_model(model)
