"""CUDA facts the kernels share: what every FlashAttention-class kernel requires of its inputs (one
place for the checks), the GPU's capability and index, the aten operators."""

from __future__ import annotations

import torch


def fa_class_reason(
    what: str, device: torch.device, dtype: torch.dtype, head_dim: int, max_head_dim: int = 256
) -> str | None:
    """None if `what` (a kernel's name in a sentence) can take these inputs by the rules every
    FlashAttention-class kernel shares (CUDA, fp16/bf16, head_dim a multiple of 8 up to a limit),
    else the reason it cannot."""
    if device.type != "cuda":
        return f"{what} runs on CUDA only, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{what} takes fp16/bf16, not {dtype}"
    if head_dim > max_head_dim or head_dim % 8:
        return f"{what} needs head_dim <= {max_head_dim} and a multiple of 8, got {head_dim}"
    return None


def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def aten_op(name: str):
    """Resolved at call time so the tests can stand in CPU fakes for the CUDA-only operators."""
    return getattr(torch.ops.aten, name)


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device when it has none): a key of per-GPU choices."""
    if device.index is not None:
        return device.index
    try:
        return torch.cuda.current_device()
    except Exception:  # a CPU-only build (tests use explicit indices)
        return 0
