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
from hybrid_cp.kernels import get_kernel
from hybrid_cp.layout import local_indices, padded_length
from hybrid_cp.testing import WorkerPool

STAGES = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")


def _inputs(seed: int, n: int, h: int, hkv: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, n, h, d), (1, n, hkv, d), (1, n, hkv, d), (1, n, h, d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def run_rank(ulysses: int, ring: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
             dtype: str, repeats: int) -> dict:
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
    return {"rank": cp.rank, "ulysses_rank": cp.ulysses_rank, "times": times, "bytes": hcp.comm_bytes(cp),
            "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _gather(results: list[dict], name: str, seq_len: int, layout: str, u: int, r: int) -> torch.Tensor:
    n = padded_length(seq_len, layout, u, r)
    first = results[0][name]
    full = first.new_zeros(first.shape[0], n, *first.shape[2:])
    for res in results[: u * r]:
        full[:, local_indices(seq_len, layout, u, r, res["rank"])] = res[name]
    return full[:, :seq_len]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybrid-cp attention-demo", description=__doc__.splitlines()[0])
    p.add_argument("--ulysses", type=int, default=4)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--repeats", type=int, default=2, help="timed forward+backward runs (min and median shown)")
    a = p.parse_args(argv)
    world = a.ulysses * a.ring
    print(f"hybrid-cp attention demo: {world} gloo processes, ulysses={a.ulysses} x ring={a.ring}, "
          f"causal GQA (H={a.heads}, H_kv={a.kv_heads}, D={a.head_dim}), {a.seq_len} tokens, {a.dtype}")
    t0 = time.perf_counter()
    with WorkerPool(world) as pool:
        results = pool.run("hybrid_cp.demo:run_rank", timeout=1800, ulysses=a.ulysses, ring=a.ring,
                           seq_len=a.seq_len, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                           dtype=a.dtype, repeats=a.repeats)
    wall = time.perf_counter() - t0
    results.sort(key=lambda res: res["rank"])
    times = sorted(max(res["times"][i] for res in results) for i in range(a.repeats))

    # Single-device reference in this process: the same fused kernel on the whole sequence.
    dt = getattr(torch, a.dtype)
    q, k, v, dout = _inputs(0, a.seq_len, a.heads, a.kv_heads, a.head_dim, dt)
    kernel = get_kernel("auto", q.device, dt, a.head_dim)
    scale = 1 / math.sqrt(a.head_dim)
    t1 = time.perf_counter()
    out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
    ref = dict(zip(["out", "dq", "dk", "dv"], (out,) + kernel.backward(dout, q, k, v, out, lse, causal=True, scale=scale)))
    single = time.perf_counter() - t1

    print(f"\n{'tensor':8} {'max |cp - single|':>18} {'relative':>10}")
    worst = 0.0
    for name, full in ref.items():
        got = _gather(results, name, a.seq_len, "zigzag", a.ulysses, a.ring)
        err = (got.double() - full.double()).abs().max().item()
        rel = err / full.double().abs().max().item()
        worst = max(worst, rel)
        print(f"{name:8} {err:18.3e} {rel:10.3e}")
    print(f"\nforward+backward on {world} ranks: min {times[0]:.2f} s, median {times[len(times) // 2]:.2f} s "
          f"(single process, same kernel: {single:.2f} s; all ranks share this machine's cores)")
    print(f"whole demo wall time {wall:.1f} s\n")
    try:
        from topology import comm_bytes as predict
    except ImportError:  # pragma: no cover - topology ships with hybrid-cp
        predict = None
    print(f"{'bytes sent per rank':24}" + "".join(f"{s:>14}" for s in STAGES))
    for res in results:
        print(f"cp rank {res['rank']:<16}" + "".join(f"{res['bytes'].get(s, 0):>14,}" for s in STAGES))
    if predict is not None:
        elem = torch.tensor([], dtype=dt).element_size()
        pred = predict(a.heads, a.kv_heads, a.head_dim, a.seq_len, 1, a.ulysses, a.ring, elem)
        print(f"{'cost model (max rank)':24}" + "".join(f"{pred[s]:>14,}" for s in STAGES))
    tol = 1e-5 if dt in (torch.float32, torch.float64) else 2e-2
    print(f"\nlargest relative error {worst:.2e} ({'OK' if worst <= tol else 'FAILED'}: tolerance {tol:g})")
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    raise SystemExit(main())
