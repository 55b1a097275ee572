"""The short version of benchmarks/soak.py: training with a new packed layout every step keeps the engine's caches
within their bounds and the process groups and threads flat, and the losses equal a shorter run's."""

from __future__ import annotations

import os

import pytest
import soak

from hybrid_cp.testing import WorkerPool

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the bound of each cache or record (its lru_cache maxsize or its cap in the code)
BOUNDS = {
    "layout perms": 8,
    "ring plans": 16,
    "head maps": 64,
    "topology layouts": 256,
    "shard records (packed)": 64,
    "validation history": 1024,
    "validation fields": 64,
    "shard records (dense)": 0,
}


def test_soak_short():
    with WorkerPool(4, extra_paths=[os.path.join(ROOT, "benchmarks")]) as pool:
        short = pool.run(soak.run_rank, steps=4, every=4, timeout=600)
        long = pool.run(soak.run_rank, steps=10, every=5, timeout=600)
    for res, ref in zip(long, short):
        assert res["losses"][:4] == ref["losses"]  # bitwise: nothing carried over between runs or steps
        first, *_, last = res["samples"]
        assert first["groups"] == last["groups"] and first["threads"] == last["threads"], res["samples"]
        for s in res["samples"]:
            for key, bound in BOUNDS.items():
                assert s[key] <= bound, (key, s)
        assert last["layout perms"] == BOUNDS["layout perms"]  # full by step 5: new layouts evict old ones


def test_shard_records_and_validation_fields_are_bounded():
    """The provenance record keeps the recent packed rows only; validation remembers few signatures' fields."""
    from hybrid_cp.engine.agreement import ValidationHistory, _remember
    from hybrid_cp.engine.layout import _RECORDS, record_packed, row_layout
    from hybrid_cp.testing import mesh_description

    cp = mesh_description(2, 2)
    for n in range(8, 400):
        record_packed(cp, row_layout(cp, cu_seqlens=[0, 3, n]))
    assert len(_RECORDS[cp].packed) == BOUNDS["shard records (packed)"]
    hist = ValidationHistory()
    for h in range(1, 500):
        _remember(hist, h, (("causal", h),))
    assert len(hist.fields) == BOUNDS["validation fields"]
