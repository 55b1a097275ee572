"""cuDNN attention through PyTorch (in every CUDA build of PyTorch; nothing to install).

`aten::_scaled_dot_product_cudnn_attention` and its backward: [B, H, S, D] views of our
[B, S, H, D] memory, lse [B, H, Sq, 1] fp32; the backward takes an external out and lse, so the
ring's merged ones. Choices and pitfalls (see docs/benchmarks.md, "GPU kernels"):

- Causal is TOP-LEFT aligned in cuDNN. The engine only asks for square causal blocks, where top-left
  and bottom-right agree; a rectangular causal block is refused with an error, never computed.
- The dense backward uses the max_q/max_k it is given as the block's lengths: they are Sq and Sk.
- GQA: the dense operator takes one head count for Q, K and V, so K/V heads are repeated for the
  call and their gradients summed back (as the sdpa kernel does).
- Packed documents run as one call per segment (varlen.py; reads the boundaries on the host, one
  sync per call). Sliding windows are not taken (no `window` keyword): cuDNN's sliding window is
  not exposed by the PyTorch operator, and its bias path has open NaN bugs; use torch-flash.
- Known cuDNN bugs with lengths that are not a multiple of 128 (pytorch#169849, #171627) are why
  "auto" runs a self-test on the GPU before it uses this kernel.
"""

from __future__ import annotations

import torch

from ..heads import expand_kv, reduce_kv
from ._cuda import aten_op as _op
from ._cuda import capability as _capability
from .varlen import per_segment_backward, per_segment_forward


def _cudnn_version() -> int:
    return torch.backends.cudnn.version() or 0


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> a [B, H, S, D] view of contiguous [B, S, H, D] memory (what the operator returns)."""
    return x.contiguous().transpose(1, 2)


def _check_causal(causal: bool, sq: int, sk: int) -> None:
    if causal and sq != sk:
        raise ValueError(
            f"the cudnn kernel got a causal block of {sq} queries x {sk} keys; cuDNN aligns causal "
            f"masks top-left, which differs from the bottom-right convention unless the block is "
            f"square. Use backend='torch-flash' (bottom-right) for rectangular causal blocks"
        )


class CuDNNKernel:
    name = "cudnn"

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type != "cuda":
            return f"cuDNN attention runs on CUDA only, not {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"cuDNN attention takes fp16/bf16, not {dtype}"
        if not torch.backends.cudnn.is_available():
            return "this torch build has no cuDNN"
        major, minor = _capability(device)
        if major < 8:
            return f"cuDNN attention needs sm80 or newer, this GPU is sm{major}{minor}"
        limit = 256 if major >= 9 and _cudnn_version() >= 91000 else 128
        if head_dim > limit or head_dim % 8:
            return (
                f"cuDNN attention needs head_dim <= {limit} and a multiple of 8 on sm{major}{minor} with cuDNN "
                f"{_cudnn_version()}, got {head_dim}"
            )
        return None

    @per_segment_forward
    def forward(self, q, k, v, *, causal: bool, scale: float):
        _check_causal(causal, q.shape[1], k.shape[1])
        h = q.shape[2]
        res = _op("_scaled_dot_product_cudnn_attention")(
            _bhsd(q), _bhsd(expand_kv(k, h)), _bhsd(expand_kv(v, h)), None, True, 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse.reshape(q.shape[0], h, q.shape[1]).float()

    @per_segment_backward
    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        sq, sk = q.shape[1], k.shape[1]
        _check_causal(causal, sq, sk)
        h, hkv = q.shape[2], k.shape[2]
        no_rng = torch.zeros(1, dtype=torch.int64, device=q.device)  # philox seed/offset: read only with dropout
        # attn_bias and cum_seq_q/k must be None (undefined): a defined empty tensor means "bias" / "nested"
        dq, dk, dv = _op("_scaled_dot_product_cudnn_attention_backward")(
            _bhsd(dout),
            _bhsd(q),
            _bhsd(expand_kv(k, h)),
            _bhsd(expand_kv(v, h)),
            _bhsd(out),
            lse.float().contiguous().unsqueeze(-1),
            no_rng,
            no_rng,
            None,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), reduce_kv(dk.transpose(1, 2), hkv), reduce_kv(dv.transpose(1, 2), hkv)
