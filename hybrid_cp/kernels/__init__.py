"""Local attention kernels behind one interface.

A kernel computes exact attention on one block of queries against one block of keys:

    forward(q, k, v, *, causal, scale, **varlen) -> (out, lse)
    backward(dout, q, k, v, out, lse, *, causal, scale, **varlen) -> (dq, dk, dv)

q is [B, Sq, H, D]; k and v are [B, Sk, H_kv, D] with H % H_kv == 0 (query head h uses KV head
h // (H // H_kv)). out is [B, Sq, H, D] in q's dtype, lse is [B, H, Sq] in fp32 (natural log).
`causal` means the causal mask of a square block (query i sees keys 0..i).
Packed documents add `varlen` = cu_seqlens_q, cu_seqlens_k (int32 boundaries, flash-attn's
naming), max_seqlen_q, max_seqlen_k: q is then [1, total_q, H, D], k/v [1, total_k, H_kv, D], and
segment i is queries cu_seqlens_q[i]:[i+1] against keys cu_seqlens_k[i]:[i+1] (causal segments are
square). Sliding windows add `window` = (left, right): flash-attn's bottom-right aligned
window_size (key j visible to query i iff -left <= j - i - (Sk - Sq) <= right; -1 unbounded).
Kernels without packed or window support need not take these keywords: the engine passes them
only when a call needs them, and says so if a kernel refuses them.
`backward` receives the *final* out and lse of the whole attention (not of this block), which is
what makes a block's gradient exact in ring attention. dk/dv come back with H_kv heads.

Registered kernels: math (reference, any dtype), sdpa (PyTorch's CPU flash / CUDA memory-efficient
operators), flash (flash-attn 2/3 if installed), torch-flash (PyTorch's own FlashAttention-2
operators), cudnn (cuDNN attention), fa4 (FlashAttention-4 if installed). backend="auto" on CUDA
takes the first of CUDA_AUTO_ORDER that supports the inputs and passes `self_test` on this GPU
(once per GPU, dtype and head_dim; said once in the "hybrid_cp" log); on CPU it is sdpa, then math.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Protocol, runtime_checkable

import torch

from .cudnn import CuDNNKernel
from .fa4 import FA4Kernel
from .flash import FlashAttnKernel
from .math import MathKernel
from .sdpa import SDPAKernel
from .torch_flash import TorchFlashKernel
from ..errors import ConfigError, InputTypeError


@runtime_checkable
class AttentionKernel(Protocol):
    name: str

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None if the kernel can run these inputs, else the reason it cannot."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                scale: float, **varlen) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                 scale: float, **varlen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


_REGISTRY: dict[str, AttentionKernel] = {}


def register_kernel(name: str, kernel: AttentionKernel, *, overwrite: bool = False) -> None:
    """Make `kernel` selectable as `hcp.attention(..., backend=name)`."""
    if not isinstance(kernel, AttentionKernel):
        raise InputTypeError(f"kernel {kernel!r} must provide name, supports(), forward() and backward()")
    if name in _REGISTRY and not overwrite:
        raise ConfigError(f"a kernel named {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = kernel


def available_kernels() -> list[str]:
    return sorted(_REGISTRY)


def get_kernel(backend: str | AttentionKernel, device: torch.device, dtype: torch.dtype,
               head_dim: int, *, needs: Iterable[str] = ()) -> AttentionKernel:
    """Resolve `backend` ("auto", a registered name, or a kernel object) for these inputs.

    Raises instead of falling back when a named backend cannot run the inputs. `needs` names the
    keywords the call will pass (e.g. "window", "cu_seqlens_q"): "auto" then skips kernels that
    do not take them (named backends are checked by the caller, which says which keyword is missing).
    """
    if isinstance(backend, AttentionKernel) and not isinstance(backend, str):
        kernel = backend
    elif backend == "auto":
        if device.type == "cuda":
            return _auto_cuda(device, dtype, head_dim, tuple(sorted(needs)))
        name, skipped = select_kernel(("sdpa", "math"), _REGISTRY, device, dtype, head_dim, needs=needs)
        if skipped and dtype != torch.float64:  # fp64 has no fast kernel anywhere
            _warn_fallback(name, skipped, device, dtype, head_dim)
        return _REGISTRY[name]
    elif isinstance(backend, str) and backend in _REGISTRY:
        kernel = _REGISTRY[backend]
    else:
        raise ConfigError(f"backend={backend!r} is not a registered attention kernel; "
                         f"use 'auto' or one of {available_kernels()}")
    reason = kernel.supports(device, dtype, head_dim)
    if reason is not None:
        raise ConfigError(f"backend={getattr(kernel, 'name', backend)!r} cannot run these inputs: {reason}")
    return kernel


# "auto" on CUDA, fastest first, by published bf16/fp16 D=128 rates on H100 (TFLOP/s, forward; backward
# in brackets):
# - fa4: FlashAttention-4 (CuTe DSL) is written for Hopper and Blackwell; on Hopper it is FA3-class,
#   460-572 forward with GQA against 225 for FA2 in the same runs (flash-attention repository,
#   flash_attn/cute benchmarks).
# - flash: flash-attn 3 reaches up to 740 forward in fp16 (FA3 paper, arXiv 2407.08608); flash-attn 2
#   309-370 non-causal, 191-335 causal [214-322] (FA3 paper's FA2 baseline). It is an explicit install,
#   so it outranks the built-in kernels; on Hopper, flash-attn 2 can lose to cudnn (gpu_check measures it).
# - cudnn: cuDNN 9 attention 497-617 non-causal, 315-539 causal [305-518] (FA3 paper, arXiv
#   2407.08608, its cuDNN baseline): FA3-class on Hopper, in every CUDA build of PyTorch.
# - torch-flash: PyTorch's own FlashAttention-2, i.e. the FA2 rates above (FA2 paper, arXiv 2307.08691).
# - sdpa: the memory-efficient operator, measured 160-181 [125-140] on our H200 (docs/benchmarks.md).
# - math: materialises the score matrix; the reference, for any dtype.
CUDA_AUTO_ORDER: tuple[str, ...] = ("fa4", "flash", "cudnn", "torch-flash", "sdpa", "math")
_FLASH_CLASS = {"fa4", "flash", "cudnn", "torch-flash"}

# Largest accepted max |kernel - fp32 math| / max |fp32 math| in the self-test, per dtype: a few
# times the rounding of the dtype; wrong masks, layouts or strides give errors of order 1.
SELF_TEST_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-3, torch.float64: 1e-9}


# Shapes of the checks: "small" for the one-time self-test of "auto" (milliseconds on a GPU),
# "large" for benchmarks/gpu_check.py. Lengths deliberately not multiples of 128.
CHECK_SIZES = {
    "small": dict(batch=2, heads=4, kv_heads=2, split=(200, 136), rect=(72, 264), seg_q=[37, 130, 61],
                  seg_k=[50, 20, 90], window_sq=200, window=(40, 0), window_rect=(150, 200, (30, 20))),
    "large": dict(batch=1, heads=8, kv_heads=2, split=(1088, 1000), rect=(1000, 2048), seg_q=[300, 517, 271],
                  seg_k=[200, 100, 600], window_sq=1088, window=(256, 0), window_rect=(1000, 1088, (128, 64))),
}


def kernel_errors(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                  size: str = "small", ref_dtype: torch.dtype = torch.float32):
    """Yield (case, {"out"|"lse"|"dq"|"dk"|"dv": max |kernel - math| / max |math|}) for the blocks the
    ring asks of a kernel, the reference being the math kernel in `ref_dtype` on the same inputs.

    Cases: a rectangular non-causal block and a causal square block whose results merge
    (ring.merge_) into one out/lse, then each block's backward with that merged out/lse (through a
    non-contiguous lse view, as the ring passes it); a block with fewer queries than keys; GQA;
    lengths that are not multiples of 128; packed segments and windows when the kernel takes them.
    Inputs are drawn in fp32 on the CPU and rounded to `dtype`, so the reference sees exactly the
    kernel's inputs. A shape mismatch raises AssertionError.
    """
    from ..ring import merge_  # ring imports kernels for typing only; imported here to keep the order simple

    cfg = CHECK_SIZES[size]
    ref = MathKernel()
    gen = torch.Generator().manual_seed(1234)
    b, h, hkv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], head_dim
    scale = d ** -0.5

    def rand(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def up(*xs):
        return tuple(x.to(ref_dtype) for x in xs)

    def errors(case: str, got, want) -> dict:
        errs = {}
        for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            if a.shape != w.shape:
                raise AssertionError(f"{case}: {name} has shape {tuple(a.shape)}, expected {tuple(w.shape)}")
            errs[name] = ((a.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
        return errs

    def one_block(case: str, q, k, v, dout, **kw) -> dict:
        out, lse = kernel.forward(q, k, v, scale=scale, **kw)
        grads = kernel.backward(dout, q, k, v, out, lse, scale=scale, **kw)
        ro, rl = ref.forward(*up(q, k, v), scale=scale, **kw)
        rg = ref.backward(*up(dout, q, k, v), ro, rl, scale=scale, **kw)
        return errors(case, (out, lse) + tuple(grads), (ro, rl) + tuple(rg))

    # 1. the ring's split: sq queries against sp earlier keys (full) and their own sq keys (causal)
    sq, sp = cfg["split"]
    q = rand(b, sq + 8, h, d)[:, 4:4 + sq]  # a non-contiguous row slice, as the ring takes it
    dout = rand(b, sq, h, d)
    k, v = rand(b, sp + sq, hkv, d), rand(b, sp + sq, hkv, d)
    blocks = [(slice(0, sp), False), (slice(sp, sp + sq), True)]
    out = torch.zeros(b, sq, h, d, dtype=torch.float32, device=device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=device)
    for rows, causal in blocks:
        o_b, l_b = kernel.forward(q, k[:, rows], v[:, rows], causal=causal, scale=scale)
        merge_(out, lse, o_b, l_b.float())
    out = out.to(dtype)
    lse_view = torch.cat([lse, lse], 2)[:, :, :sq]  # non-contiguous, like the ring's row slices
    dq = torch.zeros(b, sq, h, d, dtype=torch.float32, device=device)
    dks, dvs = [], []
    for rows, causal in blocks:
        g_q, g_k, g_v = kernel.backward(dout, q, k[:, rows], v[:, rows], out, lse_view, causal=causal, scale=scale)
        dq += g_q.float()
        dks.append(g_k)
        dvs.append(g_v)
    ro, rl = ref.forward(*up(q, k, v), causal=False, scale=scale, window=(-1, 0))  # bottom-right causal
    rg = ref.backward(*up(dout, q, k, v), ro, rl, causal=False, scale=scale, window=(-1, 0))
    case = f"merged split blocks ({sq}x{sp} full + {sq}x{sq} causal)"
    yield case, errors(case, (out, lse, dq, torch.cat(dks, 1), torch.cat(dvs, 1)), (ro, rl) + tuple(rg))

    # 2. fewer queries than keys (the other zigzag off-diagonal shape)
    nq, nk = cfg["rect"]
    case = f"rectangular {nq}x{nk} non-causal"
    yield case, one_block(case, rand(b, nq, h, d), rand(b, nk, hkv, d), rand(b, nk, hkv, d), rand(b, nq, h, d),
                          causal=False)

    # 3. packed documents and 4. windows, when the kernel takes them
    if takes_keyword_on(kernel, "cu_seqlens_q", device):
        def cu(lens):
            return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)

        seg_q = cfg["seg_q"]
        for causal, seg_k in ((True, seg_q), (False, cfg["seg_k"])):
            kw = dict(cu_seqlens_q=cu(seg_q), cu_seqlens_k=cu(seg_k), max_seqlen_q=max(seg_q),
                      max_seqlen_k=max(seg_k))
            case = f"packed segments {seg_q} x {seg_k} causal={causal}"
            yield case, one_block(case, rand(1, sum(seg_q), h, d), rand(1, sum(seg_k), hkv, d),
                                  rand(1, sum(seg_k), hkv, d), rand(1, sum(seg_q), h, d), causal=causal, **kw)
    if takes_keyword_on(kernel, "window", device):
        n, (wq, wk, wrect) = cfg["window_sq"], cfg["window_rect"]
        case = f"window {cfg['window']} causal {n}x{n}"
        yield case, one_block(case, rand(b, n, h, d), rand(b, n, hkv, d), rand(b, n, hkv, d), rand(b, n, h, d),
                              causal=True, window=cfg["window"])
        case = f"window {wrect} {wq}x{wk}"
        yield case, one_block(case, rand(b, wq, h, d), rand(b, wk, hkv, d), rand(b, wk, hkv, d), rand(b, wq, h, d),
                              causal=False, window=wrect)


def self_test(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Check `kernel` against fp32 math on the small cases of `kernel_errors`; raise AssertionError
    naming the first case and output whose relative error exceeds SELF_TEST_TOL[dtype] (or is NaN)."""
    tol = SELF_TEST_TOL.get(dtype, 3e-2)
    # the caller may be inside autocast (which would run the fp32 reference in bf16) or autograd
    with torch.autocast(device.type, enabled=False), torch.no_grad():
        for case, errs in kernel_errors(kernel, device, dtype, head_dim):
            for name, err in errs.items():
                if not err <= tol:  # NaN fails too
                    raise AssertionError(f"{case}: {name} relative error {err:.2e} > {tol:.0e} "
                                         f"({dtype}, D={head_dim})")


Probe = Callable[[AttentionKernel, torch.device, torch.dtype, int], None]


def select_kernel(order: Iterable[str], kernels: Mapping[str, AttentionKernel], device: torch.device,
                  dtype: torch.dtype, head_dim: int, *, probe: Probe | None = None,
                  needs: Iterable[str] = ()) -> tuple[str, list[tuple[str, str]]]:
    """The first kernel of `order` that supports the inputs, takes the `needs` keywords and passes
    `probe` (which raises on failure); returns (its name, [(skipped name, reason), ...])."""
    skipped: list[tuple[str, str]] = []
    for name in order:
        kernel = kernels.get(name)
        reason = "not registered" if kernel is None else kernel.supports(device, dtype, head_dim)
        if reason is None:
            missing = [n for n in needs if not takes_keyword_on(kernel, n, device)]
            if missing:
                reason = f"does not take the keyword(s) {missing} this call needs"
        if reason is None and probe is not None:
            try:
                probe(kernel, device, dtype, head_dim)
            except Exception as exc:  # any failure of a kernel on this GPU disqualifies it, with the error
                reason = f"self-test failed: {type(exc).__name__}: {exc}"
        if reason is None:
            return name, skipped
        skipped.append((name, reason))
    raise ConfigError(f"no attention backend supports device={device}, dtype={dtype}, head_dim={head_dim}: "
                     + "; ".join(f"{n}: {r}" for n, r in skipped))


_AUTO: dict = {}        # (device index, dtype, head_dim, needs) -> chosen kernel name
_SELF_TESTS: dict = {}  # (kernel name, device index, dtype, head_dim) -> None (passed) or the exception


def _device_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    try:
        return torch.cuda.current_device()
    except Exception:  # a CPU-only build (tests use explicit indices)
        return 0


def _cached_self_test(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """`self_test` once per (kernel, GPU, dtype, head_dim); the math kernel is the reference itself."""
    if isinstance(kernel, MathKernel):
        return
    key = (getattr(kernel, "name", type(kernel).__name__), _device_index(device), dtype, head_dim)
    if key not in _SELF_TESTS:
        try:
            self_test(kernel, torch.device("cuda", key[1]) if device.type == "cuda" else device, dtype, head_dim)
            _SELF_TESTS[key] = None
        except Exception as exc:
            _SELF_TESTS[key] = exc
    if _SELF_TESTS[key] is not None:
        raise _SELF_TESTS[key]


def _auto_cuda(device: torch.device, dtype: torch.dtype, head_dim: int, needs: tuple[str, ...]) -> AttentionKernel:
    """The fastest kernel that runs these inputs on this GPU and passes its self-test; chosen once
    per (GPU, dtype, head_dim, needed keywords) and said once in the "hybrid_cp" log."""
    key = (_device_index(device), dtype, head_dim, needs)
    if key not in _AUTO:
        name, skipped = select_kernel(CUDA_AUTO_ORDER, _REGISTRY, device, dtype, head_dim,
                                      probe=_cached_self_test, needs=needs)
        _AUTO[key] = name
        failed = any(r.startswith("self-test failed") for _, r in skipped)
        slow = name not in _FLASH_CLASS and dtype in (torch.float16, torch.bfloat16)
        logging.getLogger("hybrid_cp").log(
            logging.WARNING if failed or slow else logging.INFO,
            "backend='auto' picked %r for cuda:%d dtype=%s head_dim=%d%s; faster kernels skipped: %s",
            name, key[0], dtype, head_dim, f" needs={list(needs)}" if needs else "",
            "; ".join(f"{n}: {r}" for n, r in skipped) or "none")
    return _REGISTRY[_AUTO[key]]


_WARNED: set = set()


def _warn_fallback(chosen: str, skipped: list[tuple[str, str]], device: torch.device, dtype: torch.dtype,
                   head_dim: int) -> None:
    """Warn once per input kind when "auto" had to skip a faster kernel (silently slower otherwise)."""
    key = (chosen, device.type, dtype, head_dim)
    if key in _WARNED:
        return
    _WARNED.add(key)
    logging.getLogger("hybrid_cp").warning(
        "backend='auto' falls back to %r for device=%s dtype=%s head_dim=%d (%s); expect it to be slower",
        chosen, device, dtype, head_dim, "; ".join(f"{n}: {r}" for n, r in skipped))


def takes_keyword_on(kernel: AttentionKernel, name: str, device: torch.device) -> bool:
    """`takes_keyword`, less the keywords the kernel refuses on this device type (an optional
    `refuses = {device_type: (names...)}` attribute: sdpa takes windows on CPU only)."""
    return takes_keyword(kernel, name) and name not in getattr(kernel, "refuses", {}).get(device.type, ())


def takes_keyword(kernel: AttentionKernel, name: str) -> bool:
    """Whether the kernel's forward and backward accept keyword `name` (e.g. "cu_seqlens_q", "window")."""
    import inspect

    def ok(fn) -> bool:
        params = inspect.signature(fn).parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return ok(kernel.forward) and ok(kernel.backward)


register_kernel("math", MathKernel())
register_kernel("sdpa", SDPAKernel())
register_kernel("flash", FlashAttnKernel())
register_kernel("torch-flash", TorchFlashKernel())
register_kernel("cudnn", CuDNNKernel())
register_kernel("fa4", FA4Kernel())

__all__ = ["AttentionKernel", "register_kernel", "get_kernel", "available_kernels", "takes_keyword",
           "takes_keyword_on", "self_test",
           "kernel_errors",
           "select_kernel", "CUDA_AUTO_ORDER", "MathKernel", "SDPAKernel", "FlashAttnKernel", "TorchFlashKernel",
           "CuDNNKernel", "FA4Kernel"]
