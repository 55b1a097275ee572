"""Sequence layouts: which global tokens each cp rank holds, and shard/unshard between them.

zigzag (default): the (padded) sequence is cut into 2r ring chunks; ring rank j owns chunks j and
2r-1-j, and each chunk is cut into u pieces of which ulysses rank i owns piece i. After the
ulysses all-to-all a ring rank holds [chunk j ; chunk 2r-1-j], which balances causal work.
contiguous: cp rank k = j*u + i owns tokens [k*S, (k+1)*S).

Lengths that are not a multiple of the layout's granularity are padded at the end; the pad
tokens sit after every real token, so causal attention never lets a real query see them and
non-causal attention drops them explicitly. `unshard` removes the padding again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from topology.cost import granularity, padded_length

from .mesh import LAYOUTS, _check_layout

if TYPE_CHECKING:
    from .mesh import CPMesh


def _segments(layout: str, padded_len: int, ulysses: int, ring: int, cp_rank: int) -> list[tuple[int, int]]:
    """(start, length) runs of global token indices held by `cp_rank`, in local order."""
    ring_rank, ulysses_rank = divmod(cp_rank, ulysses)
    if layout == "contiguous":
        s = padded_len // (ulysses * ring)
        return [(cp_rank * s, s)]
    chunk = padded_len // (2 * ring)
    piece = chunk // ulysses
    return [(c * chunk + ulysses_rank * piece, piece) for c in (ring_rank, 2 * ring - 1 - ring_rank)]


def local_indices(seq_len: int, layout: str, ulysses: int, ring: int, cp_rank: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Global token indices (into the padded sequence) of `cp_rank`'s shard, in local order."""
    _check_layout(layout)
    n = padded_length(seq_len, layout, ulysses, ring)
    return torch.cat([torch.arange(a, a + m, device=device)
                      for a, m in _segments(layout, n, ulysses, ring, cp_rank)])


def ring_block_positions(padded_len: int, layout: str, ulysses: int, ring: int, ring_rank: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the tokens ring rank `ring_rank` holds after the ulysses all-to-all."""
    if layout == "contiguous":
        block = padded_len // ring
        return torch.arange(ring_rank * block, (ring_rank + 1) * block, device=device)
    chunk = padded_len // (2 * ring)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in (ring_rank, 2 * ring - 1 - ring_rank)])


def gathered_to_ring_block(x: torch.Tensor, layout: str, ulysses: int, dim: int = 1) -> torch.Tensor:
    """Reorder tokens gathered from the ulysses ranks (rank-major) into the ring block order."""
    if layout == "contiguous" or ulysses == 1:
        return x
    shape = x.shape
    n = shape[dim]
    x = x.reshape(*shape[:dim], ulysses, 2, n // (2 * ulysses), *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape)


def ring_block_to_gathered(x: torch.Tensor, layout: str, ulysses: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `gathered_to_ring_block`."""
    if layout == "contiguous" or ulysses == 1:
        return x
    shape = x.shape
    n = shape[dim]
    x = x.reshape(*shape[:dim], 2, ulysses, n // (2 * ulysses), *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape)


def _remember_length(cp: "CPMesh", seq_len: int) -> None:
    cp.seq_lens[padded_length(seq_len, cp.layout, cp.ulysses_size, cp.ring_size)] = seq_len


def true_length(cp: "CPMesh", local_len: int, seq_len: int | None = None) -> int:
    """The unpadded global length for a local shard of `local_len` tokens.

    Explicit `seq_len` wins; otherwise the length last given to `shard` that pads to the same
    size; otherwise no padding is assumed.
    """
    padded = local_len * cp.size
    if seq_len is None:
        seq_len = cp.seq_lens.get(padded, padded)
    if padded_length(seq_len, cp.layout, cp.ulysses_size, cp.ring_size) != padded:
        raise ValueError(f"seq_len={seq_len} does not match local length {local_len} on a "
                         f"{cp.size}-rank {cp.layout!r} layout (which pads it to "
                         f"{padded_length(seq_len, cp.layout, cp.ulysses_size, cp.ring_size)}); pass the "
                         f"global length of the sequence that was sharded")
    return seq_len


def shard(x: torch.Tensor, cp: "CPMesh", dim: int = 1) -> torch.Tensor:
    """This rank's tokens of the full-sequence tensor `x` (padded with zeros when needed)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard expects a torch.Tensor, got {type(x).__name__}")
    dim = dim % x.dim()
    seq_len = x.shape[dim]
    if seq_len == 0:
        raise ValueError(f"x has an empty sequence dimension (dim={dim}, shape={tuple(x.shape)})")
    _remember_length(cp, seq_len)
    return _shard_tensor(x, cp, dim).contiguous()


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: "CPMesh", dim: int, seq_len: int) -> torch.Tensor:
        ctx.cp, ctx.dim, ctx.seq_len = cp, dim, seq_len
        xc = x.contiguous()
        gathered = [torch.empty_like(xc) for _ in range(cp.size)]
        dist.all_gather(gathered, xc, group=cp.cp_group)
        n = x.shape[dim] * cp.size
        out = torch.empty(*x.shape[:dim], n, *x.shape[dim + 1:], dtype=x.dtype, device=x.device)
        for k, part in enumerate(gathered):
            offset = 0
            for a, m in _segments(cp.layout, n, cp.ulysses_size, cp.ring_size, k):
                out.narrow(dim, a, m).copy_(part.narrow(dim, offset, m))
                offset += m
        return out.narrow(dim, 0, seq_len)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The full tensor is used identically on every cp rank, so the gradient of my shard is
        # the slice of the full gradient at my tokens (no reduction over ranks).
        return _shard_tensor(grad, ctx.cp, ctx.dim), None, None, None


def _shard_tensor(x: torch.Tensor, cp: "CPMesh", dim: int,
                  pad: float | Callable[[torch.Tensor, int], torch.Tensor] = 0) -> torch.Tensor:
    """This rank's tokens of `x` along `dim`, after padding the sequence to the layout's
    granularity with `pad`: a fill value, or a function (x, count) -> the pad tokens."""
    seq_len = x.shape[dim]
    n = padded_length(seq_len, cp.layout, cp.ulysses_size, cp.ring_size)
    if n != seq_len:
        if callable(pad):
            fill = pad(x, n - seq_len)
        else:
            pad_shape = list(x.shape)
            pad_shape[dim] = n - seq_len
            fill = x.new_full(pad_shape, pad)
        x = torch.cat([x, fill], dim=dim)
    return torch.cat([x.narrow(dim, a, m) for a, m in
                      _segments(cp.layout, n, cp.ulysses_size, cp.ring_size, cp.rank)], dim=dim)


def unshard(x_local: torch.Tensor, cp: "CPMesh", dim: int = 1, seq_len: int | None = None) -> torch.Tensor:
    """Gather the full sequence from every cp rank (inverse of `shard`; padding removed).

    Autograd-aware: the backward gives each rank the slice of the full gradient at its tokens,
    which is right when the code after `unshard` runs identically on every cp rank.
    """
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"unshard expects a torch.Tensor, got {type(x_local).__name__}")
    dim = dim % x_local.dim()
    seq_len = true_length(cp, x_local.shape[dim], seq_len)
    if cp.size == 1:
        return x_local.narrow(dim, 0, seq_len)
    return _Unshard.apply(x_local, cp, dim, seq_len)


def positions(seq_len: int, cp: "CPMesh", device: torch.device | str | None = None) -> torch.Tensor:
    """Global position ids of this rank's tokens (pad tokens get ids >= seq_len)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    return local_indices(seq_len, cp.layout, cp.ulysses_size, cp.ring_size, cp.rank,
                         device=device if device is not None else cp.device)


__all__ = ["LAYOUTS", "granularity", "padded_length", "local_indices", "shard", "unshard", "positions"]
