"""The shape of a transformer as the cost and memory models read it, and the presets of known models.

Only what decides attention cost, communication and memory: heads, widths, layer counts (attention,
sliding-window, chunked and linear layers), the vocabulary and, for MoE models, the idle experts' weights.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ModelShape", "MODEL_PRESETS"]


class ModelShape(BaseModel):
    """The parts of a transformer that decide attention cost, communication and memory.

    ``hidden`` defaults to ``heads * head_dim``; ``intermediate`` (MLP width) to ``4 * hidden`` with a
    plain 2-matrix MLP, else a gated (SwiGLU, 3-matrix) MLP when ``gated_mlp`` is true. For MoE models
    give the *active* width (experts per token x expert width + shared experts), which prices the compute,
    and ``expert_params``, the idle experts' weights, which memory holds. Hybrid models give
    ``linear_layers`` (how many of ``layers`` are linear), ``linear_kind`` and the linear block's sizes;
    the attention terms count the other layers (docs/planner.md, section 4.2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    heads: int = Field(ge=1, description="attention (query) heads")
    kv_heads: int | None = Field(default=None, ge=1, description="key/value heads (default: heads, MHA)")
    head_dim: int = Field(ge=1, description="attention head dimension")
    hidden: int | None = Field(default=None, ge=1, description="model width (default: heads x head_dim)")
    layers: int = Field(default=32, ge=1, description="decoder layers")
    intermediate: int | None = Field(default=None, ge=1, description="MLP width (default: 4 x hidden, plain MLP)")
    gated_mlp: bool = Field(default=True, description="a gated (SwiGLU, 3-matrix) MLP when intermediate is given")
    vocab: int = Field(default=0, ge=0, description="embedding + LM head size, for model-state memory")
    sliding_window: int | None = Field(default=None, ge=1, description="keys each query sees in window layers")
    window_layers: int | None = Field(default=None, ge=0, description="layers with the window (default: all)")
    attention_chunk_size: int | None = Field(
        default=None, ge=1, description="positions of one attention chunk in chunked layers (Llama 4)"
    )
    chunked_layers: int | None = Field(default=None, ge=0, description="layers with chunked attention (default: all)")
    linear_layers: int = Field(default=0, ge=0, description="of `layers`, how many are linear (hybrid models)")
    linear_kind: Literal["gated_delta", "mamba2"] | None = Field(
        default=None, description="the linear layers' recurrence"
    )
    linear_heads: int | None = Field(default=None, ge=1, description="Gated DeltaNet value heads / Mamba2 heads")
    linear_key_heads: int | None = Field(default=None, ge=1, description="Gated DeltaNet key heads / Mamba2 groups")
    linear_key_dim: int | None = Field(default=None, ge=1, description="Gated DeltaNet dk / Mamba2 state size N")
    linear_value_dim: int | None = Field(default=None, ge=1, description="Gated DeltaNet dv / Mamba2 head dim P")
    linear_conv: int = Field(default=4, ge=1, description="causal convolution kernel of the linear layers")
    linear_chunk: int = Field(default=64, ge=1, description="chunk of the chunked recurrence kernel (tokens)")
    expert_params: int = Field(
        default=0,
        ge=0,
        description="MoE: weights of the experts a token does not use, all "
        "layers together (held in memory and sharded, never computed)",
    )
    name: str = "custom"

    @model_validator(mode="after")
    def _check(self) -> "ModelShape":
        for name in ("window_layers", "chunked_layers"):
            if (getattr(self, name) or 0) > self.layers:
                raise ValueError(f"{name}={getattr(self, name)} exceeds layers={self.layers}")
        if self.sliding_window and self.attention_chunk_size:
            if self.window_layers is None or self.chunked_layers is None:
                raise ValueError(
                    "a model with both sliding_window and attention_chunk_size needs window_layers and "
                    "chunked_layers: how many layers of each kind"
                )
            if self.window_layers + self.chunked_layers > self.layers:
                raise ValueError(
                    f"window_layers={self.window_layers} + chunked_layers={self.chunked_layers} exceeds "
                    f"layers={self.layers}"
                )
        self._check_linear()
        kv = self.kv_heads or self.heads
        if kv > self.heads or self.heads % kv:
            raise ValueError(
                f"heads={self.heads} must be a multiple of kv_heads={kv} (grouped-query attention shares "
                "each KV head among heads/kv_heads query heads)"
            )
        return self

    def _check_linear(self) -> None:
        dims = ("linear_heads", "linear_key_heads", "linear_key_dim", "linear_value_dim")
        if self.linear_layers > self.layers:
            raise ValueError(f"linear_layers={self.linear_layers} exceeds layers={self.layers}")
        if self.linear_layers and self.linear_kind is None:
            raise ValueError(f"linear_layers={self.linear_layers} needs linear_kind='gated_delta' or 'mamba2'")
        if self.linear_layers and (missing := [d for d in dims if getattr(self, d) is None]):
            raise ValueError(f"linear_kind={self.linear_kind!r} needs {', '.join(missing)} (the linear block's sizes)")
        if self.linear_layers and self.linear_heads % self.linear_key_heads:
            raise ValueError(
                f"linear_heads={self.linear_heads} must be a multiple of linear_key_heads="
                f"{self.linear_key_heads} (key heads / groups are shared by value heads)"
            )
        if self.linear_kind is not None and not self.linear_layers:
            raise ValueError(f"linear_kind={self.linear_kind!r} with linear_layers=0: give how many layers are linear")

    @property
    def attention_layers(self) -> int:
        """Softmax-attention layers (all but the linear ones)."""
        return self.layers - self.linear_layers

    @property
    def linear_state_numel(self) -> int:
        """Numbers of one run's summary (M and E) per batch row, as the engine gathers them: Gated DeltaNet
        Hv*dk*(dk+dv) (dense dk x dk transition, dk x dv state), Mamba2 H*(1+P*N) (scalar decay, P x N)."""
        if not self.linear_layers:
            return 0
        h, dk, dv = self.linear_heads, self.linear_key_dim, self.linear_value_dim
        return h * dk * (dk + dv) if self.linear_kind == "gated_delta" else h * (1 + dv * dk)

    @property
    def linear_transition_numel(self) -> int:
        """The transition M's share of `linear_state_numel` (the scan leaves it out where it is not used):
        Gated DeltaNet Hv*dk*dk, Mamba2 H."""
        if not self.linear_layers:
            return 0
        h, dk = self.linear_heads, self.linear_key_dim
        return h * dk * dk if self.linear_kind == "gated_delta" else h

    @property
    def linear_conv_channels(self) -> int:
        """Channels of the linear block's causal convolution: q|k|v (Gated DeltaNet), x|B|C (Mamba2)."""
        if not self.linear_layers:
            return 0
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_heads * self.linear_value_dim

    @property
    def linear_layer_params(self) -> int:
        """Weights of one linear layer: its input projections (conv channels, the output gate z and the
        per-head gates: beta and g, or dt), its output projection, and the MLP (norms, conv ignored)."""
        inner = self.linear_heads * self.linear_value_dim
        per_head = 2 if self.linear_kind == "gated_delta" else 1
        h = self.d_model
        return h * (self.linear_conv_channels + inner + per_head * self.linear_heads) + inner * h + self._mlp_params

    @property
    def _mlp_params(self) -> int:
        if self.intermediate is None:
            return 8 * self.d_model * self.d_model
        return (3 if self.gated_mlp else 2) * self.d_model * self.intermediate

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_model(self) -> int:
        return self.hidden or self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer: Q, K, V, O projections and the MLP (norms ignored)."""
        h, q, kv = self.d_model, self.heads * self.head_dim, self.n_kv * self.head_dim
        return h * q + 2 * h * kv + q * h + self._mlp_params

    @property
    def params(self) -> int:
        linear = self.linear_layers * self.linear_layer_params if self.linear_layers else 0
        return self.attention_layers * self.layer_params + linear + 2 * self.vocab * self.d_model

    @property
    def held_params(self) -> int:
        """Weights held in memory: `params` (the ones a token computes with) and, for MoE, the other experts."""
        return self.params + self.expert_params

    @property
    def held_layer_params(self) -> int:
        """One layer's weights held when FSDP2 unshards it (MoE: all its experts; spread evenly over the layers)."""
        return self.layer_params + self.expert_params // self.layers

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Known shapes (``llama3-8b``, ``llama3-70b``, ``glm-4.5-air``, ``llama2-7b``, ``qwen3-next-80b``)."""
        key = name.lower()
        if key not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}")
        return cls(name=key, **MODEL_PRESETS[key])


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Values from the models' Hugging Face config.json files.
    "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32, intermediate=14336, vocab=128256),
    "llama3-70b": dict(heads=64, kv_heads=8, head_dim=128, hidden=8192, layers=80, intermediate=28672, vocab=128256),
    "llama2-7b": dict(heads=32, kv_heads=32, head_dim=128, hidden=4096, layers=32, intermediate=11008, vocab=32000),
    # GLM-4.5-Air (MoE, 12B active, 106B in all): 8 of 128 routed experts of width 1408 + 1 shared expert active
    # per token; the other 120 are held in each of the 45 MoE layers (the first layer is dense).
    "glm-4.5-air": dict(
        heads=96,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        layers=46,
        intermediate=9 * 1408,
        vocab=151552,
        expert_params=(128 - 8) * 3 * 4096 * 1408 * 45,
    ),
    # Qwen3-Next-80B-A3B: 3 Gated DeltaNet layers to 1 gated-attention layer (full_attention_interval 4); MoE with
    # 10 routed experts + 1 shared expert of width 512 active per token. The attention's output gate is ignored.
    "qwen3-next-80b": dict(
        heads=16,
        kv_heads=2,
        head_dim=256,
        hidden=2048,
        layers=48,
        intermediate=11 * 512,
        vocab=151936,
        linear_layers=36,
        linear_kind="gated_delta",
        linear_heads=32,
        linear_key_heads=16,
        linear_key_dim=128,
        linear_value_dim=128,
        linear_conv=4,
        expert_params=(512 - 10) * 3 * 2048 * 512 * 48,
    ),  # 502 of 512 experts idle: 80B in all
}
