"""Sequence tiling for the two largest per-token tensors of a training step (after attention).

* The loss: `tiled_cross_entropy(hidden, weight, labels, cp)` is `hcp.cross_entropy(hidden @ weight.T,
  labels, cp)` without the `[tokens, vocab]` logits: it works on `chunk_tokens` tokens at a time and
  recomputes each chunk's logits in backward. For a 128K vocabulary and 128K local tokens the full fp32
  logits are 64 GiB; a 512-token chunk is 256 MiB. `lm_loss(model, batch, cp)` runs a transformers
  causal LM this way (its LM head never produces logits).
* The MLP: `tile_mlp(model)` runs every decoder MLP over token chunks with recomputation, so its
  `[tokens, intermediate]` activations exist one chunk at a time (forward and backward) and only the
  MLP's input is kept for backward.
* The norms: `tile_norm(model)` runs every RMSNorm the same way: the stock transformers RMSNorm keeps an
  fp32 copy of its whole input and the normalised value for backward (3 input-sized bf16 tensors' worth);
  tiled, it keeps only its input and the fp32 upcast exists for one chunk at a time.

Both are exact: the per-token arithmetic is the same, only the order of the parameter-gradient sums
over chunks changes (fp32 round-off). The idea is DeepSpeed ALST's (Arctic Long Sequence Training,
arXiv 2506.13996: tiled loss and TiledMLP); the code is ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from topology.units import LOSS_CHUNK_BYTES

from ..engine.agreement import checked_on_every_rank, digest
from ..engine.rules import positive_int
from ..errors import ConfigError, InputTypeError, SetupError, ShapeError
from .batch import MASK_KEY
from .loss import GroupReduced, check_ignore_index, reduction_group

if TYPE_CHECKING:
    from ..engine.mesh import CPMesh

__all__ = [
    "tiled_cross_entropy",
    "lm_loss",
    "tile_mlp",
    "untile_mlp",
    "default_loss_chunk",
    "tiled_mlp_chunk",
    "tile_norm",
    "untile_norm",
    "tiled_norm_chunk",
]

TILED_MLP_ATTR = "_hybrid_cp_tiled_mlp"
TILED_NORM_ATTR = "_hybrid_cp_tiled_norm"


def default_loss_chunk(vocab: int) -> int:
    """Tokens per loss chunk such that one chunk's fp32 logits take at most 256 MiB (>= 1 token)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * max(1, vocab)))


def _check_chunk(name: str, value: Any) -> None:
    positive_int(name, value, "a positive integer number of tokens (or None for the default)", allow_none=True)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum over valid tokens of CE(hidden @ weight.T + bias, labels), chunk by chunk; backward recomputes."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        valid: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = F.linear(hidden[start:end], weight, bias).float()
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, labels[start:end, None]).squeeze(1)
            total += ((lse - target) * valid[start:end]).sum()
            del logits, lse, target
        ctx.save_for_backward(hidden, weight, bias, labels, valid)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, bias, labels, valid = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if (need_b and bias is not None) else None
        scale = valid.to(torch.float32) * grad.to(torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            # one [chunk, vocab] fp32 buffer: logits -> probabilities -> d(logits), all in place
            probs = F.linear(h, weight, bias).float()
            lse = torch.logsumexp(probs, dim=-1, keepdim=True)
            probs.sub_(lse).exp_()
            rows = torch.arange(end - start, device=probs.device)
            probs[rows, labels[start:end]] -= 1.0
            probs.mul_(scale[start:end, None])
            if dh is not None:
                dh[start:end] = probs.to(h.dtype) @ weight
            if dw is not None:
                dw.addmm_(probs.t().to(acc), h.to(acc))
            if db is not None:
                db += probs.sum(0).to(acc)
            del probs, lse
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
        )


def _tiled_arguments(
    hidden: Any,
    weight: Any,
    labels: Any,
    ignore_index: Any,
    reduction: Any,
    include_dp: bool,
    bias: Any,
    chunk_tokens: Any,
) -> list[int]:
    """This rank's own checks of a `tiled_cross_entropy` call; returns the call's signature (what the ranks
    must agree on: chunk_tokens may differ, it only changes how a rank tiles its own tokens)."""
    if reduction not in ("mean", "sum"):
        raise ConfigError(
            f"reduction={reduction!r} is not supported by tiled_cross_entropy; use 'mean' or 'sum' "
            f"(for per-token losses use hcp.cross_entropy on the logits)"
        )
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise InputTypeError(f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise InputTypeError(
            f"labels must be an integer tensor of token ids, got {getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if weight.dim() != 2 or hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ShapeError(
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)} do not match: "
            f"weight must be [vocab, hidden] (nn.Linear(hidden, vocab).weight) and hidden [..., hidden]"
        )
    if tuple(hidden.shape[:-1]) != tuple(labels.shape):
        raise ShapeError(
            f"hidden.shape={tuple(hidden.shape)} does not match labels.shape={tuple(labels.shape)}; "
            f"hidden must be labels.shape + (hidden_size,), from the same shard"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ShapeError(
            f"bias must be a [{weight.shape[0]}] tensor or None, got {getattr(bias, 'shape', type(bias).__name__)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise InputTypeError(
            f"weight is {weight.dtype} on {weight.device} but hidden is {hidden.dtype} on {hidden.device}; "
            f"cast both to one dtype and device"
        )
    _check_chunk("chunk_tokens", chunk_tokens)
    check_ignore_index(ignore_index)
    return [
        digest(reduction),
        ignore_index,
        int(bool(include_dp)),
        weight.shape[0],
        weight.shape[1],
        labels.dim(),
        int(bias is not None),
    ]


def tiled_cross_entropy(  # noqa: PLR0913 (public entry point)
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cp: "CPMesh",
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    include_dp: bool = False,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """`hcp.cross_entropy(F.linear(hidden, weight, bias), labels, cp, ...)` without materialising the logits.

    Only `chunk_tokens` tokens' logits exist at a time, in forward and again in backward, which
    recomputes them.

    Same semantics as `hcp.cross_entropy`: "mean" is the token mean over the whole sequence group (and
    every dp replica with `include_dp`), identical on every rank, 0 when no token is valid; "sum" the
    group's sum. Same gradient convention: the gradient reaching this rank's hidden states and weight is
    W times the single-device gradient (W = ranks reduced over), so averaging gradients over dp x cp
    (FSDP2, DDP) is exact. Logits and softmax are computed in fp32. "none" is not offered: per-token
    losses need no tiling, use `hcp.cross_entropy`.

    Args:
        hidden: This rank's final hidden states [B, S_local, E] (or [N, E]), after the final norm.
        weight: The output projection's (LM head's) weight [V, E].
        labels: This rank's next-token targets [B, S_local] (or [N]), from `hcp.shard_batch`.
        cp: The mesh.
        ignore_index: Targets with this value count in no loss.
        reduction: "mean" or "sum".
        include_dp: Reduce over the dp replicas too.
        bias: The LM head's bias [V], if any.
        chunk_tokens: Tokens per chunk; None: 256 MiB of fp32 logits (`default_loss_chunk(V)`).

    Returns:
        The loss, a scalar, the same on every rank.

    Raises:
        ConfigError: An unknown reduction, or labels outside the vocabulary.
        InputTypeError: Tensors of the wrong dtype or device.
        ShapeError: Shapes that do not match each other.
        InconsistentRanksError: (validate) another cp rank's arguments were bad or differ from this rank's.
    """
    checked_on_every_rank(
        cp,
        lambda: _tiled_arguments(hidden, weight, labels, ignore_index, reduction, include_dp, bias, chunk_tokens),
        ("reduction", "ignore_index", "include_dp", "vocab", "hidden size", "label dims", "bias"),
        "hcp.tiled_cross_entropy arguments",
    )
    vocab = weight.shape[0]
    chunk = chunk_tokens or default_loss_chunk(vocab)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    out_of_range = valid & ((flat_labels < 0) | (flat_labels >= vocab))
    safe = flat_labels.masked_fill(~valid | out_of_range, 0)
    group, world = reduction_group(cp, include_dp)
    # count and the out-of-vocabulary check go first: a bad label must raise before any kernel indexes with it
    stats = torch.stack([valid.sum().double(), out_of_range.any().double()])
    if world > 1:
        dist.all_reduce(stats, group=group)
    if stats[1].item() > 0:
        raise ConfigError(
            f"labels on some rank hold ids outside the vocabulary [0, {vocab}) other than "
            f"ignore_index={ignore_index}; fix the labels or the ignore_index"
        )
    local_sum = _LinearCrossEntropySum.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, safe, valid.to(torch.float32), chunk
    )
    total = local_sum.detach().double().reshape(1)
    if world > 1:
        dist.all_reduce(total, group=group)
    total, count = total[0], stats[0]
    if reduction == "mean":
        denom = count.clamp_min(1.0)
        return GroupReduced.apply(local_sum, (total / denom).float(), (world / denom).float())
    return GroupReduced.apply(local_sum, total.float(), torch.tensor(float(world), device=local_sum.device))


# what lm_loss hands the model: a packed row's document boundaries (shard_batch's cu_seq_lens_q/...) or a masked row's
# AttnMask (MASK_KEY) must reach the attention layers
BATCH_KEYS = (
    "input_ids",
    "position_ids",
    "attention_mask",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    MASK_KEY,
)


def _lm_loss_arguments(
    model: Any, batch: Any, tiled: Any, chunk_tokens: Any, ignore_index: Any, include_dp: bool
) -> list[int]:
    """This rank's own checks of an `lm_loss` call; returns the call's signature (what the ranks must agree
    on before the model's first collective)."""
    if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
        raise ConfigError("batch must be the dict from hcp.shard_batch, with 'input_ids' and 'labels'")
    _check_chunk("chunk_tokens", chunk_tokens)
    check_ignore_index(ignore_index)
    if tiled:
        softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        if softcap:
            raise ConfigError(
                f"config.final_logit_softcapping={softcap}: the tiled loss computes plain logits; use "
                f"tiled=False for models that soft-cap their logits"
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear):
            raise InputTypeError(
                f"lm_loss(tiled=True) needs a model whose get_output_embeddings() is an nn.Linear LM "
                f"head, got {type(head).__name__}; use tiled=False"
            )
    return [
        int(bool(tiled)),
        ignore_index,
        int(bool(include_dp)),
        digest(sorted(k for k in BATCH_KEYS if batch.get(k) is not None)),
    ]


def lm_loss(
    model: nn.Module,
    batch: dict,
    cp: "CPMesh",
    *,
    tiled: bool = True,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    include_dp: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Run a transformers causal LM on this rank's shard (`batch` from `hcp.shard_batch`) and return the
    context-parallel loss, without ever building the `[tokens, vocab]` logits when `tiled` (the default).

    The LM head runs inside the model's forward (so FSDP2 gathers and reduces its weight as usual), but
    computes `tiled_cross_entropy` of its input instead of logits; the model's returned logits are then
    empty. `tiled=False` is the plain path: logits, then `hcp.cross_entropy`. Semantics and gradient
    convention are `hcp.cross_entropy`'s. Extra keyword arguments go to the model call.

    Args:
        model: A transformers causal LM under `apply_context_parallel`.
        batch: This rank's shard from `hcp.shard_batch`.
        cp: The mesh.
        tiled: Compute the loss in token chunks without logits.
        chunk_tokens: Tokens per chunk; None: 256 MiB of fp32 logits.
        ignore_index: Targets with this value count in no loss.
        include_dp: Reduce over the dp replicas too.
        **model_kwargs: Passed to the model call.

    Returns:
        The loss, a scalar, the same on every rank.

    Raises:
        ConfigError: A batch that is not shard_batch's, a bad chunk_tokens or ignore_index, a soft-capping model
            with tiled=True.
        InputTypeError: tiled=True on a model whose LM head is not an nn.Linear.
        InconsistentRanksError: (validate) another cp rank's arguments were bad or differ from this rank's.
    """
    from .loss import cross_entropy

    checked_on_every_rank(
        cp,
        lambda: _lm_loss_arguments(model, batch, tiled, chunk_tokens, ignore_index, include_dp),
        ("tiled", "ignore_index", "include_dp", "batch keys"),
        "hcp.lm_loss arguments",
    )
    labels = batch["labels"]
    call = {k: batch[k] for k in BATCH_KEYS if batch.get(k) is not None}
    call.update(model_kwargs)
    if not tiled:
        logits = model(**call).logits
        return cross_entropy(logits, labels, cp, ignore_index=ignore_index, include_dp=include_dp)
    head = model.get_output_embeddings()
    box: dict[str, torch.Tensor] = {}

    def head_forward(h: torch.Tensor) -> torch.Tensor:
        box["loss"] = tiled_cross_entropy(
            h, head.weight, labels, cp, ignore_index, include_dp=include_dp, bias=head.bias, chunk_tokens=chunk_tokens
        )
        return h.new_empty(*h.shape[:-1], 0)  # a fresh tensor: FSDP2 warns about views returned by a root

    head.forward = head_forward  # instance attribute, removed below: the class's forward is untouched
    try:
        model(**call)
    finally:
        del head.forward
    if "loss" not in box:
        raise SetupError(f"{type(model).__name__}'s forward did not call its LM head; use tiled=False")
    return box["loss"]


class _TiledMLPFunction(torch.autograd.Function):
    """out = fn(x) computed over token chunks without keeping intermediates; backward recomputes per chunk."""

    @staticmethod
    def forward(ctx, fn: Callable, module: nn.Module, chunk: int, x: torch.Tensor, *params: torch.Tensor):
        # autograd runs Function.forward without recording a graph: each chunk's intermediates die here
        ctx.fn, ctx.module, ctx.chunk = fn, module, chunk
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for start in range(0, flat.shape[0], chunk):  # into one output: no second copy from a cat
            piece = fn(flat[start : start + chunk])
            if out is None:
                if piece.shape[0] == flat.shape[0]:
                    out = piece
                    break
                out = piece.new_empty(flat.shape[0], piece.shape[-1])
            out[start : start + chunk] = piece
            del piece
        if out is None:  # no tokens on this rank
            out = fn(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        fn, module, chunk = ctx.fn, ctx.module, ctx.chunk
        params = [p for p in module.parameters() if p.requires_grad]
        flat = x.reshape(-1, x.shape[-1])
        gflat = grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if ctx.needs_input_grad[3] else None
        acc = [
            torch.zeros(
                p.shape, dtype=torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype, device=p.device
            )
            for p in params
        ]
        for start in range(0, flat.shape[0], chunk):
            xc = flat[start : start + chunk].detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                out = fn(xc)
            inputs = ([xc] if dx is not None else []) + params
            grads = torch.autograd.grad(out, inputs, gflat[start : start + chunk], allow_unused=True)
            if dx is not None:
                dx[start : start + chunk] = grads[0]
                grads = grads[1:]
            for a, g in zip(acc, grads):
                if g is not None:
                    a += g
        pgrads = [a.to(p.dtype) for a, p in zip(acc, params)]
        return (None, None, None, None if dx is None else dx.reshape(x.shape), *pgrads)


def _mlps(model: nn.Module) -> list[nn.Module]:
    """The `mlp` submodule of every decoder block (transformers' naming)."""
    found = []
    for name, m in model.named_modules():
        if name.endswith(".mlp") or name == "mlp":
            found.append(m)
    return found


def tile_mlp(model: nn.Module, chunk_tokens: int = 4096) -> nn.Module:
    """Run every decoder MLP of `model` (modules named `mlp`) over `chunk_tokens` tokens at a time with
    recomputation: forward keeps only the MLP's input, and the `[tokens, intermediate]` activations
    exist for one chunk at a time, in forward and in backward (which recomputes each chunk).

    Exact for token-wise MLPs (Llama/Mistral/Qwen2/Qwen3 `*MLP`); mixture-of-experts blocks (router
    statistics over the whole batch) raise ValueError. Works with FSDP2 (`shard_model`) and with
    activation checkpointing. Call again to change the chunk; `untile_mlp` undoes it. Returns the model.

    Args:
        model: The model whose `mlp` modules are tiled.
        chunk_tokens: Tokens per chunk.

    Returns:
        The model.

    Raises:
        ValueError: A mixture-of-experts block.
    """
    _check_tile_chunk(chunk_tokens)
    mlps = _mlps(model)
    if not mlps:
        raise ConfigError(
            f"{type(model).__name__} has no submodule named 'mlp'; tile_mlp supports transformers "
            f"decoder models (Llama, Mistral, Qwen2, Qwen3)"
        )
    for m in mlps:
        if not type(m).__name__.endswith("MLP"):
            raise ConfigError(
                f"{type(m).__name__} is not a token-wise MLP (mixture-of-experts blocks keep "
                f"router statistics over all tokens); tile_mlp supports *MLP modules only"
            )
    _tile(mlps, chunk_tokens, TILED_MLP_ATTR)
    return model


def _check_tile_chunk(chunk_tokens: Any) -> None:
    _check_chunk("chunk_tokens", chunk_tokens)
    if chunk_tokens is None:
        raise ConfigError("chunk_tokens=None: give a positive number of tokens, e.g. 4096")


def _tile(modules: list[nn.Module], chunk: int, attr: str) -> None:
    """Run each module's forward over `chunk` tokens at a time with recomputation (`_TiledMLPFunction`)."""
    for m in modules:
        state = m.__dict__.get(attr)
        original = state[0] if state else m.forward
        m.__dict__[attr] = (original, chunk)
        m.forward = _make_forward(m, original, chunk)


def _untile(modules: list[nn.Module], attr: str) -> None:
    for m in modules:
        state = m.__dict__.pop(attr, None)
        if state is not None and "forward" in m.__dict__:
            del m.forward


def _norms(model: nn.Module) -> list[nn.Module]:
    """Every RMSNorm module (transformers names them `*RMSNorm`: block, final and q/k norms)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def tile_norm(model: nn.Module, chunk_tokens: int = 4096) -> nn.Module:
    """Run every RMSNorm of `model` over `chunk_tokens` tokens (rows) at a time with recomputation:
    forward keeps only the norm's input (not the stock module's fp32 copy of it and the normalised
    value), and the fp32 intermediates exist for one chunk at a time in forward and in backward.

    Exact: each token's arithmetic is the module's own code; only the weight gradient's sum over chunks
    is ordered differently (accumulated in fp32 for 16-bit weights). Works with FSDP2, activation
    checkpointing and module-level head chunks (q/k norms). `untile_norm` undoes it. Returns the model.

    Args:
        model: The model whose RMSNorm modules are tiled.
        chunk_tokens: Tokens (rows) per chunk.

    Returns:
        The model.
    """
    _check_tile_chunk(chunk_tokens)
    norms = _norms(model)
    if not norms:
        raise ConfigError(
            f"{type(model).__name__} has no *RMSNorm module; tile_norm supports transformers models "
            f"with RMSNorm (Llama, Mistral, Qwen2/3, Gemma, ...)"
        )
    _tile(norms, chunk_tokens, TILED_NORM_ATTR)
    return model


def untile_norm(model: nn.Module) -> nn.Module:
    """Undo `tile_norm`.

    Args:
        model: A model `tile_norm` changed.

    Returns:
        The model.
    """
    _untile(_norms(model), TILED_NORM_ATTR)
    return model


def tiled_norm_chunk(model: nn.Module) -> int | None:
    """The chunk `tile_norm` set on `model`, or None when its norms are not tiled."""
    return _tiled_chunk(_norms(model), TILED_NORM_ATTR)


def _make_forward(module: nn.Module, original: Callable, chunk: int) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in module.parameters())):
            return original(x)
        params = [p for p in module.parameters() if p.requires_grad]
        return _TiledMLPFunction.apply(original, module, chunk, x, *params)

    return forward


def untile_mlp(model: nn.Module) -> nn.Module:
    """Undo `tile_mlp`.

    Args:
        model: A model `tile_mlp` changed.

    Returns:
        The model.
    """
    _untile(_mlps(model), TILED_MLP_ATTR)
    return model


def tiled_mlp_chunk(model: nn.Module) -> int | None:
    """The chunk `tile_mlp` set on `model`, or None when its MLPs are not tiled."""
    return _tiled_chunk(_mlps(model), TILED_MLP_ATTR)


def _tiled_chunk(modules: list[nn.Module], attr: str) -> int | None:
    for m in modules:
        state = m.__dict__.get(attr)
        if state is not None:
            return state[1]
    return None
