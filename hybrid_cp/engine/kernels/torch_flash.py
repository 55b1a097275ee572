"""PyTorch's own FlashAttention-2 operators (in every CUDA build of PyTorch; nothing to install).

`aten::_flash_attention_forward/_flash_attention_backward` take our [B, S, H, D] layout directly,
handle GQA natively (dK/dV come back with H_kv heads, no KV repeat), pack documents through
cum_seq_q/cum_seq_k ([total, H, D] tensors, lse [H, total]) and take flash-attn's window sizes.
The backward takes an external out and lse, so it accepts the ring's final merged ones (PyTorch's
own context parallelism calls it exactly that way). Causal with Sq != Sk is bottom-right aligned,
like our convention (the engine only asks for square causal blocks anyway).

Pitfalls handled here (see docs/benchmarks.md, "GPU kernels"): the kernel reads lse with its own
strides assumed contiguous, so lse is passed `.contiguous()`; the rng/philox tensors are only read
with dropout, so empty ones are passed; the backward is deterministic when
`torch.use_deterministic_algorithms(True)` is set (the operator reads that global flag itself).
Schema checked against torch 2.13 (tests/test_gpu_kernel_adapters.py binds every call to it).
"""

from __future__ import annotations

import torch

from ._cuda import aten_op as _op
from ._cuda import capability as _capability
from ._cuda import fa_class_reason


def _no_rng(device: torch.device) -> torch.Tensor:
    """What the backward's rng_state/unused arguments get without dropout (never read)."""
    return torch.empty(0, dtype=torch.uint64, device=device)


def _window(window) -> dict:
    if window is None:
        return {}
    left, right = window
    return {"window_size_left": int(left), "window_size_right": int(right)}


class TorchFlashKernel:
    name = "torch-flash"

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        reason = fa_class_reason("PyTorch's flash operator", device, dtype, head_dim)
        if reason:
            return reason
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return f"this torch ({torch.__version__}) has no aten::_flash_attention_forward"
        major, minor = _capability(device)
        if major < 8:
            return f"PyTorch's flash operators need sm80 or newer, this GPU is sm{major}{minor}"
        return None

    def forward(  # noqa: PLR0913 (kernel protocol)
        self,
        q,
        k,
        v,
        *,
        causal: bool,
        scale: float,
        window=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
    ):
        fwd = _op("_flash_attention_forward")
        q, k, v = (x.contiguous() for x in (q, k, v))
        if cu_seqlens_q is None:
            res = fwd(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale, **_window(window))
            return res[0], res[1].float()
        # packed segments: [1, total, H, D] -> [total, H, D]; lse comes back [H, total]
        res = fwd(
            q[0],
            k[0],
            v[0],
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            0.0,
            causal,
            False,
            scale=scale,
            **_window(window),
        )
        return res[0].unsqueeze(0), res[1].float().unsqueeze(0)

    def backward(  # noqa: PLR0913 (kernel protocol)
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        *,
        causal: bool,
        scale: float,
        window=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
    ):
        bwd = _op("_flash_attention_backward")
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        lse = lse.float().contiguous()
        rng = _no_rng(q.device)
        if cu_seqlens_q is None:
            return tuple(
                bwd(
                    dout,
                    q,
                    k,
                    v,
                    out,
                    lse,
                    None,
                    None,
                    q.shape[1],
                    k.shape[1],
                    0.0,
                    causal,
                    rng,
                    rng,
                    scale=scale,
                    **_window(window),
                )
            )
        dq, dk, dv = bwd(
            dout[0],
            q[0],
            k[0],
            v[0],
            out[0],
            lse[0].contiguous(),
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            0.0,
            causal,
            rng,
            rng,
            scale=scale,
            **_window(window),
        )
        return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)
