"""Which transformers models train exactly under context parallelism, and the guard that refuses the rest.

Context parallelism replaces one thing, the attention function, and runs everything else of the model
on this rank's shard of the sequence. That is exact only if everything else acts token by token
(projections, norms, MLPs, MoE routing, rotary embeddings at the right positions). A module that mixes
information along the sequence outside the attention function (linear attention, a state-space layer,
a token-mixing convolution, a recurrence) would run over the shard as if it were the whole sequence:
silently wrong gradients, while the loss can differ by as little as 1e-6.

So the rule is an allow-list, not a deny-list of known bad modules: a model is accepted only when its
`model_type` is a family in `VERIFIED_FAMILIES` (each one trained one step on a ulysses=2 x ring=2
mesh and compared with the single-process model by `tests/test_model_families.py`) and every module
in it is a class that family was verified with, or a token-wise torch/transformers class. Everything
else is refused with a `ConfigError` naming the module, the config field and what to do; the check
is local (no collective) and runs on every rank inside `apply_context_parallel`. The attention
function itself applies the same rule to its keyword arguments (`check_attention_kwargs`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from ..errors import ConfigError, ShapeError
from .linear_layers import ROUTED_CLASSES
from .router_aux import router_aux_refusal

# The classes of a Llama-like dense family and of a Mixtral-like MoE family, after the family's stem.
DENSE = "Attention DecoderLayer ForCausalLM MLP Model RMSNorm RotaryEmbedding"
MOE = "Attention DecoderLayer Experts ForCausalLM Model RMSNorm RotaryEmbedding SparseMoeBlock TopKRouter"
# ... and of a DeepSeek-V3-like family (multi-head latent attention, dense first layers, routed + shared experts)
MLA_MOE = "Attention DecoderLayer Experts ForCausalLM MLP MoE Model RMSNorm RotaryEmbedding TopkRouter"
GEMMA2 = "Attention DecoderLayer ForCausalLM MLP Model RMSNorm RotaryEmbedding TextScaledWordEmbedding"

# model_type -> (class-name stem, the classes after the stem) of every transformers module the
# family's verified tiny model contains. Some families reuse another's classes (exaone: Llama's).
VERIFIED_FAMILIES: dict[str, tuple[str, str]] = {
    "afmoe": (
        "Afmoe",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding SparseMoeBlock TokenChoiceRouter",
    ),
    "apertus": ("Apertus", DENSE),
    # hybrid: Mamba2 mixers routed by `linear_layers` (docs/linear.md)
    "bamba": ("Bamba", "Attention DecoderLayer ForCausalLM MLP Mixer Model RMSNorm RMSNormGated RotaryEmbedding"),
    "apertus1p5_text": ("Apertus1p5Text", DENSE),
    "arcee": ("Arcee", DENSE),
    "aria_text": (
        "Aria",
        "Experts SharedExpertsMLP TextAttention TextDecoderLayer TextForCausalLM "
        "TextMoELayer TextModel TextRMSNorm TextRotaryEmbedding TextTopKRouter",
    ),
    "axk1": ("AXK1", MLA_MOE),
    # hybrid: Ling 2.5's KDA (Kimi Delta Attention, routed by `linear_layers`), MLA with a head gate, MoE
    "bailing_hybrid": (
        "BailingHybrid",
        "Attention DecoderLayer DeltaAttention Experts ForCausalLM MLP MoE Model RMSNorm RotaryEmbedding TopkRouter",
    ),
    "beam": ("Beam", DENSE),
    "bitnet": ("BitNet", DENSE),
    "cohere": ("Cohere", "Attention DecoderLayer ForCausalLM LayerNorm MLP Model RotaryEmbedding"),
    "cohere2": ("Cohere2", "Attention DecoderLayer ForCausalLM LayerNorm MLP Model RotaryEmbedding"),
    "cohere2_moe": (
        "Cohere2Moe",
        "Attention DecoderLayer Experts ForCausalLM LayerNorm Model RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    "cwm": ("Cwm", DENSE),
    "deepseek_v2": (
        "DeepseekV2",
        "Attention DecoderLayer Experts ForCausalLM MLP Model Moe RMSNorm RotaryEmbedding TopkRouter",
    ),
    "deepseek_v3": ("DeepseekV3", MLA_MOE),
    "diffllama": ("DiffLlama", DENSE),
    # looped middle layers (the same weights run n_recurrent_loops times), L2-normalised residual stream, gated
    # attention with a sub-norm, per-vocabulary logit scale
    "dory": ("Dory", "Attention DecoderLayer ForCausalLM L2Norm LMHead MLP Model RotaryEmbedding"),
    "ernie4_5": ("Ernie4_5", DENSE),
    "exaone": ("Llama", DENSE),
    "ernie4_5_moe": (
        "Ernie4_5_Moe",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding "
        "SparseMoeBlock Statics TopKRouter",
    ),
    # hybrid: attention and a Mamba2 mixer side by side in every layer, the mixer routed by `linear_layers`
    "falcon_h1": (
        "FalconH1",
        "Attention DecoderLayer ForCausalLM MLP Mixer Model RMSNorm RMSNormGated RotaryEmbedding",
    ),
    "exaone4": ("Exaone4", DENSE),
    "exaone_moe": (
        "ExaoneMoe",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding SparseMoEBlock TopkRouter",
    ),
    "flex_olmo": ("FlexOlmo", MOE),
    "flint": ("Flint", DENSE),
    "gemma": ("Gemma", "Attention DecoderLayer ForCausalLM MLP Model RMSNorm RotaryEmbedding TextScaledWordEmbedding"),
    "gemma3_text": (
        "Gemma3",
        "Attention DecoderLayer ForCausalLM MLP RMSNorm RotaryEmbedding TextModel TextScaledWordEmbedding",
    ),
    "gemma2": ("Gemma2", GEMMA2),
    # Gemma 4 text: per-layer head dims and kv heads, KV sharing across layers (the reusing layers run the ring on
    # the stored layer's K/V shard again), per-layer embeddings (token lookups), MoE beside the MLP
    # Gemma 3n text: KV sharing and per-layer embeddings as Gemma 4; AltUp, Laurel and the MLPs' Gaussian top-k act on
    # each token's hidden vector
    "gemma3n_text": (
        "Gemma3n",
        "ForCausalLM RMSNorm RotaryEmbedding TextAltUp TextAttention TextDecoderLayer "
        "TextLaurelBlock TextMLP TextModel TextScaledWordEmbedding",
    ),
    "gemma4_unified_text": (
        "Gemma4Unified",
        "ForCausalLM RMSNorm TextAttention TextDecoderLayer TextMLP TextModel "
        "TextRotaryEmbedding TextScaledWordEmbedding",
    ),
    "gemma4_text": (
        "Gemma4",
        "ForCausalLM RMSNorm TextAttention TextDecoderLayer TextExperts TextMLP TextModel "
        "TextRotaryEmbedding TextRouter TextScaledWordEmbedding",
    ),
    "glm": ("Glm", DENSE),
    "glm4": ("Glm4", DENSE),
    "glm4_moe": (
        "Glm4Moe",
        "Attention DecoderLayer Experts ForCausalLM MLP MoE Model RMSNorm RotaryEmbedding TopkRouter",
    ),
    "glm4_moe_lite": ("Glm4MoeLite", MLA_MOE),
    "codegen": ("CodeGen", "Attention Block ForCausalLM MLP Model RotaryEmbedding"),
    # absolute positions (learned wpe, sinusoidal rotary tables) read the global position ids the pre-hook supplies
    "gpt2": ("GPT2", "Attention Block LMHeadModel MLP Model"),
    "gpt_bigcode": ("GPTBigCode", "Attention Block ForCausalLM MLP Model"),
    "gptj": ("GPTJ", "Attention Block ForCausalLM MLP Model RotaryEmbedding"),
    "gpt_neox": ("GPTNeoX", "Attention ForCausalLM Layer MLP Model RotaryEmbedding"),
    "gpt_oss": ("GptOss", "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding TopKRouter"),
    "granite": ("Granite", DENSE),
    "granite_swa": ("GraniteSWA", DENSE),
    "granitemoe": (
        "GraniteMoe",
        "Attention DecoderLayer Experts ForCausalLM MoE Model RMSNorm RotaryEmbedding TopKRouter",
    ),
    # hybrid: Granite 4.0-H, Mamba2 layers (Bamba's mixer, routed by `linear_layers`), attention (RoPE or NoPE), MoE
    "granitemoehybrid": (
        "GraniteMoeHybrid",
        "Attention DecoderLayer Experts ForCausalLM MLP MambaLayer MoE Model "
        "RMSNorm RMSNormGated RotaryEmbedding TopKRouter",
    ),
    "granitemoeshared": (
        "GraniteMoeShared",
        "Attention DecoderLayer Experts ForCausalLM MoE Model RMSNorm RotaryEmbedding TopKRouter",
    ),
    "granitemoe_swa": (
        "GraniteMoeSWA",
        "Attention DecoderLayer Experts ForCausalLM MoE Model RMSNorm RotaryEmbedding TopKRouter",
    ),
    "helium": ("Helium", DENSE),
    "hunyuan_v1_dense": ("HunYuanDenseV1", DENSE),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1",
        "Attention DecoderLayer Experts ForCausalLM Gate MLP Model Moe RMSNorm RotaryEmbedding",
    ),
    "hy_v3": ("HYV3", "Attention DecoderLayer Experts ForCausalLM MLP MoE Model RMSNorm RotaryEmbedding TopKRouter"),
    "hyperclovax": ("HyperCLOVAX", DENSE),
    "internlm3": ("Llama", DENSE),
    "iquestcoder": ("Llama", DENSE),
    "jais2": ("Jais2", "Attention DecoderLayer ForCausalLM MLP Model RotaryEmbedding"),
    "laguna": (
        "Laguna",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    # hybrid: Mamba-1 mixers (conv halo + selective scan) routed by `linear_layers`, attention, MoE every other layer
    "jamba": (
        "Jamba",
        "Attention AttentionDecoderLayer Experts ForCausalLM MLP MambaDecoderLayer MambaMixer Model "
        "RMSNorm SparseMoeBlock TopKRouter",
    ),
    "jetmoe": (
        "JetMoe",
        "Attention DecoderLayer ForCausalLM MoA MoE Model ParallelExperts RMSNorm RotaryEmbedding TopKGating",
    ),
    # hybrid: KDA (routed by `linear_layers`), MLA without rotary, MoE
    "kimi_linear": (
        "KimiLinear",
        "Attention DecoderLayer DeltaAttention Experts ForCausalLM MLP MoE Model RMSNorm TopkRouter",
    ),
    "kolibri1": (
        "Kolibri1",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    # hybrid: gated short convolutions (`Lfm2ShortConv`, the halo) routed by `linear_layers`, and attention
    "lfm2": ("Lfm2", "Attention DecoderLayer ForCausalLM MLP Model RMSNorm RotaryEmbedding ShortConv"),
    "lfm3": ("Lfm3", "Attention DecoderLayer ForCausalLM MLP Model RMSNorm RotaryEmbedding ShortConv"),
    # hybrid: Gated DeltaNet (Qwen3.5's), sliding and full attention, MoE
    "lara_mini": (
        "LaraMini",
        "Attention DecoderLayer Experts ForCausalLM GatedDeltaNet MLP Model RMSNorm RMSNormGated "
        "RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    "lfm2_moe": (
        "Lfm2Moe",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding ShortConv "
        "SparseMoeBlock TopKRouter",
    ),
    "llama": ("Llama", DENSE),
    "llama4_text": (
        "Llama4",
        "ForCausalLM Router TextAttention TextDecoderLayer TextExperts TextL2Norm TextMLP "
        "TextMoe TextModel TextRMSNorm TextRotaryEmbedding",
    ),
    "longcat_flash": (
        "LongcatFlash",
        "DecoderLayer Experts ForCausalLM MLA MLP MoE Model RMSNorm RotaryEmbedding TopkRouter",
    ),
    # pure Mamba2 (Codestral Mamba) and Mamba-1 (Falcon-Mamba, Mamba): mixers routed by `linear_layers`; dense rows
    # only (their models drop the packed row's boundaries before the blocks: the routed mixers refuse packed rows)
    "mamba2": ("Mamba2", "Block ForCausalLM Mixer Model RMSNorm"),
    "mamba": ("Mamba", "Block ForCausalLM Mixer Model RMSNorm"),
    "falcon_mamba": ("FalconMamba", "Block ForCausalLM Mixer Model RMSNorm"),
    "mellum": ("Mellum", MOE),
    "mimo_v2_flash": ("MiMoV2Flash", MLA_MOE),
    "minimax_m2": ("MiniMaxM2", MOE),
    "minimax_m3_vl_text": (
        "MiniMaxM3VL",
        "Attention DecoderLayer DenseMLP Experts ForCausalLM "
        "RMSNorm RotaryEmbedding SparseMoeBlock TextModel TopKRouter",
    ),
    "minicpm3": (
        "MiniCPM3",
        "Attention DecoderLayer ForCausalLM MLP Model RMSNorm RotaryEmbedding ScaledWordEmbedding",
    ),
    # hybrid: lightning attention (decayed linear attention) routed by `linear_layers`, softmax attention, MoE
    "minimax": (
        "MiniMax",
        "Attention DecoderLayer Experts ForCausalLM LightningAttention Model RMSNorm "
        "RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    "ministral": ("Ministral", DENSE),
    "ministral3": ("Ministral3", DENSE),
    "mistral": ("Mistral", DENSE),
    "mixtral": ("Mixtral", MOE),
    "modernbert-decoder": (
        "ModernBertDecoder",
        "Attention Embeddings ForCausalLM Layer MLP Model PredictionHead RotaryEmbedding",
    ),
    "nanochat": ("NanoChat", DENSE),
    # hybrid: Mamba2, MoE, attention and MLP blocks; the Mamba2 mixers routed by `linear_layers`
    "nemotron_h": (
        "NemotronH",
        "Attention Block Experts ForCausalLM MLP Mamba2Mixer Model MoE RMSNorm RMSNormGated TopkRouter",
    ),
    "nemotron": ("Nemotron", "Attention DecoderLayer ForCausalLM LayerNorm1P MLP Model RotaryEmbedding"),
    "opt": ("OPT", "Attention Decoder DecoderLayer ForCausalLM LearnedPositionalEmbedding Model"),
    "olmo": ("Olmo", "Attention DecoderLayer ForCausalLM LayerNorm MLP Model RotaryEmbedding"),
    "olmo2": ("Olmo2", DENSE),
    # hybrid: Gated DeltaNet with separate projections and beta in [0, 2] (routed by `linear_layers`), attention
    "olmo_hybrid": (
        "OlmoHybrid",
        "Attention AttentionDecoderLayer ForCausalLM GatedDeltaNet LinearAttentionDecoderLayer "
        "MLP Model RMSNorm RMSNormGated RotaryEmbedding",
    ),
    "olmo3": ("Olmo3", DENSE),
    "olmoe": ("Olmoe", MOE),
    "persimmon": ("Persimmon", "Attention DecoderLayer ForCausalLM MLP Model RotaryEmbedding"),
    "phi": ("Phi", "Attention DecoderLayer ForCausalLM MLP Model RotaryEmbedding"),
    "phi3": ("Phi3", DENSE),
    "qwen2": ("Qwen2", DENSE),
    "qwen2_moe": (
        "Qwen2Moe",
        "Attention DecoderLayer Experts ForCausalLM MLP Model RMSNorm RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    "qwen3": ("Qwen3", DENSE),
    "qwen3_moe": ("Qwen3Moe", MOE),
    # hybrid: Gated DeltaNet blocks routed by `linear_layers` (docs/linear.md), gated attention every 4th layer
    "qwen3_next": (
        "Qwen3Next",
        "Attention DecoderLayer Experts ForCausalLM GatedDeltaNet MLP Model RMSNorm "
        "RMSNormGated RotaryEmbedding SparseMoeBlock TopKRouter",
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5Moe",
        "Attention DecoderLayer Experts ForCausalLM GatedDeltaNet MLP RMSNorm "
        "RMSNormGated SparseMoeBlock TextModel TextRotaryEmbedding TopKRouter",
    ),
    "qwen3_5_text": (
        "Qwen3_5",
        "Attention DecoderLayer ForCausalLM GatedDeltaNet MLP RMSNorm RMSNormGated TextModel TextRotaryEmbedding",
    ),
    "sarvam_mla": ("DeepseekV3", MLA_MOE),
    "sarvam_moe": (
        "Glm4Moe",
        "Attention DecoderLayer Experts ForCausalLM MLP MoE Model RMSNorm RotaryEmbedding TopkRouter",
    ),
    "seed_oss": ("SeedOss", DENSE),
    "smollm3": ("SmolLM3", DENSE),
    "solar_open": (
        "SolarOpen",
        "Attention DecoderLayer Experts ForCausalLM MLP MoE Model RMSNorm RotaryEmbedding TopkRouter",
    ),
    "starcoder2": ("Starcoder2", "Attention DecoderLayer ForCausalLM MLP Model RotaryEmbedding"),
    "vaultgemma": ("VaultGemma", GEMMA2),
    "youtu": ("Youtu", DENSE),
    # hybrid: Mamba2 layers (routed by `linear_layers`) and shared (tied) attention blocks on [hidden | embeddings]
    # with per-use LoRA adapters (module head chunks skip them)
    "zamba2": (
        "Zamba2",
        "Attention AttentionDecoderLayer ForCausalLM HybridLayer MLP MambaDecoderLayer MambaMixer "
        "Model RMSNorm RMSNormGated RotaryEmbedding",
    ),
}

# vision-language families whose language model trains exactly under context parallelism on rows made by
# `hybrid_cp.image_row` (integrations/vision.py): model_type -> (stem, the classes after the stem, as in
# VERIFIED_FAMILIES, and the submodules that run on the whole row inside image_row, before sharding, whose modules
# (a vision tower, a pooling projector) the allow-list does not see). Passing pixel_values/token_type_ids to the
# model itself is refused (`media_refusal`). Each trained one step on (2, 2) and (1, 4) by tests/test_vision_masks.py.
VISION_LANGUAGE_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "gemma3": (
        "Gemma3",
        "Attention DecoderLayer ForConditionalGeneration MLP Model RMSNorm RotaryEmbedding TextModel "
        "TextScaledWordEmbedding",
        ("model.vision_tower", "model.multi_modal_projector"),
    ),
}
# vision-language families the image_row path does not carry exactly, with why (the guard's message gives it)
VISION_LANGUAGE_REFUSED = {
    "gemma4": "hybrid_cp.image_row does not carry it exactly: its decoder layers also read per-layer embeddings "
    "looked up from input_ids (hidden_size_per_layer_input), which an inputs_embeds row leaves out, its "
    "vision tower takes pixel_position_ids and its video/audio tokens are further blocks "
    "(mm_token_type_ids); not verified",
    "paligemma": "hybrid_cp.image_row does not carry it: its mask is prefix-LM (the image and prompt tokens, "
    "token_type_ids == 0, one bidirectional block; Gemma 3's blocks are the image tokens, "
    "token_type_ids == 1) and its positions start at 1; not verified",
}

# families whose modules are token-wise but whose training step cannot equal the single-process one, with why
# (the guard's message and the family table give the reason)
REFUSED_FAMILIES = {
    "phimoe": "its router (sparsemixer) samples experts with Gumbel noise and random masks per token whenever the "
    "model is in training mode, from each rank's own random stream: a CP step is only distributionally "
    "the single-process one (its longrope rotary is exact: hybrid_cp.integrations.rope)",
}

# torch modules that act on each token on its own (containers hold modules that are checked themselves)
TOKENWISE_TORCH = (
    torch.nn.Linear,
    torch.nn.Embedding,
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.Sequential,
    torch.nn.Identity,
    torch.nn.Dropout,
    torch.nn.LayerNorm,
    torch.nn.RMSNorm,
    torch.nn.SiLU,
    torch.nn.GELU,
    torch.nn.ReLU,
    torch.nn.Sigmoid,
    torch.nn.Tanh,
)
TOKENWISE_MODULES = ("transformers.activations",)  # elementwise activation functions
TOKENWISE_CONV1D = ("Conv1D", "transformers.pytorch_utils")  # GPT-2's linear layer, despite its name

# the layer kinds of `config.layer_types` that are attention the engine computes exactly
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# ... and the linear-attention kind, whose blocks `linear_layers` routes (a family's blocks count only once
# the family is verified: the module check refuses the mixers of every other family)
ROUTED_LAYER_TYPES = ("linear_attention",)
# per family, the further layer kinds that act token by token or pair attention with a routed mixer
# (Nemotron-H's MoE and MLP blocks; Falcon-H1's 'hybrid' layers: attention and a Mamba2 mixer in parallel)
FAMILY_LAYER_TYPES = {
    "nemotron_h": ("moe", "mlp"),
    "falcon_h1": ("hybrid",),
    "lfm2": ("conv",),
    "lfm2_moe": ("conv",),
    "lfm3": ("conv",),
    "zamba2": ("hybrid",),
}
# families whose attention modules call ALL_ATTENTION_FUNCTIONS.get_interface although their model class
# leaves `_supports_attention_backend` False (read in their modeling code; the parity test proves it)
REGISTRY_DISPATCH = (
    "qwen3_next",
    "qwen3_5_text",
    "bamba",
    "nemotron_h",
    "falcon_h1",
    "jamba",
    "qwen3_5_moe_text",
    "lara_mini",
    "kimi_linear",
    "bailing_hybrid",
    "olmo_hybrid",
    "zamba2",
)
# families without attention modules: nothing to dispatch through the registry
ATTENTION_FREE = ("mamba2", "mamba", "falcon_mamba")

# what a module that mixes tokens outside the attention function is, by its class name (for the message:
# the allow-list refuses them whether or not a pattern matches)
_MIXERS = (
    (re.compile(r"Mamba|Mixer|SSM|Ssm"), "a state-space (Mamba) layer"),
    (re.compile(r"DeltaNet|LinearAttention|Lightning|DeltaAttention|LinearAttn"), "linear attention"),
    (re.compile(r"ShortConv|CausalConv"), "a token-mixing convolution"),
    (re.compile(r"Rglru|Recurrent|LSTM|Rwkv|RWKV"), "a recurrence"),
    (
        re.compile(r"Indexer"),
        "a sparse-attention indexer (it scores every earlier key for each query "
        "outside the attention function and picks the keys attention may use)",
    ),
)

# classes named like a mixer that hold one (a Mamba decoder layer) or act per token (a gated RMSNorm)
_CONTAINER = re.compile(r"Norm|ForCausalLM$|Model$|Layer$|Block$|Embedding")

# keyword arguments of the attention function: implemented by `hybrid_cp_attention_forward` ...
IMPLEMENTED_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "sliding_window",
        "is_causal",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "s_aux",
        "softcap",
        "hcp_attn_mask",
    }
)
# ... or with no effect on the attention output (position_ids: the model applied them before the call;
# the forward pre-hook checks them; shift_labels, num_items_in_batch: the loss's inputs, passed down with the
# rest; seq_idx: the document of each token, for linear-attention convolutions: the attention call reads the
# boundaries from cu_seq_lens_q; output_router_logits: the router's outputs, whose loss `router_aux` makes exact
# or refuses at the model's call). The falsy-only ones change what the model returns when true.
NEUTRAL_KWARGS = frozenset({"position_ids", "shift_labels", "num_items_in_batch", "seq_idx", "output_router_logits"})
NEUTRAL_WHEN_FALSE_KWARGS = frozenset({"use_cache", "output_attentions"})

_WHAT_TO_DO = (
    "train it without context parallelism, or use a family in "
    "hybrid_cp.integrations.model_support.VERIFIED_FAMILIES (docs/models.md)"
)


def _own_class(module: torch.nn.Module) -> type:
    """The module's class as the model defined it (FSDP2's `fully_shard` swaps in a subclass FSDP<Name>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _tokenwise(cls: type) -> bool:
    return (
        cls in TOKENWISE_TORCH
        or cls.__module__ in TOKENWISE_MODULES
        or (cls.__name__, cls.__module__) == TOKENWISE_CONV1D
    )


def _mixer_kind(cls: type) -> str | None:
    if issubclass(cls, torch.nn.Conv1d):
        return "a token-mixing convolution"
    if issubclass(cls, torch.nn.modules.conv._ConvNd) or _CONTAINER.search(cls.__name__):
        return None  # image convolutions (vision towers), containers, norms: refused as unverified
    return next((kind for pattern, kind in _MIXERS if pattern.search(cls.__name__)), None)


def _configs(config: Any) -> list[tuple[str, Any]]:
    """(prefix, config) for the model's config and its sub-configs (e.g. a text config), for messages."""
    out = [("config", config)]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.append((f"config.{key}", sub))
    return out


class _PerLayer(Exception):
    """A config field that has no single value (transformers' heterogeneous per-layer configs)."""


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    try:
        return getattr(cfg, name, default)
    except AttributeError:
        return default
    except Exception as exc:  # e.g. AmbiguousGlobalPerLayerAttributeError
        raise _PerLayer(f"{name} ({type(exc).__name__})") from exc


def _config_refusals(config: Any) -> list[str]:
    """Settings that change what attention computes in ways the engine does not implement, or that make
    the model's outputs depend on the whole sequence; each entry names the field and the fix."""
    found = []
    for where, cfg in _configs(config):
        try:
            found += _settings_refused(where, cfg)
        except _PerLayer as exc:
            found.append(
                f"{where}.{exc} varies per layer; per-layer configurations are not verified under context "
                f"parallelism: {_WHAT_TO_DO}"
            )
    return found


# every config field that switches on dropout in a causal LM's body (attention_dropout, GPT-2's attn_pdrop /
# resid_pdrop / embd_pdrop, hidden_dropout, Seed-OSS's residual_dropout, OPT's dropout and layerdrop, ...): each
# rank would draw its own masks (LayerDrop would even skip different layers, and their collectives, per rank);
# fields of classification / summary heads, which a causal LM does not run, are not among them
_DROPOUT_FIELD = re.compile(r"dropout|pdrop|layerdrop|drop_path")
_HEAD_FIELDS = ("classifier_", "summary_")


def _dropout_refused(where: str, cfg: Any) -> list[str]:
    """The dropout fields of `cfg` that are switched on, each with its fix."""
    to_dict = getattr(cfg, "to_dict", None)
    names = sorted(to_dict()) if callable(to_dict) else []
    found = []
    for name in names:
        if not _DROPOUT_FIELD.search(name) or name.startswith(_HEAD_FIELDS):
            continue
        value = _field(cfg, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(
                f"{where}.{name}={value}: dropout would draw different random masks on every rank (not "
                f"the single-process step); set it to 0.0 for context-parallel training"
            )
    return found


def _settings_refused(where: str, cfg: Any) -> list[str]:
    found = _dropout_refused(where, cfg)
    if _field(cfg, "add_cross_attention", False):
        found.append(
            f"{where}.add_cross_attention=True: cross-attention attends to encoder states, not the sharded "
            f"sequence; set it to False (decoder-only causal LMs are supported)"
        )
    chunk = _field(cfg, "attention_chunk_size")
    kinds = _field(cfg, "layer_types") or []
    if chunk is not None and not kinds:
        found.append(
            f"{where}.attention_chunk_size={chunk} without config.layer_types: which layers are chunked "
            f"is not said where the attention function reads it (Llama 4 names them "
            f"'chunked_attention' in layer_types); {_WHAT_TO_DO}"
        )
    if _field(cfg, "is_encoder_decoder", False):
        found.append(f"{where}.is_encoder_decoder=True: only decoder-only causal LMs are supported")
    allowed = ATTENTION_LAYER_TYPES + ROUTED_LAYER_TYPES + FAMILY_LAYER_TYPES.get(_field(cfg, "model_type"), ())
    other = [(i, t) for i, t in enumerate(kinds) if t not in allowed]
    if other:
        i, t = other[0]
        found.append(
            f"{where}.layer_types[{i}]={t!r} ({len(other)} of {len(kinds)} layers are not "
            f"{' or '.join(ATTENTION_LAYER_TYPES)}): such layers mix tokens outside the attention "
            f"function, and each rank would run them over its own shard only; {_WHAT_TO_DO}"
        )
    return found


def _module_refusals(
    model: torch.nn.Module, verified: set[str], whole_row: tuple[str, ...] = ()
) -> tuple[list[str], list[str]]:
    """(sequence mixers, other modules outside the allow-list), as 'name (Class)'; a mixer is named at its
    outermost level (the Mamba mixer, not its convolution). Submodules in `whole_row` (a vision-language family's
    vision tower and projector, run on the whole row by `hybrid_cp.image_row`) are not checked."""
    mixers, unverified, routed = {}, [], []
    for name, module in model.named_modules():
        cls = _own_class(module)
        where = f"{name or '<model>'} ({cls.__name__})"
        if any(name == r or name.startswith(f"{r}.") for r in whole_row):
            continue
        if any(name.startswith(f"{r}.") for r in routed):
            continue
        if cls.__name__ in ROUTED_CLASSES and cls.__name__ in verified:
            routed.append(name)
            continue
        if _tokenwise(cls) or cls.__name__ in verified:
            continue
        kind = _mixer_kind(cls)
        if kind:
            mixers[name] = f"{where} is {kind}"
        else:
            unverified.append(where)
    outer = [text for name, text in mixers.items() if not any(name.startswith(f"{other}.") for other in mixers)]
    return outer, unverified


def check_model(model: torch.nn.Module) -> None:
    """Raise ConfigError unless every module of `model` is verified exact under context parallelism.

    Local (no collective), so every rank raises the same error in `apply_context_parallel`.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    family = VERIFIED_FAMILIES.get(model_type) or VISION_LANGUAGE_FAMILIES.get(model_type)
    verified = set() if family is None else {family[0] + rest for rest in family[1].split()}
    whole_row = VISION_LANGUAGE_FAMILIES[model_type][2] if model_type in VISION_LANGUAGE_FAMILIES else ()  # image_row's
    mixers, unverified = _module_refusals(model, verified, whole_row)
    reasons = []
    if mixers:
        more = f" (and {len(mixers) - 1} more such modules)" if len(mixers) > 1 else ""
        reasons.append(
            f"module {mixers[0]}{more}: it mixes tokens along the sequence outside the attention "
            f"function that hybrid-cp replaces, so under context parallelism each rank would run it over "
            f"its own shard as if it were the whole sequence (silently wrong gradients); {_WHAT_TO_DO}"
        )
    if (
        not getattr(type(model), "_supports_attention_backend", True)
        and model_type not in REGISTRY_DISPATCH
        and model_type not in ATTENTION_FREE
    ):
        reasons.append(
            f"{type(model).__name__} does not dispatch attention through transformers' attention "
            f"registry (_supports_attention_backend=False), so hybrid-cp cannot replace its attention; "
            f"{_WHAT_TO_DO}"
        )
    reasons += _config_refusals(config)
    router = [where for where, c in _configs(config) if getattr(c, "output_router_logits", False) is True]
    why = router_aux_refusal(model) if router else None
    if why:
        reasons.append(
            f"{router[0]}.output_router_logits=True: {why}, so no auxiliary loss over the row can be made "
            f"exact under context parallelism; set it to False"
        )
    if model_type in VISION_LANGUAGE_REFUSED:
        reasons.append(
            f"model_type {model_type!r} is a vision-language family that "
            f"{VISION_LANGUAGE_REFUSED[model_type]}; {_WHAT_TO_DO}"
        )
    if model_type in REFUSED_FAMILIES:
        reasons.append(
            f"model_type {model_type!r} cannot be made exact under context parallelism: "
            f"{REFUSED_FAMILIES[model_type]}; {_WHAT_TO_DO}"
        )
    if not reasons and family is None:
        reasons.append(
            f"this model family has not been verified exact under context parallelism (every module "
            f"other than the attention function must act token by token, and each verified family "
            f"has a parity test against the single-process model): {_WHAT_TO_DO}"
        )
    if not reasons and unverified:
        reasons.append(
            f"module {unverified[0]} is not among the modules model_type {model_type!r} was verified "
            f"with ({len(unverified)} such modules) and may mix tokens along the sequence: {_WHAT_TO_DO}"
        )
    if reasons:
        raise ConfigError(
            f"apply_context_parallel refuses {type(model).__name__} (config.model_type={model_type!r}): "
            + "; also ".join(reasons)
        )


# what a vision-language call passes for its images, refused at the model under context parallelism: the vision tower
# would run on this rank's shard (and transformers' image-block mask is not what the engine reads)
MEDIA_CALL_KWARGS = (
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "image_sizes",
    "pixel_attention_mask",
    "mm_encoder_outputs",
    "input_features",
    "audio_values",
)


def media_refusal(model: torch.nn.Module, kwargs: dict[str, Any]) -> str | None:
    """Why a context-parallel model call with media must not run, or None: images given to the model itself
    (`MEDIA_CALL_KWARGS`), a vision-language family's token_type_ids (they build its image blocks), or an
    ``inputs_embeds`` row of a vision-language family without the row's `hcp.AttnMask` (it would run causally,
    its images without their bidirectional blocks). Local: no collective."""
    from ..training.batch import MASK_KEY

    name = type(model).__name__
    fix = (
        "build the row with hybrid_cp.image_row(model, input_ids, pixel_values, token_type_ids) on every rank, shard "
        "it with hcp.shard_batch({'inputs_embeds': row['inputs_embeds'], 'shift_labels': ..., 'position_ids': ...}, "
        "cp, mask=row['mask']) and call the model with that shard (docs/training.md, 'Vision-language rows')"
    )
    given = [key for key in MEDIA_CALL_KWARGS if kwargs.get(key) is not None]
    if given:
        return (
            f"{name} was called with {given} under context parallelism: the vision tower would run on this rank's "
            f"shard of the row; {fix}"
        )
    if getattr(getattr(model, "config", None), "model_type", None) not in VISION_LANGUAGE_FAMILIES:
        return None
    if kwargs.get("token_type_ids") is not None:
        return (
            f"{name} was called with token_type_ids under context parallelism: transformers would build the image "
            f"blocks from this rank's shard; {fix}"
        )
    if kwargs.get("inputs_embeds") is not None and kwargs.get(MASK_KEY) is None:
        return (
            f"{name} was called with inputs_embeds but no {MASK_KEY} under context parallelism: the row would run "
            f"causally, its images without their bidirectional blocks; {fix}"
        )
    return None


def check_attention_kwargs(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise ConfigError for a keyword argument of the attention call that hybrid-cp does not implement
    and that could change the result (anything not None, outside the known-neutral set)."""
    for name, value in kwargs.items():
        if value is None or name in IMPLEMENTED_KWARGS or name in NEUTRAL_KWARGS:
            continue
        if name in NEUTRAL_WHEN_FALSE_KWARGS and not value:
            continue
        shown = f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        hint = {
            "sinks": " (attention sinks; hybrid-cp takes a module's own sinks as s_aux)",
            "indices": " (sparse attention: the keys an indexer selected)",
        }.get(name, "")
        raise ConfigError(
            f"{type(module).__name__} passed {name}={shown}{hint} to the attention function; "
            f"hybrid-cp's attention does not implement it, and running without it would compute "
            f"something else. Remove the option, or {_WHAT_TO_DO}"
        )


_HEADS_WARNED: set[tuple[str, int, int]] = set()  # (module class, heads seen, heads stated) warned about


def check_head_layout(module: torch.nn.Module, query: torch.Tensor) -> None:
    """The attention function's query must be transformers' [B, H, S, D]; a model whose own attention code
    hands [B, S, H, D] would be run with the sequence taken for heads, silently. The config states the heads:
    ShapeError when they sit in dim 2 instead of dim 1; a warning (once per module class and count) when dim 1
    matches no stated count either (per-layer head counts exist, so that alone is not certain)."""
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if not isinstance(heads, int) or query.dim() != 4 or query.shape[1] == heads:
        return
    name = type(module).__name__
    if query.shape[2] == heads:
        raise ShapeError(
            f"{name} passed a query of shape {tuple(query.shape)} to the attention function: the "
            f"config's {heads} heads are in dim 2, so this is [B, S, H, D]; transformers' attention "
            f"functions take [B, H, S, D] (transpose(1, 2) before the call)"
        )
    key = (name, int(query.shape[1]), heads)
    if key not in _HEADS_WARNED:
        _HEADS_WARNED.add(key)
        logging.getLogger("hybrid_cp").warning(
            "%s passed a query of shape %s to the attention function: %d heads in dim 1 where the config states "
            "num_attention_heads=%d; if this is not [B, H, S, D], the sequence is being taken for heads",
            name,
            tuple(query.shape),
            query.shape[1],
            heads,
        )


__all__ = [
    "VERIFIED_FAMILIES",
    "VISION_LANGUAGE_FAMILIES",
    "VISION_LANGUAGE_REFUSED",
    "REFUSED_FAMILIES",
    "media_refusal",
    "check_model",
    "check_attention_kwargs",
    "check_head_layout",
]
