"""Work balance of a row under non-causal masks: the causal zigzag layout against a layout balanced
from the mask (topology.mask_layout.MaskBalanced), by mask and ring degree. Torch-free, seconds.

    python benchmarks/mask_balance.py

Prints, per mix of the masks research (8000-token rows) and ring degree r, the busiest ring rank's
total attention work over the mean and the lock-step ratio (sum over ring steps of the busiest rank's
work at that step, over the mean total), from the plan the layout computes (`Layout.mask_tasks`); the
time to plan the mask-balanced layout; and the ring bytes one rank sends for one layer, forward and
backward (`topology.comm_bytes(..., mask=)`, u=1, 8 heads, 8 KV heads, dim 128, fp16, the busiest ring
rank) against the full-causal ring on the same length.
"""

from __future__ import annotations

import time

from hybrid_cp.cli.table import table_lines
from topology.layouts import DenseZigzag
from topology.mask_layout import MaskBalanced, work_ratios
from topology.masks import AttnMask
from topology.traffic import comm_bytes


def rag(passages: int, passage_len: int, query_len: int) -> AttnMask:
    """RAG block attention: each passage sees itself (causal); the query sees every passage and itself."""
    slices = [
        (p * passage_len, (p + 1) * passage_len, p * passage_len, (p + 1) * passage_len, None, 0)
        for p in range(passages)
    ]
    start = passages * passage_len
    slices += [
        (start, start + query_len, 0, start, None, None),
        (start, start + query_len, start, start + query_len, None, 0),
    ]
    return AttnMask.from_slices(start + query_len, slices)


def images(count: int, size: int, text: int, tail: int) -> list[int]:
    """Block ids of a row alternating `text` text tokens and an image of `size` tokens, then `tail` text."""
    ids = []
    for image in range(count):
        ids += [0] * text + [image + 1] * size
    return ids + [0] * tail


def short_documents(total: int, shortest: int, longest: int) -> AttnMask:
    """Packed causal documents of deterministic pseudo-random lengths in [shortest, longest]."""
    lens, x = [], 1
    while sum(lens) < total:
        x = (x * 1103515245 + 12345) % 2**31
        lens.append(shortest + x % (longest - shortest + 1))
    lens[-1] -= sum(lens) - total
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return AttnMask.documents(cu)


MIXES = {
    "GRPO tree: prompt 4000 + 8 x 500": AttnMask.shared_prefix(4000, [500] * 8),
    "RAG: 10 x 700 passages + query 1000": rag(10, 700, 1000),
    "Gemma 3: 12 images x 256": AttnMask.blocks(images(12, 256, 400, 128)),
    "Gemma 3: 12 images x 256, sliding 1024": AttnMask.blocks(images(12, 256, 400, 128), window=1024),
    "prefix-LM: 6000 + 2000": AttnMask.prefix_lm([0, 8000], [6000]),
    "packed documents of 50-400 (each fits a block)": short_documents(8000, 50, 400),
}


def ring_mb(seq_len: int, ring: int, mask: AttnMask | None) -> float:
    """MB the busiest rank sends around the ring for one layer, forward + backward."""
    sent = comm_bytes(8, 8, 128, seq_len, 1, 1, ring, 2, causal=True, mask=mask)
    return (sent["ring_fwd"] + sent["ring_bwd"]) / 1e6


def rows():
    for name, mask in MIXES.items():
        for ring in (4, 8):
            cells = [name, str(ring)]
            start = time.perf_counter()
            balanced = MaskBalanced(mask, 1, ring)
            plan_ms = (time.perf_counter() - start) * 1e3
            for layout in (DenseZigzag(mask.seq_len, 1, ring), balanced):
                total, lock_step = work_ratios(layout, mask)
                cells.append(f"{total:.3f} / {lock_step:.3f}")
            cells += [
                f"{plan_ms:.0f}",
                f"{ring_mb(mask.seq_len, ring, mask):.1f} / {ring_mb(mask.seq_len, ring, None):.1f}",
            ]
            yield cells


if __name__ == "__main__":
    header = [
        "mask",
        "r",
        "zigzag: total / lock-step",
        "mask-balanced: total / lock-step",
        "plan ms",
        "ring MB: mask / causal",
    ]
    print("\n".join(table_lines(header, list(rows()))))
