"""The cost model knows sliding-window layers: skipped blocks, halo traffic, mixed layer types."""

import pytest
from tolerance import relative_difference, within

import topology
from hybrid_cp.cli.plan import main
from topology.layouts import make_layout
from topology.memory import memory_ladder

# Model predictions compared with `within(relative_difference(...))`: the same closed form evaluated two ways,
# so fp64 round-off only (rel 1e-12, 1e-9, or pytest.approx's 1e-6): worst 5.1e-16 (at 1e-12), 2.2e-16 (at 1e-9)


def _model(**kw) -> topology.ModelShape:
    return topology.ModelShape(**{**topology.ModelShape.preset("llama3-8b").model_dump(), **kw})


def test_window_layers_cost_less_compute_and_traffic():
    cluster = topology.Cluster.preset("dgx-h100", nodes=4)
    full = topology.estimate(cluster, _model(), 1 << 18, 8, 4)
    win = topology.estimate(cluster, _model(sliding_window=4096), 1 << 18, 8, 4)
    assert win.attention_s < 0.1 * full.attention_s
    assert win.bytes_per_rank["ring_fwd"] < 0.1 * full.bytes_per_rank["ring_fwd"]
    assert (
        win.bytes_per_rank["ring_fwd"]
        == topology.comm_bytes(32, 8, 128, 1 << 18, 1, 8, 4, 2, causal=True, window=4096)["ring_fwd"]
    )
    assert win.time_s < full.time_s
    # the attention work priced is the busiest rank's, counted from the engine's own plan
    lay = make_layout("zigzag", 8, 4, seq_len=1 << 18)
    share = max(map(sum, lay.work(True, 4096))) / max(map(sum, lay.work(True)))
    within(relative_difference(win.attention_s, full.attention_s * share), 1e-9, "win.attention_s")


def test_window_longer_than_the_sequence_is_full_attention():
    cluster = topology.Cluster.preset("dgx-h100", nodes=1)
    full = topology.estimate(cluster, _model(), 8192, 8, 1)
    wide = topology.estimate(cluster, _model(sliding_window=8192), 8192, 8, 1)
    assert wide.time_s == full.time_s and wide.bytes_per_rank == full.bytes_per_rank


def test_mixed_layers_are_the_weighted_average():
    cluster = topology.Cluster.preset("dgx-h100", nodes=2)
    full = topology.estimate(cluster, _model(), 1 << 17, 8, 2)
    win = topology.estimate(cluster, _model(sliding_window=1024), 1 << 17, 8, 2)
    mixed = topology.estimate(cluster, _model(sliding_window=1024, window_layers=24), 1 << 17, 8, 2)
    within(relative_difference(mixed.time_s, 0.75 * win.time_s + 0.25 * full.time_s), 1e-9, "mixed.time_s")
    assert any("24 of 32 layers" in n for n in mixed.notes)


def test_plan_for_a_windowed_model_is_not_the_full_attention_plan():
    cluster = topology.Cluster.preset("dgx-h100", nodes=4)
    ladder = memory_ladder()  # the CLI's: plain checkpointing's full [tokens, vocab] logits do not fit 1M on 32
    full = topology.plan(cluster, _model(), seq_len=1 << 20, dp=1, ladder=ladder).best
    win = topology.plan(cluster, _model(sliding_window=4096), seq_len=1 << 20, dp=1, ladder=ladder).best
    assert win.estimate.time_s < 0.2 * full.estimate.time_s
    assert main(
        [
            "--preset",
            "dgx-h100",
            "--nodes",
            "4",
            "--model",
            "llama3-8b",
            "--seq-len",
            "1M",
            "--dp",
            "1",
            "--sliding-window",
            "4K",
            "--window-layers",
            "24",
            "--top",
            "1",
            "--json",
        ]
    ) in (0, None)


def test_window_layers_cannot_exceed_layers():
    with pytest.raises(ValueError, match="window_layers"):
        _model(sliding_window=128, window_layers=40)
