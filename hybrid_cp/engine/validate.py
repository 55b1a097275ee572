"""`hcp.attention`'s argument checks.

`own_attention_checks` raises a `CPError` subclass for inputs this rank can judge alone and returns what the
call runs with (`Checked`: the row's layout, the kernel, the window) and its `AttentionSignature`;
`checked_call` then asks `agreement.agree_across_ranks` to make every rank of the cp group raise when one
rank failed or the ranks were called differently (docs/errors.md, "Validation"). `op_expressible` says
whether a call's argument types fit the compiled op's schema.

This module sits above `layout` and `kernels` (which it asks what a call means).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from topology.layouts import Layout, granularity
from topology.masks import AttnMask

from ..errors import ConfigError, CPError, InputTypeError, ShapeError
from .agreement import (
    MeshLike,
    agree_across_ranks,
    digest,
    history,  # noqa: F401 (docs/errors.md named it here: hybrid_cp.engine.validate.history)
    require_mesh,
    validates,
)
from .kernels import AttentionKernel, can_on, get_kernel, kernel_needs, kernels_that_can
from .layout import check_shards, row_layout
from .rules import is_int, positive_int
from .spec import AttentionSpec

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
    documents: int = 0  # digest of the packed row's document lengths (and of the mask in effect)
    window_left: int = -1
    window_right: int = -1
    backend: int = 0  # digest of the kernel's name
    needs_grad: int = 0
    head_chunks: int = 0
    softcap: int = 0  # digest of the soft-cap (0: none)
    sinks: int = 0  # digest of the sinks' shape and dtype (and values, validate="always"/"debug"); 0: none
    v_head_dim: int = 0
    chunk_size: int = 0  # 0: no chunking
    softmax_scale: int = 0  # digest of the scale in effect

    labels = (
        "batch",
        "local length",
        "heads",
        "kv heads",
        "head_dim",
        "dtype",
        "causal",
        "seq_len",
        "cu_seqlens or mask (checksum)",
        "window",
        "window right",
        "backend",
        "needs grad",
        "head_chunks",
        "softcap (checksum)",
        "sinks (checksum)",
        "v head_dim",
        "chunk_size",
        "softmax_scale (checksum)",
    )


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
            raise ShapeError(
                f"{name} has stride {x.stride(-1)} in head_dim; the kernels need a unit stride: "
                f"pass {name}.contiguous()"
            )
    if q.device.type != cp.device.type:
        raise ConfigError(
            f"q is on {q.device} but the cp mesh was built for {cp.device}; "
            f"move the inputs to {cp.device} or rebuild the mesh with device=..."
        )


def _check_shapes(q, k, v, cp, cu_seqlens) -> None:
    b, s, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ShapeError(
            f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} differ in batch, local length or "
            f"KV heads; k and v may differ only in the head dim (the last one)"
        )
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ShapeError(
            f"k.shape={tuple(k.shape)} does not match q.shape={tuple(q.shape)} in batch, "
            f"local length or head_dim; k must be [{b}, {s}, H_kv, {d}] (and v [{b}, {s}, H_kv, D_v])"
        )
    hkv = k.shape[2]
    if hkv < 1 or h % hkv:
        raise ShapeError(
            f"q has {h} heads and k/v have {hkv}: the query heads must be a multiple of the "
            f"KV heads (GQA groups); fix num_key_value_heads"
        )
    if h < cp.ulysses_size:
        raise ShapeError(
            f"q has {h} heads but ulysses={cp.ulysses_size}: every ulysses rank needs at least "
            f"one head; use ulysses <= {h} and put the rest of the degree into ring"
        )
    if s == 0:
        raise ShapeError(f"q has local length 0 (shape {tuple(q.shape)}); shard a non-empty sequence")
    if cu_seqlens is not None and b != 1:
        raise ShapeError(
            f"q has batch size {b} with cu_seqlens: a packed row is a batch of one; concatenate the "
            f"documents into one row [1, total, ...] and describe them with cu_seqlens"
        )


_NEED_ARGUMENT = {
    "cu_seqlens_q": "cu_seqlens (or chunk_size, or mask)",
    "window": "window (or mask)",
    "softcap": "softcap",
    "value_head_dim": "a v head dim that differs from q/k's",
}


class Checked(NamedTuple):
    """What the checks of an attention call decided: the row's layout, the kernel (None: a plain
    local-attention callable), the window in effect and, for a masked call, the mask in effect (the
    window folded in)."""

    lay: Layout
    kernel: AttentionKernel | None
    window: tuple | int | None
    mask: AttnMask | None = None


def _check_kernel(q, v, cp, lay: Layout, spec: AttentionSpec, window) -> AttentionKernel | None:
    """The kernel the call runs (None for a plain local-attention callable), after checking it can
    do what the call asks."""
    if _plain_callable(spec.backend):
        if cp.ring_size != 1:
            raise ConfigError(
                f"a plain local-attention callable works with ring=1 only (got ring="
                f"{cp.ring_size}): the ring needs a kernel that returns the log-sum-exp; "
                f"register one with hcp.register_kernel"
            )
        if (
            spec.cu_seqlens is not None
            or window is not None
            or lay.effective_chunk(spec.chunk_size) is not None
            or (lay.padded_len != lay.seq_len and not spec.causal)
            or spec.mask is not None
        ):
            raise ConfigError(
                "a plain local-attention callable cannot mask document boundaries, windows, attention "
                "chunks, an AttnMask or (non-causal) "
                "padding; use a kernel backend, or for dense rows a length divisible by "
                f"{granularity(cp.layout, cp.ulysses_size, cp.ring_size)}"
            )
        return None
    backend = spec.backend
    needs = kernel_keywords(
        lay, spec.cu_seqlens, window, spec.chunk_size, spec.softcap, v.shape[3] != q.shape[3], spec.mask is not None
    )
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[3], needs=needs)
    for keyword in needs:
        if not can_on(kernel, keyword, q.device):
            raise ConfigError(
                f"backend={getattr(kernel, 'name', backend)!r} does not take the {keyword!r} keyword (or "
                f"capability) that {_NEED_ARGUMENT[keyword]} needs on {q.device.type}; kernels that "
                f"can: {kernels_that_can(keyword, q.device)}; see hybrid_cp/engine/kernels/__init__.py"
            )
    return kernel


def _plain_callable(backend: Any) -> bool:
    """A plain local-attention callable attn(q, k, v) -> out, not a kernel name or object."""
    return callable(backend) and not isinstance(backend, (str, AttentionKernel))


def chunk_size_arg(chunk_size: Any) -> int | None:
    """`chunk_size` (Llama 4's attention_chunk_size) if it is None or an int >= 1, else ConfigError."""
    return positive_int(
        "chunk_size",
        chunk_size,
        "an int >= 1, the positions of one attention chunk (each query "
        "sees the keys of its own chunk, counted from its document's start; Llama 4's "
        "attention_chunk_size), or None for no chunking",
        allow_none=True,
    )


def kernel_keywords(
    lay: Layout,
    cu_seqlens: Any,
    window: Any,
    chunk_size: Any,
    softcap: Any = None,  # noqa: PLR0913 (kernel protocol)
    value_head_dim: bool = False,
    masked: bool = False,
) -> list[str]:
    """The keywords (and capabilities) a call needs of its kernel: an attention chunk cuts the rows into
    varlen segments, also in a dense row; a mask's slices reach the kernel as varlen segments with windows."""
    needs = kernel_needs(cu_seqlens, window, softcap, value_head_dim)
    if (masked or lay.effective_chunk(chunk_size) is not None) and "cu_seqlens_q" not in needs:
        needs.append("cu_seqlens_q")
    if masked and "window" not in needs:
        needs.append("window")
    return needs


def mask_in_effect(spec: AttentionSpec) -> AttnMask:
    """A masked call's mask with its window folded in (`AttnMask.within`), after checking that the mask
    is an `AttnMask` and that no argument it replaces was given."""
    if not isinstance(spec.mask, AttnMask):
        raise InputTypeError(
            f"mask={spec.mask!r} must be an hcp.AttnMask (built with AttnMask.documents, blocks, "
            f"prefix_lm, shared_prefix or from_slices) or None"
        )
    for name, value, why in (
        ("causal", spec.causal, "build a causal mask: AttnMask.documents(cu_seqlens, causal=True)"),
        ("cu_seqlens", spec.cu_seqlens, "AttnMask.documents(cu_seqlens) holds the documents"),
        ("seq_len", spec.seq_len, "the mask's seq_len is the row's length"),
        ("chunk_size", spec.chunk_size, "AttnMask.documents(cu, chunk_size=C) holds the chunks"),
    ):
        if value is not None and value is not False:
            raise ConfigError(
                f"{name}={value!r} with mask=: the mask says which keys each query sees; drop {name} ({why})"
            )
    return spec.mask.windowed(spec.window)


def _local_checks(q, k, v, cp, spec: AttentionSpec) -> Checked:
    """Raise for inputs this rank can judge alone; return what the call runs with."""
    require_mesh(cp)
    _check_qkv(q, k, v, cp)
    _check_shapes(q, k, v, cp, spec.cu_seqlens)
    softmax_scale, causal = spec.softmax_scale, spec.causal
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ConfigError(
            f"softmax_scale={softmax_scale!r} must be a positive finite number (or None for 1/sqrt(head_dim))"
        )
    if not isinstance(causal, bool):
        raise InputTypeError(f"causal={causal!r} must be a bool")
    if spec.mask is not None:
        mask = mask_in_effect(spec)
        lay = row_layout(cp, local_len=q.shape[1], mask=spec.mask)
        check_shards(cp, (("q", q), ("k", k), ("v", v)), 1, lay, "hcp.attention")
        return Checked(lay, _check_kernel(q, v, cp, lay, spec, None), None, mask)
    lay = row_layout(cp, local_len=q.shape[1], seq_len=spec.seq_len, cu_seqlens=spec.cu_seqlens, causal=causal)
    check_shards(cp, (("q", q), ("k", k), ("v", v)), 1, lay, "hcp.attention")
    window = lay.effective_window(causal, spec.window)
    kernel = _check_kernel(q, v, cp, lay, spec, window)
    return Checked(lay, kernel, None if kernel is None else window)


# ---- attention variants: logit soft-cap -----------------------------------------------------------


def is_softcap(value: Any) -> bool:
    """None (no soft-cap) or a positive finite number that is not a bool."""
    return value is None or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def check_variants(backend, softcap, sinks) -> None:
    """The variant arguments' own rules: `softcap` a positive finite number or None; a plain
    local-attention callable computes plain softmax attention, so it refuses soft-caps and sinks."""
    if not is_softcap(softcap):
        raise ConfigError(
            f"softcap={softcap!r} must be a positive finite number (scores = softcap * "
            f"tanh(scores / softcap), Gemma 2's attn_logit_softcapping, e.g. 50.0) or None for none"
        )
    plain = _plain_callable(backend)
    for name, value in (("softcap", softcap), ("sinks", sinks)):
        if plain and value is not None:
            raise ConfigError(
                f"{name}= needs a kernel backend: a plain local-attention callable computes plain "
                f"softmax attention; use backend='auto' or a registered kernel"
            )


def check_sinks(sinks, q: torch.Tensor) -> None:
    """`sinks`: None or a floating [H] tensor (one logit per query head, all H heads) on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise InputTypeError(
            f"sinks must be a torch.Tensor [H] (one logit per query head) or None, got {type(sinks).__name__}"
        )
    if not sinks.is_floating_point():
        raise InputTypeError(f"sinks.dtype={sinks.dtype} is not floating point; pass the sink logits as a float tensor")
    if tuple(sinks.shape) != (q.shape[2],):
        raise ShapeError(
            f"sinks has shape {tuple(sinks.shape)}; it must be [H] = [{q.shape[2]}], one logit per "
            f"query head (all heads, the same on every cp rank)"
        )
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


def attention_signature(
    cp, q, k, v, spec: AttentionSpec, checked: Checked, needs_grad: int, sinks=None
) -> AttentionSignature:
    """The signature of a call that passed this rank's checks (variants as digests, so that ranks that
    differ name the field)."""
    b, s, h, d = q.shape
    lay, kernel, window, mask = checked
    left, right = (-1, -1) if window is None else (window, 0) if isinstance(window, int) else window
    name = getattr(kernel, "name", "callable" if kernel is None else str(spec.backend))
    return AttentionSignature(
        b,
        s,
        h,
        k.shape[2],
        d,
        _DTYPE_CODES.get(q.dtype, 0),
        int(spec.causal),
        lay.seq_len,
        digest(lay.doc_lens if mask is None else (lay.doc_lens, mask)),
        left,
        right,
        digest(name),
        int(needs_grad),
        spec.head_chunks,
        softcap=0 if spec.softcap is None else digest(float(spec.softcap)),
        sinks=sinks_digest(cp, sinks),
        v_head_dim=v.shape[3],
        chunk_size=spec.chunk_size or 0,
        softmax_scale=digest(float(spec.softmax_scale or 1 / math.sqrt(d))),
    )


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
    return (
        isinstance(cp, MeshLike)
        and all(isinstance(x, torch.Tensor) for x in (q, k, v))
        and op_window(s.window)[0]
        and isinstance(s.causal, bool)
        and isinstance(s.return_lse, bool)
        and is_int(s.head_chunks)
        and s.head_chunks == 1
        and backend_key != ""
        and (scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)))
        and (s.seq_len is None or is_int(s.seq_len))
        and is_softcap(s.softcap)
        and (s.mask is None or isinstance(s.mask, AttnMask))
        and (sinks is None or isinstance(sinks, torch.Tensor))
        and (s.chunk_size is None or is_int(s.chunk_size))
        and (
            cu is None or isinstance(cu, torch.Tensor) or (isinstance(cu, (list, tuple)) and all(is_int(x) for x in cu))
        )
    )


def own_attention_checks(
    q, k, v, cp, spec: AttentionSpec, sinks, needs_grad: int
) -> tuple[Checked | None, AttentionSignature, Exception | None]:
    """This rank's checks of an attention call: (what it runs with, its signature, None) or, for a call it
    rejects, (None, an empty signature, the error) when the ranks will agree on it (else the error is raised)."""
    error, signature, result = (
        None,
        AttentionSignature(causal=int(spec.causal) if isinstance(spec.causal, bool) else -1),
        None,
    )
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
            raise ConfigError(
                f"head_chunks={spec.head_chunks} needs a kernel backend (the ring path); a plain "
                f"local-attention callable runs all heads at once: use head_chunks=1"
            )
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
        agree_across_ranks(
            cp,
            signature,
            AttentionSignature.labels,
            error,
            "hcp.attention inputs",
            tensors=tensors if error is None else (),
        )


def checked_call(q, k, v, cp, spec: AttentionSpec, sinks=None, needs_grad: int = 0) -> Checked:
    """Every check of an attention call, before any collective: this rank's own (`own_attention_checks`), then,
    with `cp.validate`, the cross-rank agreement on the call's `AttentionSignature`, so that a rank that
    failed or differs makes every rank raise. `needs_grad` is passed in because the compiled path decides it
    at trace time (hybrid_cp/engine/compiled.py)."""
    result, signature, error = own_attention_checks(q, k, v, cp, spec, sinks, needs_grad)
    agree_on_attention(cp, signature, error, (("q", q), ("k", k), ("v", v)))
    return result
