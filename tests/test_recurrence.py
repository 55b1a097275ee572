"""Linear recurrences and causal short convolutions under context parallelism equal the single-device
computation over the full sequence (each document on its own for packed rows): forward and the
gradient of every input, on meshes up to 8 ranks, zigzag and contiguous, dense and packed rows."""

import linear_cases
import pytest
from tolerance import within

from hybrid_cp.engine.recurrence import scan_plan
from topology.layouts import layout_of
from topology.linear_cost import exporting_runs

MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (1, 8), (8, 1)]
# a length-1 document, documents shorter than the cp degree, a long one among short ones
DOCS = (1, 3, 19, 2, 1, 7)
# fp64 round-off of chained decays and state carries against the full-sequence fp64 run: worst 1.3e-15 (Mamba2 dA)
FP64 = 1e-10
# transformers' chunked torch kernels compute in fp32: worst 7.2e-7 (Mamba2 d(dt_bias), (4, 2)), 14x
FP32 = 1e-5


def _check(row, tol, what, label):
    sent, predicted = row.pop("bytes")
    assert sent == predicted, (what, sent, predicted)  # the counter equals the cost model, stage by stage
    for part, errs in row.items():
        for name, err in errs.items():
            within(err, tol, f"{label} {part} {name}", what)


def _check_cases(pool, task: str, u: int, r: int, cases: list, tol: float) -> None:
    for rank, rank_rows in enumerate(pool.run(getattr(linear_cases, task), u=u, r=r, cases=cases)):
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
        [(0, 8, False, True), (24, 8, True, False)],
        [(8, 16, True, True)],
    ]
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
                (tok, tok < 0 or pos > 0, n) for tok, pos, n in lay.document_runs(rank)
            ]
            assert all(
                a.tok < 0 or b.tok < 0 or a.tok + a.n != b.tok or not b.continues for a, b in zip(runs, runs[1:])
            )
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


@pytest.mark.parametrize("u,r", [(2, 2), (1, 8)])
def test_gated_delta_gather_path_fp64_exact(pool, u, r):
    # the all-gather, where the cost model picks it (forced here: the scan wins on these rows), stays exact
    cases = [(layout, docs, "naive", "gather") for layout in ("zigzag", "contiguous") for docs in (None, DOCS)]
    _check_cases(pool, "scan_parity", u, r, cases, FP64)


def _simulated_scan(lay, size):
    """The scan's rounds run on scalar affine maps s -> m s + e, with an M that did not travel unusable (None):
    {element: incoming state} of every continuing element, and the sequential composition to compare with."""
    import random

    from topology.summary_scan import summary_scan

    plan = summary_scan(lay, size)
    rng = random.Random(len(plan.elements))
    own = [(None if not c else rng.uniform(0.5, 1.5), rng.uniform(-1, 1)) for _, _, c in plan.elements]

    def then(late, early):  # late o early; a None M is zero (document start) or must not be used
        m = None if late[0] is None or early[0] is None else late[0] * early[0]
        return m, late[1] if late[0] is None else late[0] * early[1] + late[1]

    prefix = {}
    for transfers in plan.rounds:
        sent = [(i, then(own[j], prefix[j]) if j in prefix else own[j], m) for j, i, m in transfers]
        for i, (m, e), with_m in sent:
            window = (m if with_m else None, e)
            prefix[i] = then(prefix[i], window) if i in prefix else window
    want, state = {}, None
    for k, (_, _, cont) in enumerate(plan.elements):
        if cont:
            want[k] = state
        state = own[k][1] if own[k][0] is None else own[k][0] * state + own[k][1]
    return {k: prefix[k][1] for k in want}, want


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 16, 32])
def test_scan_plan_gives_every_continuing_run_its_state(layout, size):
    """Torch-free: the log-step scan's rounds (with the transfers and transitions it leaves out) give each
    continuing run the composition of everything before it in its document, dense and packed rows."""
    for docs in (None, [0, 1, 3, 20, 21, 40, 47, 53, 64], [0, 64], [0, 30, 31, 64]):
        lay = layout_of(layout, 1, size, seq_len=None if docs else 64, cu_seqlens=docs)
        got, want = _simulated_scan(lay, size)
        assert got.keys() == want.keys()
        for k in want:
            assert abs(got[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k])), (layout, size, docs, k)


def test_the_scan_moves_fewer_bytes_from_four_ranks_on():
    """Dense rows: the busiest rank's scan bytes (forward + backward) against the all-gather's, Qwen3-Next-80B's
    layer (32 value heads, dk = dv = 128): the rule picks the scan, and at P = 32 it moves under a fifth."""
    from topology.summary_scan import exchange_kind, gather_bytes, scan_bytes

    m = e = 32 * 128 * 128
    for layout in ("zigzag", "contiguous"):
        for size in (4, 8, 16, 32):
            lay = layout_of(layout, 1, size, seq_len=1024 * size)
            slots = exporting_runs(lay, size)
            scan = max(sum(scan_bytes(lay, size, r, m, e)) for r in range(size))
            assert exchange_kind(lay, size, slots, m, e) == "scan"
            assert scan < 2 * gather_bytes(size, slots, m, e) / (5 if size == 32 else 1), (layout, size)


_TABLE_DOCS = (1, 3, 19, 2, 1, 7)
_TABLE_MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (8, 1)]


def _print_parity_tables() -> None:
    """The tables in docs/linear.md: the recurrence and the causal conv under CP, and the hybrid models' step."""
    import os

    from hybrid_cp.testing import WorkerPool

    here = os.path.dirname(os.path.abspath(__file__))

    with WorkerPool(8, extra_paths=[here]) as pool:
        print("| mesh | layout | rows | kernel | gdn fwd | gdn bwd (worst of q,k,v,g,beta) | conv fwd | conv bwd |")
        print("|---|---|---|---|---|---|---|---|")
        for u, r in _TABLE_MESHES:
            cases = [
                (lay, docs, kern)
                for kern in ("naive", "hf")
                for lay in ("zigzag", "contiguous")
                for docs in (None, _TABLE_DOCS)
            ]
            rows = pool.run(linear_cases.scan_parity, u=u, r=r, cases=cases)
            for i, (lay, docs, kern) in enumerate(cases):
                worst = {
                    part: {k: max(row[i][part][k] for row in rows) for k in rows[0][i][part]}
                    for part in ("gdn", "conv")
                }
                g, c = worst["gdn"], worst["conv"]
                print(
                    f"| ({u},{r}) | {lay} | {'packed' if docs else 'dense'} | "
                    f"{'fp64 naive' if kern == 'naive' else 'fp32 transformers'} | {g['out']:.1e} | "
                    f"{max(v for k, v in g.items() if k != 'out'):.1e} | {c['out']:.1e} | "
                    f"{max(v for k, v in c.items() if k != 'out'):.1e} |"
                )
        print("\n| model | mesh | rows | logits | loss | worst gradient |")
        print("|---|---|---|---|---|---|")
        runs = [
            ("qwen3_next", u, r, f, False) for u, r, f in ((2, 2, False), (1, 4, False), (4, 1, False), (2, 2, True))
        ]
        runs += [
            ("qwen3_next", 2, 2, False, True),
            ("qwen3_5_text", 2, 2, False, False),
            ("qwen3_5_text", 2, 2, False, True),
        ]
        for kind, u, r, fsdp, packed in runs:
            if packed:
                rows = pool.run(linear_cases.hybrid_packed_parity, u=u, r=r, kind=kind)
            else:
                rows = pool.run(linear_cases.hybrid_parity, u=u, r=r, kind=kind, fsdp=fsdp)
            logits = "-" if packed else f"{max(x['logits'] for x in rows):.1e}"
            print(
                f"| {kind}{' FSDP2' if fsdp else ''} | ({u},{r}) | {'packed' if packed else 'dense, right-padded'} "
                f"| {logits} | {max(x['loss'] for x in rows):.1e} | {max(x['grad'] for x in rows):.1e} |"
            )


if __name__ == "__main__":  # the figures tests/test_recurrence.py and tests/test_hybrid_models.py bound
    _print_parity_tables()
