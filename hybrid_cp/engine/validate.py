"""Every check hybrid-cp runs on its arguments.

A rank's own checks (`positive_int`, `mesh_arguments`, `checked_call`'s local part, `batch_arguments`,
`model_inputs`) raise a `CPError` subclass for inputs the rank can judge alone; the calls that lead to a
collective then ask `agreement.agree_across_ranks` to make every rank of the cp group raise when one rank
failed or the ranks were called differently (docs/errors.md, "Validation"). The signatures they agree on
(`AttentionSignature`, `ModelInputSignature`, `BatchSignature`) are defined here.

This module sits below `mesh` (whose degrees it checks) and above `layout` and `kernels` (which it asks
what a call means).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from topology.layouts import Layout, check_layout, granularity

from ..errors import ConfigError, CPError, InputTypeError, ShapeError
from .agreement import (  # noqa: F401 (DestroyedGroup, MeshLike, digest, history: re-exported for their users)
    DestroyedGroup,
    MeshLike,
    agree_across_ranks,
    digest,
    history,
    require_mesh,
    validates,
)
from .kernels import AttentionKernel, can_on, get_kernel, kernel_needs, kernels_that_can
from .layout import check_shards, positions, row_layout
from .spec import AttentionSpec

VALIDATE_MODES = (True, "always", "debug", False)


def checked_on_every_rank(cp: Any, check: Callable[[], Sequence[int]], names: Sequence[str], what: str) -> None:
    """Run this rank's own `check` (raises a CPError on a bad argument, returns the call's signature: ints
    labelled by `names`), then with `cp.validate` agree on it across the cp ranks, so that one rank's bad or
    different argument makes every rank raise before the call's first collective instead of leaving the others
    waiting in it. Inside a compiled graph only the rank's own check runs (the graph's arguments are the same on
    every rank)."""
    if torch.compiler.is_compiling():
        check()
        return
    require_mesh(cp)
    error, signature = None, [0] * len(names)
    try:
        signature = [int(x) for x in check()]
    except (ValueError, TypeError) as exc:
        if not validates(cp) or not isinstance(exc, CPError):
            raise
        error = exc
    if validates(cp):
        agree_across_ranks(cp, signature, names, error, what)


# ---- rules --------------------------------------------------------------------------------------

def is_positive_int(value: Any) -> bool:
    """An int >= 1 that is not a bool (True is an int to Python, never a degree or a count here)."""
    return is_int(value) and value >= 1


def positive_int(name: str, value: Any, meaning: str = "a positive integer", *, where: str = "",
                 allow_none: bool = False) -> Any:
    """`value` if it is a positive int (or None with `allow_none`), else ConfigError
    "[where: ]name=value must be <meaning>"."""
    if (value is None and allow_none) or is_positive_int(value):
        return value
    prefix = f"{where}: " if where else ""
    raise ConfigError(f"{prefix}{name}={value!r} must be {meaning}")



# ---- the mesh's arguments -----------------------------------------------------------------------

def _divisor_hint(world: int) -> str:
    pairs = [f"(ulysses={u}, ring={d // u})" for d in range(1, world + 1) if world % d == 0
             for u in range(1, d + 1) if d % u == 0]
    return ", ".join(pairs[-12:])


def mesh_arguments(ulysses: Any, ring: Any, dp: Any, plan: Any, layout: Any, validate: Any, timeout: Any,
                   world: int) -> tuple[int, int, int]:
    """`init_cp_mesh`'s arguments checked against the world size; returns (ulysses, ring, dp)."""
    if plan is not None:
        if ulysses is not None or ring is not None:
            raise ConfigError("pass either plan=... or ulysses=/ring=, not both")
        ulysses, ring = int(plan.ulysses), int(plan.ring)
        dp = int(getattr(plan, "dp", 0)) or dp
    if ulysses is None or ring is None:
        raise ConfigError("init_cp_mesh needs ulysses= and ring= (or plan=)")
    try:
        check_layout(layout)
    except ValueError as exc:
        raise ConfigError(f"layout={layout!r}: {exc}") from None
    if not (isinstance(validate, bool) or validate in ("always", "debug")):
        raise ConfigError(f"validate={validate!r} must be True (check each new call signature), \"always\" (a "
                          f"cheap check on every call), \"debug\" (full check, metadata checksum, NaN/inf) or "
                          f"False (no check)")
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0):
        raise ConfigError(f"timeout={timeout!r} must be a positive datetime.timedelta (or None to inherit "
                          f"the default process group's timeout)")
    positive_int("ulysses", ulysses)
    positive_int("ring", ring)
    if dp is not None and not is_int(dp):  # ints are judged against the world size below
        positive_int("dp", dp)
    cp = ulysses * ring
    if world % cp != 0:
        raise ConfigError(f"ulysses={ulysses} x ring={ring} = {cp} does not divide the world size "
                          f"{world}; degrees that would work: {_divisor_hint(world)}")
    if dp is None:
        dp = world // cp
    if dp * cp != world:
        raise ConfigError(f"dp={dp} x ulysses={ulysses} x ring={ring} = {dp * cp} != world size "
                          f"{world}; use dp={world // cp} (or leave dp unset)")
    return ulysses, ring, dp


def mesh_device(device: Any) -> torch.device:
    """`init_cp_mesh(device=...)` as a torch.device this process can use (ConfigError otherwise)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a device: {exc}") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise ConfigError(f"device={str(device)!r}: this process has no {device.type} device; pass device='cpu' (gloo) "
                          f"or run where {device.type} is available")
    return device


# ---- hcp.attention ------------------------------------------------------------------------------

_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


class AttentionSignature(NamedTuple):
    """What every cp rank of one `hcp.attention` call must agree on (all zero for a rank that failed)."""

    batch: int = 0
    local_length: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    dtype: int = 0
    causal: int = 0
    seq_len: int = 0
    documents: int = 0      # digest of the packed row's document lengths
    window_left: int = -1
    window_right: int = -1
    backend: int = 0        # digest of the kernel's name
    needs_grad: int = 0
    head_chunks: int = 0
    softcap: int = 0        # digest of the soft-cap (0: none)
    sinks: int = 0          # digest of the sinks' shape and dtype (and values, validate="always"/"debug"); 0: none
    v_head_dim: int = 0
    chunk_size: int = 0     # 0: no chunking
    softmax_scale: int = 0  # digest of the scale in effect

    labels = ("batch", "local length", "heads", "kv heads", "head_dim", "dtype", "causal", "seq_len",
              "cu_seqlens (checksum)", "window", "window right", "backend", "needs grad", "head_chunks",
              "softcap (checksum)", "sinks (checksum)", "v head_dim", "chunk_size", "softmax_scale (checksum)")


def _check_qkv(q, k, v, cp) -> None:
    """Types, dtypes, devices and strides of q/k/v."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ShapeError(f"{name} must be [batch, seq_local, heads, head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise InputTypeError(f"{name}.dtype={x.dtype} is not floating point; pass bf16/fp16/fp32/fp64 tensors")
        if x.dtype != q.dtype:
            raise InputTypeError(f"{name}.dtype={x.dtype} differs from q.dtype={q.dtype}; cast all three to one dtype")
        if x.device != q.device:
            raise ConfigError(f"{name} is on {x.device} but q is on {q.device}; move all three to one device")
        if x.stride(-1) != 1:
            raise ShapeError(f"{name} has stride {x.stride(-1)} in head_dim; the kernels need a unit stride: "
                             f"pass {name}.contiguous()")
    if q.device.type != cp.device.type:
        raise ConfigError(f"q is on {q.device} but the cp mesh was built for {cp.device}; "
                          f"move the inputs to {cp.device} or rebuild the mesh with device=...")


def _check_shapes(q, k, v, cp, cu_seqlens) -> None:
    b, s, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ShapeError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} differ in batch, local length or "
                         f"KV heads; k and v may differ only in the head dim (the last one)")
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ShapeError(f"k.shape={tuple(k.shape)} does not match q.shape={tuple(q.shape)} in batch, "
                         f"local length or head_dim; k must be [{b}, {s}, H_kv, {d}] (and v [{b}, {s}, H_kv, D_v])")
    hkv = k.shape[2]
    if hkv < 1 or h % hkv:
        raise ShapeError(f"q has {h} heads and k/v have {hkv}: the query heads must be a multiple of the "
                         f"KV heads (GQA groups); fix num_key_value_heads")
    if h < cp.ulysses_size:
        raise ShapeError(f"q has {h} heads but ulysses={cp.ulysses_size}: every ulysses rank needs at least "
                         f"one head; use ulysses <= {h} and put the rest of the degree into ring")
    if s == 0:
        raise ShapeError(f"q has local length 0 (shape {tuple(q.shape)}); shard a non-empty sequence")
    if cu_seqlens is not None and b != 1:
        raise ShapeError(f"q has batch size {b} with cu_seqlens: a packed row is a batch of one; concatenate the "
                         f"documents into one row [1, total, ...] and describe them with cu_seqlens")


_NEED_ARGUMENT = {"cu_seqlens_q": "cu_seqlens (or chunk_size)", "window": "window", "softcap": "softcap",
                  "value_head_dim": "a v head dim that differs from q/k's"}


class Checked(NamedTuple):
    """What the checks of an attention call decided: the row's layout, the kernel (None: a plain
    local-attention callable) and the window in effect."""

    lay: Layout
    kernel: AttentionKernel | None
    window: tuple | int | None


def _check_kernel(q, v, cp, lay: Layout, spec: AttentionSpec, window) -> AttentionKernel | None:
    """The kernel the call runs (None for a plain local-attention callable), after checking it can
    do what the call asks."""
    if _plain_callable(spec.backend):
        if cp.ring_size != 1:
            raise ConfigError(f"a plain local-attention callable works with ring=1 only (got ring="
                              f"{cp.ring_size}): the ring needs a kernel that returns the log-sum-exp; "
                              f"register one with hcp.register_kernel")
        if spec.cu_seqlens is not None or window is not None or lay.effective_chunk(spec.chunk_size) is not None or (
                lay.padded_len != lay.seq_len and not spec.causal):
            raise ConfigError("a plain local-attention callable cannot mask document boundaries, windows, attention "
                              "chunks or (non-causal) "
                              "padding; use a kernel backend, or for dense rows a length divisible by "
                              f"{granularity(cp.layout, cp.ulysses_size, cp.ring_size)}")
        return None
    backend = spec.backend
    needs = kernel_keywords(lay, spec.cu_seqlens, window, spec.chunk_size, spec.softcap, v.shape[3] != q.shape[3])
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[3], needs=needs)
    for keyword in needs:
        if not can_on(kernel, keyword, q.device):
            raise ConfigError(f"backend={getattr(kernel, 'name', backend)!r} does not take the {keyword!r} keyword (or "
                              f"capability) that {_NEED_ARGUMENT[keyword]} needs on {q.device.type}; kernels that "
                              f"can: {kernels_that_can(keyword, q.device)}; see hybrid_cp/engine/kernels/__init__.py")
    return kernel


def _plain_callable(backend: Any) -> bool:
    """A plain local-attention callable attn(q, k, v) -> out, not a kernel name or object."""
    return callable(backend) and not isinstance(backend, (str, AttentionKernel))


def chunk_size_arg(chunk_size: Any) -> int | None:
    """`chunk_size` (Llama 4's attention_chunk_size) if it is None or an int >= 1, else ConfigError."""
    return positive_int("chunk_size", chunk_size, "an int >= 1, the positions of one attention chunk (each query "
                        "sees the keys of its own chunk, counted from its document's start; Llama 4's "
                        "attention_chunk_size), or None for no chunking", allow_none=True)


def kernel_keywords(lay: Layout, cu_seqlens: Any, window: Any, chunk_size: Any, softcap: Any = None,
                    value_head_dim: bool = False) -> list[str]:
    """The keywords (and capabilities) a call needs of its kernel: an attention chunk cuts the rows into
    varlen segments, also in a dense row."""
    needs = kernel_needs(cu_seqlens, window, softcap, value_head_dim)
    if lay.effective_chunk(chunk_size) is not None and "cu_seqlens_q" not in needs:
        needs.append("cu_seqlens_q")
    return needs


def _local_checks(q, k, v, cp, spec: AttentionSpec) -> Checked:
    """Raise for inputs this rank can judge alone; return what the call runs with."""
    require_mesh(cp)
    _check_qkv(q, k, v, cp)
    _check_shapes(q, k, v, cp, spec.cu_seqlens)
    softmax_scale, causal = spec.softmax_scale, spec.causal
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and
                                          math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ConfigError(f"softmax_scale={softmax_scale!r} must be a positive finite number (or None "
                          f"for 1/sqrt(head_dim))")
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal={causal!r} must be a bool")
    lay = row_layout(cp, local_len=q.shape[1], seq_len=spec.seq_len, cu_seqlens=spec.cu_seqlens, causal=causal)
    check_shards(cp, (("q", q), ("k", k), ("v", v)), 1, lay, "hcp.attention")
    window = lay.effective_window(causal, spec.window)
    kernel = _check_kernel(q, v, cp, lay, spec, window)
    return Checked(lay, kernel, None if kernel is None else window)


# ---- attention variants: logit soft-cap -----------------------------------------------------------

def is_softcap(value: Any) -> bool:
    """None (no soft-cap) or a positive finite number that is not a bool."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value) and value > 0)


def check_variants(backend, softcap, sinks) -> None:
    """The variant arguments' own rules: `softcap` a positive finite number or None; a plain
    local-attention callable computes plain softmax attention, so it refuses soft-caps and sinks."""
    if not is_softcap(softcap):
        raise ConfigError(f"softcap={softcap!r} must be a positive finite number (scores = softcap * "
                          f"tanh(scores / softcap), Gemma 2's attn_logit_softcapping, e.g. 50.0) or None for none")
    plain = _plain_callable(backend)
    for name, value in (("softcap", softcap), ("sinks", sinks)):
        if plain and value is not None:
            raise ConfigError(f"{name}= needs a kernel backend: a plain local-attention callable computes plain "
                              f"softmax attention; use backend='auto' or a registered kernel")


def check_sinks(sinks, q: torch.Tensor) -> None:
    """`sinks`: None or a floating [H] tensor (one logit per query head, all H heads) on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise InputTypeError(f"sinks must be a torch.Tensor [H] (one logit per query head) or None, got "
                             f"{type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise InputTypeError(f"sinks.dtype={sinks.dtype} is not floating point; pass the sink logits as a float tensor")
    if tuple(sinks.shape) != (q.shape[2],):
        raise ShapeError(f"sinks has shape {tuple(sinks.shape)}; it must be [H] = [{q.shape[2]}], one logit per "
                         f"query head (all heads, the same on every cp rank)")
    if sinks.device != q.device:
        raise ConfigError(f"sinks is on {sinks.device} but q is on {q.device}; move sinks to {q.device}")


def sinks_digest(cp, sinks) -> int:
    """The sinks' shape and dtype (0: none); their values only under validate="always"/"debug" (a host copy
    of H numbers per call; under True a learnable parameter's new values every step would defeat the
    prediction of repeated calls)."""
    if sinks is None:
        return 0
    values = sinks.detach().double().cpu().tolist() if cp.validate in ("always", "debug") else None
    return digest((tuple(sinks.shape), str(sinks.dtype), values))


def attention_signature(cp, q, k, v, spec: AttentionSpec, checked: Checked, needs_grad: int,
                        sinks=None) -> AttentionSignature:
    """The signature of a call that passed this rank's checks (variants as digests, so that ranks that
    differ name the field)."""
    b, s, h, d = q.shape
    lay, kernel, window = checked
    left, right = (-1, -1) if window is None else (window, 0) if isinstance(window, int) else window
    name = getattr(kernel, "name", "callable" if kernel is None else str(spec.backend))
    return AttentionSignature(b, s, h, k.shape[2], d, _DTYPE_CODES.get(q.dtype, 0), int(spec.causal), lay.seq_len,
                              digest(lay.doc_lens), left, right, digest(name), int(needs_grad), spec.head_chunks,
                              softcap=0 if spec.softcap is None else digest(float(spec.softcap)),
                              sinks=sinks_digest(cp, sinks), v_head_dim=v.shape[3], chunk_size=spec.chunk_size or 0,
                              softmax_scale=digest(float(spec.softmax_scale or 1 / math.sqrt(d))))


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def op_window(window: Any) -> tuple[bool, list[int] | None]:
    """(expressible, the compiled op's encoding) of a window: an int W -> [W], (left, right) -> [left, right]."""
    if window is None:
        return True, None
    if is_int(window):
        return True, [window]
    if isinstance(window, (tuple, list)) and len(window) == 2 and all(is_int(x) for x in window):
        return True, [window[0], window[1]]
    return False, None


def op_expressible(q, k, v, cp, spec: AttentionSpec, sinks: Any, backend_key: str) -> bool:
    """Whether an `hcp.attention` call's arguments have the types the compiled custom op takes
    (`backend_key`: a kernel name or registry key, "" for anything else). Values are not judged
    here: the op runs `checked_call`, and a call that is not expressible runs eagerly, which raises
    eager's error for invalid arguments."""
    s, scale, cu = spec, spec.softmax_scale, spec.cu_seqlens
    return (isinstance(cp, MeshLike) and all(isinstance(x, torch.Tensor) for x in (q, k, v))
            and op_window(s.window)[0] and isinstance(s.causal, bool) and isinstance(s.return_lse, bool)
            and is_int(s.head_chunks) and s.head_chunks == 1 and backend_key != ""
            and (scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)))
            and (s.seq_len is None or is_int(s.seq_len)) and is_softcap(s.softcap)
            and (sinks is None or isinstance(sinks, torch.Tensor)) and (s.chunk_size is None or is_int(s.chunk_size))
            and (cu is None or isinstance(cu, torch.Tensor)
                 or (isinstance(cu, (list, tuple)) and all(is_int(x) for x in cu))))


def own_attention_checks(q, k, v, cp, spec: AttentionSpec, sinks, needs_grad: int
                         ) -> tuple[Checked | None, AttentionSignature, Exception | None]:
    """This rank's checks of an attention call: (what it runs with, its signature, None) or, for a call it
    rejects, (None, an empty signature, the error) when the ranks will agree on it (else the error is raised)."""
    error, signature, result = None, AttentionSignature(causal=int(spec.causal) if isinstance(spec.causal, bool)
                                                        else -1), None
    try:
        positive_int("head_chunks", spec.head_chunks, "an integer >= 1 (1: all heads at once)")
        if not isinstance(spec.return_lse, bool):
            raise InputTypeError(f"return_lse={spec.return_lse!r} must be a bool")
        if not isinstance(spec.overlap, bool):
            raise InputTypeError(f"overlap={spec.overlap!r} must be a bool (the head-chunk schedule)")
        check_variants(spec.backend, spec.softcap, sinks)
        chunk_size_arg(spec.chunk_size)
        result = _local_checks(q, k, v, cp, spec)
        check_sinks(sinks, q)
        if spec.head_chunks > 1 and result.kernel is None:
            raise ConfigError(f"head_chunks={spec.head_chunks} needs a kernel backend (the ring path); a plain "
                              f"local-attention callable runs all heads at once: use head_chunks=1")
        signature = attention_signature(cp, q, k, v, spec, result, needs_grad, sinks)
    except (TypeError, ValueError) as exc:
        if not isinstance(exc, CPError):  # e.g. topology's window/boundary checks: give it a documented type
            exc = (ConfigError if isinstance(exc, ValueError) else InputTypeError)(str(exc))
        if not validates(cp):
            raise exc from None
        error, result = exc, None
    return result, signature, error


def agree_on_attention(cp, signature: AttentionSignature, error: Exception | None, tensors) -> None:
    """With `cp.validate`, the cross-rank agreement on an attention call's signature (`tensors`: (name,
    tensor) pairs whose metadata validate="debug" adds)."""
    if validates(cp):
        agree_across_ranks(cp, signature, AttentionSignature.labels, error, "hcp.attention inputs",
                           tensors=tensors if error is None else ())


def checked_call(q, k, v, cp, spec: AttentionSpec, sinks=None, needs_grad: int = 0) -> Checked:
    """Every check of an attention call, before any collective: this rank's own (`own_attention_checks`), then,
    with `cp.validate`, the cross-rank agreement on the call's `AttentionSignature`, so that a rank that
    failed or differs makes every rank raise. `needs_grad` is passed in because the compiled path decides it
    at trace time (hybrid_cp/engine/compiled.py)."""
    result, signature, error = own_attention_checks(q, k, v, cp, spec, sinks, needs_grad)
    agree_on_attention(cp, signature, error, (("q", q), ("k", k), ("v", v)))
    return result


# ---- hcp.shard_batch ----------------------------------------------------------------------------

def batch_arguments(batch: Any, ignore_index: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`shard_batch`'s checks of the whole batch; returns (input_ids, attention_mask, position_ids as
    [B or 1, S])."""
    if not isinstance(batch, Mapping):
        raise InputTypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    if "input_ids" not in batch or not isinstance(batch["input_ids"], torch.Tensor):
        raise ShapeError(f"batch needs an 'input_ids' tensor [batch, seq] (got keys {sorted(batch)}); "
                         f"pass the full-sequence token ids as batch['input_ids']")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ShapeError(f"batch['input_ids'] must be [batch, seq], got shape {tuple(ids.shape)}; "
                         f"add a batch dimension with input_ids[None]")
    if ids.is_floating_point():
        raise ConfigError(f"batch['input_ids'] has dtype {ids.dtype}; token ids must be integers")
    b, s = ids.shape
    if s == 0 or b == 0:
        raise ShapeError(f"batch['input_ids'] has shape {tuple(ids.shape)}; it needs at least one sequence "
                         f"and one token")
    if not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index={ignore_index!r} must be an int")
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise ShapeError(f"batch['attention_mask'] must be a [batch, seq] 0/1 padding mask, got "
                         f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}; 4-D or custom masks are "
                         f"not supported under context parallelism (attention is causal over the sequence)")
    _check_per_token_shapes(batch, b, s)
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 1:
        if pos.shape[0] != s:
            raise ShapeError(f"batch['position_ids'] has length {pos.shape[0]} but input_ids has {s}")
        pos = pos[None]
    return ids, mask, pos


class BatchSignature(NamedTuple):
    """What every cp rank's `shard_batch` call must agree on: the same full batch (a checksum of its ids)."""

    batch: int = 0
    length: int = 0
    input_ids: int = 0      # checksum of the token ids
    labels: int = 0         # checksum of the labels (0: none)
    keys: int = 0           # digest of the batch's keys

    labels_ = ("batch", "length", "input_ids (checksum)", "labels (checksum)", "keys")


def content_checksum(t: Any) -> int:
    """A position-weighted checksum of an integer tensor's values (0 for anything else): two ranks given
    different batches disagree on it (one pass over the tokens; a host sync for a device tensor)."""
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.numel() == 0:
        return 0
    flat = t.reshape(-1).to(torch.int64)
    weights = (torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 2654435761) % 2147483647
    return int((flat * weights).sum()) & (2 ** 62 - 1)


def batch_signature(batch: Mapping[str, Any]) -> BatchSignature:
    """The signature of a batch that passed this rank's checks."""
    ids = batch["input_ids"]
    return BatchSignature(ids.shape[0], ids.shape[1], content_checksum(ids),
                          content_checksum(batch.get("shift_labels", batch.get("labels"))), digest(sorted(batch)))


def agree_on_batch(cp, batch: Any, error: Exception | None) -> None:
    """Every cp rank raises if one rank's batch failed its checks or the ranks were given different batches
    (checked on every call: the batch changes every step, so no call is predicted)."""
    if validates(cp):
        signature = batch_signature(batch) if error is None else BatchSignature()
        agree_across_ranks(cp, signature, BatchSignature.labels_, error, "hcp.shard_batch batch (the same full "
                           "batch on every rank of a cp group)", learn=False)


def _check_per_token_shapes(batch: Mapping[str, Any], b: int, s: int) -> None:
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if key == "position_ids" and value.shape[0] == 1:
            pass
        elif value.shape[0] != b:
            raise ShapeError(f"batch[{key!r}] has batch size {value.shape[0]} (shape {tuple(value.shape)}) but "
                             f"input_ids has {b}; every per-token tensor must be [{b}, {s}, ...]")
        if value.shape[1] != s:
            raise ShapeError(f"batch[{key!r}] has sequence length {value.shape[1]} (shape {tuple(value.shape)}) "
                             f"but input_ids has {s}; every per-token tensor must be [{b}, {s}, ...] over "
                             f"the same full sequence")


def right_padding(mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """Return the mask as bool after checking every row is ones then zeros (right padding)."""
    if mask.dtype == torch.bool:
        m = mask
    else:
        if mask.is_floating_point() or mask.is_complex():
            raise ConfigError(f"{name} has dtype {mask.dtype}; pass a 0/1 integer or bool padding mask "
                              f"(additive float masks are not supported under context parallelism)")
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ConfigError(f"{name} holds values other than 0 and 1 (e.g. {mask[bad][0].item()}); pass a "
                              f"0/1 padding mask")
        m = mask != 0
    # right padding: once a row turns 0 it stays 0, i.e. the mask never increases along the row
    if m.shape[-1] > 1 and bool((m[..., 1:] & ~m[..., :-1]).any()):
        rows = torch.nonzero((m[..., 1:] & ~m[..., :-1]).any(-1)).flatten().tolist()
        raise ConfigError(f"{name} is not right padding in batch rows {rows[:8]} (a 0 is followed by a 1: left "
                          f"padding, holes or packed documents). Context-parallel attention is causal over the "
                          f"whole sequence, which is exact only for right padding; right-pad the batch "
                          f"(tokenizer padding_side='right') or drop the mask")
    return m


def dense_labels(labels: Any) -> None:
    """A dense batch's labels: a [batch, seq] integer tensor (or None: the input ids)."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ShapeError(f"batch['labels'] must be a [batch, seq] integer tensor, got "
                         f"{getattr(labels, 'shape', type(labels).__name__)}")
    if labels.is_floating_point():
        raise ConfigError(f"batch['labels'] has dtype {labels.dtype}; labels must be integer token ids")


def dense_positions(pos: torch.Tensor | None) -> None:
    """A dense batch's position ids increase by one along each row (an offset is fine)."""
    if pos is None:
        return
    if pos.is_floating_point():
        raise ConfigError(f"batch['position_ids'] has dtype {pos.dtype}; position ids must be integers")
    if pos.shape[-1] > 1 and bool((pos[:, 1:] - pos[:, :-1] != 1).any()):
        raise ConfigError("batch['position_ids'] do not increase by one along the sequence, nor restart at 0 "
                          "per document (packed rows); custom positions are not supported: drop position_ids "
                          "(the default is 0..S-1), pass arange-like rows, or pack documents into one row "
                          "whose positions restart at 0 (or give cu_seq_lens_q)")


# ---- a transformers model's inputs --------------------------------------------------------------

class ModelInputSignature(NamedTuple):
    """What every cp rank of one model call must agree on."""

    batch: int = 0
    local_length: int = 0
    has_mask: int = 0
    documents: int = 0   # digest of the packed row's document lengths, 0 for a dense row
    loss: int = 0        # labels given: every rank joins the loss's all-reduce

    labels = ("batch", "local length", "has mask", "cu_seq_lens_q (checksum)", "labels given")


def _model_call_options(kwargs: Mapping[str, Any]) -> None:
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None and shifted is None:
        raise ConfigError("labels= was passed to a context-parallel model without shift_labels=: the model would "
                          "shift the labels inside this rank's shard, so the target of its last token (on another "
                          "rank) would be wrong. Pass the output of hcp.shard_batch as it is (its labels are "
                          "already shifted on the full sequence and it carries them as shift_labels too), or "
                          "call the model without labels and use hcp.cross_entropy(logits, batch['labels'], cp)")
    ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if shifted is not None and (not isinstance(shifted, torch.Tensor) or tuple(shifted.shape) != tuple(ref.shape[:2])):
        raise ShapeError(f"shift_labels must be this rank's [batch, seq_local] = {list(ref.shape[:2])} next-token "
                         f"targets from hcp.shard_batch, got {getattr(shifted, 'shape', type(shifted).__name__)}")
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ConfigError(f"{name}= was passed: KV caches (generation) are not supported under context "
                              f"parallelism; run generation on one device")
    if kwargs.get("use_cache"):
        raise ConfigError("use_cache=True is not supported under context parallelism (training only); "
                          "pass use_cache=False")


def _model_positions(cp, kwargs: dict, ref: torch.Tensor, lay: Layout, packed: bool) -> None:
    """Fill in missing position ids with this rank's, or check the given ones are them."""
    b, s = ref.shape[0], ref.shape[1]
    cu = kwargs.get("cu_seq_lens_q")
    expected = positions(None if packed else lay.seq_len, cp, device=ref.device, cu_seqlens=cu)
    pos = kwargs.get("position_ids")
    if pos is None:
        kwargs["position_ids"] = expected[None].expand(b, -1)
        return
    if pos.dim() == 1:
        pos = pos[None]
    if pos.shape[-1] != s:
        raise ShapeError(f"position_ids has local length {pos.shape[-1]} but input has {s}; pass "
                         f"batch['position_ids'] from hcp.shard_batch")
    offset = pos - expected
    if bool((offset != offset[:, :1]).any()) or (packed and bool((offset != 0).any())):
        raise ShapeError("position_ids are not the positions of this rank's tokens (they differ from "
                         "hcp.positions(...) by more than a constant, or for a packed row at all): pass "
                         "batch['position_ids'] from hcp.shard_batch, or none (the default is filled in)")


def _model_local_checks(cp, kwargs: dict) -> ModelInputSignature:
    """This rank's checks of a model call (filling in missing position ids); returns its signature."""
    ids, embeds, mask = kwargs.get("input_ids"), kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    ref = ids if ids is not None else embeds
    if ref is None:
        raise ConfigError("the model needs input_ids=... (or inputs_embeds=...): this rank's shard from "
                          "hcp.shard_batch")
    b, s = ref.shape[0], ref.shape[1]
    _model_call_options(kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    if cu is None and isinstance(pos, torch.Tensor) and pos.dim() >= 1 and pos.shape[-1] > 1 and \
            bool((pos[..., 1:] < pos[..., :-1]).any()):
        raise ConfigError("position_ids decrease inside this rank's row (packed documents, e.g. from "
                          "DataCollatorWithFlattening) but no cu_seq_lens_q was passed, so the document boundaries "
                          "of the whole row are unknown on this rank: shard the packed batch with hcp.shard_batch "
                          "and pass its output as it is (it adds cu_seq_lens_q/cu_seq_lens_k)")
    lay = row_layout(cp, local_len=s, cu_seqlens=cu, causal=True, what="the model's input")
    if cu is not None and (mask is not None or b != 1):
        raise ConfigError("a packed row (cu_seq_lens_q) is one row without attention_mask: pass the output of "
                          "hcp.shard_batch for the packed batch as it is")
    _model_positions(cp, kwargs, ref, lay, cu is not None)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape != (b, s):
            raise ShapeError(f"attention_mask must be this rank's [batch, seq_local] = [{b}, {s}] 0/1 padding "
                             f"mask from hcp.shard_batch, got {getattr(mask, 'shape', type(mask).__name__)}; "
                             f"4-D and custom masks are not supported under context parallelism")
        if mask.is_floating_point() or bool(((mask != 0) & (mask != 1)).any()):
            raise ConfigError("attention_mask must hold 0/1 (or bool) padding flags; additive float masks are "
                              "not supported under context parallelism")
    return ModelInputSignature(b, s, int(mask is not None), 0 if cu is None else digest(lay.doc_lens),
                               int(kwargs.get("labels") is not None))


def model_inputs(cp, kwargs: dict) -> dict:
    """Check a transformers model call's keyword arguments on this rank, agree on them across the cp
    group, and check a padding mask is right padding over the whole sequence. Returns the arguments
    with missing `position_ids` filled in."""
    kwargs = dict(kwargs)
    error, signature = None, ModelInputSignature()
    try:
        signature = _model_local_checks(cp, kwargs)
    except ValueError as exc:
        if not validates(cp):
            raise
        error = exc
    if validates(cp):
        agree_across_ranks(cp, signature, ModelInputSignature.labels, error, "model inputs")
    if kwargs.get("attention_mask") is not None:
        global_right_padding(cp, kwargs["attention_mask"], kwargs["position_ids"])
    return kwargs


def global_right_padding(cp, mask: torch.Tensor, pos: torch.Tensor) -> None:
    """Right padding over the whole sequence: every kept token's position < every masked one's."""
    keep = mask.bool()
    pos = pos.expand(keep.shape[0], -1).to(torch.int64)
    big = torch.iinfo(torch.int64).max // 2
    last_kept = torch.where(keep, pos, torch.full_like(pos, -big)).amax(-1)
    first_masked = torch.where(~keep, pos, torch.full_like(pos, big)).amin(-1)
    stats = torch.stack([last_kept, -first_masked], dim=-1).to(cp.device)
    if cp.size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=cp.cp_group)
    rows = torch.nonzero(stats[:, 0] > -stats[:, 1]).flatten().tolist()
    if rows:
        raise ConfigError(f"attention_mask is not right padding over the whole sequence in batch rows {rows[:8]} (a "
                          f"masked token comes before a kept one): context-parallel attention is causal, exact only "
                          f"for right padding; right-pad the batch or drop the mask")
