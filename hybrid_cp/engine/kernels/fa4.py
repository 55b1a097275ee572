"""FlashAttention-4 (`flash-attn-4` on PyPI: a pure-Python CuTe DSL package; `pip install 'hybrid-cp[fa4]'`).

Import-guarded: the package works without it. [B, S, H, D] layout, lse [B, H, Sq] fp32, GQA native,
causal bottom-right for rectangular blocks, and a backward that takes an external out and lse (the
ring's merged ones). The entry points are private and beta (`flash_attn.cute.interface`): they are
called by keyword, and the forward's return value is read as (out, lse, ...) because recent betas
return five values where older ones returned two. FA4 compiles each new configuration on first use
(seconds); set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 to keep compiled kernels across runs.

Choices (see docs/benchmarks.md, "GPU kernels"): the backward needs sm90 or newer, so the kernel
requires sm90+. Packed documents run as one call per segment (varlen.py), and sliding windows are
not taken (no `window` keyword; use torch-flash): in the FA4 source this adapter was written against
(flash_attn/cute/interface.py, 2026), the sm90 backward asserts on both. A logit soft-cap
(`softcap`, Gemma 2) is FA4's own `softcap` argument of `_flash_attn_fwd` (None: off) and
`_flash_attn_bwd` (0.0: off); not run on a GPU by this package's tests (fake-module tests only).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ._cuda import capability as _capability
from ._cuda import fa_class_reason
from .varlen import per_segment_backward, per_segment_forward


@lru_cache(maxsize=1)
def _fa4_module():
    """flash_attn.cute.interface if flash-attn-4 is installed (and importable here), else None."""
    try:
        from flash_attn.cute import interface
    except Exception:  # ImportError, or the CuTe DSL failing to load its CUDA libraries
        return None
    return interface


class FA4Kernel:
    name = "fa4"

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if _fa4_module() is None:
            return "flash-attn-4 is not installed (pip install 'hybrid-cp[fa4]')"
        reason = fa_class_reason("flash-attn-4", device, dtype, head_dim)
        if reason:
            return reason
        major, minor = _capability(device)
        if major < 9:
            return f"flash-attn-4's backward needs sm90 or newer, this GPU is sm{major}{minor}"
        return None

    @per_segment_forward
    def forward(self, q, k, v, *, causal: bool, scale: float, softcap: float | None = None):
        res = _fa4_module()._flash_attn_fwd(
            q=q.contiguous(),
            k=k.contiguous(),
            v=v.contiguous(),
            softmax_scale=scale,
            causal=causal,
            softcap=softcap,
            return_lse=True,
        )
        out, lse = res[0], res[1]
        if lse is None:
            raise RuntimeError(
                "flash-attn-4's _flash_attn_fwd returned no lse despite return_lse=True; this "
                "flash-attn-4 release is not supported (pin the version of the 'fa4' extra)"
            )
        return out, lse.float()

    @per_segment_backward
    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, softcap: float | None = None):  # noqa: PLR0913 (kernel protocol)
        res = _fa4_module()._flash_attn_bwd(
            q=q.contiguous(),
            k=k.contiguous(),
            v=v.contiguous(),
            out=out.contiguous(),
            dout=dout.contiguous(),
            lse=lse.float().contiguous(),
            softmax_scale=scale,
            causal=causal,
            softcap=float(softcap or 0.0),
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return res[0], res[1], res[2]
