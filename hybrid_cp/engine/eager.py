"""Functions that must run outside torch.compile graphs (collectives, host-side records), marked without
importing torch._dynamo: `torch.compiler.disable` imports it (about 1 s, more than the rest of
`import hybrid_cp`), and most processes never compile. The disabled trampoline lives in
`eager_dynamo`, imported on the first call that dynamo traces (dynamo runs that import for real)."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """`fn` as `torch.compiler.disable(fn)` (recursive) acts: a call that dynamo traces becomes a graph
    break and runs eagerly with dynamo off; a call outside tracing goes straight to `fn`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            from .eager_dynamo import run_eagerly

            return run_eagerly(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
