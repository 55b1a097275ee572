"""The torch-flash, cudnn and fa4 adapters and "auto" on CUDA, checked on CPU.

The aten operators behind torch-flash and cudnn run on CUDA only, so each call the adapter makes
goes to a fake that (a) binds it to the real operator's schema in this torch
(`torch.ops.aten.<op>.default._schema`: every positional/keyword name, count and type), (b) runs
the real operator on meta tensors of the same shapes and strides (its shape function) and checks
the fake's outputs have the shapes the real one gives, and (c) computes the answer with the math
kernel in the operator's own layout and alignment ([B, S, H, D] with lse [B, H, S] and varlen
[total, H, D] with lse [H, total] for flash; [B, H, S, D] views with lse [B, H, S, 1] and TOP-LEFT
causal for cuDNN). FA4 gets a fake module with the parameter names of flash_attn.cute.interface
(flash-attn-4 4.0.0b36). The numbers of the real kernels are benchmarks/gpu_check.py's job.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from test_flash_adapter import _varlen
from tolerance import allclose_ratio, within

import hybrid_cp.engine.kernels as kernels
from hybrid_cp.engine.kernels import cudnn, fa4, flash, registry, selftest, torch_flash
from hybrid_cp.engine.kernels.math import MathKernel

_M = MathKernel()
CUDA = torch.device("cuda", 0)


# ---- binding a call to the real schema, and the real operator's shape function on meta ---------------------------


def _type_ok(type_name: str, value) -> bool:
    optional = type_name.startswith("Optional[")
    base = type_name[9:-1] if optional else type_name
    if value is None:
        return optional or base == "Tensor"  # a non-optional Tensor may be undefined (None)
    if base == "Tensor":
        return isinstance(value, torch.Tensor)
    if base in ("int", "SymInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "bool":
        return isinstance(value, bool)
    raise AssertionError(f"unhandled schema type {type_name}")


def bind(op: str, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by schema name, after checking names, counts, requiredness and types."""
    schema = getattr(torch.ops.aten, op).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = {a.name: a for a in schema.arguments}
    assert len(args) <= len(positional), f"{op}: {len(args)} positional arguments, the schema has {len(positional)}"
    bound = {a.name: v for a, v in zip(positional, args)}
    for name, value in kwargs.items():
        assert name in names, f"{op} has no argument {name!r} (it has {list(names)})"
        assert name not in bound, f"{op}: {name!r} given positionally and by keyword"
        bound[name] = value
    for a in schema.arguments:
        if a.name in bound:
            assert _type_ok(str(a.type), bound[a.name]), f"{op}: {a.name}={bound[a.name]!r} is not {a.type}"
        else:
            assert a.has_default_value(), f"{op}: required argument {a.name!r} missing"
            bound[a.name] = a.default_value
    return bound


def _meta(name: str, x):
    """A meta tensor with x's shape and strides; data in bf16 as the CUDA kernels need (lse stays fp32)."""
    if not isinstance(x, torch.Tensor):
        return x
    dtype = torch.bfloat16 if x.is_floating_point() and name != "logsumexp" else x.dtype
    return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta")


def meta_shapes(op: str, args: tuple, kwargs: dict) -> list:
    schema = getattr(torch.ops.aten, op).default._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    res = getattr(torch.ops.aten, op).default(
        *(_meta(n, x) for n, x in zip(positional, args)), **{n: _meta(n, x) for n, x in kwargs.items()}
    )
    return [tuple(r.shape) if isinstance(r, torch.Tensor) else None for r in res]


def check_against_meta(op: str, args: tuple, kwargs: dict, result: tuple, compare: int) -> None:
    want = meta_shapes(op, args, kwargs)
    for i in range(compare):
        assert tuple(result[i].shape) == want[i], f"{op} result {i}: fake {tuple(result[i].shape)}, real {want[i]}"


CALLS: list[tuple[str, dict]] = []


def _window_of(b: dict):
    """flash semantics: causal means right = 0 (bottom-right); -1 or None is unbounded."""
    left = b["window_size_left"] if b["window_size_left"] is not None else -1
    right = 0 if b["is_causal"] else (b["window_size_right"] if b["window_size_right"] is not None else -1)
    return None if (left, right) == (-1, -1) else (left, right)


def _segments(cu_q, cu_k, max_q, max_k):
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
    q, k = cu_q.tolist(), cu_k.tolist()
    segs = [(q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(q) - 1)]
    assert max_q == max(b - a for a, b, _, _ in segs) and max_k == max(d - c for _, _, c, d in segs)
    return segs


def fake_flash_forward(*args, **kwargs):
    b = bind("_flash_attention_forward", args, kwargs)
    CALLS.append(("_flash_attention_forward", b))
    assert b["dropout_p"] == 0.0 and b["return_debug_mask"] is False
    q, k, v = b["query"], b["key"], b["value"]
    kw = dict(causal=False, scale=b["scale"], window=_window_of(b))
    if b["cum_seq_q"] is None:
        assert q.dim() == 4 and (b["max_q"], b["max_k"]) == (q.shape[1], k.shape[1])
        out, lse = _M.forward(q, k, v, **kw)
    else:  # [total, H, D], lse [H, total]
        assert q.dim() == 3 and q.is_contiguous()
        outs, lses = [], []
        for qa, qb, ka, kb in _segments(b["cum_seq_q"], b["cum_seq_k"], b["max_q"], b["max_k"]):
            o, l = _M.forward(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], **kw)
            outs.append(o[0])
            lses.append(l[0])
        out, lse = torch.cat(outs), torch.cat(lses, 1)
    res = (out, lse, torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64), q.new_empty(0))
    check_against_meta("_flash_attention_forward", args, kwargs, res, 2)
    return res


def fake_flash_backward(*args, **kwargs):
    b = bind("_flash_attention_backward", args, kwargs)
    CALLS.append(("_flash_attention_backward", b))
    assert b["dropout_p"] == 0.0
    lse = b["logsumexp"]
    assert lse.is_contiguous() and lse.dtype == torch.float32, "the kernel reads lse as contiguous fp32"
    t = [b[n] for n in ("grad_out", "query", "key", "value", "out")]
    kw = dict(causal=False, scale=b["scale"], window=_window_of(b))
    if b["cum_seq_q"] is None:
        assert lse.shape == (t[1].shape[0], t[1].shape[2], t[1].shape[1]), "dense lse is [B, H, Sq]"
        assert (b["max_q"], b["max_k"]) == (t[1].shape[1], t[2].shape[1])
        dq, dk, dv = _M.backward(t[0], t[1], t[2], t[3], t[4], lse, **kw)
    else:
        assert lse.shape == (t[1].shape[1], t[1].shape[0]), "varlen lse is [H, total_q]"
        dq, dk, dv = torch.empty_like(t[1]), torch.zeros_like(t[2]), torch.zeros_like(t[3])
        for qa, qb, ka, kb in _segments(b["cum_seq_q"], b["cum_seq_k"], b["max_q"], b["max_k"]):
            g = _M.backward(
                t[0][None, qa:qb],
                t[1][None, qa:qb],
                t[2][None, ka:kb],
                t[3][None, ka:kb],
                t[4][None, qa:qb],
                lse[None, :, qa:qb],
                **kw,
            )
            dq[qa:qb] = g[0][0]
            dk[ka:kb] += g[1][0]
            dv[ka:kb] += g[2][0]
    check_against_meta("_flash_attention_backward", args, kwargs, (dq, dk, dv), 3)
    return dq, dk, dv


def _bshd(x):
    return x.transpose(1, 2)


def fake_cudnn_forward(*args, **kwargs):
    b = bind("_scaled_dot_product_cudnn_attention", args, kwargs)
    CALLS.append(("_scaled_dot_product_cudnn_attention", b))
    q, k, v = b["query"], b["key"], b["value"]
    assert q.shape[1] == k.shape[1] == v.shape[1], "the dense cuDNN operator takes one head count"
    assert b["attn_bias"] is None and b["compute_log_sumexp"] is True and b["dropout_p"] == 0.0
    # cuDNN's causal mask is top-left: the math kernel's tril on the [Sq, Sk] scores is exactly that
    out, lse = _M.forward(_bshd(q), _bshd(k), _bshd(v), causal=b["is_causal"], scale=b["scale"])
    res = (
        _bshd(out),
        lse.unsqueeze(-1),
        None,
        None,
        q.shape[2],
        k.shape[2],
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        None,
    )
    check_against_meta("_scaled_dot_product_cudnn_attention", args, kwargs, res, 2)
    return res


def fake_cudnn_backward(*args, **kwargs):
    b = bind("_scaled_dot_product_cudnn_attention_backward", args, kwargs)
    CALLS.append(("_scaled_dot_product_cudnn_attention_backward", b))
    q, k, v, lse = b["query"], b["key"], b["value"], b["logsumexp"]
    assert b["attn_bias"] is None and b["cum_seq_q"] is None and b["cum_seq_k"] is None, (
        "a defined attn_bias/cum_seq tensor switches cuDNN to its bias/nested path"
    )
    assert (b["max_q"], b["max_k"]) == (q.shape[2], k.shape[2]), "cuDNN's dense backward uses max_q/max_k as Sq/Sk"
    assert lse.shape == (*q.shape[:3], 1) and lse.is_contiguous() and lse.dtype == torch.float32
    assert q.shape[1] == k.shape[1] == v.shape[1]
    grads = _M.backward(
        _bshd(b["grad_out"]),
        _bshd(q),
        _bshd(k),
        _bshd(v),
        _bshd(b["out"]),
        lse[..., 0],
        causal=b["is_causal"],
        scale=b["scale"],
    )
    res = tuple(_bshd(g) for g in grads)
    check_against_meta("_scaled_dot_product_cudnn_attention_backward", args, kwargs, res, 3)
    return res


FAKE_OPS = {
    "_flash_attention_forward": fake_flash_forward,
    "_flash_attention_backward": fake_flash_backward,
    "_scaled_dot_product_cudnn_attention": fake_cudnn_forward,
    "_scaled_dot_product_cudnn_attention_backward": fake_cudnn_backward,
}


# ---- FA4: the parameter names of flash_attn.cute.interface (4.0.0b36) -------------------------------------------------


def fa4_module(returns: int):
    def _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        softcap=None,
        window_size_left=None,
        window_size_right=None,
        learnable_sink=None,
        m_block_size=128,
        n_block_size=128,
        num_threads=384,
        num_splits=1,
        pack_gqa=None,
        _arch=None,
        score_mod=None,
        mask_mod=None,
        block_sparse_tensors=None,
        cu_total_m_blocks=None,
        cu_total_n_blocks=None,
        return_lse=False,
        out=None,
        lse=None,
        aux_tensors=None,
    ):
        assert cu_seqlens_q is None and window_size_left is None and window_size_right is None
        assert softcap is None or isinstance(softcap, float)
        assert q.dim() == 4 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        o, l = _M.forward(
            q, k, v, causal=False, scale=softmax_scale, window=(-1, 0) if causal else None, softcap=softcap
        )
        return (o, l if return_lse else None, None, None, None)[:returns]

    def _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=None,
        causal=False,
        softcap=0.0,
        window_size_left=None,
        window_size_right=None,
        m_block_size=64,
        n_block_size=128,
        num_threads=256,
        pack_gqa=False,
        num_stages_Q=2,
        num_stages_dO=2,
        SdP_swapAB=False,
        dKV_swapAB=False,
        dQ_swapAB=False,
        AtomLayoutMSdP=2,
        AtomLayoutNdKV=2,
        AtomLayoutMdQ=2,
        V_in_regs=False,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        deterministic=False,
        dq=None,
        dk=None,
        dv=None,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        aux_tensors=None,
        block_sparse_tensors=None,
    ):
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        assert out.dtype == q.dtype == dout.dtype and isinstance(softcap, float)
        return _M.backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            causal=False,
            scale=softmax_scale,
            window=(-1, 0) if causal else None,
            softcap=softcap or None,
        )

    return types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only add spinning on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fake_ops(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(torch_flash, "_op", lambda name: FAKE_OPS[name])
    monkeypatch.setattr(cudnn, "_op", lambda name: FAKE_OPS[name])
    monkeypatch.setattr(fa4, "_fa4_module", lambda: fa4_module(5))
    return CALLS


ADAPTERS = [torch_flash.TorchFlashKernel(), cudnn.CuDNNKernel(), fa4.FA4Kernel()]
IDS = ["torch-flash", "cudnn", "fa4"]


def _dense(b, sq, sk, h, hkv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, sq, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, sk, hkv, d, generator=g) for _ in range(2))
    return q, k, v, dout


def _close(got: torch.Tensor, want: torch.Tensor, label: str, rtol: float, atol: float) -> None:
    """torch.testing.assert_close(got, want, rtol, atol), with the figure recorded (tests/tolerance.py)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (label, got.shape, want.shape, got.dtype, want.dtype)
    within(allclose_ratio(got, want, rtol, atol), 1.0, f"{label} / allclose allowance")


def _assert_matches_math(kern, q, k, v, dout, **kw):
    """The fakes compute with the math kernel: fp32 round-off of the same sums in another order (out and lse
    rtol 1e-5 + atol 1e-6, gradients rtol = atol = 1e-5): worst seen 0 (the same GEMMs in the same order)."""
    out, lse = kern.forward(q, k, v, scale=0.25, **kw)
    ref_out, ref_lse = _M.forward(q, k, v, scale=0.25, **kw)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    _close(out, ref_out, "out", rtol=1e-5, atol=1e-6)
    _close(lse, ref_lse, "lse", rtol=1e-5, atol=1e-6)
    # the backward gets a non-contiguous lse view, as the ring passes it
    lse_view = torch.cat([lse, lse], 2)[:, :, : q.shape[1]]
    grads = kern.backward(dout, q, k, v, out, lse_view, scale=0.25, **kw)
    for name, got, want, like in zip(
        ("dq", "dk", "dv"), grads, _M.backward(dout, q, k, v, out, lse, scale=0.25, **kw), (q, k, v)
    ):
        assert got.shape == like.shape
        _close(got, want, name, rtol=1e-5, atol=1e-5)


# ---- the adapters against the schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kern", ADAPTERS, ids=IDS)
@pytest.mark.parametrize(
    "sq,sk,causal,h,hkv",
    [(200, 136, False, 8, 2), (72, 264, False, 8, 2), (200, 200, True, 8, 2), (33, 33, True, 4, 4)],
    ids=["rect-2CxC-gqa", "rect-Cx2C-gqa", "causal-200-gqa", "causal-33-mha"],
)
def test_dense_blocks_match_math(fake_ops, kern, sq, sk, causal, h, hkv):
    q, k, v, dout = _dense(2, sq, sk, h, hkv)
    q = torch.cat([q, q], 1)[:, :sq]  # a non-contiguous row slice, as the ring takes it
    _assert_matches_math(kern, q, k, v, dout, causal=causal)
    ops = {
        "torch-flash": ["_flash_attention_forward", "_flash_attention_backward"],
        "cudnn": ["_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"],
        "fa4": [],
    }[kern.name]
    assert [name for name, _ in fake_ops] == ops


@pytest.mark.parametrize("kern", ADAPTERS, ids=IDS)
@pytest.mark.parametrize(
    "causal,seg_q,seg_k",
    [
        (True, [37, 130, 61], [37, 130, 61]),
        (False, [37, 130, 61], [50, 20, 90]),
    ],
    ids=["causal", "noncausal"],
)
def test_varlen_matches_math(fake_ops, kern, causal, seg_q, seg_k):
    q, k, v, dout, kw = _varlen(seg_q, seg_k, 8, 2)
    _assert_matches_math(kern, q, k, v, dout, causal=causal, **kw)
    if kern.name == "torch-flash":  # native varlen: one call each way, [total, H, D] with cum_seq
        assert [n for n, _ in fake_ops] == ["_flash_attention_forward", "_flash_attention_backward"]
        assert fake_ops[0][1]["cum_seq_q"] is kw["cu_seqlens_q"] and fake_ops[0][1]["max_q"] == 130


@pytest.mark.parametrize(
    "window,sq,sk,causal", [((40, 0), 200, 200, True), ((30, 20), 150, 200, False), ((-1, 5), 120, 100, False)]
)
def test_torch_flash_windows(fake_ops, window, sq, sk, causal):
    q, k, v, dout = _dense(2, sq, sk, 8, 2)
    _assert_matches_math(torch_flash.TorchFlashKernel(), q, k, v, dout, causal=causal, window=window)
    fwd = fake_ops[0][1]
    assert (fwd["window_size_left"], fwd["window_size_right"]) == window
    seg_q, seg_k = [37, 130, 61], [50, 20, 90]
    q, k, v, dout, kw = _varlen(seg_q, seg_k, 8, 2)
    _assert_matches_math(torch_flash.TorchFlashKernel(), q, k, v, dout, causal=False, window=(30, 20), **kw)


def test_torch_flash_rectangular_causal_is_bottom_right(fake_ops):
    q, k, v, dout = _dense(1, 50, 90, 4, 2)
    out, lse = torch_flash.TorchFlashKernel().forward(q, k, v, causal=True, scale=0.25)
    ref_out, ref_lse = _M.forward(q, k, v, causal=False, window=(-1, 0), scale=0.25)
    # assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5): the same sums as the math kernel's window form
    _close(out, ref_out, "out", rtol=1.3e-6, atol=1e-5)
    _close(lse, ref_lse, "lse", rtol=1.3e-6, atol=1e-5)


def test_cudnn_refuses_rectangular_causal(fake_ops):
    q, k, v, dout = _dense(1, 50, 90, 4, 2)
    with pytest.raises(ValueError, match="top-left"):
        cudnn.CuDNNKernel().forward(q, k, v, causal=True, scale=0.25)
    with pytest.raises(ValueError, match="top-left"):
        cudnn.CuDNNKernel().backward(q, q, k, v, q, torch.zeros(1, 4, 50), causal=True, scale=0.25)
    assert not fake_ops  # refused before any operator ran


def test_window_keyword_support_is_declared():
    assert kernels.takes_keyword(torch_flash.TorchFlashKernel(), "window")
    assert kernels.takes_keyword(torch_flash.TorchFlashKernel(), "cu_seqlens_q")
    for kern in (cudnn.CuDNNKernel(), fa4.FA4Kernel()):
        assert not kernels.takes_keyword(kern, "window") and kernels.takes_keyword(kern, "cu_seqlens_q")


def test_sdpa_windows_are_cpu_only_for_auto_and_the_self_test():
    sdpa = kernels.SDPAKernel()
    assert kernels.takes_keyword_on(sdpa, "window", torch.device("cpu"))
    assert not kernels.takes_keyword_on(sdpa, "window", CUDA) and kernels.takes_keyword_on(sdpa, "cu_seqlens_q", CUDA)
    name, skipped = kernels.select_kernel(
        ["sdpa", "math"], {"sdpa": sdpa, "math": MathKernel()}, CUDA, torch.float32, 64, needs=("window",)
    )
    assert name == "math" and "window" in skipped[0][1]


def test_adapters_run_the_real_operators_on_meta():
    """No fakes: the real aten operators' shape functions accept exactly what the adapters pass."""
    m = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 200, 8, 64, **m), torch.empty(2, 136, 2, 64, **m)
    for kern in (torch_flash.TorchFlashKernel(), cudnn.CuDNNKernel()):
        out, lse = kern.forward(q, k, k, causal=False, scale=0.125)
        assert out.shape == q.shape and lse.shape == (2, 8, 200) and lse.dtype == torch.float32
        dq, dk, dv = kern.backward(out, q, k, k, out, lse[:, :, :], causal=False, scale=0.125)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    tq, tk = torch.empty(1, 228, 8, 64, **m), torch.empty(1, 160, 2, 64, **m)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, max_seqlen_q=130, max_seqlen_k=90)
    out, lse = torch_flash.TorchFlashKernel().forward(tq, tk, tk, causal=False, scale=0.1, window=(30, 20), **kw)
    assert out.shape == tq.shape and lse.shape == (1, 8, 228)
    grads = torch_flash.TorchFlashKernel().backward(
        out, tq, tk, tk, out, lse, causal=False, scale=0.1, window=(30, 20), **kw
    )
    assert [g.shape for g in grads] == [tq.shape, tk.shape, tk.shape]


@pytest.mark.parametrize("returns", [2, 5], ids=["fa4-2-values", "fa4-5-values"])
def test_fa4_return_arity(monkeypatch, returns):
    monkeypatch.setattr(fa4, "_fa4_module", lambda: fa4_module(returns))
    q, k, v, dout = _dense(2, 72, 264, 8, 2)
    _assert_matches_math(fa4.FA4Kernel(), q, k, v, dout, causal=False)


def test_supports_reasons(monkeypatch):
    for mod in (torch_flash, cudnn, fa4):
        monkeypatch.setattr(mod, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(fa4, "_fa4_module", lambda: None)
    assert "flash-attn-4 is not installed (pip install 'hybrid-cp[fa4]')" == fa4.FA4Kernel().supports(
        CUDA, torch.bfloat16, 128
    )
    monkeypatch.setattr(fa4, "_fa4_module", lambda: fa4_module(5))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(cudnn, "_cudnn_version", lambda: 91500)
    for kern in ADAPTERS:
        assert kern.supports(CUDA, torch.bfloat16, 128) is None, kern.name
        assert "CUDA only" in kern.supports(torch.device("cpu"), torch.bfloat16, 128)
        assert "fp16/bf16" in kern.supports(CUDA, torch.float32, 128)
        assert "multiple of 8" in kern.supports(CUDA, torch.bfloat16, 100)
    monkeypatch.setattr(cudnn, "_cudnn_version", lambda: 90100)
    assert "head_dim <= 128" in cudnn.CuDNNKernel().supports(CUDA, torch.bfloat16, 256)
    for mod in (torch_flash, cudnn, fa4):
        monkeypatch.setattr(mod, "_capability", lambda device: (8, 0))
    assert "sm90" in fa4.FA4Kernel().supports(CUDA, torch.bfloat16, 128)
    assert torch_flash.TorchFlashKernel().supports(CUDA, torch.bfloat16, 128) is None
    monkeypatch.setattr(torch_flash, "_capability", lambda device: (7, 5))
    assert "sm80" in torch_flash.TorchFlashKernel().supports(CUDA, torch.bfloat16, 128)


def test_flash_attn_backward_is_deterministic_when_asked(monkeypatch):
    from test_flash_adapter import fa274

    seen = []
    real_call = flash._call
    monkeypatch.setattr(flash, "_flash_module", lambda: (fa274(), 2))
    monkeypatch.setattr(flash, "_call", lambda fn, **kw: seen.append(kw.get("deterministic")) or real_call(fn, **kw))
    q, k, v, dout = _dense(1, 24, 24, 4, 2)
    kern = flash.FlashAttnKernel()
    out, lse = kern.forward(q, k, v, causal=True, scale=0.25)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True):
            torch.use_deterministic_algorithms(flag)
            kern.backward(dout, q, k, v, out, lse, causal=True, scale=0.25)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen[1:] == [False, True]


# ---- the self-test and "auto" on CUDA --------------------------------------------------------------------------------


@pytest.mark.parametrize("kern", ADAPTERS, ids=IDS)
def test_self_test_passes_the_adapters(fake_ops, kern):
    kernels.self_test(kern, torch.device("cpu"), torch.float32, 8)
    assert bool(fake_ops) == (kern.name != "fa4")  # the operator fakes really ran (fa4 has its own module)


class _WrongCausal(MathKernel):
    """Forgets the causal mask."""

    name = "wrong-causal"

    def forward(self, q, k, v, *, causal, scale, **kw):
        return super().forward(q, k, v, causal=False, scale=scale, **kw)  # forgets the mask

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, **kw):
        return super().backward(dout, q, k, v, out, lse, causal=False, scale=scale, **kw)


class _WrongLse(MathKernel):
    name = "wrong-lse"

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, **kw):
        return super().backward(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous().view(lse.shape[0], lse.shape[2], lse.shape[1]).transpose(1, 2),
            causal=causal,
            scale=scale,
            **kw,
        )  # reads lse in the wrong layout


@pytest.mark.parametrize("bad,match", [(_WrongCausal(), "merged split blocks"), (_WrongLse(), "relative error")])
def test_self_test_catches_broken_kernels(bad, match):
    with pytest.raises(AssertionError, match=match):
        kernels.self_test(bad, torch.device("cpu"), torch.float32, 8)


class _Fake:
    def __init__(self, name, reason=None, window=True):
        self.name, self.reason = name, reason
        if not window:
            self.forward = lambda q, k, v, *, causal, scale: None
            self.backward = lambda dout, q, k, v, out, lse, *, causal, scale: None

    def supports(self, device, dtype, head_dim):
        return self.reason

    def forward(self, q, k, v, *, causal, scale, **kw):
        raise AssertionError("the selection must not run a kernel")

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, **kw):
        raise AssertionError("the selection must not run a kernel")


def test_select_kernel_order_reasons_and_needs():
    ks = {"a": _Fake("a", "not installed"), "b": _Fake("b"), "c": _Fake("c", window=False), "d": _Fake("d")}

    def probe(kernel, device, dtype, head_dim):
        if kernel.name == "b":
            raise RuntimeError("CUDA error: misaligned address")

    name, skipped = kernels.select_kernel("abcd", ks, CUDA, torch.bfloat16, 128, probe=probe)
    assert name == "c"
    assert skipped == [("a", "not installed"), ("b", "self-test failed: RuntimeError: CUDA error: misaligned address")]
    name, skipped = kernels.select_kernel("abcd", ks, CUDA, torch.bfloat16, 128, probe=probe, needs=["window"])
    assert name == "d" and "does not take" in skipped[-1][1] and "window" in skipped[-1][1]
    with pytest.raises(ValueError, match="a: not installed"):
        kernels.select_kernel("a", ks, CUDA, torch.bfloat16, 128)


def test_auto_on_cuda_picks_tests_once_caches_and_logs_once(monkeypatch, caplog):
    fakes = {
        "fa4": _Fake("fa4", "flash-attn-4 is not installed (pip install 'hybrid-cp[fa4]')"),
        "flash": _Fake("flash", "flash-attn is not installed"),
        "cudnn": _Fake("cudnn"),
        "torch-flash": _Fake("torch-flash"),
        "sdpa": _Fake("sdpa"),
        "math": MathKernel(),
    }
    for name, kern in fakes.items():
        monkeypatch.setitem(registry._REGISTRY, name, kern)
    monkeypatch.setattr(registry, "_AUTO", {})
    monkeypatch.setattr(selftest, "_SELF_TESTS", {})
    probed = []

    def fake_self_test(kernel, device, dtype, head_dim):
        probed.append((kernel.name, device, dtype, head_dim))
        if kernel.name == "cudnn":
            raise AssertionError("merged split blocks: dq relative error 4.1e-01 > 3e-02")

    monkeypatch.setattr(selftest, "self_test", fake_self_test)
    caplog.set_level(logging.INFO, logger="hybrid_cp")
    for _ in range(3):
        assert kernels.get_kernel("auto", CUDA, torch.bfloat16, 128).name == "torch-flash"
    assert probed == [("cudnn", CUDA, torch.bfloat16, 128), ("torch-flash", CUDA, torch.bfloat16, 128)]
    records = [r for r in caplog.records if r.name == "hybrid_cp"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING  # a faster kernel failed its self-test
    msg = records[0].getMessage()
    assert "picked 'torch-flash'" in msg and "cuda:0" in msg and "fa4: flash-attn-4 is not installed" in msg
    assert "cudnn: self-test failed: AssertionError: merged split blocks" in msg
    # a window call skips kernels without the keyword; self-tests are not rerun
    fakes["torch-flash"].forward = lambda q, k, v, *, causal, scale: None
    monkeypatch.setattr(registry, "_AUTO", {})
    assert kernels.get_kernel("auto", CUDA, torch.bfloat16, 128, needs=("window",)).name == "sdpa"
    assert [p[0] for p in probed] == ["cudnn", "torch-flash", "sdpa"]
    # another dtype is another choice; the math kernel (the reference) is not self-tested, and
    # fp64 landing there is no warning (no fast kernel takes fp64)
    del fakes["torch-flash"].forward
    for name in ("cudnn", "torch-flash", "sdpa"):
        fakes[name].reason = "fp16/bf16 only"
    caplog.clear()
    assert kernels.get_kernel("auto", CUDA, torch.float64, 128).name == "math"
    assert len(probed) == 3 and [r.levelno for r in caplog.records if r.name == "hybrid_cp"] == [logging.INFO]
    # a named backend never falls back
    with pytest.raises(ValueError, match="fa4.*not installed"):
        kernels.get_kernel("fa4", CUDA, torch.bfloat16, 128)


def test_auto_on_cpu_is_unchanged(caplog):
    cpu = torch.device("cpu")
    assert kernels.get_kernel("auto", cpu, torch.bfloat16, 64).name == "sdpa"
    assert kernels.get_kernel("auto", cpu, torch.float64, 64).name == "math"
    assert kernels.get_kernel("auto", cpu, torch.float32, 64, needs=("window", "cu_seqlens_q")).name == "sdpa"


# ---- benchmarks/gpu_check.py: its CPU-independent parts (the GPU run itself is not possible here) -------------------


def test_gpu_check_writes_json_and_markdown(tmp_path, monkeypatch):
    import importlib.util
    import json
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gc = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gc)  # its dataclass looks itself up there
    spec.loader.exec_module(gc)
    monkeypatch.delenv("OUT", raising=False)
    a = gc.parse_args([])
    assert a.out == os.path.join("benchmarks", "results") and not a.dry_run
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert gc.parse_args([]).out == str(tmp_path / "o") and gc.parse_args(["--dry-run"]).dry_run
    res = {
        "env": {"gpu": "X", "supports_bf16": {"fa4": "not installed", "cudnn": "yes"}},
        "parity": [
            {
                "kernel": "cudnn",
                "dtype": "bfloat16",
                "D": 128,
                "case": "merged",
                "out": 4e-3,
                "lse": 1e-5,
                "dq": 8e-3,
                "dk": 7e-3,
                "dv": 5e-3,
                "pass": True,
            },
            {"kernel": "fa4", "dtype": "bfloat16", "D": 128, "skipped": "flash-attn-4 | not installed"},
            {"kernel": "torch-flash", "dtype": "float16", "D": 64, "error": "RuntimeError: boom"},
        ],
        "throughput": [
            {
                "kernel": "cudnn",
                "tokens": 8192,
                "block": "full",
                "fwd_tflops_best": 512.3,
                "fwd_tflops_median": 500.1,
                "bwd_tflops_best": 401.0,
                "bwd_tflops_median": 399.0,
            }
        ],
        "schedule": [{"kernel": "cudnn", "tokens_per_block": 32768, "r": 8, "fwd_efficiency": 0.97}],
        "sync": [{"check": "ring", "result": "no host sync"}],
        "seconds": {"parity": 1.0},
        "_mesh": object(),
    }
    jp, mp = gc.write(res, str(tmp_path / "w"))
    assert "_mesh" not in json.load(open(jp))
    md = open(mp).read()
    assert "| cudnn | bfloat16 | 128 | merged | 4.0e-03 |" in md and "| 512 / 500 | 401 / 399 |" in md
    assert "skipped: flash-attn-4 / not installed" in md and "error: RuntimeError: boom" in md
    assert "| cudnn | 32768 | 8 |" in md and "0.97" in md and "no host sync" in md


def test_fa4_passes_softcap_forward_and_backward(fake_ops):
    """FA4's own `softcap` (forward None/float, backward 0.0/float): with the fake computing the math kernel's
    soft-capped attention, out, lse and every gradient match only if both entry points get it."""
    kern = fa4.FA4Kernel()
    assert kernels.takes_keyword(kern, "softcap")
    for sq, sk, causal in ((64, 64, True), (40, 72, False)):
        q, k, v, dout = _dense(2, sq, sk, 8, 2)
        _assert_matches_math(kern, q, k, v, dout, causal=causal, softcap=1.5)
    q, k, v, dout, kw = _varlen([37, 20], [37, 20], 8, 2)
    _assert_matches_math(kern, q, k, v, dout, causal=True, softcap=1.5, **kw)


def test_variant_capabilities_of_each_kernel():
    """softcap: math, flash, fa4; a value head dim != q/k's: math only (the others are refused, not guessed)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    every = {
        k.name: k
        for k in (
            MathKernel(),
            kernels.SDPAKernel(),
            flash.FlashAttnKernel(),
            torch_flash.TorchFlashKernel(),
            cudnn.CuDNNKernel(),
            fa4.FA4Kernel(),
        )
    }
    assert sorted(n for n, k in every.items() if kernels.takes_keyword(k, "softcap")) == ["fa4", "flash", "math"]
    for device in (cpu, cuda):
        assert [n for n, k in every.items() if kernels.can_on(k, "value_head_dim", device)] == ["math"]
    assert kernels.kernels_that_can("softcap", cpu) == ["fa4", "flash", "math"]
    name, skipped = kernels.select_kernel(["sdpa", "math"], every, cpu, torch.float32, 16, needs=["value_head_dim"])
    assert name == "math" and "value_head_dim" in skipped[0][1]


class _IgnoresSoftcap(MathKernel):
    """Takes the soft-cap keyword but computes plain attention: what the soft-cap self-test must catch."""

    name = "ignores-softcap"

    def forward(self, q, k, v, *, causal, scale, softcap=None, **kw):
        return MathKernel.forward(self, q, k, v, causal=causal, scale=scale, **kw)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, softcap=None, **kw):
        return MathKernel.backward(self, dout, q, k, v, out, lse, causal=causal, scale=scale, **kw)


def test_self_test_checks_the_softcap_only_when_a_call_needs_it(fake_ops):
    cpu = torch.device("cpu")
    selftest.self_test(_IgnoresSoftcap(), cpu, torch.float32, 16)  # no soft-cap asked: passes
    with pytest.raises(AssertionError, match="softcap 1 causal"):
        selftest.self_test(_IgnoresSoftcap(), cpu, torch.float32, 16, needs=("softcap",))
    selftest.self_test(fa4.FA4Kernel(), cpu, torch.float32, 16, needs=("softcap",))  # passes it on
