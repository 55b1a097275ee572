"""What a kernel is: the `AttentionKernel` interface and which optional keywords a kernel takes."""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import torch


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


def takes_keyword_on(kernel: AttentionKernel, name: str, device: torch.device) -> bool:
    """`takes_keyword`, less the keywords the kernel refuses on this device type (an optional
    `refuses = {device_type: (names...)}` attribute: sdpa takes windows on CPU only)."""
    return takes_keyword(kernel, name) and name not in getattr(kernel, "refuses", {}).get(device.type, ())


def takes_keyword(kernel: AttentionKernel, name: str) -> bool:
    """Whether the kernel's forward and backward accept keyword `name` (e.g. "cu_seqlens_q", "window")."""
    def ok(fn) -> bool:
        params = inspect.signature(fn).parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return ok(kernel.forward) and ok(kernel.backward)
