"""More layer kinds on the linear-recurrence mechanism (docs/linear.md, "More layer kinds"): LFM2's gated short
convolution (the halo only), Jamba's Mamba-1 selective scan (a diagonal decay per channel and state) and
MiniMax's lightning attention (a fixed decay per head) under context parallelism equal the single-device
computation over the full sequence (each document on its own for packed rows): forward and the gradient of
every input and parameter, zigzag and contiguous, dense and packed rows; bytes equal the cost model."""

import linear_more_cases
import pytest
from tolerance import within

MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4)]
# a length-1 document, documents shorter than the cp degree, a long one among short ones
DOCS = (1, 3, 19, 2, 1, 7)
NAMES = {
    "conv": ("out", "dB", "dC", "dx", "dw", "dbias"),
    "mamba": ("out", "dx", "ddt", "dB", "dC", "dconv_w", "dconv_b", "dA", "dD", "ddt_bias"),
    "lightning": ("out", "dq", "dk", "dv"),
}
# fp64 round-off of chained decays and state carries against the full-sequence fp64 run: worst 1.4e-15 (lightning dv)
FP64 = 1e-10
# transformers' torch selective scan and the lightning kind's block-wise kernel in fp32: worst 4.6e-7 (Mamba-1
# d(dt_bias)), 22x
FP32 = 1e-5


def _check_cases(pool, u: int, r: int, cases: list, tol: float) -> None:
    for rank, rank_rows in enumerate(pool.run(linear_more_cases.kinds_parity, u=u, r=r, cases=cases)):
        for i, (case, row) in enumerate(zip(cases, rank_rows)):
            for kind, result in row.items():
                sent, predicted = result["bytes"]
                assert sent == predicted, (u, r, case, kind, sent, predicted)  # stage by stage
                assert len(result["errors"]) == len(NAMES[kind]), (kind, result)
                for name, err in zip(NAMES[kind], result["errors"]):
                    within(err, tol, f"rank {rank} case {i} {kind} {name}", (u, r, case))


@pytest.mark.parametrize("u,r", MESHES)
def test_more_kinds_fp64_exact(pool, u, r):
    cases = [(layout, docs, "fp64") for layout in ("zigzag", "contiguous") for docs in (None, DOCS)]
    _check_cases(pool, u, r, cases, FP64)


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4)])
def test_more_kinds_fp32_kernels(pool, u, r):
    # transformers' torch selective scan (Jamba) and the lightning kind's block-wise kernel, in fp32
    cases = [("zigzag", None, "fp32"), ("zigzag", DOCS, "fp32"), ("contiguous", DOCS, "fp32")]
    _check_cases(pool, u, r, cases, FP32)
