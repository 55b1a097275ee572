"""GPU checks in one run (under 8 minutes on one H200; installs nothing).

    python benchmarks/gpu_check.py --out DIR            # DIR/gpu_check.json and DIR/gpu_check.md
    python benchmarks/gpu_check.py --dry-run --out DIR  # the same code on CPU at tiny shapes (no GPU)

--out defaults to $OUT, else benchmarks/results. Sections (each records its own failure, and a
failing kernel is recorded per kernel, so the rest of the run goes on):

1. env: GPU, versions, every kernel's supports() answer for bf16 D=128, the kernel backend="auto"
   picks and each kernel's self-test result.
2. parity: every available kernel (bf16 and fp16; sdpa also fp32), D=64 and 128, against fp64 math:
   the "large" cases of hybrid_cp.engine.kernels.kernel_errors (merged out/lse backward on split blocks,
   lengths not multiples of 128, GQA 8/2, packed segments and windows where the kernel takes them).
3. throughput: TFLOP/s forward and backward per kernel at the ring's block shapes, bf16, H=32,
   H_kv=8, D=128, 8K and 32K tokens per ring block n: causal square (n x n), zigzag off-diagonal
   (n x n/2: both query halves against a visiting half; n/2 x n: a query half against full keys),
   full (n x n). FLOPs 4*B*H*Sq*Sk*D (half if causal), backward 2.5x; CUDA events after warm-up;
   best and median.
4. schedule: a ring rank's r blocks of 32K keys run back to back against 32K queries with the
   engine's merge (hybrid_cp.engine.kernels.merge.merge_; backward: merged out/lse, fp32 dq/dk/dv accumulation),
   versus one call over the same r*32K keys. Efficiency = fused time / ring time (limit 1.0).
5. linear: the linear layers' CUDA kernels (fla's chunk_gated_delta_rule, mamba_ssm's
   mamba_chunk_scan_combined, when importable) against transformers' torch reference, fp32 and bf16, forward
   and backward: plain with the final state, from an initial state, the engine's probe (Gated DeltaNet at
   width dv + dk); max relative error over the outputs and over the inputs' gradients. "not installed" rows
   otherwise. The first calls compile (and autotune) Triton kernels; alone: --sections env,linear.
6. engine: hcp.attention (backend="auto") on a one-rank NCCL mesh, forward + backward, against
   fp64 math.
7. sync: after warm-up, ring_forward + ring_backward and hcp.attention (dense and packed) run under
   torch.cuda.set_sync_debug_mode("error"): does anything synchronise with the host?
8. memory: one training step (benchmarks/memory_step.py:measure) of a Llama-3-8B-shaped model with 2 layers,
   bf16, every memory option of the --max-seq ladder (checkpointing with offload, tiled norm and MLP of 8,192
   tokens, tiled loss, 4 module-level head chunks), at 128K and 256K tokens on the one-rank mesh: the CUDA
   allocator's peak (allocated and reserved) beside the planner's estimate for the same shape, as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # FA4: keep compiled kernels

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid_cp.cli.table import format_table  # noqa: E402
from hybrid_cp.engine import kernels as K  # noqa: E402
from hybrid_cp.engine.kernels.merge import merge_  # noqa: E402

KERNELS = [n for n in K.CUDA_AUTO_ORDER if n != "math"]


@dataclass
class Ctx:
    dev: torch.device
    dry: bool
    budget_s: float
    t0: float = field(default_factory=time.time)

    # shapes: the GPU run's, or tiny ones for --dry-run on CPU
    @property
    def parity_size(self) -> str:
        return "small" if self.dry else "large"

    @property
    def parity_dims(self) -> tuple[int, ...]:
        return (16,) if self.dry else (64, 128)

    @property
    def heads(self) -> tuple[int, int, int]:
        return (4, 2, 16) if self.dry else (32, 8, 128)

    @property
    def tokens(self) -> tuple[int, ...]:
        return (256,) if self.dry else (8192, 32768)

    @property
    def sched(self) -> tuple[int, tuple[int, ...]]:
        return (256, (2,)) if self.dry else (32768, (2, 8))

    deadline: float = float("inf")

    def out_of_time(self) -> bool:
        return time.time() > min(self.deadline, self.t0 + self.budget_s)


# Most seconds each section may take (on top of the run's --budget): one slow kernel (FA4 compiles
# each new configuration on first use) must not starve the sections after it.
SECTION_LIMIT_S = {"parity": 150.0, "throughput": 150.0, "schedule": 100.0, "linear": 120.0, "memory": 150.0}


def _kernel(name: str, ctx: Ctx, dtype: torch.dtype, d: int):
    """(kernel, None) or (None, why it cannot run here)."""
    try:
        return K.get_kernel(name, ctx.dev, dtype, d), None
    except ValueError as exc:
        return None, str(exc)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev: torch.device, reps: int, warmup: int = 2) -> tuple[float, float]:
    """(best, median) seconds of fn() after warm-up: CUDA events on a GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(dev)
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def _free(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---- 1. environment -------------------------------------------------------------------------------------------------


def env(res: dict, ctx: Ctx) -> None:
    info = {"torch": torch.__version__, "device": str(ctx.dev), "dry_run": ctx.dry}
    if ctx.dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(ctx.dev)
        info["capability"] = "sm%d%d" % torch.cuda.get_device_capability(ctx.dev)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    for mod, label in (
        ("flash_attn", "flash_attn"),
        ("flash_attn_interface", "flash_attn_3"),
        ("flash_attn.cute", "flash_attn_4"),
    ):
        try:
            m = __import__(mod, fromlist=["_"])
            info[label] = getattr(m, "__version__", "installed")
        except Exception as exc:
            info[label] = f"not importable ({_err(exc)})"
    d = ctx.heads[2]
    info["supports_bf16"] = {
        n: K.registered_kernels()[n].supports(ctx.dev, torch.bfloat16, d) or "yes" for n in K.CUDA_AUTO_ORDER
    }
    try:
        info["auto_bf16"] = K.get_kernel("auto", ctx.dev, torch.bfloat16, d).name
    except Exception as exc:
        info["auto_bf16"] = _err(exc)
    info["self_tests"] = {
        f"{k[0]} {k[2]} D={k[3]}": ("passed" if v is None else _err(v)) for k, v in K.self_test_results().items()
    }
    res["env"] = info
    print(json.dumps(info, indent=1, default=str), flush=True)


# ---- 2. parity ------------------------------------------------------------------------------------------------------


def parity(res: dict, ctx: Ctx) -> None:
    rows = res.setdefault("parity", [])
    for name in KERNELS:
        dtypes = [torch.bfloat16, torch.float16] + ([torch.float32] if name == "sdpa" else [])
        for dtype in dtypes:
            for d in ctx.parity_dims:
                base = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "D": d}
                if ctx.out_of_time():
                    rows.append({**base, "skipped": "time budget"})
                    continue
                kern, why = _kernel(name, ctx, dtype, d)
                if kern is None:
                    rows.append({**base, "skipped": why})
                    continue
                tol = K.SELF_TEST_TOL[dtype]
                try:
                    for case, errs in K.kernel_errors(
                        kern, ctx.dev, dtype, d, size=ctx.parity_size, ref_dtype=torch.float64
                    ):
                        rows.append({**base, "case": case, **errs, "pass": all(e <= tol for e in errs.values())})
                        print(rows[-1], flush=True)
                except Exception as exc:
                    rows.append({**base, "error": _err(exc)})
                    print(rows[-1], flush=True)
                _free(ctx.dev)


# ---- 3. throughput --------------------------------------------------------------------------------------------------


def _blocks(n: int):
    return [
        ("causal square", n, n, True),
        ("zigzag off-diagonal (n x n/2)", n, n // 2, False),
        ("zigzag off-diagonal (n/2 x n)", n // 2, n, False),
        ("full", n, n, False),
    ]


def throughput(res: dict, ctx: Ctx) -> None:
    rows = res.setdefault("throughput", [])
    h, hkv, d = ctx.heads
    dtype = torch.bfloat16
    for name in KERNELS:
        kern, why = _kernel(name, ctx, dtype, d)
        if kern is None:
            rows.append({"kernel": name, "skipped": why})
            continue
        for n in ctx.tokens:
            for label, sq, sk, causal in _blocks(n):
                row = {"kernel": name, "tokens": n, "block": label, "Sq": sq, "Sk": sk}
                if ctx.out_of_time():
                    rows.append({**row, "skipped": "time budget"})
                    continue
                try:
                    q = torch.randn(1, sq, h, d, device=ctx.dev, dtype=dtype)
                    k, v = (torch.randn(1, sk, hkv, d, device=ctx.dev, dtype=dtype) for _ in range(2))
                    flops = 4 * sq * sk * d * h * (0.5 if causal else 1.0)
                    scale = d**-0.5
                    reps = 10 if n <= 8192 else 5
                    fmin, fmed = _time(lambda: kern.forward(q, k, v, causal=causal, scale=scale), ctx.dev, reps)
                    o, lse = kern.forward(q, k, v, causal=causal, scale=scale)
                    bmin, bmed = _time(
                        lambda: kern.backward(o, q, k, v, o, lse, causal=causal, scale=scale), ctx.dev, reps
                    )
                    row.update(
                        fwd_tflops_best=flops / fmin / 1e12,
                        fwd_tflops_median=flops / fmed / 1e12,
                        bwd_tflops_best=2.5 * flops / bmin / 1e12,
                        bwd_tflops_median=2.5 * flops / bmed / 1e12,
                    )
                except Exception as exc:
                    row["error"] = _err(exc)
                rows.append(row)
                print(row, flush=True)
                _free(ctx.dev)
    # the fp32 online-softmax merge of one ring block, for scale
    n = ctx.tokens[-1]
    out = torch.zeros(1, n, h, d, device=ctx.dev)
    lse = torch.zeros(1, h, n, device=ctx.dev)
    bo = torch.randn(1, n, h, d, device=ctx.dev, dtype=dtype)
    bl = torch.randn(1, h, n, device=ctx.dev)
    mmin, mmed = _time(lambda: merge_(out, lse, bo, bl), ctx.dev, 10)
    res["merge"] = {"tokens": n, "ms_best": mmin * 1e3, "ms_median": mmed * 1e3}
    print(res["merge"], flush=True)


# ---- 4. ring schedule efficiency ------------------------------------------------------------------------------------


def schedule(res: dict, ctx: Ctx) -> None:
    rows = res.setdefault("schedule", [])
    h, hkv, d = ctx.heads
    dtype = torch.bfloat16
    n, rs = ctx.sched
    scale = d**-0.5
    for name in KERNELS:
        kern, why = _kernel(name, ctx, dtype, d)
        if kern is None:
            rows.append({"kernel": name, "skipped": why})
            continue
        for r in rs:
            row = {"kernel": name, "tokens_per_block": n, "r": r}
            if ctx.out_of_time():
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                q, dout = (torch.randn(1, n, h, d, device=ctx.dev, dtype=dtype) for _ in range(2))
                k, v = (torch.randn(1, r * n, hkv, d, device=ctx.dev, dtype=dtype) for _ in range(2))
                parts = [slice(i * n, (i + 1) * n) for i in range(r)]

                def ring_fwd():
                    out = torch.zeros(1, n, h, d, dtype=torch.float32, device=ctx.dev)
                    lse = torch.full((1, h, n), float("-inf"), dtype=torch.float32, device=ctx.dev)
                    for p in parts:
                        o_b, l_b = kern.forward(q, k[:, p], v[:, p], causal=False, scale=scale)
                        merge_(out, lse, o_b, l_b)
                    return out.to(dtype), lse

                out, lse = ring_fwd()

                def ring_bwd():
                    dq = torch.zeros(1, n, h, d, dtype=torch.float32, device=ctx.dev)
                    dkv = torch.zeros(2, 1, r * n, hkv, d, dtype=torch.float32, device=ctx.dev)
                    for p in parts:
                        g = kern.backward(dout, q, k[:, p], v[:, p], out, lse, causal=False, scale=scale)
                        dq.add_(g[0])
                        dkv[0][:, p].add_(g[1])
                        dkv[1][:, p].add_(g[2])
                    return dq, dkv

                reps = 3 if r * n > 65536 else 5
                rf = _time(ring_fwd, ctx.dev, reps, warmup=1)
                ff = _time(lambda: kern.forward(q, k, v, causal=False, scale=scale), ctx.dev, reps, warmup=1)
                fo, fl = kern.forward(q, k, v, causal=False, scale=scale)
                rb = _time(ring_bwd, ctx.dev, reps, warmup=1)
                fb = _time(
                    lambda: kern.backward(dout, q, k, v, fo, fl, causal=False, scale=scale), ctx.dev, reps, warmup=1
                )
                row.update(
                    fwd_ring_ms=rf[0] * 1e3,
                    fwd_fused_ms=ff[0] * 1e3,
                    fwd_efficiency=ff[0] / rf[0],
                    bwd_ring_ms=rb[0] * 1e3,
                    bwd_fused_ms=fb[0] * 1e3,
                    bwd_efficiency=fb[0] / rb[0],
                )
            except Exception as exc:
                row["error"] = _err(exc)
            rows.append(row)
            print(row, flush=True)
            _free(ctx.dev)


# ---- 5. linear-layer kernels (fla, mamba_ssm) against transformers' torch reference ---------------------------------


def _linear_kernels(ctx: Ctx) -> list[tuple[str, str, object, object]]:
    """(family, package and version or why not, kernel or None, reference) for Gated DeltaNet and Mamba2: the
    CUDA kernel the linear layers dispatch to (linear_layers.cuda_kernel); under --dry-run without it, the
    reference against itself (checks the script)."""
    from transformers.models.bamba import modeling_bamba
    from transformers.models.qwen3_next import modeling_qwen3_next

    from hybrid_cp.integrations.linear_layers import CUDA_KERNELS, cuda_kernel

    out = []
    for family, name, mod in (
        ("gdn", "torch_chunk_gated_delta_rule", modeling_qwen3_next),
        ("ssd", "mamba2_chunk_scan", modeling_bamba),
    ):
        ref = getattr(getattr(mod, name), "__wrapped__", getattr(mod, name))
        _, attr, package, _ = CUDA_KERNELS[name]
        try:
            kern, what = cuda_kernel(name), f"{package}.{attr}"
        except Exception as exc:  # installed but refused (too old) or broken: recorded, not replaced
            kern, what = None, f"{package}: {_err(exc)}"
        if kern is not None:
            what += f" {getattr(sys.modules[package], '__version__', '')}"
        elif ctx.dry and what == f"{package}.{attr}":
            kern, what = ref, f"{package} not installed: reference vs itself (dry run)"
        elif what == f"{package}.{attr}":
            what = f"{package} not installed"
        out.append((family, what, kern, ref))
    return out


def _gdn_cases(ctx: Ctx, dtype: torch.dtype) -> tuple[dict, list]:
    """Qwen3-Next's layout (16 q/k heads, 32 v heads, 128 dims; tiny under --dry-run): inputs, and the cases
    (plain with the final state, from an initial state, the engine's probe at width dv + dk)."""
    from hybrid_cp.engine.recurrence import GatedDelta

    b, t, h, hv, dk, dv = (1, 40, 2, 4, 8, 8) if ctx.dry else (1, 2000, 16, 32, 128, 128)
    g = torch.Generator().manual_seed(11)
    x = {
        "q": torch.randn(b, t, h, dk, generator=g).to(dtype),
        "k": torch.randn(b, t, h, dk, generator=g).to(dtype),
        "v": torch.randn(b, t, hv, dv, generator=g).to(dtype),
        "g": -torch.nn.functional.softplus(torch.randn(b, t, hv, generator=g) - 2),  # fp32, as the layer's
        "beta": torch.rand(b, t, hv, generator=g).to(dtype),
        "h0": torch.randn(b, hv, dk, dv, generator=g) * 0.1,
    }

    def call(kern, i, initial):
        return kern(
            i["q"],
            i["k"],
            i["v"],
            g=i["g"],
            beta=i["beta"],
            initial_state=i["h0"] if initial else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    return x, [
        ("plain + final state", lambda kern, i: call(kern, i, False)),
        ("initial state", lambda kern, i: call(kern, i, True)),
        (
            f"probe (v width {dv + dk})",
            lambda kern, i: GatedDelta(kern).probe([i[n] for n in ("q", "k", "v", "g", "beta")]),
        ),
    ]


def _ssd_cases(ctx: Ctx, dtype: torch.dtype) -> tuple[dict, list]:
    """A Mamba2 layer's shapes (32 heads of 64, 4 groups, state 128, chunk 256; tiny under --dry-run): inputs,
    and the cases (plain with the final state, from an initial state, the engine's probe)."""
    from hybrid_cp.engine.recurrence import Mamba2

    b, t, h, p, ng, n, chunk = (1, 40, 4, 4, 2, 8, 16) if ctx.dry else (1, 2000, 32, 64, 4, 128, 256)
    g = torch.Generator().manual_seed(12)
    x = {
        "x": torch.randn(b, t, h, p, generator=g).to(dtype),
        "dt": torch.randn(b, t, h, generator=g).to(dtype),
        "B": torch.randn(b, t, ng, n, generator=g).to(dtype),
        "C": torch.randn(b, t, ng, n, generator=g).to(dtype),
        "A": -torch.rand(h, generator=g) - 0.5,
        "D": torch.randn(h, generator=g),
        "dt_bias": torch.randn(h, generator=g),
        "h0": torch.randn(b, h, p, n, generator=g) * 0.1,
    }

    def kind(kern, i):
        return Mamba2(kern, i["A"], chunk, i["D"], i["dt_bias"])

    def initial(kern, i):
        return kern(
            i["x"],
            i["dt"],
            i["A"],
            i["B"],
            i["C"],
            chunk_size=chunk,
            D=i["D"],
            dt_bias=i["dt_bias"],
            initial_states=i["h0"],
            dt_softplus=True,
            return_final_states=True,
        )

    return x, [
        ("plain + final state", lambda kern, i: kind(kern, i).plain([i[k] for k in "x dt B C".split()], True)),
        ("initial state", initial),
        ("probe", lambda kern, i: kind(kern, i).probe([i[k] for k in "x dt B C".split()])),
    ]


def _linear_errors(fn, inputs: dict, kern, ref, dev: torch.device) -> dict:
    """Max relative errors of fn(kernel, inputs) against fn(reference, inputs): the largest over the outputs
    (out, final state, the probe's transition) and over the gradients of every input, and which input's."""

    def run(k):
        xs = {n: x.detach().to(dev, copy=True).requires_grad_() for n, x in inputs.items()}
        outs = [o for o in fn(k, xs) if o is not None]
        g = torch.Generator(device=dev).manual_seed(5)
        sum((o.float() * torch.randn(o.shape, generator=g, device=dev)).sum() for o in outs).backward()
        return outs, {n: x.grad for n, x in xs.items() if x.grad is not None}

    (go, gg), (ro, rg) = run(kern), run(ref)
    grads = {n: _rel(gg[n], rg[n]) for n in rg if rg[n].abs().max() > 0}
    worst = max(grads, key=grads.get) if grads else ""
    return {
        "out": max(_rel(a, b) for a, b in zip(go, ro)),
        "grad": grads.get(worst, 0.0),
        "worst_grad": worst,
        "grads": grads,
    }


def linear(res: dict, ctx: Ctx) -> None:
    rows = res.setdefault("linear", [])
    for family, what, kern, ref in _linear_kernels(ctx):
        if kern is None:
            rows.append({"family": family, "kernel": what, "skipped": what})
            continue
        for dtype in (torch.float32, torch.bfloat16):
            inputs, cases = (_gdn_cases if family == "gdn" else _ssd_cases)(ctx, dtype)
            for case, fn in cases:
                row = {"family": family, "kernel": what, "dtype": str(dtype).replace("torch.", ""), "case": case}
                try:
                    if ctx.out_of_time():
                        row["skipped"] = "time budget"
                    else:
                        row.update(_linear_errors(fn, inputs, kern, ref, ctx.dev))
                except Exception as exc:
                    row["error"] = _err(exc)
                rows.append(row)
                print(row, flush=True)
                _free(ctx.dev)


# ---- 6. the engine on a one-rank mesh, 7. host syncs --------------------------------------------------------------


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def engine(res: dict, ctx: Ctx) -> None:
    import hybrid_cp as hcp

    cp = res["_mesh"]
    rows = res.setdefault("engine", [])
    m = K.MathKernel()
    cases = (
        [(torch.bfloat16, 4000, True), (torch.float32, 1000, False)]
        if not ctx.dry
        else [(torch.float32, 200, True), (torch.bfloat16, 120, False)]
    )
    for dtype, n, causal in cases:
        row = {"dtype": str(dtype).replace("torch.", ""), "n": n, "causal": causal}
        try:
            g = torch.Generator().manual_seed(1)
            q, do = (torch.randn(1, n, 16, 64, generator=g).to(ctx.dev) for _ in range(2))
            k, v = (torch.randn(1, n, 4, 64, generator=g).to(ctx.dev) for _ in range(2))
            ql, kl, vl = (hcp.shard(x.to(dtype), cp).requires_grad_() for x in (q, k, v))
            out, lse = hcp.attention(ql, kl, vl, cp, causal=causal, return_lse=True)
            out.backward(hcp.shard(do.to(dtype), cp))
            args = [x.to(dtype).double() for x in (q, k, v)]
            o64, l64 = m.forward(*args, causal=causal, scale=0.125)
            g64 = m.backward(do.to(dtype).double(), *args, o64, l64, causal=causal, scale=0.125)
            row.update(
                kernel=K.get_kernel("auto", ctx.dev, dtype, 64).name,
                out=_rel(out, o64),
                lse=_rel(lse, l64),
                dq=_rel(ql.grad, g64[0]),
                dk=_rel(kl.grad, g64[1]),
                dv=_rel(vl.grad, g64[2]),
            )
        except Exception as exc:
            row["error"] = _err(exc)
        rows.append(row)
        print(row, flush=True)


def sync_check(res: dict, ctx: Ctx) -> None:
    import hybrid_cp as hcp
    from hybrid_cp.engine.heads import head_split
    from hybrid_cp.engine.layout import row_layout
    from hybrid_cp.engine.ring import RingCall, block_plan, ring_backward, ring_forward

    cp = res["_mesh"]
    rows = res.setdefault("sync", [])
    n, h, hkv, d = (8192, 16, 4, 128) if not ctx.dry else (256, 4, 2, 16)
    dtype = torch.bfloat16
    q, dout = (torch.randn(1, n, h, d, device=ctx.dev, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, n, hkv, d, device=ctx.dev, dtype=dtype) for _ in range(2))
    kern = K.get_kernel("auto", ctx.dev, dtype, d)
    lay = row_layout(cp, local_len=n, seq_len=n, causal=True)
    plan = block_plan(lay, cp.ring_rank, True, ctx.dev)
    kv_index = head_split(h, hkv, 1).kv_index(0)

    def ring():
        rc = RingCall(cp, kern, plan, scale=d**-0.5)
        out, lse, halo = ring_forward(rc, q, k, v, kv_index)
        ring_backward(rc, dout, q, k, v, (out, lse), kv_index, halo)

    def call(**kw):
        def run():
            ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
            hcp.attention(ql, kl, vl, cp, causal=True, **kw).backward(dout)

        return run

    docs = [0, 3 * n // 8, 7 * n // 8, n]
    checks = [
        (f"ring_forward + ring_backward ({kern.name}, causal, {n} tokens)", ring),
        ("hcp.attention forward + backward (dense causal)", call(seq_len=n)),
        (f"hcp.attention forward + backward (packed, cu_seqlens={docs})", call(cu_seqlens=docs)),
    ]
    for label, fn in checks:
        row = {"check": label}
        try:
            fn()  # warm-up: kernel choice, self-test, plans and caches
            if ctx.dev.type != "cuda":
                row["result"] = "ran (the sync check itself needs CUDA)"
                rows.append(row)
                continue
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                row["result"] = "no host sync"
            except RuntimeError as exc:
                row["result"] = f"host sync: {_err(exc)}"
                row["where"] = traceback.format_exc(limit=-4)[-1500:]
            finally:
                torch.cuda.set_sync_debug_mode(0)
        except Exception as exc:
            row["result"] = f"error: {_err(exc)}"
        rows.append(row)
        print({k: v for k, v in row.items() if k != "where"}, flush=True)


# ---- 8. a training step's peak against the planner ----------------------------------------------------------------


def memory(res: dict, ctx: Ctx) -> None:
    import memory_step as ms

    rows = res.setdefault("memory", [])
    shape = (
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
        )
        if ctx.dry
        else dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        )
    )  # Llama-3-8B's layer
    tile = 256 if ctx.dry else 8192
    opts = dict(
        layers=2, checkpoint=True, offload=True, tiled_norm=tile, tiled_mlp=tile, tiled_loss=True, head_chunks=4
    )
    for n in (1024, 2048) if ctx.dry else (131072, 262144):
        row = {"tokens": n}
        try:
            if ctx.out_of_time():
                row["skipped"] = "time budget"
            else:
                if ctx.dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(ctx.dev)
                m = ms.measure(
                    u=1, r=1, seq_len=n, loss_chunk=512, device=ctx.dev.type, shape=shape, dtype="bf16", **opts
                )
                est = ms._estimate(1, 1, n, opts, shape, "bf16")
                reserved = torch.cuda.max_memory_reserved(ctx.dev) if ctx.dev.type == "cuda" else m["device_peak"]
                row.update(
                    measured_gib=m["device_peak"] / 2**30,
                    reserved_gib=reserved / 2**30,
                    estimate_gib=est.peak / 2**30,
                    ratio=est.peak / m["device_peak"],
                    phase=est.peak_phase,
                )
        except Exception as exc:
            row["error"] = _err(exc)
        rows.append(row)
        print(row, flush=True)
        _free(ctx.dev)


def _with_mesh(res: dict, ctx: Ctx, sections) -> None:
    """Run `sections` on a one-rank mesh (NCCL on a GPU, gloo on CPU), torn down afterwards."""
    import torch.distributed as dist

    import hybrid_cp as hcp

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if ctx.dev.type == "cuda" else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1
        )
        try:
            if ctx.dev.type == "cuda":
                torch.cuda.set_device(ctx.dev)
            res["_mesh"] = hcp.init_cp_mesh(1, 1, device=ctx.dev)
            for section in sections:
                _run(section, res, ctx)
        finally:
            res.pop("_mesh", None)
            dist.destroy_process_group()


# ---- running and writing ------------------------------------------------------------------------------------------


def _run(section, res: dict, ctx: Ctx) -> None:
    t = time.time()
    ctx.deadline = t + SECTION_LIMIT_S.get(section.__name__, float("inf"))
    try:
        section(res, ctx)
    except Exception:
        res.setdefault("errors", {})[section.__name__] = traceback.format_exc()
        print(traceback.format_exc(), flush=True)
    res.setdefault("seconds", {})[section.__name__] = round(time.time() - t, 1)
    print(f"{section.__name__}: {time.time() - t:.1f}s", flush=True)


def _fmt(x) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.1e}" if abs(x) < 0.01 else f"{x:.3g}" if abs(x) < 10 else f"{x:.0f}"
    return str(x).replace("|", "/")


def md_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of `rows` ([(key, header)] columns); rows that were skipped or failed get
    their reason in the first free column."""
    table = []
    for row in rows:
        cells = [_fmt(row[k]) if k in row else "" for k, _ in columns]
        note = row.get("skipped") or row.get("error")
        if note:
            i = next((j for j, (k, _) in enumerate(columns) if k not in row), len(cells) - 1)
            cells[i] = ("skipped: " if "skipped" in row else "error: ") + _fmt(note)
        table.append(cells)
    return format_table([h for _, h in columns], table, markdown=True)


def markdown(res: dict) -> str:
    env_ = res.get("env", {})
    out = ["# GPU check (`benchmarks/gpu_check.py`)", ""]
    out += [
        f"- {k}: {_fmt(v) if not isinstance(v, dict) else ', '.join(f'{a}: {b}' for a, b in v.items())}"
        for k, v in env_.items()
    ]
    out += [
        "",
        "## Parity against fp64 math (max |err| / max |ref|)",
        "",
        md_table(
            [{**r, "pass": "yes" if r["pass"] else "**NO**"} if "pass" in r else r for r in res.get("parity", [])],
            [
                ("kernel", "kernel"),
                ("dtype", "dtype"),
                ("D", "D"),
                ("case", "case"),
                ("out", "out"),
                ("lse", "lse"),
                ("dq", "dq"),
                ("dk", "dk"),
                ("dv", "dv"),
                ("pass", "within self-test tolerance"),
            ],
        ),
    ]
    out += ["", "## Throughput (TFLOP/s, best / median; bf16, H=32, H_kv=8, D=128)", ""]
    rows = [
        {
            **r,
            "fwd": f"{r['fwd_tflops_best']:.0f} / {r['fwd_tflops_median']:.0f}",
            "bwd": f"{r['bwd_tflops_best']:.0f} / {r['bwd_tflops_median']:.0f}",
        }
        if "fwd_tflops_best" in r
        else r
        for r in res.get("throughput", [])
    ]
    out.append(
        md_table(
            rows,
            [
                ("kernel", "kernel"),
                ("tokens", "tokens per ring block"),
                ("block", "block"),
                ("fwd", "forward"),
                ("bwd", "backward"),
            ],
        )
    )
    if "merge" in res:
        m = res["merge"]
        out += ["", f"fp32 merge of one {m['tokens']}-token block: {m['ms_best']:.2f} ms (median {m['ms_median']:.2f})"]
    out += [
        "",
        "## Ring schedule efficiency on one GPU (one fused call / r blocks with merge; limit 1.0)",
        "",
        md_table(
            res.get("schedule", []),
            [
                ("kernel", "kernel"),
                ("tokens_per_block", "tokens per block"),
                ("r", "r"),
                ("fwd_ring_ms", "fwd ring ms"),
                ("fwd_fused_ms", "fwd fused ms"),
                ("fwd_efficiency", "fwd eff."),
                ("bwd_ring_ms", "bwd ring ms"),
                ("bwd_fused_ms", "bwd fused ms"),
                ("bwd_efficiency", "bwd eff."),
            ],
        ),
    ]
    out += [
        "",
        "## Linear-layer kernels against transformers' torch reference (max relative error)",
        "",
        md_table(
            res.get("linear", []),
            [
                ("family", "layer"),
                ("kernel", "kernel"),
                ("dtype", "dtype"),
                ("case", "case"),
                ("out", "outputs"),
                ("grad", "gradients"),
                ("worst_grad", "worst gradient"),
            ],
        ),
    ]
    out += [
        "",
        "## hcp.attention on a one-rank mesh against fp64 math",
        "",
        md_table(
            res.get("engine", []),
            [
                ("dtype", "dtype"),
                ("n", "n"),
                ("causal", "causal"),
                ("kernel", "auto picked"),
                ("out", "out"),
                ("lse", "lse"),
                ("dq", "dq"),
                ("dk", "dk"),
                ("dv", "dv"),
            ],
        ),
    ]
    out += [
        "",
        "## Host syncs (torch.cuda.set_sync_debug_mode('error') after warm-up)",
        "",
        md_table(res.get("sync", []), [("check", "check"), ("result", "result")]),
    ]
    out += [
        "",
        "## A training step's peak against the planner (Llama-3-8B layers x 2, bf16, every ladder option)",
        "",
        md_table(
            res.get("memory", []),
            [
                ("tokens", "tokens"),
                ("measured_gib", "allocated peak GiB"),
                ("reserved_gib", "reserved peak GiB"),
                ("estimate_gib", "estimate GiB"),
                ("ratio", "estimate / allocated"),
                ("phase", "estimate's peak phase"),
            ],
        ),
    ]
    if res.get("errors"):
        out += ["", "## Section errors", ""] + [
            f"- {k}: `{v.strip().splitlines()[-1]}`" for k, v in res["errors"].items()
        ]
    out += ["", "Seconds per section: " + ", ".join(f"{k} {v}" for k, v in res.get("seconds", {}).items())]
    return "\n".join(out) + "\n"


def write(res: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    jp, mp = os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.md")
    with open(jp, "w") as f:
        json.dump({k: v for k, v in res.items() if not k.startswith("_")}, f, indent=1, default=str)
    with open(mp, "w") as f:
        f.write(markdown(res))
    return jp, mp


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or os.path.join("benchmarks", "results"),
        help="directory for gpu_check.json and gpu_check.md (default: $OUT, else benchmarks/results)",
    )
    p.add_argument("--dry-run", action="store_true", help="run on CPU at tiny shapes (checks the script, no GPU)")
    p.add_argument(
        "--budget",
        type=float,
        default=400.0,
        help="seconds after which remaining measurements are skipped and recorded as such "
        "(each section also has its own limit, SECTION_LIMIT_S)",
    )
    p.add_argument(
        "--sections",
        default="env,parity,throughput,schedule,linear,engine,sync,memory",
        help="comma-separated subset of env,parity,throughput,schedule,linear,engine,sync,memory",
    )
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run to check the script on CPU")
    ctx = Ctx(
        torch.device("cpu") if a.dry_run else torch.device("cuda", torch.cuda.current_device()), a.dry_run, a.budget
    )
    wanted = set(a.sections.split(","))
    res: dict = {}
    for section in (env, parity, throughput, schedule, linear):
        if section.__name__ in wanted:
            _run(section, res, ctx)
    mesh_sections = [s for name, s in (("engine", engine), ("sync", sync_check), ("memory", memory)) if name in wanted]
    if mesh_sections:
        try:
            _with_mesh(res, ctx, mesh_sections)
        except Exception:
            res.setdefault("errors", {})["mesh"] = traceback.format_exc()
    res["total_seconds"] = round(time.time() - ctx.t0, 1)
    jp, mp = write(res, a.out)
    print(f"wrote {jp} and {mp} ({res['total_seconds']} s)", flush=True)
    return res


if __name__ == "__main__":
    main()
