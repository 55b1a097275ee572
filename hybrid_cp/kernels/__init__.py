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
Kernels without packed or window support need not take these keywords: the engine passes them
only when a call needs them, and says so if a kernel refuses them.
`backward` receives the *final* out and lse of the whole attention (not of this block), which is
what makes a block's gradient exact in ring attention. dk/dv come back with H_kv heads.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .flash import FlashAttnKernel
from .math import MathKernel
from .sdpa import SDPAKernel
from ..errors import ConfigError, InputTypeError


@runtime_checkable
class AttentionKernel(Protocol):
    name: str

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None if the kernel can run these inputs, else the reason it cannot."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                scale: float, **varlen) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                 scale: float, **varlen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


_REGISTRY: dict[str, AttentionKernel] = {}


def register_kernel(name: str, kernel: AttentionKernel, *, overwrite: bool = False) -> None:
    """Make `kernel` selectable as `hcp.attention(..., backend=name)`."""
    if not isinstance(kernel, AttentionKernel):
        raise InputTypeError(f"kernel {kernel!r} must provide name, supports(), forward() and backward()")
    if name in _REGISTRY and not overwrite:
        raise ConfigError(f"a kernel named {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = kernel


def available_kernels() -> list[str]:
    return sorted(_REGISTRY)


def get_kernel(backend: str | AttentionKernel, device: torch.device, dtype: torch.dtype,
               head_dim: int) -> AttentionKernel:
    """Resolve `backend` ("auto", a registered name, or a kernel object) for these inputs.

    Raises instead of falling back when a named backend cannot run the inputs.
    """
    if isinstance(backend, AttentionKernel) and not isinstance(backend, str):
        kernel = backend
    elif backend == "auto":
        order = ["flash", "sdpa", "math"] if device.type == "cuda" else ["sdpa", "math"]
        for name in order:
            if _REGISTRY[name].supports(device, dtype, head_dim) is None:
                if name != order[0] and dtype != torch.float64:  # fp64 has no fast kernel anywhere
                    _warn_fallback(order, name, device, dtype, head_dim)
                return _REGISTRY[name]
        raise ConfigError(f"no attention backend supports device={device}, dtype={dtype}, head_dim={head_dim}")
    elif isinstance(backend, str) and backend in _REGISTRY:
        kernel = _REGISTRY[backend]
    else:
        raise ConfigError(f"backend={backend!r} is not a registered attention kernel; "
                         f"use 'auto' or one of {available_kernels()}")
    reason = kernel.supports(device, dtype, head_dim)
    if reason is not None:
        raise ConfigError(f"backend={getattr(kernel, 'name', backend)!r} cannot run these inputs: {reason}")
    return kernel


_WARNED: set = set()


def _warn_fallback(order: list[str], chosen: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Warn once per input kind when "auto" had to skip a faster kernel (silently slower otherwise)."""
    key = (chosen, device.type, dtype, head_dim)
    if key in _WARNED:
        return
    _WARNED.add(key)
    reasons = []
    for name in order[:order.index(chosen)]:
        reasons.append(f"{name}: {_REGISTRY[name].supports(device, dtype, head_dim)}")
    import logging

    logging.getLogger("hybrid_cp").warning(
        "backend='auto' falls back to %r for device=%s dtype=%s head_dim=%d (%s); expect it to be slower",
        chosen, device, dtype, head_dim, "; ".join(reasons))


def takes_keyword(kernel: AttentionKernel, name: str) -> bool:
    """Whether the kernel's forward and backward accept keyword `name` (e.g. "cu_seqlens_q", "window")."""
    import inspect

    def ok(fn) -> bool:
        params = inspect.signature(fn).parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return ok(kernel.forward) and ok(kernel.backward)


register_kernel("math", MathKernel())
register_kernel("sdpa", SDPAKernel())
register_kernel("flash", FlashAttnKernel())

__all__ = ["AttentionKernel", "register_kernel", "get_kernel", "available_kernels", "takes_keyword",
           "MathKernel", "SDPAKernel", "FlashAttnKernel"]
