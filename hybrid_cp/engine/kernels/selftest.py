"""The kernels' self-test: a kernel's results on the blocks the ring asks of it, against the math kernel.

backend="auto" on CUDA uses a kernel only after it passes `self_test` on this GPU (once per GPU,
dtype and head_dim: `cached_self_test`); benchmarks/gpu_check.py runs the "large" cases of
`kernel_errors` and reports the errors themselves.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch

from ._cuda import device_index
from .math import MathKernel
from .merge import merge_
from .protocol import AttentionKernel, takes_keyword_on

# Largest accepted max |kernel - fp32 math| / max |fp32 math| in the self-test, per dtype: a few
# times the rounding of the dtype; wrong masks, layouts or strides give errors of order 1.
SELF_TEST_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-3, torch.float64: 1e-9}


# Shapes of the checks: "small" for the one-time self-test of "auto" (milliseconds on a GPU),
# "large" for benchmarks/gpu_check.py. Lengths deliberately not multiples of 128.
CHECK_SIZES = {
    "small": dict(
        batch=2,
        heads=4,
        kv_heads=2,
        split=(200, 136),
        rect=(72, 264),
        seg_q=[37, 130, 61],
        seg_k=[50, 20, 90],
        window_sq=200,
        window=(40, 0),
        window_rect=(150, 200, (30, 20)),
    ),
    "large": dict(
        batch=1,
        heads=8,
        kv_heads=2,
        split=(1088, 1000),
        rect=(1000, 2048),
        seg_q=[300, 517, 271],
        seg_k=[200, 100, 600],
        window_sq=1088,
        window=(256, 0),
        window_rect=(1000, 1088, (128, 64)),
    ),
}

Case = tuple[str, dict[str, float]]


def relative_errors(case: str, got, want) -> dict[str, float]:
    """{"out"|"lse"|"dq"|"dk"|"dv": max |got - want| / max |want|}; a shape mismatch raises AssertionError."""
    errs = {}
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if a.shape != w.shape:
            raise AssertionError(f"{case}: {name} has shape {tuple(a.shape)}, expected {tuple(w.shape)}")
        errs[name] = ((a.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
    return errs


class _Cases:
    """The cases of `kernel_errors` for one kernel and input kind, drawing every input from one seeded
    generator in a fixed order (so a case's inputs do not depend on which kernel is checked before it)."""

    def __init__(
        self,
        kernel: AttentionKernel,
        device: torch.device,
        dtype: torch.dtype,
        head_dim: int,
        cfg: dict,
        ref_dtype: torch.dtype,
    ):
        self.kernel, self.ref, self.cfg = kernel, MathKernel(), cfg
        self.device, self.dtype, self.ref_dtype = device, dtype, ref_dtype
        self.gen = torch.Generator().manual_seed(1234)
        self.b, self.h, self.hkv, self.d = cfg["batch"], cfg["heads"], cfg["kv_heads"], head_dim
        self.scale = head_dim**-0.5

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=self.dtype)

    def reference(self, dout, q, k, v, **kw) -> tuple:
        """(out, lse, dq, dk, dv) of the math kernel in `ref_dtype` on the same inputs."""
        dout, q, k, v = (x.to(self.ref_dtype) for x in (dout, q, k, v))
        out, lse = self.ref.forward(q, k, v, scale=self.scale, **kw)
        return (out, lse) + tuple(self.ref.backward(dout, q, k, v, out, lse, scale=self.scale, **kw))

    def one_block(self, case: str, nq: int, nk: int, batch: int | None = None, **kw) -> Case:
        """One kernel call forward and backward on fresh [batch, nq] queries against [batch, nk] keys."""
        b = self.b if batch is None else batch
        q = self.rand(b, nq, self.h, self.d)
        k, v = self.rand(b, nk, self.hkv, self.d), self.rand(b, nk, self.hkv, self.d)
        dout = self.rand(b, nq, self.h, self.d)
        out, lse = self.kernel.forward(q, k, v, scale=self.scale, **kw)
        grads = self.kernel.backward(dout, q, k, v, out, lse, scale=self.scale, **kw)
        return case, relative_errors(case, (out, lse) + tuple(grads), self.reference(dout, q, k, v, **kw))

    def merged_split_blocks(self) -> Case:
        """The ring's split: sq queries against sp earlier keys (full) and their own sq keys (causal),
        merged into one out/lse, then each block's backward with that merged out/lse."""
        sq, sp = self.cfg["split"]
        b, h, hkv, d = self.b, self.h, self.hkv, self.d
        q = self.rand(b, sq + 8, h, d)[:, 4 : 4 + sq]  # a non-contiguous row slice, as the ring takes it
        dout = self.rand(b, sq, h, d)
        k, v = self.rand(b, sp + sq, hkv, d), self.rand(b, sp + sq, hkv, d)
        blocks = [(slice(0, sp), False), (slice(sp, sp + sq), True)]
        out = torch.zeros(b, sq, h, d, dtype=torch.float32, device=self.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=self.device)
        for rows, causal in blocks:
            o_b, l_b = self.kernel.forward(q, k[:, rows], v[:, rows], causal=causal, scale=self.scale)
            merge_(out, lse, o_b, l_b.float())
        out = out.to(self.dtype)
        lse_view = torch.cat([lse, lse], 2)[:, :, :sq]  # non-contiguous, like the ring's row slices
        dq = torch.zeros(b, sq, h, d, dtype=torch.float32, device=self.device)
        dks, dvs = [], []
        for rows, causal in blocks:
            g_q, g_k, g_v = self.kernel.backward(
                dout, q, k[:, rows], v[:, rows], out, lse_view, causal=causal, scale=self.scale
            )
            dq += g_q.float()
            dks.append(g_k)
            dvs.append(g_v)
        want = self.reference(dout, q, k, v, causal=False, window=(-1, 0))  # bottom-right causal
        case = f"merged split blocks ({sq}x{sp} full + {sq}x{sq} causal)"
        return case, relative_errors(case, (out, lse, dq, torch.cat(dks, 1), torch.cat(dvs, 1)), want)

    def rectangular(self) -> Case:
        """Fewer queries than keys (the other zigzag off-diagonal shape)."""
        nq, nk = self.cfg["rect"]
        return self.one_block(f"rectangular {nq}x{nk} non-causal", nq, nk, causal=False)

    def packed_segments(self) -> Iterator[Case]:
        """Packed documents, causal (square segments) and not."""

        def cu(lens):
            return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=self.device)

        seg_q = self.cfg["seg_q"]
        for causal, seg_k in ((True, seg_q), (False, self.cfg["seg_k"])):
            kw = dict(cu_seqlens_q=cu(seg_q), cu_seqlens_k=cu(seg_k), max_seqlen_q=max(seg_q), max_seqlen_k=max(seg_k))
            yield self.one_block(
                f"packed segments {seg_q} x {seg_k} causal={causal}",
                sum(seg_q),
                sum(seg_k),
                batch=1,
                causal=causal,
                **kw,
            )

    def windows(self) -> Iterator[Case]:
        """A causal sliding window on a square block, and a two-sided window on a rectangular one."""
        n, window, (wq, wk, wrect) = self.cfg["window_sq"], self.cfg["window"], self.cfg["window_rect"]
        yield self.one_block(f"window {window} causal {n}x{n}", n, n, causal=True, window=window)
        yield self.one_block(f"window {wrect} {wq}x{wk}", wq, wk, causal=False, window=wrect)


def kernel_errors(
    kernel: AttentionKernel,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    size: str = "small",
    ref_dtype: torch.dtype = torch.float32,
) -> Iterator[Case]:
    """Yield (case, {"out"|"lse"|"dq"|"dk"|"dv": max |kernel - math| / max |math|}) for the blocks the
    ring asks of a kernel, the reference being the math kernel in `ref_dtype` on the same inputs.

    Cases: a rectangular non-causal block and a causal square block whose results merge
    (`merge_`) into one out/lse, then each block's backward with that merged out/lse (through a
    non-contiguous lse view, as the ring passes it); a block with fewer queries than keys; GQA;
    lengths that are not multiples of 128; packed segments and windows when the kernel takes them.
    Inputs are drawn in fp32 on the CPU and rounded to `dtype`, so the reference sees exactly the
    kernel's inputs. A shape mismatch raises AssertionError.
    """
    cases = _Cases(kernel, device, dtype, head_dim, CHECK_SIZES[size], ref_dtype)
    yield cases.merged_split_blocks()
    yield cases.rectangular()
    if takes_keyword_on(kernel, "cu_seqlens_q", device):
        yield from cases.packed_segments()
    if takes_keyword_on(kernel, "window", device):
        yield from cases.windows()


def softcap_errors(
    kernel: AttentionKernel,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    size: str = "small",
    ref_dtype: torch.dtype = torch.float32,
) -> Iterator[Case]:
    """`kernel_errors` for a logit soft-cap (Gemma 2): a causal square block and a rectangular one with
    softcap=1 (scores of order one, so the cap bends them), against the math kernel's soft-cap."""
    cases = _Cases(kernel, device, dtype, head_dim, CHECK_SIZES[size], ref_dtype)
    n, (nq, nk) = cases.cfg["window_sq"], cases.cfg["rect"]
    yield cases.one_block(f"softcap 1 causal {n}x{n}", n, n, causal=True, softcap=1.0)
    yield cases.one_block(f"softcap 1 {nq}x{nk} non-causal", nq, nk, causal=False, softcap=1.0)


def self_test(
    kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int, needs: tuple[str, ...] = ()
) -> None:
    """Check `kernel` against fp32 math on the small cases of `kernel_errors` (and `softcap_errors` when
    `needs` has "softcap"); raise AssertionError naming the first case and output whose relative error
    exceeds SELF_TEST_TOL[dtype] (or is NaN)."""
    tol = SELF_TEST_TOL.get(dtype, 3e-2)
    # the caller may be inside autocast (which would run the fp32 reference in bf16) or autograd
    with torch.autocast(device.type, enabled=False), torch.no_grad():
        every = kernel_errors(kernel, device, dtype, head_dim)
        if "softcap" in needs:
            every = itertools.chain(every, softcap_errors(kernel, device, dtype, head_dim))
        for case, errs in every:
            for name, err in errs.items():
                if not err <= tol:  # NaN fails too
                    raise AssertionError(f"{case}: {name} relative error {err:.2e} > {tol:.0e} ({dtype}, D={head_dim})")


_SELF_TESTS: dict = {}  # (kernel name, device index, dtype, head_dim[, "softcap"]) -> None (passed) or the exception


def cached_self_test(
    kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int, needs: tuple[str, ...] = ()
) -> None:
    """`self_test` once per (kernel, GPU, dtype, head_dim), raising its error again on every later call;
    a call that needs a soft-cap is a separate check with the soft-capped cases added (a kernel whose
    soft-cap fails stays usable without one). The math kernel is the reference itself."""
    if isinstance(kernel, MathKernel):
        return
    key = (getattr(kernel, "name", type(kernel).__name__), device_index(device), dtype, head_dim)
    extra = {"needs": ("softcap",)} if "softcap" in needs else {}
    key += tuple(extra.get("needs", ()))
    if key not in _SELF_TESTS:
        try:
            self_test(
                kernel, torch.device("cuda", key[1]) if device.type == "cuda" else device, dtype, head_dim, **extra
            )
            _SELF_TESTS[key] = None
        except Exception as exc:
            _SELF_TESTS[key] = exc
    if _SELF_TESTS[key] is not None:
        raise _SELF_TESTS[key]


def self_test_results() -> dict:
    """{(kernel name, device index, dtype, head_dim[, "softcap"]): None (passed) or the exception} of the
    self-tests run so far."""
    return dict(_SELF_TESTS)
