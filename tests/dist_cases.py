"""Functions run on every rank of the worker pool (see conftest.py). They return errors; the
tests assert on them."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tolerance import within

import hybrid_cp as hcp

# The parity runs, the fp64 references and the mesh cache live in hybrid_cp.testing.parity (the benchmarks
# run them too); re-exported here under the names the case modules import.
from hybrid_cp.testing.parity import (  # noqa: F401 (re-exported)
    DTYPES,
    MESH_CACHE,
    attention_errors,
    masked_reference,
    mesh,
    packed_errors,
    reference,
    visibility,
    window_errors,
)
from hybrid_cp.testing.parity import random_inputs as _inputs
from hybrid_cp.testing.parity import rel as _rel
from hybrid_cp.testing.parity import rel_norm as _rel_norm  # noqa: F401 (re-exported)


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
    return {
        "equal": torch.equal(back.detach(), x.detach()),
        "shape": tuple(back.shape),
        "local_ok": torch.equal(local.detach(), expected_local),
        # each rank's gradient is the full gradient at its own tokens (summing over ranks gives w)
        "grad_ok": torch.equal(x.grad, w * mine.view(1, -1, 1)),
    }


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
    return {
        name: _rel(g, hcp.shard(rf, cp))
        for name, g, rf in zip(
            ["out", "dq", "dk", "dv"], [out.detach(), ql.grad, kl.grad, vl.grad], [ref[0], ref[2], ref[3], ref[4]]
        )
    }


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
    groups = [
        weakref.ref(getattr(cp, name))
        for name in ("ulysses_group", "ring_group", "ring_group_bwd", "cp_group", "dp_cp_group", "check_group")
    ]
    hcp.destroy_cp_mesh(cp)
    gc.collect()
    out = {"alive": sum(ref() is not None for ref in groups)}
    for name, use in {
        "attention": lambda: hcp.attention(q, q[:, :, :2], q[:, :, :2], cp, causal=True),
        "loss": lambda: hcp.cross_entropy(torch.randn(1, 8, 5), torch.zeros(1, 8, dtype=torch.long), cp),
    }.items():
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
    for name, kwargs in {
        "not_divisor": dict(ulysses=3, ring=1),
        "bad_dp": dict(ulysses=2, ring=2, dp=3),
        "zero": dict(ulysses=0, ring=2),
        "layout": dict(ulysses=2, ring=1, layout="spiral"),
    }.items():
        try:
            hcp.init_cp_mesh(**kwargs)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    cp = hcp.init_cp_mesh(plan=types.SimpleNamespace(ulysses=2, ring=2, dp=2))
    out["plan"] = (cp.ulysses_size, cp.ring_size, cp.dp_size, cp.size, [p for p in cp.device_mesh.mesh_dim_names])
    out["ranks"] = (dist.get_rank(), cp.dp_rank, cp.ring_rank, cp.ulysses_rank, cp.ring_next, cp.ring_prev)
    import topology

    best = topology.plan(
        topology.Cluster.preset("cpu", gpus_per_node=8),
        topology.ModelShape(heads=8, kv_heads=2, head_dim=64, hidden=512, layers=2),
        seq_len=65536,
        world_size=8,
        dp=1,
    ).best
    planned = hcp.init_cp_mesh(plan=best)
    out["planned"] = ((best.ulysses, best.ring, best.dp), (planned.ulysses_size, planned.ring_size, planned.dp_size))
    hcp.destroy_cp_mesh(cp)
    hcp.destroy_cp_mesh(planned)
    return out


# ---- packed documents ---------------------------------------------------------------------------


def assert_errors(
    rows_per_rank, limit: float = 1e-5, tensors=("out", "lse", "dq", "dk", "dv"), label: str = ""
) -> None:
    """Every rank's every case has relative errors <= limit in every tensor (each figure recorded by
    tests/tolerance.py as 'label rank R case I tensor')."""
    for rank, rows in enumerate(rows_per_rank):
        for i, row in enumerate(rows):
            for t in tensors:
                within(row[t], limit, f"{label} rank {rank} case {row.get('case', i)} {t}".strip(), row)


def hidden_length_case() -> dict:
    """Shard a 997-token q/k/v, then another 1,000-token tensor, then non-causal attention and
    unshard without seq_len: both must raise (ambiguous); with seq_len=997 the answer is exact."""
    cp = mesh(2, 2)
    hcp.engine.layout.recorded_lengths(cp).clear()  # the cached mesh is shared with other cases
    q, k, v, dout = _inputs(5, 1, 997, 4, 2, 16)
    ql, kl, vl = (hcp.shard(x.float(), cp) for x in (q, k, v))
    hcp.shard(torch.zeros(1, 1000, 3), cp)
    out = {}
    for name, call in (("attention", lambda: hcp.attention(ql, kl, vl, cp)), ("unshard", lambda: hcp.unshard(ql, cp))):
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


def window_bytes_case(u: int, r: int, n: int, h: int, hkv: int, d: int, window) -> dict:
    """Bytes each stage sends for one windowed causal call (no reference: n may be large)."""
    cp = mesh(u, r)
    q, k, v, dout = _inputs(13, 1, n, h, hkv, d)
    hcp.reset_comm_bytes(cp)
    ql, kl, vl = (hcp.shard(x.float(), cp).requires_grad_() for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=True, window=window, seq_len=n)
    (out * hcp.shard(dout.float(), cp)).sum().backward()
    return {"bytes": hcp.comm_bytes(cp), "ring_rank": cp.ring_rank, "ulysses_rank": cp.ulysses_rank}


def raised(call, **kwargs) -> tuple[str, str]:
    """(error class name, message) of what `call(**kwargs)` raised as a ValueError, or ("no error", "")."""
    try:
        call(**kwargs)
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""
