"""Functions run on every rank of the worker pool (see conftest.py). They return errors; the
tests assert on them."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import hybrid_cp as hcp
from hybrid_cp.engine.kernels import get_kernel

MESH_CACHE = 10
_MESHES: dict = {}
_REFS: dict = {}

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def mesh(u: int, r: int, layout: str = "zigzag", validate: bool | str = True) -> hcp.CPMesh:
    """Meshes are cached: building one creates process groups (every rank, in the same order). Cases that
    make one rank call differently use validate="always": under the default (True) a shared mesh's
    earlier calls decide which calls are checked, and a lone deviation would wait for the timeout.
    At most `MESH_CACHE` are kept (the least recently used is destroyed): every live group costs CPU
    while idle (benchmarks/idle_groups.py), and the suite would otherwise hold hundreds per worker."""
    key = (u, r, layout, validate)
    if key in _MESHES:
        _MESHES[key] = _MESHES.pop(key)   # most recently used last
    else:
        while len(_MESHES) >= MESH_CACHE:
            hcp.destroy_cp_mesh(_MESHES.pop(next(iter(_MESHES))))
        _MESHES[key] = hcp.init_cp_mesh(u, r, layout=layout, validate=validate)
    return _MESHES[key]


def reference(q, k, v, dout, causal: bool, scale: float):
    """Single-device attention by autograd in fp64 (independent of the package's kernels)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    h = q.shape[2]
    ke, ve = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), ve)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _ref_key(c: dict) -> tuple:
    return (c["b"], c["n"], c["h"], c["hkv"], c["d"], c["causal"])


def _fill_references(cases: list[dict]) -> None:
    """fp64 references, computed once per session and split over the ranks (they are slow)."""
    world, me = dist.get_world_size(), dist.get_rank()
    missing = sorted({_ref_key(c) for c in cases} - set(_REFS))
    mine = {}
    for i, key in enumerate(missing):
        if i % world == me:
            b, n, h, hkv, d, causal = key
            inputs = _inputs(hash(key) % 10007, b, n, h, hkv, d)
            mine[key] = (inputs, reference(*inputs, causal, 1 / math.sqrt(d)))
    for i, key in enumerate(missing):
        item = [mine.get(key)]
        dist.broadcast_object_list(item, src=i % world)
        _REFS[key] = item[0]


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """Largest elementwise error relative to the largest reference magnitude (at least `floor`)."""
    if b.numel() == 0:  # a rank without real tokens (e.g. a 1-token packed row on 2 ranks): nothing to compare;
        return 0.0      # raising here on that rank alone would leave the others waiting in unshard's all-gather
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(floor)).item()


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the Frobenius norm: stable under rounding noise (used for bf16)."""
    return (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()


def _inputs(seed: int, b: int, n: int, h: int, hkv: int, d: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _cp_run(cp, q, k, v, dout, causal, dtype, backend):
    ql, kl, vl = (hcp.shard(x.to(dtype), cp).requires_grad_() for x in (q, k, v))
    out, lse = hcp.attention(ql, kl, vl, cp, causal=causal, return_lse=True, backend=backend)
    (out * hcp.shard(dout.to(dtype), cp)).sum().backward()
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def attention_errors(u: int, r: int, layout: str, cases: list[dict]) -> list[dict]:
    """For each case, relative errors of out/lse/dq/dk/dv against the fp64 reference.

    bf16 cases also report the single-device bf16 error of the same backend ("base_*")."""
    cp = mesh(u, r, layout)
    _fill_references(cases)
    results = []
    for c in cases:
        n, d = c["n"], c["d"]
        dtype, causal, backend = DTYPES[c["dtype"]], c["causal"], c.get("backend", "auto")
        (q, k, v, dout), ref = _REFS[_ref_key(c)]
        got = _cp_run(cp, q, k, v, dout, causal, dtype, backend)
        keep = torch.nonzero(hcp.positions(n, cp) < n).flatten()
        metric = _rel if dtype in (torch.float64, torch.float32) else _rel_norm
        names, dims = ["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1]

        def local(x, dim):  # this rank's real (non-pad) tokens of a full-sequence tensor
            return hcp.shard(x, cp, dim=dim).index_select(dim, keep)

        err = {name: metric(gt.index_select(dim, keep), local(rf, dim))
               for name, dim, rf, gt in zip(names, dims, ref, got)}
        if dtype not in (torch.float64, torch.float32):
            # The same backend on one device, judged on the same tokens: the error budget.
            kern = get_kernel(backend, q.device, dtype, d)
            qd, kd, vd, dd = (x.to(dtype) for x in (q, k, v, dout))
            o1, l1 = kern.forward(qd, kd, vd, causal=causal, scale=1 / math.sqrt(d))
            g1 = kern.backward(dd, qd, kd, vd, o1, l1, causal=causal, scale=1 / math.sqrt(d))
            for name, dim, a, rf in zip(names, dims, (o1, l1) + tuple(g1), ref):
                err["base_" + name] = metric(local(a, dim), local(rf, dim))
        results.append({**c, **err})
    return results


def unshard_roundtrip(u: int, r: int, layout: str, n: int) -> dict:
    cp = mesh(u, r, layout)
    x = torch.arange(2 * n * 3, dtype=torch.float64).view(2, n, 3).requires_grad_()
    local = hcp.shard(x, cp)
    back = hcp.unshard(local, cp)
    w = torch.linspace(0, 1, back.numel(), dtype=torch.float64).view_as(back)
    (back * w).sum().backward()
    pos = hcp.positions(n, cp)
    mine = torch.zeros(n, dtype=torch.float64)
    mine[pos[pos < n]] = 1.0
    expected_local = torch.where((pos < n).view(1, -1, 1), x.detach().index_select(1, pos.clamp_max(n - 1)), 0.0)
    return {"equal": torch.equal(back.detach(), x.detach()), "shape": tuple(back.shape),
            "local_ok": torch.equal(local.detach(), expected_local),
            # each rank's gradient is the full gradient at its own tokens (summing over ranks gives w)
            "grad_ok": torch.equal(x.grad, w * mine.view(1, -1, 1))}


def comm_bytes_case(u: int, r: int, layout: str, b: int, n: int, h: int, hkv: int, d: int, causal: bool) -> dict:
    cp = mesh(u, r, layout)
    q, k, v, dout = _inputs(7, b, n, h, hkv, d)
    hcp.reset_comm_bytes(cp)
    ql, kl, vl = (hcp.shard(x.float(), cp).requires_grad_() for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=causal)
    fwd = hcp.comm_bytes(cp)
    (out * hcp.shard(dout.float(), cp)).sum().backward()
    total = hcp.comm_bytes(cp)
    return {"ulysses_rank": cp.ulysses_rank, "fwd": fwd, "total": total}


def bad_input(u: int, r: int, which: str) -> str:
    """Make one rank (or all) call attention wrongly; return the error message seen here."""
    cp = mesh(u, r, validate="always")
    rank = dist.get_rank() % cp.size
    q = torch.randn(1, 16, 8, 32)
    k = torch.randn(1, 16, 2, 32)
    v = torch.randn(1, 16, 2, 32)
    kwargs = {}
    if which == "one_rank_length" and rank == 1:
        q, k, v = q[:, :8].contiguous(), k[:, :8].contiguous(), v[:, :8].contiguous()
    elif which == "one_rank_heads" and rank == 0:
        k = torch.randn(1, 16, 3, 32)
        v = torch.randn(1, 16, 3, 32)
    elif which == "one_rank_dtype" and rank == cp.size - 1:
        q = q.double()
    elif which == "one_rank_causal" and rank == 0:
        kwargs["causal"] = True
    elif which == "all_backend":
        kwargs["backend"] = "no-such-kernel"
    elif which == "all_stride":
        q = torch.randn(1, 16, 32, 8).transpose(2, 3)
    elif which == "all_too_many_ulysses":
        q = torch.randn(1, 16, 1, 32)
        k = v = torch.randn(1, 16, 1, 32)
    try:
        hcp.attention(q, k, v, cp, **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def callable_backend(u: int, n: int, causal: bool) -> dict:
    """Ulysses (ring=1) around a plain local-attention callable equals the reference."""
    cp = mesh(u, 1)
    q, k, v, dout = _inputs(11, 2, n, 8, 2, 32)

    def local_attn(q, k, v):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2)

    ref = reference(q, k, v, dout, causal, 1 / math.sqrt(32))
    ql, kl, vl = (hcp.shard(x.float(), cp).requires_grad_() for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=causal, backend=local_attn)
    (out * hcp.shard(dout.float(), cp)).sum().backward()
    return {name: _rel(g, hcp.shard(rf, cp)) for name, g, rf in
            zip(["out", "dq", "dk", "dv"], [out.detach(), ql.grad, kl.grad, vl.grad],
                [ref[0], ref[2], ref[3], ref[4]])}



def destroyed_mesh(u: int, r: int) -> dict:
    """hcp.destroy_cp_mesh: the mesh's process groups are gone (nothing keeps them, so their threads end), a
    destroyed mesh raises SetupError (before any collective) in attention and in the loss, and FSDP2 on a
    new mesh of the same shape works (DTensor's caches do not hand it the destroyed groups)."""
    import gc
    import weakref

    from hybrid_cp.integrations.fsdp import shard_model

    def fsdp_step(cp: hcp.CPMesh) -> float:
        torch.manual_seed(0)
        model = shard_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), cp)
        model(torch.randn(3, 4)).sum().backward()
        return sum(p.grad.full_tensor().abs().sum().item() for p in model.parameters())

    cp = hcp.init_cp_mesh(u, r)
    q = torch.randn(1, 8, 4, 8)
    hcp.attention(q, q[:, :, :2], q[:, :, :2], cp, causal=True, seq_len=8 * cp.size)
    first = fsdp_step(cp)
    groups = [weakref.ref(getattr(cp, name)) for name in ("ulysses_group", "ring_group", "ring_group_bwd", "cp_group",
                                                         "dp_cp_group", "check_group")]
    hcp.destroy_cp_mesh(cp)
    gc.collect()
    out = {"alive": sum(ref() is not None for ref in groups)}
    for name, use in {"attention": lambda: hcp.attention(q, q[:, :, :2], q[:, :, :2], cp, causal=True),
                      "loss": lambda: hcp.cross_entropy(torch.randn(1, 8, 5), torch.zeros(1, 8, dtype=torch.long),
                                                        cp)}.items():
        try:
            use()
            out[name] = "no error"
        except hcp.SetupError as exc:
            out[name] = str(exc)
    again = hcp.init_cp_mesh(u, r)
    out["fsdp_again"] = fsdp_step(again) == first
    hcp.destroy_cp_mesh(again)
    return out


def mesh_errors() -> dict:
    """init_cp_mesh's checks, and a mesh built from a planner-like plan object."""
    import types

    out = {}
    for name, kwargs in {"not_divisor": dict(ulysses=3, ring=1), "bad_dp": dict(ulysses=2, ring=2, dp=3),
                         "zero": dict(ulysses=0, ring=2), "layout": dict(ulysses=2, ring=1, layout="spiral")}.items():
        try:
            hcp.init_cp_mesh(**kwargs)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    cp = hcp.init_cp_mesh(plan=types.SimpleNamespace(ulysses=2, ring=2, dp=2))
    out["plan"] = (cp.ulysses_size, cp.ring_size, cp.dp_size, cp.size,
                   [p for p in cp.device_mesh.mesh_dim_names])
    out["ranks"] = (dist.get_rank(), cp.dp_rank, cp.ring_rank, cp.ulysses_rank, cp.ring_next, cp.ring_prev)
    import topology

    best = topology.plan(topology.Cluster.preset("cpu", gpus_per_node=8),
                         topology.ModelShape(heads=8, kv_heads=2, head_dim=64, hidden=512, layers=2),
                         seq_len=65536, world_size=8, dp=1).best
    planned = hcp.init_cp_mesh(plan=best)
    out["planned"] = ((best.ulysses, best.ring, best.dp), (planned.ulysses_size, planned.ring_size, planned.dp_size))
    hcp.destroy_cp_mesh(cp)
    hcp.destroy_cp_mesh(planned)
    return out


# ---- packed documents ---------------------------------------------------------------------------

def visibility(doc_lens: list[int], causal: bool, window=None) -> torch.Tensor:
    """[N, N] bool: key j visible to query i inside the same document, under the mask and window
    (window W with causal: the W keys ending at i; (left, right) without: i - left .. i + right)."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    pos = torch.cat([torch.arange(n) for n in doc_lens])
    diff = pos[None, :] - pos[:, None]  # key position - query position
    visible = doc[:, None] == doc[None, :]
    if causal:
        visible &= diff <= 0
        if window is not None:
            visible &= diff > -window
    elif window is not None:
        visible &= (diff >= -window[0]) & (diff <= window[1])
    return visible


def masked_reference(q, k, v, dout, scale: float, visible: torch.Tensor):
    """Attention by fp64 autograd over the whole row with a [N, N] visibility mask."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    h = q.shape[2]
    ke, ve = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    s = (torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), ve)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def assert_errors(rows_per_rank, limit: float = 1e-5, tensors=("out", "lse", "dq", "dk", "dv")) -> None:
    """Every rank's every case has relative errors <= limit in every tensor."""
    for rank, rows in enumerate(rows_per_rank):
        for row in rows:
            bad = {t: row[t] for t in tensors if not row[t] <= limit}
            assert not bad, f"rank {rank}, case {row}: relative errors {bad} exceed {limit}"


def packed_errors(u: int, r: int, layout: str, cases: list[dict]) -> list[dict]:
    """For each packed case, relative errors of out/lse/dq/dk/dv on this rank's real tokens against
    the per-document fp64 reference, and the largest magnitude found in pad slots (must be 0)."""
    from topology.layouts import PAD

    cp = mesh(u, r, layout)
    results = []
    for c in cases:
        lens, h, hkv, d, causal = c["docs"], c["h"], c["hkv"], c["d"], c["causal"]
        dtype = DTYPES[c.get("dtype", "fp32")]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        q, k, v, dout = _inputs(c.get("seed", 3), 1, cu[-1], h, hkv, d)
        ref = masked_reference(q, k, v, dout, 1 / math.sqrt(d), visibility(lens, causal))
        ql, kl, vl = (hcp.shard(x.to(dtype), cp, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
        out, lse = hcp.attention(ql, kl, vl, cp, causal=causal, cu_seqlens=cu, return_lse=True,
                                 backend=c.get("backend", "auto"))
        (out * hcp.shard(dout.to(dtype), cp, cu_seqlens=cu)).sum().backward()
        got = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
        lay = hcp.engine.layout.row_layout(cp, cu_seqlens=cu)
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
        keep, pads = torch.nonzero(real).flatten(), torch.nonzero(~real).flatten()
        err, pad_max = {}, 0.0
        for name, dim, rf, gt in zip(["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1], ref, got):
            # relative to max(|ref|, 1): one-token documents have dq = dk = 0 exactly, only round-off remains
            err[name] = _rel(gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, cu_seqlens=cu).index_select(dim, keep),
                             floor=1.0)
            if name != "lse" and pads.numel():
                pad_max = max(pad_max, gt.index_select(dim, pads).abs().max().item())
        if pads.numel():
            err["lse_pad_is_neg_inf"] = bool(torch.isneginf(lse.index_select(2, pads)).all())
        back = hcp.unshard(out.detach(), cp, cu_seqlens=cu)
        err["unshard_ok"] = tuple(back.shape) == (1, cu[-1], h, d) and _rel(back, ref[0]) <= 1e-5
        results.append({**c, **err, "pad_max": pad_max})
    return results


def hidden_length_case() -> dict:
    """Shard a 997-token q/k/v, then another 1,000-token tensor, then non-causal attention and
    unshard without seq_len: both must raise (ambiguous); with seq_len=997 the answer is exact."""
    cp = mesh(2, 2)
    hcp.engine.layout.recorded_lengths(cp).clear()  # the cached mesh is shared with other cases
    q, k, v, dout = _inputs(5, 1, 997, 4, 2, 16)
    ql, kl, vl = (hcp.shard(x.float(), cp) for x in (q, k, v))
    hcp.shard(torch.zeros(1, 1000, 3), cp)
    out = {}
    for name, call in (("attention", lambda: hcp.attention(ql, kl, vl, cp)),
                       ("unshard", lambda: hcp.unshard(ql, cp))):
        try:
            call()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    res = hcp.attention(ql, kl, vl, cp, seq_len=997)
    full = hcp.unshard(res, cp, seq_len=997)
    ref = reference(q, k, v, dout, False, 1 / math.sqrt(16))[0]
    out["explicit_shape"] = tuple(full.shape)
    out["explicit_err"] = _rel(full, ref)
    causal = hcp.unshard(hcp.attention(ql, kl, vl, cp, causal=True), cp, seq_len=997)
    out["causal_err"] = _rel(causal, reference(q, k, v, dout, True, 1 / math.sqrt(16))[0])
    hcp.engine.layout.recorded_lengths(cp).clear()
    return out


def packed_comm_bytes_case(u: int, r: int, lens: list[int], h: int, hkv: int, d: int, causal: bool) -> dict:
    cp = mesh(u, r)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, dout = _inputs(9, 1, cu[-1], h, hkv, d)
    hcp.reset_comm_bytes(cp)
    ql, kl, vl = (hcp.shard(x.float(), cp, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=causal, cu_seqlens=cu)
    (out * hcp.shard(dout.float(), cp, cu_seqlens=cu)).sum().backward()
    return {"ulysses_rank": cp.ulysses_rank, "ring_rank": cp.ring_rank, "total": hcp.comm_bytes(cp), "cu": cu}


# ---- sliding windows ----------------------------------------------------------------------------

def window_errors(u: int, r: int, layout: str, cases: list[dict]) -> list[dict]:
    """Relative errors of windowed attention (dense rows, or packed with `docs`) on this rank's real
    tokens against the fp64 reference, plus the bytes each ring stage sent."""
    from topology.layouts import PAD

    cp = mesh(u, r, layout)
    results = []
    for c in cases:
        h, hkv, d, causal, window = c["h"], c["hkv"], c["d"], c["causal"], c["window"]
        window = window if causal or window is None else tuple(window)
        packed = "docs" in c
        lens = c["docs"] if packed else [c["n"]]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        kw = {"cu_seqlens": cu} if packed else {}
        dtype = DTYPES[c.get("dtype", "fp32")]
        q, k, v, dout = _inputs(c.get("seed", 4), 1, cu[-1], h, hkv, d)
        ref = masked_reference(q, k, v, dout, 1 / math.sqrt(d), visibility(lens, causal, window))
        hcp.reset_comm_bytes(cp)
        ql, kl, vl = (hcp.shard(x.to(dtype), cp, **kw).requires_grad_() for x in (q, k, v))
        out, lse = hcp.attention(ql, kl, vl, cp, causal=causal, window=window, return_lse=True,
                                 backend=c.get("backend", "auto"), seq_len=None if packed else cu[-1], **kw)
        (out * hcp.shard(dout.to(dtype), cp, **kw)).sum().backward()
        lay = hcp.engine.layout.row_layout(cp, seq_len=None if packed else cu[-1], **kw)
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
        keep = torch.nonzero(real).flatten()
        # relative to max(|ref|, 1): with W = 1 the exact dq and dk are 0 and only round-off remains
        err = {name: _rel(gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, **kw).index_select(dim, keep), floor=1.0)
               for name, dim, rf, gt in zip(["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1], ref,
                                             (out.detach(), lse, ql.grad, kl.grad, vl.grad))}
        results.append({**c, **err, "bytes": hcp.comm_bytes(cp), "ring_rank": cp.ring_rank,
                        "ulysses_rank": cp.ulysses_rank})
    return results


def window_bytes_case(u: int, r: int, n: int, h: int, hkv: int, d: int, window) -> dict:
    """Bytes each stage sends for one windowed causal call (no reference: n may be large)."""
    cp = mesh(u, r)
    q, k, v, dout = _inputs(13, 1, n, h, hkv, d)
    hcp.reset_comm_bytes(cp)
    ql, kl, vl = (hcp.shard(x.float(), cp).requires_grad_() for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=True, window=window, seq_len=n)
    (out * hcp.shard(dout.float(), cp)).sum().backward()
    return {"bytes": hcp.comm_bytes(cp), "ring_rank": cp.ring_rank, "ulysses_rank": cp.ulysses_rank}
