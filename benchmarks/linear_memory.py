"""Peak memory of one training step of a tiny hybrid model (Gated DeltaNet or Mamba2 layers next to attention)
under context parallelism, measured exactly, beside the planner's estimate (`topology.step_model.step_memory` of
`hybrid_cp.integrations.config_shape.model_shape(config)`).

CPU: `hybrid_cp.training.memory.StorageTracker` counts live tensor storage exactly (not RSS); 8 gloo processes
(dp = 8 / (u r)), replicated weights, AdamW (per-tensor), the second step (Adam's state exists).

    python benchmarks/linear_memory.py --dtypes fp32 bf16 --json benchmarks/results/linear_memory_cpu.json
    python benchmarks/linear_memory.py --dtypes fp32 bf16 --from-json benchmarks/results/linear_memory_cpu.json
    python benchmarks/linear_memory.py --mixers --dtypes fp32 bf16   # one mixer alone, one process

The first writes the docs/linear.md "Memory" table (24 steps, about 12 minutes on a loaded 2-core machine),
the second estimates stored measurements again (no pool). bf16 runs hold bf16 weights and Adam states (no
FSDP2 mixed precision on CPU) where the planner counts fp32 master weights: compare their columns "above
weights + Adam".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from memory_step import NullTracker, mib, one_step  # noqa: E402

from hybrid_cp.cli.table import table_lines  # noqa: E402
from hybrid_cp.testing.parity import mesh  # noqa: E402  (the worker's cached meshes; the tests release them per module)
from hybrid_cp.training.memory import StorageTracker, mark_stages  # noqa: E402

# tiny hybrids whose linear layers dominate the activations: a dense MLP (Qwen3.5's text model; Bamba), one
# linear layer then one attention layer, several recurrence chunks per rank
CONFIGS: dict[str, tuple[str, dict]] = {
    "gated_delta": (
        "qwen3_5_text",
        dict(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            use_cache=False,
        ),
    ),
    "mamba2": (
        "bamba",
        dict(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=64,
            mamba_expand=2,
            use_cache=False,
        ),
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the stages bracketed (attribute names of the decoder layers' submodules)
STAGES = ("self_attn", "mlp", "feed_forward", "linear_attn", "mamba")


def config(kind: str, **overrides: Any):
    from hybrid_cp.testing.families import tiny_config

    mtype, cfg = CONFIGS[kind]
    return tiny_config(mtype, **{**cfg, **overrides})


def measure(
    kind: str = "gated_delta",
    u: int = 2,
    r: int = 2,
    seq_len: int = 4096,
    checkpoint: bool = False,
    dtype: str = "fp32",
    **overrides: Any,
) -> dict:
    """One measured training step (the second) on this rank of a WorkerPool worker: the tiny hybrid under
    `apply_context_parallel` on a (u, r) mesh; bytes (`peak`: all live storage) and the stages' reports."""
    import torch.distributed as dist

    import hybrid_cp as hcp
    from hybrid_cp.integrations.transformers import apply_context_parallel
    from hybrid_cp.testing.families import build

    cp = mesh(u, r)
    model = build(config(kind, **overrides)).to(DTYPES[dtype])
    apply_context_parallel(model, cp)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    local = hcp.shard_batch({"input_ids": ids}, cp)

    one_step(model, local, cp, NullTracker(), tiled_loss=False, loss_chunk=None, optimizer=opt)
    tracker = StorageTracker()
    with tracker:
        tracker.track(list(model.parameters()), [list(s.values()) for s in opt.state.values()], local)
        base = tracker.live
        handles = mark_stages(model, tracker, STAGES)
        one_step(model, local, cp, tracker, tiled_loss=False, loss_chunk=None, optimizer=opt)
    for h in handles:
        h.remove()
    dist.barrier()
    return {"rank": dist.get_rank(), "base": base, "peak": tracker.peak, "stages": tracker.report()}


def mixer_memory(
    kind: str = "gated_delta", u: int = 2, r: int = 2, seq_len: int = 4096, dtype: str = "fp32", **overrides: Any
) -> dict:
    """One linear mixer of the tiny hybrid alone (layer 0's, routed by `apply_context_parallel`), forward then
    backward, on this rank of a WorkerPool worker: what its forward leaves for backward (`saved`, the output
    excluded), its forward peak above its input and weights, and its backward peak above the level at entry."""
    import torch.distributed as dist

    from hybrid_cp.integrations.transformers import apply_context_parallel
    from hybrid_cp.testing.families import build

    cp = mesh(u, r)
    model = build(config(kind, **overrides)).to(DTYPES[dtype])
    apply_context_parallel(model, cp)
    layer = model.model.layers[0]
    mixer = getattr(layer, "linear_attn", None) or layer.mamba
    g = torch.Generator().manual_seed(cp.rank)
    x = torch.randn(1, seq_len // cp.size, model.config.hidden_size, generator=g).to(DTYPES[dtype]).requires_grad_()
    dout = torch.randn(x.shape, generator=g).to(x.dtype)
    t = StorageTracker()
    with t:
        t.track(x, dout, list(mixer.parameters()))
        start = t.live
        out = mixer(hidden_states=x)
        saved = t.live - start - out.untyped_storage().nbytes()
        fwd = t.peak - start
        t.reset_peak()
        entry = t.live
        out.backward(dout)
        bwd = t.peak - entry
    dist.barrier()
    return {"rank": dist.get_rank(), "saved": saved, "fwd": fwd, "bwd": bwd}


def mixers_table(kinds, dtypes, tokens: int = 1024) -> int:
    """`mixer_memory` on one process (a one-rank gloo group: zigzag still splits the row into two runs, the
    second probed) beside `topology.step_model`'s count of the same mixer's saved tensors."""
    import torch.distributed as dist

    from hybrid_cp.integrations.config_shape import model_shape
    from hybrid_cp.testing import local_rendezvous
    from topology.layouts import make_layout
    from topology.linear_cost import linear_mixer_saved

    init, _ = local_rendezvous()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    print(f"### One linear mixer alone, {tokens} tokens (two runs, the second probed), saved tensors (MiB)\n")
    print("| layers | dtype | measured | estimate | error |\n|---|---|---|---|---|")
    for kind in kinds:
        m = model_shape(config(kind))
        for dtype in dtypes:
            e = DTYPES[dtype].itemsize
            got = mixer_memory(kind, 1, 1, tokens, dtype)["saved"]
            runs = [(n, pos > 0) for _, pos, n in make_layout("zigzag", 1, 1, seq_len=tokens).token_runs(0)]
            est = linear_mixer_saved(m, runs, e)
            print(f"| {kind} | {dtype} | {mib(got)} | {mib(est)} | {est / got - 1:+.1%} |", flush=True)
    dist.destroy_process_group()
    return 0


def estimate(kind: str, u: int, r: int, seq_len: int, checkpoint: bool, dtype: str, **overrides: Any):
    """The planner's step memory of the same model, mesh and options."""
    from hybrid_cp.integrations.config_shape import model_shape
    from topology.step_model import MemoryOptions, step_memory

    opts = MemoryOptions(checkpoint=checkpoint, fsdp=False, foreach_optimizer=False)
    return step_memory(model_shape(config(kind, **overrides)), seq_len, u, r, 8 // (u * r), 1, opts, dtype=dtype)


def rows(pool, kinds, meshes, seq_len: int, dtypes, raw: dict, stored: dict | None = None):
    """One table row per (kind, mesh, checkpointing, dtype): measured worst rank beside the estimate (`stored`:
    the measurements of an earlier `--json`, estimated again)."""
    for kind in kinds:
        for u, r in meshes:
            for dtype in dtypes:
                for ckpt in (False, True):
                    key = f"{kind}/u{u}r{r}/{dtype}/{'ckpt' if ckpt else 'plain'}"
                    if stored is not None:
                        worst = stored[key]["measured"]
                    else:
                        res = pool.run(
                            measure, kind=kind, u=u, r=r, seq_len=seq_len, checkpoint=ckpt, dtype=dtype, timeout=3600
                        )
                        worst = max(res, key=lambda x: x["peak"])
                    est = estimate(kind, u, r, seq_len, ckpt, dtype)
                    raw[key] = {"measured": worst, "estimate": est.to_dict()}
                    st = worst["stages"]
                    mixer = "linear_attn" if kind == "gated_delta" else "mamba"

                    def tr(key):
                        return mib(st.get(key, {}).get("transient", 0))

                    act_m = worst["peak"] - worst["base"]
                    act_e = est.peak - est.persistent["params"] - est.persistent["adam"]
                    yield [
                        kind,
                        f"u{u} r{r}",
                        dtype,
                        "yes" if ckpt else "no",
                        mib(worst["peak"]),
                        mib(est.peak),
                        f"{est.peak / worst['peak'] - 1:+.1%}",
                        mib(act_m),
                        mib(act_e),
                        f"{act_e / act_m - 1:+.1%}",
                        est.peak_phase,
                        f"{tr(mixer)} / {tr(mixer + '.bwd')}",
                    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--meshes", nargs="+", default=["2,2", "1,4", "4,1"], help="u,r pairs (u r divides 8)")
    p.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--json", help="write the raw measurements here")
    p.add_argument("--from-json", help="estimate again the measurements stored by an earlier --json (no pool)")
    p.add_argument("--mixers", action="store_true", help="layer 0's mixer alone, one process, beside the estimate")
    args = p.parse_args(argv)
    from hybrid_cp.testing import WorkerPool

    if args.mixers:
        return mixers_table(args.kinds, args.dtypes)

    meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes]
    raw: dict = {}
    print(
        f"### One training step of a tiny hybrid, {args.seq_len} tokens, 8 gloo ranks (dp = 8 / (u r)), "
        "replicated weights, AdamW (exact live storage, MiB per rank, worst rank)\n"
    )
    header = [
        "layers",
        "mesh",
        "dtype",
        "checkpointing",
        "measured peak",
        "estimate",
        "error",
        "measured above weights + Adam",
        "estimate above weights + Adam",
        "error",
        "estimated peak at",
        "linear mixer fwd / bwd (measured)",
    ]
    if args.from_json:
        with open(args.from_json) as f:
            stored = json.load(f)
        for line in table_lines(
            header, rows(None, args.kinds, meshes, args.seq_len, args.dtypes, raw, stored), markdown=True
        ):
            print(line, flush=True)
    else:
        with WorkerPool(8, extra_paths=[HERE]) as pool:
            for line in table_lines(
                header, rows(pool, args.kinds, meshes, args.seq_len, args.dtypes, raw), markdown=True
            ):
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
