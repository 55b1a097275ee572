"""Packed (varlen) calls and window masks for kernels without native support.

Packed segments run as one dense call per segment.

Segment i is queries cu_seqlens_q[i]:cu_seqlens_q[i+1] against keys cu_seqlens_k[i]:cu_seqlens_k[i+1];
causal segments are square (the block plan only emits square causal segments), so top-left and
bottom-right alignment agree. The loop needs the boundaries on the host: the block plan registers
its device tensors' host values (`remember_host`), so no device sync happens in the ring loop;
other device tensors are read back (a sync on CUDA).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

_HOST = WeakIdKeyDictionary()  # device cu_seqlens tensor -> its values, while the tensor lives


def remember_host(cu: torch.Tensor, values: list[int]) -> torch.Tensor:
    """Record the host values of a boundary tensor made from them (so loops need not read it back)."""
    _HOST[cu] = list(values)
    return cu


def _host(cu: torch.Tensor) -> list[int]:
    values = _HOST.get(cu)
    return values if values is not None else cu.tolist()


def _bounds(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    q, k = _host(cu_q), _host(cu_k)
    return [(q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(q) - 1)]


def window_mask(nq: int, nk: int, window: tuple[int, int], device) -> torch.Tensor:
    """[nq, nk] bool: key j visible to query i under flash-attn's bottom-right aligned
    window_size (left, right), -1 meaning unbounded."""
    left, right = window
    offset = (torch.arange(nk, device=device)[None, :] - torch.arange(nq, device=device)[:, None]) - (nk - nq)
    visible = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


def segment_forward(forward, q, k, v, *, causal: bool, scale: float, cu_seqlens_q, cu_seqlens_k, window=None):
    outs, lses = [], []
    extra = {} if window is None else {"window": window}
    for qa, qb, ka, kb in _bounds(cu_seqlens_q, cu_seqlens_k):
        o, l = forward(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], causal=causal, scale=scale, **extra)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 1), torch.cat(lses, 2)


def segment_backward(backward, dout, q, k, v, out, lse, *, causal: bool, scale: float, cu_seqlens_q, cu_seqlens_k,
                     window=None):
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    extra = {} if window is None else {"window": window}
    for qa, qb, ka, kb in _bounds(cu_seqlens_q, cu_seqlens_k):
        g = backward(dout[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], out[:, qa:qb], lse[:, :, qa:qb],
                     causal=causal, scale=scale, **extra)
        dq[:, qa:qb] = g[0]
        dk[:, ka:kb] += g[1]
        dv[:, ka:kb] += g[2]
    return dq, dk, dv
