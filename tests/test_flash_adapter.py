"""The flash-attn adapter against the entry-point signatures of flash-attn 2.6, 2.7+ and 3.

flash-attn needs CUDA, so these tests stand in CPU functions with the real signatures (taken
from the released sources) that compute with the math kernel; they check that our adapter
passes every argument by the right name and reads lse from the right place. The numerical
check of the real kernels belongs to benchmarks/gpu_check.py on a GPU with flash-attn.
"""

import types

import pytest
import torch

from hybrid_cp.kernels import flash
from hybrid_cp.kernels.math import MathKernel

_M = MathKernel()


def _fwd(q, k, v, softmax_scale, causal):
    return _M.forward(q, k, v, causal=causal, scale=softmax_scale)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal):
    for buf, g in zip((dq, dk, dv), _M.backward(dout, q, k, v, out, lse, causal=causal, scale=softmax_scale)):
        buf.copy_(g)


def fa26():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        assert window_size == (-1, -1) and dropout_p == 0.0 and alibi_slopes is None
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)

    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


def fa27():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                             rng_state=None):
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)

    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


def fa3():
    def _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                            seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx,
                            leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale,
                            softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0,
                            softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                            pack_gqa=None, sm_margin=0):
        assert k_new is None and cu_seqlens_q is None and page_table is None
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                             max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                             softcap=0.0, deterministic=False, sm_margin=0):
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)

    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


@pytest.mark.parametrize("make,version", [(fa26, 2), (fa27, 2), (fa3, 3)], ids=["2.6", "2.7+", "3"])
@pytest.mark.parametrize("causal", [True, False])
def test_adapter_matches_math_kernel(monkeypatch, make, version, causal):
    monkeypatch.setattr(flash, "_flash_module", lambda: (make(), version))
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 24, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 24, 2, 16, generator=g) for _ in range(2))
    kern = flash.FlashAttnKernel()
    out, lse = kern.forward(q, k, v, causal=causal, scale=0.25)
    ref_out, ref_lse = _M.forward(q, k, v, causal=causal, scale=0.25)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = kern.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25)
    for got, want in zip(grads, _M.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25)):
        assert torch.equal(got, want)


def test_flash_unavailable_is_a_clear_reason(monkeypatch):
    monkeypatch.setattr(flash, "_flash_module", lambda: (None, None))
    reason = flash.FlashAttnKernel().supports(torch.device("cuda"), torch.bfloat16, 128)
    assert "flash-attn is not installed" in reason
