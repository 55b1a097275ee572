"""Sharded, atomic training checkpoints that resume exactly, on the same mesh or another one.

What every context-parallel training loop needs beyond `torch.distributed.checkpoint` (DCP):

- the data position of every dp replica, defined by the global step alone (`replica_samples`), so
  a run resumed on another (dp, ring, ulysses) split reads the same sequences in the same steps;
- every rank agreeing on the step before a save and after a load (a rank one step ahead would
  otherwise write or resume a mixed state);
- atomic publication: everything is written into ``step-NNNNNNNN.tmp``, rank 0 then writes the
  marker (`MARKER`: step, split, data position, the size of every file) and renames the folder to
  ``step-NNNNNNNN``. A worker killed at any point before the rename leaves the older checkpoints
  as they were; the lookup skips, with a warning naming them, folders that are partial or whose
  files do not match their marker.

The model and optimizer go through DCP's `get_state_dict`/`set_state_dict`, so FSDP2-sharded
weights and optimizer state are resharded on load when the mesh or world size changed. The
folder must be on a filesystem every rank sees (as DCP's file writer requires).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, ConfigError, InconsistentRanksError, SetupError

if TYPE_CHECKING:
    from ..engine.mesh import CPMesh

log = logging.getLogger("hybrid_cp")

MARKER = "hybrid_cp_checkpoint.json"  # written last, before the rename: its presence means complete
TRAIN_STATE = "train_state.pt"  # RNG states of every rank, the LR schedule, the caller's extras
_NAME = re.compile(r"^step-(\d+)(\.tmp)?$")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a complete checkpoint's marker says: where it is, its step, the split it was written on."""

    path: Path
    step: int
    dp: int
    ulysses: int
    ring: int
    world: int
    global_batch: int | None = None
    replica_next_sample: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def replica_samples(step: int, global_batch: int, cp: "CPMesh") -> range:
    """The global sample indices this dp replica trains on at optimizer step `step` (0-based).

    Step `s` covers samples ``s * global_batch ... (s + 1) * global_batch - 1`` whatever the split:
    replica `d` of `dp` takes the d-th contiguous slice of ``global_batch // dp``. A resumed run on
    another dp degree thus sees the same sequences per step, and the loss (a global token mean)
    only changes by fp32 round-off.

    Args:
        step: The optimizer step (0-based).
        global_batch: Sequences per optimizer step over all dp replicas.
        cp: The mesh (its dp rank and degree).

    Returns:
        The global sample indices of this dp replica.
    """
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % cp.dp_size:
        raise ConfigError(
            f"global_batch={global_batch!r} must be a positive multiple of the dp degree "
            f"{cp.dp_size}: pick a global batch that every dp replica can split evenly"
        )
    per = global_batch // cp.dp_size
    first = _replica_start(step, global_batch, cp.dp_rank, cp.dp_size)
    return range(first, first + per)


def _replica_start(step: int, global_batch: int, dp_rank: int, dp_size: int) -> int:
    return step * global_batch + dp_rank * (global_batch // dp_size)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    if _world()[1] == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agreed_step(step: int, when: str) -> int:
    """All ranks' step, checked equal; raised on every rank alike (they all see the same list)."""
    steps = _all_gather(int(step))
    if len(set(steps)) != 1:
        raise InconsistentRanksError(
            f"the ranks are at different steps {when}: {steps} (rank order); every rank "
            "must call save_checkpoint/load_checkpoint at the same optimizer step"
        )
    return steps[0]


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _dcp(fn: Any, state: dict, path: Path, world: int) -> None:
    """`dcp.save`/`dcp.load`; without a process group DCP warns that it assumes one process: we mean that."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=path, no_dist=world == 1)


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _write_durably(path: Path, write: Any, mode: str = "wb") -> None:
    """Write and fsync: the marker must not reach the disk before what it describes."""
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path) -> None:
    """Make a written checkpoint visible: one rename (atomic on POSIX filesystems)."""
    if final.exists():  # the same step written again (a restart resumed from an older one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checked_keep(keep: int | None) -> None:
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ConfigError(f"keep={keep!r} must be None (keep every checkpoint) or a positive int, e.g. keep=3")


def _marker_content(step: int, cp: "CPMesh", global_batch: int | None, extra: dict, tmp: Path) -> dict:
    positions = (
        [_replica_start(step, global_batch, d, cp.dp_size) for d in range(cp.dp_size)]
        if global_batch is not None
        else []
    )
    return {
        "step": step,
        "dp": cp.dp_size,
        "ulysses": cp.ulysses_size,
        "ring": cp.ring_size,
        "world": _world()[1],
        "global_batch": global_batch,
        "replica_next_sample": positions,
        "extra": extra,
        "files": _file_sizes(tmp),
    }


def _checked_save_arguments(step: int, cp: "CPMesh", global_batch: int | None, extra: dict | None, keep: Any) -> None:
    """`save_checkpoint`'s arguments checked before its first collective, so a bad one raises instead of hanging."""
    _checked_keep(keep)
    if global_batch is not None:
        replica_samples(step, global_batch, cp)  # a bad global batch raises here, before any collective
    try:  # and so does an extra that JSON cannot hold
        json.dumps(extra or {})
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"extra={extra!r} must be JSON-serialisable (a dict of numbers, strings, lists, dicts): {exc}"
        ) from None


def save_checkpoint(  # noqa: PLR0913 (public entry point)
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cp: "CPMesh",
    *,
    scheduler: Any = None,
    global_batch: int | None = None,
    extra: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Write ``directory/step-NNNNNNNN`` atomically after optimizer step `step` (steps done so far).

    Call on every rank. Holds the (FSDP2-sharded) model and optimizer through DCP, every rank's RNG
    states, `scheduler.state_dict()`, the split, the data position of every dp replica for
    `global_batch` (see `replica_samples`) and `extra` (JSON). `keep`: delete all but the newest
    `keep` complete checkpoints (and leftover partial ones) afterwards. Returns the final path.

    Args:
        directory: The run's checkpoint folder.
        step: Optimizer steps done so far.
        model: The (FSDP2-sharded) model.
        optimizer: Its optimizer.
        cp: The mesh.
        scheduler: A learning-rate scheduler, if any.
        global_batch: Sequences per optimizer step over all dp replicas (for `replica_samples`).
        extra: JSON-serialisable data to keep with the checkpoint.
        keep: Keep only the newest `keep` complete checkpoints.

    Returns:
        The checkpoint's folder.

    Raises:
        ConfigError: A `global_batch` that is not a positive multiple of the dp degree.
        SetupError: The folder could not be written (every rank; the older checkpoints are untouched).
        CommTimeoutError: Rank 0 died or hung while creating or publishing the folder (the other ranks, within
            the default process group's timeout); the checkpoint is published if rank 0 got past the rename.
    """
    import torch.distributed.checkpoint as dcp  # imported on use: DCP pulls in DTensor (~0.8 s per process start)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _checked_save_arguments(step, cp, global_batch, extra, keep)
    world = _world()[1]
    step = _agreed_step(step, "before saving")
    final = Path(directory) / f"step-{step:08d}"
    tmp = final.with_name(final.name + ".tmp")

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def publish() -> None:
        train_state = {"rng": rngs, "scheduler": scheduler.state_dict() if scheduler is not None else None}
        _write_durably(tmp / TRAIN_STATE, lambda f: torch.save(train_state, f))
        marker = _marker_content(step, cp, global_batch, extra or {}, tmp)
        _write_durably(tmp / MARKER, lambda f: json.dump(marker, f, indent=1), "w")
        _publish(tmp, final)
        if keep is not None:
            prune_checkpoints(directory, keep)

    _on_rank0(prepare, f"create {tmp}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:  # DCP gathers every rank's write failures and raises the same CheckpointException on each
        _dcp(dcp.save, {"model": model_sd, "optim": optim_sd}, tmp, world)
    except (OSError, CheckpointException) as exc:
        raise SetupError(
            f"could not write {tmp} ({_first_error(exc)}); the older checkpoints are untouched: check "
            f"that the folder is writable, has space and is on a filesystem every rank sees"
        ) from exc
    rngs = _all_gather(_rng_state())
    _on_rank0(publish, f"publish {final}")  # nobody goes on (or exits) before the checkpoint is visible
    return final


def _on_rank0(work: Any, what: str) -> None:
    """Run `work` on rank 0; every rank returns after it, or raises if it failed (instead of waiting
    for rank 0 in the next collective until the timeout)."""
    rank, world = _world()
    failure = [None]
    cause = None
    if rank == 0:
        try:
            work()
        except Exception as exc:  # every rank raises the same SetupError, rank 0 with the cause chained
            failure, cause = [f"{type(exc).__name__}: {exc}"], exc
    if world > 1:
        try:
            dist.broadcast_object_list(failure, src=0)
        except RuntimeError as exc:  # DistBackendError, gloo's errors: rank 0 died or hung while doing `work`
            raise CommTimeoutError(
                f"rank 0 did not report whether it could {what} within the default process "
                f"group's timeout (it died or hung; backend said: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                f"load_checkpoint takes the newest complete checkpoint"
            ) from exc
    if failure[0] is not None:
        raise SetupError(
            f"rank 0 could not {what}: {failure[0]}; check that the folder is writable and on a "
            "filesystem every rank sees"
        ) from cause


def _read_marker(folder: Path) -> CheckpointInfo | str:
    """The folder's CheckpointInfo, or why it is not a complete checkpoint."""
    try:
        content = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} (an interrupted save, or a copy that did not finish)"
    except (OSError, ValueError) as exc:
        return f"unreadable {MARKER}: {exc}"
    try:
        files, step = content["files"], int(content["step"])
        info = CheckpointInfo(
            path=folder,
            step=step,
            dp=content["dp"],
            ulysses=content["ulysses"],
            ring=content["ring"],
            world=content["world"],
            global_batch=content["global_batch"],
            replica_next_sample=content["replica_next_sample"],
            extra=content["extra"],
        )
    except (KeyError, TypeError, ValueError) as exc:
        return f"{MARKER} lacks {exc}"
    if _NAME.match(folder.name) and int(_NAME.match(folder.name).group(1)) != step:
        return f"{MARKER} says step {step}, the folder name another"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or has {path.stat().st_size if path.is_file() else 0} bytes, not {size}"
    return info


def _entries(directory: Path) -> list[tuple[int, bool, Path]]:
    """(step, partial?, path) of every step-N or step-N.tmp folder in `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), bool(m.group(2)), p) for p in directory.iterdir() if p.is_dir() and (m := _NAME.match(p.name))
    ]
    return sorted(found, key=lambda e: (e[0], not e[1]), reverse=True)


def latest_checkpoint(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest complete checkpoint in `directory`, or None. Local: no collective.

    Newer partial (``.tmp``) or corrupt folders are skipped with a `UserWarning` naming them and
    saying why; older ones than the one returned are not inspected.

    Args:
        directory: The run's checkpoint folder.

    Returns:
        The newest complete checkpoint's info, or None.
    """
    for _, partial, path in _entries(Path(directory)):
        if partial:
            warnings.warn(f"skipping partial checkpoint {path}: a save that did not finish", stacklevel=2)
            continue
        found = _read_marker(path)
        if isinstance(found, CheckpointInfo):
            return found
        warnings.warn(f"skipping corrupt checkpoint {path}: {found}", stacklevel=2)
    return None


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and every partial one; return the deleted.

    Run by one process (`save_checkpoint` runs it on rank 0 after its own save has been renamed).

    Args:
        directory: The run's checkpoint folder.
        keep: How many complete checkpoints to keep.

    Returns:
        The deleted folders.
    """
    _checked_keep(keep)
    complete, removed = 0, []
    for _, partial, path in _entries(Path(directory)):
        if not partial and isinstance(_read_marker(path), CheckpointInfo) and complete < keep:
            complete += 1
            continue
        if not partial and complete < keep:  # corrupt and newer than the kept ones: leave it for inspection
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _broadcast_choice(directory: str | os.PathLike) -> CheckpointInfo | None:
    """Rank 0 looks the newest checkpoint up, every rank loads that one (a shared filesystem may lag)."""
    rank, world = _world()
    if world == 1:
        missing = _missing(directory)
        if missing is not None:
            raise missing
        return latest_checkpoint(directory)
    choice: list[Any] = [None]
    if rank == 0:
        try:
            choice = [_missing(directory) or latest_checkpoint(directory)]
        except Exception as exc:  # told to every rank, not left for them to wait on
            choice = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], ConfigError):
        raise choice[0]
    if isinstance(choice[0], str):
        raise SetupError(f"rank 0 could not look for checkpoints in {directory}: {choice[0]}")
    return choice[0]


def _missing(directory: str | os.PathLike) -> ConfigError | None:
    """The error for a checkpoint folder that does not exist: a mistyped path must not pass for a fresh start."""
    if Path(directory).is_dir():
        return None
    return ConfigError(
        f"directory={str(directory)!r} does not exist (or is not a folder): no checkpoint can be in "
        f"it. A first run creates it (os.makedirs(directory, exist_ok=True)) before calling "
        f"load_checkpoint, so that a mistyped path is not taken for a fresh start"
    )


def load_checkpoint(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cp: "CPMesh",
    *,
    scheduler: Any = None,
    global_batch: int | None = None,
) -> CheckpointInfo | None:
    """Resume from the newest complete checkpoint in `directory`; None (nothing changed) if there is none.
    A `directory` that does not exist raises ConfigError (create it on a first run): a mistyped path is not
    a fresh start.

    Call on every rank, after building the model, `shard_model` and the optimizer (and scheduler)
    exactly as for a fresh start: DCP loads into their current sharding, whatever the split the
    checkpoint was written on. `global_batch`, if given, must equal the one saved (the data order
    depends on it). RNG states are restored per rank when the split is the one saved; on another
    split rank k takes saved rank k mod the saved world size (streams per rank cannot map exactly).
    Returns the checkpoint's info; continue with optimizer step ``info.step``.

    Args:
        directory: The run's checkpoint folder.
        model: The model, built and sharded as for a fresh start.
        optimizer: Its optimizer.
        cp: The mesh (any split).
        scheduler: A learning-rate scheduler, if any.
        global_batch: Must equal the one saved, if given.

    Returns:
        The loaded checkpoint's info, or None when there is none.

    Raises:
        ConfigError: `global_batch` differs from the one saved; `directory` does not exist (a mistyped path is
            not a fresh start: create the folder on a first run); the checkpoint does not fit the model or
            optimizer (a parameter's name or shape).
    """
    import torch.distributed.checkpoint as dcp  # imported on use: DCP pulls in DTensor (~0.8 s per process start)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    info = _broadcast_choice(directory)
    if info is None:
        return None
    if global_batch is not None and info.global_batch is not None and global_batch != info.global_batch:
        raise ConfigError(
            f"global_batch={global_batch} but {info.path} was written with global batch "
            f"{info.global_batch}: resume with the same global batch (sequences per step over all "
            f"dp replicas), e.g. --batch {info.global_batch // cp.dp_size} on dp={cp.dp_size}"
        )
    rank, world = _world()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        _dcp(dcp.load, state, info.path, world)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (RuntimeError, ValueError, KeyError, CheckpointException) as exc:  # (CheckpointException: a BaseException)
        raise ConfigError(
            f"{info.path} does not fit this model and optimizer (a parameter's name or shape "
            f"differs): {_first_error(exc)}; build the model and optimizer as they were when it was "
            f"saved"
        ) from exc
    saved = torch.load(info.path / TRAIN_STATE, weights_only=True)
    if scheduler is not None and saved["scheduler"] is not None:
        scheduler.load_state_dict(saved["scheduler"])
    same = (info.dp, info.ulysses, info.ring, info.world) == (cp.dp_size, cp.ulysses_size, cp.ring_size, world)
    _set_rng_state(saved["rng"][rank if same else rank % len(saved["rng"])])
    _agreed_step(info.step, "after loading")
    return info


def _first_error(exc: BaseException) -> str:
    """The line of a (DCP) error that says what failed, not its traceback dump."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for key in ("size mismatch", "shape", "Error"):
        found = [line for line in lines if key in line]
        if found:
            return found[0][:300]
    return (lines or [type(exc).__name__])[0][:300]


def restart_store(timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> Any:
    """For `init_process_group(store=..., rank=RANK, world_size=WORLD_SIZE)` under torchrun restarts: None
    when not needed (outside torchrun, several nodes, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).

    torchrun's agent keeps one TCPStore for every restart attempt unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so a restarted group reads the dead group's connection keys
    and creating its process groups fails ("Connection refused"). On one node this returns the
    agent's store behind a prefix per attempt (TORCHELASTIC_RESTART_COUNT). On several nodes the
    agents count restarts separately (pytorch#135712), so a prefix could differ between nodes:
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun there (warned about on rank 0).

    Args:
        timeout: The store's timeout.

    Returns:
        A store for `init_process_group(store=...)`, or None.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if env.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and env.get("RANK") == "0":
            warnings.warn(
                "torchrun restarts on several nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
                "environment (docs/training.md, Checkpoints and restarts)",
                stacklevel=2,
            )
        return None
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


__all__ = [
    "restart_store",
    "CheckpointInfo",
    "MARKER",
    "replica_samples",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "prune_checkpoints",
]
