"""PyTorch's fused scaled-dot-product attention operators that also return the log-sum-exp.

CPU: the flash-attention CPU operator (fp32/bf16/fp16). CUDA: the memory-efficient operator
(fp32/bf16/fp16), whose backward takes out and lse directly. It is the portable CUDA fallback (it
also takes fp32), not the fast one: the CUDA flash operators' backward takes an external out/lse
too and is wrapped as the `torch-flash` kernel (torch_flash.py); cuDNN attention is `cudnn` and
FlashAttention-4 `fa4`. backend="auto" picks among them on CUDA. GQA is handled here by repeating
KV heads for the call and summing their gradients back (local to one block).
"""

from __future__ import annotations

import torch

from ..heads import expand_kv, reduce_kv
from .varlen import per_segment_backward, per_segment_forward, window_mask


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> a [B, H, S, D] view of [B, S, H, D] memory, the layout these operators
    produce and expect (the CUDA memory-efficient backward reads garbage from other layouts)."""
    return x.contiguous().transpose(1, 2)


def _window_bias(q: torch.Tensor, k: torch.Tensor, window) -> torch.Tensor | None:
    """The additive mask (0 / -inf, in q's dtype) of a window block, for the CPU operator; windows
    on CUDA need a kernel with native windows (flash-attn) or the math backend."""
    if window is None:
        return None
    if q.device.type != "cpu":
        raise ValueError(
            "the CUDA SDPA backend has no verified window path; use backend='torch-flash' (native "
            "windows, no install), backend='flash' (flash-attn) or backend='math' for "
            "sliding-window attention on CUDA"
        )
    visible = window_mask(q.shape[1], k.shape[1], window, q.device)
    return torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))


class SDPAKernel:
    name = "sdpa"
    refuses = {"cuda": ("window",)}  # see _window_bias: "auto" and the self-test skip windows here on CUDA

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type == "cpu":
            # The CPU operator accepts fp64 but computes its log-sum-exp to fp32 precision
            # only (measured: 4e-8 relative), so fp64 goes to the exact math backend instead.
            return (
                None
                if dtype in (torch.float32, torch.bfloat16, torch.float16)
                else f"the CPU operator takes fp32/bf16/fp16, not {dtype} (use backend='math' for fp64)"
            )
        if device.type == "cuda":
            if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                return f"the CUDA operators take fp32/bf16/fp16, not {dtype}"
            return None
        return f"device type {device.type!r} has no fused SDPA operator with log-sum-exp"

    @per_segment_forward
    def forward(self, q, k, v, *, causal: bool, scale: float, window=None):
        mask = _window_bias(q, k, window)
        h = q.shape[2]
        qt, kt, vt = _bhsd(q), _bhsd(expand_kv(k, h)), _bhsd(expand_kv(v, h))
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, attn_mask=mask, scale=scale
            )
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=scale
            )[:2]
        return out.transpose(1, 2), lse[..., : q.shape[1]].float()

    @per_segment_backward
    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, window=None):  # noqa: PLR0913 (kernel protocol)
        mask = _window_bias(q, k, window)
        h, hkv = q.shape[2], k.shape[2]
        qt, kt, vt = _bhsd(q), _bhsd(expand_kv(k, h)), _bhsd(expand_kv(v, h))
        dot, ot = _bhsd(dout), _bhsd(out)
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse.float(), 0.0, causal, attn_mask=mask, scale=scale
            )
        else:
            pad = (-q.shape[1]) % 32
            lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
            no_rng = torch.zeros((), dtype=torch.int64)  # what the forward returns without dropout
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dot,
                qt,
                kt,
                vt,
                None,
                ot,
                lse_p.contiguous(),
                no_rng,
                no_rng,
                0.0,
                [True, True, True, False],
                causal,
                scale=scale,
            )
        return (dq.transpose(1, 2), reduce_kv(dk.transpose(1, 2), hkv), reduce_kv(dv.transpose(1, 2), hkv))
