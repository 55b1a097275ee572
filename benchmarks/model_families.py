"""Which transformers causal-LM families `apply_context_parallel` accepts (each verified exact by a
parity test) and why it refuses the others: the table in the README.

    python benchmarks/model_families.py            # markdown table and counts for the installed transformers

Every model type the installed transformers maps to a causal-LM class is built tiny on the meta device
and handed to the guard (no process group needed: it starts no collective).
"""

from __future__ import annotations

import collections
import re

from hybrid_cp.cli.table import format_table
from hybrid_cp.testing.families import walk

# the guard's reasons, from the most specific; the first that matches a message names its row
REASONS = [
    (r"module \S+ \(\w+\) is linear attention", "linear attention (Gated DeltaNet variants, Kimi delta)"),
    (r"module \S+ \(\w+\) is a state-space", "state-space layers (Mamba, Mamba2)"),
    (r"module \S+ \(\w+\) is a token-mixing convolution", "token-mixing convolutions"),
    (r"module \S+ \(\w+\) is a recurrence", "recurrences (RWKV, xLSTM)"),
    (r"module \S+ \(\w+\) is a sparse-attention indexer", "sparse-attention indexers (DeepSeek sparse attention)"),
    (r"attention_chunk_size=\S+ without", "chunked attention without layer_types"),
    (r"is_encoder_decoder", "encoder-decoder"),
    (r"layer_types", "layer kinds other than full/sliding/chunked attention (layer_types)"),
    (r"attention registry", "attention not dispatched through transformers' registry"),
    (r"attention_dropout", "attention dropout in the default config"),
    (r"varies per layer", "per-layer configurations"),
    (r"has not been verified", "not verified yet (no parity test)"),
]


def reason(message: str) -> str:
    return next((label for pattern, label in REASONS if re.search(pattern, message)), message[:80])


def main() -> None:
    rows = walk()
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for model_type, (status, message) in sorted(rows.items()):
        groups["exact" if status == "exact" else
               "not built here" if status == "not built" else f"refused: {reason(message)}"].append(model_type)
    counts = collections.Counter(status for status, _ in rows.values())
    print(f"{len(rows)} causal-LM model types: {counts['exact']} exact (parity-tested), {counts['refused']} refused, "
          f"{counts['not built']} not built here, 0 run unverified\n")
    order = ["exact"] + [f"refused: {label}" for _, label in REASONS] + ["not built here"]
    table = [[f"{key} ({len(groups[key])})", ", ".join(groups[key])]
             for key in order + sorted(set(groups) - set(order)) if groups.get(key)]
    print(format_table(["status", "families"], table, markdown=True))


if __name__ == "__main__":
    main()
