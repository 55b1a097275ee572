"""The flash-attn adapter against the entry-point signatures of flash-attn 2.5 to 2.8 and 3.

flash-attn needs CUDA, so these tests stand in CPU functions that have the real signatures and
compute with the math kernel; they check that our adapter passes every argument by the right name
(dense and packed/varlen), reads lse from the right place and layout, and writes the gradients
where flash-attn would. The numerical check of the real kernels belongs to benchmarks/gpu_check.py
on a GPU with flash-attn.

Where the signatures come from (github.com/Dao-AILab/flash-attention, read at these tags/commits):

- 2.5.x (v2.5.9) flash_attn/flash_attn_interface.py: window_size tuple, no softcap; varlen lse is
  [B, H, max_seqlen_q] (padded), a layout the adapter does not read: the `flash` extra requires
  flash-attn >= 2.6, so 2.5 is only checked on the dense path.
- 2.6.0: softcap after window_size; varlen forward takes block_table without a default and returns 8
  values with lse at index 5, now [H, total_q] (csrc/flash_attn/flash_api.cpp: "{num_heads, total_q}").
- 2.6.3: the varlen forward's trailing parameters get defaults, plus leftpad_k and seqused_k.
- 2.7.0: window_size_left/window_size_right, forward returns (out, lse, S_dmask, rng_state); the entry
  points are `torch.library.custom_op` objects on torch >= 2.4 (so `inspect.signature` of them is
  `(*args, **kwargs)`).
- 2.7.4 .. 2.8.3: varlen forward and backward gain zero_tensors=False.
- 3 (hopper/flash_attn_interface.py) at 0165c96f (2025-09): one forward/backward for dense and
  varlen (cu_seqlens_q/k, max_seqlen_q/k), window_size tuple, `causal`.
- 3 at 0f82fead (2026-03): custom ops; the backward takes `is_causal` (not `causal`) and
  window_size_left/right, the forward's output buffer is `out_`.
"""

from __future__ import annotations

import inspect
import types
from typing import Optional

import pytest
import torch
from tolerance import allclose_ratio, within

from hybrid_cp.engine.kernels import flash, takes_keyword
from hybrid_cp.engine.kernels.math import MathKernel

_M = MathKernel()


def _same(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """The adapter's result is the fake's math-kernel result up to the order of fp32 sums: the same
    arithmetic, but the first GEMM of a process can split its sums differently from later ones (measured:
    5.7e-5 between two identical math-kernel calls, first vs second, on this 2-core machine). A wrong
    argument mapping (transposed layout, lost mask or scale) is off by O(1). Worst seen in the recorded runs: 0 (the
    same GEMMs in the same order)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (label, got.shape, want.shape, got.dtype, want.dtype)
    within(allclose_ratio(got, want, rtol=1e-4, atol=1e-4), 1.0, f"{label} / allclose allowance")


# ---- what every fake computes: the math kernel, dense [B, S, H, D] or varlen [total, H, D] --------------------------


def _segments(cu_q, cu_k, max_q, max_k) -> list[tuple[int, int, int, int]]:
    """Check the varlen arguments the way flash-attn needs them and return the (q, k) row ranges."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, (cu_q.dtype, cu_k.dtype)
    assert cu_q.dim() == 1 and cu_q.shape == cu_k.shape
    q, k = cu_q.tolist(), cu_k.tolist()
    assert isinstance(max_q, int) and isinstance(max_k, int)
    assert max_q >= max(b - a for a, b in zip(q, q[1:])) and max_k >= max(b - a for a, b in zip(k, k[1:]))
    return [(q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(q) - 1)]


def _fwd(q, k, v, softmax_scale, causal, cu_q=None, cu_k=None, max_q=None, max_k=None):
    """Dense: out [B, S, H, D], lse [B, H, S]. Varlen (q [total, H, D]): out [total, H, D], lse [H, total]."""
    if cu_q is None:
        assert q.dim() == 4
        return _M.forward(q, k, v, causal=causal, scale=softmax_scale)
    assert q.dim() == 3 and k.dim() == 3 and q.is_contiguous(), "varlen inputs are [total, H, D]"
    outs, lses = [], []
    for qa, qb, ka, kb in _segments(cu_q, cu_k, max_q, max_k):
        o, lse = _M.forward(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], causal=causal, scale=softmax_scale)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cu_q=None, cu_k=None, max_q=None, max_k=None):
    """Write the gradients into the caller's dq/dk/dv, as flash-attn does."""
    if cu_q is None:
        grads = _M.backward(dout, q, k, v, out, lse, causal=causal, scale=softmax_scale)
    else:
        assert q.dim() == 3 and lse.shape == (q.shape[1], q.shape[0]), "varlen lse is [H, total_q]"
        grads = (torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v))
        for qa, qb, ka, kb in _segments(cu_q, cu_k, max_q, max_k):
            g = _M.backward(
                dout[None, qa:qb],
                q[None, qa:qb],
                k[None, ka:kb],
                v[None, ka:kb],
                out[None, qa:qb],
                lse[None, :, qa:qb],
                causal=causal,
                scale=softmax_scale,
            )
            grads[0][qa:qb] = g[0][0]
            grads[1][ka:kb] += g[1][0]
            grads[2][ka:kb] += g[2][0]
    for buf, g in zip((dq, dk, dv), grads):
        assert buf.shape == g.shape
        buf.copy_(g)


def _neutral(dropout_p=0.0, window=(-1, -1), softcap=0.0, alibi_slopes=None, **unused) -> None:
    """The adapter never asks for dropout, windows, soft-capping, ALiBi, paging or extra outputs."""
    assert dropout_p == 0.0 and tuple(window) == (-1, -1) and softcap == 0.0 and alibi_slopes is None
    assert all(v is None or v is False for v in unused.values()), unused


def _custom_op(name: str, mutates=()):
    """flash-attn >= 2.7 and recent flash-attn 3 expose their entry points as torch custom ops."""
    return torch.library.custom_op(f"hcp_fake_flash::{name}", mutates_args=mutates, device_types="cpu")


# ---- flash-attn 2.5 (dense only: see the module docstring) ---------------------------------------------------------


def fa25():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        _neutral(dropout_p, window_size, alibi_slopes=alibi_slopes, return_softmax=return_softmax)
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        _neutral(dropout_p, window_size, alibi_slopes=alibi_slopes, rng_state=rng_state)
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
        return dq, dk, dv, None

    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


# ---- flash-attn 2.6 -------------------------------------------------------------------------------------------------


def _fa26_dense():
    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
    ):
        _neutral(dropout_p, window_size, softcap, alibi_slopes, return_softmax=return_softmax)
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        _neutral(dropout_p, window_size, softcap, alibi_slopes, rng_state=rng_state)
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
        return dq, dk, dv, None

    return _flash_attn_forward, _flash_attn_backward


def _fa26_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _neutral(dropout_p, window_size, softcap, alibi_slopes, rng_state=rng_state)
    _bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        softmax_scale,
        causal,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    return dq, dk, dv, None


def fa260():
    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_softmax,
        block_table,
    ):
        _neutral(dropout_p, window_size, softcap, alibi_slopes, return_softmax=return_softmax, block_table=block_table)
        out, lse = _fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return out, q, k, v, out, lse, None, None

    fwd, bwd = _fa26_dense()
    return types.SimpleNamespace(
        _flash_attn_forward=fwd,
        _flash_attn_backward=bwd,
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_fa26_varlen_backward,
    )


def fa263():
    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        leftpad_k=None,
        seqused_k=None,
    ):
        _neutral(
            dropout_p,
            window_size,
            softcap,
            alibi_slopes,
            return_softmax=return_softmax,
            block_table=block_table,
            leftpad_k=leftpad_k,
            seqused_k=seqused_k,
        )
        out, lse = _fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return out, q, k, v, out, lse, None, None

    fwd, bwd = _fa26_dense()
    return types.SimpleNamespace(
        _flash_attn_forward=fwd,
        _flash_attn_backward=bwd,
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_fa26_varlen_backward,
    )


# ---- flash-attn 2.7 / 2.8: custom ops, window_size_left/right, 4 outputs ---------------------------------------------


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@_custom_op("fa27_forward")
def _fa27_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _neutral(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes, return_softmax=return_softmax)
    out, lse = _fwd(q, k, v, softmax_scale, causal)
    return out, lse, _empty(q), _empty(lse)


@_custom_op("fa27_backward", mutates=("dq", "dk", "dv"))
def _fa27_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _neutral(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes, rng_state=rng_state)
    _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return _empty(softmax_lse)


@_custom_op("fa270_varlen_forward")
def _fa270_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _neutral(
        dropout_p,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
        return_softmax=return_softmax,
        block_table=block_table,
        leftpad_k=leftpad_k,
        seqused_k=seqused_k,
    )
    out, lse = _fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return out, lse, _empty(q), _empty(lse)


@_custom_op("fa270_varlen_backward", mutates=("dq", "dk", "dv"))
def _fa270_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _neutral(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes, rng_state=rng_state)
    _bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        softmax_scale,
        causal,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    return _empty(softmax_lse)


@_custom_op("fa274_varlen_forward")
def _fa274_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _neutral(
        dropout_p,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
        return_softmax=return_softmax,
        block_table=block_table,
        leftpad_k=leftpad_k,
        seqused_k=seqused_k,
        zero_tensors=zero_tensors,
    )
    out, lse = _fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return out, lse, _empty(q), _empty(lse)


@_custom_op("fa274_varlen_backward", mutates=("dq", "dk", "dv"))
def _fa274_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _neutral(
        dropout_p,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
        rng_state=rng_state,
        zero_tensors=zero_tensors,
    )
    _bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        softmax_scale,
        causal,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    return _empty(softmax_lse)


def fa270():
    return types.SimpleNamespace(
        _flash_attn_forward=_fa27_forward,
        _flash_attn_backward=_fa27_backward,
        _flash_attn_varlen_forward=_fa270_varlen_forward,
        _flash_attn_varlen_backward=_fa270_varlen_backward,
    )


def fa274():
    return types.SimpleNamespace(
        _flash_attn_forward=_fa27_forward,
        _flash_attn_backward=_fa27_backward,
        _flash_attn_varlen_forward=_fa274_varlen_forward,
        _flash_attn_varlen_backward=_fa274_varlen_backward,
    )


# ---- flash-attn 3: one entry point for dense and varlen ------------------------------------------------------------


def fa3_2025():
    def _flash_attn_forward(
        q,
        k,
        v,
        k_new,
        v_new,
        qv,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_k_new,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        page_table,
        kv_batch_idx,
        leftpad_k,
        rotary_cos,
        rotary_sin,
        seqlens_rotary,
        q_descale,
        k_descale,
        v_descale,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        rotary_interleaved=True,
        scheduler_metadata=None,
        num_splits=1,
        pack_gqa=None,
        sm_margin=0,
    ):
        _neutral(
            window=window_size,
            softcap=softcap,
            k_new=k_new,
            v_new=v_new,
            qv=qv,
            out=out,
            cu_seqlens_k_new=cu_seqlens_k_new,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            page_table=page_table,
            kv_batch_idx=kv_batch_idx,
            leftpad_k=leftpad_k,
            rotary_cos=rotary_cos,
            q_descale=q_descale,
        )
        out, lse = _fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return out, lse, None, None

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        sequed_q,
        sequed_k,
        max_seqlen_q,
        max_seqlen_k,
        dq,
        dk,
        dv,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        softcap=0.0,
        deterministic=False,
        sm_margin=0,
    ):
        _neutral(window=window_size, softcap=softcap, sequed_q=sequed_q, sequed_k=sequed_k)
        _bwd(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            softmax_scale,
            causal,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        )

    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


@_custom_op("fa3_forward")
def _fa3_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    out_: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None,
    kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    seqlens_rotary: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Optional[torch.Tensor] = None,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _neutral(
        window=(window_size_left, window_size_right),
        softcap=softcap,
        k_new=k_new,
        out_=out_,
        page_table=page_table,
        seqused_k=seqused_k,
        leftpad_k=leftpad_k,
    )
    out, lse = _fwd(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return out, lse, _empty(q), _empty(lse)


@_custom_op("fa3_backward", mutates=("dq", "dk", "dv"))
def _fa3_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    sequed_q: Optional[torch.Tensor] = None,
    sequed_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:
    _neutral(window=(window_size_left, window_size_right), softcap=softcap, sequed_q=sequed_q, sequed_k=sequed_k)
    _bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        softmax_scale,
        is_causal,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    return _empty(softmax_lse)


def fa3_2026():
    return types.SimpleNamespace(_flash_attn_forward=_fa3_forward, _flash_attn_backward=_fa3_backward)


DENSE = [(fa25, 2), (fa260, 2), (fa263, 2), (fa270, 2), (fa274, 2), (fa3_2025, 3), (fa3_2026, 3)]
DENSE_IDS = ["2.5", "2.6.0", "2.6.3", "2.7.0", "2.7.4-2.8", "3-2025", "3-2026"]
VARLEN = DENSE[1:]
VARLEN_IDS = DENSE_IDS[1:]


@pytest.mark.parametrize("make,version", DENSE, ids=DENSE_IDS)
@pytest.mark.parametrize("causal", [True, False])
def test_adapter_matches_math_kernel(monkeypatch, make, version, causal):
    monkeypatch.setattr(flash, "_flash_module", lambda: (make(), version))
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 24, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 24, 2, 16, generator=g) for _ in range(2))
    kern = flash.FlashAttnKernel()
    out, lse = kern.forward(q, k, v, causal=causal, scale=0.25)
    ref_out, ref_lse = _M.forward(q, k, v, causal=causal, scale=0.25)
    _same(out, ref_out, "out")
    _same(lse, ref_lse, "lse")
    grads = kern.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25)
    for name, got, want in zip(
        ("dq", "dk", "dv"), grads, _M.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25)
    ):
        _same(got, want, name)


def _varlen(seg_q: list[int], seg_k: list[int], heads: int, kv_heads: int, seed: int = 1):
    """q/dout [1, total_q, H, D], k/v [1, total_k, H_kv, D] and the varlen keywords, as the ring engine builds them."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(seg_q), sum(seg_k)
    q, dout = (torch.randn(1, tq, heads, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, tk, kv_heads, 16, generator=g) for _ in range(2))

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

    kw = dict(cu_seqlens_q=cu(seg_q), cu_seqlens_k=cu(seg_k), max_seqlen_q=max(seg_q), max_seqlen_k=max(seg_k))
    return q, k, v, dout, kw


@pytest.mark.parametrize("make,version", VARLEN, ids=VARLEN_IDS)
@pytest.mark.parametrize(
    "causal,seg_q,seg_k",
    [
        (True, [5, 1, 17, 3, 8], [5, 1, 17, 3, 8]),  # causal segments are square
        (False, [5, 1, 17, 3, 8], [9, 4, 2, 1, 12]),  # non-causal: a segment's queries and keys differ
    ],
    ids=["causal", "noncausal"],
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_varlen_adapter_matches_math_kernel(monkeypatch, make, version, causal, seg_q, seg_k, heads, kv_heads):
    monkeypatch.setattr(flash, "_flash_module", lambda: (make(), version))
    q, k, v, dout, kw = _varlen(seg_q, seg_k, heads, kv_heads)
    kern = flash.FlashAttnKernel()
    out, lse = kern.forward(q, k, v, causal=causal, scale=0.25, **kw)
    ref_out, ref_lse = _M.forward(q, k, v, causal=causal, scale=0.25, **kw)
    assert out.shape == ref_out.shape == q.shape and lse.shape == ref_lse.shape == (1, heads, q.shape[1])
    _same(out, ref_out, "out")
    _same(lse, ref_lse, "lse")
    grads = kern.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25, **kw)
    want = _M.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25, **kw)
    for name, got, ref, like in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert got.shape == like.shape
        _same(got, ref, name)
    # and the packed answer is not the dense one: the segments really are separate
    dense_out, _ = _M.forward(q, k, v, causal=causal, scale=0.25)
    assert not torch.allclose(out, dense_out)


def test_flash_unavailable_is_a_clear_reason(monkeypatch):
    monkeypatch.setattr(flash, "_flash_module", lambda: (None, None))
    reason = flash.FlashAttnKernel().supports(torch.device("cuda"), torch.bfloat16, 128)
    assert "flash-attn is not installed" in reason


def _recording(fn, seen: list):
    """`fn` called by keyword, recording the soft-cap it is given and handing the fake 0.0 (the fakes compute
    plain attention); `flash._parameters` reads the real signature through `_init_fn`."""

    def call(**kwargs):
        seen.append(kwargs["softcap"])
        return fn(**{**kwargs, "softcap": 0.0})

    call._init_fn = getattr(fn, "_init_fn", None) or inspect.unwrap(fn)
    return call


@pytest.mark.parametrize("make,version", VARLEN, ids=VARLEN_IDS)
def test_softcap_is_passed_to_forward_and_backward(monkeypatch, make, version):
    """Gemma 2's soft-cap is flash-attn's own `softcap` argument, forward and backward, dense and packed."""
    seen: list = []
    mod = make()
    fake = types.SimpleNamespace(**{name: _recording(fn, seen) for name, fn in vars(mod).items()})
    monkeypatch.setattr(flash, "_flash_module", lambda: (fake, version))
    kern = flash.FlashAttnKernel()
    q, k, v, dout, kw = _varlen([5, 9], [5, 9], 4, 2)
    for extra in ({}, kw):
        out, lse = kern.forward(q, k, v, causal=True, scale=0.25, softcap=30.0, **extra)
        kern.backward(dout, q, k, v, out, lse, causal=True, scale=0.25, softcap=30.0, **extra)
    assert seen == [30.0] * 4
    assert takes_keyword(kern, "softcap")


def test_softcap_on_a_flash_attn_without_it_raises(monkeypatch):
    monkeypatch.setattr(flash, "_flash_module", lambda: (fa25(), 2))
    q, k, v, _, _ = _varlen([8], [8], 4, 2)
    with pytest.raises(TypeError, match="softcap"):
        flash.FlashAttnKernel().forward(q, k, v, causal=True, scale=0.25, softcap=30.0)
