"""`hybrid-cp attention-demo`: exact hybrid attention on local CPU processes, checked end to end.

Starts `ulysses * ring` gloo processes, runs causal GQA attention forward and backward on one
long sequence, and compares the gathered outputs and gradients with single-device attention
computed in this process. Prints the error, the time and the bytes each stage sent per rank
(next to the cost model's prediction, which must be equal).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import hybrid_cp as hcp
from hybrid_cp.cli import attention_demo
from hybrid_cp.engine.kernels import get_kernel
from hybrid_cp.engine.layout import local_indices, padded_length
from hybrid_cp.testing import WorkerPool
from topology import comm_bytes

from .bench import check_shape
from .command import Command
from .table import format_table

STAGES = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")


def _inputs(seed: int, n: int, h: int, hkv: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, n, h, d), (1, n, hkv, d), (1, n, hkv, d), (1, n, h, d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def run_rank(
    ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype: str, repeats: int
) -> dict:
    """One rank's part: shard, attention forward + backward (timed), local results and bytes."""
    import torch.distributed as dist

    dt = getattr(torch, dtype)
    cp = hcp.init_cp_mesh(ulysses, ring)
    q, k, v, dout = _inputs(0, seq_len, heads, kv_heads, head_dim, dt)
    ql, kl, vl = (hcp.shard(x, cp).requires_grad_() for x in (q, k, v))
    dl = hcp.shard(dout, cp)
    times = []
    for i in range(repeats):
        for x in (ql, kl, vl):
            x.grad = None
        hcp.reset_comm_bytes(cp)
        dist.barrier()
        t0 = time.perf_counter()
        out = hcp.attention(ql, kl, vl, cp, causal=True)
        out.backward(dl)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {
        "rank": cp.rank,
        "ulysses_rank": cp.ulysses_rank,
        "times": times,
        "bytes": hcp.comm_bytes(cp),
        "out": out.detach(),
        "dq": ql.grad,
        "dk": kl.grad,
        "dv": vl.grad,
    }


def _gather(results: list[dict], name: str, seq_len: int, layout: str, u: int, r: int) -> torch.Tensor:
    n = padded_length(seq_len, layout, u, r)
    first = results[0][name]
    full = first.new_zeros(first.shape[0], n, *first.shape[2:])
    for res in results[: u * r]:
        full[:, local_indices(seq_len, layout, u, r, res["rank"])] = res[name]
    return full[:, :seq_len]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ulysses", type=int, default=4)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--repeats", type=int, default=2, help="timed forward+backward runs (min and median shown)")


def _single_device(a: argparse.Namespace) -> tuple[dict[str, torch.Tensor], float]:
    """The reference in this process: the same fused kernel on the whole sequence; and its time."""
    dt = getattr(torch, a.dtype)
    q, k, v, dout = _inputs(0, a.seq_len, a.heads, a.kv_heads, a.head_dim, dt)
    kernel = get_kernel("auto", q.device, dt, a.head_dim)
    scale = 1 / math.sqrt(a.head_dim)
    t1 = time.perf_counter()
    out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=scale)
    return dict(zip(["out", "dq", "dk", "dv"], (out, *grads))), time.perf_counter() - t1


def _errors(results: list[dict], ref: dict[str, torch.Tensor], a: argparse.Namespace) -> float:
    """Print each tensor's largest error against the reference; the largest relative one."""
    rows = []
    for name, full in ref.items():
        got = _gather(results, name, a.seq_len, "zigzag", a.ulysses, a.ring)
        err = (got.double() - full.double()).abs().max().item()
        rows.append([name, err, err / full.double().abs().max().item()])
    print()
    print(format_table(["tensor", "max |cp - single|", "relative"], rows, formats=["", ".3e", ".3e"], gap=1))
    return max(row[2] for row in rows)


def _bytes_table(results: list[dict], a: argparse.Namespace) -> None:
    """Bytes each stage sent per rank, under the cost model's figure (which must be equal)."""
    rows = [[f"cp rank {res['rank']}", *(res["bytes"].get(s, 0) for s in STAGES)] for res in results]
    elem = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    pred = comm_bytes(a.heads, a.kv_heads, a.head_dim, a.seq_len, 1, a.ulysses, a.ring, elem)
    rows.append(["cost model (max rank)", *(pred[s] for s in STAGES)])
    print(format_table(["bytes sent per rank", *STAGES], rows, formats=["", *[","] * len(STAGES)]))


def run(a: argparse.Namespace) -> int:
    """`hybrid-cp attention-demo` on parsed flags: 0 when every error is within the tolerance."""
    check_shape(a)  # before any process starts: a bad flag is a usage error, not a traceback from 8 ranks
    world = a.ulysses * a.ring
    print(
        f"hybrid-cp attention demo: {world} gloo processes, ulysses={a.ulysses} x ring={a.ring}, "
        f"causal GQA (H={a.heads}, H_kv={a.kv_heads}, D={a.head_dim}), {a.seq_len} tokens, {a.dtype}"
    )
    t0 = time.perf_counter()
    with WorkerPool(world) as pool:
        results = pool.run(
            attention_demo.run_rank,
            timeout=1800,
            ulysses=a.ulysses,
            ring=a.ring,
            seq_len=a.seq_len,
            heads=a.heads,
            kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            dtype=a.dtype,
            repeats=a.repeats,
        )
    wall = time.perf_counter() - t0
    results.sort(key=lambda res: res["rank"])
    times = sorted(max(res["times"][i] for res in results) for i in range(a.repeats))
    ref, single = _single_device(a)
    worst = _errors(results, ref, a)
    print(
        f"\nforward+backward on {world} ranks: min {times[0]:.2f} s, median {times[len(times) // 2]:.2f} s "
        f"(single process, same kernel: {single:.2f} s; all ranks share this machine's cores)"
    )
    print(f"whole demo wall time {wall:.1f} s\n")
    _bytes_table(results, a)
    tol = 1e-5 if a.dtype in ("float32", "float64") else 2e-2
    print(f"\nlargest relative error {worst:.2e} ({'OK' if worst <= tol else 'FAILED'}: tolerance {tol:g})")
    return 0 if worst <= tol else 1


COMMAND = Command(
    "attention-demo",
    "exact hybrid attention on local CPU processes vs one device",
    __doc__.splitlines()[0],
    add_arguments,
    run,
)
main = COMMAND.main
