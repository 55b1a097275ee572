"""Where each rank's tokens come from: shard/unshard/positions for dense rows and packed documents.

The arithmetic lives in `topology.layouts` (one `Layout` object per row shape, shared with the cost
model); this module turns it into tensors. Dense rows use `cp.layout`:

- zigzag (default): the (padded) sequence is cut into 2r ring chunks; ring rank j owns chunks j and
  2r-1-j, and each chunk is cut into u pieces of which ulysses rank i owns piece i;
- contiguous: cp rank k = j*u + i owns tokens [k*S, (k+1)*S).

Dense lengths that are not a multiple of the layout's granularity are padded at the end, after
every real token. Packed rows (``cu_seqlens=``) use the packed layout (documents balanced over the
ring ranks, see docs/layouts.md); their padding sits at the end of each ring block. Padding is
invisible in every result: `unshard` drops it and attention masks it.

Lengths are never guessed silently: `attention`/`unshard` take ``seq_len=`` (dense) or
``cu_seqlens=`` (packed). Without them a dense length comes from the lengths `shard` has seen that
pad to the same size; when several did, the call raises (non-causal attention, `unshard`) instead
of picking one.

``cu_seqlens`` enters here once (`boundaries`: a tensor or a list, to a list of ints) and is parsed
by `topology.layouts.layout_of`, which the planner uses too.
"""

from __future__ import annotations

import logging
import numbers
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from topology.layouts import LAYOUTS, PAD, Layout, granularity, layout_of, padded_length
from topology.mask_layout import MaskBalanced, mask_layout
from topology.masks import AttnMask

from ..errors import ConfigError, CPError, InputTypeError, ShapeError
from .agreement import MeshLike, agree_across_ranks, digest, require_mesh, validates
from .comm import comm_guard

if TYPE_CHECKING:
    from .mesh import CPMesh


def boundaries(cu_seqlens: Any) -> list[int]:
    """A packed row's document boundaries [0, len_0, len_0 + len_1, ..., total] as a list of ints,
    from a 1-D integer tensor or a list (the torch-side entry of every ``cu_seqlens``)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ShapeError(
                f"cu_seqlens must be a 1-D integer tensor or list [0, len_0, len_0 + len_1, ..., total], "
                f"got dtype {cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}"
            )
        return cu_seqlens.tolist()
    if not isinstance(cu_seqlens, (list, tuple)) or not all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu_seqlens
    ):
        kinds = sorted({type(x).__name__ for x in cu_seqlens}) if isinstance(cu_seqlens, (list, tuple)) else []
        raise ConfigError(
            f"cu_seqlens must be a 1-D integer tensor or a list of ints [0, len_0, ..., total], "
            f"got a {type(cu_seqlens).__name__}{f' of {kinds}' if kinds else ''}"
        )
    return [int(x) for x in cu_seqlens]  # numpy integers too


@dataclass
class _ShardRecord:
    lengths: dict[int, set[int]] = field(default_factory=dict)  # padded size -> dense lengths shard saw
    padding_warned: set[tuple[int, int]] = field(default_factory=set)
    # (local length, total, digest of the documents) of the packed rows sharded lately, newest last
    packed: dict[tuple[int, int, int], None] = field(default_factory=dict)  # a plain dict: dynamo traces it
    warned: set[tuple[str, int]] = field(default_factory=set)  # (call, local length) warned about


_PACKED_RECORDS = 64  # packed rows bring a new layout every step: remember the recent ones only

# The tensors `shard` returned: (their mesh, the dim it cut, the row's key). Certain provenance for shards passed on
# as they are (a projection's output is a new tensor and untagged); weak keys: a freed shard drops its tag.
_TAGS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _row_key(lay: Layout) -> tuple:
    """What a shard and a call on it must agree on (a dense row by its padded length: causal calls infer the longest
    of the lengths that pad alike, which gives every real token the same result)."""
    if isinstance(lay, MaskBalanced):
        return ("mask", lay.seq_len, digest(lay.mask))
    return ("packed", lay.seq_len, digest(lay.doc_lens)) if lay.kind.startswith("packed") else ("dense", lay.padded_len)


def _row_words(key: tuple) -> str:
    """How a row key reads in an error: which argument cut or describes the row."""
    return {"mask": "mask=", "packed": "cu_seqlens", "dense": "neither cu_seqlens nor mask"}[key[0]]


def check_shards(cp: "CPMesh", tensors: tuple[tuple[str, Any], ...], dim: int, lay: Layout, what: str) -> None:
    """Raise when a tensor `shard` returned is used on another mesh, along another dim, or as another row
    (cu_seqlens given to one call and not the other, or other boundaries): shapes alone cannot tell."""
    mine = None
    for name, x in tensors:
        tag = _TAGS.get(x) if isinstance(x, torch.Tensor) else None
        if tag is None:
            continue
        mine = mine or _row_key(lay)  # once per call (a packed row's key digests its documents)
        mesh, cut_dim, key = tag[0](), tag[1], tag[2]
        if mesh is not None and mesh is not cp and _mesh_name(mesh) != _mesh_name(cp):
            raise ShapeError(
                f"{what}: {name} was sharded on another mesh ({_mesh_name(mesh)}) than this call's "
                f"({_mesh_name(cp)}): its tokens sit in another order; shard with the mesh you use"
            )
        if cut_dim != dim:
            raise ShapeError(
                f"{what}: {name} was sharded along dim {cut_dim} but the sequence is read from dim {dim}: "
                f"pass [B, S, H, D] tensors (a [B, H, S, D] tensor: transpose(1, 2) before hcp.shard)"
            )
        if key != mine:
            other = ", another value" if key[0] == mine[0] else ""
            raise ConfigError(
                f"{what}: {name} was sharded by hcp.shard with {_row_words(key)} (a row of {key[1]} "
                f"tokens{other}), but this call passes {_row_words(mine)}: pass the same cu_seqlens= "
                f"or mask= to both, or neither"
            )


# What `shard` has seen on each mesh. A record, not a result: the documented contract is that
# `attention`/`unshard` without `seq_len=` use the length `shard` saw (docs/usage.md, "Layouts"), and they
# are called without anything from `shard` in hand. Weak keys: a dropped mesh drops its record.
_RECORDS: "weakref.WeakKeyDictionary[CPMesh, _ShardRecord]" = weakref.WeakKeyDictionary()


def _record(cp: "CPMesh") -> _ShardRecord:
    return _RECORDS.setdefault(cp, _ShardRecord())


def recorded_lengths(cp: "CPMesh") -> dict[int, set[int]]:
    """The dense lengths `shard`/`shard_batch` have sharded on `cp`, by padded size (clear it to forget)."""
    return _record(cp).lengths


def forget_shards(cp: "CPMesh") -> None:
    """Forget the rows `shard`/`shard_batch` have cut on `cp` (what the provenance checks compare with)."""
    _RECORDS.pop(cp, None)


def shard_layout(cp: "CPMesh", seq_len: int) -> Layout:
    """The dense layout `shard`/`shard_batch` cut a row of `seq_len` tokens with; the length is
    recorded, so that later calls without ``seq_len=`` can tell a unique length from an ambiguous one."""
    lay = layout_of(cp.layout, cp.ulysses_size, cp.ring_size, seq_len=seq_len)
    recorded_lengths(cp).setdefault(lay.padded_len, set()).add(seq_len)
    return lay


def record_packed(cp: "CPMesh", lay: Layout) -> None:
    """Remember a packed row `shard`/`shard_batch` cut, so that a call on its shards that forgets
    ``cu_seqlens=`` (or passes it for a dense shard) can be told."""
    packed, key = _record(cp).packed, (lay.local_len, lay.seq_len, digest(lay.doc_lens))
    packed.pop(key, None)
    packed[key] = None  # newest last
    while len(packed) > _PACKED_RECORDS:
        del packed[next(iter(packed))]


def _layout_of(cp: "CPMesh", what: str, **kwargs: Any) -> Layout:
    """topology's layout, its ValueErrors (boundaries that do not describe a row) as ConfigError."""
    try:
        return layout_of(cp.layout, cp.ulysses_size, cp.ring_size, **kwargs)
    except ValueError as exc:
        if isinstance(exc, CPError):
            raise
        raise ConfigError(f"{what}: {exc}") from None


def _mesh_name(cp: "CPMesh") -> str:
    return f"ulysses={cp.ulysses_size} x ring={cp.ring_size}, {cp.layout!r} layout"


def _unrecorded(cp: "CPMesh", local_len: int, padded: int, what: str) -> None:
    """A dense length to be inferred that no `shard` on this mesh produced: warn (once per mesh, call and
    length) with what the tensor most likely is (docs/errors.md, "Provenance"). Not an error: shards cut by
    hand (`local_indices`) are legal and leave no record; the tensors `shard` returned are checked for certain
    (`check_shards`)."""
    rec = _record(cp)
    if (what, local_len) in rec.warned:
        return
    rec.warned.add((what, local_len))
    if any(key[0] == local_len for key in rec.packed):
        why = (
            "it has the local length of a packed row hcp.shard cut with cu_seqlens= on this mesh, but no "
            "cu_seqlens was passed here: pass the same cu_seqlens= (or the documents attend to each other)"
        )
    elif rec.lengths:
        lens = sorted(n for group in rec.lengths.values() for n in group)
        why = (
            f"it matches no row hcp.shard cut on this mesh (rows of {lens[-8:]} tokens). Tensors must be this "
            f"rank's shard with the sequence in dim 1, [B, S, H, D]: a [B, H, S, D] tensor (transpose(1, 2) "
            f"first), the full row (shard it with hcp.shard, a model's batch with hcp.shard_batch) or a shard of "
            f"another mesh does not fit"
        )
    else:
        other = next(
            (
                m
                for m, r in list(_RECORDS.items())
                if m is not cp and _mesh_name(m) != _mesh_name(cp) and any(p // m.size == local_len for p in r.lengths)
            ),
            None,
        )
        why = (
            f"nothing was sharded on this mesh, but it is the local length of a row hcp.shard cut on another "
            f"mesh ({_mesh_name(other)}), where tokens sit in another order"
            if other is not None
            else "no hcp.shard/shard_batch call on this mesh recorded a length to check it against"
        )
    logging.getLogger("hybrid_cp").warning(
        "%s: local length %d, global length inferred as %d: %s. Pass seq_len= (or cu_seqlens=) to be sure",
        what,
        local_len,
        padded,
        why,
    )


def row_layout(
    cp: "CPMesh",
    *,
    local_len: int | None = None,
    seq_len: int | None = None,  # noqa: PLR0913 (one keyword per way to describe a row)
    cu_seqlens: Any = None,
    causal: bool = False,
    what: str = "hcp.attention",
    mask: Any = None,
) -> Layout:
    """The layout of this call's row: balanced from its `mask` (`topology.mask_layout`), packed (`cu_seqlens`),
    or dense with an explicit or inferable length.

    `local_len` (the shard's length) is checked against the layout. A dense length without
    `seq_len` comes from `cp`'s record of lengths given to `shard`; when several lengths pad to the
    same size the answer is ambiguous and this raises, except for causal attention, where every real
    token's result is the same for all of them (padding sits after every real token): the
    longest is used.
    """
    u, r = cp.ulysses_size, cp.ring_size
    if mask is not None:
        return _mask_row(cp, mask, local_len, what, seq_len=seq_len, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        if seq_len is not None:
            raise ConfigError(
                f"{what}: pass cu_seqlens= or seq_len=, not both (a packed row's length is cu_seqlens[-1])"
            )
        lay = _layout_of(cp, what, cu_seqlens=boundaries(cu_seqlens))
        if local_len is not None and local_len != lay.local_len:
            raise ShapeError(
                f"{what}: the shard has {local_len} local tokens but cu_seqlens (total {lay.seq_len}, "
                f"{len(lay.doc_lens)} documents) lays out {lay.local_len} per rank on ulysses={u} x "
                f"ring={r}; shard packed rows with hcp.shard(x, cp, cu_seqlens=cu) and pass the same cu"
            )
        return lay
    if seq_len is not None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ConfigError(f"{what}: seq_len={seq_len!r} must be a positive integer (the unpadded global length)")
        lay = layout_of(cp.layout, u, r, seq_len=seq_len)
        if local_len is not None and local_len != lay.local_len:
            raise ShapeError(
                f"{what}: seq_len={seq_len} does not match local length {local_len} on a {cp.size}-rank "
                f"{cp.layout!r} layout (which pads it to {lay.padded_len}, {lay.local_len} per rank); "
                f"pass the global length of the sequence that was sharded"
            )
        return lay
    if local_len is None:
        raise ConfigError(f"{what}: pass seq_len= (or cu_seqlens= for a packed row)")
    padded = local_len * cp.size
    g = granularity(cp.layout, u, r)
    if padded % g:
        raise ShapeError(
            f"{what}: local length {local_len} is not a multiple of {g // cp.size} for the "
            f"{cp.layout!r} layout on ulysses={u} x ring={r}; shard inputs with hcp.shard, which pads "
            f"the sequence (or pass cu_seqlens= for a packed row)"
        )
    seen = sorted(recorded_lengths(cp).get(padded, ()))
    if not seen:
        _unrecorded(cp, local_len, padded, what)
    if len(seen) > 1 and not causal:
        raise ConfigError(
            f"{what}: the sequence length is ambiguous: hcp.shard has seen lengths {seen} that all pad to "
            f"{padded} tokens on this mesh; pass seq_len= explicitly"
        )
    return layout_of(cp.layout, u, r, seq_len=seen[-1] if seen else padded)


def _mask_row(cp: "CPMesh", mask: Any, local_len: int | None, what: str, **replaced: Any) -> Layout:
    """The layout a mask balances (the mask replaces `replaced`: they must be None), its local length checked."""
    if not isinstance(mask, AttnMask):
        raise InputTypeError(
            f"{what}: mask={mask!r} must be an hcp.AttnMask (AttnMask.documents, blocks, prefix_lm, "
            f"shared_prefix or from_slices) or None"
        )
    for name, value in replaced.items():
        if value is not None:
            raise ConfigError(
                f"{what}: pass mask= or {name}=, not both (the mask holds the row's length and documents)"
            )
    lay = mask_layout(mask, cp.ulysses_size, cp.ring_size)
    if local_len is not None and local_len != lay.local_len:
        raise ShapeError(
            f"{what}: the shard has {local_len} local tokens but the mask's row ({mask.seq_len} tokens) "
            f"lays out {lay.local_len} per rank on ulysses={cp.ulysses_size} x ring={cp.ring_size}; "
            f"shard the row with hcp.shard(x, cp, mask=m) and pass the same mask"
        )
    return lay


def local_indices(
    seq_len: int, layout: str, ulysses: int, ring: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global token indices (into the padded dense sequence) of `cp_rank`'s shard, in local order."""
    lay = layout_of(layout, ulysses, ring, seq_len=seq_len)
    return torch.cat([torch.arange(pos, pos + n, device=device) for _, pos, n in lay.token_runs(cp_rank)])


def shard_tokens(
    x: torch.Tensor, cp: "CPMesh", dim: int, lay: Layout, pad: float | Callable[[torch.Tensor, int], torch.Tensor] = 0
) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` under layout `lay`; pad slots get `pad`: a fill value,
    or (dense rows only) a function (x, count) -> the tokens that continue the sequence."""
    parts, fill = [], None
    for tok, pos, n in lay.token_runs(cp.rank):
        if tok != PAD:
            parts.append(x.narrow(dim, tok, n))
        elif callable(pad):
            if fill is None:
                fill = pad(x, lay.padded_len - lay.seq_len)
            parts.append(fill.narrow(dim, pos - lay.seq_len, n))
        else:
            shape = list(x.shape)
            shape[dim] = n
            parts.append(x.new_full(shape, pad))
    return torch.cat(parts, dim=dim)


def _check_tensor(x: Any, cp: Any, dim: Any, what: str) -> int:
    """The tensor, the mesh and the sequence dim of a shard/unshard call; returns dim as a non-negative index."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    require_mesh(cp)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ShapeError(
            f"{what}: dim={dim!r} is not a dimension of x (shape {tuple(x.shape)}, {x.dim()} dims); pass "
            f"the sequence dimension, e.g. dim=1 for [batch, seq, ...], dim=0 for a 1-D row"
        )
    return dim % x.dim()


def shard(x: torch.Tensor, cp: "CPMesh", dim: int = 1, cu_seqlens: Any = None, *, mask: Any = None) -> torch.Tensor:
    """This rank's tokens of the full-row tensor `x` (padding slots are zeros).

    With `cu_seqlens` ([0, len_0, ..., total], flash-attn's varlen convention) `x` is a packed row
    of documents, laid out so that causal work is balanced over the ring ranks. With `mask` (an
    `hcp.AttnMask`) the row is laid out for that mask's work (`topology.mask_layout.MaskBalanced`).

    Args:
        x: The full row, the same on every cp rank, with the sequence along `dim`.
        cp: The mesh.
        dim: The sequence dimension.
        cu_seqlens: Packed documents' boundaries [0, len_0, ..., total]; None: a dense row.
        mask: The row's attention mask (then no `cu_seqlens`); pass the same one to `attention`/`unshard`.

    Returns:
        This rank's tokens, in `cp.layout`, padded to the layout's granularity.

    Raises:
        InputTypeError: `x` is not a tensor.
        ShapeError: An empty sequence, or a packed row whose length is not `cu_seqlens[-1]`.
        ConfigError: Invalid `cu_seqlens`, or both `cu_seqlens` and `mask`.
    """
    dim = _check_tensor(x, cp, dim, "hcp.shard")
    n = x.shape[dim]
    if n == 0:
        raise ShapeError(f"x has an empty sequence dimension (dim={dim}, shape={tuple(x.shape)})")
    if mask is not None:
        lay = row_layout(cp, cu_seqlens=cu_seqlens, mask=mask, what="hcp.shard")
        if n != lay.seq_len:
            raise ShapeError(f"x has {n} tokens along dim {dim} but the mask describes a row of {lay.seq_len}")
    elif cu_seqlens is not None:
        lay = row_layout(cp, cu_seqlens=cu_seqlens, what="hcp.shard")
        _check_packed_row(x, dim, lay, "x")
        record_packed(cp, lay)
    else:
        lay = shard_layout(cp, n)
    _warn_padding(cp, lay)
    out = shard_tokens(x, cp, dim, lay).contiguous()
    _TAGS[out] = (weakref.ref(cp), dim, _row_key(lay))
    return out


def _warn_padding(cp: "CPMesh", lay: Layout) -> None:
    """Warn (once per mesh and layout) when padding is over 10% of the tokens: compute and
    communication spent on nothing."""
    pad = lay.padded_len - lay.seq_len
    if pad * 10 <= lay.padded_len:
        return
    warned = _record(cp).padding_warned
    key = (lay.seq_len, lay.padded_len)
    if key in warned:
        return
    warned.add(key)
    fix = (
        "pack more tokens into the row, or use fewer ranks for short rows"
        if len(lay.doc_lens) > 1 or lay.kind.startswith("packed")
        else f"pick a length that is a multiple of "
        f"{granularity(cp.layout, cp.ulysses_size, cp.ring_size)}, or fewer ranks for short rows"
    )
    logging.getLogger("hybrid_cp").warning(
        "padding is %d of %d tokens (%.0f%%) on this %s mesh (ulysses=%d, ring=%d): %s",
        pad,
        lay.padded_len,
        100 * pad / lay.padded_len,
        cp.layout,
        cp.ulysses_size,
        cp.ring_size,
        fix,
    )


def _check_packed_row(x: torch.Tensor, dim: int, lay: Layout, name: str) -> None:
    if x.shape[dim] != lay.seq_len:
        raise ShapeError(
            f"{name} has {x.shape[dim]} tokens along dim {dim} but cu_seqlens ends at {lay.seq_len}; "
            f"cu_seqlens must describe this packed row"
        )
    if dim != 0 and x.shape[0] != 1:
        raise ShapeError(
            f"{name} has batch size {x.shape[0]} (shape {tuple(x.shape)}); a packed row is a batch of "
            f"one: concatenate the documents into [1, total, ...] and describe them with cu_seqlens"
        )


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: "CPMesh", dim: int, lay: Layout) -> torch.Tensor:
        ctx.cp, ctx.dim, ctx.lay = cp, dim, lay
        xc = x.contiguous()
        gathered = [torch.empty_like(xc) for _ in range(cp.size)]
        with comm_guard(cp, "hcp.unshard's all-gather"):
            dist.all_gather(gathered, xc, group=cp.cp_group)
        out = x.new_empty(*x.shape[:dim], lay.seq_len, *x.shape[dim + 1 :])
        for k, part in enumerate(gathered):
            offset = 0
            for tok, _, n in lay.token_runs(k):
                if tok != PAD:
                    out.narrow(dim, tok, n).copy_(part.narrow(dim, offset, n))
                offset += n
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The full tensor is used identically on every cp rank, so the gradient of my shard is
        # the slice of the full gradient at my tokens (no reduction over ranks).
        return shard_tokens(grad, ctx.cp, ctx.dim, ctx.lay), None, None, None


def unshard(
    x_local: torch.Tensor,
    cp: "CPMesh",
    dim: int = 1,
    seq_len: int | None = None,
    cu_seqlens: Any = None,
    *,
    mask: Any = None,
) -> torch.Tensor:
    """Gather the full row from every cp rank (inverse of `shard`; padding removed).

    Autograd-aware: the backward gives each rank the slice of the full gradient at its tokens,
    which is right when the code after `unshard` runs identically on every cp rank.

    Args:
        x_local: This rank's tokens (as `shard` or `attention` returned them).
        cp: The mesh.
        dim: The sequence dimension.
        seq_len: The unpadded length; None: the length `shard` saw.
        cu_seqlens: Packed documents' boundaries, as given to `shard`.
        mask: The row's attention mask, as given to `shard`.

    Returns:
        The full row, the same on every cp rank.

    Raises:
        ShapeError: A local length that does not match the mesh and layout, or no row `shard` cut on it.
        ConfigError: An ambiguous length (several that pad to the same size): pass `seq_len`.
        InconsistentRanksError: Another cp rank's call differs or failed its checks (with `cp.validate`).
        SetupError: A destroyed mesh.
    """
    lay = _unshard_layout(x_local, cp, dim, seq_len, cu_seqlens, mask)
    dim = dim % x_local.dim()
    if cp.size == 1:  # one rank holds the row in order, padding at the end
        return x_local.narrow(dim, 0, lay.seq_len)
    return _Unshard.apply(x_local, cp, dim, lay)


def _unshard_layout(x: Any, cp: "CPMesh", dim: Any, seq_len: Any, cu_seqlens: Any, mask: Any) -> Layout:
    """`unshard`'s checks: this rank's own, then (with `cp.validate`) the cp ranks' agreement on the call, so
    that one rank's bad argument makes every rank raise instead of leaving the others in the all-gather."""
    error, lay, signature = None, None, [0] * 5
    try:
        d = _check_tensor(x, cp, dim, "hcp.unshard")
        lay = row_layout(
            cp, local_len=x.shape[d], seq_len=seq_len, cu_seqlens=cu_seqlens, what="hcp.unshard", mask=mask
        )
        check_shards(cp, (("x", x),), d, lay, "hcp.unshard")
        signature = [
            d,
            x.dim(),
            digest((tuple(x.shape), str(x.dtype))),
            lay.seq_len,
            digest(lay.doc_lens if mask is None else mask),
        ]
    except (ValueError, TypeError) as exc:
        if not validates(cp) or not isinstance(exc, CPError):
            raise
        error = exc
    if validates(cp):
        agree_across_ranks(
            cp,
            signature,
            ("dim", "dims", "shape and dtype (checksum)", "seq_len", "cu_seqlens or mask (checksum)"),
            error,
            "hcp.unshard arguments",
        )
    return lay


def positions(
    seq_len: "int | None | CPMesh",
    cp: "CPMesh | None" = None,
    device: torch.device | str | None = None,
    *,
    cu_seqlens: Any = None,
    mask: Any = None,
) -> torch.Tensor:
    """Position ids of this rank's tokens: global positions of a dense row (pad slots get ids >=
    seq_len), positions inside each document of a packed row (restarting at 0; pad slots 0..), or,
    with `mask`, the tokens' indices in the row (``hcp.positions(cp, mask=m)``; a completion that
    continues its prompt's positions needs the caller's own position ids, `shard_batch` keeps them).

    Args:
        seq_len: The unpadded global length of a dense row (None with `cu_seqlens`); with `mask` it may
            be left out (``positions(cp, mask=m)``).
        cp: The mesh.
        device: Where the result lives; None: `cp.device`.
        cu_seqlens: Packed documents' boundaries; positions then restart in every document.
        mask: The row's attention mask, as given to `shard`.

    Returns:
        int64 position ids of this rank's tokens [S_local].

    Raises:
        SetupError: A destroyed mesh.
        ConfigError: A `seq_len` that is not a positive integer or disagrees with `cu_seqlens` or `mask`.
    """
    if cp is None and isinstance(seq_len, MeshLike):  # positions(cp, mask=m)
        seq_len, cp = None, seq_len
    require_mesh(cp)
    if mask is not None:
        lay = row_layout(cp, cu_seqlens=cu_seqlens, mask=mask, what="hcp.positions")
        if seq_len is not None and seq_len != lay.seq_len:
            raise ConfigError(
                f"seq_len={seq_len} but the mask's row has {lay.seq_len} tokens; pass seq_len=None with mask"
            )
    elif cu_seqlens is None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise ConfigError(f"seq_len={seq_len!r} must be a positive integer (or pass cu_seqlens= for a packed row)")
    elif cu_seqlens is not None:
        lay = row_layout(cp, seq_len=None, cu_seqlens=cu_seqlens, what="hcp.positions")
        if seq_len is not None and seq_len != lay.seq_len:
            raise ConfigError(
                f"seq_len={seq_len} but cu_seqlens ends at {lay.seq_len}; pass seq_len=None with cu_seqlens"
            )
    else:
        lay = _layout_of(cp, "hcp.positions", seq_len=seq_len)
    device = device if device is not None else cp.device
    return torch.cat([torch.arange(pos, pos + n, device=device) for _, pos, n in lay.token_runs(cp.rank)])


@lru_cache(maxsize=8)
def _perm(lay: Layout, device: torch.device, inverse: bool) -> torch.Tensor | None:
    """The gathered <-> ring-block row permutation on `device` (None when it is the identity); cached for
    the layers of a step and bounded to a few layouts: each holds 8 bytes per gathered token (at a million
    tokens, 8 MiB), and packed rows bring a new layout every step."""
    rows = lay.gathered_rows()
    if rows is None:
        return None
    t = torch.tensor(rows, device=device)
    return torch.argsort(t) if inverse else t


def gathered_rows_identity(lay: Layout, device: torch.device) -> bool:
    """Whether the gathered and the ring-block row orders are the same (no reordering)."""
    return _perm(lay, device, True) is None


def gathered_to_ring_block(x: torch.Tensor, lay: Layout, dim: int = 1) -> torch.Tensor:
    """Reorder tokens gathered from the ulysses ranks (rank-major) into the ring block's row order."""
    p = _perm(lay, x.device, True)
    return x if p is None else x.index_select(dim, p)


def ring_block_to_gathered(x: torch.Tensor, lay: Layout, dim: int = 1) -> torch.Tensor:
    """Inverse of `gathered_to_ring_block`."""
    p = _perm(lay, x.device, False)
    return x if p is None else x.index_select(dim, p)


__all__ = [
    "LAYOUTS",
    "granularity",
    "padded_length",
    "local_indices",
    "shard",
    "unshard",
    "positions",
    "row_layout",
    "boundaries",
    "shard_layout",
    "shard_tokens",
    "recorded_lengths",
    "record_packed",
    "check_shards",
    "forget_shards",
]
