"""Tiny random configurations of any transformers causal-LM family, and the walk over all of them.

`walk()` builds every causal-LM model type the installed transformers ships (tiny, on the meta device:
building is free) and asks `apply_context_parallel` about each; the test-suite asserts that it accepts
exactly the verified families, whose parity tests train `tiny_model(...)` for real;
`benchmarks/model_families.py` prints the table.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import torch

VOCAB = 256
# every size field a config may have, set to a tiny value when the config has it
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    # every dropout field off (GPT-2's, OPT's, Seed-OSS's defaults draw per-rank masks: the guard refuses them)
    attn_pdrop=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    residual_dropout=0.0,
    hidden_dropout=0.0,
    dropout=0.0,
    activation_dropout=0.0,
    layerdrop=0.0,
)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
# multi-head latent attention (any config with kv_lora_rank): query/key head dim 16 + 8, value head dim 16;
# the decompressed keys have every query head (transformers' eager attention needs kv heads = heads), and
# head_dim is the rotary part (what MLA configs derive it as)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=16,
)
# what makes the attention variants of these families matter inside a test's 100 tokens (2 layers, one of
# each kind): a window and a chunk much shorter than the row, a temperature scale that grows inside it, soft-caps
# at which tanh bends the scores, routed experts next to a dense MLP
VARIANTS = {
    "gpt_oss": dict(sliding_window=16),  # sliding / full layers, each with its sinks
    "gemma2": dict(sliding_window=16, query_pre_attn_scalar=1, attn_logit_softcapping=0.5, final_logit_softcapping=5.0),
    "deepseek_v3": dict(
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE; YaRN's mscale in the scaling
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=256,
        ),
    ),
    "llama4_text": dict(
        attention_chunk_size=16,
        no_rope_layers=[1, 0],
        floor_scale=8,
        attn_scale=0.5,
        moe_layers=[1],
        intermediate_size_mlp=128,
    ),  # chunked + RoPE, full + NoPE + temperature
    # a short-convolution layer next to the attention one (LFM2's tiny default has none; LFM2-MoE's does not
    # build without layer_types), the second layer's MLP an MoE block
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),  # rotary on half of the tiny head dim (16)
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    # Gemma 4: sliding and full layers with their own head dim, kv heads (one, keys = values) and partial rotary; the
    # last two layers reuse the K/V of the first two (KV sharing); per-layer embeddings; MoE beside the MLP
    "gemma4_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=16,
        num_kv_shared_layers=2,
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
        final_logit_softcapping=5.0,
        enable_moe_block=True,
        top_k_experts=2,
    ),
    # Gemma 4 unified (text): Gemma 4's attention and KV sharing without per-layer embeddings or MoE
    "gemma4_unified_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=16,
        num_kv_shared_layers=2,
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        final_logit_softcapping=5.0,
    ),
    # Dory: one input layer, two looped twice with the same weights, one output layer (its defaults of 8 input and 8
    # output layers leave a tiny model a negative loop section)
    "dory": dict(num_hidden_layers=4, n_input_layers=1, n_output_layers=1, sliding_window=16),
    # Gemma 3n: the same KV sharing and per-layer embeddings, AltUp, Laurel, Gaussian top-k sparsity in two MLPs
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=16,
        num_kv_shared_layers=2,
        intermediate_size=[128] * 4,
        activation_sparsity_pattern=[0.95] * 2 + [0.0] * 2,
        laurel_rank=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
}


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _has_field(config, name: str) -> bool:
    """hasattr, except that a per-layer field of a heterogeneous config (Gemma 4's head_dim), which raises when read
    globally, counts as present."""
    try:
        return hasattr(config, name)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return True


def tiny_config(model_type: str, **overrides):
    """The family's default configuration with every size field it has made tiny (and `VARIANTS`), token ids
    inside the tiny vocabulary. Raises whatever transformers raises when the family rejects the tiny sizes."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in TINY.items() if _has_field(base, k)}
    if getattr(base, "kv_lora_rank", None) is not None:
        kwargs.update({k: v for k, v in MLA.items() if hasattr(base, k)})
    kwargs.update(VARIANTS.get(model_type, {}))
    for i, name in enumerate(_TOKEN_IDS):
        value = getattr(base, name, None)
        if isinstance(value, int) and value >= VOCAB:
            kwargs[name] = VOCAB - 1 - i
        elif isinstance(value, list):
            kwargs[name] = [min(x, VOCAB - 8) for x in value]
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def walk_config(model_type: str):
    """The tiniest configuration of the family that builds: tiny sizes, else tiny widths at the family's
    own depth (some fix the layer pattern's length), else the defaults (the walk builds on meta)."""
    from transformers import AutoConfig

    for attempt in (
        lambda: tiny_config(model_type),
        lambda: tiny_config(model_type, num_hidden_layers=AutoConfig.for_model(model_type).num_hidden_layers),
        lambda: AutoConfig.for_model(model_type),
    ):
        try:
            config = attempt()
            build(config, "meta")
            return config
        except Exception as exc:  # the family rejects these sizes (or needs a package not installed)
            error = exc
    raise error


def build(config, device: str | torch.device = "cpu", seed: int = 0):
    """`AutoModelForCausalLM.from_config` in fp32, training mode; quiet about the family's warnings."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.device(device):
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    finally:
        logger.setLevel(level)
    return model.float().train()


def tiny_model(model_type: str, device: str | torch.device = "cpu", seed: int = 0, **overrides):
    return build(tiny_config(model_type, **overrides), device, seed)


def parameter_count(config) -> int:
    """Parameters of the model `config` builds, counted on the meta device (nothing allocated)."""
    return sum(p.numel() for p in build(config, "meta").parameters())


def walk(model_types: Sequence[str] | None = None) -> dict[str, tuple[str, str]]:
    """model_type -> ("exact", ""), ("refused", the guard's message) or ("not built", why), for each of
    `model_types` (default: every causal-LM family of the installed transformers), asked of
    `apply_context_parallel` on a ulysses=2 x ring=2 mesh description (no process groups: the guard starts no
    collective)."""
    from ..errors import ConfigError
    from ..integrations.transformers import apply_context_parallel
    from . import mesh_description

    cp = mesh_description(2, 2)
    rows = {}
    for model_type in causal_lm_types() if model_types is None else model_types:
        try:
            model = build(walk_config(model_type), "meta")
        except Exception as exc:  # the family needs other sizes or a package not installed here
            rows[model_type] = ("not built", f"{type(exc).__name__}: {exc}".splitlines()[0])
            continue
        try:
            apply_context_parallel(model, cp)
            rows[model_type] = ("exact", "")
        except ConfigError as exc:
            rows[model_type] = ("refused", str(exc))
    return rows
