"""The suite's numeric tolerance checks, in one place so that every figure compared can be recorded.

A tolerance is only as good as its margin over the worst value the check has seen (CONTRIBUTING.md:
at least 3x, with the reason for the bound next to it). `within` asserts one figure against its bound;
when the environment variable HCP_RECORD_TOLERANCES names a file, it also appends one JSON line
{test, label, value, bound} to it, and `python benchmarks/tolerance_margins.py FILE...` prints the
worst value of every check over the recorded runs, its bound and the margin.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import torch

RECORD_ENV = "HCP_RECORD_TOLERANCES"


def _current_test() -> str:
    """pytest's id of the running test (`tests/test_x.py::test_y[case]`), or '?' outside pytest."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]


def within(value: float, bound: float, label: str, detail: object = None) -> None:
    """Assert value <= bound (a NaN fails), recording the pair when HCP_RECORD_TOLERANCES names a file.

    Args:
        value: the measured figure (an error, a ratio).
        bound: the tolerance it must not exceed.
        label: what was compared, with the rank/case/tensor where the test loops, so that the same check
            has the same label in every run.
        detail: shown when the check fails (the whole row of figures, the case), never recorded.
    """
    value, bound = float(value), float(bound)
    path = os.environ.get(RECORD_ENV)
    if path:
        line = {
            "test": _current_test(),
            "label": label,
            "value": value if math.isfinite(value) else str(value),
            "bound": bound,
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    assert value <= bound, f"{label}: {value:.3e} exceeds the tolerance {bound:.3e}" + (
        f" ({detail})" if detail else ""
    )


def all_within(values: Mapping[str, float], bound: float, label: str = "", detail: object = None) -> None:
    """`within` for each entry of a dict of figures (e.g. {'out': .., 'dq': ..}), labelled 'label key'."""
    for key, value in values.items():
        within(value, bound, f"{label} {key}".strip(), detail)


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-300) -> float:
    """max |got - want| / max(max |want|, floor) in fp64 (the suite's usual figure; 0 for two zero tensors)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def relative_difference(got: float, want: float, floor: float = 1e-300) -> float:
    """|got - want| / max(|want|, floor) of two numbers (0 when equal): `<= rel` is pytest.approx(want, rel=rel)
    with abs=rel * floor."""
    return 0.0 if got == want else abs(got - want) / max(abs(want), floor)


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in fp64."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return (got - want).abs().max().item()


def allclose_ratio(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """max |got - want| / (atol + rtol |want|): <= 1 exactly when torch.allclose(got, want, rtol, atol) holds
    (equal entries, infinities included, count as 0; a NaN fails)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    diff = torch.where(got == want, 0.0, (got - want).abs())
    return (diff / (atol + rtol * want.abs())).max().item()
