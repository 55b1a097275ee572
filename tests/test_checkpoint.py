"""Checkpoints resume exactly: examples/train_llama.py under torchrun (gloo, CPU) against one
uninterrupted run, on the same mesh, on another mesh and world size, with another dp degree, and
after a worker is SIGKILLed under `torchrun --max-restarts 1`; the atomic-save, lookup and pruning
rules of hybrid_cp.training.checkpoint on one process."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tolerance import within

from hybrid_cp.errors import ConfigError, InconsistentRanksError
from hybrid_cp.testing import mesh_description
from hybrid_cp.training import checkpoint as ckpt

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 8, 3
MODEL = [
    "--device",
    "cpu",
    "--seq-len",
    "64",
    "--hidden",
    "32",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--steps",
    str(STEPS),
    "--warmup",
    "2",
    "--schedule",
    "cosine",
    "--lr",
    "3e-3",
    "--resume",
]
# relative loss differences after a resume: on the same mesh the bound (the same fp32 arithmetic: worst 0,
# bitwise); on another mesh fp32 round-off of other reduction orders (worst 9.6e-8, 100x)
SAME_MESH, OTHER_MESH = 1e-6, 1e-5


def _launch(folder: Path, name: str, nproc: int, ulysses: int, ring: int, batch: int, *extra: str) -> subprocess.Popen:
    """torchrun of the example on `nproc` local gloo processes, writing folder/name (checkpoints) and name.jsonl."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *extra,
        str(ROOT / "examples" / "train_llama.py"),
        *MODEL,
        "--ulysses",
        str(ulysses),
        "--ring",
        str(ring),
        "--batch",
        str(batch),
        "--save-dir",
        str(folder / name),
        "--save-every",
        str(EVERY),
        "--metrics",
        str(folder / f"{name}.jsonl"),
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # its own process group: one killpg ends all of it


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"one line per step expected, got steps {steps}"
    return {r["step"]: r["loss"] for r in rows}


def _times(path: Path) -> dict[int, float]:
    return {r["step"]: r["time"] for r in map(json.loads, path.read_text().splitlines())}


def _worker_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of torchrun's workers now alive (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def _wait_for(checkpoint: Path, proc: subprocess.Popen, timeout: float = 200) -> None:
    """Until `checkpoint` is published (renamed into place), the run ended, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _kill_after_checkpoint(proc: subprocess.Popen, checkpoint: Path, record: dict) -> None:
    """SIGKILL worker rank 1 as soon as `checkpoint` is published (the steps after it are then lost).

    The worker is found before the checkpoint appears: scanning /proc on a loaded machine can take longer
    than the rest of this short run, which would then end before the kill."""
    pid = None
    while pid is None and proc.poll() is None:
        for parent in [proc.pid, *_proc_children(proc.pid)]:  # torchrun's agent starts the workers
            pid = pid or _worker_pids(parent).get(1)
        time.sleep(0.005)
    _wait_for(checkpoint, proc)
    if pid is not None and proc.poll() is None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # the worker had already ended: the test reports that no kill happened
            return
        record["killed_at"] = time.time()


def _proc_children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted 4-rank run (u2 x r2) and, side by side with it, the restart run; once the first
    has published its step-3 checkpoint, two runs that resume it on 2 ranks (u2 x r1, and dp=2 with
    half the batch per replica)."""
    folder = tmp_path_factory.mktemp("ckpt")
    t0 = time.monotonic()
    procs = {
        "ref": _launch(folder, "ref", 4, 2, 2, 2),
        "restart": _launch(folder, "restart", 4, 2, 2, 2, "--max-restarts", "1"),
    }
    record: dict = {}
    killer = threading.Thread(
        target=_kill_after_checkpoint, args=(procs["restart"], folder / "restart" / "step-00000003", record)
    )
    killer.start()
    try:
        _wait_for(folder / "ref" / "step-00000003", procs["ref"])
        for name, (nproc, ulysses, ring, batch) in {"other_mesh": (2, 2, 1, 2), "other_dp": (2, 1, 1, 1)}.items():
            (folder / name).mkdir()
            shutil.copytree(folder / "ref" / "step-00000003", folder / name / "step-00000003")
            procs[name] = _launch(folder, name, nproc, ulysses, ring, batch)
        out = {name: _finish(proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            _kill_group(proc)
        killer.join()
    losses = {name: _losses(folder / f"{name}.jsonl") for name in out}
    return {"folder": folder, "out": out, "losses": losses, "record": record, "wall": time.monotonic() - t0}


def _max_rel(run: dict[int, float], ref: dict[int, float], after: int) -> float:
    steps = list(range(after + 1, STEPS + 1))
    assert sorted(run) == sorted(set(run) | set(steps)) and all(s in run for s in steps), (sorted(run), steps)
    return max(abs(run[s] - ref[s]) / abs(ref[s]) for s in steps)


@pytest.mark.e2e  # starts its own torchrun processes
def test_resume_on_another_mesh_and_world_size(runs):
    ref = runs["losses"]["ref"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    for name, note in (("other_mesh", "dp=1 ulysses=2 ring=2"), ("other_dp", "dp=1 ulysses=2 ring=2")):
        assert (
            f"resumed from {runs['folder'] / name / 'step-00000003'} (step 3, written on {note})" in runs["out"][name]
        )
        assert sorted(runs["losses"][name]) == list(range(4, STEPS + 1))
        err = _max_rel(runs["losses"][name], ref, 3)
        within(err, OTHER_MESH, f"{name} loss after resume")
        print(f"\n{name}: max relative loss difference after resume {err:.2e}")


@pytest.mark.e2e  # starts its own torchrun processes
def test_restart_after_sigkill_resumes_with_the_same_losses(runs):
    out, record = runs["out"]["restart"], runs["record"]
    assert "killed_at" in record, "the watcher found no worker to kill"
    resumed = re.findall(r"resumed from \S+ \(step (\d+),", out)  # anywhere: a progress bar may share the line
    assert len(resumed) == 1, out[-4000:]  # the first attempt started fresh, the restart resumed
    step = int(resumed[0])
    assert step in range(EVERY, STEPS, EVERY), resumed
    losses = runs["losses"]["restart"]
    assert sorted(losses) == list(range(1, STEPS + 1))  # the re-done steps replaced, not appended
    err = _max_rel(losses, runs["losses"]["ref"], step)
    within(err, SAME_MESH, "loss after restart")
    to_resume = _times(runs["folder"] / "restart.jsonl")[step + 1] - record["killed_at"]
    assert 0 < to_resume < 200
    kept = sorted(p.name for p in (runs["folder"] / "restart").iterdir())
    assert kept == ["step-00000003", "step-00000006", "step-00000008"], kept
    print(
        f"\nrestart: resumed from step {step}, max relative loss difference {err:.2e} "
        f"(bit-identical: {err == 0.0}), kill -> first step after resume {to_resume:.1f} s; "
        f"all runs {runs['wall']:.1f} s"
    )


# ---------------------------------------------------------------- one process: the atomic save, lookup, pruning


def _state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


CP1 = mesh_description(1, 1)


def test_kill_between_write_and_rename_leaves_the_older_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _state(0)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, CP1, scheduler=sched, global_batch=4)
    saved = model.weight.detach().clone(), opt.state_dict()["state"][0]["exp_avg"].clone(), sched.state_dict()
    model(torch.randn(5, 4)).sum().backward()
    opt.step()

    def killed(tmp, final):
        raise KeyboardInterrupt("killed between the write and the rename")

    monkeypatch.setattr(ckpt, "_publish", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, CP1, scheduler=sched, global_batch=4)
    assert (tmp_path / "step-00000002.tmp" / ckpt.MARKER).is_file()  # fully written, never published
    fresh, fresh_opt, fresh_sched = _state(1)
    with pytest.warns(UserWarning, match="step-00000002.tmp"):
        info = ckpt.load_checkpoint(tmp_path, fresh, fresh_opt, CP1, scheduler=fresh_sched, global_batch=4)
    assert info.step == 1 and info.path == tmp_path / "step-00000001" and info.replica_next_sample == [4]
    assert torch.equal(fresh.weight, saved[0])
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved[1])
    assert fresh_sched.state_dict() == saved[2]
    with pytest.raises(ConfigError, match=r"global_batch=8 .*global batch 4"), pytest.warns(UserWarning):
        ckpt.load_checkpoint(tmp_path, fresh, fresh_opt, CP1, global_batch=8)


def _corrupt(folder: Path, how: str) -> None:
    if how == "no marker":
        (folder / ckpt.MARKER).unlink()
    elif how == "garbage marker":
        (folder / ckpt.MARKER).write_text("{not json")
    else:  # a truncated shard: the file's size no longer matches the marker
        shard = next(folder.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:10])


@pytest.mark.parametrize(
    "how,why",
    [
        ("no marker", "no hybrid_cp_checkpoint.json"),
        ("garbage marker", "unreadable"),
        ("truncated", r"\S+\.distcp is missing or has 10 bytes"),
    ],
)
def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path, how, why):
    model, opt, _ = _state(0)
    for step in (3, 5):
        ckpt.save_checkpoint(tmp_path, step, model, opt, CP1)
    _corrupt(tmp_path / "step-00000005", how)
    with pytest.warns(
        UserWarning, match=f"skipping corrupt checkpoint {re.escape(str(tmp_path / 'step-00000005'))}: {why}"
    ):
        assert ckpt.latest_checkpoint(tmp_path).step == 3
    assert ckpt.latest_checkpoint(tmp_path / "absent") is None


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    model, opt, _ = _state(0)
    (tmp_path / "step-00000001.tmp").mkdir()  # left by an interrupted save
    (tmp_path / "notes").mkdir()  # not ours: never touched
    for step in (2, 4, 6, 8):
        ckpt.save_checkpoint(tmp_path, step, model, opt, CP1, keep=2, extra={"run": "a"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-00000006", "step-00000008"]
    assert ckpt.latest_checkpoint(tmp_path).extra == {"run": "a"}
    with pytest.raises(ConfigError, match="keep=0"):
        ckpt.save_checkpoint(tmp_path, 9, model, opt, CP1, keep=0)


def test_every_rank_must_be_at_the_same_step(monkeypatch):
    monkeypatch.setattr(ckpt, "_all_gather", lambda step: [3, 3, 4, 3])
    with pytest.raises(InconsistentRanksError, match=r"different steps before saving: \[3, 3, 4, 3\]"):
        ckpt._agreed_step(3, "before saving")


@pytest.mark.parametrize("global_batch", [4, 8])
def test_data_order_depends_on_the_global_step_only(global_batch):
    for step in (0, 5):
        expect = list(range(step * global_batch, (step + 1) * global_batch))
        for dp in (1, 2, 4):
            meshes = [_with_dp(dp, d) for d in range(dp)]
            assert [i for cp in meshes for i in ckpt.replica_samples(step, global_batch, cp)] == expect
    with pytest.raises(ConfigError, match="global_batch=6 .* dp degree 4"):
        ckpt.replica_samples(0, 6, _with_dp(4, 0))


def _with_dp(dp: int, rank: int):
    return dataclasses.replace(CP1, dp_size=dp, dp_rank=rank)


def test_restart_store_gives_each_torchrun_attempt_its_own_keys(monkeypatch):
    import datetime

    import torch.distributed as dist

    for key in ("TORCHELASTIC_USE_AGENT_STORE", "GROUP_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(key, raising=False)
    assert ckpt.restart_store() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        assert ckpt.restart_store() is None  # several nodes: the agents' restart counts may differ
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=20))
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    ckpt.restart_store(datetime.timedelta(seconds=20)).set("rank_0", "here")
    assert server.get("attempt-2/rank_0") == b"here" and not server.check(["rank_0"])
