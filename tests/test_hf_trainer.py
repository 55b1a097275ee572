"""CPTrainer on 4 gloo ranks (torchrun) against the stock Trainer on one process (tests/hf_cases.py).

One torchrun launch trains every case in the same 4 processes (startup is most of the cost); the
stock references run at the same time in one plain process.

    python tests/test_hf_trainer.py OUT      # the figures the tests bound, per case (runs once into OUT)

prints, for each CP case, the relative errors the tests assert on (loss, grad norm, eval loss, weights: the
largest element and the largest tensor norm), so a tolerance's margin over what is seen can be read off;
it reuses OUT if it already holds a run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tolerance import within

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.e2e  # starts its own torchrun processes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MESHES = [(2, 2), (1, 4), (2, 1)]  # (ulysses, ring) on 4 ranks: dp = 1, 1, 2
KINDS = ["dense", "packed"]
CP_CASES = [f"llama:{kind}:{u}:{r}" for kind in KINDS for u, r in MESHES] + [
    "mistral:packed:2:2",
    "sft:packing:2:2",
    "sft:padding_free:2:1",
    "llama+gc:packed:1:4",
    "gemma3_text:packed:2:2",
    "qwen2:packed:2:2",
]
FSDP2 = ["llama+fsdp2:packed:2:2", "llama+fsdp2:dense:2:1"]  # CPTrainer(fsdp2=True); reference: the plain llama's
CP_CASES += FSDP2
# CPTrainer(dynamic_cp=DynamicCP(tokens_per_rank=16)): documents of 9..40 tokens on degrees 1, 2 and 4 (u x r in the
# name is 1 x 1: dp = world, so the reference is the stock Trainer reading the same global batch on one process)
DYNAMIC = ["llama+dyn:packed:1:1", "llama+dyn+fsdp2:dense:1:1"]
CP_CASES += DYNAMIC
CHECKS = ["direct", "errors", "auto", "mesh"]
# "+fsdp2": CPTrainer(fsdp2=True), DCP checkpoints; "+dyn": dynamic_cp (as in DYNAMIC), resumed mid-epoch
RESUME = ["resume:packed:2:2", "resume+fsdp2:packed:2:2", "resume+dyn:packed:1:1", "resume+dyn+fsdp2:dense:1:1"]


def _dp(u: int, r: int) -> int:
    return 4 // (u * r)


def _ref(case: str) -> str:
    """The stock reference's name of a cp CASE (FSDP2 changes nothing in the arithmetic)."""
    return (
        f"{case.rsplit(':', 2)[0].replace('+fsdp2', '').replace('+dyn', '')}:1:1:{_dp(*map(int, case.split(':')[2:]))}"
    )


REF_CASES = sorted({_ref(c) for c in CP_CASES})
REFUSED = {
    "label_smoothing_factor",
    "train_sampling_strategy",
    "average_tokens_across_devices",
    "fsdp",
    "compute_metrics",
    "train_dataset",
    "ulysses",
    "dynamic_cp",
    "labels",
    "cu_seq_lens_q",
    "load_best_model_at_end",
    "resume_from_checkpoint",
}


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    script = os.path.join(HERE, "hf_cases.py")
    cp = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            script,
            out,
            "cp",
            *CHECKS,
            *CP_CASES,
            *RESUME,
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ref = subprocess.run(
        [sys.executable, script, out, "ref", *REF_CASES], env=_env(), capture_output=True, text=True, timeout=600
    )
    cp_log = cp.communicate(timeout=600)[0]
    assert ref.returncode == 0, ref.stdout[-4000:] + ref.stderr[-4000:]
    assert cp.returncode == 0, cp_log[-8000:]
    return out


def _load(out: str, name: str) -> dict:
    return torch.load(os.path.join(out, name + ".pt"), weights_only=False)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _rel_norm(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", CP_CASES)
def test_cp_trainer_matches_stock_trainer(results, case):
    model, kind, u, r = case.split(":")
    got = _load(results, f"cp-{model}_{kind}_{u}_{r}")
    want = _load(results, "ref-" + _ref(case).rsplit(":", 1)[0].replace(":", "_") + f"_dp{_dp(int(u), int(r))}")
    # Bounds: fp32 round-off of another summation order (per-rank partial sums, all-reduces); worst seen over every
    # case (`python tests/test_hf_trainer.py OUT`, bitwise the same over 5 runs): loss 1.7e-7, grad norm
    # 1.05e-6 (gemma3), eval loss 1.7e-7: each bound keeps >= 50x over it. The dynamic cases (documents re-packed
    # into other rows and groups every step): loss 8.6e-8, grad norm 9.4e-8, eval loss 1.7e-7, weights 8.7e-6.
    assert len(got["loss"]) == len(want["loss"]) >= 4
    within(_rel(got["loss"], want["loss"]), 1e-5, "loss", (got["loss"], want["loss"]))
    within(_rel(got["grad_norm"], want["grad_norm"]), 1e-4, "grad norm", (got["grad_norm"], want["grad_norm"]))
    assert got["lr"] == want["lr"]
    # cp_comm_bytes: every training log entry has the bytes all ranks sent since the previous one; they add up
    # to what the ranks counted (u * r > 1 sends on every step)
    assert all(isinstance(b, int) and b > 0 for b in got["cp_comm_bytes"]) or int(u) * int(r) == 1, got["cp_comm_bytes"]
    assert sum(got["cp_comm_bytes"]) == got["counted_bytes"], (got["cp_comm_bytes"], got["counted_bytes"])
    within(_rel(got["eval_loss"], want["eval_loss"]), 1e-5, "eval loss", (got["eval_loss"], want["eval_loss"]))
    assert got["weights"].keys() == want["weights"].keys()
    # Weights after 4 AdamW steps. Adam divides each gradient entry by its own RMS, so an entry that is near zero
    # (embedding rows of tokens seen once) turns its fp32 round-off into a step difference of up to lr * noise /
    # (sqrt(v) + eps): one element of one tensor sets the elementwise figure, a lottery on which entry sits near
    # zero (gemma3 packed 2x2: 1.02e-4 with eps 1e-6, 8.9e-6 with 1e-5, 2.2e-5 with 1e-7; bitwise the same over 5
    # runs, so any reordered sum elsewhere moves it). The tensor's norm is not a lottery (worst 1.25e-5, qwen2):
    # it is the tight check; the elementwise bound keeps 10x over the worst element seen (1.02e-4). The latest
    # recorded run (tests/tolerance.py): norm 1.17e-5, element 4.5e-5, loss 1.7e-7, grad norm 1.7e-7.
    within(max(_rel_norm(got["weights"][k], want["weights"][k]) for k in want["weights"]), 1e-4, "weights norm")
    within(max(_rel(got["weights"][k], want["weights"][k]) for k in want["weights"]), 1e-3, "weights element")


@pytest.mark.parametrize("case", DYNAMIC)
def test_dynamic_cp_runs_mixed_degrees_and_counts_their_bytes(results, case):
    """The comparison above is of a run that really mixed degrees: every step's schedule (global batch of
    per_device_train_batch_size x accumulation x world items) put documents on groups of 1, 2 and 4 ranks
    (all three over the run, at least two per step), in micro-batches that are not the accumulation count; each
    log entry's cp_comm_bytes is > 0 and they add up to what the ranks counted on all the family's meshes."""
    got = _load(results, "cp-" + case.replace(":", "_"))
    steps = got["degrees"]
    assert len(steps) == 4 and all(len(degrees) >= 2 for degrees, *_ in steps), steps
    assert set().union(*(d for d, *_ in steps)) == {1, 2, 4}, steps
    assert any(count != 2 for _, count, *_ in steps), steps  # micro-batches come from the schedule
    assert all(b > 0 for b in got["cp_comm_bytes"]) and sum(got["cp_comm_bytes"]) == got["counted_bytes"], got


@pytest.mark.parametrize("kind", KINDS)
def test_model_loss_is_the_global_token_mean(results, kind):
    """model(**hcp.shard_batch(batch, cp)).loss (labels + shift_labels) on (2, 2), default use_cache=True, in
    fp64 against the stock model on one process with per-document attention (use_cache=False). The loss itself
    is computed in fp32 by both (transformers upcasts the logits; hcp.cross_entropy too)."""
    for i, rank in enumerate(_load(results, "checks")):
        got = rank["direct"][kind]
        # the loss in fp32 on both sides (fp32 round-off of the mean: worst 8.5e-8, 12x), the fp64 gradients (fp64
        # round-off: worst 7.2e-16)
        within(got["forward"], 1e-6, f"rank {i} forward", got)
        within(got["backward"], 1e-10, f"rank {i} backward", got)
        # fp32 weights under bf16 autocast (Trainer bf16=True): bf16 round-off (worst 6.7e-6)
        within(got["autocast_bf16"], 2e-2, f"rank {i} autocast_bf16", got)
    if kind == "packed":  # the pitfall our classes do not inherit: stock with use_cache=True mixes documents
        assert got["stock_use_cache"] > 1e-3, got


def test_unsupported_settings_raise_on_every_rank(results):
    every = _load(results, "checks")
    assert len(every) == 4
    for rank in every:
        assert set(rank["errors"]) == REFUSED
        for name, (kind, message) in rank["errors"].items():
            assert kind == "ConfigError", (name, kind, message)
            assert name in message, (name, message)


@pytest.mark.parametrize("case", RESUME)
def test_resume_from_checkpoint_continues_with_the_same_losses(results, case):
    """Bitwise: the resumed run reloads weights, optimizer state, schedule and RNG exactly (with fsdp2 the sharded
    model and optimizer through DCP; without the optimizer state step 4's loss differs by 1.6e-3 relative), and
    with dynamic_cp it gathers and schedules the same global batches (nothing of the dynamic step is saved: the
    data order, the documents and so the schedule follow from the stock Trainer's resumed sampler)."""
    got = _load(results, "cp-" + case.replace(":", "_"))
    assert got["full"]["sharded"] == ("fsdp2" in case)  # the DCP folder in checkpoint-2 only with fsdp2
    assert len(got["full"]["loss"]) == 4
    assert got["resumed"]["loss"] == got["full"]["loss"]  # steps 1-2 from the checkpoint's state, 3-4 trained again
    assert got["resumed"]["grad_norm"] == got["full"]["grad_norm"]
    for k, w in got["full"]["weights"].items():
        assert torch.equal(got["resumed"]["weights"][k], w), k
    # cp_comm_bytes: entries 1-2 come from the checkpoint's log, 3-4 are counted by the resumed trainer, each only
    # since the previous entry (the same bytes as the uninterrupted run's, adding up to what its meshes counted)
    full, resumed = got["full"]["cp_comm_bytes"], got["resumed"]["cp_comm_bytes"]
    assert resumed == full and all(b > 0 for b in full), (resumed, full)
    counted = got["full"]["counted_bytes"], got["resumed"]["counted_bytes"]
    assert (sum(full), sum(resumed[2:])) == counted, (full, resumed, counted)


@pytest.mark.parametrize("case", [c for c in RESUME if "+dyn" in c])
def test_dynamic_cp_resume_reschedules_the_same_global_batches(results, case):
    """With dynamic_cp the resumed run (skipping 2 steps' batches mid-epoch, then into the second epoch) gathers
    the same global batches as the uninterrupted one: steps 3-4 have the same schedules (digests), which mix
    degrees."""
    got = _load(results, "cp-" + case.replace(":", "_"))
    full, resumed = got["full"]["degrees"], got["resumed"]["degrees"]
    assert len(full) == 4 and resumed == full[2:], (full, resumed)  # the resumed trainer schedules steps 3-4 only
    assert all(len(degrees) >= 2 for degrees, *_ in resumed), resumed
    assert 1 < got["full"]["epoch"] == got["resumed"]["epoch"] < 2, got["full"]["epoch"]  # step 4: second epoch


@pytest.mark.parametrize("case", RESUME)
def test_save_model_loads_on_one_process(results, case):
    """trainer.save_model() writes an ordinary checkpoint: from_pretrained on one process, default attention."""
    from transformers import AutoModelForCausalLM

    path = os.path.join(results, "saved-" + case.replace(":", "_"))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config._attn_implementation != "hybrid_cp"
    trained = _load(results, "cp-" + case.replace(":", "_"))["full"]["weights"]
    for k, w in model.state_dict().items():
        assert torch.equal(w, trained[k]), k
    with torch.no_grad():
        out = model(input_ids=torch.arange(1, 17)[None], labels=torch.arange(1, 17)[None])
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("case", FSDP2)
def test_fsdp2_save_model_is_a_full_checkpoint(results, case):
    """save_model() under fsdp2 gathers the shards: from_pretrained on one process gives the trained weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(results, "saved-" + case.replace(":", "_")))
    got = _load(results, "cp-" + case.replace(":", "_"))
    trained = got["weights"]
    assert got["deferred"] == 4 * (2 - 1)  # 4 steps of accumulation 2: the first micro-batch's reduction deferred
    assert model.state_dict().keys() == trained.keys()
    for k, w in model.state_dict().items():
        assert torch.equal(w, trained[k]), k


def test_auto_split_comes_from_the_planner_and_is_logged(results):
    for rank in _load(results, "checks"):
        both, ring2 = rank["auto"]["both"], rank["auto"]["ring=2"]
        assert both[0] * both[1] * both[2] == 4 and ring2[1] == 2 and ring2[0] * ring2[2] == 2
        assert both[:3] == _load(results, "checks")[0]["auto"]["both"][:3]  # every rank chose the same
        for u, r, dp, lines in (both, ring2):
            assert len(lines) == 1 and f"ulysses={u} ring={r} dp={dp}" in lines[0] and "fastest feasible" in lines[0]


def test_mesh_from_accelerate_device_mesh(results):
    """accelerate's (dp_shard, cp) mesh -> CPMesh with the same cp groups, cp = ring x ulysses, ulysses innermost."""
    for rank, got in enumerate(r["mesh"] for r in _load(results, "checks")):
        for (dp, cp_size, u), groups in ((k, v) for k, v in got.items() if k != "strided"):
            assert groups["cp"] == groups["accelerate_cp"]
            assert groups["degrees"] == (u, cp_size // u, dp)
            first = rank - rank % u
            assert groups["ulysses"] == list(range(first, first + u))  # consecutive ranks
            assert len(groups["ring"]) == cp_size // u and rank in groups["ring"]
        assert got["strided"][0] == "ConfigError" and "consecutive" in got["strided"][1]


def test_one_process_accelerate_cpu_launch_is_named(monkeypatch):
    """`accelerate launch --cpu --num_processes 4` starts one process (no MPI): the error says what to run instead."""
    import torch.distributed as dist

    from hybrid_cp.errors import SetupError
    from hybrid_cp.integrations.trainer_mesh import resolve_mesh

    if dist.is_initialized():
        pytest.skip("this process is a distributed rank")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    with pytest.raises(SetupError, match="--multi_gpu --num_processes"):
        resolve_mesh(torch.nn.Linear(1, 1), 2, 2, "zigzag", True)


def _run_into(out: str) -> None:
    """The cases' torchrun and references once into `out` (the torchrun's output in out/cp.log)."""
    script = os.path.join(HERE, "hf_cases.py")
    with open(os.path.join(out, "cp.log"), "w") as log:
        cp = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "4",
                script,
                out,
                "cp",
                *CHECKS,
                *CP_CASES,
                *RESUME,
            ],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        ref = subprocess.run([sys.executable, script, out, "ref", *REF_CASES], env=_env(), capture_output=True)
        if cp.wait() or ref.returncode:
            raise SystemExit(f"a run failed (see {out}/cp.log): {ref.stderr[-2000:]!r}")


def _print_figures(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, "checks.pt")):
        _run_into(out)
    for case in CP_CASES:
        model, kind, u, r = case.split(":")
        got = _load(out, f"cp-{model}_{kind}_{u}_{r}")
        want = _load(out, "ref-" + _ref(case).rsplit(":", 1)[0].replace(":", "_") + f"_dp{_dp(int(u), int(r))}")
        element = max((_rel(got["weights"][k], want["weights"][k]), k) for k in want["weights"])
        norm = max(_rel_norm(got["weights"][k], want["weights"][k]) for k in want["weights"])
        print(
            f"{case:26s} loss {_rel(got['loss'], want['loss']):.2e}  grad_norm "
            f"{_rel(got['grad_norm'], want['grad_norm']):.2e}  eval {_rel(got['eval_loss'], want['eval_loss']):.2e}"
            f"  weights: element {element[0]:.2e} ({element[1]}), norm {norm:.2e}"
        )


if __name__ == "__main__":  # the figures the tests above bound
    _print_figures(sys.argv[1] if len(sys.argv) > 1 else "hf_trainer_figures")
