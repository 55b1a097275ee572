"""The planner's `ModelShape` of a transformers config (`model_shape`): attention heads and widths, windowed
and chunked layers, and the linear layers of the hybrid families it reads (`GATED_DELTA_TYPES`,
`MAMBA2_TYPES`); any other family with non-attention mixers is refused rather than priced wrongly."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

# transformers families whose linear layers `model_shape` reads: Gated DeltaNet (`layer_types` "linear_attention")
# and Mamba2 mixers (Bamba's `attn_layer_indices`, Nemotron-H's `layers_block_type`)
GATED_DELTA_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MAMBA2_TYPES = ("bamba", "nemotron_h")
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
# config keys that mean sequence mixers other than attention (a family not read here must not pass as attention-only)
_LINEAR_MARKERS = (
    "mamba",
    "ssm",
    "linear_attn",
    "linear_num",
    "linear_conv",
    "conv_l_cache",
    "layers_block_type",
    "attn_layer",
)


def model_shape(config: Any) -> Any:
    """The planner's `ModelShape` of a transformers config (docs/planner.md section 4.2): windowed and chunked
    layers from `layer_types` (Llama 4: `no_rope_layers` when it has none), a hybrid's linear layers for the
    families in `GATED_DELTA_TYPES` and `MAMBA2_TYPES`. A config whose layers it cannot read raises
    `ConfigError` (a wrong shape would plan a wrong split)."""
    try:
        return _read_shape(config)
    except ConfigError:
        raise
    except (
        AttributeError,
        TypeError,
        ValueError,
        RuntimeError,
    ) as exc:  # a field missing, per layer or of another form
        mtype = getattr(config, "model_type", None) or type(config).__name__
        text = " ".join(str(exc).split())
        raise ConfigError(
            f"model_type={mtype!r}: the planner cannot read its config ({text[:300]}); pass explicit "
            f'ulysses= and ring= instead of "auto"'
        ) from None


def _read_shape(config: Any) -> Any:
    from topology.model_shape import ModelShape

    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(config, "model_type", None) or "custom"
    heads = config.num_attention_heads
    fields = dict(
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        intermediate=getattr(config, "intermediate_size", None),
        vocab=config.vocab_size,
        name=mtype,
    )
    if mtype in GATED_DELTA_TYPES:
        fields.update(_gated_delta_fields(config))
    elif mtype in MAMBA2_TYPES:
        fields.update(_mamba2_fields(config, mtype))
    else:
        _refuse_unread_mixers(config, mtype)
    kinds = [k for k in (getattr(config, "layer_types", None) or ()) if k != "linear_attention"]
    unknown = sorted(set(kinds) - set(_ATTENTION_KINDS)) if mtype not in MAMBA2_TYPES else []
    if unknown:
        raise ConfigError(
            f"config.layer_types has {unknown} (model_type={mtype!r}): layer kinds the planner does "
            f'not price; pass explicit ulysses= and ring= instead of "auto"'
        )
    fields.update(_attention_kinds(config, kinds if mtype not in MAMBA2_TYPES else [], mtype))
    return ModelShape(**fields)


def _refuse_unread_mixers(config: Any, mtype: str) -> None:
    """A family with non-attention mixers that `model_shape` does not read (Jamba, Zamba, GraniteMoeHybrid,
    MiniMax, Kimi Linear, LFM2, Falcon-H1, ...) is refused: priced as attention only, its plan would be wrong."""
    keys = [k for k in config.to_dict() if any(m in k.lower() for m in _LINEAR_MARKERS)]
    kinds = set(getattr(config, "layer_types", None) or ()) - set(_ATTENTION_KINDS)
    if keys or kinds:
        what = f"layer_types {sorted(kinds)}" if kinds else f"fields {keys[:4]}"
        raise ConfigError(
            f"model_type={mtype!r} has sequence mixers other than attention ({what}) that the planner "
            f"does not read (it reads {', '.join(GATED_DELTA_TYPES + MAMBA2_TYPES)}); pass explicit "
            f'ulysses= and ring= instead of "auto"'
        )


def _gated_delta_fields(config: Any) -> dict:
    """Qwen3-Next / Qwen3.5: `layer_types` "linear_attention" layers are Gated DeltaNet blocks; MoE models
    give the MLP's active width and the idle experts' weights (`expert_params`)."""
    kinds = list(getattr(config, "layer_types", None) or ())
    if len(kinds) != config.num_hidden_layers:
        raise ConfigError(
            f"config.layer_types={kinds!r} (model_type={config.model_type!r}) does not name each of the "
            f"{config.num_hidden_layers} layers: cannot tell which are linear"
        )
    out: dict = {}
    if getattr(config, "num_experts", 0) and getattr(config, "moe_intermediate_size", None):
        # MoE (Qwen3-Next, Qwen3.5-MoE): the active width (routed experts per token and the shared expert), and
        # the dense layers' (`mlp_only_layers`, `decoder_sparse_step`) averaged in
        step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", ()) or ())
        moe = config.num_experts_per_tok * config.moe_intermediate_size + (
            getattr(config, "shared_expert_intermediate_size", 0) or 0
        )
        widths = [config.intermediate_size if i in dense or (i + 1) % step else moe for i in range(len(kinds))]
        out["intermediate"] = round(sum(widths) / len(widths))
        idle = (config.num_experts - config.num_experts_per_tok) * 3 * config.hidden_size * config.moe_intermediate_size
        out["expert_params"] = idle * sum(w == moe for w in widths)
    return dict(
        out,
        linear_layers=kinds.count("linear_attention"),
        linear_kind="gated_delta",
        linear_heads=config.linear_num_value_heads,
        linear_key_heads=config.linear_num_key_heads,
        linear_key_dim=config.linear_key_head_dim,
        linear_value_dim=config.linear_value_head_dim,
        linear_conv=config.linear_conv_kernel_dim,
    )


def _mamba2_fields(config: Any, mtype: str) -> dict:
    """Bamba (attention at `attn_layer_indices`, Mamba2 elsewhere, an MLP in every layer) and Nemotron-H (one
    mixer or one MLP per block, `layers_block_type`: a planner layer is a mixer block, with the MLP and MoE
    blocks' active width spread evenly over them; relu2, no gate)."""
    if mtype == "bamba":
        attn = len(set(config.attn_layer_indices or ()))
        out = dict(
            layers=config.num_hidden_layers,
            linear_layers=config.num_hidden_layers - attn,
            linear_heads=config.mamba_n_heads,
            linear_value_dim=config.mamba_d_head,
            linear_key_heads=config.mamba_n_groups,
            linear_key_dim=config.mamba_d_state,
            linear_conv=config.mamba_d_conv,
            linear_chunk=config.mamba_chunk_size,
        )
    else:
        blocks = list(config.layers_block_type)
        unknown = sorted(set(blocks) - {"linear_attention", "full_attention", "mlp", "moe"})
        if unknown:
            raise ConfigError(
                f"config.layers_block_type has {unknown} (model_type={mtype!r}): block kinds the "
                f'planner does not read; pass explicit ulysses= and ring= instead of "auto"'
            )
        linear, mixers = (
            blocks.count("linear_attention"),
            blocks.count("linear_attention") + blocks.count("full_attention"),
        )
        moe = (
            config.num_experts_per_tok * config.moe_intermediate_size
            + (config.n_shared_experts or 0) * config.moe_shared_expert_intermediate_size
        )
        width = blocks.count("mlp") * config.intermediate_size + blocks.count("moe") * moe
        idle = (
            (config.n_routed_experts - config.num_experts_per_tok)
            * 2
            * config.hidden_size
            * config.moe_intermediate_size
            * blocks.count("moe")
        )  # relu2 experts: up and down projections
        out = dict(
            layers=mixers,
            linear_layers=linear,
            intermediate=max(1, round(width / max(1, mixers))),
            gated_mlp=False,
            linear_heads=config.mamba_num_heads,
            linear_value_dim=config.mamba_head_dim,
            linear_key_heads=config.n_groups,
            linear_key_dim=config.ssm_state_size,
            linear_conv=config.conv_kernel,
            linear_chunk=config.chunk_size,
            expert_params=idle,
        )
    return dict(out, linear_kind="mamba2")


def _attention_kinds(config: Any, kinds: list[str], mtype: str) -> dict:
    """Window and chunk fields of the attention layers: how many of each from `layer_types` (Llama 4 without
    them: its RoPE layers, `no_rope_layers` 1, are the chunked ones)."""
    window, chunk = getattr(config, "sliding_window", None) or None, getattr(config, "attention_chunk_size", None)
    out: dict = {
        "sliding_window": window,
        "window_layers": kinds.count("sliding_attention") if window and kinds else None,
    }
    if chunk:
        if kinds:
            chunked = kinds.count("chunked_attention")
        elif getattr(config, "no_rope_layers", None):
            chunked = sum(1 for x in config.no_rope_layers if x)
        else:
            raise ConfigError(
                f"config.attention_chunk_size={chunk} (model_type={mtype!r}) with neither layer_types nor "
                f"no_rope_layers: cannot tell which layers attend in chunks"
            )
        out.update(attention_chunk_size=chunk if chunked else None, chunked_layers=chunked or None)
    return out
