"""The checks of the context-parallel trainer's arguments: the stock Trainer's constructor and
`TrainingArguments` settings whose effect under context parallelism is not verified raise `ConfigError`
on every rank, before any collective (`check_constructor`, `check_training_arguments`, `check_fsdp2`);
`checkpoints_allowed` lets the stock constructor accept full checkpoints of an FSDP2 model."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from ..errors import ConfigError

# constructor arguments of the stock Trainer that would see this rank's shard where they expect the whole
# sequence (logits for metrics) or compute a loss of their own on it
REFUSED_ARGUMENTS = {
    "model_init": "pass model= (an instantiated model): the mesh is applied to it before training",
    "compute_loss_func": "drop it: the model's own loss is replaced by the cp group's cross entropy",
    "compute_metrics": "drop it: logits are per-rank shards under context parallelism (eval_loss is exact)",
    "preprocess_logits_for_metrics": "drop it: logits are per-rank shards under context parallelism",
}


def refuse(name: str, value: Any, fix: str) -> ConfigError:
    """The error for an argument the context-parallel trainer does not take, with how to fix it."""
    return ConfigError(
        f"{name}={value!r} is not supported by the context-parallel trainer (hybrid_cp.integrations.hf): {fix}"
    )


def check_training_arguments(args: Any) -> None:
    """Raise ConfigError for TrainingArguments whose effect under context parallelism is not verified."""
    checks = [
        ("label_smoothing_factor", lambda v: v not in (0, 0.0, None), "set it to 0"),
        (
            "parallelism_config",
            lambda v: v is not None,
            "drop it: hybrid-cp builds its own mesh from ulysses=/ring= (see hybrid_cp.integrations.hf.cp_mesh_from_"
            "accelerator for accelerate's cp dimension)",
        ),
        ("deepspeed", lambda v: bool(v), "drop it: DeepSpeed is not verified with hybrid-cp (use DDP)"),
        (
            "fsdp",
            lambda v: bool(v),
            "drop it and pass fsdp2=True to the trainer: it shards the model with hybrid_cp.integrations.fsdp."
            "shard_model over the dp x cp ranks (accelerate's own FSDP runs DDP instead on CPU; not verified)",
        ),
        (
            "train_sampling_strategy",
            lambda v: v == "group_by_length",
            'use "random" or "sequential": the length-grouped batch sampler is built per process, not per dp replica',
        ),
        ("n_gpu", lambda v: v > 1, "launch one process per device (torchrun), not torch.nn.DataParallel"),
        ("torch_compile", lambda v: bool(v), "set it to False (not verified through the Trainer)"),
        (
            "average_tokens_across_devices",
            lambda v: v is False,
            "set it to True (the default): each rank's loss is its share of the global token mean",
        ),
    ]
    for name, bad, fix in checks:
        value = getattr(args, name, None)
        if bad(value):
            raise refuse(f"TrainingArguments.{name}", value, fix)
    acc = getattr(args, "accelerator_config", None)
    for name in ("split_batches", "dispatch_batches"):
        value = getattr(acc, name, None)
        if value:
            raise refuse(
                f"TrainingArguments.accelerator_config.{name}",
                value,
                "leave it unset: every process loads its dp replica's batches itself",
            )


def check_constructor(bound: inspect.BoundArguments) -> None:
    """The stock constructor's arguments, checked before anything is built."""
    given = bound.arguments
    for name, fix in REFUSED_ARGUMENTS.items():
        if given.get(name) is not None:
            raise refuse(name, type(given[name]).__name__, fix)
    if given.get("model") is None:
        raise refuse("model", None, REFUSED_ARGUMENTS["model_init"])
    for name in ("train_dataset", "eval_dataset"):
        data = given.get(name)
        sets = data.values() if isinstance(data, dict) else [data]
        if any(isinstance(d, torch.utils.data.IterableDataset) for d in sets):
            raise refuse(
                name,
                "an IterableDataset",
                "use a map-style dataset (datasets.Dataset or a list): its batches are split per dp replica by index",
            )


def check_fsdp2(fsdp2: Any, args: Any) -> dict:
    """The `fully_shard` keyword arguments of `fsdp2=` (True or a dict); ConfigError for what is not verified."""
    if not (fsdp2 is True or isinstance(fsdp2, dict)):
        raise ConfigError(
            f"fsdp2={fsdp2!r}: expected True, False or a dict of fully_shard keyword arguments "
            f"(e.g. {{'mp_policy': MixedPrecisionPolicy(...)}})"
        )
    if args is not None and getattr(args, "load_best_model_at_end", False):
        raise refuse(
            "TrainingArguments.load_best_model_at_end",
            True,
            "with fsdp2 set it to False and load the best checkpoint's full weights with from_pretrained "
            "(the stock path loads full weights into the FSDP2 shards: not verified)",
        )
    return {} if fsdp2 is True else dict(fsdp2)


@contextlib.contextmanager
def checkpoints_allowed(args: Any, fsdp2: bool):
    """The stock constructor refuses full checkpoints of a model sharded before it (its optimizer state would be
    torch.save'd from rank 0); with fsdp2 the mixin writes that state through DCP, so the check is passed with
    save_only_model shown as True, and the user's value restored right after."""
    saved = getattr(args, "save_only_model", None)
    if fsdp2 and args is not None:
        args.save_only_model = True
    try:
        yield
    finally:
        if fsdp2 and args is not None:
            args.save_only_model = saved
