"""Hybrid models of the further layer kinds train one step under context parallelism equal to one process:
tiny LFM2 and LFM2-MoE (gated short convolutions + attention), Jamba (Mamba-1 + attention, MoE) and MiniMax
(lightning attention + softmax attention, MoE), dense right-padded rows on three meshes, with FSDP2, and a
packed row against each document run on its own. A control: the same models with the mixers left
unrouted (each rank runs them over its shard only) fail these checks."""

import linear_more_cases
import pytest
import torch
from tolerance import within

from hybrid_cp.errors import ConfigError
from hybrid_cp.integrations.linear_layers import route_linear_layers
from hybrid_cp.integrations.model_support import VERIFIED_FAMILIES, check_model
from hybrid_cp.testing import mesh_description
from hybrid_cp.testing.families import build, tiny_config
from hybrid_cp.testing.parity import assert_every_case_ran

pytest.importorskip("transformers")

KINDS = ["lfm2", "lfm2_moe", "jamba", "minimax"]
# fp32 round-off of one tiny-model step against one process: loss (worst 1.7e-7, 58x), logits (worst 1.9e-6, 53x),
# the worst parameter gradient through fp32 scans cut where the shards end (worst 6.8e-6, Jamba packed, 15x)
LOSS, LOGITS, GRAD = 1e-5, 1e-4, 1e-4


def _check(rows, what, kinds=KINDS, ranks=4):
    assert_every_case_ran(rows, kinds, ranks)
    for rank, row in enumerate(rows):
        for kind, errs in row.items():
            assert not errs.get("missing"), (what, kind, errs)
            within(errs["loss"], LOSS, f"rank {rank} {kind} loss", (what, errs))
            within(errs["grad"], GRAD, f"rank {rank} {kind} grad", (what, errs))
            within(errs.get("logits", 0.0), LOGITS, f"rank {rank} {kind} logits", (what, errs))


@pytest.mark.parametrize("u,r,fsdp", [(2, 2, False), (1, 4, False), (4, 1, False), (2, 2, True)])
def test_more_hybrids_step_matches_one_process(pool, u, r, fsdp):
    _check(pool.run(linear_more_cases.more_parity, u=u, r=r, kinds=KINDS, fsdp=fsdp), (u, r, fsdp), ranks=u * r)


def test_more_hybrids_packed_row_matches_per_document_reference(pool):
    _check(pool.run(linear_more_cases.more_packed_parity, u=2, r=2, kinds=KINDS), "packed")


def test_jamba_routed_decoder_layer_under_activation_checkpointing(pool):
    # Jamba's Mamba decoder layer is routed too (to pass the packed row's boundaries on): it must checkpoint
    _check(pool.run(linear_more_cases.more_parity, u=2, r=2, kinds=["jamba"], checkpoint=True), "checkpoint", ["jamba"])


def test_unrouted_mixers_fail_the_same_checks(pool):
    # the control: without the routing every family's gradients are off by far more than the tolerance
    rows = pool.run(linear_more_cases.more_parity, u=2, r=2, kinds=KINDS, routed=False)
    assert_every_case_ran(rows, KINDS, 4)
    for row in rows:
        for kind, errs in row.items():
            assert errs["grad"] > 0.1 and errs["logits"] > 5e-4, (kind, errs)


def test_guard_accepts_the_new_families_and_still_refuses_unverified_hybrids():
    for model_type in KINDS:
        assert model_type in VERIFIED_FAMILIES
        check_model(build(tiny_config(model_type), "meta"))
    for model_type in ("recurrent_gemma", "qwen4_exp_text", "xlstm"):
        with pytest.raises(ConfigError, match="mixes tokens along the sequence"):
            check_model(build(tiny_config(model_type), "meta"))


@pytest.mark.parametrize("model_type", KINDS)
def test_routed_mixers_refuse_a_cache_before_any_collective(model_type):
    model = build(tiny_config(model_type), "meta")
    assert route_linear_layers(model, mesh_description(2, 2)) >= 1
    routed = [m for m in model.modules() if type(m.__dict__.get("forward")).__name__.endswith("Forward")]
    for module in routed:  # the mixer and, for Jamba, its decoder layer
        with pytest.raises(ConfigError, match="received a cache"):
            module.forward(torch.zeros(1, 4, 64, device="meta"), cache=object())
