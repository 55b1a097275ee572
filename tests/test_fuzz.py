"""Fuzzing hcp.attention on the session pool: drawn meshes, shapes, dtypes, masks (causal, windows,
packed cu_seqlens) and deliberately wrong arguments (on every rank, or on one rank only). Every
call either matches the fp64 reference or raises a documented hcp.CPError on every rank of the cp
group; none hangs (the pool's timeout would fail the test)."""

from __future__ import annotations

import reliability_cases
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability_cases import FUZZ_LIMITS
from tolerance import within

import hybrid_cp.errors as errors

MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (2, 4), (8, 1), (1, 8)]
FAULTS = ["causal_flip", "bad_scale", "int_dtype", "kv_heads", "seq_len", "stride", "backend", "window_type"]
SEEN = {"calls": 0, "faults": 0, "exact": 0}


@st.composite
def cases(draw):
    u, r = draw(st.sampled_from(MESHES))
    h = draw(st.sampled_from([x for x in (2, 4, 6, 8) if x >= u]))
    hkv = draw(st.sampled_from([x for x in (1, 2, h) if h % x == 0]))
    packed = draw(st.booleans())
    lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4)) if packed else [draw(st.integers(1, 90))]
    causal = draw(st.booleans())
    window = (
        draw(st.one_of(st.none(), st.integers(1, 30)))
        if causal
        else draw(st.one_of(st.none(), st.lists(st.integers(0, 20), min_size=2, max_size=2)))
    )
    fault = draw(st.one_of(st.none(), st.tuples(st.sampled_from(FAULTS), st.integers(-1, u * r - 1))))
    if fault and fault[0] == "causal_flip" and fault[1] == -1:
        fault = ("causal_flip", 0)  # flipping causal on every rank is a valid call
    return dict(
        u=u,
        r=r,
        h=h,
        hkv=hkv,
        d=draw(st.sampled_from([8, 16])),
        lens=lens,
        packed=packed,
        causal=causal,
        window=window,
        dtype=draw(st.sampled_from(["fp64", "fp32", "bf16"])),
        fault=fault,
        seed=draw(st.integers(0, 1000)),
    )


# derandomize: CI sees the same 24 draws every run (a failure reproduces); change the seed to explore
@settings(
    max_examples=24,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cases())
@example(
    case={
        "u": 8,
        "r": 1,
        "h": 8,
        "hkv": 1,
        "d": 8,
        "lens": [1],
        "packed": False,
        "causal": False,
        "window": None,
        "dtype": "fp32",
        "fault": None,
        "seed": 0,
    }
)  # one token: dq is exactly 0
def test_every_call_is_exact_or_raises_a_documented_error_on_every_rank(pool8, case):
    results = pool8.run(reliability_cases.fuzz_case, c=case, timeout=120)
    size = case["u"] * case["r"]
    SEEN["calls"] += 1
    for group in range(len(results) // size):  # each cp group is judged on its own
        mine = results[group * size : (group + 1) * size]
        raised = [res["raised"] for res in mine]
        if case["fault"] is None:
            assert raised == [None] * size, (case, mine)
            for res in mine:  # the worst over the drawn cases of each dtype is recorded
                within(res["out"], FUZZ_LIMITS[case["dtype"]], f"{case['dtype']} out", (case, res))
                within(res["dq"], FUZZ_LIMITS[case["dtype"]], f"{case['dtype']} dq", (case, res))
            SEEN["exact"] += 1
        else:
            assert all(x is not None for x in raised), (case, mine)  # every rank raised
            assert all(x in errors.__all__ for x in raised), (case, mine)  # and a documented class
            SEEN["faults"] += 1
