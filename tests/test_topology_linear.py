"""The planner's linear layers of hybrid models: `hybrid-cp plan`'s linear flags, `hf.model_shape` of hybrid and
chunked configs (config objects only), and the memory model of a linear layer against an exactly measured step."""

import pytest

from hybrid_cp.cli.plan import main
from hybrid_cp.errors import ConfigError
from hybrid_cp.integrations.config_shape import model_shape
from hybrid_cp.testing.families import tiny_config
from topology.model_shape import ModelShape

PLAN = ["--preset", "dgx-h100", "--nodes", "4", "--seq-len", "128K", "--top", "1", "--dp", "1"]
QWEN3_NEXT = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=3,
)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4)


# ---- hybrid-cp plan --linear-* ---------------------------------------------------------------------------------------


def test_linear_flags_override_the_preset(capsys):
    assert main([*PLAN, "--model", "qwen3-next-80b", "--linear-layers", "24", "--linear-chunk", "128"]) == 0
    assert "24 of 48 layers attend in full, 24 of 48 layers are linear (gated_delta)" in capsys.readouterr().out
    assert main([*PLAN, "--model", "qwen3-next-80b", "--linear-layers", "0"]) == 0  # the preset's linear layers go
    out = capsys.readouterr().out
    assert "linear" not in out and "chosen: ulysses=" in out


def test_linear_flags_give_a_mamba2_hybrid(capsys):
    argv = [
        *PLAN,
        "--heads",
        "8",
        "--head-dim",
        "64",
        "--layers",
        "8",
        "--linear-layers",
        "6",
        "--linear-kind",
        "mamba2",
        "--linear-heads",
        "16",
        "--linear-key-heads",
        "1",
        "--linear-key-dim",
        "64",
        "--linear-value-dim",
        "32",
        "--linear-conv",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    import json

    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["linear_share"] == 0.75 and chosen["linear_s"] > 0 and "linear_state_fwd" in chosen["bytes_per_rank"]


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ["--model", "qwen3-next-80b", "--linear-heads", "30"],
            "--linear-heads=30 must be a multiple of --linear-key-heads=16",
        ),
        (["--model", "qwen3-next-80b", "--linear-layers", "60"], "--linear-layers=60 exceeds layers=48"),
        (
            ["--model", "qwen3-next-80b", "--linear-key-dim", "0"],
            "--linear-key-dim=0: Input should be greater than or equal to 1",
        ),
        (
            ["--heads", "8", "--head-dim", "64", "--linear-kind", "mamba2"],
            "--linear-kind='mamba2' with --linear-layers=0",
        ),
        (
            ["--heads", "8", "--head-dim", "64", "--linear-layers", "2", "--linear-kind", "mamba2"],
            "needs linear_heads, linear_key_heads, linear_key_dim, linear_value_dim",
        ),
    ],
)
def test_linear_flag_errors_name_the_flag(extra, match, capsys):
    assert main([*PLAN, *extra]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and "pydantic" not in err


def test_linear_kind_choices():
    with pytest.raises(SystemExit):
        main([*PLAN, "--model", "qwen3-next-80b", "--linear-kind", "mamba"])


# ---- hf.model_shape: the "auto" split's model ------------------------------------------------------------------------


def test_model_shape_reads_gated_deltanet_layers():
    want = dict(
        layers=4,
        linear_layers=3,
        linear_kind="gated_delta",
        linear_heads=4,
        linear_key_heads=2,
        linear_key_dim=8,
        linear_value_dim=16,
        linear_conv=3,
    )
    for mtype in ("qwen3_next", "qwen3_5_text"):
        shape = model_shape(tiny_config(mtype, **QWEN3_NEXT))
        assert {k: getattr(shape, k) for k in want} == want, mtype
        assert (shape.heads, shape.n_kv, shape.head_dim, shape.d_model) == (4, 2, 16, 64)
    composite = tiny_config("qwen3_5", text_config=dict(tiny_config("qwen3_5_text", **QWEN3_NEXT).to_dict()))
    assert model_shape(composite).linear_layers == 3  # Qwen3.5's multimodal config: its text config


def test_model_shape_of_the_qwen3_next_config_is_the_preset():
    """transformers' default Qwen3-Next config is the 80B-A3B model: the same shape as the `qwen3-next-80b`
    preset, MoE active width (10 routed + 1 shared expert of 512) included."""
    from transformers import AutoConfig

    got = model_shape(AutoConfig.for_model("qwen3_next")).model_dump()
    want = ModelShape.preset("qwen3-next-80b").model_dump()
    assert {k: v for k, v in got.items() if k != "name"} == {k: v for k, v in want.items() if k != "name"}


def test_model_shape_reads_mamba2_mixers():
    bamba = model_shape(tiny_config("bamba", num_hidden_layers=4, attn_layer_indices=[1], **MAMBA2))
    assert (bamba.layers, bamba.linear_layers, bamba.linear_kind) == (4, 3, "mamba2")
    assert (
        bamba.linear_heads,
        bamba.linear_value_dim,
        bamba.linear_key_heads,
        bamba.linear_key_dim,
        bamba.linear_conv,
        bamba.linear_chunk,
    ) == (8, 16, 2, 8, 4, 4)
    # Nemotron-H: one mixer or one MLP per block; a planner layer is a mixer with the MLP widths spread over them
    cfg = tiny_config(
        "nemotron_h",
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=4,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "moe", "full_attention", "mlp"],
    )
    nem = model_shape(cfg)
    moe = (
        cfg.num_experts_per_tok * cfg.moe_intermediate_size
        + cfg.n_shared_experts * cfg.moe_shared_expert_intermediate_size
    )
    assert (nem.layers, nem.linear_layers, nem.linear_heads, nem.linear_key_dim, nem.gated_mlp) == (3, 2, 4, 8, False)
    assert nem.intermediate == round((2 * cfg.intermediate_size + moe) / 3)


def test_model_shape_reads_llama4_chunked_layers():
    cfg = tiny_config("llama4_text", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], layer_types=None)
    assert cfg.layer_types.count("chunked_attention") == 3  # transformers derives them from no_rope_layers
    shape = model_shape(cfg)
    assert (shape.attention_chunk_size, shape.chunked_layers) == (16, 3)
    cfg.layer_types = None  # a config without layer_types: its RoPE layers (no_rope_layers 1) are the chunked ones
    assert model_shape(cfg).chunked_layers == 3
    assert model_shape(tiny_config("llama4", text_config=cfg.to_dict())).chunked_layers == 3
    plain = model_shape(tiny_config("llama"))
    assert (plain.linear_layers, plain.attention_chunk_size, plain.layers) == (0, None, 2)


@pytest.mark.parametrize(
    "mtype, match",
    [
        ("falcon_h1", "layer_types \\['hybrid'\\]"),  # attention and Mamba2 side by side in every layer
        ("jamba", "model_type='jamba' has sequence mixers other than attention"),
        ("minimax", "model_type='minimax'"),
        ("granitemoehybrid", "model_type='granitemoehybrid'"),
        ("lfm2", "conv_L_cache"),
        ("mamba2", "cannot read its config"),
    ],
)
def test_model_shape_refuses_what_it_cannot_read(mtype, match):
    from transformers import AutoConfig

    with pytest.raises(ConfigError, match=match):
        model_shape(AutoConfig.for_model(mtype))  # the family's default config


def test_model_shape_refuses_a_hybrid_whose_layers_it_cannot_tell():
    cfg = tiny_config("qwen3_next", **QWEN3_NEXT)
    cfg.layer_types = None
    with pytest.raises(ConfigError, match="cannot tell which are linear"):
        model_shape(cfg)
    cfg = tiny_config("llama4_text")
    cfg.layer_types, cfg.no_rope_layers = None, None
    with pytest.raises(ConfigError, match="attention_chunk_size=16 .* cannot tell which layers attend in chunks"):
        model_shape(cfg)


def test_model_shape_is_priced_by_the_planner():
    from topology import Cluster
    from topology.planner import plan

    shape = model_shape(tiny_config("bamba", num_hidden_layers=4, attn_layer_indices=[1], **MAMBA2))
    best = plan(Cluster.preset("dgx-h100"), shape, 8192, dp=1).best
    assert best.estimate.linear_share == 0.75 and isinstance(shape, ModelShape)


# ---- the memory model of a linear layer against one exactly measured step -------------------------------------------


def measure_linear(**kwargs) -> dict:
    """benchmarks/linear_memory.py:measure (one step of a tiny hybrid, StorageTracker) on this pool rank."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from linear_memory import measure

    return measure(**kwargs)


@pytest.mark.parametrize("kind, checkpoint", [("mamba2", True), ("gated_delta", False)])
def test_linear_memory_estimate_within_ten_percent_of_measured(pool, kind, checkpoint):
    """A tiny Qwen3.5 (Gated DeltaNet + attention) / Bamba (Mamba2 + attention) step on u2 x r2, fp32: the
    planner's peak of `model_shape(config)` is within 10% of the exactly measured worst rank."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from linear_memory import estimate

    rows = pool.run(measure_linear, kind=kind, u=2, r=2, seq_len=2048, checkpoint=checkpoint)
    est = estimate(kind, 2, 2, 2048, checkpoint, "fp32")
    worst = max(row["peak"] for row in rows)
    assert abs(est.peak / worst - 1) <= 0.10, (est.peak, worst, est.phases)


def test_linear_layers_save_their_own_tensors():
    """A hybrid's `layer` activation term is its linear layer's (larger than a softmax layer's at Qwen3-Next's
    sizes), and without checkpointing every linear layer's saved tensors are counted, not a softmax layer's."""
    from topology.step_model import MemoryOptions, step_memory

    hybrid = ModelShape.preset("qwen3-next-80b")
    dense = hybrid.model_copy(update=dict(linear_layers=0, linear_kind=None))
    opts = MemoryOptions(checkpoint=False)
    a, b = step_memory(hybrid, 32768, 4, 2, options=opts), step_memory(dense, 32768, 4, 2, options=opts)
    assert a.activations["layer"] > b.activations["layer"]
    assert a.activations["inputs"] + a.activations["layer"] > b.activations["inputs"] + b.activations["layer"]
    ckpt = step_memory(hybrid, 32768, 4, 2)
    assert ckpt.activations["inputs"] == hybrid.layers * ckpt.local_tokens * hybrid.d_model * 2  # layer inputs, bf16
    assert ckpt.stages["linear_bwd"] > 0 and ckpt.peak > step_memory(dense, 32768, 4, 2).peak
