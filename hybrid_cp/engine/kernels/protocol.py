"""What a kernel is: the `AttentionKernel` interface, which optional keywords a kernel takes, and which
capabilities it declares (what a call may need that is not a keyword: `CAPABILITIES`)."""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionKernel(Protocol):
    name: str

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None if the kernel can run these inputs, else the reason it cannot."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, **varlen
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        **varlen,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


CAPABILITIES = ("value_head_dim",)
"""Needs a kernel declares in a `capabilities` attribute because no keyword carries them:
"value_head_dim": v's head dim may differ from q/k's (out has v's; MLA after decompression)."""


def can_on(kernel: AttentionKernel, need: str, device: torch.device) -> bool:
    """Whether the kernel can do `need` on this device type: a capability it declares (less those it
    `refuses` there), or a keyword it takes (`takes_keyword_on`)."""
    if need in CAPABILITIES:
        return need in getattr(kernel, "capabilities", ()) and need not in getattr(kernel, "refuses", {}).get(
            device.type, ()
        )
    return takes_keyword_on(kernel, need, device)


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
