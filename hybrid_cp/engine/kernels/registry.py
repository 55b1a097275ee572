"""Which kernel runs a call: the registry of named kernels and the choice behind backend="auto".

"auto" on CUDA takes the first of CUDA_AUTO_ORDER that supports the inputs, takes the keywords the
call needs and passes its self-test on this GPU (chosen once per GPU, dtype, head_dim and needed
keywords, and said once in the "hybrid_cp" log); on CPU it is sdpa, then math.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterable, Mapping

import torch

from ...errors import ConfigError, InputTypeError
from ._cuda import device_index
from .cudnn import CuDNNKernel
from .fa4 import FA4Kernel
from .flash import FlashAttnKernel
from .math import MathKernel
from .protocol import AttentionKernel, can_on
from .sdpa import SDPAKernel
from .selftest import cached_self_test
from .torch_flash import TorchFlashKernel

_REGISTRY: dict[str, AttentionKernel] = {}
_VERSION = [0]  # registrations so far: a checked call pattern holds for one registry state (`registry_version`)


def register_kernel(name: str, kernel: AttentionKernel, *, overwrite: bool = False) -> None:
    """Make `kernel` selectable as `hcp.attention(..., backend=name)`.

    Args:
        name: The backend name.
        kernel: An object with the `AttentionKernel` interface (`name`, `supports`, `forward`, `backward`).
        overwrite: Replace a kernel already registered under `name`.

    Raises:
        InputTypeError: `name` is not a non-empty str, or `kernel` lacks the interface.
        ConfigError: `name` is taken (without `overwrite`).
    """
    if not isinstance(name, str) or not name:
        raise InputTypeError(f"name={name!r} must be a non-empty str: backend=name selects the kernel")
    if not isinstance(kernel, AttentionKernel):
        raise InputTypeError(f"kernel {kernel!r} must provide name, supports(), forward() and backward()")
    if name in _REGISTRY and not overwrite:
        raise ConfigError(f"a kernel named {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = kernel
    _VERSION[0] += 1


def registry_version() -> int:
    """How many registrations the registry has seen (a new one may change what a backend name resolves to)."""
    return _VERSION[0]


def available_kernels() -> list[str]:
    """The registered kernel names (usable as `backend=`), sorted; whether one runs on given inputs is
    `get_kernel`'s question."""
    return sorted(_REGISTRY)


def registered_kernels() -> dict[str, AttentionKernel]:
    """{name: kernel} of every registered kernel, whether or not it can run here (a copy)."""
    return dict(_REGISTRY)


def kernel_needs(cu_seqlens, window, softcap=None, value_head_dim: bool = False) -> list[str]:
    """The kernel keywords a call passes beyond the dense ones, and the capabilities it needs
    (protocol.CAPABILITIES): what "auto" must find a kernel for."""
    return [
        kw
        for needed, kw in (
            (cu_seqlens is not None, "cu_seqlens_q"),
            (window is not None, "window"),
            (softcap is not None, "softcap"),
            (value_head_dim, "value_head_dim"),
        )
        if needed
    ]


def kernels_that_can(need: str, device: torch.device) -> list[str]:
    """The registered kernels that take keyword (or declare capability) `need` on this device type."""
    return [name for name, kernel in sorted(_REGISTRY.items()) if can_on(kernel, need, device)]


def get_kernel(
    backend: str | AttentionKernel,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    needs: Iterable[str] = (),
) -> AttentionKernel:
    """Resolve `backend` ("auto", a registered name, or a kernel object) for these inputs.

    Raises instead of falling back when a named backend cannot run the inputs. `needs` names the
    keywords the call will pass (e.g. "window", "cu_seqlens_q"): "auto" then skips kernels that
    do not take them (named backends are checked by the caller, which says which keyword is missing).

    Args:
        backend: "auto", a registered name, or a kernel object.
        device: The inputs' device.
        dtype: The inputs' dtype.
        head_dim: The inputs' head dim.
        needs: Keywords the call will pass to the kernel.

    Returns:
        The kernel that runs the call.

    Raises:
        ConfigError: An unknown backend, or a named one that cannot run these inputs.
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
        raise ConfigError(
            f"backend={backend!r} is not a registered attention kernel; use 'auto' or one of {available_kernels()}"
        )
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

Probe = Callable[[AttentionKernel, torch.device, torch.dtype, int], None]


def select_kernel(
    order: Iterable[str],
    kernels: Mapping[str, AttentionKernel],
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    probe: Probe | None = None,
    needs: Iterable[str] = (),
) -> tuple[str, list[tuple[str, str]]]:
    """The first kernel of `order` that supports the inputs, takes the `needs` keywords and passes
    `probe` (which raises on failure); returns (its name, [(skipped name, reason), ...])."""
    skipped: list[tuple[str, str]] = []
    for name in order:
        kernel = kernels.get(name)
        reason = "not registered" if kernel is None else kernel.supports(device, dtype, head_dim)
        if reason is None:
            missing = [n for n in needs if not can_on(kernel, n, device)]
            if missing:
                reason = f"does not take the keyword(s) or capability {missing} this call needs"
        if reason is None and probe is not None:
            try:
                probe(kernel, device, dtype, head_dim)
            except Exception as exc:  # any failure of a kernel on this GPU disqualifies it, with the error
                reason = f"self-test failed: {type(exc).__name__}: {exc}"
        if reason is None:
            return name, skipped
        skipped.append((name, reason))
    raise ConfigError(
        f"no attention backend supports device={device}, dtype={dtype}, head_dim={head_dim}: "
        + "; ".join(f"{n}: {r}" for n, r in skipped)
    )


_AUTO: dict = {}  # (device index, dtype, head_dim, needs) -> chosen kernel name


def _auto_cuda(device: torch.device, dtype: torch.dtype, head_dim: int, needs: tuple[str, ...]) -> AttentionKernel:
    """The fastest kernel that runs these inputs on this GPU and passes its self-test; chosen once
    per (GPU, dtype, head_dim, needed keywords) and said once in the "hybrid_cp" log."""
    key = (device_index(device), dtype, head_dim, needs)
    if key not in _AUTO:
        name, skipped = select_kernel(
            CUDA_AUTO_ORDER,
            _REGISTRY,
            device,
            dtype,
            head_dim,
            probe=functools.partial(cached_self_test, needs=needs),
            needs=needs,
        )
        _AUTO[key] = name
        failed = any(r.startswith("self-test failed") for _, r in skipped)
        slow = name not in _FLASH_CLASS and dtype in (torch.float16, torch.bfloat16)
        logging.getLogger("hybrid_cp").log(
            logging.WARNING if failed or slow else logging.INFO,
            "backend='auto' picked %r for cuda:%d dtype=%s head_dim=%d%s; faster kernels skipped: %s",
            name,
            key[0],
            dtype,
            head_dim,
            f" needs={list(needs)}" if needs else "",
            "; ".join(f"{n}: {r}" for n, r in skipped) or "none",
        )
    return _REGISTRY[_AUTO[key]]


_WARNED: set = set()


def _warn_fallback(
    chosen: str, skipped: list[tuple[str, str]], device: torch.device, dtype: torch.dtype, head_dim: int
) -> None:
    """Warn once per input kind when "auto" had to skip a faster kernel (silently slower otherwise)."""
    key = (chosen, device.type, dtype, head_dim)
    if key in _WARNED:
        return
    _WARNED.add(key)
    logging.getLogger("hybrid_cp").warning(
        "backend='auto' falls back to %r for device=%s dtype=%s head_dim=%d (%s); expect it to be slower",
        chosen,
        device,
        dtype,
        head_dim,
        "; ".join(f"{n}: {r}" for n, r in skipped),
    )


register_kernel("math", MathKernel())
register_kernel("sdpa", SDPAKernel())
register_kernel("flash", FlashAttnKernel())
register_kernel("torch-flash", TorchFlashKernel())
register_kernel("cudnn", CuDNNKernel())
register_kernel("fa4", FA4Kernel())
