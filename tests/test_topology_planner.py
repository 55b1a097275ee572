"""Planner: enumeration, feasibility, ranking, explain table."""

import json

import pytest

from topology import Cluster, ModelShape, PlanError, plan

LLAMA = ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)


def test_plans_are_valid_and_ranked_by_throughput():
    c = Cluster.preset("dgx-h100", nodes=4)
    plans = plan(c, LLAMA, 1 << 20)
    assert plans and plans.best is plans[0]
    keys = [p.estimate.time_s / p.dp for p in plans]
    assert keys == sorted(keys)
    for k, p in enumerate(plans, 1):
        assert p.rank == k
        assert all(isinstance(x, int) for x in (p.ulysses, p.ring, p.dp))
        assert p.ulysses * p.ring * p.dp == 32 and p.ulysses <= 32
        assert p.memory.peak <= 0.9 * 80e9
    # the best plan keeps ulysses inside a node, and nothing fits without CP at 1M tokens
    assert plans.best.ulysses <= 8 and not plans.best.notes
    assert any(r.ulysses * r.ring == 1 and "memory" in r.reason for r in plans.rejected)


def test_fixed_dp_puts_one_cp_group_over_all_gpus():
    c = Cluster.preset("dgx-h100", nodes=4)
    best = plan(c, LLAMA, 1 << 20, dp=1).best
    assert (best.ulysses, best.ring, best.dp) == (8, 4, 1)
    with pytest.raises(PlanError, match="dp=3"):
        plan(c, LLAMA, 1 << 20, dp=3)


def test_head_bound_and_crossing_groups_are_flagged():
    c = Cluster.preset("dgx-h100", nodes=2)
    small = ModelShape(heads=4, kv_heads=1, head_dim=64, layers=2)
    plans = plan(c, small, 1 << 16)
    assert all(p.ulysses <= 4 for p in plans)
    assert any("ulysses=8 > heads=4" in r.reason for r in plans.rejected)
    crossing = [p for p in plan(c, LLAMA, 1 << 17) if p.ulysses == 16]
    assert crossing and "cross the inter-node fabric" in crossing[0].notes[0]


def test_memory_budget_and_errors():
    c = Cluster.preset("dgx-h100", nodes=1)
    plans = plan(c, LLAMA, 1 << 18, memory_budget=40e9)
    assert all(p.memory.peak <= 40e9 for p in plans)
    with pytest.raises(PlanError, match="memory") as err:
        plan(c, LLAMA, 1 << 22, memory_budget=1e9)
    assert "raise memory_budget" in str(err.value)
    with pytest.raises(PlanError, match="world_size"):
        plan(c, LLAMA, 1 << 16, world_size=16)
    assert {p.world_size for p in plan(c, LLAMA, 1 << 16, world_size=4)} == {4}


def test_explain_and_json():
    plans = plan(Cluster.preset("dgx-h100", nodes=2), LLAMA, 1 << 18)
    table = plans.explain(top=3)
    assert "ms/layer" in table and "a2a" in table and "mem GiB" in table and "more feasible" in table
    assert "rejected" in table
    detail = plans.best.explain()
    assert "compute" in detail and "all-to-all" in detail and "memory per rank" in detail
    data = json.loads(json.dumps(plans.to_dict()))
    assert data["chosen"]["ulysses"] == plans.best.ulysses and len(data["plans"]) == len(plans)


def test_hybrid_beats_pure_ulysses_across_nodes():
    """On 4 DGX nodes a ulysses group of 32 pays the NIC for its all-to-all: u=8 x r=4 must win."""
    plans = plan(Cluster.preset("dgx-h100", nodes=4), LLAMA, 1 << 18, dp=1)
    order = [(p.ulysses, p.ring) for p in plans]
    assert order.index((8, 4)) < order.index((32, 1))


def test_plan_and_max_seq_share_one_memory_model():
    """`plan` checks a split with the step model `--max-seq` searches with: a plan's memory is `step_memory`'s
    peak for the options the split was checked with, and the longest sequence `max_seq_len` finds at a split is
    one `plan` (with the same ladder) accepts at that split, where the old per-layer sum refused 5M tokens on 8
    H100s for every split."""
    from topology.memory import first_fitting, max_seq_len, memory_ladder
    from topology.step_model import MemoryOptions, step_memory

    c = Cluster.preset("dgx-h100")
    llama = ModelShape.preset("llama3-8b")
    p = plan(c, llama, 1 << 16, dp=1).best
    assert (
        p.memory == step_memory(llama, 1 << 16, p.ulysses, p.ring, 1, 1, MemoryOptions())
        and p.options == MemoryOptions()
    )
    ladder = memory_ladder()
    plans = plan(c, llama, 5 << 20, memory_budget=80e9, ladder=ladder, host_memory=c.host_memory_per_gpu)
    assert plans and all(p.dp == 1 for p in plans)  # 5M tokens need all 8 GPUs in the CP group
    for p in plans:
        name, opt, mem = first_fitting(
            llama, 5 << 20, p.ulysses, p.ring, p.dp, 1, ladder, 80e9, host_memory=c.host_memory_per_gpu
        )
        assert p.memory == mem and p.options == opt and mem.peak <= 80e9 and f"memory options: {name}" in p.notes[0]
    best = max_seq_len(llama, 8, 80e9, ladder[-1][1], splits=[(8, 1)], host_memory=c.host_memory_per_gpu)
    at = plan(c, llama, best.seq_len, memory_budget=80e9, ladder=[ladder[-1]], host_memory=c.host_memory_per_gpu)
    assert any((p.ulysses, p.ring) == (8, 1) for p in at)
    too_long = plan(
        c,
        llama,
        best.seq_len + 1024 * 8,
        memory_budget=80e9,
        ladder=[ladder[-1]],
        host_memory=c.host_memory_per_gpu,
        dp=1,
    )
    assert all((p.ulysses, p.ring) != (8, 1) for p in too_long)
    with pytest.raises(PlanError, match="not both"):
        plan(c, llama, 1 << 16, options=MemoryOptions(), ladder=ladder)


def test_with_a_ladder_fewer_memory_options_rank_first():
    """Splits that fit on an earlier rung come first (the later rungs' recomputation and copies are not in the
    time model); within a rung, by throughput."""
    from topology.memory import memory_ladder

    c = Cluster.preset("dgx-h100", nodes=4)
    ladder = memory_ladder()
    plans = plan(c, LLAMA, 1 << 20, ladder=ladder)
    names = [n for n, _ in ladder]
    rungs = [names.index(p.notes[0].split("memory options: ")[1].split(" (")[0]) for p in plans]
    assert rungs == sorted(rungs) and rungs[0] == 0 and rungs[-1] > 0
    for k in set(rungs):
        keys = [p.estimate.time_s / p.dp for p, g in zip(plans, rungs) if g == k]
        assert keys == sorted(keys)
