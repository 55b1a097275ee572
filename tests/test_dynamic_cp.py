"""Dynamic context-parallel degrees on the 4-rank pool: a family of meshes, the schedule's digest check, and
training on mixed degrees 1/2/4 equal to one process on the same global batch."""

from __future__ import annotations

import dynamic_cases
import pytest
from tolerance import within


def test_family_of_meshes_on_aligned_blocks_and_refusals(pool):
    for rank, res in enumerate(pool.run(dynamic_cases.family_shape)):
        refused = res.pop("head_chunks")  # module-level head chunks cut heads for the patch-time mesh's ulysses
        assert "module chunks" in refused and "chunk_projections=False" in refused, refused
        assert res.pop("engine_head_chunks") == "no error" and res.pop("attention_chunks") == "no error"
        # every routed mixer is verified below (fp64 on the schedule's groups, a tiny family on mixed degrees), so
        # no model is refused for its mixers any more: module-level head chunks are the only refusal left to test
        assert res.pop("gated_delta") == "no error" and res.pop("short_conv") == "no error", res
        assert sorted(res) == [1, 2, 4]
        assert res[2]["split"] == (1, 2) and res[4]["split"] == (2, 2)
        for k, m in res.items():
            assert m["block"] == rank // k and m["cp_rank"] == rank % k  # cp groups are aligned blocks
            assert m["shared_world"]


@pytest.mark.parametrize(
    "checkpoint,fsdp,flat_cost,kind,head_chunks",
    [
        (False, False, False, "llama", 1),
        (True, False, False, "llama", 2),
        (False, True, True, "llama", 1),
        (False, False, False, "gemma3", 1),
        (False, False, False, "llama4_text", 1),
        (False, False, False, "bamba", 1),
    ],
    ids=[
        "plain",
        "checkpointed-head-chunks",
        "fsdp2-with-idle-ranks",
        "gemma3-sliding-windows",
        "llama4-chunked-layers",
        "bamba-mamba2-hybrid",
    ],
)
def test_mixed_degrees_train_like_one_process(pool, checkpoint, fsdp, flat_cost, kind, head_chunks):
    rows = pool.run(
        dynamic_cases.dynamic_training,
        checkpoint=checkpoint,
        fsdp=fsdp,
        flat_cost=flat_cost,
        kind=kind,
        head_chunks=head_chunks,
    )
    for rank, res in enumerate(rows):
        assert all(len(d) >= 2 and 4 in d for d in res["degrees"]), res  # really mixed degrees
        # fp32: reduction order only. Worst seen: loss 1.4e-7 (bamba), gradient 2.9e-5 (bamba's Mamba2 in_proj: its
        # chunked scan sums a document's chunks in another order when the document sits on 1, 2 or 4 ranks; the
        # attention-only models 2.7e-6, gemma3), one run each of llama4 (5.7e-7), head chunks (4.7e-7), bamba
        within(max(res["loss"]), 1e-5, f"rank {rank} loss", res)
        within(max(res["grad"]), 1e-4, f"rank {rank} grad", res)
    assert (sum(res["idle"] for res in rows) > 0) == flat_cost  # placeholders ran where ranks were idle


# fp64 round-off of each routed mixer's token-mixing core against one device on every group of the schedule, the
# fixed meshes' bound (test_recurrence.py). Worst seen: Gated DeltaNet 7.4e-16 (d conv weight, degree 4), Kimi Delta
# Attention 5.1e-16 (dg), LFM2's short convolution 4.7e-16 (dw), Mamba-1 1.1e-15 (d dt_bias), lightning 1.8e-15 (out)
MIXER_FP64 = 1e-10


@pytest.mark.parametrize("mixer", dynamic_cases.MIXERS)
def test_mixer_exact_on_the_schedules_groups_fp64(pool, mixer):
    """Each rank's micro-batch groups of a dynamic schedule (degrees 1, 2, 4: one long document on 4 ranks, packed
    rows of short ones on 1 and 2, documents shorter than their group and starting mid-row): the mixer's
    recurrence and convolution in fp64 equal one device, forward and every input's gradient."""
    for rank, res in enumerate(pool.run(dynamic_cases.mixer_on_groups, mixer=mixer)):
        assert not res["bytes_off"], res["bytes_off"]  # the bytes sent are the cost model's, case by case
        assert sorted(res["worst"]) == [1, 2, 4], res
        for degree, errs in res["worst"].items():
            for name, err in errs.items():
                within(err, MIXER_FP64, f"rank {rank} degree {degree} {name}")


# Gated DeltaNet in fp32: transformers' chunked kernel computes in fp32 and rounds per 64-token chunk, and a document
# cut into pieces on 2 or 4 ranks is chunked at other points than on one device. With every fp32 cast made fp64
# (kernel, norms, loss) the same two steps on mixed degrees equal one process to 1.9e-13 (gradients), so what is
# left is round-off, which this tiny model (initializer_range 0.2) amplifies: one process in fp32 differs from
# itself in fp64 by 1.8e-5 on the first step, as much as the mixed degrees from one process. Without `resync` (the
# model takes the reference's parameters after each step) two fp32 trajectories through SGD at lr 0.5 drift apart:
# up to 6.7e-3 on the second step over 5 seeds (in fp64 the drift takes 1.6e-14 to 1.9e-13 too). Worst seen with
# resync, 8 data/model seeds x 2 steps, deterministic over 3 runs: Qwen3.5 6.3e-5 (dt_bias), Qwen3-Next 5.2e-5
# (A_log); this case 1.8e-5. 3.2x the worst:
GDN_GRAD = 2e-4
# The other routed mixers, the same 8 data/model seeds x 2 steps with resync (seed 0 deterministic over 3 runs); each
# bound 3x its worst. Made fp64 (every fp32 cast kept fp64 as for Gated DeltaNet above, the MoE experts' eager loop,
# MiniMax's decay buffers recomputed in fp64) mixed degrees equal one process to 9e-13 (LFM2's second step), 3.2e-14
# (Jamba), 1.1e-14 (Kimi Linear), 5.1e-15 (MiniMax), 2 seeds each, so these are fp32 round-off:
# - LFM2 (short convolution, then attention): first step 8.2e-7, second 1.6e-4 (seed 7; this case 6.4e-5), in the
#   attention layer (its q/k layernorm weights, once k_proj) after the tiny model's SGD step at lr 0.5, not in the
#   conv (in fp64 too the second step amplifies round-off ~1000x: 1e-15 then 9e-13);
SHORT_CONV_GRAD = 5e-4
# - Jamba (Mamba-1 mixer, its decoder layer routed to pass the row's boundaries): 8.2e-6 (x_proj, D);
MAMBA_GRAD = 2.5e-5
# - Kimi Linear (Kimi Delta Attention next to MLA, MoE): 7.6e-6 (the forget gate's A_log);
KDA_GRAD = 2.5e-5
# - MiniMax (lightning attention next to attention, MoE): 3.3e-6.
LIGHTNING_GRAD = 1e-5


@pytest.mark.parametrize(
    "kind,bound",
    [
        ("qwen3_5_text", GDN_GRAD),
        ("lfm2", SHORT_CONV_GRAD),
        ("jamba", MAMBA_GRAD),
        ("kimi_linear", KDA_GRAD),
        ("minimax", LIGHTNING_GRAD),
    ],
    ids=["qwen3_5-gated-delta", "lfm2-short-conv", "jamba-mamba1", "kimi-linear-kda", "minimax-lightning"],
)
def test_routed_mixers_mixed_degrees_train_like_one_process(pool, kind, bound):
    """A tiny hybrid family (one routed mixer layer next to an attention layer) on mixed degrees 1/2/4 vs one
    process, each step at the reference's parameters (`resync`)."""
    for rank, res in enumerate(pool.run(dynamic_cases.dynamic_training, kind=kind, resync=True)):
        assert all(d == [1, 2, 4] for d in res["degrees"]), res  # really mixed degrees
        within(max(res["loss"]), 1e-5, f"rank {rank} loss", res)
        within(max(res["grad"]), bound, f"rank {rank} grad", res)


def test_a_rank_with_another_batch_raises_on_every_rank(pool):
    for res in pool.run(dynamic_cases.disagreeing_batch, timeout=120):
        assert res["error"].startswith("InconsistentRanksError"), res


@pytest.mark.parametrize("kind,fsdp", [("llama", False), ("bamba", True)], ids=["llama", "bamba-fsdp2"])
def test_eight_ranks_degrees_1_2_4_8_train_like_one_process(pool8, kind, fsdp):
    """The session's 8-rank pool: degrees 1/2/4/8 (splits 1x1, 1x2, 2x2, 2x4) in one step; a tiny Llama, and
    Bamba (Mamba2 layers next to attention) sharded by FSDP2 over the world."""
    rows = pool8.run(dynamic_cases.dynamic_training, eight=True, kind=kind, fsdp=fsdp)
    for rank, res in enumerate(rows):
        assert all(8 in d and 1 in d for d in res["degrees"]), res
        within(max(res["loss"]), 1e-5, f"rank {rank} loss", res)  # fp32 reduction order only
        within(max(res["grad"]), 1e-4, f"rank {rank} grad", res)
