"""Attention variants (sinks, logit soft-capping, a value head dim != q/k's), run on every rank of the
worker pool (see conftest.py): relative errors against an fp64 autograd reference written here,
independently of the package's kernels. tests/test_variants.py asserts on them."""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from dist_cases import DTYPES, mesh, visibility

import hybrid_cp as hcp
import topology
from hybrid_cp.testing.parity import per_module, replica_share
from topology.layouts import PAD

TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")
STAGES = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")


def reference(q, k, v, dout, sinks, scale: float, visible: torch.Tensor, softcap: float | None):
    """Attention over the whole row by fp64 autograd: scores q.k * scale, soft-capped (softcap * tanh(s /
    softcap)), masked by `visible` [N, N]; each sink a key of score sinks[h] and value 0. Returns out, lse,
    dq, dk, dv and d(sinks) (None without sinks)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    b, n, h, _ = q.shape
    sink = None if sinks is None else sinks.detach().double().requires_grad_()
    ke, ve = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, None if sink is None else sink.grad


def _inputs(seed: int, b: int, n: int, h: int, hkv: int, d: int, dv: int):
    g = torch.Generator().manual_seed(seed)
    q, k = (
        torch.randn(b, n, h, d, generator=g, dtype=torch.float64),
        torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64),
    )
    v, dout = (
        torch.randn(b, n, hkv, dv, generator=g, dtype=torch.float64),
        torch.randn(b, n, h, dv, generator=g, dtype=torch.float64),
    )
    sinks = 2 * torch.randn(h, generator=g, dtype=torch.float64)  # comparable to the rows' lse
    return q, k, v, dout, sinks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to max(|reference|, 1)."""
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def _run(cp, c: dict, ref_inputs, dtype, kw: dict):
    """hcp.attention on this rank's shards, forward and backward; d(sinks) summed over the cp group."""
    q, k, v, dout, sinks = ref_inputs
    ql, kl, vl = (hcp.shard(x.to(dtype), cp, **kw).requires_grad_() for x in (q, k, v))
    sl = sinks.to(dtype).clone().requires_grad_() if c.get("sinks") else None
    out, lse = hcp.attention(
        ql,
        kl,
        vl,
        cp,
        causal=c["causal"],
        window=c.get("window"),
        return_lse=True,
        softcap=c.get("softcap"),
        sinks=sl,
        head_chunks=c.get("head_chunks", 1),
        seq_len=None if "docs" in c else c["n"],
        **kw,
    )
    (out * hcp.shard(dout.to(dtype), cp, **kw)).sum().backward()
    dsinks = None
    if sl is not None:
        dsinks = sl.grad.clone()
        if cp.size > 1:
            dist.all_reduce(dsinks, group=cp.cp_group)  # each rank holds its share
    return out.detach(), lse, ql.grad, kl.grad, vl.grad, dsinks


def variant_errors(u: int, r: int, cases: list[dict]) -> list[dict]:
    """For each case (keys: h, hkv, d, dv, causal, n (dense, b=2) or docs (packed), and optionally window,
    softcap, sinks, head_chunks, layout, dtype), relative errors of out/lse/dq/dk/dv on this rank's real
    tokens and of the cp group's summed d(sinks), against `reference`."""
    results = []
    for layout in sorted({c.get("layout", "zigzag") for c in cases}):  # mesh creation is collective: every rank,
        mesh(u, r, layout)  # before the replicas take their shares of the cases
    for c in replica_share(mesh(u, r), cases):
        cp = mesh(u, r, c.get("layout", "zigzag"))
        packed = "docs" in c
        lens = c["docs"] if packed else [c["n"]]
        cu = [0, *itertools.accumulate(lens)]
        kw = {"cu_seqlens": cu} if packed else {}
        d, dv = c["d"], c.get("dv", c["d"])
        window = c.get("window")
        inputs = _inputs(c.get("seed", 5), 1 if packed else 2, cu[-1], c["h"], c["hkv"], d, dv)
        if not c.get("sinks"):
            inputs = (*inputs[:4], None)
        key = ("variant", c.get("seed", 5), tuple(lens), c["h"], c["hkv"], d, dv, c["causal"], window, c.get("softcap"))
        ref = per_module(
            (*key, inputs[4] is not None),
            lambda: reference(*inputs, 1 / math.sqrt(d), visibility(lens, c["causal"], window), c.get("softcap")),
            cp.cp_group,
        )
        dtype = DTYPES[c.get("dtype", "fp64")]
        hcp.reset_comm_bytes(cp)
        got = _run(cp, c, inputs, dtype, kw)
        sent = hcp.comm_bytes(cp)
        lay = hcp.engine.layout.row_layout(cp, seq_len=None if packed else cu[-1], **kw)
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
        keep = torch.nonzero(real).flatten()
        err = {
            name: _rel(gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, **kw).index_select(dim, keep))
            for name, dim, rf, gt in zip(TENSORS[:5], [1, 2, 1, 1, 1], ref, got)
        }
        err["dsinks"] = 0.0 if ref[5] is None else _rel(got[5], ref[5])
        err["out_dim_ok"] = got[0].shape[-1] == dv
        # the cost model's bytes, v's head dim included, are what was sent (head chunks send q/out again in backward)
        if c.get("head_chunks", 1) == 1:
            want = topology.comm_bytes(
                c["h"],
                c["hkv"],
                d,
                cu[-1],
                1 if packed else 2,
                u,
                r,
                dtype.itemsize,
                layout=cp.layout,
                ulysses_rank=cp.ulysses_rank,
                ring_rank=cp.ring_rank,
                cu_seqlens=cu if packed else None,
                causal=c["causal"],
                window=window,
                v_head_dim=dv,
            )
            err["bytes_match"] = all(sent.get(k, 0) == want[k] for k in STAGES) or str((sent, want))
        results.append({**c, **err})
    return results


def compiled_variant(u: int, r: int) -> dict | None:
    """Sinks + soft-cap + Dv != D through torch.compile (fullgraph, aot_eager): out, lse and every gradient
    equal eager's. Only the first cp group compiles (the suite's CPU cores are shared)."""
    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    q, k, v, dout, sinks = _inputs(21, 2, 40, 4, 2, 12, 8)
    shards = [hcp.shard(x.float(), cp) for x in (q, k, v, dout)]

    def attn(q, k, v, sinks):
        return hcp.attention(q, k, v, cp, causal=True, window=9, softcap=3.0, sinks=sinks, seq_len=40, return_lse=True)

    def run(fn):
        xs = [x.clone().requires_grad_() for x in shards[:3]] + [sinks.float().requires_grad_()]
        out, lse = fn(*xs)
        (out * shards[3]).sum().backward()
        return [out.detach(), lse] + [x.grad for x in xs]

    torch._dynamo.reset()
    want, got = run(attn), run(torch.compile(attn, backend="aot_eager", fullgraph=True))
    return {name: _rel(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want)}


def disagreement(u: int, r: int, which: str) -> str:
    """One rank calls with a different soft-cap / sinks (validate="always"): the message seen here."""
    cp = mesh(u, r, validate="always")
    rank = dist.get_rank() % cp.size
    q, k, v = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    sinks = torch.zeros(4)
    kwargs = {"softcap": 30.0, "sinks": sinks}
    if which == "softcap" and rank == 1:
        kwargs["softcap"] = 20.0
    elif which == "sinks_missing" and rank == 0:
        kwargs["sinks"] = None
    elif which == "sinks_values" and rank == cp.size - 1:
        kwargs["sinks"] = sinks + 1
    elif which == "v_head_dim" and rank == 0:
        v = torch.randn(1, 16, 2, 4)
    try:
        hcp.attention(q, k, v, cp, **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
