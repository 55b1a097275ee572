"""docs/errors.md is the error catalogue: every example in it runs here and raises its class on
every rank, and every error class has an example (the doc and the test cannot drift)."""

from __future__ import annotations

import pathlib
import re

import pytest
import reliability_cases
import torch
import torch.distributed as dist

import hybrid_cp as hcp
import hybrid_cp.errors as errors

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def examples() -> list[dict]:
    """The ```python raises=Name [own=Name] [local|faults] blocks of docs/errors.md."""
    out = []
    for m in re.finditer(r"```python raises=(\w+)([^\n]*)\n(.*?)```", DOC.read_text(), re.S):
        flags = m.group(2).split()
        own = [f.split("=", 1)[1] for f in flags if f.startswith("own=")]
        out.append(
            {
                "name": m.group(1),
                "own": own[0] if own else None,
                "code": m.group(3),
                "where": "local" if "local" in flags else "faults" if "faults" in flags else "pool",
            }
        )
    return out


def test_every_error_class_is_documented_with_an_example():
    classes = {n for n in errors.__all__ if n != "CPError"}
    assert classes <= {e["name"] for e in examples()}, classes - {e["name"] for e in examples()}
    assert set(errors.__all__) <= set(hcp.__all__)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CPError)
        assert f"`hcp.{name}`" in DOC.read_text(), name


def test_error_classes_keep_builtin_bases():
    assert issubclass(hcp.ConfigError, ValueError) and issubclass(hcp.ShapeError, ValueError)
    assert issubclass(hcp.InputTypeError, TypeError) and issubclass(hcp.InconsistentRanksError, ValueError)
    assert issubclass(hcp.CommTimeoutError, RuntimeError) and issubclass(hcp.SetupError, RuntimeError)


def test_pool_examples_raise_their_class_on_every_rank(pool8):
    exs = [e for e in examples() if e["where"] == "pool"]
    assert len(exs) >= 10
    per_rank = pool8.run(reliability_cases.run_examples, examples=exs, timeout=120)
    for rank, results in enumerate(per_rank):
        for ex, res in zip(exs, results):
            assert res["raised"] is not None, f"{ex['name']} example raised nothing on rank {rank}:\n{ex['code']}"
            if res["raised"] == ex["own"]:
                continue  # the rank whose own input was bad raises its own error
            assert res["ok"], f"{ex['name']} example raised {res['raised']} on rank {rank}: {res['message']}"


def test_local_examples():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has a process group")
    for ex in (e for e in examples() if e["where"] == "local"):
        with pytest.raises(getattr(errors, ex["name"])):
            exec(compile(ex["code"], f"<errors.md: {ex['name']}>", "exec"), {"hcp": hcp, "torch": torch})


def test_fault_examples_are_covered_by_test_faults():
    text = (pathlib.Path(__file__).parent / "test_faults.py").read_text()
    for ex in (e for e in examples() if e["where"] == "faults"):
        assert ex["name"] in text


def test_timeouts_reach_every_group(pool):
    for res in pool.run(reliability_cases.group_timeouts, seconds=7.0, timeout=120):
        assert set(res["groups"].values()) == {7.0}, res
    for res in pool.run(reliability_cases.group_timeouts, seconds=None, timeout=120):
        assert set(res["groups"].values()) == {res["default"]}, res


def test_validation_modes_count_their_checks(pool):
    for res in pool.run(reliability_cases.validation_counts, u=2, r=2, steps=5, validate=True, timeout=120):
        assert res == {"hash": 1, "skipped": 4}, res
    for res in pool.run(reliability_cases.validation_counts, u=2, r=2, steps=5, validate="always", timeout=120):
        assert res == {"hash": 5}, res
    for res in pool.run(reliability_cases.validation_counts, u=2, r=2, steps=3, validate="debug", timeout=120):
        assert res == {"full": 3}, res


def _checks_per_step(steps: list[list[str]]) -> list[int]:
    """How many calls of each step validate=True checks, for a sequence of call signatures."""
    from types import SimpleNamespace

    from hybrid_cp.engine.agreement import _advance, _agreed, _predicted

    cp = SimpleNamespace(signatures=[], signature_period=None)
    out = []
    for step in steps:
        checks = 0
        for h in step:
            if h == _predicted(cp):
                _advance(cp, h)
            else:
                checks += 1
                _agreed(cp, h)
        out.append(checks)
    return out


def test_default_validation_learns_repeating_call_patterns():
    """A training loop is checked in its first step (and the first call of the second), whatever its
    pattern; packed rows (new signatures every step) cost a check per new signature."""
    assert _checks_per_step([["batch"] + ["layer"] * 8] * 5) == [2, 1, 0, 0, 0]
    assert _checks_per_step([["batch"] + ["full", "sliding"] * 4] * 5) == [5, 1, 0, 0, 0]
    recompute = ["full", "sliding"] * 4 + ["sliding", "full"] * 4  # checkpointing replays in reverse
    assert _checks_per_step([["batch"] + recompute] * 5) == [9, 1, 0, 0, 0]
    assert _checks_per_step([[f"batch{i}"] + [f"layer{i}"] * 8 for i in range(5)]) == [2] * 5
    assert _checks_per_step([["a", "b", "c"] * 400]) == [4]  # the first round, and "a" again once


def test_default_validation_on_real_calls(pool):
    for res in pool.run(reliability_cases.learned_validation, u=2, r=2, timeout=300):
        assert res["per_step"][0] == 5 and res["per_step"][2:] == [0, 0], res
        assert "causal" in res["first_call"], res


@pytest.mark.parametrize("tensor", ["q", "v"])
def test_debug_mode_names_the_nonfinite_rank_and_tensor(pool, tensor):
    msgs = pool.run(reliability_cases.nonfinite_debug, u=2, r=2, bad_rank=2, tensor=tensor, timeout=120)
    for rank, m in enumerate(msgs):
        if rank < 4:  # dp group 0 holds rank 2
            assert f"{tensor} on cp rank 2" in m, (rank, m)
        else:
            assert m == "no error", (rank, m)


def test_mesh_creation_logs_its_configuration_and_warns_about_slow_placements(pool8):
    per_rank = pool8.run(reliability_cases.mesh_logs, local_world_size=2, timeout=120)
    info = [m for level, m in per_rank[0] if level == "INFO" and "ulysses=4 ring=2" in m]
    assert len(info) == 1 and "ulysses=4 ring=2 dp=1 layout=zigzag backend=gloo device=cpu" in info[0], info
    assert all(not any("ulysses=4 ring=2" in m for _, m in records) for records in per_rank[1:])  # rank 0 only
    for records in per_rank:  # ulysses groups of 4 ranks with 2 ranks per node span two nodes
        warnings = [m for level, m in records if level == "WARNING"]
        assert any("spans nodes" in m for m in warnings), records
        assert any("padding is 7 of 16 tokens" in m for m in warnings), records
    quiet = pool8.run(reliability_cases.mesh_logs, local_world_size=8, timeout=120)
    assert not any("spans nodes" in m for records in quiet for _, m in records)
