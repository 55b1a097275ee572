"""How many of the package's files one `hcp.attention` call passes through, and how often it comes back
to a file it already left (docs/architecture.md): a profiler hook records every call of a function in
hybrid_cp/ or topology/ during one packed causal GQA call (forward and backward) on rank 0 of a
ulysses=2 x ring=2 gloo mesh.

    python benchmarks/call_path.py            # the call's path through the code, then the counts

"modules" counts the files a reader holds for the call; a "re-entry" is a call into a module that is
already on the call stack below the caller (the path goes down into another file and comes back up
into one it has not left: A -> B -> A), the bouncing the layering removes. "following cu_seqlens"
keeps only the functions that take the document boundaries as an argument.
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
    hcp.attention(q, k, v, cp, causal=True, cu_seqlens=cu)  # warm: the first call agrees across ranks
    calls: list[tuple[str, str, bool, bool]] = []  # module, function, takes boundaries, re-entry
    stack: list[str] = []

    def hook(frame, event, arg):
        module = _module(frame.f_code.co_filename, root)
        if not module:
            return
        if event == "call":
            code = frame.f_code
            params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            reentry = bool(stack) and stack[-1] != module and module in stack
            calls.append((module, code.co_name, any(p in BOUNDARY_ARGS for p in params), reentry))
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    if dist.get_rank() == 0:
        sys.setprofile(hook)
    out = hcp.attention(q, k, v, cp, causal=True, cu_seqlens=cu)
    out.sum().backward()
    sys.setprofile(None)
    return {"calls": calls}


def main() -> None:
    from hybrid_cp.testing import WorkerPool

    with WorkerPool(4, extra_paths=[os.path.dirname(os.path.abspath(__file__))]) as pool:
        calls = pool.run(traced_call)[0]["calls"]
    modules = sorted({c[0] for c in calls})
    reentries = [f"{m}.{f}" for m, f, _, again in calls if again]
    print(f"every project function: {len(calls)} calls in {len(modules)} modules, {len(reentries)} re-entries")
    print("  modules: " + ", ".join(modules))
    print("  re-entered: " + ", ".join(sorted(set(reentries))))
    chain = [f"{m}.{f}" for m, f, takes, _ in calls if takes]
    print(f"following cu_seqlens: {len({c.rpartition('.')[0] for c in chain})} modules: " + " -> ".join(chain))


if __name__ == "__main__":
    main()
