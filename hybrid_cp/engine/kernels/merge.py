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


def merge_rows_(out: torch.Tensor, lse: torch.Tensor, rows: slice | torch.Tensor, block_out: torch.Tensor,
                block_lse: torch.Tensor) -> None:
    """`merge_` into the rows `rows` (a slice, or an index tensor of sequence positions) of out/lse."""
    if isinstance(rows, slice):
        merge_(out[:, rows], lse[:, :, rows], block_out, block_lse)
        return
    o, l = out.index_select(1, rows), lse.index_select(2, rows)
    merge_(o, l, block_out, block_lse)
    out.index_copy_(1, rows, o)
    lse.index_copy_(2, rows, l)
