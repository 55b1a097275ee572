"""The online-softmax merge of partial attention results.

A kernel returns a block's (out, lse); attention over the union of key blocks is their merge, in any
order, so the ring merges each block as it arrives and the self-test merges split blocks the same way.
Kept apart from the ring so that the kernels' self-test can use it without importing the engine.
"""

from __future__ import annotations

import torch


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (out, lse) into the running fp32 (out, lse), in place.

    out [B, S, H, D], lse [B, H, S]. Rows that have seen no key (lse = -inf on both sides) stay
    at out = 0, lse = -inf instead of becoming NaN.
    """
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_new)
    lse.copy_(new)


def merge_rows_(
    out: torch.Tensor, lse: torch.Tensor, rows: slice | torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """`merge_` into the rows `rows` (a slice, or an index tensor of sequence positions) of out/lse."""
    if isinstance(rows, slice):
        merge_(out[:, rows], lse[:, :, rows], block_out, block_lse)
        return
    o, l = out.index_select(1, rows), lse.index_select(2, rows)
    merge_(o, l, block_out, block_lse)
    out.index_copy_(1, rows, o)
    lse.index_copy_(2, rows, l)


def merge_sink_(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Merge one key per head with score sink[h] and value 0 (attention sinks, gpt-oss) into the running
    fp32 (out [B, S, h, D], lse [B, h, S]), in place: lse' = logaddexp(lse, sink), out' = out * exp(lse - lse').
    A row that saw no key gets out 0, lse' = sink."""
    new = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # sink = -inf on a keyless row: stays 0
    out.mul_(torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The gradient of `merge_sink_` w.r.t. the sinks [h], from the final out' [B, S, h, D] and lse' [B, h, S]:
    d sink_h = - sum over rows of exp(sink_h - lse') * rowsum(dout * out') (the sink's softmax weight times
    -delta; its value is 0, so delta is that of the keys). In fp32 (fp64 for fp64 inputs), in sink's dtype."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, h, S]
    weight = torch.exp(sink.to(acc).view(1, -1, 1) - lse)
    return -(weight * delta).sum((0, 2)).to(sink.dtype)
