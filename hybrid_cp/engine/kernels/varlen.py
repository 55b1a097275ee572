"""Packed (varlen) calls and window masks for kernels without native support.

Packed segments run as one dense call per segment: a kernel writes only its dense forward and
backward and declares them `@per_segment_forward` / `@per_segment_backward`, which adds the varlen
keywords (cu_seqlens_q/k, max_seqlen_q/k) to their signatures, so `takes_keyword` sees them.

Segment i is queries cu_seqlens_q[i]:cu_seqlens_q[i+1] against keys cu_seqlens_k[i]:cu_seqlens_k[i+1];
causal segments are square (the block plan only emits square causal segments), so top-left and
bottom-right alignment agree. The loop needs the boundaries on the host: the block plan registers
its device tensors' host values (`remember_host`), so no device sync happens in the ring loop;
other device tensors are read back (a sync on CUDA).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

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


VARLEN_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _with_varlen_keywords(method: Callable, dense: Callable) -> Callable:
    """`method` named and documented as `dense`, with `dense`'s signature plus the varlen keywords."""
    functools.update_wrapper(method, dense)
    sig = inspect.signature(dense)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in VARLEN_KEYWORDS]
    params += [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    method.__signature__ = sig.replace(parameters=params)
    return method


def per_segment_forward(dense: Callable) -> Callable:
    """A kernel's forward that takes packed rows by running `dense` (its dense forward) once per
    segment: the segments' out and lse are concatenated along the rows."""

    def forward(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kw):
        if cu_seqlens_q is None:
            return dense(self, q, k, v, **kw)
        outs, lses = [], []
        for qa, qb, ka, kb in _bounds(cu_seqlens_q, cu_seqlens_k):
            o, l = dense(self, q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], **kw)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, 1), torch.cat(lses, 2)

    return _with_varlen_keywords(forward, dense)


def per_segment_backward(dense: Callable) -> Callable:
    """A kernel's backward that takes packed rows by running `dense` (its dense backward) once per
    segment: dq is written per segment, dk/dv accumulate (segments may share keys)."""

    def backward(  # noqa: PLR0913 (kernel protocol)
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        *,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        **kw,
    ):
        if cu_seqlens_q is None:
            return dense(self, dout, q, k, v, out, lse, **kw)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qa, qb, ka, kb in _bounds(cu_seqlens_q, cu_seqlens_k):
            g = dense(
                self, dout[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], out[:, qa:qb], lse[:, :, qa:qb], **kw
            )
            dq[:, qa:qb] = g[0]
            dk[:, ka:kb] += g[1]
            dv[:, ka:kb] += g[2]
        return dq, dk, dv

    return _with_varlen_keywords(backward, dense)
