"""The demo's data and model, shared by `hybrid-cp demo` and the examples: byte tokens of the Python standard
library (the same on every machine with the same Python, no download) and a tiny random-initialised Llama."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from ..errors import ConfigError, SetupError

__all__ = ["VOCAB", "build_model", "sample_batch", "stdlib_corpus", "tiny_llama_config"]

VOCAB = 256


# ----------------------------------------------------------------------------------------- data


def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Byte tokens of the Python standard library's .py files, in a fixed (sorted) order.

    The same on every machine with the same Python version, without a download.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "encodings"}  # encodings: machine-generated charmap tables
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise SetupError(f"found no Python source files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def sample_batch(corpus: torch.Tensor, step: int, batch: int, seq_len: int, seed: int = 0) -> dict:
    """A deterministic batch of `batch` windows of `seq_len` tokens for `step` (same on every rank)."""
    if corpus.numel() <= seq_len + 1:
        raise ConfigError(f"the corpus has {corpus.numel()} tokens, too few for seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len, (batch,), generator=g)
    ids = torch.stack([corpus[s : s + seq_len] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------------------------------- model


def tiny_llama_config(seq_len: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq_len, 128),
        rope_theta=10000.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def build_model(config, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.train()
    return model
