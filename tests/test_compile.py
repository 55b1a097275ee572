"""torch.compile: a model whose attention goes through `hcp.attention` compiles as one graph (the
attention is the opaque custom op `hybrid_cp::attention_fwd`, see hybrid_cp/engine/compiled.py), does not
recompile when the data changes, and matches eager loss and gradients on a ulysses x ring mesh.

Backends: aot_eager for most cases. It runs everything the custom ops must get right (dynamo, the
fake implementations, AOTAutograd's joint graph and its forward/backward partition, the autograd
registration) but not Inductor's C++ code generation, which costs seconds per process on CPU; the
compiled graph then runs the same ATen ops as eager, so parity is exact. One case uses inductor,
whose fused kernels agree with eager to fp32 round-off.
"""

import compile_cases
import pytest
from tolerance import within

pytest.importorskip("torch._dynamo")

# aot_eager runs eager's ops: the errors are 0.0; this only absorbs a reordered fp32 sum (module head chunks, eager
# at a graph break: worst 1.2e-7, 8.6x)
EXACT = 1e-6
INDUCTOR = 1e-5  # Inductor's fused fp32 kernels reorder sums against eager: worst 5.3e-7 (grads), 19x


def _steps_within(rank: int, steps: list[dict], tol: float) -> None:
    for s, step in enumerate(steps):
        within(step["loss"], tol, f"rank {rank} step {s} loss", step)
        within(step["grads"], tol, f"rank {rank} step {s} grads", step)


def _mine(rows):
    """The cases compile on the first cp group only (dp rank 0); the other replicas return None."""
    rows = [row for row in rows if row is not None]
    assert rows, "no rank compiled"
    return rows


def _check_parity(rows, tol, halo=None):
    for rank, row in enumerate(_mine(rows)):
        assert row["frames"] == 1, (rank, row["frames"])  # one compile for 3 steps of new data
        assert row["graph_breaks"] == {}, (rank, row["graph_breaks"])
        assert row["op_in_graph"], rank
        _steps_within(rank, row["steps"], tol)
        for step in row["steps"]:
            if halo is not None:
                assert step["halo"] is halo, (rank, step)


@pytest.mark.parametrize("packed", [False, True])
def test_ops_pass_opcheck(pool, packed):
    """Schema, fake vs real shapes and strides, autograd registration and AOT dispatch of both ops."""
    for row in _mine(pool.run(compile_cases.opcheck, u=2, r=2, packed=packed)):
        for op in ("fwd", "bwd"):
            assert set(row[op].values()) == {"SUCCESS"}, row


@pytest.mark.parametrize("packed,window", [(False, None), (True, 5)], ids=["dense", "packed-halo"])
def test_compiled_model_matches_eager(pool, packed, window):
    """fullgraph=True, error_on_recompile=True; u=2 x r=2, causal, GQA (4 query heads, 2 KV heads).
    The packed case changes the document boundaries every step and uses a short window (halo mode:
    backward receives the halo rows again instead of keeping forward's)."""
    rows = pool.run(compile_cases.parity, u=2, r=2, packed=packed, window=window)
    _check_parity(rows, EXACT, halo=True if window else None)


def test_inductor_matches_eager(pool):
    _check_parity(pool.run(compile_cases.parity, u=2, r=2, backend="inductor"), INDUCTOR)


def test_kernel_objects_and_listed_boundaries_compile(pool):
    for rank, row in enumerate(_mine(pool.run(compile_cases.argument_kinds, u=2, r=2))):
        for key, err in row.items():
            within(err, EXACT, f"rank {rank} {key}", row)


def test_validation_runs_inside_the_compiled_op(pool):
    """One rank compiles causal=False, the others causal=True: every rank raises, naming the field."""
    for row in _mine(pool.run(compile_cases.validation, u=2, r=2)):
        assert row.startswith("InconsistentRanksError") and "causal" in row, row


def test_unsupported_options_run_outside_the_graph(pool):
    """head_chunks > 1 (not expressible as the op) falls back to eager at a graph break: same result."""
    for rank, row in enumerate(_mine(pool.run(compile_cases.outside_graph, u=2, r=2))):
        _steps_within(rank, [row], EXACT)


def test_transformers_llama_compiles(pool):
    """A tiny HF Llama through apply_context_parallel: exact, and the model body (attention op included)
    is one graph compiled once for all steps. The integration's pre-forward hook (input checks with
    data-dependent branches and the cross-rank agreement) runs eagerly (torch.compiler.disable), so
    nothing recompiles after the first step."""
    pytest.importorskip("transformers")
    for rank, row in enumerate(_mine(pool.run(compile_cases.hf_llama, u=2, r=2))):
        _steps_within(rank, row["steps"], EXACT)
        with_op = [i for i, n in enumerate(row["attention_ops"]) if n]
        assert len(with_op) == 1 and row["attention_ops"][with_op[0]] == 1, (rank, row)  # compiled once
        assert row["graph_sizes"][with_op[0]] == max(row["graph_sizes"]), (rank, row)  # the body, whole
        assert row["steps"][-1]["frames"] == row["steps"][0]["frames"], (rank, row)  # no recompiles


def test_transformers_llama_with_module_head_chunks_compiles(pool):
    """Module-level head chunks under torch.compile: the chunk loop runs eagerly (a graph break per
    attention module), results exact, and nothing recompiles after the first step."""
    pytest.importorskip("transformers")
    for rank, row in enumerate(_mine(pool.run(compile_cases.hf_llama, u=2, r=2, head_chunks=2))):
        _steps_within(rank, row["steps"], EXACT)
        assert not any(row["attention_ops"]), (rank, row)  # no compiled attention op: the pipeline is eager
        assert row["steps"][-1]["frames"] == row["steps"][0]["frames"], (rank, row)


def test_import_leaves_dynamo_out():
    """`import hybrid_cp` does not load torch._dynamo (about 1 s of every process start): the engine's
    graph breaks (`engine/eager.py`) and the custom ops (`engine/compiled.py`) load it on the first trace.
    Nor DCP and DTensor (0.74 s more): checkpoints import them on use."""
    import subprocess
    import sys

    code = "import sys, hybrid_cp; print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'hybrid_cp.engine.compiled', 'torch.distributed.tensor', 'torch.distributed.checkpoint'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
