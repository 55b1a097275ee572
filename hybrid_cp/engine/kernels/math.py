"""Reference attention in plain PyTorch math: any dtype (fp64 included), any device.

Slow (materialises the score matrix) but simple enough to trust: the tests' ground truth.
Rows that see no key return out = 0, lse = -inf and zero gradient. Takes a logit soft-cap (`softcap`:
scores = softcap * tanh(q.k * scale / softcap), then the mask, Gemma 2) and a value head dim that
differs from the query/key one (out has v's).
"""

from __future__ import annotations

import torch

from ..heads import expand_kv, reduce_kv
from .varlen import per_segment_backward, per_segment_forward, window_mask


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, window=None, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(masked scores, tanh of the capped scores or None without a soft-cap: the backward's chain rule)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    sq, sk = s.shape[-2], s.shape[-1]
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if window is not None:
        s = s.masked_fill(~window_mask(sq, sk, window, s.device), float("-inf"))
    return s, t


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(lse).unsqueeze(-1)
    return torch.where(finite, torch.exp(s - torch.where(finite, lse.unsqueeze(-1), 0.0)), 0.0)


class MathKernel:
    name = "math"
    capabilities = ("value_head_dim",)  # v's head dim may differ from q/k's (protocol.CAPABILITIES)

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        return None if dtype.is_floating_point else f"dtype {dtype} is not a floating point type"

    @per_segment_forward
    def forward(self, q, k, v, *, causal: bool, scale: float, window=None, softcap: float | None = None):
        ct = _compute_dtype(q.dtype)
        h = q.shape[2]
        qc, kc, vc = q.to(ct), expand_kv(k, h).to(ct), expand_kv(v, h).to(ct)
        s, _ = _masked_scores(qc, kc, causal, scale, window, softcap)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", _probs(s, lse), vc)
        return out.to(q.dtype), lse.to(torch.float64 if ct == torch.float64 else torch.float32)

    @per_segment_backward
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
        softcap: float | None = None,
    ):
        ct = _compute_dtype(q.dtype)
        h, hkv = q.shape[2], k.shape[2]
        qc, kc, vc = q.to(ct), expand_kv(k, h).to(ct), expand_kv(v, h).to(ct)
        do, o = dout.to(ct), out.to(ct)
        s, t = _masked_scores(qc, kc, causal, scale, window, softcap)
        p = _probs(s, lse.to(ct))
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vc)
        delta = (do * o).sum(-1).transpose(1, 2).unsqueeze(-1)  # [B, H, Sq, 1]
        ds = p * (dp - delta)
        if t is not None:  # d raw = d capped * (1 - tanh^2)
            ds = ds * (1 - t * t)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kc) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, qc) * scale
        return dq.to(q.dtype), reduce_kv(dk, hkv).to(k.dtype), reduce_kv(dv, hkv).to(v.dtype)
