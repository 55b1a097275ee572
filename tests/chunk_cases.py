"""Chunked attention (Llama 4's attention_chunk_size) on every rank of the worker pool: fp64/fp32
parity against a single-device reference with an explicit chunk mask, and the refusals. The
functions return errors and messages; tests/test_chunked.py asserts on them."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from dist_cases import DTYPES, _inputs, _rel, masked_reference, mesh, visibility

import hybrid_cp as hcp
from hybrid_cp.engine.ring import block_plan
from topology.layouts import PAD

_REFS: dict = {}


def chunk_visibility(doc_lens: list[int], causal: bool, chunk_size: int, window=None) -> torch.Tensor:
    """[N, N] bool: key j visible to query i iff both are in the same document and in the same chunk of
    `chunk_size` positions counted from the document's start (and j <= i when causal, inside the window)."""
    pos = torch.cat([torch.arange(n) for n in doc_lens])
    same_chunk = (pos[:, None] // chunk_size) == (pos[None, :] // chunk_size)
    return visibility(doc_lens, causal, window) & same_chunk


def chunk_cases(u: int, pick: int = 0) -> list[dict]:
    """Dense and packed rows, causal and not, GQA and MQA, C not dividing the length, C below a ring
    block, C = 1, C beyond every document, with a window, head chunks, and fp32: the first four on
    every mesh, each other one on every third mesh (`pick`: the mesh's index), to keep the suite fast."""
    heads = [(8, 2), (8, 1), (4, 4)] if u <= 4 else [(8, 2), (8, 1)]
    docs = [30, 1, 90, 7, 50]  # documents shorter and longer than C
    cases = [
        dict(n=61, causal=True, chunk=16),
        dict(n=61, causal=False, chunk=7),
        dict(n=128, causal=True, chunk=3),
        dict(docs=docs, causal=True, chunk=16),
        dict(n=96, causal=True, chunk=1),
        dict(n=61, causal=True, chunk=1000),
        dict(n=100, causal=True, chunk=40, window=9),
        dict(n=100, causal=False, chunk=20, window=(3, 5)),
        dict(docs=docs, causal=False, chunk=25),
        dict(docs=docs, causal=True, chunk=8, window=5),
        dict(n=80, causal=True, chunk=12, head_chunks=2),
        dict(docs=docs, causal=True, chunk=10, head_chunks=2),
        dict(n=96, causal=True, chunk=16, dtype="fp32"),
        dict(docs=docs, causal=False, chunk=9, dtype="fp32"),
    ]
    return [
        dict(c, h=heads[i % len(heads)][0], hkv=heads[i % len(heads)][1], d=8, seed=i)
        for i, c in enumerate(cases)
        if i < 4 or (i + pick) % 3 == 0
    ]


def _run_case(cp: hcp.CPMesh, c: dict) -> dict:
    h, hkv, d, causal, chunk = c["h"], c["hkv"], c["d"], c["causal"], c["chunk"]
    window = c.get("window")
    packed = "docs" in c
    lens = c["docs"] if packed else [c["n"]]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kw = {"cu_seqlens": cu} if packed else {"seq_len": cu[-1]}
    dtype = DTYPES[c.get("dtype", "fp64")]
    key = (tuple(lens), h, hkv, d, causal, chunk, str(window), c["seed"])
    if key not in _REFS:  # the same cases run on every mesh: one reference per process
        q, k, v, dout = _inputs(c["seed"], 1, cu[-1], h, hkv, d)
        vis = chunk_visibility(lens, causal, chunk, window)
        _REFS[key] = (q, k, v, dout), masked_reference(q, k, v, dout, 1 / math.sqrt(d), vis)
    (q, k, v, dout), ref = _REFS[key]
    shard_kw = {"cu_seqlens": cu} if packed else {}
    hcp.reset_comm_bytes(cp)
    ql, kl, vl = (hcp.shard(x.to(dtype), cp, **shard_kw).requires_grad_() for x in (q, k, v))
    out, lse = hcp.attention(
        ql,
        kl,
        vl,
        cp,
        causal=causal,
        window=window,
        chunk_size=chunk,
        return_lse=True,
        head_chunks=c.get("head_chunks", 1),
        **kw,
    )
    (out * hcp.shard(dout.to(dtype), cp, **shard_kw)).sum().backward()
    lay = hcp.engine.layout.row_layout(cp, **kw)
    real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
    keep = torch.nonzero(real).flatten()
    # relative to max(|ref|, 1): with C = 1 the exact dq and dk are 0 and only round-off remains
    err = {
        name: _rel(
            gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, **shard_kw).index_select(dim, keep), floor=1.0
        )
        for name, dim, rf, gt in zip(
            ["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1], ref, (out.detach(), lse, ql.grad, kl.grad, vl.grad)
        )
    }
    halo = block_plan(lay, cp.ring_rank, causal, q.device, lay.effective_window(causal, window), chunk).halo
    return {
        **err,
        "bytes": hcp.comm_bytes(cp),
        "halo": halo,
        "ring_rank": cp.ring_rank,
        "ulysses_rank": cp.ulysses_rank,
    }


def chunk_errors(u: int, r: int, layouts: tuple[str, ...] = ("zigzag",), pick: int = 0) -> list[dict]:
    """The chunk cases on the (u, r) mesh of each layout: errors, bytes sent, whether the plan is a halo."""
    return [
        {**c, "layout": layout, **_run_case(mesh(u, r, layout), c)} for layout in layouts for c in chunk_cases(u, pick)
    ]


def chunk_refusals(u: int, r: int) -> dict:
    """Invalid chunk sizes on every rank, and ranks that disagree: the message each call raised here,
    and the attention bytes sent before it raised (must be 0: the checks run before any collective)."""
    cp = mesh(u, r, validate="always")
    rank = dist.get_rank() % cp.size
    q = torch.randn(1, 16, 4, 8)
    k = v = torch.randn(1, 16, 2, 8)
    calls = {f"bad {value!r}": value for value in (0, -3, True, 2.5, "8")}
    calls["one rank 8"] = 8 if rank == 1 else 16
    calls["one rank None"] = None if rank == 0 else 16
    out = {}
    for name, chunk in calls.items():
        hcp.reset_comm_bytes(cp)
        try:
            hcp.attention(q, k, v, cp, causal=True, seq_len=16 * cp.size, chunk_size=chunk)
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        out[name + " bytes"] = sum(hcp.comm_bytes(cp).values())
    try:
        hcp.attention(q, k, v, mesh(1, 1), causal=True, seq_len=16, chunk_size=4, backend=lambda a, b, c: a)
        out["callable"] = "no error"
    except ValueError as exc:
        out["callable"] = f"{type(exc).__name__}: {exc}"
    return out
