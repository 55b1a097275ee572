"""Exact peak memory of a training step, by stage, without a GPU.

`StorageTracker` is a `TorchDispatchMode` that sees every ATen operation and counts the bytes of
every tensor storage that is alive: a storage is counted from the first operation that produces or
reads it until the storage is freed (a weak-reference finaliser on PyTorch's preserved storage
object), so views are not counted twice and tensors kept alive by autograd (saved activations) are
counted exactly as long as they live. Resized storages (FSDP2's `resize_`) are re-measured whenever
an operation touches them. Not counted: scratch memory inside a kernel that never becomes a tensor
(for example a fused attention kernel's per-thread buffers) and allocator caching/fragmentation.

Stages: `mark_stages(model, tracker)` brackets each transformers decoder block's `self_attn` and `mlp`
in forward and backward (identity autograd markers, which allocate nothing), and `tracker.stage(name)`
brackets any region (e.g. the loss). For each stage the tracker reports the highest live total seen
inside it (`peak`) and the most it grew above its entry level (`transient`): the stage's own
intermediate memory. On CUDA, `CudaStageStats` gives the same report from the caching allocator's
statistics (`torch.cuda.max_memory_allocated`).

Device and host: `host_buffer(nbytes)` allocates the host memory that offloaded tensors live in
(`hybrid_cp.training.offload`); the tracker counts those storages as host bytes (`host_live`,
`host_peak`) and everything else as device-resident (`device_live`, `device_peak`), also on a CPU run,
where both are the same RAM: that is what lets a CPU test see the device-resident peak fall.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "StorageTracker",
    "PeakTensors",
    "StageStats",
    "mark_stages",
    "mark",
    "CudaStageStats",
    "host_buffer",
    "is_host",
]

_HOST: "weakref.WeakValueDictionary[int, torch.UntypedStorage]" = weakref.WeakValueDictionary()
_ALLOCATING_HOST = [0]  # > 0 while host_buffer allocates: a tracker counts what it sees then as host


def host_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` that trackers count as host memory (pinned when `pin`, for
    asynchronous copies to and from CUDA)."""
    _ALLOCATING_HOST[0] += 1
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
    finally:
        _ALLOCATING_HOST[0] -= 1
    st = buf.untyped_storage()
    _HOST[id(st)] = st
    return buf


def is_host(t: torch.Tensor) -> bool:
    """Whether `t` lives in a `host_buffer` (a view of one included)."""
    st = t.untyped_storage()
    return _HOST.get(id(st)) is st


@dataclass
class StageStats:
    """Peak live bytes while inside the stage, and the largest growth above the level at entry."""

    peak: int = 0
    transient: int = 0
    entries: int = 0


@dataclass
class _Open:
    name: str
    entry: int
    high: int


class _StageMixin:
    """Nested stage bookkeeping shared by the CPU (storage) and CUDA (allocator) trackers."""

    def _init_stages(self) -> None:
        self.stages: dict[str, StageStats] = {}
        self._open: list[_Open] = []

    def _level(self) -> int:
        raise NotImplementedError

    def enter(self, name: str) -> None:
        level = self._level()
        self._open.append(_Open(name, level, level))

    def exit(self, name: str) -> None:
        names = [o.name for o in self._open]
        if name not in names:
            return  # a marker whose opening never ran (e.g. a checkpoint recomputation that stopped early)
        while self._open[-1].name != name:
            self._open.pop()  # abandoned: a non-reentrant checkpoint stops recomputing once it has what it needs
        o = self._open.pop()
        st = self.stages.setdefault(name, StageStats())
        st.entries += 1
        st.peak = max(st.peak, o.high)
        st.transient = max(st.transient, o.high - o.entry)

    def _observe(self, level: int) -> None:
        for o in self._open:
            if level > o.high:
                o.high = level

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Bracket a region (forward code; for backward regions use `mark_stages`' markers)."""
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)

    def report(self) -> dict[str, dict[str, int]]:
        return {k: {"peak": v.peak, "transient": v.transient, "entries": v.entries} for k, v in self.stages.items()}


@dataclass(frozen=True)
class PeakTensors:
    """Storages alive at the device-resident peak that share a shape, dtype and creation site: their total
    `bytes` and `count`. `site`: the innermost frames outside torch where the first one was created."""

    bytes: int
    count: int
    shape: tuple[int, ...]
    dtype: str
    site: str


class StorageTracker(_StageMixin, TorchDispatchMode):
    """Counts live tensor-storage bytes exactly (see the module docstring). Use as a context manager;
    `track(*tensors)` adds storages that exist already (parameters, optimizer state) up front.

    `record_peak=True` also notes each storage of at least `min_bytes` (shape, dtype, creation site) and
    when it lived, so that `alive_at_peak()` can say what made up the device-resident peak: how a memory
    model is checked term by term (slower: one stack walk per new storage)."""

    def __init__(self, record_peak: bool = False, min_bytes: int = 4096) -> None:
        super().__init__()
        self._init_stages()
        self.live = 0
        self.peak = 0
        self.host_live = 0
        self.host_peak = 0
        self.device_peak = 0
        self._host: set[int] = set()  # ids of host-buffer storages among the counted ones
        self._sizes: dict[int, int] = {}  # id(storage object) -> counted bytes
        self._refs: dict[int, Any] = {}  # id -> weakref (keeps ids unique while alive)
        self.device_types: set[str] = set()
        self._record, self._min_bytes = record_peak, min_bytes
        self._clock = 0  # counts births and deaths of storages: their times
        self._peak_clock = -1  # the time of the device-resident peak
        self._born: dict[int, tuple[int, tuple[int, ...], str, str]] = {}  # id -> (birth, shape, dtype, site)
        self._lived: list[tuple[int, int, int, tuple[int, ...], str, str]] = []  # freed: (birth, death, bytes, ...)

    def _level(self) -> int:
        return self.live

    @property
    def device_live(self) -> int:
        """Live bytes outside host buffers (device-resident; on a CPU run everything but offloaded tensors)."""
        return self.live - self.host_live

    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        self._clock += 1
        born = self._born.pop(key, None)
        if born is not None and born[0] <= self._peak_clock:  # only storages born by the peak can matter
            self._lived.append((born[0], self._clock, size) + born[1:])
        self.live -= size
        if key in self._host:
            self._host.discard(key)
            self.host_live -= size
        self._refs.pop(key, None)

    def _see(self, t: torch.Tensor) -> None:
        if t.is_meta or not hasattr(t, "untyped_storage"):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # tensors without storage (sparse, wrapper subclasses)
        key = id(st)
        size = st.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
            self._sizes[key] = size
            self.live += size
            if _ALLOCATING_HOST[0] or _HOST.get(key) is st:
                self._host.add(key)
                self.host_live += size
            self.device_types.add(t.device.type)
            self._clock += 1
            if self._record and size >= self._min_bytes and key not in self._host:
                self._born[key] = (self._clock, tuple(t.shape), str(t.dtype).removeprefix("torch."), _site())
        elif old != size:
            self._sizes[key] = size
            self.live += size - old
            if key in self._host:
                self.host_live += size - old
        self.peak = max(self.peak, self.live)
        self.host_peak = max(self.host_peak, self.host_live)
        if self.live - self.host_live > self.device_peak:
            self.device_peak = self.live - self.host_live
            self._peak_clock = self._clock
            self._lived.clear()  # every one died before this peak
        self._observe(self.live)

    def alive_at_peak(self) -> list[PeakTensors]:
        """The recorded storages alive at the device-resident peak (`record_peak=True`), grouped by shape,
        dtype and creation site, largest first. Storages below `min_bytes` are left out; those that existed
        before the tracker saw them show where they were first seen (a `track` call, or the op that read them)."""
        if not self._record:
            raise ValueError("alive_at_peak() needs StorageTracker(record_peak=True)")
        t = self._peak_clock
        alive = [(size, rest) for birth, death, size, *rest in self._lived if birth <= t < death]
        alive += [(self._sizes.get(k, 0), born[1:]) for k, born in self._born.items() if born[0] <= t]
        groups: dict[tuple, list[int]] = {}
        for size, (shape, dtype, site) in alive:
            g = groups.setdefault((tuple(shape), dtype, site), [0, 0])
            g[0] += size
            g[1] += 1
        return sorted((PeakTensors(b, n, *key) for key, (b, n) in groups.items()), key=lambda p: -p.bytes)

    def track(self, *tensors: Any) -> None:
        """Count these existing tensors' storages from now on (nested containers are fine)."""
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)

    def reset_peak(self) -> None:
        self.peak = self.live
        self.host_peak = self.host_live
        self.device_peak = self.live - self.host_live
        self._peak_clock = self._clock
        self._lived.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


def _site(depth: int = 4) -> str:
    """The innermost `depth` frames outside torch and this module, innermost first ("function:line < ...")."""
    frames, f = [], sys._getframe(2)
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename
        if "/torch/" not in name and name != __file__:
            frames.append(f"{os.path.basename(name)}:{f.f_code.co_name}:{f.f_lineno}")
        f = f.f_back
    return " < ".join(frames)


class CudaStageStats(_StageMixin):
    """The same stage report on CUDA, from the caching allocator: `memory_allocated` at entry and
    `max_memory_allocated` (reset at every stage boundary) for the high-water mark."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        self._init_stages()
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)
        self.peak = torch.cuda.memory_allocated(device)

    def _level(self) -> int:
        high = torch.cuda.max_memory_allocated(self.device)
        self._observe(high)
        self.peak = max(self.peak, high)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def enter(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        super().enter(name)

    def exit(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        self._level()
        super().exit(name)

    def finish(self) -> int:
        torch.cuda.synchronize(self.device)
        self._level()
        return self.peak


class _Marker(torch.autograd.Function):
    """Identity; its backward opens or closes a stage (gradients reach a stage's output first)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tracker: _StageMixin, name: str, action: str) -> torch.Tensor:
        ctx.tracker, ctx.name, ctx.action = tracker, name, action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.action == "enter":
            ctx.tracker.enter(ctx.name)
        else:
            ctx.tracker.exit(ctx.name)
        return grad, None, None, None


def mark(x: Any, tracker: _StageMixin, name: str, action: str) -> Any:
    """Identity on `x` whose backward opens (action="enter": put it on a stage's output) or closes
    (action="exit": on its input) the stage `name` in `tracker`; a no-op when `x` needs no gradient."""
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        return _Marker.apply(x, tracker, name, action)
    return x


def mark_stages(model: nn.Module, tracker: _StageMixin, names: tuple[str, ...] = ("self_attn", "mlp")) -> list:
    """Bracket every submodule whose attribute name is in `names` as the stage "attention" (self_attn)
    or "mlp", in forward (hooks) and in backward (identity markers on its hidden-state input and its
    first output). Returns the hook handles; `.remove()` them when done."""
    label = {"self_attn": "attention", "mlp": "mlp"}
    handles = []
    for full, module in model.named_modules():
        short = full.rsplit(".", 1)[-1]
        if short not in names:
            continue
        stage = label.get(short, short)

        def pre(mod, args, kwargs, stage=stage):
            tracker.enter(stage)
            if args:
                args = (mark(args[0], tracker, f"{stage}.bwd", "exit"),) + tuple(args[1:])
            elif "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=mark(kwargs["hidden_states"], tracker, f"{stage}.bwd", "exit"))
            return args, kwargs

        def post(mod, args, kwargs, out, stage=stage):
            if isinstance(out, tuple):
                out = (mark(out[0], tracker, f"{stage}.bwd", "enter"),) + out[1:]
            else:
                out = mark(out, tracker, f"{stage}.bwd", "enter")
            tracker.exit(stage)
            return out

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles
