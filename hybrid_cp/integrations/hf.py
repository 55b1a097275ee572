"""Context parallelism behind the Hugging Face `Trainer` and TRL's `SFTTrainer`.

`CPTrainerMixin` turns any `transformers.Trainer` subclass into a context-parallel one: world =
dp x (ring x ulysses), the ranks of one cp group see the same batches (the dataloader is split per dp
replica, not per process), each batch is sharded with `hcp.shard_batch` after it reaches the device,
and the model runs through `apply_context_parallel`, whose loss is `hcp.cross_entropy` over the cp group.
Everything else (optimizer, schedule, clipping, gradient accumulation, DDP over all ranks, logging,
checkpoints) is the stock Trainer's. The few places where the stock code assumes that every process
holds distinct samples are overridden, each for one reason (docs/training.md):

- `get_cp_size`: the Trainer divides its count of label tokens (`num_items_in_batch`, summed over all
  processes) by it, so the count is that of the global batch once, not cp times;
- `_get_dataloader`: accelerate's batch sampler shard is told dp (replicas), not the world size;
- `compute_loss`: the batch is sharded with `hcp.shard_batch` after the Trainer counted its label tokens;
  each rank's loss is then its own tokens' share of the global mean, as on a DDP rank, so the stock
  world-size factor and DDP's gradient average over all dp x cp ranks hold as they are;
- with `fsdp2=`: `save_model` gathers the full weights; checkpoints hold the sharded model and optimizer
  through `torch.distributed.checkpoint` (`_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`);
- `prediction_step` / `evaluation_loop`: losses only (logits are shards), gathered per dp replica.

With `dynamic_cp=hcp.DynamicCP(tokens_per_rank=C)` instead of ulysses=/ring=, every process reads its batches
as a plain DDP process would; `get_batch_samples` gathers the step's batches of all processes (the global
batch), cuts them into documents and schedules those over groups of degrees 1, 2, 4, ... (`hcp.schedule_documents`);
`training_step` runs this rank's micro-batches of that schedule, each on its group's mesh (`use_mesh`), with
the loss normalised over the step's target tokens across the world. Evaluation runs each process's own
batches on one rank (the degree-1 mesh), as DDP does.

Arguments whose handling under context parallelism is not verified raise `ConfigError` on every rank in
the constructor, before any collective (`trainer_args`). `CPSFTTrainer` (TRL) is built on first use: `trl` is
imported only then. The mesh ("auto" degrees, accelerate's device mesh) comes from `trainer_mesh`, the planner's
model shape from `config_shape`; their public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..engine.comm import comm_bytes, comm_guard
from ..engine.meshes import init_cp_meshes
from ..errors import ConfigError
from ..training.batch import shard_batch
from ..training.dynamic import DynamicCP, batch_documents, micro_batches, schedule_documents
from .config_shape import GATED_DELTA_TYPES, MAMBA2_TYPES, model_shape
from .fsdp import shard_model
from .trainer_args import check_constructor, check_fsdp2, check_training_arguments, checkpoints_allowed, refuse
from .trainer_mesh import auto_degrees, cp_mesh_from_accelerator, cp_mesh_from_device_mesh, ddp_timeout, resolve_mesh
from .transformers import apply_context_parallel, use_mesh

# with fsdp2, the folder of a Trainer checkpoint that holds the sharded model and optimizer (DCP, every rank's shards)
SHARDED_FOLDER = "hybrid_cp_sharded"


class CPTrainerMixin:
    """Context parallelism for a `transformers.Trainer` subclass: `class MyTrainer(CPTrainerMixin, Trainer)`.

    Takes every argument of the Trainer it is mixed into plus `ulysses`, `ring` (ints, or "auto", the
    default: the planner's split for this world size, the model's shape and `cp_seq_len`, by default TRL's
    `max_length` or the model's `max_position_embeddings`; logged with the reason), `layout` (the mesh's token
    layout) and `cp_validate` (`init_cp_mesh(validate=...)`). `fsdp2=True` (or a dict of `fully_shard` keyword
    arguments) shards the model with FSDP2 over all dp x cp ranks (`shard_model`) instead of DDP. `self.cp`
    is the mesh.

    `dynamic_cp=hcp.DynamicCP(tokens_per_rank=C)` instead of ulysses=/ring= (both: ConfigError): a degree per
    group of documents, chosen every step (docs/training.md "Variable-length batches"). The step's global batch
    is what a plain DDP run of WORLD_SIZE processes reads (per_device_train_batch_size x
    gradient_accumulation_steps x world items); its documents run in the schedule's micro-batches, so
    gradient_accumulation_steps only sizes the global batch. `self.cp_meshes` is the family of meshes,
    `self.cp` its degree-1 mesh and `self.cp_schedule` the last step's schedule (`explain()` prints it).
    """

    def __init__(
        self,
        *args: Any,
        ulysses: int | str | None = None,
        ring: int | str | None = None,
        layout: str = "zigzag",
        cp_validate: bool | str = True,
        cp_seq_len: int | None = None,
        fsdp2: bool | dict = False,
        dynamic_cp: DynamicCP | None = None,
        **kwargs: Any,
    ):
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        check_constructor(bound)
        training_args = bound.arguments.get("args")
        if training_args is not None:
            check_training_arguments(training_args)
        if dynamic_cp is not None:
            _check_dynamic(self, dynamic_cp, ulysses, ring)
        self.cp_fsdp2 = check_fsdp2(fsdp2, training_args) if fsdp2 is not False else None
        if training_args is not None:
            training_args.device  # noqa: B018  (sets up torch.distributed under torchrun / accelerate launch)
        model = bound.arguments["model"]
        if isinstance(model, str):
            raise refuse("model", model, "pass an instantiated model (from_pretrained), not a name")
        self.cp_dynamic, self.cp_meshes, self.cp_schedule = dynamic_cp, None, None
        timeout = ddp_timeout(training_args)
        if dynamic_cp is not None:  # a mesh per degree; the degree-1 mesh is the home one (evaluation, FSDP2)
            self.cp_meshes = init_cp_meshes(
                None if dynamic_cp.degrees is None else list(dynamic_cp.degrees),
                splits=dynamic_cp.split_map,
                layout=layout,
                validate=cp_validate,
                heads=getattr(model.config, "num_attention_heads", None),
                timeout=timeout,
            )
            self.cp = self.cp_meshes.mesh(1)
        else:
            if cp_seq_len is None:  # what "auto" plans for: TRL's max_length, else the model's context
                cp_seq_len = getattr(training_args, "max_length", None) or getattr(
                    model.config, "max_position_embeddings", None
                )
            self.cp = resolve_mesh(
                model,
                "auto" if ulysses is None else ulysses,
                "auto" if ring is None else ring,
                layout,
                cp_validate,
                cp_seq_len,
                timeout,
            )
        apply_context_parallel(model, self.cp)
        if dynamic_cp is not None:
            with use_mesh(model, self.cp):  # the models use_mesh refuses (the same answer on every rank)
                pass
        if self.cp_fsdp2 is not None:
            shard_model(
                model.to(training_args.device if training_args is not None else "cpu"), self.cp, **self.cp_fsdp2
            )
            # the stock Trainer's path for a model that owns its sharding and gradient reduction (sharded at load
            # time): not moved, no DDP wrap, no second sharding; and transformers' FSDP2 marker, so the reduce-
            # scatter is deferred under gradient accumulation (and generation syncs its ranks)
            model._is_distributed_loading_by_transformers = True
            model._is_fsdp_managed_module = True
        with checkpoints_allowed(training_args, self.cp_fsdp2 is not None):
            super().__init__(*args, **kwargs)
        if training_args is None:
            check_training_arguments(self.args)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The stock log entry; a training entry also gets `cp_comm_bytes`: the bytes all ranks together sent
        in the context-parallel exchanges (all-to-all and ring, forward and backward) since the previous entry
        (one all-reduce: every rank logs at the same steps)."""
        if "loss" in logs and dist.is_initialized():
            meshes = self.cp_meshes.meshes.values() if self.cp_meshes is not None else [self.cp]
            sent = torch.tensor(
                [sum(sum(comm_bytes(m).values()) for m in meshes)], dtype=torch.int64, device=self.cp.device
            )
            dist.all_reduce(sent, group=self.cp.dp_cp_group)
            total = int(sent.item())
            logs = {**logs, "cp_comm_bytes": total - getattr(self, "_cp_bytes_logged", 0)}
            self._cp_bytes_logged = total
        super().log(logs, *args, **kwargs)

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """FSDP2's reduce-scatter waits for the last micro-batch of an accumulation window (the stock version reads
        a `distributed_config` that a model sharded by `shard_model` does not have)."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """With dynamic_cp: this process's batches of the step, as the stock loop fetches them (they keep its
        step counting, FLOP and token counts those of a DDP process), the last one also carrying this rank's
        micro-batches of the step's schedule; the count is N, the step's valid targets over the world."""
        if self.cp_meshes is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        work, targets = self._dynamic_step(batches)
        if batches:
            batches[-1] = {**batches[-1], _STEP_KEY: work}
        return batches, targets

    def _dynamic_step(self, batches: list[dict]) -> tuple[list, int]:
        """The global batch (every process's batches of the step, gathered over the world in rank order) cut into
        documents and scheduled; this rank's (micro-batch, packed row or None when idle) pairs, and N. A batch
        one process cannot cut raises ConfigError on every rank (its error is gathered with the documents)."""
        try:
            mine, error = [d for b in batches for d in batch_documents(b)], None
        except ConfigError as exc:
            mine, error = [], str(exc)
        every: list = [None] * self.cp_meshes.world
        dist.all_gather_object(every, (error, mine), group=self.cp_meshes.check_group)
        bad = [(rank, e) for rank, (e, _) in enumerate(every) if e]
        if bad:
            raise ConfigError(f"dynamic_cp: rank {bad[0][0]}'s batch: {bad[0][1]}")
        docs = [d for _, ds in every for d in ds]
        sched = schedule_documents(
            [len(ids) for ids, _ in docs],
            self.cp_meshes,
            self.cp_dynamic.tokens_per_rank,
            targets=[int((t != -100).sum()) for _, t in docs],
        )
        self.cp_schedule = sched
        work = []
        for mb in micro_batches(sched, self.cp_meshes):
            row = (
                None
                if mb.idle
                else {
                    "input_ids": torch.cat([docs[d][0] for d in mb.docs])[None],
                    "shift_labels": torch.cat([docs[d][1] for d in mb.docs])[None],
                    "cu_seq_lens_q": torch.tensor(mb.cu_seqlens, dtype=torch.int32),
                }
            )
            work.append((mb, row))
        return work, sched.targets

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        """With dynamic_cp: this rank's micro-batches of the step (carried by the step's last batch; the others
        carry none), each forward and backward on its group's mesh, gradient reduction deferred to the last;
        returns the sum of their losses (`_micro_batch_loss`)."""
        if self.cp_meshes is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        total = torch.zeros((), device=self.args.device)
        work = inputs.get(_STEP_KEY, ())
        for i, (mb, row) in enumerate(work):
            defer = self._no_sync(model) if i < len(work) - 1 else contextlib.nullcontext()
            with defer, use_mesh(self.model, mb.cp):  # backward inside: checkpointed layers recompute on mb.cp
                with self.compute_loss_context_manager():
                    loss = self._micro_batch_loss(model, mb, row, num_items_in_batch)
                self.accelerator.backward(loss)
            total += loss.detach()
        return total

    def _no_sync(self, model: torch.nn.Module):
        """No gradient reduction for this backward (DDP's no_sync; FSDP2's deferred reduce-scatter)."""
        if self.cp_fsdp2 is not None:
            return self._defer_fsdp_gradient_reduction()
        return self.accelerator.no_sync(model)

    def _micro_batch_loss(self, model: torch.nn.Module, mb: Any, row: dict | None, targets: int) -> torch.Tensor:
        """W / N times this rank's sum of token losses (N: the step's targets, W: the world), which is the
        stock Trainer's loss on a DDP rank (its share of the global mean times the world size): DDP's gradient
        average makes the step the one-process one, and the logged mean over ranks of the summed values is
        the step's token mean. An idle rank runs one placeholder token, times 0 (DDP's and FSDP2's collectives
        need every rank in every backward)."""
        if row is None:
            inputs = {k: v for k, v in mb.placeholder_batch().items() if k not in ("labels", "shift_labels")}
            return model(**inputs).logits.float().sum() * 0.0
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        local = shard_batch(row, mb.cp, pad_token_id=pad if isinstance(pad, int) else 0)
        labels = local.pop("labels")
        local.pop("shift_labels")
        logits = model(**local).logits
        own = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1).to(logits.device),
            ignore_index=-100,
            reduction="sum",
        )
        return own * (self.cp_meshes.world / max(int(targets), 1))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """With fsdp2: the full state dict gathered from the shards (a collective, on every rank), written by the
        main process as an ordinary checkpoint (`from_pretrained` loads it on one process)."""
        if self.cp_fsdp2 is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        dist.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """With fsdp2: the sharded model and optimizer through `torch.distributed.checkpoint` into
        `output_dir/hybrid_cp_sharded` (a collective: every rank writes its shards), the schedule as the stock
        Trainer writes it (RNG states and trainer state stay the stock Trainer's)."""
        if self.cp_fsdp2 is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from transformers.trainer import SCHEDULER_NAME

        model_sd, optim_sd = get_state_dict(self.model, self._torch_optimizer())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(output_dir, SHARDED_FOLDER))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """With fsdp2 the weights are loaded with the optimizer state (`_load_optimizer_and_scheduler`, once the
        optimizer exists); a checkpoint without the sharded folder (save_only_model=True) is refused."""
        if self.cp_fsdp2 is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not os.path.isdir(os.path.join(resume_from_checkpoint, SHARDED_FOLDER)):
            raise refuse(
                "resume_from_checkpoint",
                resume_from_checkpoint,
                f"with fsdp2 resume from a checkpoint that holds {SHARDED_FOLDER}/ (written with "
                f"save_only_model=False); load a save_only_model checkpoint with from_pretrained instead",
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """With fsdp2: the sharded model and optimizer from `checkpoint/hybrid_cp_sharded` (DCP, into the current
        shards), then the schedule."""
        if self.cp_fsdp2 is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from transformers.trainer import SCHEDULER_NAME

        optimizer = self._torch_optimizer()
        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, SHARDED_FOLDER))
        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside accelerate's wrapper (DCP's state-dict helpers step it to initialise state)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def get_cp_size(self) -> int:
        """Ranks that see the same batch: the Trainer divides its global label-token count by it."""
        return self.cp.size

    def _get_dataloader(self, *args: Any, **kwargs: Any):
        """The stock dataloader, with accelerate's batch sampler shard split over dp replicas, not processes."""
        loader = super()._get_dataloader(*args, **kwargs)
        shard = getattr(loader, "batch_sampler", None)
        if not (hasattr(shard, "num_processes") and hasattr(shard, "process_index")):
            raise ConfigError(
                f"the dataloader is a {type(loader).__name__} with batch sampler "
                f"{type(shard).__name__}: the context-parallel trainer splits batches per dp replica "
                f"through accelerate's BatchSamplerShard; use a map-style dataset and leave "
                f"accelerator_config.dispatch_batches unset"
            )
        shard.num_processes = self.cp.dp_size
        shard.process_index = self.cp.dp_rank
        return loader

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ):
        """The stock loss on this rank's shard of the batch. Sharding happens here, after the Trainer has counted
        the label tokens of the whole batch (`num_items_in_batch`); where a caller passed no count (TRL's
        evaluation) it is counted here, so every rank's loss is its own tokens' share of the global mean, as
        on a DDP rank (the stock world-size factor and DDP's gradient average then hold as they are)."""
        if num_items_in_batch is None and (inputs.get("labels") is not None or inputs.get("shift_labels") is not None):
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        return super().compute_loss(
            model, self.shard(inputs), return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def shard(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard of a batch of whole rows (`hcp.shard_batch`: labels shifted on the whole sequence)."""
        has_labels = inputs.get("labels") is not None or inputs.get("shift_labels") is not None
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        out = shard_batch(inputs, self.cp, pad_token_id=pad if isinstance(pad, int) else 0)
        if not has_labels:
            out.pop("labels")
            out.pop("shift_labels")
        return out

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        """The stock count of label tokens across the processes (a default-group gather): a peer that stalled
        or died there is a CommTimeoutError naming it, as in the mesh's own collectives."""
        with comm_guard(self.cp, "the Trainer's count of label tokens (its gather across processes)"):
            return super()._get_num_items_in_batch(batch_samples, device)

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ):
        """Losses only: logits and labels are this rank's shards."""
        return super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """The stock loop with losses gathered from one rank per dp replica (the cp ranks repeat them)."""
        self.gather_function = self._gather_replicas
        return super().evaluation_loop(*args, **kwargs)

    def _gather_replicas(self, tensor: torch.Tensor, **_: Any) -> torch.Tensor:
        """Per-rank losses of every process -> one per dp replica (the sum of its cp ranks' shares, over cp: each
        rank's share carries the world-size factor), in dp order, without the samples the last batches repeated."""
        # on the mesh's all-ranks group, with its timeout: a stalled peer is a CommTimeoutError, not a wait on the
        # default group (which transformers leaves at torch's 30 minutes on CPU)
        group = self.cp.dp_cp_group
        rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        with comm_guard(self.cp, "the evaluation's loss gather"):
            dist.all_gather(rows, tensor.contiguous(), group=group)
        by_rank = dict(zip(dist.get_process_group_ranks(group), rows))  # global rank -> its losses
        grid = self.cp.device_mesh.mesh.reshape(self.cp.dp_size, self.cp.size)  # [dp, cp] -> global rank
        out = torch.stack([by_rank[g] for g in grid.flatten().tolist()]).reshape(*grid.shape, *tensor.shape)
        out = out.to(torch.float64).mean(1).to(tensor.dtype).reshape(-1, *tensor.shape[1:])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            out = out[: state.remainder]
        return out


# the key of the step's last batch that carries this rank's scheduled micro-batches (dynamic_cp)
_STEP_KEY = "hybrid_cp_dynamic_step"
# what a dynamic step replaces of the stock Trainer: a subclass between the mixin and Trainer that overrides one of
# them (TRL's SFTTrainer computes its own loss and metrics) is not verified with it
_DYNAMIC_OVERRIDES = ("compute_loss", "training_step", "get_batch_samples")


def _check_dynamic(trainer: Any, dynamic_cp: Any, ulysses: Any, ring: Any) -> None:
    """`dynamic_cp=` instead of ulysses=/ring=, a `DynamicCP`, on a Trainer whose loss path is the stock one."""
    if not isinstance(dynamic_cp, DynamicCP):
        raise refuse("dynamic_cp", dynamic_cp, "pass hybrid_cp.DynamicCP(tokens_per_rank=C)")
    if ulysses is not None or ring is not None:
        raise refuse(
            "ulysses/ring",
            (ulysses, ring),
            "give either dynamic_cp= (a degree per group of documents, "
            "chosen every step) or ulysses=/ring= (one fixed mesh)",
        )
    from transformers import Trainer

    for cls in type(trainer).__mro__:
        if cls is Trainer:
            break
        hit = [n for n in _DYNAMIC_OVERRIDES if n in vars(cls)] if cls is not CPTrainerMixin else []
        if hit:
            raise refuse(
                "dynamic_cp",
                dynamic_cp,
                f"{cls.__name__} overrides {hit}: dynamic degrees are verified "
                f"with transformers.Trainer's own loss path only (CPTrainer)",
            )


def _trainer_class():
    from transformers import Trainer

    class CPTrainer(CPTrainerMixin, Trainer):
        """`transformers.Trainer` with context parallelism (`CPTrainerMixin`): add ulysses=, ring= (or
        dynamic_cp=hcp.DynamicCP(tokens_per_rank=C))."""

    CPTrainer.__module__ = __name__
    return CPTrainer


def _sft_trainer_class():
    from trl import SFTTrainer

    class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
        """TRL's `SFTTrainer` with context parallelism (`CPTrainerMixin`): add ulysses=, ring=."""

    CPSFTTrainer.__module__ = __name__
    return CPSFTTrainer


_LAZY = {"CPTrainer": _trainer_class, "CPSFTTrainer": _sft_trainer_class}


def __getattr__(name: str):
    """`CPTrainer` and `CPSFTTrainer` are built on first access, so transformers and trl load only then."""
    if name in _LAZY:
        cls = _LAZY[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CPTrainerMixin",
    "CPTrainer",  # noqa: F822 (built on first access)
    "CPSFTTrainer",  # noqa: F822 (built on first access)
    "check_training_arguments",
    "resolve_mesh",
    "auto_degrees",
    "model_shape",
    "GATED_DELTA_TYPES",
    "MAMBA2_TYPES",
    "cp_mesh_from_device_mesh",
    "cp_mesh_from_accelerator",
]
