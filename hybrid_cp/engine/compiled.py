"""`hcp.attention` under `torch.compile`: the engine as two opaque custom ops.

Why opaque: the engine's work is collectives (Ulysses all-to-all, ring send/recv) interleaved with
host-side decisions (block plans, cross-rank validation) that dynamo cannot trace without
breaking the graph. So while dynamo traces, `attention()` hands the call to
`hybrid_cp::attention_fwd`: its real implementation runs the same checks and the same engine code
as eager (`validate.checked_call`, then `pipeline.forward`: exchange, ring, exchange); its fake
implementation only gives shapes, so tracing never communicates. The op's autograd formula calls
`hybrid_cp::attention_bwd` (`pipeline.backward`: all-to-all of d(out), the ring backward,
all-to-all of the gradients), the steps eager backward runs, so results match eager exactly.

What backward needs comes out of the forward op as extra outputs (the post-all-to-all q/k/v, out
and lse in ring-block order): eager saves exactly these, so this costs no extra memory. In halo
mode (short windows) eager also keeps the halo K/V rows received in forward; their number of rows
depends on the plan (for packed rows, on the values in `cu_seqlens`), which a fake cannot know,
so backward receives them again instead (halo rows are few by construction).

The variants are op arguments too: `softcap` a float, `sinks` an optional tensor whose gradient (this
rank's share) comes out of the backward op; v's head dim comes from v's shape (the fakes use it). A mask
is an int64 tensor (`engine.masks.encode_mask`, carried by every `hcp.AttnMask` as `encoded`) that the op
decodes: like `cu_seqlens` its values are data, so a new mask each step runs the same graph.

Objects cannot be op arguments, so the mesh and kernel objects go through a per-process registry
and the op gets a small integer key (first-use order: the same on every rank of an SPMD program,
so every rank compiles the same graph). Calls the ops cannot express (a plain local-attention
callable, `head_chunks` > 1, arguments of the wrong type) run eagerly outside the graph (`hcp.attention`
does that when `compiled_attention` returns None): a graph break, never a wrong result; invalid
arguments then raise eager's documented error.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import torch

from .comm import acc_dtype
from .heads import head_split
from .kernels import AttentionKernel, get_kernel
from .layout import row_layout
from .masks import AttnMask, encode_mask
from .mesh import CPMesh
from .patterns import prepared
from .pipeline import AttentionCall, Saved, backward, forward, plan_call
from .rules import is_int
from .spec import AttentionSpec
from .validate import Checked, kernel_keywords, mask_in_effect, op_expressible

log = logging.getLogger("hybrid_cp")

__all__ = ["compiled_attention", "registered_mesh"]


class _Registry:
    """Objects that cannot be op arguments, by small integer key in first-use order (the same on every
    rank of an SPMD program, so every rank compiles the same graph). Entries stay alive: a key must
    never point at a new object."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.keys: dict[int, int] = {}  # id(object) -> key

    def key(self, obj: Any) -> int:
        if id(obj) not in self.keys:
            self.keys[id(obj)] = len(self.items)
            self.items.append(obj)
        return self.keys[id(obj)]


_MESHES = _Registry()
_KERNELS = _Registry()  # kernel objects passed as backend=
_KERNEL_PREFIX = "#kernel:"


# dynamo runs these two for real while tracing (their registry writes must happen before the graph first
# runs; traced writes would only be replayed after it) and bakes the key into the graph as a constant; it
# still guards on the object, so a different mesh or kernel object recompiles with its own key.
@torch.compiler.assume_constant_result
def _mesh_key(cp: CPMesh) -> int:
    return _MESHES.key(cp)


def registered_mesh(key: int) -> CPMesh:
    """The mesh behind an op's `mesh` argument."""
    return _MESHES.items[key]


@torch.compiler.assume_constant_result
def _kernel_key(backend: Any) -> str:
    """A kernel object as a registry key; "" for anything else (a plain callable, or no backend at all).
    Runs for real: dynamo cannot evaluate isinstance against the runtime-checkable kernel protocol."""
    if not isinstance(backend, AttentionKernel):
        return ""
    return f"{_KERNEL_PREFIX}{_KERNELS.key(backend)}"


def _backend(arg: str) -> Any:
    return _KERNELS.items[int(arg[len(_KERNEL_PREFIX) :])] if arg.startswith(_KERNEL_PREFIX) else arg


def _call(
    cp: CPMesh, spec: AttentionSpec, shape: tuple[int, int, int, int], kv_heads: int, like: torch.Tensor, v_dim: int
) -> AttentionCall:
    """The call's plan handle in backward, recomputed without checks (forward checked the same arguments).
    `shape` is q's, `like` a tensor of q's dtype and device, `v_dim` v's head dim."""
    if spec.mask is not None:  # as validate's checks: the mask's own layout, its window folded into the mask
        lay, window, mask = row_layout(cp, local_len=shape[1], mask=spec.mask), None, mask_in_effect(spec)
    else:
        lay, mask = (
            row_layout(cp, local_len=shape[1], seq_len=spec.seq_len, cu_seqlens=spec.cu_seqlens, causal=spec.causal),
            None,
        )
        window = lay.effective_window(spec.causal, spec.window)
    needs = kernel_keywords(
        lay, spec.cu_seqlens, window, spec.chunk_size, spec.softcap, v_dim != shape[3], mask is not None
    )
    kernel = get_kernel(spec.backend, like.device, like.dtype, shape[3], needs=needs)  # as forward
    return plan_call(cp, spec, Checked(lay, kernel, window, mask), shape, kv_heads, like.device)


def _unaliased(outs: list[torch.Tensor], inputs: tuple) -> list[torch.Tensor]:
    """Custom ops may not return views of their inputs or of each other, and the fakes promise contiguous
    outputs: copy what the engine passes through (ulysses = 1 and no row permutation) or returns as views
    (q/k/v after the all-to-all are head slices of one receive buffer)."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor) and x.numel()}
    result = []
    for x in outs:
        x = x.contiguous()
        ptr = x.untyped_storage().data_ptr() if x.numel() else None
        if ptr is not None and ptr in seen:
            x = x.clone()
            ptr = x.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        result.append(x)
    return result


_FWD_OUT = "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"


def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    mesh: int,
    needs_grad: bool,
    *spec_args,
) -> tuple[torch.Tensor, ...]:
    """Validated hybrid attention forward. Returns (out, lse or an empty tensor, and for backward: q, k, v,
    out [B, u*S, own heads, D] and lse [B, own heads, u*S] in ring-block order, the sinks merged in)."""
    cp = registered_mesh(mesh)
    spec = _with_backend(AttentionSpec.from_op_args(*spec_args))
    ready = prepared(q, k, v, cp, spec, sinks, int(needs_grad))
    call = ready.plan(lambda: plan_call(cp, spec, ready.checked, tuple(q.shape), k.shape[2], q.device))
    out, lse, saved = forward(call, q, k, v, want_lse=spec.return_lse, sinks=sinks)  # backward receives the halo again
    if lse is None:
        lse = saved.lse_h.new_empty(0)
    return tuple(
        _unaliased([out, lse, saved.qh, saved.kh, saved.vh, saved.out_h, saved.lse_h], (q, k, v, spec.cu_seqlens))
    )


attention_fwd = torch.library.custom_op(
    "hybrid_cp::attention_fwd",
    _attention_fwd,
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, int mesh, bool needs_grad, {AttentionSpec.OP_SCHEMA}) "
    f"-> {_FWD_OUT}",
)


def _with_backend(spec: AttentionSpec) -> AttentionSpec:
    """The spec with its backend argument resolved from the op's string (a kernel name or registry key)."""
    return replace(spec, backend=_backend(spec.backend))


def _own_heads(cp: CPMesh, heads: int, kv_heads: int) -> tuple[int, int]:
    """This rank's query and KV head counts; a plausible guess for inputs the real op will reject (the
    fake must not raise on one rank alone: the others would wait for it in the agreement check)."""
    try:
        split = head_split(heads, kv_heads, cp.ulysses_size)
        (qs, qe), (ks, ke) = split.q[cp.ulysses_rank], split.kv[cp.ulysses_rank]
        return qe - qs, ke - ks
    except (ValueError, ZeroDivisionError, IndexError):
        return max(heads // cp.ulysses_size, 1), max(kv_heads // cp.ulysses_size, 1)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, sinks, mesh, needs_grad, *spec_args):
    cp = registered_mesh(mesh)
    spec = AttentionSpec.from_op_args(*spec_args, values=False)
    b, s, h, d = q.shape
    nq, nkv = _own_heads(cp, h, k.shape[2])
    n = cp.ulysses_size * s
    acc = acc_dtype(q.dtype)
    dv = v.shape[3]
    lse = q.new_empty(b, h, s, dtype=acc) if spec.return_lse else q.new_empty(0, dtype=acc)
    return (
        q.new_empty(b, s, h, dv),
        lse,
        q.new_empty(b, n, nq, d),
        k.new_empty(b, n, nkv, d),
        v.new_empty(b, n, nkv, dv),
        q.new_empty(b, n, nq, dv),
        q.new_empty(b, nq, n, dtype=acc),
    )


def _attention_bwd(
    dout: torch.Tensor, saved: list[torch.Tensor], sinks: Optional[torch.Tensor], mesh: int, kv_heads: int, *spec_args
) -> tuple[torch.Tensor, ...]:
    """Gradients of `attention_fwd` w.r.t. q, k, v and sinks (this rank's share; an empty tensor without
    sinks), eager backward's code, in its order. `saved`: the forward's q, k, v, out and lse in ring-block
    order."""
    cp = registered_mesh(mesh)
    qh, kh, vh, out_h, lse_h = saved
    spec = _with_backend(AttentionSpec.from_op_args(*spec_args))
    call = _call(cp, spec, (*dout.shape[:3], qh.shape[3]), kv_heads, qh, vh.shape[3])
    *grads, dsinks = backward(call, dout, Saved(qh, kh, vh, out_h, lse_h, sinks=sinks))
    grads.append(dsinks if dsinks is not None else dout.new_empty(0))
    return tuple(_unaliased(grads, (dout, *saved, spec.cu_seqlens, sinks)))


attention_bwd = torch.library.custom_op(
    "hybrid_cp::attention_bwd",
    _attention_bwd,
    mutates_args=(),
    schema=f"(Tensor dout, Tensor[] saved, Tensor? sinks, int mesh, int kv_heads, {AttentionSpec.OP_SCHEMA}) "
    f"-> (Tensor, Tensor, Tensor, Tensor)",
)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, saved, sinks, mesh, kv_heads, *spec_args):
    qh, kh, vh = saved[:3]
    b, s, h = dout.shape[:3]
    return (
        qh.new_empty(b, s, h, qh.shape[3]),
        kh.new_empty(b, s, kv_heads, kh.shape[3]),
        vh.new_empty(b, s, kv_heads, vh.shape[3]),
        dout.new_empty(0) if sinks is None else torch.empty_like(sinks),
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, mesh, needs_grad, *spec_args = inputs
    out, lse, qh, kh, vh, out_h, lse_h = output
    ctx.save_for_backward(qh, kh, vh, out_h, lse_h, sinks)
    ctx.args = (mesh, k.shape[2], spec_args)
    ctx.mark_non_differentiable(lse, qh, kh, vh, out_h, lse_h)


def _backward(ctx, dout, *_unused):
    *saved, sinks = ctx.saved_tensors
    mesh, kv_heads, spec_args = ctx.args
    dq, dk, dv, dsinks = torch.ops.hybrid_cp.attention_bwd(dout, saved, sinks, mesh, kv_heads, *spec_args)
    return (dq, dk, dv, None if sinks is None else dsinks) + (None,) * (2 + len(spec_args))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)

_WARNED: set[str] = set()


def _mask_arg(mask: Any) -> torch.Tensor | None:
    """The op's `mask` argument: an `hcp.AttnMask`'s own encoding (dynamo reads it as a graph input), or the
    encoding of another `topology.masks.AttnMask` built while tracing (a constant it guards on)."""
    if mask is None:
        return None
    return mask.encoded if isinstance(mask, AttnMask) else encode_mask(mask)


def compiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPMesh, spec: AttentionSpec, sinks: Any = None
):
    """`hcp.attention` while dynamo traces (`run_attention` calls this): one `hybrid_cp::attention_fwd` node in
    the graph. Same results as `hcp.attention`, or None for a call the op cannot express (it then runs eagerly
    outside the graph, which raises eager's error for invalid arguments).

    `cu_seqlens` should be a tensor (as `shard_batch` gives): a Python list is a constant to dynamo,
    so every new packing would recompile. Likewise a mask: an `hcp.AttnMask` reaches the op as its
    `encoded` tensor (a graph input read from the mask object: new masks are new data); a
    `topology.masks.AttnMask` is encoded while tracing, a constant, so each new one recompiles.
    """
    backend = spec.backend
    backend_arg = backend if isinstance(backend, str) else _kernel_key(backend)
    plain_callable = backend_arg == "" and callable(backend)
    head_chunks = spec.head_chunks
    if (plain_callable or head_chunks != 1) and is_int(head_chunks) and head_chunks >= 1:
        reason = "a plain local-attention callable" if plain_callable else f"head_chunks={head_chunks}"
        if reason not in _WARNED:
            _WARNED.add(reason)
            log.warning(
                "hcp.attention with %s runs outside the compiled graph (a graph break per call); "
                "under torch.compile use a kernel backend and head_chunks=1",
                reason,
            )
    if not isinstance(cp, CPMesh) or not op_expressible(q, k, v, cp, spec, sinks, backend_arg):
        return None
    cu_seqlens = spec.cu_seqlens
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(list(cu_seqlens), dtype=torch.int64)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    op_spec = replace(spec, backend=backend_arg, cu_seqlens=cu_seqlens, mask=_mask_arg(spec.mask))
    out, lse = torch.ops.hybrid_cp.attention_fwd(q, k, v, sinks, _mesh_key(cp), needs_grad, *op_spec.op_args())[:2]
    return (out, lse) if spec.return_lse else out
