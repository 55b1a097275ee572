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
        assert p.estimate.memory_bytes <= 0.9 * 80e9
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
    assert all(p.estimate.memory_bytes <= 40e9 for p in plans)
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
