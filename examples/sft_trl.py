"""Supervised fine-tuning with TRL's SFTTrainer and hybrid context parallelism, on packed documents.

    # CPU, 4 processes (gloo): a tiny random Llama, byte tokens, ulysses 2 x ring 2
    torchrun --nproc-per-node 4 examples/sft_trl.py

    # the split from the planner (for this tiny model on CPU it picks dp = 4: no context parallelism needed)
    torchrun --nproc-per-node 4 examples/sft_trl.py --ulysses auto --ring auto

    # the same with accelerate's launcher (the same losses as torchrun), optionally FSDP2 over all ranks; on CPU
    # too: --multi_gpu is torchrun underneath (accelerate 1.15's --cpu starts ONE process without MPI)
    accelerate launch --multi_gpu --num_processes 4 examples/sft_trl.py [--fsdp2]

    # GPUs: a real model (local path or hub name), bf16, explicit degrees
    torchrun --nproc-per-node 8 examples/sft_trl.py --model /path/to/llama --ulysses 4 --ring 2 --max-length 65536

Data: the Python standard library's source files as documents (on every machine, no download), packed by
TRL (packing=True, best-fit decreasing) into rows of --max-length tokens. Every document attends only to
itself, also across ranks; TRL's own context parallelism refuses packing (trl#6843).

The lines a user adds to a stock SFTTrainer script are marked "CP:".
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import torch

from hybrid_cp.integrations.hf import CPSFTTrainer  # CP: 1/4 the trainer (TRL imported on first use)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a model path or name; 'tiny': a random 2-layer Llama, byte vocab")
    p.add_argument("--ulysses", default="2", help="ulysses degree, or 'auto' (the planner; default 2)")
    p.add_argument("--ring", default="2", help="ring degree, or 'auto' (the planner; default 2): dp = world / (u x r)")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per packed row (default 1024)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--documents", type=int, default=64, help="standard-library files to train on (default 64)")
    p.add_argument("--fsdp2", action="store_true", help="shard the model with FSDP2 over all dp x cp ranks")
    p.add_argument("--output-dir", default="sft-trl-out")
    return p.parse_args(argv)


def degree(value: str) -> int | str:
    return value if value == "auto" else int(value)


def byte_tokenizer():
    """A 256-token byte-level tokenizer built here (no download); id 0 is padding and end of document."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    first = next(c for c, i in vocab.items() if i == 0)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=first, pad_token=first)


def documents(n: int, longest: int) -> list[dict]:
    """The first n standard-library files (sorted, at most `longest` characters each) as {"text": ...}."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:n]
    return [{"text": f.read_text(encoding="utf-8", errors="replace")[:longest]} for f in files]


def load(name: str):
    """(model, tokenizer): the tiny random Llama with byte tokens, or a pretrained model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if name != "tiny":
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16), AutoTokenizer.from_pretrained(name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config), byte_tokenizer()


def main(argv=None) -> None:
    from datasets import Dataset
    from trl import SFTConfig

    a = parse_args(argv)
    model, tokenizer = load(a.model)
    gpu = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        warmup_steps=1,
        logging_steps=1,
        max_length=a.max_length,
        packing=True,
        bf16=gpu,
        use_cpu=not gpu,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        gradient_checkpointing=gpu,
    )
    data = Dataset.from_list(documents(a.documents, 4 * a.max_length))
    trainer = CPSFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data.select(range(8)),
        processing_class=tokenizer,
        ulysses=degree(a.ulysses),
        ring=degree(a.ring),  # CP: 2/4 the degrees (or "auto")
        fsdp2=a.fsdp2,
    )
    trainer.train()  # CP: 3/4 launch with torchrun
    metrics = trainer.evaluate()
    trainer.save_model()  # CP: 4/4 an ordinary HF checkpoint
    if trainer.is_world_process_zero():
        cp = trainer.cp
        print(f"mesh: ulysses={cp.ulysses_size} ring={cp.ring_size} dp={cp.dp_size}")
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"step {h['step']}: loss {h['loss']:.6f} grad_norm {h['grad_norm']:.6f}")
        print(f"eval_loss {metrics['eval_loss']:.4f}; model saved to {a.output_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
