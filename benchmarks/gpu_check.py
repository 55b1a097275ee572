"""GPU checks in one short run: kernel parity on CUDA, the engine on CUDA, kernel throughput.

    python benchmarks/gpu_check.py --out results.json

1. Every CUDA-capable backend (sdpa: flash op for bf16/fp16, efficient op for fp32; flash-attn
   if installed) forward and backward against the fp64 math reference, MHA/GQA, causal or not.
2. hcp.attention on a one-rank NCCL mesh on the GPU against the same reference (exercises the
   CUDA path of the engine: mesh, validation collective, kernels, autograd).
3. Throughput (TFLOP/s, causal counted as half) of the local kernel on the block shapes a
   zigzag ring step uses, next to the full causal block, and the cost of the fp32 merge.
Each section reports its own failure instead of stopping the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch

from hybrid_cp.kernels import MathKernel, available_kernels, get_kernel
from hybrid_cp.ring import merge_


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def parity(results):
    dev = torch.device("cuda")
    ref_kernel = MathKernel()
    rows = []
    for backend in ["sdpa", "flash"]:
        for dtype in [torch.bfloat16, torch.float16, torch.float32]:
            try:
                kern = get_kernel(backend, dev, dtype, 128)
            except ValueError as exc:
                rows.append({"backend": backend, "dtype": str(dtype), "skipped": str(exc)})
                continue
            for hkv in (32, 8):
                for causal in (True, False):
                    g = torch.Generator(device=dev).manual_seed(0)
                    q, do = (torch.randn(2, 2048, 32, 128, device=dev, generator=g) for _ in range(2))
                    k, v = (torch.randn(2, 2048, hkv, 128, device=dev, generator=g) for _ in range(2))
                    s = 1 / math.sqrt(128)
                    o64, l64 = ref_kernel.forward(q.double(), k.double(), v.double(), causal=causal, scale=s)
                    g64 = ref_kernel.backward(do.double(), q.double(), k.double(), v.double(), o64, l64,
                                              causal=causal, scale=s)
                    qd, kd, vd, dod = (x.to(dtype) for x in (q, k, v, do))
                    o, l = kern.forward(qd, kd, vd, causal=causal, scale=s)
                    gr = kern.backward(dod, qd, kd, vd, o, l, causal=causal, scale=s)
                    # the same computation on rounded inputs in fp64 is the error floor of the dtype
                    row = {"backend": backend, "dtype": str(dtype), "hkv": hkv, "causal": causal}
                    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], (o, l) + tuple(gr), (o64, l64) + tuple(g64)):
                        row[name] = _rel(a, b)
                    rows.append(row)
                    print(row, flush=True)
    results["parity"] = rows


def engine(results):
    import torch.distributed as dist

    import hybrid_cp as hcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    cp = hcp.init_cp_mesh(1, 1)
    rows = []
    for dtype, n, causal in [(torch.bfloat16, 4000, True), (torch.float32, 1000, False)]:
        g = torch.Generator(device="cuda").manual_seed(1)
        q, do = (torch.randn(1, n, 16, 64, device="cuda", generator=g) for _ in range(2))
        k, v = (torch.randn(1, n, 4, 64, device="cuda", generator=g) for _ in range(2))
        ql, kl, vl = (hcp.shard(x.to(dtype), cp).requires_grad_() for x in (q, k, v))
        out, lse = hcp.attention(ql, kl, vl, cp, causal=causal, return_lse=True)
        out.backward(hcp.shard(do.to(dtype), cp))
        m = MathKernel()
        o64, l64 = m.forward(q.double(), k.double(), v.double(), causal=causal, scale=0.125)
        g64 = m.backward(do.double(), q.double(), k.double(), v.double(), o64, l64, causal=causal, scale=0.125)
        row = {"dtype": str(dtype), "n": n, "causal": causal, "device": str(out.device),
               "out": _rel(out, o64), "lse": _rel(lse, l64), "dq": _rel(ql.grad, g64[0]),
               "dk": _rel(kl.grad, g64[1]), "dv": _rel(vl.grad, g64[2])}
        rows.append(row)
        print(row, flush=True)
    dist.destroy_process_group()
    results["engine_cuda"] = rows


def _time(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def throughput(results):
    dev = torch.device("cuda")
    rows = []
    h, hkv, d = 32, 8, 128
    for backend in ["sdpa", "flash"]:
        try:
            kern = get_kernel(backend, dev, torch.bfloat16, d)
        except ValueError as exc:
            rows.append({"backend": backend, "skipped": str(exc)})
            continue
        for n in (8192, 32768):
            for label, sq, sk, causal in [("full causal", n, n, True), ("zigzag step (2C x C)", n, n // 2, False),
                                          ("zigzag step (C x 2C)", n // 2, n, False)]:
                q = torch.randn(1, sq, h, d, device=dev, dtype=torch.bfloat16)
                k = torch.randn(1, sk, hkv, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                flops = 4 * sq * sk * d * h * (0.5 if causal else 1.0)
                fmin, fmed = _time(lambda: kern.forward(q, k, v, causal=causal, scale=0.088))
                o, l = kern.forward(q, k, v, causal=causal, scale=0.088)
                bmin, bmed = _time(lambda: kern.backward(o, q, k, v, o, l, causal=causal, scale=0.088))
                row = {"backend": backend, "n": n, "block": label, "fwd_tflops_best": flops / fmin / 1e12,
                       "fwd_tflops_median": flops / fmed / 1e12, "bwd_tflops_best": 2.5 * flops / bmin / 1e12,
                       "bwd_tflops_median": 2.5 * flops / bmed / 1e12}
                rows.append(row)
                print(row, flush=True)
        # cost of the fp32 online-softmax merge for a 32K-token ring block, relative to one step
        n = 32768
        out = torch.zeros(1, n, h, d, device=dev)
        lse = torch.zeros(1, h, n, device=dev)
        bo = torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16)
        bl = torch.randn(1, h, n, device=dev)
        mmin, mmed = _time(lambda: merge_(out, lse, bo, bl))
        rows.append({"backend": backend, "merge_32k_ms_best": mmin * 1e3, "merge_32k_ms_median": mmed * 1e3})
        print(rows[-1], flush=True)
    results["throughput"] = rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backends": available_kernels()}
    try:
        import flash_attn  # noqa: F401
        results["flash_attn"] = flash_attn.__version__
    except ImportError as exc:
        results["flash_attn"] = f"not installed ({exc})"
    print(results, flush=True)
    for section in (parity, engine, throughput):
        t0 = time.time()
        try:
            section(results)
        except Exception:
            results[section.__name__ + "_error"] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        print(f"{section.__name__}: {time.time() - t0:.1f}s", flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
