"""Attention sinks, logit soft-capping and a value head dim != q/k's: fp64 parity against an independent
autograd reference on every mesh with u * r <= 8 (forward and backward, d(sinks) included), the model
combinations (gpt-oss, Gemma 2, DeepSeek), torch.compile, and the checks that refuse what is not verified."""

import pytest
import torch
import variant_cases
from tolerance import relative_error, within

import hybrid_cp as hcp
from hybrid_cp.engine.kernels import get_kernel, kernel_needs
from hybrid_cp.testing import mesh_description
from hybrid_cp.testing.cases import MESHES

# fp64 round-off against the independent fp64 autograd reference: worst 1.6e-15 (d(sinks)), 610x
FP64 = 1e-12
# fp32 cases against the fp64 reference, and compiled fp32 against eager fp32: worst 7.3e-7 (dq, (8, 1)), 14x
FP32 = 1e-5
DOCS = [20, 1, 27]


def _cases(u: int, r: int) -> list[dict]:
    """Every variant alone and in the combinations models use, causal and not, GQA/MQA/MHA, dense (with
    padding) and packed, head chunks; fp32 cases (whose bytes are checked against the cost model); the
    contiguous layout on the meshes that have one."""
    h = 16 if u == 8 else 8
    cases = [
        dict(sinks=True, causal=False, h=8, hkv=2, d=8, n=45),  # sinks, GQA, padding
        dict(sinks=True, causal=True, h=8, hkv=1, d=8, docs=DOCS),  # sinks, MQA, packed
        dict(softcap=2.0, causal=True, h=8, hkv=8, d=8, n=48),  # soft-cap, MHA
        dict(softcap=2.0, causal=False, h=8, hkv=2, d=8, docs=DOCS),  # soft-cap, packed
        dict(dv=4, causal=False, h=8, hkv=1, d=12, n=40, dtype="fp32"),  # Dv != D, MQA
        dict(sinks=True, causal=True, window=7, h=8, hkv=2, d=8, n=48),  # gpt-oss
        dict(softcap=2.0, causal=True, window=9, h=8, hkv=2, d=8, n=48),  # Gemma 2
        dict(dv=8, causal=True, h=8, hkv=8, d=12, docs=DOCS),  # DeepSeek (MLA)
        dict(
            sinks=True, softcap=3.0, dv=4, causal=True, window=5, h=h, hkv=2, d=8, n=48, head_chunks=2
        ),  # everything, head chunks
        dict(sinks=True, softcap=3.0, dv=4, causal=False, window=(3, 6), h=8, hkv=2, d=8, docs=DOCS, dtype="fp32"),
        dict(sinks=True, causal=True, window=7, h=8, hkv=2, d=8, n=48, dtype="fp32"),
    ]
    if (u, r) in ((2, 2), (1, 4), (4, 2), (2, 4)):
        cases.append(dict(sinks=True, softcap=3.0, dv=4, causal=True, h=8, hkv=2, d=8, n=45, layout="contiguous"))
    return cases


@pytest.mark.parametrize("u,r", MESHES)
def test_variants_match_fp64_reference(pool, u, r):
    for rank, rows in enumerate(pool.run(variant_cases.variant_errors, u=u, r=r, cases=_cases(u, r))):
        for i, row in enumerate(rows):
            limit = FP32 if row.get("dtype") == "fp32" else FP64
            for t in ("out", "lse", "dq", "dk", "dv", "dsinks"):
                within(row[t], limit, f"rank {rank} case {row['case']} {t}", row)
            assert row["out_dim_ok"] is True, row
            assert row.get("bytes_match", True) is True, (rank, row.get("bytes_match"))  # engine == topology.comm_bytes


def test_compiled_variants_equal_eager(pool):
    for rank, row in enumerate(pool.run(variant_cases.compiled_variant, u=2, r=2)):
        if row is not None:
            for key, err in row.items():
                within(err, FP32, f"rank {rank} {key}", row)


@pytest.mark.parametrize(
    "which,expect",
    [
        ("softcap", "softcap (checksum)"),
        ("sinks_missing", "sinks (checksum)"),
        ("sinks_values", "sinks (checksum)"),
        ("v_head_dim", "v head_dim"),
    ],
)
def test_ranks_that_disagree_raise(pool, which, expect):
    messages = pool.run(variant_cases.disagreement, u=2, r=2, which=which, timeout=60)
    assert all(m != "no error" for m in messages), messages
    assert any(expect in m for m in messages), messages


def test_auto_picks_a_kernel_that_can():
    cpu = torch.device("cpu")
    assert get_kernel("auto", cpu, torch.float32, 16).name == "sdpa"
    assert get_kernel("auto", cpu, torch.float32, 16, needs=kernel_needs(None, None, 30.0)).name == "math"
    assert get_kernel("auto", cpu, torch.float32, 16, needs=kernel_needs(None, None, None, True)).name == "math"


def _local(h=4, hkv=2, d=8, dv=8, n=16):
    return torch.randn(1, n, h, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, dv)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            dict(backend="sdpa", softcap=30.0),
            hcp.ConfigError,
            r"'sdpa' does not take the 'softcap'.*can: \[.*'fa4', 'flash', 'math'\]",
        ),
        (
            dict(backend="sdpa", v=torch.randn(1, 16, 2, 4)),
            hcp.ConfigError,
            r"'sdpa' does not take the 'value_head_dim'",
        ),
        (dict(softcap=0.0), hcp.ConfigError, "softcap=0.0 must be a positive finite number"),
        (dict(softcap=-1), hcp.ConfigError, "softcap=-1"),
        (dict(softcap=True), hcp.ConfigError, "softcap=True"),
        (dict(softcap=float("inf")), hcp.ConfigError, "softcap=inf"),
        (dict(sinks=torch.zeros(3)), hcp.ShapeError, r"sinks has shape \(3,\); it must be \[H\] = \[4\]"),
        (dict(sinks=torch.zeros(1, 4)), hcp.ShapeError, r"sinks has shape \(1, 4\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), hcp.InputTypeError, "sinks.dtype=torch.int64 is not floating"),
        (dict(sinks=[0.0] * 4), hcp.InputTypeError, "sinks must be a torch.Tensor"),
        (dict(v=torch.randn(1, 16, 1, 8)), hcp.ShapeError, "may differ only in the head dim"),
        (dict(v=torch.randn(1, 8, 2, 8)), hcp.ShapeError, "may differ only in the head dim"),
        (dict(backend=lambda q, k, v: q, sinks=torch.zeros(4)), hcp.ConfigError, "sinks= needs a kernel backend"),
        (dict(backend=lambda q, k, v: q, softcap=5.0), hcp.ConfigError, "softcap= needs a kernel backend"),
    ],
)
def test_bad_variant_arguments_raise(kwargs, error, match):
    q, k, v = _local()
    v = kwargs.pop("v", v)
    with pytest.raises(error, match=match):
        hcp.attention(q, k, v, mesh_description(1, 1), **kwargs)


def test_single_device_variants_and_callable_with_dv():
    """cp of one rank: the engine without communication equals the reference, and a plain callable may
    return v's head dim."""
    from dist_cases import visibility
    from variant_cases import reference

    q, k, v = (x.double().requires_grad_() for x in _local(dv=4))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = hcp.attention(q, k, v, mesh_description(1, 1), causal=True, softcap=2.0, sinks=sinks, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference(q, k, v, dout, sinks, 8**-0.5, visibility([16], True), 2.0)
    for name, got, want in zip(
        ("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, q.grad, k.grad, v.grad, sinks.grad), ref
    ):
        within(relative_error(got.detach(), want.detach(), floor=1.0), FP64, name)
    plain = hcp.attention(q, k, v, mesh_description(1, 1), backend=lambda q, k, v: q[..., :4])
    assert plain.shape == (1, 16, 4, 4)


def _module_project(d: int, dv: int, n: int, q_ranges, sinks=None):
    """project(j, tensors) of a tiny attention module: chunk j's q heads and KV head j from x [1, n, hidden]."""
    import torch.nn.functional as F

    from hybrid_cp.engine.modulechunk import Projected

    def project(j, tensors):
        x, wq, wk, wv = tensors[:4]
        qa, qb = q_ranges[j]
        q = F.linear(x, wq[qa * d : qb * d]).view(1, n, qb - qa, d)
        k = F.linear(x, wk[j * d : (j + 1) * d]).view(1, n, 1, d)
        v = F.linear(x, wv[j * dv : (j + 1) * dv]).view(1, n, 1, dv)
        return Projected(q, k, v, {"causal": True, "seq_len": n, "softcap": 2.0, "sinks": sinks})

    return project


def test_module_chunks_with_a_value_head_dim_and_softcap():
    """Module-level head chunks (one process): v's head dim sizes the output and its projection's slices;
    output and every gradient equal one hcp.attention call over all heads."""
    import torch.nn.functional as F

    from hybrid_cp.engine.modulechunk import pipelined_module_chunks

    g = torch.Generator().manual_seed(3)
    h, d, dv, n, hidden, q_ranges = 4, 8, 4, 16, 12, [(0, 2), (2, 4)]
    x, wq, wk, wv, wo = (
        torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
        for s in ((1, n, hidden), (h * d, hidden), (2 * d, hidden), (2 * dv, hidden), (hidden, h * dv))
    )
    cp = mesh_description(1, 1)
    y = pipelined_module_chunks(
        _module_project(d, dv, n, q_ranges), q_ranges, [1, 1], cp, 1, [x], [wq, wk, wv], wo, None
    )
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, wq, wk, wv, wo), dy)
    q, k, v = (F.linear(x, w).view(1, n, -1, e) for w, e in ((wq, d), (wk, d), (wv, dv)))
    ref_y = F.linear(hcp.attention(q, k, v, cp, causal=True, softcap=2.0).flatten(2), wo)
    want = torch.autograd.grad(ref_y, (x, wq, wk, wv, wo), dy)
    within(relative_error(y.detach(), ref_y.detach()), FP64, "output")
    for name, a, b in zip(("x", "wq", "wk", "wv", "wo"), got, want):
        within(relative_error(a, b), FP64, f"d{name}")


def test_module_chunks_refuse_sinks():
    from hybrid_cp.engine.modulechunk import pipelined_module_chunks

    n, q_ranges = 16, [(0, 2), (2, 4)]
    x, wq, wk, wv, wo = (torch.randn(*s) for s in ((1, n, 12), (32, 12), (16, 12), (16, 12), (12, 32)))
    with pytest.raises(hcp.ConfigError, match="module-level head chunks do not take attention sinks"):
        pipelined_module_chunks(
            _module_project(8, 8, n, q_ranges, sinks=torch.zeros(4)),
            q_ranges,
            [1, 1],
            mesh_description(1, 1),
            1,
            [x],
            [wq, wk, wv],
            wo,
            None,
        )
