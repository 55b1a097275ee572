"""Every rope type of transformers' `ROPE_INIT_FUNCTIONS` trains exactly under context parallelism: loss and
every gradient against one process in fp64, on zigzag and contiguous dense rows (a shard below the dynamic
types' threshold while the row is past it) and on packed rows (each document as if trained alone); the row
extents the rotaries cannot be given are refused by name."""

from __future__ import annotations

import types

import pytest
import rope_cases
import torch

pytest.importorskip("transformers")

from rope_cases import ROPE_TYPES, rope_model  # noqa: E402
from tolerance import within  # noqa: E402

from hybrid_cp.errors import ConfigError  # noqa: E402
from hybrid_cp.integrations.rope import RowExtent, route_rotaries, row_extent  # noqa: E402
from hybrid_cp.testing import mesh_description  # noqa: E402
from hybrid_cp.testing.parity import assert_every_case_ran  # noqa: E402
from hybrid_cp.training.batch import shard_batch  # noqa: E402

# fp64 on both sides: the worst values seen in 3 runs are 3.2e-16 (loss) and 1.9e-15 (gradients); unrouted,
# the dynamic types move gradients by 1e-2 (longrope) to 4e-1 (dynamic NTK)
TOL = 1e-12
EXTENT_TYPES = ("dynamic", "longrope")


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)], ids=lambda m: f"u{m[0]}r{m[1]}")
def test_every_rope_type_matches_single_process(pool, mesh):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) <= set(ROPE_TYPES), set(ROPE_INIT_FUNCTIONS) - set(ROPE_TYPES)
    layouts = ("zigzag", "contiguous", "packed") if mesh == (2, 2) else ("zigzag", "packed")
    tables = pool.run(rope_cases.rope_table, u=mesh[0], r=mesh[1], layouts=layouts)
    assert_every_case_ran(tables, [(t, layout) for t in ROPE_TYPES for layout in layouts], mesh[0] * mesh[1])
    for rank, table in enumerate(tables):
        for (rope_type, layout), errors in table.items():
            within(errors["loss"], TOL, f"rank {rank} {rope_type} {layout} loss", errors)
            within(errors["grad"], TOL, f"rank {rank} {rope_type} {layout} grad", errors)


def test_the_rows_would_catch_a_shard_local_extent(pool):
    """The control: the same rows with every rotary seeing its own shard only are far off (some rank's shard,
    or some document, stays below the threshold the row crosses)."""
    rows = pool.run(rope_cases.rope_table, u=2, r=2, rope_types=EXTENT_TYPES, routed=False)
    pairs = [(t, layout) for t in EXTENT_TYPES for layout in ("zigzag", "contiguous", "packed")]
    assert_every_case_ran(rows, pairs, 4)
    for pair in pairs:
        assert max(row[pair]["grad"] for row in rows if pair in row) > 1e-3, pair


def test_an_ambiguous_dense_length_is_refused_for_an_extent_dependent_rope():
    """Lengths 97 and 100 both pad to 104 on zigzag (2, 2): which one the row has cannot be told from the
    shard, and a dynamic rope's frequencies depend on it."""
    cp = mesh_description(2, 2)
    for n in (97, 100):
        shard_batch({"input_ids": torch.zeros(1, n, dtype=torch.long)}, cp)
    call = {"input_ids": torch.zeros(1, 26, dtype=torch.long), "position_ids": torch.arange(26)[None]}
    with pytest.raises(ConfigError, match=r"ambiguous.*\[97, 100\].*multiple of 8"):
        row_extent(cp, call)


def test_multi_axis_position_ids_are_refused_for_an_extent_dependent_rope():
    model = rope_model("dynamic")
    holder = types.SimpleNamespace(row=RowExtent(4, ((torch.tensor(8), None),)))
    assert route_rotaries(model, holder) == 1
    x = torch.zeros(1, 4, 16, dtype=torch.float64)
    model.model.rotary_emb(x, torch.arange(4)[None])  # this rank's [batch, 4] positions: accepted
    with pytest.raises(ConfigError, match="LlamaRotaryEmbedding.*position_ids of shape"):
        model.model.rotary_emb(x, torch.arange(4).expand(3, 1, 4))


def _print_rope_table() -> None:
    """The table in benchmarks/results/rope_types.md: every rope type's loss and worst gradient against one process
    (fp64), next to every rotary left to its own shard (before the fix) and transformers' own packed row."""
    import os

    from hybrid_cp.testing import WorkerPool

    here = os.path.dirname(os.path.abspath(__file__))

    with WorkerPool(4, extra_paths=[here]) as pool:
        fixed = pool.run(rope_cases.rope_table, u=2, r=2, stock=True)
        before = pool.run(rope_cases.rope_table, u=2, r=2, routed=False)
    print(
        "| rope type | layout | loss rel. diff | worst gradient rel. diff | before the fix (worst gradient) "
        "| transformers' packed row vs per document |"
    )
    print("|---|---|---|---|---|---|")
    for key in fixed[0]:
        worst = {k: max(row[key][k] for row in fixed) for k in ("loss", "grad")}
        old = max(row[key]["grad"] for row in before)
        stock = fixed[0][key].get("stock_row")
        print(
            f"| {key[0]} | {key[1]} | {worst['loss']:.1e} | {worst['grad']:.1e} | {old:.1e} | "
            f"{'' if stock is None else f'{stock:.1e}'} |"
        )


if __name__ == "__main__":  # the figures the tests above bound (about a minute on 2 cores)
    _print_rope_table()
