"""The MoE router's load-balancing loss (``output_router_logits=True``) under context parallelism equals the
single-process one: value, the loss that includes it, and every gradient, for each verified family whose
transformers model computes it (`router_aux.py`); the other MoE families keep refusing the setting by name."""

from __future__ import annotations

import moe_cases
import pytest
import torch

pytest.importorskip("transformers")

from test_training import _fake_mesh  # noqa: E402

from hybrid_cp.errors import ConfigError  # noqa: E402
from hybrid_cp.integrations.model_support import VERIFIED_FAMILIES  # noqa: E402
from hybrid_cp.integrations.router_aux import aux_settings, matches_family, router_statistics, switch_loss  # noqa: E402
from hybrid_cp.integrations.transformers import apply_context_parallel  # noqa: E402
from hybrid_cp.testing import families  # noqa: E402
from hybrid_cp.testing.parity import assert_every_case_ran  # noqa: E402

# the verified families whose transformers model adds the Switch load-balancing loss (21 in transformers 5.24; flint
# too, but its verified configuration has no MoE layer: its MoE block is refused by the module guard)
AUX_FAMILIES = (
    "ernie4_5_moe",
    "flex_olmo",
    "gpt_oss",
    "granitemoe",
    "granitemoe_swa",
    "granitemoehybrid",
    "granitemoeshared",
    "jamba",
    "jetmoe",
    "laguna",
    "lara_mini",
    "mellum",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl_text",
    "mixtral",
    "olmoe",
    "qwen2_moe",
    "qwen3_5_moe_text",
    "qwen3_moe",
    "qwen3_next",
)
# verified MoE families whose transformers model computes no auxiliary loss: output_router_logits stays refused
NO_AUX = ("deepseek_v3", "glm4_moe", "afmoe", "hy_v3")
# fp32 round-off against one process (the statistics are summed in another order, the loss is the model's cross
# entropy plus the auxiliary loss at coefficient 1), worst over 21 families x 4 runs x 8 ranks: loss 2.2e-7, aux
# 2.4e-7 (margins 45x, 42x), gradients 7.6e-6 (granitemoehybrid; bound 1e-4, 13x), Gated DeltaNet hybrids 3.0e-5 (lara_mini;
# bound 2e-4, 6.7x)
TOL = 1e-5


def _installed(kinds) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [k for k in kinds if k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and k in VERIFIED_FAMILIES]


def test_the_formula_is_every_aux_familys_function():
    """Each family's own load_balancing_loss_func equals the formula on the probe, and a variant does not."""
    for kind in _installed(AUX_FAMILIES):
        model = families.build(families.tiny_config(kind), "meta")
        assert aux_settings(model)[0], (kind, aux_settings(model))
    assert not matches_family(
        lambda logits, e, k, mask: switch_loss(*router_statistics(logits, e, k, torch.ones(logits[0].shape[0])), e)
    )  # ignores the padding mask
    assert not matches_family(lambda logits, e, k: 0.0)


@pytest.mark.parametrize("kind", NO_AUX)
def test_families_without_an_aux_loss_refuse_output_router_logits(kind):
    if not _installed([kind]):
        pytest.skip(f"{kind} is not in the installed transformers")
    model = families.build(families.tiny_config(kind, output_router_logits=True), "meta")
    with pytest.raises(ConfigError, match="output_router_logits=True: .* computes no load-balancing loss"):
        apply_context_parallel(model, _fake_mesh(2, 2, 0))
    model = apply_context_parallel(families.build(families.tiny_config(kind), "meta"), _fake_mesh(2, 2, 0))
    with pytest.raises(ConfigError, match="output_router_logits=True: .* computes no load-balancing loss"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), output_router_logits=True)  # before any collective


# one family of each shape in the default run (Mixtral-like, JetMoe's coefficient name, a Gated DeltaNet hybrid):
# the mechanism is one for all; the other families: slow
FAST = ("mixtral", "jetmoe", "qwen3_next")
# Gated DeltaNet hybrids: transformers' fp32 chunked kernel rounds the decay gate's gradient differently on other
# chunk boundaries (test_model_families: gradients within 2e-4)
GDN = ("qwen3_next", "qwen3_5_moe_text", "lara_mini")
RUNS = [((2, 2), False), ((1, 4), False), ((2, 2), True), ((1, 4), True)]
IDS = [f"u{m[0]}r{m[1]}-{'packed' if p else 'dense'}" for m, p in RUNS]


def _check(pool, mesh, packed, kinds):
    # one pool task: the families split over the pool's replicas of the mesh (minutes each on a loaded 2-core machine)
    rows = pool.run(moe_cases.aux_parity, timeout=900 * len(kinds), u=mesh[0], r=mesh[1], kinds=kinds, packed=packed)
    assert_every_case_ran(rows, kinds, mesh[0] * mesh[1])
    for rank, row in enumerate(rows):
        for kind, errors in row.items():
            assert not errors["missing"], (kind, errors)
            assert errors["loss"] <= TOL and errors["aux"] <= TOL, (kind, rank, errors)
            assert errors["grad"] <= (20 if kind in GDN else 10) * TOL, (kind, rank, errors)


@pytest.mark.parametrize("mesh,packed", RUNS, ids=IDS)
def test_aux_loss_matches_single_process(pool, mesh, packed):
    """One step, `model(**shard, output_router_logits=True).loss` against the single-process loss (cross entropy +
    aux): dense right-padded rows against the model on the whole batch, the packed row against each document on its
    own for attention and the whole row's tokens for the router statistics (transformers' one-process count)."""
    _check(pool, mesh, packed, _installed(FAST))


@pytest.mark.slow  # 18 more families x 4 runs: minutes on 2 cores; the fast test covers each shape of family
@pytest.mark.parametrize("mesh,packed", RUNS, ids=IDS)
def test_aux_loss_matches_single_process_every_family(pool, mesh, packed):
    _check(pool, mesh, packed, _installed(sorted(set(AUX_FAMILIES) - set(FAST))))
