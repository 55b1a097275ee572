"""Real Trainer runs for tests/test_hf_trainer.py: `CPTrainer` on torchrun ranks and the stock `Trainer` on
one process, on the same tiny models and data, recording what the tests compare.

    torchrun --standalone --nproc-per-node 4 tests/hf_cases.py OUT cp CASE...     # every CASE on 4 ranks
    python tests/hf_cases.py OUT ref CASE...                                      # the stock references

A CASE is "model:kind:ulysses:ring" (model "llama" or "mistral", kind "dense" or "packed"); dp is
world // (ulysses * ring). The reference of a CASE is the stock Trainer with gradient accumulation
2 * dp over the same sampler order (accelerate gives dp replica d the batches d, d + dp, ...).
Results are written by rank 0 as OUT/<role>-<CASE>.pt.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

STEPS = 4
ACCUMULATION = 2
PACKED_BATCH = 3   # documents flattened into one packed row


def model_for(name: str, cache: bool = True):
    """A tiny model of the family; `cache` is config.use_cache (the default True trains under our classes)."""
    from hybrid_cp.testing.families import tiny_model

    extra = dict(sliding_window=8) if name == "mistral" else {}
    model = tiny_model(name, seed=0, **extra)
    model.config.use_cache = cache
    return model


def rows(n: int, seed: int) -> list[dict]:
    """Token rows of unequal lengths (9..40) from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(9, 41, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, 256, (length,), generator=g).tolist()})
    return out


def pad_collate(features: list[dict]) -> dict:
    """Right padding to a multiple of 16 (so a batch of one has padding too), labels -100 there."""
    longest = max(len(f["input_ids"]) for f in features)
    total = -(-longest // 16) * 16
    ids = torch.zeros(len(features), total, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def collator(kind: str):
    from transformers import DataCollatorWithFlattening

    return pad_collate if kind == "dense" else DataCollatorWithFlattening()


def training_args(out: str, accumulation: int, batch: int, eval_batch: int = 1, **extra):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=eval_batch,
                gradient_accumulation_steps=accumulation, max_steps=STEPS, learning_rate=5e-3, logging_steps=1,
                max_grad_norm=0.5, warmup_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    base.update(extra)
    return TrainingArguments(**base)


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "lr": [h["learning_rate"] for h in logs]}


def run_case(case: str, role: str, out: str) -> dict:
    """Train one CASE (cp: CPTrainer on this process's rank; ref: the stock Trainer) and evaluate."""
    from transformers import Trainer

    from hybrid_cp.integrations.hf import CPTrainer

    name, kind, u, r = case.split(":")
    u, r = int(u), int(r)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (u * r) if role == "cp" else int(os.environ.get("HF_CASES_DP", "1"))
    batch = 1 if kind == "dense" else PACKED_BATCH
    accumulation = ACCUMULATION if role == "cp" else ACCUMULATION * dp
    data = rows(STEPS * ACCUMULATION * 2 * batch, seed=1)
    evaluation = rows(2 * 4, seed=2) if kind == "dense" else rows(2 * 4, seed=2)
    # the reference needs per-document attention: stock transformers with use_cache=True attends across the
    # documents of a position-ids-only packed row (docs/training.md); our trainer does not, whatever the setting
    model = model_for(name, cache=role == "cp")
    common = dict(model=model, args=training_args(out, accumulation, batch, 1 if role == "cp" else dp), train_dataset=data,
                  eval_dataset=evaluation, data_collator=collator(kind))
    if role == "cp":
        trainer = CPTrainer(**common, ulysses=u, ring=r)
    else:
        trainer = Trainer(**common)
    trainer.train()
    result = history(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["weights"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return result


def main(argv: list[str]) -> None:
    out, role, cases = argv[0], argv[1], argv[2:]
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for case in cases:
        if role == "ref":
            os.environ["HF_CASES_DP"] = case.split(":")[4] if case.count(":") == 4 else "1"
            case = ":".join(case.split(":")[:4])
        with tempfile.TemporaryDirectory() as tmp:
            result = run_case(case, role, tmp)
        if rank == 0:
            torch.save(result, os.path.join(out, f"{role}-{case.replace(':', '_')}"
                                                 f"{'_dp' + os.environ['HF_CASES_DP'] if role == 'ref' else ''}.pt"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
