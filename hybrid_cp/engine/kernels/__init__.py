"""Local attention kernels behind one interface.

A kernel computes exact attention on one block of queries against one block of keys:

    forward(q, k, v, *, causal, scale, **varlen) -> (out, lse)
    backward(dout, q, k, v, out, lse, *, causal, scale, **varlen) -> (dq, dk, dv)

q is [B, Sq, H, D]; k and v are [B, Sk, H_kv, D] with H % H_kv == 0 (query head h uses KV head
h // (H // H_kv)). out is [B, Sq, H, D] in q's dtype, lse is [B, H, Sq] in fp32 (natural log).
`causal` means the causal mask of a square block (query i sees keys 0..i).
Packed documents add `varlen` = cu_seqlens_q, cu_seqlens_k (int32 boundaries, flash-attn's
naming), max_seqlen_q, max_seqlen_k: q is then [1, total_q, H, D], k/v [1, total_k, H_kv, D], and
segment i is queries cu_seqlens_q[i]:[i+1] against keys cu_seqlens_k[i]:[i+1] (causal segments are
square). Sliding windows add `window` = (left, right): flash-attn's bottom-right aligned
window_size (key j visible to query i iff -left <= j - i - (Sk - Sq) <= right; -1 unbounded).
A logit soft-cap adds `softcap` = c > 0: scores = c * tanh(q.k * scale / c), then the mask (Gemma 2;
math, flash and fa4 take it). Kernels without packed, window or soft-cap support need not take these
keywords: the engine passes them only when a call needs them, and says so if a kernel refuses them.
v may have its own head dim Dv (out is then [B, Sq, H, Dv]) only in a kernel that declares the
"value_head_dim" capability (`capabilities` attribute, protocol.CAPABILITIES; math only).
`backward` receives the *final* out and lse of the whole attention (not of this block), which is
what makes a block's gradient exact in ring attention. dk/dv come back with H_kv heads.

Registered kernels: math (reference, any dtype), sdpa (PyTorch's CPU flash / CUDA memory-efficient
operators), flash (flash-attn 2/3 if installed), torch-flash (PyTorch's own FlashAttention-2
operators), cudnn (cuDNN attention), fa4 (FlashAttention-4 if installed). backend="auto" on CUDA
takes the first of CUDA_AUTO_ORDER that supports the inputs and passes `self_test` on this GPU
(once per GPU, dtype and head_dim; said once in the "hybrid_cp" log); on CPU it is sdpa, then math.

Modules: `protocol` (the interface and which keywords a kernel takes), `registry` (the named kernels
and the choice behind "auto"), `selftest` (a kernel against the math kernel), `merge` (the
online-softmax merge of partial results), `varlen` (packed rows one segment at a time, window
masks), `_cuda` (the input rules FlashAttention-class kernels share), one module per kernel.
"""

from __future__ import annotations

from .cudnn import CuDNNKernel
from .fa4 import FA4Kernel
from .flash import FlashAttnKernel
from .math import MathKernel
from .protocol import CAPABILITIES, AttentionKernel, can_on, takes_keyword, takes_keyword_on
from .registry import (
    CUDA_AUTO_ORDER,
    available_kernels,
    get_kernel,
    kernel_needs,
    kernels_that_can,
    register_kernel,
    registered_kernels,
    select_kernel,
)
from .sdpa import SDPAKernel
from .selftest import CHECK_SIZES, SELF_TEST_TOL, kernel_errors, self_test, self_test_results
from .torch_flash import TorchFlashKernel

__all__ = [
    "AttentionKernel",
    "CAPABILITIES",
    "can_on",
    "kernels_that_can",
    "register_kernel",
    "get_kernel",
    "available_kernels",
    "registered_kernels",
    "kernel_needs",
    "takes_keyword",
    "takes_keyword_on",
    "self_test",
    "self_test_results",
    "kernel_errors",
    "CHECK_SIZES",
    "SELF_TEST_TOL",
    "select_kernel",
    "CUDA_AUTO_ORDER",
    "MathKernel",
    "SDPAKernel",
    "FlashAttnKernel",
    "TorchFlashKernel",
    "CuDNNKernel",
    "FA4Kernel",
]
