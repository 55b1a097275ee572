"""torch.compile cases, run on every rank of the worker pool (see conftest.py): a tiny model whose
attention goes through `hcp.attention`, compiled against the same model run eagerly. They return
numbers and messages; tests/test_compile.py asserts on them.

Only the first cp group (dp rank 0) compiles: the other dp replicas would do the same work, and
compiling is the expensive part on the suite's shared CPU cores.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from dist_cases import mesh
from torch import nn

import hybrid_cp as hcp
from hybrid_cp.engine.layout import row_layout
from hybrid_cp.engine.ring import block_plan

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 4, 2, 8


class TinyModel(nn.Module):
    """embedding -> q/k/v projections -> hcp.attention -> output projection -> MLP -> local loss sum."""

    def __init__(self, cp: hcp.CPMesh, seq_len: int, window=None, chunk_size=None):
        super().__init__()
        torch.manual_seed(0)
        self.cp, self.seq_len, self.window, self.chunk_size = cp, seq_len, window, chunk_size
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        x = self.emb(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM)
        k = self.k(x).view(b, s, KV_HEADS, HEAD_DIM)
        v = self.v(x).view(b, s, KV_HEADS, HEAD_DIM)
        a = hcp.attention(
            q,
            k,
            v,
            self.cp,
            causal=True,
            window=self.window,
            cu_seqlens=cu_seqlens,
            seq_len=None if cu_seqlens is not None else self.seq_len,
            chunk_size=self.chunk_size,
        )
        x = x + self.o(a.reshape(b, s, HEADS * HEAD_DIM))
        x = x + self.down(F.gelu(self.up(x)))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")


def _batch(cp: hcp.CPMesh, step: int, seq_len: int, packed: bool):
    """This rank's shard of step `step`'s batch (the same full batch on every cp rank)."""
    g = torch.Generator().manual_seed(100 + step)
    b = 1 if packed else 2
    ids = torch.randint(0, VOCAB, (b, seq_len), generator=g)
    labels = torch.randint(0, VOCAB, (b, seq_len), generator=g)
    cu = None
    if packed:  # three documents, new boundaries every step (same count: same shapes)
        cuts = sorted(torch.randperm(seq_len - 2, generator=g)[:2].add(1).tolist())
        cu = torch.tensor([0, *cuts, seq_len], dtype=torch.int32)
    ids_l, labels_l = (hcp.shard(x, cp, cu_seqlens=cu) for x in (ids, labels))
    return ids_l, labels_l, cu


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compiled_twins(make, backend: str, fullgraph: bool = True):
    """Fresh dynamo state and counters, two models from `make()` (the same seed gives the same weights) and the
    second compiled: (eager, model, its frame counter, compiled)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, model = make(), make()
    counter = CompileCounterWithBackend(backend)
    return eager, model, counter, torch.compile(model, backend=counter, fullgraph=fullgraph)


def parity(
    u: int,
    r: int,
    backend: str = "aot_eager",
    steps: int = 3,
    packed: bool = False,
    window=None,
    seq_len: int = 64,
    chunk_size: int | None = None,
) -> dict | None:
    """Compile the tiny model (fullgraph) and run `steps` steps with new data against eager: loss and
    gradient errors per step, compiles, graph breaks, whether the custom op is in the graph, and
    timings (first compiled step = compile time; later steps: compiled vs eager)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    eager, model, counter, compiled = compiled_twins(lambda: TinyModel(cp, seq_len, window, chunk_size), backend)
    rows = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(steps):
            ids, labels, cu = _batch(cp, step, seq_len, packed)
            t0 = time.perf_counter()
            ref = eager(ids, labels, cu)
            ref.backward()
            t1 = time.perf_counter()
            loss = compiled(ids, labels, cu)
            loss.backward()
            t2 = time.perf_counter()
            g_ref, g = _grads(eager), _grads(model)
            lay = row_layout(
                cp, local_len=ids.shape[1], seq_len=None if packed else seq_len, cu_seqlens=cu, causal=True
            )
            halo = block_plan(lay, cp.ring_rank, True, ids.device, lay.effective_window(True, window), chunk_size).halo
            rows.append(
                {
                    "loss": _rel(loss.detach(), ref.detach()),
                    "halo": halo,
                    "grads": max(_rel(g[n], g_ref[n]) for n in g_ref),
                    "eager_s": t1 - t0,
                    "compiled_s": t2 - t1,
                }
            )
            eager.zero_grad()
            model.zero_grad()
    ops = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    return {
        "steps": rows,
        "frames": counter.frame_count,
        "graph_breaks": dict(counters["graph_break"]),
        "op_in_graph": any("hybrid_cp.attention_fwd" in o for o in ops),
    }


def validation(u: int, r: int) -> str | None:
    """One cp rank compiles a call with causal=False, the others causal=True: the op's real
    implementation must run the cross-rank agreement and raise on every rank (no hang)."""
    import torch._dynamo

    cp = mesh(u, r, validate="always")
    if cp.dp_rank != 0:
        return None
    torch._dynamo.reset()
    causal = cp.rank != 1

    def f(q, k, v):
        return hcp.attention(q, k, v, cp, causal=causal, seq_len=16 * cp.size)

    g = torch.Generator().manual_seed(cp.rank)
    q = torch.randn(1, 16, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, 16, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    try:
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    except hcp.InconsistentRanksError as exc:
        return f"InconsistentRanksError: {exc}"
    except Exception as exc:  # report what came instead
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def hf_llama(u: int, r: int, backend: str = "aot_eager", steps: int = 3, head_chunks: int = 1) -> dict | None:
    """A tiny transformers Llama with `apply_context_parallel` (module-level `head_chunks`), compiled (not
    fullgraph) against eager: loss and gradient errors, compiled frames and graph breaks."""
    from torch._dynamo.utils import counters
    from train_cases import tiny_model

    from hybrid_cp.integrations.transformers import apply_context_parallel

    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    eager, model, counter, compiled = compiled_twins(
        lambda: apply_context_parallel(tiny_model(hkv=2, num_hidden_layers=1), cp, head_chunks=head_chunks),
        backend,
        fullgraph=False,
    )
    rows = []
    seq_len = 64
    for step in range(steps):
        g = torch.Generator().manual_seed(200 + step)
        full = {"input_ids": torch.randint(0, 256, (2, seq_len), generator=g)}
        local = hcp.shard_batch(full, cp)
        losses = []
        for m in (eager, compiled):
            logits = m(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), local["labels"].flatten(), reduction="sum")
            loss.backward()
            losses.append(loss.detach())
        g_ref, g_c = _grads(eager), _grads(model)
        rows.append(
            {
                "loss": _rel(losses[1], losses[0]),
                "grads": max(_rel(g_c[n], g_ref[n]) for n in g_ref),
                "frames": counter.frame_count,
            }
        )
        eager.zero_grad()
        model.zero_grad()
    graphs = [[str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm in counter.graphs]
    breaks = {str(k).splitlines()[0]: v for k, v in counters["graph_break"].items()}
    return {
        "steps": rows,
        "frames": counter.frame_count,
        "graph_breaks": breaks,
        "graph_sizes": [len(g) for g in graphs],
        "attention_ops": [sum("hybrid_cp.attention_fwd" in o for o in g) for g in graphs],
    }


def opcheck(u: int, r: int, packed: bool = False) -> dict | None:
    """torch.library.opcheck on both ops (schema, fake vs real shapes/strides, autograd registration,
    AOT dispatch): every rank runs the same checks in the same order, so the collectives pair up."""
    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    seq_len = 16 * cp.size
    g = torch.Generator().manual_seed(7 + cp.rank)
    q = torch.randn(1, 16, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 16, KV_HEADS, HEAD_DIM, generator=g, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 11, 40, seq_len], dtype=torch.int32) if packed else None
    from hybrid_cp.engine.compiled import _mesh_key
    from hybrid_cp.engine.spec import AttentionSpec

    spec = AttentionSpec(causal=True, return_lse=True, seq_len=None if packed else seq_len, cu_seqlens=cu).op_args()
    args = (q, k, v, None, _mesh_key(cp), True, *spec)
    fwd = torch.library.opcheck(torch.ops.hybrid_cp.attention_fwd.default, args)
    outs = torch.ops.hybrid_cp.attention_fwd(*args)
    dout = torch.randn(q.shape, generator=g)
    bwd_args = (dout, [x.detach() for x in outs[2:]], None, _mesh_key(cp), KV_HEADS, *spec)
    bwd = torch.library.opcheck(torch.ops.hybrid_cp.attention_bwd.default, bwd_args)
    return {"fwd": fwd, "bwd": bwd}


def outside_graph(u: int, r: int) -> dict | None:
    """head_chunks > 1 is not expressible as the op: under torch.compile (not fullgraph) the call runs
    eagerly outside the graph and still matches eager."""
    import torch._dynamo

    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    torch._dynamo.reset()

    def f(q, k, v):
        return (hcp.attention(q * 2, k, v, cp, causal=True, seq_len=16 * cp.size, head_chunks=2) * 3).sum()

    g = torch.Generator().manual_seed(11 + cp.rank)
    inputs = [torch.randn(1, 16, h, HEAD_DIM, generator=g, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS)]
    ref = f(*inputs)
    ref_grads = torch.autograd.grad(ref, inputs)
    out = torch.compile(f, backend="aot_eager")(*inputs)
    grads = torch.autograd.grad(out, inputs)
    return {"loss": _rel(out.detach(), ref.detach()), "grads": max(_rel(a, b) for a, b in zip(grads, ref_grads))}


def argument_kinds(u: int, r: int) -> dict | None:
    """fullgraph compiles with a kernel object as backend (through the op's registry) and with
    cu_seqlens as a Python list (a constant); both match eager."""
    import torch._dynamo

    from hybrid_cp.engine.kernels import get_kernel

    cp = mesh(u, r)
    if cp.dp_rank != 0:
        return None
    g = torch.Generator().manual_seed(3 + cp.rank)
    q = torch.randn(1, 16, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, 16, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    kernel = get_kernel("math", q.device, q.dtype, HEAD_DIM)
    calls = {
        "kernel object": lambda q, k, v: hcp.attention(q, k, v, cp, causal=True, seq_len=16 * cp.size, backend=kernel),
        "cu_seqlens list": lambda q, k, v: hcp.attention(q, k, v, cp, causal=True, cu_seqlens=[0, 10, 16 * cp.size]),
    }
    errors = {}
    for name, f in calls.items():
        torch._dynamo.reset()
        errors[name] = _rel(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v))
    return errors
