"""Work balance of a row under non-causal masks: today's causal layouts against a layout balanced
from the mask (topology.mask_layout.MaskBalanced), by mask and ring degree. Torch-free, seconds.

    python benchmarks/mask_balance.py

Prints, per mix of the masks research (8000-token rows) and ring degree r, the busiest ring rank's
total attention work over the mean and the lock-step ratio (sum over ring steps of the busiest rank's
work at that step, over the mean total), from the plan the layout computes (`Layout.mask_tasks`).
"""

from __future__ import annotations

from hybrid_cp.cli.table import table_lines
from topology.layouts import DenseContiguous, DenseZigzag
from topology.mask_layout import MaskBalanced, work_ratios
from topology.masks import AttnMask


def rag(passages: int, passage_len: int, query_len: int) -> AttnMask:
    """RAG block attention: each passage sees itself (causal); the query sees every passage and itself."""
    slices = [(p * passage_len, (p + 1) * passage_len, p * passage_len, (p + 1) * passage_len, None, 0)
              for p in range(passages)]
    start = passages * passage_len
    slices += [(start, start + query_len, 0, start, None, None), (start, start + query_len, start, start + query_len,
                                                                  None, 0)]
    return AttnMask.from_slices(start + query_len, slices)


def images(count: int, size: int, text: int, tail: int) -> list[int]:
    """Block ids of a row alternating `text` text tokens and an image of `size` tokens, then `tail` text."""
    ids = []
    for image in range(count):
        ids += [0] * text + [image + 1] * size
    return ids + [0] * tail


MIXES = {
    "GRPO tree: prompt 4000 + 8 x 500": AttnMask.shared_prefix(4000, [500] * 8),
    "RAG: 10 x 700 passages + query 1000": rag(10, 700, 1000),
    "Gemma 3: 12 images x 256": AttnMask.blocks(images(12, 256, 400, 128)),
    "Gemma 3: 12 images x 256, sliding 1024": AttnMask.blocks(images(12, 256, 400, 128), window=1024),
    "prefix-LM: 6000 + 2000": AttnMask.prefix_lm([0, 8000], [6000]),
}


def rows():
    for name, mask in MIXES.items():
        for ring in (4, 8):
            cells = [name, str(ring)]
            for layout in (DenseZigzag(mask.seq_len, 1, ring), DenseContiguous(mask.seq_len, 1, ring),
                           MaskBalanced(mask, 1, ring)):
                total, lock_step = work_ratios(layout, mask)
                cells.append(f"{total:.3f} / {lock_step:.3f}")
            yield cells


if __name__ == "__main__":
    header = ["mask", "r", "zigzag: total / lock-step", "contiguous", "mask-balanced (8 chunks/rank)"]
    print("\n".join(table_lines(header, list(rows()))))
