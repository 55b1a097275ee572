"""Real Trainer runs for tests/test_hf_trainer.py: `CPTrainer` on torchrun ranks and the stock `Trainer` on
one process, on the same tiny models and data, recording what the tests compare.

    torchrun --standalone --nproc-per-node 4 tests/hf_cases.py OUT cp CASE...     # every CASE on 4 ranks
    python tests/hf_cases.py OUT ref CASE...                                      # the stock references

A CASE is "model:kind:ulysses:ring" (model "llama", "mistral", "gemma3_text" and "qwen2": sliding and full layers
from `layer_types`, "llama+gc": gradient checkpointing, "llama+fsdp2": CPTrainer(fsdp2=True), its reference the
plain llama's, "llama+dyn": CPTrainer(dynamic_cp=DynamicCP(tokens_per_rank=DYNAMIC_C)) with ulysses = ring = 1 in
the name (dp = world: the reference reads the same global batch); kind "dense" or "packed"), or
"sft:packing|padding_free:u:r" (TRL), or "resume[+dyn][+fsdp2]:kind:u:r" (train, then resume from step 2); dp is
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
PACKED_BATCH = 3  # documents flattened into one packed row
# AdamW turns a gradient entry that is zero in exact arithmetic but rounding noise in fp32 (seen: one embedding
# row in the TRL packing case, 1e-4 apart after 4 steps) into a step of lr * g / (|g| + eps), large next to the
# noise; eps 1e-6 instead of 1e-8 keeps such steps below the weights' tolerance (both runs use the same optimizer)
ADAM_EPS = 1e-6
# dynamic_cp's tokens per rank: documents of 9..40 tokens run on 1 (<= 16), 2 (17..32) or 4 ranks (33..40)
DYNAMIC_C = 16
MIXED = ["sliding_attention", "full_attention"]  # one layer of each kind
WINDOWED = {
    "mistral": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8, layer_types=MIXED),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2, layer_types=MIXED),
}


def model_for(name: str, cache: bool = True):
    """A tiny model of the family; `cache` is config.use_cache (the default True trains under our classes)."""
    from hybrid_cp.testing.families import tiny_model

    model = tiny_model(name, seed=0, **WINDOWED.get(name, {}))
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
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def collator(kind: str):
    from transformers import DataCollatorWithFlattening

    return pad_collate if kind == "dense" else DataCollatorWithFlattening()


def training_args(out: str, accumulation: int, batch: int, eval_batch: int = 1, **extra):
    from transformers import TrainingArguments

    base = dict(
        output_dir=out,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=eval_batch,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        learning_rate=5e-3,
        logging_steps=1,
        max_grad_norm=0.5,
        warmup_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        adam_epsilon=ADAM_EPS,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    base.update(extra)
    return TrainingArguments(**base)


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "cp_comm_bytes": [h.get("cp_comm_bytes") for h in logs],
    }


def counted_bytes(trainer) -> int:
    """Every byte all ranks counted in the cp exchanges so far (what the log entries' cp_comm_bytes add up to)."""
    import torch.distributed as dist

    import hybrid_cp as hcp

    meshes = trainer.cp_meshes.meshes.values() if trainer.cp_meshes is not None else [trainer.cp]
    sent = torch.tensor([sum(sum(hcp.comm_bytes(m).values()) for m in meshes)], dtype=torch.int64)
    dist.all_reduce(sent)
    return int(sent.item())


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
    model = model_for(name.split("+")[0], cache=role == "cp")
    extra = dict(gradient_checkpointing=True) if name.endswith("+gc") else {}  # layers recomputed in backward
    common = dict(
        model=model,
        args=training_args(out, accumulation, batch, 1 if role == "cp" else dp, **extra),
        train_dataset=data,
        eval_dataset=evaluation,
        data_collator=collator(kind),
    )
    degrees: list = []
    if role == "cp" and "+dyn" in name:
        import hybrid_cp as hcp

        trainer = CPTrainer(
            **common, dynamic_cp=hcp.DynamicCP(tokens_per_rank=DYNAMIC_C), fsdp2=name.endswith("+fsdp2")
        )
        _record_degrees(trainer, degrees)
    elif role == "cp":
        trainer = CPTrainer(**common, ulysses=u, ring=r, fsdp2=name.endswith("+fsdp2"))
    else:
        trainer = Trainer(**common)
    deferred = _count_calls(trainer, "_defer_fsdp_gradient_reduction")
    trainer.train()
    result = history(trainer)
    result["degrees"] = degrees
    if role == "cp":
        result["counted_bytes"] = counted_bytes(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["weights"] = full_weights(trainer.model)
    if name.endswith("+fsdp2"):  # the full checkpoint gathered from the shards (tests: from_pretrained, one process)
        trainer.save_model(os.path.join(os.environ["HF_CASES_OUT"], f"saved-{case.replace(':', '_')}"))
        result["deferred"] = deferred[0]  # micro-batches whose reduce-scatter waited for the window's last one
    return result


def _record_degrees(trainer, out: list) -> None:
    """Per step of a dynamic trainer: the degrees of its schedule's groups that ran documents, the count of
    micro-batches and of idle rank blocks (placeholders), and the schedule's digest (its global batch)."""
    inner = trainer._dynamic_step

    def recorded(batches):
        result = inner(batches)
        sched = trainer.cp_schedule
        out.append(
            (
                sorted({g.degree for mb in sched.microbatches for g in mb.groups if g.docs}),
                len(sched.microbatches),
                sum(not g.docs for mb in sched.microbatches for g in mb.groups),
                sched.digest,
            )
        )
        return result

    trainer._dynamic_step = recorded


def _count_calls(obj, name: str) -> list[int]:
    """Wrap obj.name (on the instance) to count its calls: [count]."""
    count, inner = [0], getattr(obj, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return inner(*args, **kwargs)

    setattr(obj, name, counted)
    return count


def full_weights(model) -> dict:
    """The whole weights on every rank (FSDP2's DTensors gathered: a collective, called on all ranks)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def direct_case() -> dict:
    """`model(**hcp.shard_batch(batch, cp)).loss` on mesh (2, 2) in fp64 against the stock model on the whole
    batch (one process, per-document attention): loss and the cp-averaged parameter gradients, per input kind."""
    import copy

    import torch.distributed as dist

    import hybrid_cp as hcp
    from hybrid_cp.integrations.transformers import apply_context_parallel

    cp = hcp.init_cp_mesh(2, 2)
    out = {}
    for kind in ("dense", "packed"):
        feats = rows(3, seed=5)
        batch = collator(kind)(feats)
        base = model_for("llama", cache=False).double()
        ref = copy.deepcopy(base)
        want = ref(**batch).loss
        want.backward()
        stock_cached = copy.deepcopy(base)
        stock_cached.config.use_cache = True  # the stock pitfall: a packed row attends across its documents
        with torch.no_grad():
            pitfall = _rel(stock_cached(**batch).loss, want.detach())
        model = copy.deepcopy(base)
        model.config.use_cache = True  # the default config: ours is per-document whatever the setting
        model = apply_context_parallel(model, cp)
        got = model(**hcp.shard_batch(batch, cp)).loss
        got.backward()
        worst = 0.0
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, group=cp.cp_group)
            worst = max(worst, _rel(g / cp.size, q.grad))
        out[kind] = {"forward": _rel(got.detach(), want.detach()), "backward": worst, "stock_use_cache": pitfall}
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, bf16 autocast
            ref32, model32 = copy.deepcopy(ref).float(), copy.deepcopy(model).float()
            out[kind]["autocast_bf16"] = _rel(model32(**hcp.shard_batch(batch, cp)).loss, ref32(**batch).loss)
    hcp.destroy_cp_mesh(cp)
    return out


def _refusal(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test asserts the type and the message on every rank
        return type(exc).__name__, str(exc)
    return "nothing raised", ""


def errors_case() -> dict:
    """Unsupported settings, each tried on every rank: what each raised (before any step or collective)."""
    import hybrid_cp as hcp
    from hybrid_cp.integrations.hf import CPTrainer
    from hybrid_cp.integrations.transformers import apply_context_parallel

    data = rows(8, seed=1)

    def trainer(u=2, r=2, resume=False, **extra):
        with tempfile.TemporaryDirectory() as tmp:
            args = training_args(tmp, 2, 1, **{k: v for k, v in extra.items() if k in _ARGS})
            kwargs = {k: v for k, v in extra.items() if k not in _ARGS}
            kwargs.setdefault("train_dataset", data)
            made = CPTrainer(
                model=model_for("llama"), args=args, data_collator=pad_collate, ulysses=u, ring=r, **kwargs
            )
            if resume:  # a checkpoint folder without the sharded model and optimizer (as save_only_model writes)
                made.train(resume_from_checkpoint=tmp)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)

    cp = hcp.init_cp_mesh(2, 2)
    model = apply_context_parallel(model_for("llama"), cp)
    packed = hcp.shard_batch(collator("packed")(rows(3, seed=5)), cp)
    dense = hcp.shard_batch(pad_collate(rows(2, seed=5)), cp)
    cases = {
        "label_smoothing_factor": lambda: trainer(label_smoothing_factor=0.1),
        "train_sampling_strategy": lambda: trainer(train_sampling_strategy="group_by_length"),
        "average_tokens_across_devices": lambda: trainer(average_tokens_across_devices=False),
        "fsdp": lambda: trainer(fsdp="full_shard", fsdp_config={"version": 2}),
        "load_best_model_at_end": lambda: trainer(fsdp2=True, load_best_model_at_end=True),
        "resume_from_checkpoint": lambda: trainer(fsdp2=True, resume=True),
        "compute_metrics": lambda: trainer(compute_metrics=lambda p: {}),
        "train_dataset": lambda: trainer(train_dataset=Stream()),
        "ulysses": lambda: trainer(u=3, r=1),
        "dynamic_cp": lambda: trainer(dynamic_cp=hcp.DynamicCP(tokens_per_rank=16)),  # and ulysses=2, ring=2
        "labels": lambda: model(
            input_ids=dense["input_ids"], position_ids=dense["position_ids"], labels=dense["labels"]
        ),
        "cu_seq_lens_q": lambda: model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]),
    }
    out = {name: _refusal(fn) for name, fn in cases.items()}
    hcp.destroy_cp_mesh(cp)
    return out


def auto_case() -> dict:
    """CPTrainer(ulysses="auto", ring="auto") and (ulysses="auto", ring=2): the degrees the planner chose and
    the log line that says why."""
    import logging

    from hybrid_cp.integrations.hf import CPTrainer

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("hybrid_cp")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    out = {}
    try:
        for name, ring in (("both", "auto"), ("ring=2", 2)):
            with tempfile.TemporaryDirectory() as tmp:
                trainer = CPTrainer(
                    model=model_for("llama"),
                    args=training_args(tmp, 2, 1),
                    train_dataset=rows(4, 1),
                    data_collator=pad_collate,
                    ulysses="auto",
                    ring=ring,
                    cp_seq_len=4096,
                )
            cp = trainer.cp
            out[name] = (cp.ulysses_size, cp.ring_size, cp.dp_size, [m for m in records if "planner" in m])
            records.clear()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out


def mesh_case() -> dict:
    """`cp_mesh_from_device_mesh` on DeviceMeshes shaped as accelerate builds them (dp_shard, cp): the cp mesh's
    groups (ranks) and the refusal of cp groups that are not consecutive ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_cp.integrations.trainer_mesh import cp_mesh_from_device_mesh

    out = {}
    for dp, cp_size, u in ((1, 4, 2), (2, 2, 2), (1, 4, 1)):
        mesh = init_device_mesh("cpu", (dp, cp_size), mesh_dim_names=("dp_shard", "cp"))
        cp = cp_mesh_from_device_mesh(mesh, u)
        out[(dp, cp_size, u)] = {
            "accelerate_cp": dist.get_process_group_ranks(mesh["cp"].get_group()),
            "cp": dist.get_process_group_ranks(cp.cp_group),
            "ulysses": dist.get_process_group_ranks(cp.ulysses_group),
            "ring": dist.get_process_group_ranks(cp.ring_group),
            "degrees": (cp.ulysses_size, cp.ring_size, cp.dp_size),
        }
    outer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp_shard"))
    out["strided"] = _refusal(lambda: cp_mesh_from_device_mesh(outer, 2))
    return out


_ARGS = (
    "label_smoothing_factor",
    "train_sampling_strategy",
    "average_tokens_across_devices",
    "fsdp",
    "fsdp_config",
    "load_best_model_at_end",
)
CHECKS = {"direct": direct_case, "errors": errors_case, "auto": auto_case, "mesh": mesh_case}


def run_resume(case: str, role: str, out: str) -> dict:
    """CPTrainer saving every 2 steps, `save_model` into OUT/saved-<case>, then a second trainer resuming from
    the step-2 checkpoint: the losses and weights of both runs ("resume+fsdp2": CPTrainer(fsdp2=True), whose
    checkpoints hold the sharded model and optimizer through DCP; "resume+dyn": dynamic_cp, 3 steps per epoch,
    so the resumed run skips batches mid-epoch and then starts the second epoch; per step its schedule, and the
    bytes each run's meshes counted)."""
    import hybrid_cp as hcp
    from hybrid_cp.integrations.hf import SHARDED_FOLDER, CPTrainer

    name, kind, u, r = case.split(":")
    fsdp2 = name.endswith("+fsdp2")
    dynamic = "+dyn" in name
    batch = 1 if kind == "dense" else PACKED_BATCH
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = rows((3 * world if dynamic else STEPS * 2) * ACCUMULATION * batch, seed=1)
    mesh = dict(dynamic_cp=hcp.DynamicCP(tokens_per_rank=DYNAMIC_C)) if dynamic else dict(ulysses=int(u), ring=int(r))
    result = {}
    for run in ("full", "resumed"):
        args = training_args(out, ACCUMULATION, batch, save_strategy="steps", save_steps=2)
        trainer = CPTrainer(
            model=model_for("llama"),
            args=args,
            train_dataset=data,
            data_collator=collator(kind),
            fsdp2=fsdp2,
            **mesh,
        )
        degrees: list = []
        if dynamic:
            _record_degrees(trainer, degrees)
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if run == "resumed" else None)
        result[run] = history(trainer)
        result[run]["degrees"] = degrees
        result[run]["counted_bytes"] = counted_bytes(trainer)
        result[run]["epoch"] = trainer.state.epoch
        result[run]["weights"] = full_weights(trainer.model)
        result[run]["sharded"] = os.path.isdir(os.path.join(out, "checkpoint-2", SHARDED_FOLDER))
        if run == "full":
            trainer.save_model(os.path.join(os.environ["HF_CASES_OUT"], f"saved-{case.replace(':', '_')}"))
    return result


def byte_tokenizer():
    """The example's byte-level tokenizer (examples/sft_trl.py: built on the machine, no download)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from sft_trl import byte_tokenizer as example_tokenizer

    return example_tokenizer()


def run_sft(case: str, role: str, out: str) -> dict:
    """TRL: CPSFTTrainer (cp) or SFTTrainer (ref) with packing=True (bfd) or padding_free=True."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hybrid_cp.integrations.hf import CPSFTTrainer

    _, kind, u, r = case.split(":")
    u, r = int(u), int(r)
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (u * r) if role == "cp" else int(os.environ.get("HF_CASES_DP", "1"))
    batch = 1 if kind == "packing" else PACKED_BATCH
    accumulation = ACCUMULATION if role == "cp" else ACCUMULATION * dp
    data = Dataset.from_list(rows(STEPS * ACCUMULATION * 2 * batch * 3, seed=3))
    args = SFTConfig(
        output_dir=out,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=1 if role == "cp" else dp,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        learning_rate=5e-3,
        logging_steps=1,
        max_grad_norm=0.5,
        warmup_steps=1,
        adam_epsilon=ADAM_EPS,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=96 if kind == "packing" else None,
        packing=kind == "packing",
        padding_free=kind == "padding_free",
        bf16=False,
    )
    common = dict(
        model=model_for("llama", cache=role == "cp"),
        args=args,
        train_dataset=data,
        eval_dataset=Dataset.from_list(rows(8, seed=4)),
        processing_class=byte_tokenizer(),
    )
    trainer = CPSFTTrainer(**common, ulysses=u, ring=r) if role == "cp" else SFTTrainer(**common)
    trainer.train()
    result = history(trainer)
    if role == "cp":
        result["counted_bytes"] = counted_bytes(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["weights"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return result


def main(argv: list[str]) -> None:
    out, role, cases = argv[0], argv[1], argv[2:]
    os.environ["HF_CASES_OUT"] = out
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    checks = [c for c in cases if c in CHECKS]
    if checks:  # every rank's answers, gathered to rank 0
        import torch.distributed as dist
        from accelerate import PartialState

        PartialState(cpu=True)  # the process group, set up as the Trainer's arguments do
        mine = {name: CHECKS[name]() for name in checks}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if rank == 0:
            torch.save(every, os.path.join(out, "checks.pt"))
        cases = [c for c in cases if c not in CHECKS]
    for case in cases:
        if role == "ref":
            os.environ["HF_CASES_DP"] = case.split(":")[4] if case.count(":") == 4 else "1"
            case = ":".join(case.split(":")[:4])
        runner = {"sft": run_sft, "resume": run_resume}.get(case.split(":")[0].split("+")[0], run_case)
        result = runner(case, role, os.path.join(out, f"work-{role}-{case.replace(':', '_')}"))  # shared by ranks
        if rank == 0:
            torch.save(
                result,
                os.path.join(
                    out,
                    f"{role}-{case.replace(':', '_')}{'_dp' + os.environ['HF_CASES_DP'] if role == 'ref' else ''}.pt",
                ),
            )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
