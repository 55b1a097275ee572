"""Run a Hugging Face transformers causal LM with context-parallel attention.

`apply_context_parallel(model, cp)` registers one attention function with transformers'
attention-function registry (`AttentionInterface`) under the name "hybrid_cp" and switches the
model to it; each attention layer then calls `hcp.attention` on this rank's shard. Nothing of the
model's code is copied or patched: projections, rotary embeddings, norms and MLPs run unchanged on
the local tokens, which is exact because they act token by token (given the right position ids).
That premise is checked, not assumed: `model_support.check_model` accepts only the families verified
exact and refuses every model with a module that mixes tokens outside the attention function.

A forward pre-hook on the model makes the call contract hard to get wrong:
- missing `position_ids` are filled in with the global positions of this rank's tokens;
- `labels` come with `shift_labels` (both from `hcp.shard_batch`: next-token targets shifted on the full
  sequence); the model's `loss_function` is replaced by `hcp.cross_entropy` over the cp group, so
  `model(**shard).loss` is the group's token mean (with `num_items_in_batch`, the Trainer's global count,
  this rank's token sum over it, as on a DDP rank); `labels` alone raise (the model would shift them
  inside the shard);
- a 2-D `attention_mask` must be right padding over the whole sequence (checked across the cp
  group), and is then dropped: causal attention is exact for the real tokens; anything else raises;
- packed rows (from `hcp.shard_batch`) carry the global document boundaries as transformers'
  flash-attention keywords ``cu_seq_lens_q``/``cu_seq_lens_k``; they reach every attention layer,
  and position ids must be the per-document positions of this rank's tokens;
- masked rows (`hcp.shard_batch(..., mask=m)`) carry their `hcp.AttnMask` under ``hcp_attn_mask``
  (`training.batch.MASK_KEY`); it reaches every attention layer the same way, which runs `hcp.attention`
  under it (a layer's sliding window narrows it); position ids are the caller's own;
- KV caches (generation) are refused.

The attention function passes what the module gives it and what its layer is: attention sinks
(``s_aux``), the logit soft-cap (``softcap``), the value head dim (from ``value``), the chunk size of
a chunked layer (read from the config: transformers hands a custom attention function no mask), and
for Llama 4's temperature-tuned NoPE layers it rescales the queries to the tokens' own positions.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from topology.heads import module_chunks

from ..engine.attention import run_attention
from ..engine.layout import boundaries, positions, row_layout
from ..engine.masks import AttnMask
from ..engine.mesh import CPMesh
from ..engine.modulechunk import Projected, pipelined_module_chunks
from ..engine.rules import is_int, is_positive_int, positive_int
from ..engine.spec import AttentionSpec
from ..errors import ConfigError, InputTypeError, SetupError, ShapeError
from ..training.batch import MASK_KEY
from ..training.loss import cross_entropy
from .linear_layers import is_routed, route_linear_layers
from .mask_interface import UnreadMask, note_model, transformers_mask
from .model_inputs import model_inputs
from .model_support import (
    VISION_LANGUAGE_FAMILIES,
    check_attention_kwargs,
    check_head_layout,
    check_model,
    media_refusal,
)
from .rope import route_rotaries, row_extent
from .router_aux import install_router_aux

ATTN_IMPLEMENTATION = "hybrid_cp"
_HOOK_ATTR = "_hybrid_cp_hook"


class _MeshRef:
    """Holds the mesh on each module; copying a model shares it instead of copying process groups."""

    __slots__ = ("cp", "head_chunks", "overlap", "rotaries", "row", "packed", "fixed", "padding")

    def __init__(self, cp: CPMesh, head_chunks: int = 1, overlap: bool = False):
        self.cp = cp
        self.head_chunks = head_chunks
        self.overlap = overlap  # the head-chunk schedule (AttentionSpec.overlap)
        self.rotaries = 0  # rotary modules that read the row's extent (`rope.route_rotaries`)
        self.row = None  # ... and that extent, of the model's current call (`rope.row_extent`)
        self.packed = False  # whether the current call is a packed row (routed mixers check they got its boundaries)
        self.fixed = ""  # what bound `cp` at patch time (module chunks, linear layers): `use_mesh` refuses then
        self.padding = None  # the current call's attention mask (`router_aux`: the tokens its statistics count)

    def __deepcopy__(self, memo):
        return self


def _unsupported(msg: str) -> ConfigError:
    return ConfigError(
        msg + " (hybrid_cp.integrations.transformers supports causal attention, with sliding "
        "windows, chunked layers, attention sinks, logit soft-capping, right padding or packed "
        "documents; no dropout)"
    )


def _layer_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4: `config.layer_types[layer_idx] ==
    "chunked_attention"`, `config.attention_chunk_size`). transformers builds that layer's mask from the
    config and hands this attention function none, so the size is read where the model reads it."""
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None) or ()
    if "chunked_attention" not in kinds:
        return None
    i = getattr(module, "layer_idx", None)
    if not is_int(i) or not 0 <= i < len(kinds):
        raise _unsupported(
            f"{type(module).__name__} has layer_idx={i!r}, so which of config.layer_types (with "
            f"chunked_attention layers) it is cannot be told; its attention would be computed wrong"
        )
    if kinds[i] != "chunked_attention":
        return None
    size = getattr(config, "attention_chunk_size", None)
    if not is_positive_int(size):
        raise _unsupported(
            f"{type(module).__name__} (layer {i}) is a chunked_attention layer but "
            f"config.attention_chunk_size={size!r}; expected a positive int"
        )
    return size


def _variants(module: torch.nn.Module, kwargs: dict) -> tuple[torch.Tensor | None, dict]:
    """hcp.attention's `sinks`, and its `softcap` and `chunk_size` settings for this call, those that are set:
    `s_aux` (attention sinks, gpt-oss) and `softcap` (Gemma 2) only when they are the module's own
    (`module.sinks`, `module.attn_logit_softcapping`): the eager attention of a family without them ignores such
    a keyword from the caller, so computing it would differ; the chunk size of a chunked layer (`_layer_chunk`)."""
    out = {}
    sinks, cap = kwargs.get("s_aux"), kwargs.get("softcap")
    if sinks is not None and sinks is not getattr(module, "sinks", None):
        raise _unsupported(
            f"{type(module).__name__} received s_aux (attention sinks) that is not its own "
            f"`sinks` parameter; pass no s_aux to the model"
        )
    if cap is not None:
        if cap != getattr(module, "attn_logit_softcapping", None):
            raise _unsupported(
                f"{type(module).__name__} received softcap={cap!r} (attention logit soft-capping) but "
                f"its config.attn_logit_softcapping is {getattr(module, 'attn_logit_softcapping', None)!r}"
                f"; pass no softcap to the model"
            )
        out["softcap"] = cap
    chunk = _layer_chunk(module)
    if chunk is not None:
        out["chunk_size"] = chunk
    return sinks, out


def _temperature(module: torch.nn.Module, q: torch.Tensor, cp: CPMesh, lay, cu: Any) -> torch.Tensor:
    """Llama 4's NoPE layers (`attn_temperature_tuning`) scale each query by
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, with p = arange(tokens the module got): under CP the
    local index, not the token's position. Rescale q [B, S_local, H, D] to the token's own position (global in
    a dense row, inside its document in a packed row: what one process computes for the unpacked sequence)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return q

    def scale(p: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((p.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    own = positions(None if cu is not None else lay.seq_len, cp, q.device, cu_seqlens=cu)
    ratio = scale(own) / scale(torch.arange(q.shape[1], device=q.device))
    return (q * ratio.view(1, -1, 1, 1)).to(q.dtype)


def _row_of_call(module: torch.nn.Module, cp: CPMesh, local_len: int, kwargs: dict) -> tuple[dict, Any]:
    """The row settings of an attention call (causal with seq_len, packed with cu_seqlens, or an `hcp.AttnMask`
    from `MASK_KEY`, which replaces both) and its layout."""
    name = type(module).__name__
    cu, mask = kwargs.get("cu_seq_lens_q"), kwargs.get(MASK_KEY)
    if mask is not None:
        if cu is not None or kwargs.get("cu_seq_lens_k") is not None:
            raise _unsupported(f"{name} received cu_seq_lens_q/k with {MASK_KEY}=: the AttnMask holds the documents")
        if not isinstance(mask, AttnMask):
            raise ConfigError(
                f"{name} received {MASK_KEY}={mask!r}; expected an hcp.AttnMask (from "
                f"hcp.shard_batch(batch, cp, mask=m))"
            )
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            raise _unsupported(
                f"{name} scales its queries by their positions (attn_temperature_tuning), not verified with {MASK_KEY}="
            )
        return dict(mask=mask), row_layout(cp, local_len=local_len, mask=mask, what=name)
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and (cu is None or boundaries(cu_k) != boundaries(cu)):
        raise _unsupported(
            f"{name} received cu_seq_lens_k different from cu_seq_lens_q; packed "
            f"self-attention needs the same boundaries for queries and keys"
        )
    lay = row_layout(cp, local_len=local_len, cu_seqlens=cu, causal=True, what=name)
    return dict(causal=True, seq_len=None if cu is not None else lay.seq_len, cu_seqlens=cu), lay


def _check_prepared_mask(module: torch.nn.Module, attention_mask: Any, kwargs: dict) -> None:
    """Refuse, by name, every mask the call would otherwise drop: a non-causal module, a prepared mask tensor, or a
    mask transformers composed of parts we do not read (`mask_interface.UnreadMask`), unless the batch carries the
    row's `hcp.AttnMask` (`MASK_KEY`), which then says which keys each query sees."""
    name, given = type(module).__name__, kwargs.get(MASK_KEY) is not None
    fix = (
        "build the row's mask as an hcp.AttnMask (AttnMask.blocks for image tokens, documents(..., causal=False) "
        "for bidirectional rows, from_slices for anything else) and pass it with hcp.shard_batch(batch, cp, mask=m)"
    )
    if (not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False) and not given:
        raise _unsupported(f"{name} is not causal; {fix}")
    if isinstance(attention_mask, UnreadMask):
        if not given:
            raise _unsupported(
                f"{name}: transformers built this model's mask from {attention_mask.describe()}, "
                f"which hybrid-cp does not read from transformers (it would run causally); {fix}"
            )
    elif attention_mask is not None:
        raise _unsupported(
            f"{name} received a prepared attention mask "
            f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}; only causal "
            f"attention with right padding is supported (pass a 2-D padding mask or none), or {fix}"
        )


def hybrid_cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query/key [B, H or H_kv, S_local, D], value [B, H_kv, S_local, Dv].

    Returns (attn_output [B, S_local, H, Dv], None).
    """
    ref = getattr(module, "_hybrid_cp_mesh", None)
    if ref is None:
        raise SetupError(
            f"{type(module).__name__} runs with attn_implementation={ATTN_IMPLEMENTATION!r} but has "
            f"no cp mesh; call hybrid_cp.integrations.transformers.apply_context_parallel(model, cp)"
        )
    cp = ref.cp
    if dropout and dropout > 0:
        raise _unsupported(
            f"attention dropout={dropout} in {type(module).__name__}; set "
            f"config.attention_dropout=0.0 for context-parallel training"
        )
    _check_prepared_mask(module, attention_mask, kwargs)
    check_attention_kwargs(module, kwargs)
    if _CAPTURE not in module.__dict__:  # a module chunk's call holds its chunk of the heads
        check_head_layout(module, query)
    window = kwargs.get("sliding_window")
    if window is not None and not is_positive_int(window):
        raise _unsupported(
            f"{type(module).__name__} passed sliding_window={window!r}; expected a positive int (the "
            f"number of keys each query sees, itself included)"
        )
    row, lay = _row_of_call(module, cp, query.shape[2], kwargs)
    if torch.is_autocast_enabled(query.device.type):  # fp32 weights under autocast (Trainer bf16=True): the
        dt = torch.get_autocast_dtype(query.device.type)  # projections give bf16, rotary fp32; eager's matmuls
        query, key, value = (x.to(dt) for x in (query, key, value))  # would run all three in the autocast dtype
    q = _temperature(module, query.transpose(1, 2), cp, lay, row.get("cu_seqlens")).contiguous()
    k = key.transpose(1, 2).contiguous()
    v = value.transpose(1, 2).contiguous()
    sinks, variants = _variants(module, kwargs)
    if row.get("mask") is not None and "chunk_size" in variants:
        raise _unsupported(
            f"{type(module).__name__} is a chunked_attention layer, called with {MASK_KEY}=: its "
            f"chunks cannot be cut from an AttnMask shared by every layer (Llama 4); train it on "
            f"causal or packed rows"
        )
    spec = AttentionSpec(
        softmax_scale=scaling,
        window=window,
        overlap=ref.overlap,
        head_chunks=module.__dict__.get("_hybrid_cp_engine_chunks", ref.head_chunks),
        **row,
        **variants,
    )
    mode = module.__dict__.get(_CAPTURE)
    if mode == "project":  # a module chunk's projections are done: hand them to the chunk pipeline
        raise _Captured(Projected(q, k, v, spec, sinks))
    if mode == "probe":  # the structure check of module chunks: return q itself as the attention output
        module.__dict__[_PROBE_OUT] = q
        return q, None
    return run_attention(q, k, v, cp, spec, sinks), None


class _CPLoss:
    """The model's `loss_function` under context parallelism (transformers calls it with this rank's logits and
    the `labels`/`shift_labels`/`num_items_in_batch` the model got), on the already shifted targets:

    - without `num_items_in_batch`: `hcp.cross_entropy`, so `model(**hcp.shard_batch(batch, cp)).loss` is the
      token mean over the whole cp group (its gradient convention: average the ranks' gradients);
    - with `num_items_in_batch` (the Trainer's count of label tokens over the whole global batch): this rank's
      share, the sum over its own tokens divided by that count, which is what transformers' loss is on each
      DDP rank; the shares of all ranks sum to the global token mean, and the Trainer's world-size factor and
      DDP's gradient average make the update the single-process one. No communication."""

    def __init__(self, ref: _MeshRef):
        self.ref = ref

    def __deepcopy__(self, memo):
        return self

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        targets = shift_labels if shift_labels is not None else labels
        if targets is None:  # the forward pre-hook refuses labels without shift_labels
            raise ConfigError("the context-parallel loss needs shift_labels= (hcp.shard_batch's labels)")
        targets = targets.to(logits.device)
        if num_items_in_batch is None:
            return cross_entropy(logits, targets, self.ref.cp, ignore_index)
        own = cross_entropy(logits, targets, self.ref.cp, ignore_index, reduction="none").sum()
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(own.device)
        return own / num_items_in_batch


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hybrid_cp_attention_forward)
    # transformers then hands us the mask it composed instead of none (hybrid_cp/integrations/mask_interface.py)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, transformers_mask)


@torch.compiler.disable  # host-side checks and a collective: runs eagerly under torch.compile (no recompiles)
def _pre_forward(ref: _MeshRef, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The model's positional inputs as keywords, checked and agreed on across the cp group
    (`model_inputs.model_inputs`, which fills in missing position ids); the padding mask, once checked,
    is dropped (causal attention is exact for the real tokens of right-padded rows); the row's extent for
    rotaries that depend on it (`rope`)."""
    cp = ref.cp
    if args:
        kwargs = dict(kwargs)
        for name, value in zip(("input_ids", "attention_mask", "position_ids"), args):
            kwargs[name] = value
        args = ()
    # media given to the model: refused through the input agreement, on every rank (before any other collective)
    kwargs = model_inputs(cp, kwargs, refusal=media_refusal(module, kwargs))
    ref.packed = kwargs.get("cu_seq_lens_q") is not None
    if kwargs.get(MASK_KEY) is not None:
        _refuse_masked(module)
    if ref.rotaries:
        ref.row = row_extent(cp, kwargs)
    ref.padding = kwargs.get("attention_mask")  # the router's load-balancing loss counts the real tokens
    if kwargs.get("attention_mask") is not None:
        kwargs["attention_mask"] = None
    kwargs["use_cache"] = False
    return args, kwargs


def _refuse_masked(model: torch.nn.Module) -> None:
    """A masked call (`MASK_KEY`) of a model whose sequence mixers outside attention (Mamba2, Gated DeltaNet: routed
    mixers) or length-dependent rotaries could not follow the mask: refused by name (after the inputs were agreed,
    so on every rank alike)."""
    mixers = sorted({type(m).__name__ for m in model.modules() if is_routed(m)})
    if mixers:
        raise ConfigError(
            f"{MASK_KEY}= (an hcp.AttnMask) with sequence mixers {mixers}: their scans run along the "
            f"row, not under an attention mask; train this model on causal or packed rows"
        )
    ref = model.__dict__.get("_hybrid_cp_mesh")
    if ref is not None and ref.rotaries:
        raise ConfigError(
            f"{MASK_KEY}= (an hcp.AttnMask) with a rotary embedding whose frequencies depend on the "
            f"row's length (longrope, dynamic NTK): its extent under a mask is not defined; use a "
            f"static rope type or causal/packed rows"
        )


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_CAPTURE = "_hybrid_cp_capture"
_PROBE_OUT = "_hybrid_cp_probe_out"


class _Captured(BaseException):
    """Stops a module's forward at its attention call and carries the chunk's Q/K/V out (a BaseException,
    so that no `except Exception` in model code swallows it)."""

    def __init__(self, projected: Projected):
        self.projected = projected


class _Swapped:
    """Temporarily replace parameters of a module (by dotted name) by tensors, without hooks."""

    def __init__(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor | None]):
        self.module, self.tensors, self.saved = module, tensors, []

    def __enter__(self):
        for path, t in self.tensors.items():
            owner_name, _, name = path.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            self.saved.append((owner, name, owner._parameters[name]))
            owner._parameters[name] = t
        return self

    def __exit__(self, *exc):
        for owner, name, p in reversed(self.saved):
            owner._parameters[name] = p
        self.saved = []


class _ModuleChunks:
    """The forward of an attention module whose heads run in module-level chunks (UPipe from the
    projections on), pipelined by `hybrid_cp.engine.modulechunk`: chunk j's Q/K/V come from the module's own
    forward with its q/k/v projections cut to the chunk's heads (views of the parameters), stopped at
    the attention call; the output projection's columns of the chunk's heads are applied inside."""

    def __init__(
        self,
        module: torch.nn.Module,
        cp: CPMesh,
        kv_ranges: list[tuple[int, int]],
        engine_chunks: int,
        group: int,
        head_dim: int,
        layer=None,
        keep_output: bool | None = None,
    ):
        # the class's forward, taken now: the instance's `forward` becomes this object
        self.module, self.original, self.cp, self.engine_chunks = module, type(module).forward, cp, engine_chunks
        self.kv_ranges, self.group, self.d = kv_ranges, group, head_dim
        self.q_ranges = [(a * group, b * group) for a, b in kv_ranges]
        self.checked = False
        self.layer, self.keep_output = layer, keep_output  # layer: a weakref to the enclosing decoder layer

    def _keep(self) -> bool:
        """Keep the attention outputs for backward: by default only inside a checkpointed layer (free there:
        its first forward keeps nothing, its recomputation saves a forward); unchecked layers would keep
        one output-sized tensor each through the whole forward."""
        if self.keep_output is not None:
            return self.keep_output
        layer = self.layer() if self.layer is not None else None
        return bool(layer is not None and getattr(layer, "gradient_checkpointing", False) and layer.training)

    def _cut(self, name: str, p: torch.Tensor, j: int) -> torch.Tensor:
        a, b = self.kv_ranges[j]
        if name.startswith("q_proj."):
            return p[a * self.group * self.d : b * self.group * self.d]
        if name.startswith(("k_proj.", "v_proj.")):
            return p[a * self.d : b * self.d]
        return p

    def _run(
        self,
        mode: str,
        j: int,
        leaves: list,
        spec,
        names: list[str],
        params: list[torch.Tensor],
        extra: dict | None = None,
    ):
        from torch.utils._pytree import tree_unflatten

        args, kwargs = tree_unflatten(leaves, spec)
        swap = {n: self._cut(n, p, j) for n, p in zip(names, params)}
        self.module.__dict__[_CAPTURE] = mode
        try:
            with _Swapped(self.module, {**swap, **(extra or {})}):
                return self.original(self.module, *args, **kwargs)
        finally:
            self.module.__dict__.pop(_CAPTURE, None)

    def _check_structure(self, leaves: list, spec, names: list[str], params: list[torch.Tensor]) -> None:
        """Once per module: its output must be o_proj(attention output): what the pipeline computes. Runs the
        module's forward for the first chunk with the attention output replaced by q (local, no collective)."""
        qa, qb = self.q_ranges[0]
        w = self.module.o_proj.weight[:, qa * self.d : qb * self.d]
        with torch.no_grad():
            y = self._run("probe", 0, leaves, spec, names, params, {"o_proj.weight": w})[0]
            q = self.module.__dict__.pop(_PROBE_OUT, None)
            expected = None if q is None else F.linear(q.reshape(*q.shape[:2], -1), w, self.module.o_proj.bias)
        if expected is None or y.shape != expected.shape or not torch.allclose(y, expected, rtol=1e-4, atol=1e-5):
            raise ConfigError(
                f"{type(self.module).__name__} does more than o_proj(attention output) after its "
                f"attention call, so its heads cannot run in module-level chunks; pass "
                f"apply_context_parallel(..., chunk_projections=False) (chunks inside hcp.attention)"
            )
        self.checked = True

    @torch.compiler.disable  # the chunk loop (collectives, swapped parameters) runs eagerly: a graph break per call
    def __call__(self, *args, **kwargs):
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        names = [n for n, _ in self.module.named_parameters() if not n.startswith("o_proj.")]
        params = [self.module.get_parameter(n) for n in names]  # as registered now (FSDP2: unsharded)
        if not self.checked:
            self._check_structure(leaves, spec, names, params)
        # every tensor argument goes through the Function (saved for backward there, so that layer
        # checkpointing manages it); `project` keeps only the non-tensor arguments
        skeleton = [None if isinstance(x, torch.Tensor) else x for x in leaves]

        def project(j: int, tensors):
            vals = list(skeleton)
            for i, t in zip(at, tensors):
                vals[i] = t
            try:
                self._run("project", j, vals, spec, names, list(tensors[len(at) : len(at) + len(names)]))
            except _Captured as done:
                return done.projected
            raise SetupError(
                f"{type(self.module).__name__}.forward returned without calling the attention function; "
                f"module-level head chunks need attn_implementation={ATTN_IMPLEMENTATION!r}"
            )

        o = self.module.o_proj
        ref = self.module.__dict__.get("_hybrid_cp_mesh")
        return pipelined_module_chunks(
            project,
            self.q_ranges,
            [b - a for a, b in self.kv_ranges],
            self.cp,
            self.engine_chunks,
            [leaves[i] for i in at],
            params,
            o.weight,
            o.bias,
            overlap=bool(ref is not None and ref.overlap),
            keep_output=self._keep(),
        ), None


# attention modules that use their whole-head K/V or projections outside the attention call: a layer that stores
# its K/V for later layers (Gemma 3n / Gemma 4 KV sharing) would store one chunk's heads; LoRA-style adapters
# (Zamba2's `linear_q_adapter_list`, ...) add full-width outputs to projections cut to a chunk
_WHOLE_HEAD_FLAGS = ("store_full_length_kv", "is_kv_shared_layer")
_ADAPTER_SUFFIX = "_adapter_list"


def _keeps_whole_heads(module: torch.nn.Module) -> bool:
    """Whether `module` must run its heads whole (module-level chunks would compute something else)."""
    return any(getattr(module, flag, False) for flag in _WHOLE_HEAD_FLAGS) or any(
        name.endswith(_ADAPTER_SUFFIX) for name in module._modules
    )


def _chunk_module(
    module: torch.nn.Module, cp: CPMesh, head_chunks: int, layer=None, keep_output: bool | None = None
) -> bool:
    """Make an attention module run its heads in chunks from the projections on (UPipe at the module
    level, `_ModuleChunks`); returns False for modules without separate q/k/v/o projections of
    `num_attention_heads` x `head_dim`, for modules with attention sinks (the module chunk pipeline does not
    carry their gradient), for chunked-attention layers (it takes no chunk size) and for modules that keep whole
    heads (`_keeps_whole_heads`: KV-sharing store layers, adapters): they keep engine-level chunks."""
    if not all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in _PROJECTIONS):
        return False
    if getattr(module, "sinks", None) is not None or _layer_chunk(module) is not None or _keeps_whole_heads(module):
        return False
    d = getattr(module, "head_dim", None)
    if not isinstance(d, int) or module.q_proj.out_features % d or module.k_proj.out_features % d:
        return False
    heads, kv_heads = module.q_proj.out_features // d, module.k_proj.out_features // d
    config_heads = getattr(getattr(module, "config", None), "num_attention_heads", heads)
    if heads % kv_heads or heads != config_heads or module.o_proj.in_features != heads * d:
        return False  # e.g. a q projection that also produces gates: not a plain [heads, head_dim] layout
    ranges, engine = module_chunks(heads, kv_heads, cp.ulysses_size, head_chunks)
    module.__dict__["_hybrid_cp_engine_chunks"] = engine
    module.__dict__.pop("forward", None)
    if len(ranges) > 1:
        module.__dict__["forward"] = _ModuleChunks(module, cp, ranges, engine, heads // kv_heads, d, layer, keep_output)
    return True


def _chunk_attention_modules(
    model: torch.nn.Module, cp: CPMesh, head_chunks: int, chunk_projections: bool, keep_attention_output: bool | None
) -> None:
    """`apply_context_parallel`'s head chunks: module-level where `_chunk_module` can, else inside `hcp.attention`
    (logged when head chunks were asked for)."""
    # linear-attention mixers named self_attn (Kimi's, Ling's KDA) keep their routed forward
    named = [(name, m) for name, m in model.named_modules() if name.endswith("self_attn") and not is_routed(m)]
    attention_modules = [m for _, m in named]
    layers = [weakref.ref(model.get_submodule(name.rpartition(".")[0])) if "." in name else None for name, _ in named]
    chunked = [
        _chunk_module(m, cp, head_chunks if chunk_projections else 1, layer, keep_attention_output)
        for m, layer in zip(attention_modules, layers)
    ]
    if not chunk_projections:
        for m in attention_modules:
            m.__dict__["_hybrid_cp_engine_chunks"] = head_chunks
    elif head_chunks > 1 and not all(chunked):
        import logging

        logging.getLogger("hybrid_cp").warning(
            "head_chunks=%d: %d of %d attention modules have no separate q/k/v/o projections of num_attention_heads x "
            "head_dim, or have attention sinks, chunked attention, KV-sharing or adapters, and chunk their heads "
            "inside hcp.attention only (Q/K/V of all heads exist at once there)",
            head_chunks,
            chunked.count(False),
            len(chunked),
        )


def _check_arguments(
    model: torch.nn.Module, cp: CPMesh, head_chunks: int, keep_attention_output: bool | None, overlap: bool
) -> None:
    """`apply_context_parallel`'s checks, all before it changes the model: a refusal leaves the model as it was."""
    positive_int("head_chunks", head_chunks, "an integer >= 1 (1: all heads at once)")
    if keep_attention_output is not None and not isinstance(keep_attention_output, bool):
        raise ConfigError(
            f"keep_attention_output={keep_attention_output!r}: pass True, False or None (None: keep "
            f"inside checkpointed layers only)"
        )
    if not isinstance(overlap, bool):
        raise ConfigError(f"overlap={overlap!r}: pass True (overlapped head chunks) or False (one after another)")
    if not isinstance(cp, CPMesh):
        raise InputTypeError(f"cp must be a CPMesh from hcp.init_cp_mesh(...), got {type(cp).__name__}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise InputTypeError(
            f"apply_context_parallel expects a transformers PreTrainedModel (transformers >= 5.17, "
            f"pip install 'hybrid-cp[hf]'), got {type(model).__name__}"
        )
    check_model(model)
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads < cp.ulysses_size:
        raise ShapeError(
            f"the model has {heads} attention heads but ulysses={cp.ulysses_size}: every ulysses rank "
            f"needs at least one head; use ulysses <= {heads} and put the rest into ring"
        )


def apply_context_parallel(
    model: torch.nn.Module,
    cp: CPMesh,
    *,
    head_chunks: int = 1,
    chunk_projections: bool = True,
    keep_attention_output: bool | None = None,
    overlap: bool = False,
) -> torch.nn.Module:
    """Make a transformers causal LM run its attention through `hcp.attention` on mesh `cp`.

    Afterwards `model(input_ids=local_ids, position_ids=local_pos)` on each rank (the shard from
    `hcp.shard_batch`) returns this rank's logits [B, S_local, V]; compute the loss with
    `hcp.cross_entropy`. Accepts the families verified exact (`model_support.VERIFIED_FAMILIES`, docs/models.md)
    and raises ConfigError, on every rank before any collective, for every other model and for settings it
    would get wrong (`model_support.check_model`: sequence mixers, attention dropout, router auxiliary losses).
    Sliding-window layers (``sliding_window``, or ``layer_types`` that mix window and full layers)
    get their window in every layer, chunked layers (Llama 4) their ``attention_chunk_size``, and
    attention sinks (gpt-oss), logit soft-capping (Gemma 2) and value head dims other than the
    query/key one (multi-head latent attention: DeepSeek-V3) reach `hcp.attention`; dynamic rope types
    (longrope, dynamic NTK) see the whole row's extent (`rope.py`); non-causal attention and masks other than
    right padding raise.

    Args:
        model: A transformers causal LM of a verified family.
        cp: The mesh.
        head_chunks: > 1 runs each attention module's heads in about that many chunks of whole GQA groups
            from the Q/K/V projections on, recomputed in backward (UPipe; `engine/modulechunk.py`; modules
            without separate q/k/v/o projections, with sinks or chunked attention chunk inside `hcp.attention`).
        chunk_projections: False keeps the projections whole and chunks inside `hcp.attention` only.
        keep_attention_output: Keep each module chunk's attention output and lse for backward instead of
            running attention forward again there. None: inside checkpointed layers only (two attention
            forwards per layer instead of three); True: in every layer (one output-sized tensor each).
        overlap: With head_chunks > 1, post each chunk's all-to-all before the previous chunk computes
            (`hcp.attention`'s `overlap`, for module-level chunks too); False: one chunk after another.

    Returns:
        The model.

    Raises:
        ConfigError: A family or setting that is not verified exact; with module chunks, on its first
            forward, a module that does more than o_proj(attention output) after its attention call.
    """
    _check_arguments(model, cp, head_chunks, keep_attention_output, overlap)
    _register()
    note_model(model)
    model.set_attn_implementation(_implementations(model))
    route_linear_layers(model, cp)  # hybrid models: Gated DeltaNet blocks, Mamba2 mixers (docs/linear.md)
    ref = _MeshRef(cp, head_chunks, overlap)
    ref.rotaries = route_rotaries(model, ref)
    for m in model.modules():
        m.__dict__["_hybrid_cp_mesh"] = ref
    if hasattr(type(model), "loss_function"):
        model.loss_function = _CPLoss(ref)
    _chunk_attention_modules(model, cp, head_chunks, chunk_projections, keep_attention_output)
    ref.fixed = _mesh_bound_by(model, head_chunks)
    install_router_aux(model, ref)  # MoE families: the load-balancing loss over the whole row (router_aux.py)
    old = model.__dict__.get(_HOOK_ATTR)
    if old is not None:
        old.remove()
    handle = model.register_forward_pre_hook(lambda mod, a, kw: _pre_forward(ref, mod, a, kw), with_kwargs=True)
    model.__dict__[_HOOK_ATTR] = handle
    return model


def _implementations(model: torch.nn.Module) -> str | dict[str, str]:
    """What `set_attn_implementation` gets: hybrid-cp everywhere, except a vision-language family's sub-models other
    than its text model (the vision tower runs on whole images inside `hybrid_cp.image_row`, with its own attention
    implementation: it is not context-parallel)."""
    config = model.config
    if getattr(config, "model_type", None) not in VISION_LANGUAGE_FAMILIES:
        return ATTN_IMPLEMENTATION
    own = {
        key: getattr(config, key)._attn_implementation
        for key in config.sub_configs
        if key != "text_config" and getattr(config, key, None) is not None
    }
    return {"": ATTN_IMPLEMENTATION, "text_config": ATTN_IMPLEMENTATION, **own}


def _mesh_bound_by(model: torch.nn.Module, head_chunks: int) -> str:
    """Why `use_mesh` refuses this model, with the fix, or "": module-level head chunks (their head ranges are
    cut for the patch-time mesh's ulysses degree) and routed mixers not verified with mixed degrees (Gated
    DeltaNet, Mamba2, Mamba-1, short convolutions, lightning attention and Kimi Delta Attention are, so none is
    refused today: `linear_layers._Routed.dynamic_verified`, the check kept for a routed mixer added later)."""
    chunked = any(
        "forward" in m.__dict__ for name, m in model.named_modules() if name.endswith("self_attn") and not is_routed(m)
    )
    if chunked:
        return (
            f"head_chunks={head_chunks} module chunks keep the ulysses degree they were patched for; patch it "
            f"with apply_context_parallel(..., chunk_projections=False) (head chunks inside hcp.attention, which "
            f"read the call's mesh) or head_chunks=1"
        )
    mixers = sorted(
        {
            type(x).__name__
            for x in model.modules()  # a routed forward not marked verified: refused
            if is_routed(x) and not getattr(x.__dict__.get("forward"), "dynamic_verified", False)
        }
    )
    if mixers:
        return (
            f"sequence mixers {mixers} are not verified with dynamic degrees (Gated DeltaNet, Mamba2, Mamba-1, "
            f"short convolution, lightning and Kimi Delta Attention mixers are); train this model on one fixed "
            f"mesh (hcp.init_cp_mesh)"
        )
    return ""


@contextlib.contextmanager
def use_mesh(model: torch.nn.Module, cp: CPMesh):
    """Run a model patched by `apply_context_parallel` on mesh `cp` inside the block (a dynamic schedule's
    micro-batch, `hcp.DynamicStep`): its attention, input checks and loss read the mesh per call. Run the
    backward inside the block too: activation checkpointing recomputes the forward there. The routed
    linear-attention and state-space mixers, chunked layers and head chunks inside `hcp.attention` read the call's
    mesh too. ConfigError for module-level head chunks (head_chunks > 1 with chunk_projections=True: their head
    ranges are cut for the patch-time mesh's ulysses degree) and for a routed mixer not verified with mixed degrees
    (none today: `_mesh_bound_by`)."""
    ref = model.__dict__.get("_hybrid_cp_mesh")
    if ref is None:
        raise SetupError("use_mesh needs a model patched by apply_context_parallel(model, cp) first")
    if ref.fixed:
        raise ConfigError(f"use_mesh (dynamic degrees): this model's {ref.fixed}")
    if not isinstance(cp, CPMesh):
        raise InputTypeError(f"cp must be a CPMesh, got {type(cp).__name__}")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is not None and heads < cp.ulysses_size:
        raise ShapeError(f"the model has {heads} attention heads but this mesh has ulysses={cp.ulysses_size}")
    old, ref.cp = ref.cp, cp
    try:
        yield model
    finally:
        ref.cp = old


__all__ = ["apply_context_parallel", "hybrid_cp_attention_forward", "ATTN_IMPLEMENTATION", "use_mesh"]
