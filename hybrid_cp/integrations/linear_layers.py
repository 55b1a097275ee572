"""The linear-attention and state-space mixers of hybrid models under context parallelism (docs/linear.md).

`route_linear_layers(model, cp)` gives every Gated DeltaNet block of a verified family (Qwen3-Next) a
forward that keeps the module's own projections, gates, norm and output projection, and replaces only
the two parts that mix tokens: the short causal convolution (`recurrence.causal_conv`, with the halo
from the rank before) and the gated delta rule (`recurrence.linear_scan` over `GatedDelta`, exact
across ranks and documents). The rule runs on transformers' own torch function of the model's module
(`torch_chunk_gated_delta_rule`, its reference path without the hub dispatch); with
`HYBRID_CP_LINEAR_KERNEL=auto`, on CUDA tensors, on fla's `chunk_gated_delta_rule` when `fla` is importable;
both take an initial state and return the final one (`cuda_kernel`).

Mamba2 mixers (Bamba, Nemotron-H, Falcon-H1) get the same treatment: their in_proj (Falcon-H1's
multipliers included), gated norm and out_proj stay; the convolution over x|B|C goes through
`causal_conv` and the SSD scan through `linear_scan` over `Mamba2`: transformers' torch `mamba2_chunk_scan`
of the model's module, or (opted in, on CUDA tensors) mamba_ssm's `mamba_chunk_scan_combined` when importable (never the fused `mamba_split_conv1d_scan_combined` the module takes in training when the hub
kernel is installed: it mixes the convolution into the scan, so no halo can enter it).

The torch kernels are the default because they are the ones our parity tests verify; the CUDA kernels are
checked only against stand-ins with their signatures until `benchmarks/gpu_check.py` runs on a GPU, so they
are opt-in (`HYBRID_CP_LINEAR_KERNEL=auto`; "torch", the default, keeps the reference). The kernel is chosen
once per call from the tensors' device and what is importable (`cuda_kernel`). An error in a chosen kernel is
raised, never answered by falling back. The convolutions stay `causal_conv` (torch, exact on any device: causal-conv1d
would only be faster), and Mamba-1 stays on transformers' torch scan: mamba_ssm's `selective_scan_fn` returns
its last state without a gradient, which the state exchange needs.

More kinds on the same mechanism: LFM2's short convolution (`Lfm2ShortConv`: B * x through `causal_conv`,
then C *), Jamba's Mamba-1 mixer (conv through `causal_conv`, the selective scan through `linear_scan` over
`Mamba`, on transformers' torch `mamba_selective_scan`; its decoder layer is routed too, only to hand the
mixer the packed row's boundaries, which the layer does not pass on) and MiniMax's lightning attention
(`linear_scan` over `Lightning`, whose block-wise torch kernel is the module's own arithmetic), and Kimi Linear's
and Ling 2.5's Kimi Delta Attention (`GatedDelta` with a per-channel decay, on transformers' torch
`chunk_kimi_delta_attention`; fla's `chunk_kda` is not wired in yet, so CUDA tensors run the torch kernel too).
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..engine.layout import row_layout
from ..engine.mesh import CPMesh
from ..engine.recurrence import GatedDelta, Lightning, Mamba, Mamba2, causal_conv, linear_scan
from ..errors import ConfigError

# the Gated DeltaNet classes whose forward `_GatedDeltaNetForward` reproduces (verified by a parity test)
GATED_DELTANET_CLASSES = (
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "LaraMiniGatedDeltaNet",
    "OlmoHybridGatedDeltaNet",
)
# the Mamba2 mixers whose forward `_Mamba2Forward` reproduces (verified by a parity test)
MAMBA2_CLASSES = (
    "BambaMixer",
    "NemotronHMamba2Mixer",
    "FalconH1Mixer",
    "GraniteMoeHybridMambaLayer",
    "Mamba2Mixer",
    "Zamba2MambaMixer",
)
# LFM2's gated short convolutions, Jamba's Mamba-1 mixer, MiniMax's lightning attention (each parity-tested)
SHORT_CONV_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
MAMBA_CLASSES = ("JambaMambaMixer", "FalconMambaMixer", "MambaMixer")
LIGHTNING_CLASSES = ("MiniMaxLightningAttention",)
# Kimi Delta Attention (KDA, a gated delta rule with a per-channel decay) of Kimi Linear and Ling 2.5 (parity-tested)
KDA_CLASSES = ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention")
# decoder layers that call their mixer without the packed row's keywords (routed to pass cu_seq_lens_q on)
_LAYERS_WITHOUT_KWARGS = ("JambaMambaDecoderLayer",)


def _model_class(module: torch.nn.Module, names: tuple[str, ...] = GATED_DELTANET_CLASSES) -> type | None:
    """The module's class among `names` (also under FSDP2, which swaps in a subclass), or None."""
    return next((c for c in type(module).__mro__ if c.__name__ in names), None)


def _reference_kernel(
    module: torch.nn.Module, name: str = "torch_chunk_gated_delta_rule", names: tuple[str, ...] = GATED_DELTANET_CLASSES
):
    """transformers' torch function `name` of the module's model, without the hub-kernel dispatch."""
    fn = getattr(sys.modules[_model_class(module, names).__module__], name)
    return getattr(fn, "__wrapped__", fn)


# transformers' torch function -> the CUDA kernel with its signature (module, function, package, the package's
# first version with what the engine passes: fla 0.5.0 takes fewer q/k heads than v heads (GVA, Qwen3-Next's
# layout; before it q, k and v needed the same head count), mamba_ssm 2.0.0 has mamba_chunk_scan_combined)
CUDA_KERNELS = {
    "torch_chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fla", "0.5.0"),
    "mamba2_chunk_scan": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", "mamba_ssm", "2.0.0"),
}
# "torch" (default): transformers' reference everywhere (what the parity tests verify); "auto": the CUDA kernel on
# CUDA tensors when importable (checked against stand-ins only until gpu_check.py runs on a GPU)
KERNEL_ENV = "HYBRID_CP_LINEAR_KERNEL"
KERNEL_CHOICES = ("auto", "torch")


@lru_cache(maxsize=None)
def cuda_kernel(name: str) -> Callable | None:
    """The CUDA kernel standing in for transformers' torch function `name`, or None when it is not importable
    (an ImportError only: any other error while importing it is raised); a version older than the one the
    engine's keywords need is refused (ConfigError). Cached; `cuda_kernel.cache_clear()`."""
    module, attr, package, oldest = CUDA_KERNELS[name]
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError:
        return None
    from packaging.version import Version

    version = str(getattr(sys.modules[package], "__version__", "0"))
    if Version(version) < Version(oldest):
        raise ConfigError(
            f"{package} {version} is installed, but its {attr} is used from {package} {oldest} on "
            f"(the keywords and head layout the linear layers pass): upgrade {package}, or set "
            f"{KERNEL_ENV}=torch (the default) for transformers' torch reference"
        )
    return fn


def kernel_choice() -> str:
    """`HYBRID_CP_LINEAR_KERNEL` (default "torch"), refused when it is not one of KERNEL_CHOICES."""
    choice = os.environ.get(KERNEL_ENV, "torch").strip().lower() or "torch"
    if choice not in KERNEL_CHOICES:
        raise ConfigError(
            f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r} is not one of {KERNEL_CHOICES}: unset it (or "
            f"'torch') for transformers' reference, 'auto' for fla / mamba_ssm on CUDA when installed"
        )
    return choice


def _kernel_for(module: torch.nn.Module, device: torch.device, name: str, names: tuple[str, ...]) -> Callable:
    """The kernel one call of the module's recurrence runs on: the CUDA kernel for CUDA tensors when it is
    importable and opted into (`HYBRID_CP_LINEAR_KERNEL=auto`), else transformers' torch function `name`."""
    if kernel_choice() == "auto" and torch.device(device).type == "cuda" and name in CUDA_KERNELS:
        fn = cuda_kernel(name)
        if fn is not None:
            return fn
    return _reference_kernel(module, name, names)


def _refuse_cache(m: torch.nn.Module, cache: Any, kwargs: dict) -> None:
    if cache is not None or kwargs.get("cache_params") is not None:
        raise ConfigError(
            f"{type(m).__name__} received a cache: generation is not supported under context "
            f"parallelism; run it on one device"
        )


def _call_layout(cp: CPMesh, m: torch.nn.Module, hidden_states: torch.Tensor, cache: Any, kwargs: dict):
    """A routed mixer's call: a cache refused, then the rows' layout (packed documents from `cu_seq_lens_q`).
    A mixer that gets no boundaries while the model was called with a packed row raises: its model or layer
    dropped them on the way (pure Mamba / Mamba2 / RWKV models call their blocks without `**kwargs`), and the
    scan would run across documents."""
    _refuse_cache(m, cache, kwargs)
    if kwargs.get("cu_seq_lens_q") is None and getattr(m.__dict__.get("_hybrid_cp_mesh"), "packed", False):
        raise ConfigError(
            f"{type(m).__name__} received no cu_seq_lens_q although the model was called with a packed "
            f"row: its model or decoder layer does not pass the row's document boundaries on to it, so "
            f"its scan would run across documents. Packed rows are not supported for this family; "
            f"pass dense (padded) rows"
        )
    return row_layout(
        cp, local_len=hidden_states.shape[1], cu_seqlens=kwargs.get("cu_seq_lens_q"), causal=True, what=type(m).__name__
    )


class _Routed:
    """A routed mixer's forward. Its mesh is the model's mesh of the current call (`use_mesh` switches it per
    micro-batch of a dynamic schedule), read from the module's mesh reference that `apply_context_parallel`
    sets; the mesh it was routed with until then. `dynamic_verified`: whether training on mixed degrees was
    verified against one process (`use_mesh` refuses the others)."""

    dynamic_verified = False

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        self.module, self._cp = module, cp

    @property
    def cp(self) -> CPMesh:
        ref = self.module.__dict__.get("_hybrid_cp_mesh")
        return self._cp if ref is None else ref.cp


class _GatedDeltaNetForward(_Routed):
    """The block's forward with the convolution and the recurrence made context parallel."""

    # tests/test_dynamic_cp.py: the recurrence and convolution in fp64 on the schedule's groups of degree 1, 2
    # and 4 equal one device to 7e-16; tiny Qwen3.5 trained on mixed degrees in fp32 within round-off
    dynamic_verified = True

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        super().__init__(module, cp)

    def kind(self, device: torch.device) -> GatedDelta:
        """The recurrence on the kernel chosen for tensors on `device` (`_kernel_for`)."""
        kernel = _kernel_for(self.module, device, "torch_chunk_gated_delta_rule", GATED_DELTANET_CLASSES)
        return GatedDelta(kernel, use_qk_l2norm_in_kernel=True)

    def __call__(
        self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        from transformers.activations import ACT2FN

        m = self.module
        lay = _call_layout(self.cp, m, hidden_states, cache, kwargs)
        if attention_mask is not None:  # what the block does itself (the pre-hook drops right-padding masks)
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        mixed, z, b, a = _projections(m, hidden_states)
        weight = m.conv1d.weight.squeeze(1)
        mixed = ACT2FN[m.activation](causal_conv(self.cp, lay, mixed.to(weight.dtype), weight, m.conv1d.bias))
        q, k, v = mixed.to(hidden_states.dtype).split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        shape = (q.shape[0], q.shape[1], -1)
        q, k = q.reshape(*shape, m.head_k_dim), k.reshape(*shape, m.head_k_dim)
        v = v.reshape(*shape, m.head_v_dim)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        beta = b.sigmoid() * 2.0 if getattr(m, "allow_neg_eigval", False) else b.sigmoid()  # OLMo: beta in [0, 2]
        core = linear_scan(self.cp, lay, self.kind(q.device), (q, k, v, g, beta))
        norm, out_proj = (m.o_norm, m.o_proj) if hasattr(m, "o_norm") else (m.norm, m.out_proj)
        out = norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
        return out_proj(out.reshape(z.shape).reshape(z.shape[0], z.shape[1], -1))


def _projections(m: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The block's own input projections: (q|k|v before the convolution [B, S, 2 key_dim + value_dim],
    the gate z [B, S, Hv, dv], b and a [B, S, Hv]), for Qwen3-Next's fused, Qwen3.5's and OLMo hybrid's separate
    ones."""
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: fused projections, interleaved per key head
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
        return torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1), z, b, a
    if hasattr(m, "g_proj"):  # OLMo hybrid: q, k, v, a, b each its own projection, the gate from g_proj
        z = m.g_proj(h)
        qkv = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
        return qkv, z.reshape(z.shape[0], z.shape[1], -1, m.head_v_dim), m.b_proj(h), m.a_proj(h)
    z = m.in_proj_z(h)
    return m.in_proj_qkv(h), z.reshape(z.shape[0], z.shape[1], -1, m.head_v_dim), m.in_proj_b(h), m.in_proj_a(h)


class _Mamba2Forward(_Routed):
    """The Mamba2 mixer's forward (Bamba's, Nemotron-H's; Falcon-H1's with its multipliers and optional
    norm) with the convolution and the SSD scan made context parallel."""

    dynamic_verified = True  # tests/test_dynamic_cp.py (Bamba)

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        super().__init__(module, cp)

    def kind(self, device: torch.device) -> Mamba2:
        """The SSD recurrence on the kernel chosen for tensors on `device` (`_kernel_for`)."""
        m = self.module
        kernel = _kernel_for(m, device, "mamba2_chunk_scan", MAMBA2_CLASSES)
        return Mamba2(kernel, -torch.exp(m.A_log.float()), m.chunk_size, m.D, m.dt_bias, m.time_step_limit)

    def __call__(
        self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        from transformers.activations import ACT2FN

        m, dtype = self.module, hidden_states.dtype
        lay = _call_layout(self.cp, m, hidden_states, cache, kwargs)
        hidden_states = _masked(hidden_states, attention_mask)
        falcon = hasattr(m, "mup_vector")
        proj = m.in_proj(hidden_states * m.ssm_in_multiplier if falcon else hidden_states)
        proj = proj * m.mup_vector if falcon else proj
        gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        weight = m.conv1d.weight.squeeze(1)
        xbc = ACT2FN[m.activation](causal_conv(self.cp, lay, xbc.to(weight.dtype), weight, m.conv1d.bias))
        xbc = _masked(xbc.to(dtype), attention_mask)
        groups = m.n_groups * m.ssm_state_size
        x, b, c = xbc.split([m.intermediate_size, groups, groups], dim=-1)
        shape = (x.shape[0], x.shape[1])
        y = linear_scan(
            self.cp,
            lay,
            self.kind(x.device),
            (
                x.reshape(*shape, m.num_heads, m.head_dim),
                dt,
                b.reshape(*shape, m.n_groups, -1),
                c.reshape(*shape, m.n_groups, -1),
            ),
        )
        y = y.reshape(*shape, -1)
        y = y * F.silu(gate) if falcon and not m.mamba_rms_norm else m.norm(y, gate)
        return m.out_proj(y.to(dtype))


class _ShortConvForward(_Routed):
    """LFM2's gated short convolution: in_proj -> B, C, x; C * causal_conv(B * x) -> out_proj."""

    # tests/test_dynamic_cp.py: the short convolution in fp64 on the schedule's groups of degree 1, 2 and 4 equals
    # one device to 5e-16; tiny LFM2 trained on mixed degrees in fp32 within round-off (fp64: 9e-13)
    dynamic_verified = True

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        super().__init__(module, cp)

    def __call__(
        self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        m = self.module
        lay = _call_layout(self.cp, m, hidden_states, cache, kwargs)
        b, c, x = m.in_proj(_masked(hidden_states, attention_mask)).chunk(3, dim=-1)
        weight = m.conv.weight.squeeze(1)
        conv = causal_conv(self.cp, lay, (b * x).to(weight.dtype), weight, m.conv.bias).to(hidden_states.dtype)
        return m.out_proj(c * conv)


class _MambaForward(_Routed):
    """Jamba's, Falcon-Mamba's and Mamba's Mamba-1 mixer: in_proj -> x | gate; silu(causal_conv(x)); x_proj -> dt, B, C
    with their RMSNorms (none in Mamba);
    dt_proj's weight (its bias goes into the scan's softplus); the selective scan; * silu(gate); out_proj."""

    # tests/test_dynamic_cp.py: the convolution and selective scan in fp64 on the schedule's groups of degree 1, 2
    # and 4 equal one device to 1.1e-15; tiny Jamba trained on mixed degrees in fp32 within round-off (pure Mamba
    # and Falcon-Mamba models pass no packed row's boundaries to their mixers: `_call_layout` refuses packed rows)
    dynamic_verified = True

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        super().__init__(module, cp)
        self.kernel = _reference_kernel(module, "mamba_selective_scan", MAMBA_CLASSES)

    def __call__(
        self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        from transformers.activations import ACT2FN

        m, dtype = self.module, hidden_states.dtype
        lay = _call_layout(self.cp, m, hidden_states, cache, kwargs)
        x, gate = m.in_proj(_masked(hidden_states, attention_mask)).chunk(2, dim=-1)
        weight = m.conv1d.weight.squeeze(1)
        x = ACT2FN[m.activation](causal_conv(self.cp, lay, x.to(weight.dtype), weight, m.conv1d.bias))
        x = _masked(x.to(dtype), attention_mask)
        dt, b, c = m.x_proj(x).split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        dt = _norm(
            m, "dt_layernorm", dt
        )  # dt_proj without its bias, as the module computes it (quantized: the layer, - bias)
        dt = m.dt_proj(dt) - m.dt_proj.bias if hasattr(m.config, "_is_quantized") else F.linear(dt, m.dt_proj.weight)
        bias = None if m.dt_proj.bias is None else m.dt_proj.bias.float()
        kind = Mamba(self.kernel, -torch.exp(m.A_log.float()), m.D.float(), bias)
        y = linear_scan(self.cp, lay, kind, (x, dt, _norm(m, "b_layernorm", b), _norm(m, "c_layernorm", c)))
        return m.out_proj((y * F.silu(gate)).to(dtype))


def _norm(m: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The mixer's norm `name` on x (Jamba's and Falcon-Mamba's dt/B/C norms), or x where the mixer has none (Mamba)."""
    norm = getattr(m, name, None)
    return x if norm is None else norm(x)


class _MambaLayerForward:
    """Jamba's Mamba decoder layer (norm, mixer, residual; norm, MLP or MoE, residual), handing the mixer
    the packed row's boundaries."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        position_ids: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        m = self.module
        _refuse_cache(m, cache, kwargs)
        h = hidden_states + m.mamba(
            hidden_states=m.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
        )
        return h + m.feed_forward(m.pre_ff_layernorm(h))


class _LightningForward(_Routed):
    """MiniMax's lightning attention: act(qkv_proj) -> q, k, v per head; the decayed linear attention; RMSNorm;
    * sigmoid(output_gate(input)); out_proj. Returns (output, None) as the module does (no cache)."""

    # tests/test_dynamic_cp.py: the block-wise decayed linear attention in fp64 on the schedule's groups of degree 1,
    # 2 and 4 equals one device to 1.8e-15; tiny MiniMax trained on mixed degrees in fp32 within round-off
    dynamic_verified = True

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        super().__init__(module, cp)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        m = self.module
        lay = _call_layout(self.cp, m, hidden_states, cache, kwargs)
        qkv = _masked(m.act_fn(m.qkv_proj(hidden_states)), attention_mask)
        b, s = qkv.shape[:2]
        q, k, v = qkv.reshape(b, s, m.num_attention_heads, 3 * m.head_dim).split(m.head_dim, dim=3)
        out = linear_scan(self.cp, lay, Lightning(m.slope_rate.reshape(-1), m.block_size), (q, k, v))
        out = m.norm(out.reshape(b, s, -1))
        return m.out_proj(torch.sigmoid(m.output_gate(hidden_states)) * out), None


class _KimiDeltaForward(_Routed):
    """Kimi Delta Attention (Kimi Linear's, Ling 2.5's): q|k|v -> act(causal_conv); the forget gate's per-channel
    log-decay g [B, S, H, dk] and beta = sigmoid(b_proj); the gated delta rule (`GatedDelta` on transformers' torch
    `chunk_kimi_delta_attention`: the state's columns still evolve independently, so the probe holds); o_norm gated by
    Kimi's low-rank g_a/g_b projection or Ling's g_proj; o_proj."""

    # tests/test_dynamic_cp.py: the rule with its per-channel decay and the convolution in fp64 on the schedule's
    # groups of degree 1, 2 and 4 equal one device to 5e-16; tiny Kimi Linear trained on mixed degrees in fp32
    # within round-off
    dynamic_verified = True

    def __init__(self, module: torch.nn.Module, cp: CPMesh):
        super().__init__(module, cp)
        self.kind = GatedDelta(
            _reference_kernel(module, "chunk_kimi_delta_attention", KDA_CLASSES), use_qk_l2norm_in_kernel=True
        )

    def __call__(
        self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        from transformers.activations import ACT2FN

        m = self.module
        lay = _call_layout(self.cp, m, hidden_states, cache, kwargs)
        h = _masked(hidden_states, attention_mask)
        mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
        weight = m.conv1d.weight.squeeze(1)
        mixed = ACT2FN[m.activation](causal_conv(self.cp, lay, mixed.to(weight.dtype), weight, m.conv1d.bias))
        shape = (h.shape[0], h.shape[1], -1, m.head_dim)
        q, k, v = (x.reshape(shape) for x in mixed.to(h.dtype).split([m.qkv_dim] * 3, dim=-1))
        core = linear_scan(self.cp, lay, self.kind, (q, k, v, m.forget_gate(h), torch.sigmoid(m.b_proj(h))))
        gate = m.g_proj(h) if hasattr(m, "g_proj") else m.g_b_proj(m.g_a_proj(h))
        return m.o_proj(m.o_norm(core, gate.reshape(shape)).reshape(h.shape[0], h.shape[1], -1))


def _masked(h: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """What the mixers do with a padding mask (the pre-hook drops right-padding masks)."""
    return h if attention_mask is None else (h * attention_mask[:, :, None]).to(h.dtype)


# routed class names -> the forward that replaces theirs
_ROUTES = (
    (GATED_DELTANET_CLASSES, _GatedDeltaNetForward),
    (MAMBA2_CLASSES, _Mamba2Forward),
    (SHORT_CONV_CLASSES, _ShortConvForward),
    (MAMBA_CLASSES, _MambaForward),
    (LIGHTNING_CLASSES, _LightningForward),
    (KDA_CLASSES, _KimiDeltaForward),
)
# every routed mixer class (the guard, `model_support`, accepts these in the families verified with them)
ROUTED_CLASSES = tuple(name for names, _ in _ROUTES for name in names)


def is_routed(module: torch.nn.Module) -> bool:
    """Whether `route_linear_layers` gives this module its own forward (a mixer in `ROUTED_CLASSES`)."""
    return _model_class(module, ROUTED_CLASSES) is not None


def route_linear_layers(model: torch.nn.Module, cp: CPMesh) -> int:
    """Route every Gated DeltaNet block, Mamba2 and Mamba mixer, short convolution and lightning attention of
    `model` through its context-parallel forward; returns how many mixers were routed (the guard,
    `model_support.check_model`, has refused every other mixer). A bad `HYBRID_CP_LINEAR_KERNEL` raises here,
    before any forward."""
    kernel_choice()
    routed = 0
    for module in model.modules():
        if _model_class(module, _LAYERS_WITHOUT_KWARGS) is not None:
            module.__dict__["forward"] = _MambaLayerForward(module)
        route = next((fwd for names, fwd in _ROUTES if _model_class(module, names) is not None), None)
        if route is not None:
            module.__dict__["forward"] = route(module, cp)
            routed += 1
    return routed


__all__ = [
    "CUDA_KERNELS",
    "KERNEL_ENV",
    "KERNEL_CHOICES",
    "cuda_kernel",
    "kernel_choice",
    "GATED_DELTANET_CLASSES",
    "MAMBA2_CLASSES",
    "SHORT_CONV_CLASSES",
    "MAMBA_CLASSES",
    "LIGHTNING_CLASSES",
    "KDA_CLASSES",
    "ROUTED_CLASSES",
    "is_routed",
    "route_linear_layers",
]
