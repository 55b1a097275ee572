"""Linear recurrences and causal short convolutions under context parallelism equal the single-device
computation over the full sequence (each document on its own for packed rows): forward and the
gradient of every input, on meshes up to 8 ranks, zigzag and contiguous, dense and packed rows."""

import pytest
from tolerance import within

from hybrid_cp.engine.recurrence import scan_plan
from topology.cost import exporting_runs
from topology.layouts import layout_of

MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (1, 8), (8, 1)]
# a length-1 document, documents shorter than the cp degree, a long one among short ones
DOCS = (1, 3, 19, 2, 1, 7)
# fp64 round-off of chained decays and state carries against the full-sequence fp64 run: worst 1.3e-15 (Mamba2 dA)
FP64 = 1e-10
# transformers' chunked torch kernels compute in fp32: worst 7.2e-7 (Mamba2 d(dt_bias), (4, 2)), 14x
FP32 = 1e-5


def _check(row, tol, what, label):
    sent, predicted = row.pop("bytes")
    assert sent == predicted, (what, sent, predicted)   # the counter equals the cost model, stage by stage
    for part, errs in row.items():
        for name, err in errs.items():
            within(err, tol, f"{label} {part} {name}", what)


def _check_cases(pool, task: str, u: int, r: int, cases: list, tol: float) -> None:
    for rank, rank_rows in enumerate(pool.run(f"linear_cases:{task}", u=u, r=r, cases=cases)):
        for i, (case, row) in enumerate(zip(cases, rank_rows)):
            _check(row, tol, (u, r, case), f"rank {rank} case {i}")


@pytest.mark.parametrize("u,r", MESHES)
def test_gated_delta_and_conv_fp64_exact(pool, u, r):
    cases = [(layout, docs, "naive") for layout in ("zigzag", "contiguous") for docs in (None, DOCS)]
    _check_cases(pool, "scan_parity", u, r, cases, FP64)


@pytest.mark.parametrize("u,r", [(2, 2), (4, 2), (1, 4)])
def test_gated_delta_transformers_kernel_fp32(pool, u, r):
    # transformers' chunked torch function computes in fp32 whatever the input dtype
    cases = [("zigzag", None, "hf"), ("zigzag", DOCS, "hf"), ("contiguous", DOCS, "hf")]
    _check_cases(pool, "scan_parity", u, r, cases, FP32)


def test_plan_resets_at_documents_and_chains_zigzag():
    plan = scan_plan(layout_of("zigzag", 2, 2, seq_len=32), 4)
    # zigzag: every chunk but the first continues; the last (ring rank 0's second chunk) exports nothing
    assert [run.continues for runs in plan.runs for run in runs] == [False, True] + [True] * 6
    assert sum(run.exports for runs in plan.runs for run in runs) == 7
    packed = scan_plan(layout_of("zigzag", 2, 2, cu_seqlens=[0, 1, 3, 20]), 4)
    for runs in packed.runs:
        for run in runs:
            assert run.tok < 0 or run.continues == (run.tok not in (0, 1, 3))


def test_plan_merges_adjacent_runs_of_one_document():
    # zigzag on a ring of 2: rank 1's chunks (tokens 8-15, 16-23) meet: one continuing run, one slot
    plan = scan_plan(layout_of("zigzag", 1, 2, seq_len=32), 2)
    assert [[(run.tok, run.n, run.continues, run.exports) for run in runs] for runs in plan.runs] == [
        [(0, 8, False, True), (24, 8, True, False)], [(8, 16, True, True)]]
    assert plan.slots == 1 and plan.order == ((0, 0), (1, 0))
    # one rank: both zigzag chunks are one document, nothing continues, nothing is gathered
    one = scan_plan(layout_of("zigzag", 1, 1, seq_len=32), 1)
    assert [(run.tok, run.n, run.continues) for run in one.runs[0]] == [(0, 32, False)] and one.slots == 0


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("u,r", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (1, 8)])
def test_plan_agrees_with_the_cost_model(layout, u, r):
    """The engine's runs are `Layout.document_runs` (continuing runs, slots: bytes and FLOPs)."""
    for docs in (None, [0, 1, 3, 20, 21, 40, 47, 53, 64]):
        lay = layout_of(layout, u, r, seq_len=None if docs else 64, cu_seqlens=docs)
        plan = scan_plan(lay, u * r)
        for rank, runs in enumerate(plan.runs):
            assert [(run.tok, run.tok < 0 or run.continues, run.n) for run in runs] == [
                (tok, tok < 0 or pos > 0, n) for tok, pos, n in lay.document_runs(rank)]
            assert all(a.tok < 0 or b.tok < 0 or a.tok + a.n != b.tok or not b.continues for a, b in zip(runs, runs[1:]))
        assert plan.slots == exporting_runs(lay, u * r)


@pytest.mark.parametrize("u,r", MESHES)
def test_mamba2_ssd_fp64_exact(pool, u, r):
    # Mamba2's core (conv -> silu -> SSD) with every input's and parameter's gradient, bytes = cost model
    cases = [(layout, docs, "naive") for layout in ("zigzag", "contiguous") for docs in (None, DOCS)]
    _check_cases(pool, "mamba_parity", u, r, cases, FP64)


@pytest.mark.parametrize("u,r", [(2, 2), (4, 2), (1, 4)])
def test_mamba2_transformers_kernel_fp32(pool, u, r):
    # transformers' torch chunked SSD (mamba2_chunk_scan, chunks of 8 tokens) computes in fp32
    cases = [("zigzag", None, "hf"), ("zigzag", DOCS, "hf"), ("contiguous", DOCS, "hf")]
    _check_cases(pool, "mamba_parity", u, r, cases, FP32)
