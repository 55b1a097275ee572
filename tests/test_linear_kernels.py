"""Kernel choice of the linear layers (hybrid_cp/integrations/linear_layers.py, docs/linear.md "Kernels").

There is no GPU and neither fla nor mamba_ssm here: stand-ins with the real signatures (fla's
`chunk_gated_delta_rule`, mamba_ssm's `mamba_chunk_scan_combined`, read from their sources) are put in
`sys.modules`; they check the shapes and keywords they get as the real functions do, record them, and compute
with transformers' torch reference. The "CUDA" branch is forced through the forwards' `kind(device)` with
device "cuda" (CPU tensors), so the dispatcher, the keywords of plain, exporting and probed (continuing) runs
and bitwise equality with the reference path are all checked; the kernels themselves only on a GPU
(benchmarks/gpu_check.py, section "linear")."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from hybrid_cp.errors import ConfigError
from hybrid_cp.integrations import linear_layers as L
from hybrid_cp.testing.families import tiny_model

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", fn)


def _gdn_reference():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return _unwrapped(modeling_qwen3_next.torch_chunk_gated_delta_rule)


def _ssd_reference():
    from transformers.models.bamba import modeling_bamba

    return _unwrapped(modeling_bamba.mamba2_chunk_scan)


def fla_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    """fla's signature and checks (q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV], initial_state
    [N, HV, K, V]); computes with transformers' torch function, which has the same default scale K^-0.5."""
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    assert k.shape == q.shape and v.shape[:2] == (b, t) and hv % h == 0, (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (b, t, hv), (g.shape, beta.shape)
    assert initial_state is None or initial_state.shape == (b, hv, dk, dv), initial_state.shape
    assert scale is None and cu_seqlens is None and cp_context is None and not kwargs
    assert not (use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first)
    CALLS.append(
        (
            "fla",
            {
                "v": tuple(v.shape),
                "initial_state": None if initial_state is None else tuple(initial_state.shape),
                "output_final_state": output_final_state,
                "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
            },
        )
    )
    return _gdn_reference()(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
    state_dtype=None,
):
    """mamba_ssm's signature and the asserts of its forward; computes with transformers' torch function."""
    b, t, h, p = x.shape
    ng, n = B.shape[2:]
    assert h % ng == 0 and B.shape == C.shape == (b, t, ng, n) and dt.shape == (b, t, h) and A.shape == (h,)
    assert D is None or D.shape in ((h, p), (h,))
    assert dt_bias is None or dt_bias.shape == (h,)
    assert z is None and initial_states is None and seq_idx is None and cu_seqlens is None
    assert not return_varlen_states and state_dtype is None
    CALLS.append(
        (
            "mamba_ssm",
            {
                "chunk_size": chunk_size,
                "dt_softplus": dt_softplus,
                "dt_limit": tuple(dt_limit),
                "return_final_states": return_final_states,
                "D": D is not None,
                "dt_bias": dt_bias is not None,
            },
        )
    )
    return _ssd_reference()(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )


CALLS: list = []
_PACKAGES = {
    "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", fla_chunk_gated_delta_rule, "0.5.2"),
    "mamba_ssm.ops.triton.ssd_combined": ("mamba_chunk_scan_combined", mamba_chunk_scan_combined, "2.3.2.post1"),
}


def _install(monkeypatch, present: bool = True, fla_version: str | None = None) -> None:
    """The stand-in packages in sys.modules with their versions (or None entries: `import` then raises
    ImportError)."""
    for path, (name, fn, version) in _PACKAGES.items():
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            mod = types.ModuleType(".".join(parts[:i])) if present else None
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), mod)
        if present:
            setattr(sys.modules[path], name, fn)
            sys.modules[parts[0]].__version__ = fla_version if fla_version and parts[0] == "fla" else version


@pytest.fixture
def kernels(monkeypatch):
    """Stand-ins installed, the kernel cache cleared (before and after), the CUDA kernels opted into."""
    monkeypatch.setenv(L.KERNEL_ENV, "auto")
    L.cuda_kernel.cache_clear()
    CALLS.clear()
    _install(monkeypatch)
    yield monkeypatch
    L.cuda_kernel.cache_clear()


@pytest.fixture(scope="module")
def mixers():
    """A tiny Qwen3-Next Gated DeltaNet block and a tiny Bamba Mamba2 mixer, with their forwards (no mesh:
    `kind(device)` needs none)."""
    gdn = next(m for m in tiny_model("qwen3_next").modules() if type(m).__name__ in L.GATED_DELTANET_CLASSES)
    ssd = next(m for m in tiny_model("bamba").modules() if type(m).__name__ in L.MAMBA2_CLASSES)
    ssd.chunk_size = 8  # runs of 13 tokens cross a chunk (the default 256 pads them to 256: slow on CPU)
    fwd = {"gdn": L._GatedDeltaNetForward(gdn, None), "ssd": L._Mamba2Forward(ssd, None)}
    return gdn, ssd, fwd


def test_cuda_tensors_get_fla_and_mamba_ssm_cpu_the_reference(kernels, mixers):
    _, _, fwd = mixers
    assert fwd["gdn"].kind(CUDA).kernel is fla_chunk_gated_delta_rule
    assert fwd["ssd"].kind(CUDA).kernel is mamba_chunk_scan_combined
    assert fwd["gdn"].kind(CPU).kernel is _gdn_reference()
    assert fwd["ssd"].kind(CPU).kernel is _ssd_reference()


def test_reference_when_not_importable_or_forced(kernels, mixers):
    _, _, fwd = mixers
    kernels.delenv(L.KERNEL_ENV)  # the default: the verified torch kernels, also on CUDA
    assert fwd["gdn"].kind(CUDA).kernel is _gdn_reference()
    assert fwd["ssd"].kind(CUDA).kernel is _ssd_reference()
    kernels.setenv(L.KERNEL_ENV, "torch")
    assert fwd["gdn"].kind(CUDA).kernel is _gdn_reference()
    assert fwd["ssd"].kind(CUDA).kernel is _ssd_reference()
    kernels.setenv(L.KERNEL_ENV, "fla")
    with pytest.raises(ConfigError, match="HYBRID_CP_LINEAR_KERNEL='fla'"):
        fwd["gdn"].kind(CPU)
    with pytest.raises(ConfigError, match="HYBRID_CP_LINEAR_KERNEL='fla'"):  # also when routing, before a forward
        L.route_linear_layers(torch.nn.Linear(1, 1), None)
    kernels.setenv(L.KERNEL_ENV, "auto")
    _install(kernels, present=False)
    L.cuda_kernel.cache_clear()
    assert L.cuda_kernel("torch_chunk_gated_delta_rule") is None
    assert fwd["gdn"].kind(CUDA).kernel is _gdn_reference()
    assert fwd["ssd"].kind(CUDA).kernel is _ssd_reference()


def test_fla_before_native_gva_is_refused(kernels, mixers):
    _, _, fwd = mixers
    _install(kernels, fla_version="0.4.2")  # q, k and v needed one head count: Qwen3-Next's would be wrong
    with pytest.raises(ConfigError, match=r"fla 0\.4\.2 .* from fla 0\.5\.0 on.*HYBRID_CP_LINEAR_KERNEL=torch"):
        fwd["gdn"].kind(CUDA)
    kernels.setenv(L.KERNEL_ENV, "torch")
    assert fwd["gdn"].kind(CUDA).kernel is _gdn_reference()
    assert fwd["ssd"].kind(CUDA).kernel is _ssd_reference()


def test_a_broken_package_raises_instead_of_falling_back(kernels, mixers):
    _, _, fwd = mixers
    kernels.delattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule")  # importable, but broken
    with pytest.raises(AttributeError, match="chunk_gated_delta_rule"):
        fwd["gdn"].kind(CUDA)
    assert fwd["gdn"].kind(CPU).kernel is _gdn_reference()  # CPU never asks for it


def _grads(fn, inputs):
    """(outputs, gradients of a fixed random weighting of every output w.r.t. every input)."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    outs = [o for o in fn(xs) if o is not None]
    g = torch.Generator().manual_seed(3)
    sum(((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)).backward()
    return [o.detach() for o in outs], [x.grad for x in xs]


def _assert_bitwise(fn, inputs, forward):
    """fn(kind, inputs) on the kind chosen for "cuda" (the stand-in) equals it on the CPU's (the reference),
    outputs and gradients; kinds built per call (Mamba2's A comes from the module's parameter)."""
    (go, gg), (ro, rg) = (_grads(lambda xs: fn(forward.kind(dev), xs), inputs) for dev in (CUDA, CPU))
    assert len(go) == len(ro) and all(torch.equal(a, b) for a, b in zip(go + gg, ro + rg))


def test_gated_delta_through_fla_signature_is_the_reference_bitwise(kernels, mixers):
    gdn, _, fwd = mixers
    b, n, hk, hv, dk, dv = 2, 11, gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, n, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, n, hv, dv, generator=g)
    decay, beta = -F.softplus(torch.randn(b, n, hv, generator=g)), torch.rand(b, n, hv, generator=g)
    inputs = (q, k, v, decay, beta)
    for final in (False, True):  # a run that starts its document: exports its state or not
        _assert_bitwise(lambda kind, xs: kind.plain(xs, final), inputs, fwd["gdn"])
    _assert_bitwise(lambda kind, xs: kind.probe(xs), inputs, fwd["gdn"])  # a continuing run
    shared = {"use_qk_l2norm_in_kernel": True}
    assert [c for _, c in CALLS] == [
        {"v": (b, n, hv, dv), "initial_state": None, "output_final_state": False, **shared},
        {"v": (b, n, hv, dv), "initial_state": None, "output_final_state": True, **shared},
        {"v": (b, n, hv, dv + dk), "initial_state": (b, hv, dk, dv + dk), "output_final_state": True, **shared},
    ]


def test_mamba2_through_mamba_ssm_signature_is_the_reference_bitwise(kernels, mixers):
    _, ssd, fwd = mixers
    b, n, h, p, ng, ns = 2, 13, ssd.num_heads, ssd.head_dim, ssd.n_groups, ssd.ssm_state_size
    g = torch.Generator().manual_seed(1)
    x, dt = torch.randn(b, n, h, p, generator=g), torch.randn(b, n, h, generator=g)
    bb, cc = (torch.randn(b, n, ng, ns, generator=g) for _ in range(2))
    inputs = (x, dt, bb, cc)
    for final in (False, True):
        _assert_bitwise(lambda kind, xs: kind.plain(xs, final), inputs, fwd["ssd"])
    _assert_bitwise(lambda kind, xs: kind.probe(xs), inputs, fwd["ssd"])
    shared = {
        "chunk_size": ssd.chunk_size,
        "dt_softplus": True,
        "dt_limit": tuple(ssd.time_step_limit),
        "D": True,
        "dt_bias": True,
    }
    assert [c for _, c in CALLS] == [{**shared, "return_final_states": f} for f in (False, True, True)]


def scan_through_standins(u: int, r: int) -> dict:
    """On every pool rank: the Gated DeltaNet and Mamba2 recurrences of tiny blocks through `linear_scan`
    on a (u, r) zigzag mesh (runs probed, exported and corrected after the exchange), with the kind the
    forwards choose for "cuda" (the stand-ins) and for "cpu" (the reference): bitwise equal outputs and
    gradients? And the keywords of every stand-in call."""
    from dist_cases import mesh
    from transformers.models.bamba.modeling_bamba import BambaMixer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from hybrid_cp.engine.layout import shard_tokens
    from hybrid_cp.engine.recurrence import linear_scan
    from hybrid_cp.testing.families import tiny_config
    from topology.layouts import layout_of

    cp, mp = mesh(u, r), pytest.MonkeyPatch()
    lay = layout_of("zigzag", u, r, seq_len=23)
    torch.manual_seed(0)
    gdn = L._GatedDeltaNetForward(Qwen3NextGatedDeltaNet(tiny_config("qwen3_next"), 0), cp)
    ssd_module = BambaMixer(tiny_config("bamba"), 0)
    ssd_module.chunk_size = 4
    ssd = L._Mamba2Forward(ssd_module, cp)
    g = torch.Generator().manual_seed(4)
    m = gdn.module
    gdn_in = [
        torch.randn(1, 23, m.num_k_heads, m.head_k_dim, generator=g),
        torch.randn(1, 23, m.num_k_heads, m.head_k_dim, generator=g),
        torch.randn(1, 23, m.num_v_heads, m.head_v_dim, generator=g),
        -F.softplus(torch.randn(1, 23, m.num_v_heads, generator=g)),
        torch.rand(1, 23, m.num_v_heads, generator=g),
    ]
    s = ssd.module
    ssd_in = [
        torch.randn(1, 23, s.num_heads, s.head_dim, generator=g),
        torch.randn(1, 23, s.num_heads, generator=g),
        torch.randn(1, 23, s.n_groups, s.ssm_state_size, generator=g),
        torch.randn(1, 23, s.n_groups, s.ssm_state_size, generator=g),
    ]
    try:
        L.cuda_kernel.cache_clear()
        CALLS.clear()
        _install(mp)
        mp.setenv(L.KERNEL_ENV, "auto")
        same = {}
        for name, fwd, inputs in (("gdn", gdn, gdn_in), ("ssd", ssd, ssd_in)):
            local = [shard_tokens(x, cp, 1, lay) for x in inputs]
            (go, gg), (ro, rg) = (
                _grads(lambda xs: [linear_scan(cp, lay, fwd.kind(dev), xs)], local) for dev in (CUDA, CPU)
            )
            same[name] = all(torch.equal(a, b) for a, b in zip(go + gg, ro + rg))
        return {"same": same, "calls": [(who, c) for who, c in CALLS]}
    finally:
        mp.undo()
        L.cuda_kernel.cache_clear()


def test_linear_scan_across_ranks_through_standins_is_the_reference_bitwise(pool):
    rows = pool.run(scan_through_standins, u=1, r=2)
    assert all(row["same"] == {"gdn": True, "ssd": True} for row in rows), [row["same"] for row in rows]
    for row in rows:  # zigzag on a ring of 2: every rank has a probed (continuing) run and an exporting one
        fla = [c for who, c in row["calls"] if who == "fla"]
        assert any(c["initial_state"] is not None and c["output_final_state"] for c in fla), fla
        assert all((c["initial_state"] is None) or c["initial_state"][-1] == c["v"][-1] for c in fla), fla
        ssd = [c for who, c in row["calls"] if who == "mamba_ssm"]
        assert any(c["return_final_states"] for c in ssd) and ssd


def test_gpu_check_compares_the_dispatched_kernels(kernels):
    """benchmarks/gpu_check.py's "linear" section takes the kernels the layers dispatch to (and says when a
    package is missing), so its GPU figures are about the code that runs."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gc = importlib.util.module_from_spec(spec)
    kernels.setitem(sys.modules, "gpu_check", gc)  # its dataclass looks itself up there
    spec.loader.exec_module(gc)
    found = gc._linear_kernels(gc.Ctx(CPU, False, 1.0))
    assert [(f, k) for f, _, k, _ in found] == [("gdn", fla_chunk_gated_delta_rule), ("ssd", mamba_chunk_scan_combined)]
    assert [w for _, w, _, _ in found] == [
        "fla.chunk_gated_delta_rule 0.5.2",
        "mamba_ssm.mamba_chunk_scan_combined 2.3.2.post1",
    ]
    _install(kernels, present=False)
    L.cuda_kernel.cache_clear()
    assert [(w, k) for _, w, k, _ in gc._linear_kernels(gc.Ctx(CPU, False, 1.0))] == [
        ("fla not installed", None),
        ("mamba_ssm not installed", None),
    ]
