"""Masked attention under torch.compile and with head chunks, run on every rank of the worker pool (see
conftest.py): a tiny model whose attention takes a new `hcp.AttnMask` every step, compiled against the same
model run eagerly; masked head chunks against the one-chunk call and the fp64 dense reference. They return
numbers; tests/test_mask_compile.py asserts on them.

Only the first cp group (dp rank 0) compiles, as in tests/compile_cases.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from dist_cases import mesh
from torch import nn

import hybrid_cp as hcp
from hybrid_cp.testing.parity import DTYPES, mask_visibility, masked_reference, random_inputs, rel
from topology.masks import AttnMask as RangeMask

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 4, 2, 8
SEQ = 128


def step_masks() -> list[hcp.AttnMask]:
    """One mask per step over the same row length, with different slice counts (so the encoded masks differ
    in length as well as in values)."""
    m = hcp.AttnMask
    return [
        m.documents([0, 40, 43, SEQ]),
        m.shared_prefix(40, [15, 30, 7, 36]),
        m.prefix_lm([0, 60, SEQ], [25, 0]),
        m.blocks([0] * 20 + [1] * 16 + [0] * 30 + [2] * 24 + [0] * 38),
    ]


class MaskModel(nn.Module):
    """embedding -> q/k/v projections -> hcp.attention(mask=...) -> output projection -> local loss sum."""

    def __init__(self, cp: hcp.CPMesh, window=None, softcap: float | None = None, sinks: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.cp, self.window, self.softcap = cp, window, softcap
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS)) if sinks else None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: hcp.AttnMask) -> torch.Tensor:
        x = self.emb(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM)
        k = self.k(x).view(b, s, KV_HEADS, HEAD_DIM)
        v = self.v(x).view(b, s, KV_HEADS, HEAD_DIM)
        a = hcp.attention(q, k, v, self.cp, mask=mask, window=self.window, softcap=self.softcap, sinks=self.sinks)
        x = x + self.o(a.reshape(b, s, HEADS * HEAD_DIM))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")


def _batch(cp: hcp.CPMesh, step: int, mask: hcp.AttnMask):
    g = torch.Generator().manual_seed(300 + step)
    ids, labels = (torch.randint(0, VOCAB, (2, mask.seq_len), generator=g) for _ in range(2))
    local = hcp.shard(ids, cp, mask=mask), hcp.shard(labels, cp, mask=mask)
    from torch._dynamo import mark_dynamic

    for x in local:  # each mask's layout has its own local length (whole documents are kept whole): dynamic
        mark_dynamic(x, 1)
    return local


def parity(
    u: int,
    r: int,
    backend: str = "aot_eager",
    window=None,
    softcap: float | None = None,  # noqa: PLR0913 (case knobs)
    sinks: bool = False,
    plain: bool = False,
) -> dict | None:
    """Compile the masked model (fullgraph; error_on_recompile unless `plain`) and run one step per `step_masks()`
    mask against eager: loss and gradient errors per step, compiled frames, graph breaks, whether the custom op is
    in the graph. `plain`: the masks as `topology.masks.AttnMask` (no `encoded` tensor)."""
    import torch._dynamo
    from compile_cases import _rel, compiled_twins
    from torch._dynamo.utils import counters

    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    eager, model, counter, compiled = compiled_twins(lambda: MaskModel(cp, window, softcap, sinks), backend)
    rows = []
    masks = step_masks()  # built after dynamo loaded: their encodings' lengths are marked dynamic
    if plain:
        masks = [RangeMask(m.seq_len, m.slices) for m in masks]
    with torch._dynamo.config.patch(error_on_recompile=not plain):
        for step, mask in enumerate(masks):
            ids, labels = _batch(cp, step, mask)
            ref = eager(ids, labels, mask)
            ref.backward()
            loss = compiled(ids, labels, mask)
            loss.backward()
            g_ref = {n: p.grad for n, p in eager.named_parameters()}
            rows.append(
                {
                    "loss": _rel(loss.detach(), ref.detach()),
                    "slices": len(mask.slices),
                    "grads": max(_rel(p.grad, g_ref[n]) for n, p in model.named_parameters()),
                }
            )
            eager.zero_grad()
            model.zero_grad()
    ops = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    return {
        "steps": rows,
        "frames": counter.frame_count,
        "graph_breaks": dict(counters["graph_break"]),
        "op_in_graph": any("hybrid_cp.attention_fwd" in o for o in ops),
    }


def opcheck(u: int, r: int) -> dict | None:
    """torch.library.opcheck on both ops with a mask (and a window) among the arguments: every rank runs the same
    checks in the same order, so the collectives pair up."""
    from hybrid_cp.engine.compiled import _mesh_key
    from hybrid_cp.engine.spec import AttentionSpec

    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    mask = step_masks()[1]
    g = torch.Generator().manual_seed(9 + cp.rank)
    n = mask.seq_len // cp.size
    q = torch.randn(1, n, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(1, n, KV_HEADS, HEAD_DIM, generator=g, requires_grad=True) for _ in range(2))
    spec = AttentionSpec(return_lse=True, mask=mask.encoded, window=9).op_args()
    mesh_key = _mesh_key(cp)
    args = (q, k, v, None, mesh_key, True, *spec)
    fwd = torch.library.opcheck(torch.ops.hybrid_cp.attention_fwd.default, args)
    outs = torch.ops.hybrid_cp.attention_fwd(*args)
    dout = torch.randn(q.shape, generator=g)
    bwd_args = (dout, [x.detach() for x in outs[2:]], None, mesh_key, KV_HEADS, *spec)
    bwd = torch.library.opcheck(torch.ops.hybrid_cp.attention_bwd.default, bwd_args)
    return {"fwd": fwd, "bwd": bwd}


_REF = {"out": 0, "dq": 2, "dk": 3, "dv": 4}  # masked_reference's (out, lse, dq, dk, dv)


def head_chunk_errors(u: int, r: int, cases: list[dict]) -> list[dict]:
    """Masked attention with `case["head_chunks"]` chunks (and `case["overlap"]`) against the same call with one
    chunk (the same kernels on fewer heads: out, lse and gradients should agree to round-off) and against the fp64
    dense masked reference (as `parity.mask_errors`)."""
    cp = mesh(u, r)
    results = []
    for c in cases:
        mask, h, hkv, d, window, softcap = c["mask"], c["h"], c["hkv"], c["d"], c.get("window"), c.get("softcap")
        dtype = DTYPES[c.get("dtype", "fp32")]
        q, k, v, dout = random_inputs(c.get("seed", 5), 1, mask.seq_len, h, hkv, d)
        ref = masked_reference(q, k, v, dout, 1 / math.sqrt(d), mask_visibility(mask.windowed(window)), softcap)
        dl = hcp.shard(dout.to(dtype), cp, mask=mask)
        got = {}
        for chunks in (1, c["head_chunks"]):
            ql, kl, vl = (hcp.shard(x.to(dtype), cp, mask=mask).requires_grad_() for x in (q, k, v))
            out, lse = hcp.attention(
                ql,
                kl,
                vl,
                cp,
                mask=mask,
                window=window,
                softcap=softcap,
                return_lse=True,
                head_chunks=chunks,
                overlap=c.get("overlap", False) and chunks > 1,
            )
            (out * dl).sum().backward()
            got[chunks] = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        one, many = got[1], got[c["head_chunks"]]
        finite = torch.isfinite(one["lse"])
        row = {key: val for key, val in c.items() if key != "mask"}
        for name in ("out", "dq", "dk", "dv"):
            row[f"{name} vs one chunk"] = rel(many[name], one[name], floor=1.0)
            row[f"{name} vs fp64"] = rel(hcp.unshard(many[name], cp, mask=mask), ref[_REF[name]], floor=1.0)
        row["lse vs one chunk"] = rel(
            torch.where(finite, many["lse"], 0.0), torch.where(finite, one["lse"], 0.0), floor=1.0
        )
        row["lse -inf match"] = bool(torch.equal(torch.isneginf(many["lse"]), torch.isneginf(one["lse"])))
        results.append(row)
    return results
