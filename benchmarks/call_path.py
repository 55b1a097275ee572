"""How many of the package's files one `hcp.attention` call passes through, and how often it comes back
to a file it already left (docs/architecture.md): a profiler hook records every call of a function in
hybrid_cp/ or topology/ during one packed causal GQA call (forward and backward) on rank 0 of a
ulysses=2 x ring=2 gloo mesh.

    python benchmarks/call_path.py            # the call's path through the code, then the counts

"stays" are runs of consecutive calls in one module, "returns" stays in a module already left before;
"following cu_seqlens" keeps only the functions that take the document boundaries as an argument.
"""

from __future__ import annotations

import os
import sys

BOUNDARY_ARGS = ("cu_seqlens", "cu", "cu_seqlens_q", "cu_seqlens_k")


def _module(filename: str, root: str) -> str | None:
    rel = os.path.relpath(filename, root)
    if rel.startswith("..") or not rel.endswith(".py") or not rel.startswith(("hybrid_cp", "topology")):
        return None
    return rel[:-3].replace(os.sep, ".").removesuffix(".__init__")


def traced_call() -> dict:
    """Runs on every rank; rank 0 records the modules of every project function its call enters."""
    import torch
    import torch.distributed as dist

    import hybrid_cp as hcp

    root = os.path.dirname(os.path.dirname(os.path.abspath(hcp.__file__)))
    cp = hcp.init_cp_mesh(ulysses=2, ring=2)
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 130, 256])
    q, k, v = (torch.randn(1, 256, h, 16) for h in (4, 2, 2))
    q, k, v = (hcp.shard(x, cp, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
    hcp.attention(q, k, v, cp, causal=True, cu_seqlens=cu)   # warm: the first call agrees across ranks
    calls: list[tuple[str, str, bool]] = []

    def hook(frame, event, arg):
        if event == "call":
            module = _module(frame.f_code.co_filename, root)
            if module:
                code = frame.f_code
                params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                calls.append((module, code.co_name, any(p in BOUNDARY_ARGS for p in params)))

    if dist.get_rank() == 0:
        sys.setprofile(hook)
    out = hcp.attention(q, k, v, cp, causal=True, cu_seqlens=cu)
    out.sum().backward()
    sys.setprofile(None)
    return {"calls": calls}


def stays(modules: list[str]) -> tuple[list[str], int]:
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    returns = sum(1 for i, m in enumerate(runs) if m in runs[:i])
    return runs, returns


def main() -> None:
    from hybrid_cp.testing import WorkerPool

    with WorkerPool(4, extra_paths=[os.path.dirname(os.path.abspath(__file__))]) as pool:
        calls = pool.run("call_path:traced_call")[0]["calls"]
    for title, chosen in (("every project function", calls),
                          ("following cu_seqlens", [c for c in calls if c[2]])):
        runs, returns = stays([m for m, _, _ in chosen])
        print(f"{title}: {len(set(runs))} modules, {len(runs)} stays, {returns} returns to a module already left")
        print("  " + " -> ".join(runs))


if __name__ == "__main__":
    main()
