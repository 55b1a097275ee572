"""The one `torch.compiler.disable` of the engine (it imports torch._dynamo): imported by `eager.eager_only`
on the first traced call, so that `import hybrid_cp` does not load dynamo."""

from __future__ import annotations

from typing import Any, Callable

import torch


def _run(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


run_eagerly = torch.compiler.disable(_run, recursive=True)  # a graph break; fn and all it calls run eagerly
