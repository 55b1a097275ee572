"""The fp64 parity runs of the attention engine, shared by the test-suite (tests/dist_cases.py re-exports
them) and the benchmarks that tabulate the same errors (benchmarks/accuracy_table.py,
benchmarks/mask_accuracy_table.py). Each `*_errors` function runs on every rank of a `WorkerPool`
(`pool.run(parity.attention_errors, ...)`) and returns its errors; the callers assert
or print them. The references are computed by fp64 autograd, independent of the package's kernels."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import hybrid_cp as hcp
from hybrid_cp.engine.kernels import get_kernel

__all__ = [
    "CACHE_ENV",
    "DTYPES",
    "MESH_CACHE",
    "assert_every_case_ran",
    "attention_errors",
    "masked_case",
    "masked_reference",
    "mesh",
    "packed_errors",
    "per_module",
    "random_inputs",
    "reference",
    "replica_part",
    "replica_share",
    "rel",
    "rel_norm",
    "shared",
    "visibility",
    "window_errors",
]

# Four meshes at most: every live gloo group costs CPU while idle (three threads each, benchmarks/idle_groups.py;
# ten idle meshes made a later bf16 case 2x slower), and destroying one costs about 0.2 s (its groups' threads
# end). The suite once destroyed every mesh after each test module: on 8 pool-heavy modules (217 tests, 2 cores)
# 299 s against 265-269 s with four kept across modules (267 s with two, where one test failed).
MESH_CACHE = 4
_MESHES: dict = {}
_REFS: dict = {}
_PER_MODULE: dict = {}  # per_module's values, until end_module

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def mesh(u: int, r: int, layout: str = "zigzag", validate: bool | str = True) -> hcp.CPMesh:
    """Meshes are cached: building one creates process groups (every rank, in the same order). Cases that
    make one rank call differently use validate="always": under the default (True) a shared mesh's
    earlier calls decide which calls are checked, and a lone deviation would wait for the timeout.
    At most `MESH_CACHE` are kept (the least recently used is destroyed), so a task may hold that many at once:
    one that builds more would destroy a mesh it still uses."""
    key = (u, r, layout, validate)
    if key in _MESHES:
        _MESHES[key] = _MESHES.pop(key)  # most recently used last
    else:
        while len(_MESHES) >= MESH_CACHE:
            hcp.destroy_cp_mesh(_MESHES.pop(next(iter(_MESHES))))
        _MESHES[key] = hcp.init_cp_mesh(u, r, layout=layout, validate=validate)
    return _MESHES[key]


def replica_share(cp: hcp.CPMesh, cases: list[dict]) -> list[dict]:
    """This dp replica's share of the cases, each tagged with its index ("case"): every case runs on one replica
    of the mesh, not on all of them (a pool of 4 ranks holds 4 replicas of a 1 x 1 mesh, 2 of a 2 x 1), and the
    replicas run different calls side by side on their own groups."""
    return replica_part(cp, [dict(c, case=i) for i, c in enumerate(cases)])


def replica_part(cp: hcp.CPMesh, items: list) -> list:
    """This dp replica's part of `items` (every dp_size-th, from its dp rank)."""
    return list(items)[cp.dp_rank :: cp.dp_size]


def assert_every_case_ran(rows: list[dict], names: list[str], ranks: int) -> None:
    """For runs split by `replica_share` whose rows are {name: result}: each name has results from `ranks` ranks at
    least (one whole mesh), so that no case was left out by the split."""
    for name in names:
        got = sum(name in row for row in rows)
        assert got >= ranks, f"{name!r}: results from {got} ranks, expected {ranks} at least"


def end_module() -> int:
    """Forget the `per_module` values (every rank calls it, as a pool task, after each test module); returns how
    many. The meshes stay cached: the next module often builds the same ones."""
    count = len(_PER_MODULE)
    _PER_MODULE.clear()
    return count


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


def shared(computations: list[Callable[[], Any]], group: dist.ProcessGroup | None = None) -> list[Any]:
    """Each computation run on one rank of `group` (the i-th on its rank i mod the group's size) and its result
    broadcast to the others, in order. For single-process references that every rank compares with: the 8-rank
    pool on a 2-core machine computed each of them 8 times, more than the distributed run it checks."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    owner = [ranks[i % len(ranks)] for i in range(len(computations))]
    mine = {i: compute() for i, compute in enumerate(computations) if owner[i] == dist.get_rank()}
    out = []
    for i in range(len(computations)):
        item = [mine.get(i)]
        dist.broadcast_object_list(item, src=owner[i], group=group)
        out.append(item[0])
    return out


# A folder where the session's references are kept for its other processes (the test-suite sets it: its two pools
# compute the same fp64 references otherwise, 10-15 s of a 2-core machine each).
CACHE_ENV = "HCP_PARITY_CACHE"


def _kept(key: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()`, or its value saved by an earlier process of this session (`CACHE_ENV`); without the folder,
    `compute()`."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return compute()
    path = os.path.join(folder, hashlib.sha1(repr(key).encode()).hexdigest() + ".pt")
    if os.path.exists(path):
        return torch.load(path)
    value = compute()
    torch.save(value, f"{path}.{os.getpid()}")
    os.replace(f"{path}.{os.getpid()}", path)  # whole or absent for a reader
    return value


def _fill_references(cases: list[dict]) -> None:
    """fp64 references, computed once per session and split over the ranks (they are slow); for the bf16 cases,
    also the same kernel's single-device result (the error budget), the same on every rank."""

    def reference_of(key):
        b, n, h, hkv, d, causal = key
        inputs = random_inputs(hash(key) % 10007, b, n, h, hkv, d)
        return inputs, reference(*inputs, causal, 1 / math.sqrt(d))

    _fill({_ref_key(c) for c in cases}, reference_of)
    _fill({_base_key(c) for c in cases if DTYPES[c["dtype"]] not in (torch.float64, torch.float32)}, _single_device)


def _fill(keys: set[tuple], compute: Callable[[tuple], Any]) -> None:
    """`_REFS[key] = compute(key)` for the keys it lacks: each computed on one rank (or read from `CACHE_ENV`)."""
    missing = sorted(keys - set(_REFS))
    _REFS.update(zip(missing, shared([lambda key=key: _kept(key, lambda: compute(key)) for key in missing])))


def _base_key(c: dict) -> tuple:
    return ("single-device", *_ref_key(c), c["dtype"], c.get("backend", "auto"))


def _single_device(key: tuple) -> tuple:
    """The kernel's (out, lse, dq, dk, dv) on one device, in the case's dtype (key from `_base_key`)."""
    _, b, n, h, hkv, d, causal, dtype, backend = key
    (q, k, v, dout), _ = _REFS[(b, n, h, hkv, d, causal)]
    kern, scale = get_kernel(backend, q.device, DTYPES[dtype], d), 1 / math.sqrt(d)
    qd, kd, vd, dd = (x.to(DTYPES[dtype]) for x in (q, k, v, dout))
    o1, l1 = kern.forward(qd, kd, vd, causal=causal, scale=scale)
    g1 = kern.backward(dd, qd, kd, vd, o1, l1, causal=causal, scale=scale)
    return (o1, l1, *g1)


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """Largest elementwise error relative to the largest reference magnitude (at least `floor`)."""
    if b.numel() == 0:  # a rank without real tokens (e.g. a 1-token packed row on 2 ranks): nothing to compare;
        return 0.0  # raising here on that rank alone would leave the others waiting in unshard's all-gather
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(floor)).item()


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the Frobenius norm: stable under rounding noise (used for bf16)."""
    return (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()


def random_inputs(seed: int, b: int, n: int, h: int, hkv: int, d: int):
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
    for c in replica_share(cp, cases):
        n = c["n"]
        dtype, causal, backend = DTYPES[c["dtype"]], c["causal"], c.get("backend", "auto")
        (q, k, v, dout), ref = _REFS[_ref_key(c)]
        got = _cp_run(cp, q, k, v, dout, causal, dtype, backend)
        keep = torch.nonzero(hcp.positions(n, cp) < n).flatten()
        metric = rel if dtype in (torch.float64, torch.float32) else rel_norm
        names, dims = ["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1]

        def local(x, dim):  # this rank's real (non-pad) tokens of a full-sequence tensor
            return hcp.shard(x, cp, dim=dim).index_select(dim, keep)

        err = {
            name: metric(gt.index_select(dim, keep), local(rf, dim)) for name, dim, rf, gt in zip(names, dims, ref, got)
        }
        if dtype not in (torch.float64, torch.float32):
            # The same backend on one device, judged on the same tokens: the error budget.
            for name, dim, a, rf in zip(names, dims, _REFS[_base_key(c)], ref):
                err["base_" + name] = metric(local(a, dim), local(rf, dim))
        results.append({**c, **err})
    return results


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


def masked_reference(q, k, v, dout, scale: float, visible: torch.Tensor, softcap: float | None = None):
    """Attention by fp64 autograd over the whole row with a [N, N] visibility mask (and Gemma 2's logit
    soft-cap, softcap * tanh(scores / softcap), when given)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    h = q.shape[2]
    ke, ve = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    # a row that sees no key: out 0, lse -inf, no gradient (softmax over nothing would be NaN)
    p = torch.where(visible, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def per_module(key: tuple, compute: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """`compute()` once per test module (`end_module` forgets it): an fp64 reference that every mesh of a module
    compares with costs more than the distributed call it checks (about half of a window test's time when computed
    per mesh). With `group` (a replica's cp group, whose ranks run the same cases in the same order), one rank of
    the group computes it and the others receive it; the ranks first agree on who has it, as a rank may have it
    from an earlier mesh whose replicas split the cases differently."""
    if group is None or dist.get_world_size(group) == 1:
        if key not in _PER_MODULE:
            _PER_MODULE[key] = compute()
        return _PER_MODULE[key]
    have: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(have, key in _PER_MODULE, group=group)
    if not all(have):
        src = dist.get_global_rank(group, have.index(True) if any(have) else 0)
        item = [None]
        if dist.get_rank() == src:
            item = [_PER_MODULE[key] if key in _PER_MODULE else compute()]
        dist.broadcast_object_list(item, src=src, group=group)
        _PER_MODULE[key] = item[0]
    return _PER_MODULE[key]


def masked_case(
    cp: hcp.CPMesh,
    seed: int,
    shape: tuple[int, int, int, int, int],
    visible: Callable[[], torch.Tensor],
    key: tuple,
    softcap=None,
) -> tuple:
    """A case's fp64 inputs (fresh tensors: the caller may mark them for autograd) and its masked reference
    (out, lse, dq, dk, dv), once per test module and replica of `cp` (`per_module`). `shape` is (batch, n, h, hkv,
    d); `key` names the visibility that `visible()` builds (documents, causal, window, mask)."""
    inputs = random_inputs(seed, *shape)
    ref = per_module(
        ("masked", seed, shape, softcap, key),
        lambda: masked_reference(*inputs, shape[-1] ** -0.5, visible(), softcap),
        cp.cp_group,
    )
    return inputs, ref


def packed_errors(u: int, r: int, layout: str, cases: list[dict]) -> list[dict]:
    """For each packed case, relative errors of out/lse/dq/dk/dv on this rank's real tokens against
    the per-document fp64 reference, and the largest magnitude found in pad slots (must be 0)."""
    from topology.layouts import PAD

    cp = mesh(u, r, layout)
    results = []
    for c in replica_share(cp, cases):
        lens, h, hkv, d, causal = c["docs"], c["h"], c["hkv"], c["d"], c["causal"]
        dtype = DTYPES[c.get("dtype", "fp32")]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        (q, k, v, dout), ref = masked_case(
            cp, c.get("seed", 3), (1, cu[-1], h, hkv, d), lambda: visibility(lens, causal), (tuple(lens), causal, None)
        )
        ql, kl, vl = (hcp.shard(x.to(dtype), cp, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
        out, lse = hcp.attention(
            ql, kl, vl, cp, causal=causal, cu_seqlens=cu, return_lse=True, backend=c.get("backend", "auto")
        )
        (out * hcp.shard(dout.to(dtype), cp, cu_seqlens=cu)).sum().backward()
        got = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
        lay = hcp.engine.layout.row_layout(cp, cu_seqlens=cu)
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
        keep, pads = torch.nonzero(real).flatten(), torch.nonzero(~real).flatten()
        err, pad_max = {}, 0.0
        for name, dim, rf, gt in zip(["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1], ref, got):
            # relative to max(|ref|, 1): one-token documents have dq = dk = 0 exactly, only round-off remains
            err[name] = rel(
                gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, cu_seqlens=cu).index_select(dim, keep), floor=1.0
            )
            if name != "lse" and pads.numel():
                pad_max = max(pad_max, gt.index_select(dim, pads).abs().max().item())
        if pads.numel():
            err["lse_pad_is_neg_inf"] = bool(torch.isneginf(lse.index_select(2, pads)).all())
        back = hcp.unshard(out.detach(), cp, cu_seqlens=cu)
        err["unshard_ok"] = tuple(back.shape) == (1, cu[-1], h, d)
        err["unshard"] = rel(back, ref[0]) if err["unshard_ok"] else math.inf
        results.append({**c, **err, "pad_max": pad_max})
    return results


def window_errors(u: int, r: int, layout: str, cases: list[dict]) -> list[dict]:
    """Relative errors of windowed attention (dense rows, or packed with `docs`) on this rank's real
    tokens against the fp64 reference, plus the bytes each ring stage sent."""
    from topology.layouts import PAD

    cp = mesh(u, r, layout)
    results = []
    for c in replica_share(cp, cases):
        h, hkv, d, causal, window = c["h"], c["hkv"], c["d"], c["causal"], c["window"]
        window = window if causal or window is None else tuple(window)
        packed = "docs" in c
        lens = c["docs"] if packed else [c["n"]]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        kw = {"cu_seqlens": cu} if packed else {}
        dtype = DTYPES[c.get("dtype", "fp32")]
        (q, k, v, dout), ref = masked_case(
            cp,
            c.get("seed", 4),
            (1, cu[-1], h, hkv, d),
            lambda: visibility(lens, causal, window),
            (tuple(lens), causal, window),
        )
        hcp.reset_comm_bytes(cp)
        ql, kl, vl = (hcp.shard(x.to(dtype), cp, **kw).requires_grad_() for x in (q, k, v))
        out, lse = hcp.attention(
            ql,
            kl,
            vl,
            cp,
            causal=causal,
            window=window,
            return_lse=True,
            backend=c.get("backend", "auto"),
            seq_len=None if packed else cu[-1],
            **kw,
        )
        (out * hcp.shard(dout.to(dtype), cp, **kw)).sum().backward()
        lay = hcp.engine.layout.row_layout(cp, seq_len=None if packed else cu[-1], **kw)
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
        keep = torch.nonzero(real).flatten()
        # relative to max(|ref|, 1): with W = 1 the exact dq and dk are 0 and only round-off remains
        err = {
            name: rel(gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, **kw).index_select(dim, keep), floor=1.0)
            for name, dim, rf, gt in zip(
                ["out", "lse", "dq", "dk", "dv"], [1, 2, 1, 1, 1], ref, (out.detach(), lse, ql.grad, kl.grad, vl.grad)
            )
        }
        results.append(
            {**c, **err, "bytes": hcp.comm_bytes(cp), "ring_rank": cp.ring_rank, "ulysses_rank": cp.ulysses_rank}
        )
    return results


def mask_visibility(mask) -> torch.Tensor:
    """[N, N] bool of an `AttnMask`, cell by cell from its slices (the dense matrix the tests compare with)."""
    n = mask.seq_len
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = torch.zeros(n, n, dtype=torch.bool)
    for sl in mask.slices:
        lo, hi = sl.offsets()
        visible |= (
            (i >= sl.q_start) & (i < sl.q_end) & (j >= sl.k_start) & (j < sl.k_end) & (j - i >= lo) & (j - i <= hi)
        )
    return visible


def mask_errors(u: int, r: int, cases: list[dict]) -> list[dict]:
    """Attention under an `AttnMask` (case["mask"], with case["window"] folded in by the engine) against the
    fp64 dense masked reference on this rank's real tokens: relative errors of out/lse/dq/dk/dv, whether lse
    is -inf exactly where the reference's is (rows that see no key), and the bytes each stage sent."""
    from topology.layouts import PAD

    cp = mesh(u, r)
    results = []
    for c in replica_share(cp, cases):
        mask, h, hkv, d, window = c["mask"], c["h"], c["hkv"], c["d"], c.get("window")
        dtype = DTYPES[c.get("dtype", "fp32")]
        (q, k, v, dout), ref = masked_case(
            cp,
            c.get("seed", 5),
            (c.get("batch", 1), mask.seq_len, h, hkv, d),
            lambda: mask_visibility(mask.windowed(window)),
            (mask, window),
            c.get("softcap"),
        )
        hcp.reset_comm_bytes(cp)
        ql, kl, vl = (hcp.shard(x.to(dtype), cp, mask=mask).requires_grad_() for x in (q, k, v))
        out, lse = hcp.attention(
            ql,
            kl,
            vl,
            cp,
            mask=mask,
            window=window,
            return_lse=True,
            backend=c.get("backend", "auto"),
            softcap=c.get("softcap"),
        )
        (out * hcp.shard(dout.to(dtype), cp, mask=mask)).sum().backward()
        lay = hcp.engine.layout.row_layout(cp, mask=mask)
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
        keep = torch.nonzero(real).flatten()
        ref_lse = hcp.shard(ref[1], cp, dim=2, mask=mask).index_select(2, keep)
        got_lse = lse.index_select(2, keep)
        empty = torch.isinf(ref_lse)
        err = {
            name: rel(
                gt.index_select(dim, keep), hcp.shard(rf, cp, dim=dim, mask=mask).index_select(dim, keep), floor=1.0
            )
            for name, dim, rf, gt in zip(
                ["out", "dq", "dk", "dv"], [1, 1, 1, 1], (ref[0], *ref[2:]), (out.detach(), ql.grad, kl.grad, vl.grad)
            )
        }
        err["lse"] = rel(torch.where(empty, 0.0, got_lse.double()), torch.where(empty, 0.0, ref_lse), floor=1.0)
        full = hcp.unshard(out.detach(), cp, mask=mask)  # every real token back in row order
        tokens = torch.tensor(
            [t for tok, _, n in lay.token_runs(cp.rank) if tok != PAD for t in range(tok, tok + n)], dtype=torch.long
        )
        results.append(
            {
                **{key: val for key, val in c.items() if key != "mask"},
                **err,
                "empty_rows": int(empty.sum()),
                "empty_match": bool(torch.equal(torch.isneginf(got_lse), empty)),
                "unshard": rel(full, ref[0], floor=1.0),
                "positions_match": bool(torch.equal(hcp.positions(cp, mask=mask).index_select(0, keep), tokens)),
                "bytes": hcp.comm_bytes(cp),
                "ring_rank": cp.ring_rank,
                "ulysses_rank": cp.ulysses_rank,
            }
        )
    return results
