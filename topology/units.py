"""Element sizes, byte units and the count check that the cost, memory and calibration models share.

One table of dtype names (the torch names, and the short aliases the CLI and presets use) and their
sizes, so that every model reads a dtype the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_BYTES", "DTYPE_ALIASES", "FP32_BYTES", "GiB", "dtype_bytes", "dtype_name", "check_counts"]

GiB = 1 << 30
FP32_BYTES = 4  # gradients, softmax statistics and optimizer states are kept in fp32
LOSS_CHUNK_BYTES = 256 << 20  # hcp.tiled_cross_entropy's default chunk: 256 MiB of fp32 logits (the memory model's too)

DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
}  # fmt: skip


def dtype_name(dtype: Any) -> str:
    """The torch name of ``dtype`` (``"bf16"`` and ``torch.bfloat16`` -> ``"bfloat16"``); unknown names
    come back lower-cased, unchanged."""
    name = str(dtype).removeprefix("torch.").lower()
    return DTYPE_ALIASES.get(name, name)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: an int, a name like ``"bf16"`` or a ``torch.dtype``.

    Args:
        dtype: An int, a name like "bf16", or a `torch.dtype`.

    Returns:
        Bytes per element.

    Raises:
        ValueError: An unknown dtype.
    """
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in (1, 2, 4, 8):
            raise ValueError(f"dtype bytes={dtype} must be 1, 2, 4 or 8")
        return dtype
    name = dtype_name(dtype)
    if name not in DTYPE_BYTES:
        known = ", ".join(sorted({*DTYPE_BYTES, *DTYPE_ALIASES}))
        raise ValueError(f"unknown dtype {dtype!r}; use one of {known} or a byte count")
    return DTYPE_BYTES[name]


def check_counts(**counts: int) -> None:
    """Raise ValueError unless every value is an integer >= 1 (``True`` is not a count)."""
    for name, v in counts.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
