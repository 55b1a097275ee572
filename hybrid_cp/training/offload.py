"""Offloaded checkpoints: each checkpointed decoder layer's saved input lives in host memory between the
forward and the layer's recomputation in backward.

Why this is enough: with non-reentrant activation checkpointing a layer keeps exactly its inputs for
backward (everything inside is recomputed), and it saves them through autograd's saved-tensor hooks
before it installs its own. So saved-tensor hooks around the checkpoint call (not around the layer's
recomputation) see the layer's inputs and nothing else: `pack` copies each into a host buffer and lets
the device copy go, `unpack` (the recomputation asking for its inputs) brings it back. The copies are
bitwise, so results are identical to not offloading (`tests/test_offload.py`).

Host memory is bounded: buffers come from a pool (`_HostPool`) and go back to it when the graph that
saved them is freed, so a steady training loop reuses the same buffers step after step (one per layer
input alive at once), never one allocation per step. A buffer is reused only once its graph is gone,
so a second forward before a backward gets fresh buffers instead of overwriting live ones.

On CUDA the buffers are pinned and the copies run on a side stream: the device-to-host copy of layer i's
input overlaps layer i's forward, and when layer i's recomputation fetches its input, the copy back of
layer i - 1's input is started (prefetch), so it overlaps layer i's backward; events order the
streams. On CPU the same code runs with synchronous copies (the prefetch order included); the CUDA
stream path is written but was not run on a GPU in this project's CPU sessions.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError
from .memory import host_buffer

__all__ = ["offload_checkpoints", "unoffload_checkpoints", "offloader_of", "Offloader"]

OFFLOAD_ATTR = "_hybrid_cp_offload"


class _HostPool:
    """Host buffers by size, handed out and returned; at most one buffer per tensor alive at once.
    A request takes the smallest free buffer that fits; when none fits, the largest free one is
    released first, so buffers of a shorter sequence do not pile up."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: list[torch.Tensor] = []
        self.allocated = 0  # bytes held by the pool (free and in use)

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self.free if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self.free.remove(buf)
            return buf
        if self.free:
            biggest = max(self.free, key=torch.Tensor.numel)
            self.free.remove(biggest)
            self.allocated -= biggest.numel()
        self.allocated += nbytes
        return host_buffer(nbytes, pin=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self.free.append(buf)


class _Saved:
    """One offloaded tensor: its host copy and, once fetched, its device copy (with the copy's event)."""

    def __init__(self, pool: _HostPool, t: torch.Tensor, frame: "_Frame", side: Any):
        self.frame, self.device, self.dtype, self.shape = frame, t.device, t.dtype, t.shape
        self.buf = pool.take(t.numel() * t.element_size())
        weakref.finalize(self, pool.give, self.buf)  # back to the pool when autograd drops this handle
        self.host = self.buf[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        self.fetched: torch.Tensor | None = None
        self.ready: Any = None
        if side is None:
            self.host.copy_(t)
        else:  # after the producer, on the side stream; the device tensor must outlive the copy
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(side)

    def fetch(self, side: Any) -> None:
        """Start the copy back (on CUDA: on the side stream, ordered after the copy out)."""
        if self.fetched is not None:
            return
        if side is None:
            self.fetched = self.host.to(self.device, copy=True)
            return
        with torch.cuda.stream(side):
            self.fetched = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)

    def take(self, side: Any) -> torch.Tensor:
        self.fetch(side)
        out, self.fetched = self.fetched, None  # the recomputation holds it now; a second unpack fetches again
        if side is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.ready)
            out.record_stream(current)
        return out


class _Frame:
    """The tensors one layer call offloaded, and the previous layer's frame of the same forward pass (the
    one to prefetch while this layer runs backward)."""

    def __init__(self, layer: int, previous: "_Frame | None"):
        self.layer = layer
        self.previous = weakref.ref(previous) if previous is not None else None
        self.saved: list[weakref.ref] = []
        self.fetched = False


class Offloader:
    """The saved-tensor hooks of one model: the host pool, the side stream and the frames of the current
    forward pass. `log` records (event, layer) pairs when it is a list (tests read the prefetch order)."""

    def __init__(self, pin: bool | None, prefetch: bool | None, log: list | None = None):
        cuda = torch.cuda.is_available()
        self.pool = _HostPool(cuda if pin is None else bool(pin) and cuda)
        self.prefetch = cuda if prefetch is None else bool(prefetch)
        self.side = torch.cuda.Stream() if cuda else None
        self.last: _Frame | None = None
        self.log = log

    def _side(self, device: torch.device) -> Any:
        return self.side if device.type == "cuda" else None

    def hooks(self, layer: int, first: bool) -> torch.autograd.graph.saved_tensors_hooks:
        frame = _Frame(layer, None if first or self.last is None else self.last)
        self.last = frame
        return torch.autograd.graph.saved_tensors_hooks(partial(self._pack, frame), self._unpack)

    def _pack(self, frame: _Frame, t: torch.Tensor) -> Any:
        if type(t) is not torch.Tensor or t.numel() == 0:
            return t  # subclasses (DTensor) and empty tensors stay where they are
        saved = _Saved(self.pool, t, frame, self._side(t.device))
        frame.saved.append(weakref.ref(saved))
        if self.log is not None:
            self.log.append(("offload", frame.layer))
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        frame = saved.frame
        if not frame.fetched:
            frame.fetched = True
            if self.log is not None:
                self.log.append(("fetch", frame.layer))
            previous = frame.previous() if frame.previous is not None else None
            if self.prefetch and previous is not None and not previous.fetched:
                self._prefetch(previous)
        return saved.take(self._side(saved.device))

    def _prefetch(self, frame: _Frame) -> None:
        if self.log is not None:
            self.log.append(("prefetch", frame.layer))
        for ref in frame.saved:
            saved = ref()
            if saved is not None:
                saved.fetch(self._side(saved.device))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks transformers checkpoints (GradientCheckpointingLayer), in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _check_checkpointing(layer: nn.Module) -> None:
    """Offload moves what checkpointing keeps: refuse a layer that is not checkpointed non-reentrantly."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    keywords = getattr(func, "keywords", {}) or {}
    if not getattr(layer, "gradient_checkpointing", False) or keywords.get("use_reentrant", True) is not False:
        raise ConfigError(
            f"offload_checkpoints: {type(layer).__name__} is not under non-reentrant activation "
            f"checkpointing (gradient_checkpointing={getattr(layer, 'gradient_checkpointing', False)}, "
            f"use_reentrant={keywords.get('use_reentrant', 'unset')}); call model."
            f"gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': False}}) "
            f"first, or do not offload"
        )


_ORIGINAL = "_hybrid_cp_checkpoint_func"


def _wrap(layer: nn.Module, offloader: Offloader, index: int, first: bool) -> list:
    """Put the hooks around this layer's checkpoint call only (not its module hooks, not the recomputation):
    the forward pre-hook swaps in a checkpoint function that runs the original inside the hooks."""

    def pre(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        _check_checkpointing(module)
        original = module.__dict__[_ORIGINAL] = module._gradient_checkpointing_func

        def offloaded(fn: Callable, *a, **kw):
            module._gradient_checkpointing_func = module.__dict__.pop(_ORIGINAL)
            with offloader.hooks(index, first):
                return original(fn, *a, **kw)

        module._gradient_checkpointing_func = offloaded
        return None

    def post(module, args, kwargs, out):
        if _ORIGINAL in module.__dict__:  # the checkpoint did not run: restore the function anyway
            module._gradient_checkpointing_func = module.__dict__.pop(_ORIGINAL)
        return None

    return [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]


def offload_checkpoints(
    model: nn.Module,
    *,
    keep_first: bool = False,
    keep_last: bool = False,
    pin_memory: bool | None = None,
    prefetch: bool | None = None,
    log: list | None = None,
) -> nn.Module:
    """Keep each checkpointed decoder layer's saved input in host memory between forward and backward.

    Needs non-reentrant activation checkpointing (`model.gradient_checkpointing_enable(
    gradient_checkpointing_kwargs={"use_reentrant": False})`, before or after this call; checked on each
    training forward, ConfigError otherwise). `keep_first`/`keep_last` leave the first/last layer's input
    on the device (the last one is fetched back first, so offloading it buys nothing at the peak; the
    first one is fetched last, when nothing is left to overlap with). `pin_memory` and `prefetch`
    default to on with CUDA, off otherwise. Results are bitwise those without offload. Returns the model;
    `unoffload_checkpoints` undoes it.

    Args:
        model: A transformers model with non-reentrant activation checkpointing.
        keep_first: Leave the first layer's input on the device.
        keep_last: Leave the last layer's input on the device.
        pin_memory: Pinned host buffers; None: on with CUDA.
        prefetch: Fetch the next layer's input back during a layer's backward; None: on with CUDA.
        log: If a list, the offload's events are appended to it (tests).

    Returns:
        The model.

    Raises:
        ConfigError: On the first training forward, a layer without non-reentrant checkpointing.
    """
    layers = _decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"offload_checkpoints: {type(model).__name__} has no transformers decoder layers "
            f"(GradientCheckpointingLayer); it supports transformers decoder models"
        )
    unoffload_checkpoints(model)
    offloader = Offloader(pin_memory, prefetch, log)
    chosen = [i for i in range(len(layers)) if not (keep_first and i == 0) and not (keep_last and i == len(layers) - 1)]
    handles = [h for n, i in enumerate(chosen) for h in _wrap(layers[i], offloader, i, first=n == 0)]
    model.__dict__[OFFLOAD_ATTR] = (offloader, handles)
    return model


def unoffload_checkpoints(model: nn.Module) -> nn.Module:
    """Undo `offload_checkpoints` (the host buffers go when no graph holds them).

    Args:
        model: A model `offload_checkpoints` changed.

    Returns:
        The model.
    """
    _, handles = model.__dict__.pop(OFFLOAD_ATTR, (None, ()))
    for h in handles:
        h.remove()
    return model


def offloader_of(model: nn.Module) -> Offloader | None:
    """The model's `Offloader` (its host pool: `.pool.allocated` bytes), or None without offload."""
    state = model.__dict__.get(OFFLOAD_ATTR)
    return state[0] if state else None
