"""``hybrid-cp plan``: rank the (ulysses, ring, dp) splits for a cluster, a model and a sequence length.

hybrid-cp plan --preset dgx-h100 --nodes 4 --heads 32 --kv-heads 8 --head-dim 128 --seq-len 1M
hybrid-cp plan --cluster my_cluster.yaml --model llama3-8b --seq-len 512K --json
hybrid-cp plan --discover --model llama3-8b --seq-len 128K --plot splits.png
hybrid-cp plan --preset dgx-h100 --model llama3-8b --lengths lognormal:median=2K,sigma=1.5,total=512K
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticUndefined

from topology.cluster import Cluster, ClusterError
from topology.discovery import discover
from topology.memory import max_seq_table, memory_ladder
from topology.model_shape import MODEL_PRESETS, ModelShape
from topology.planner import PlanError, PlanList, plan
from topology.step_model import attention_forwards
from topology.units import GiB

from .command import Command, UsageError, fail
from .plan_lengths import lengths_main

__all__ = ["COMMAND", "main", "parse_count", "parse_bytes", "plot_plans"]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_int(text: str) -> int:
    """``"1M"`` -> 1048576, ``"64K"`` -> 65536, ``"4096"`` -> 4096, ``"0"`` -> 0 (binary suffixes, as for tokens)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KkMmGg]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: use an integer with optional K/M/G (e.g. 128K)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def parse_count(text: str) -> int:
    """A count >= 1 (`parse_int`)."""
    value = parse_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def parse_bytes(text: str) -> float:
    """``"70G"``/``"70GB"`` -> 70e9 bytes, ``"64GiB"`` -> 64 * 2**30; plain numbers are bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 70G, 64GiB or 7e10")
    exp = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return float(m.group(1)) * ((1024 if m.group(3) else 1000) ** exp)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("cluster (one of)")
    src.add_argument("--preset", help=f"named cluster: {', '.join(Cluster.preset_names())}")
    src.add_argument("--cluster", metavar="FILE", help="cluster YAML/JSON written by Cluster.save")
    src.add_argument("--discover", action="store_true", help="describe the cluster this job runs on")
    p.add_argument("--nodes", type=int, default=1, help="nodes for --preset (default 1)")
    m = p.add_argument_group("model (each flag is the ModelShape field of the same name)")
    m.add_argument("--model", choices=sorted(MODEL_PRESETS), help="known shape; the flags below override it")
    add_shape_arguments(m, [n for n in MODEL_FLAGS if n not in LINEAR_FLAGS])
    add_linear_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument(
        "--seq-len", type=parse_count, help="tokens per sequence, e.g. 131072, 128K, 1M (not with --max-seq)"
    )
    w.add_argument(
        "--lengths",
        metavar="FILE|lognormal:...",
        help="one global batch's document lengths (a file, or lognormal:median=2K,sigma=1.5,total=512K): "
        "print the dynamic-degree schedule next to the fixed splits",
    )
    w.add_argument(
        "--tokens-per-rank",
        type=parse_count,
        default=8192,
        help="with --lengths: tokens one rank holds per micro-batch (default 8K)",
    )
    w.add_argument("--batch", type=parse_count, default=1, help="sequences per CP group (default 1)")
    w.add_argument("--world-size", type=int, help="GPUs to use (default: all)")
    w.add_argument("--dp", type=int, help="fix the data-parallel degree (1 = one CP group over all GPUs)")
    w.add_argument(
        "--memory-budget",
        type=parse_bytes,
        help="bytes per GPU, e.g. 70G, used as given (default 90%% of device memory)",
    )
    w.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    w.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    w.add_argument("--no-causal", dest="causal", action="store_false", help="full (bidirectional) attention")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=0, help="show only the N best plans")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--plot", metavar="FILE", help="stacked bar chart of the time components (needs matplotlib)")
    add_max_seq_arguments(p)


def _cluster(args: argparse.Namespace) -> Cluster:
    chosen = [x for x in (args.preset, args.cluster, args.discover or None) if x]
    if len(chosen) != 1:
        raise ClusterError("give exactly one of --preset NAME, --cluster FILE or --discover")
    if args.preset:
        return Cluster.preset(args.preset, nodes=args.nodes)
    if args.cluster:
        return Cluster.load(args.cluster)
    return discover()


# the model flags: one per ModelShape field (the name is --model's), the linear layers' apart
MODEL_FLAGS = tuple(n for n in ModelShape.model_fields if n != "name")
LINEAR_FLAGS = tuple(n for n in MODEL_FLAGS if n.startswith("linear_"))


def add_shape_arguments(group: Any, names: list[str]) -> None:
    """One flag per ModelShape field: its description as help, its type from the annotation (integers take
    K/M/G suffixes; the model shape checks each field's bound), choices from a Literal."""
    for name in names:
        info = ModelShape.model_fields[name]
        kinds = [a for a in typing.get_args(info.annotation) or (info.annotation,) if a is not type(None)]
        default = "" if info.default in (None, PydanticUndefined) else f" (default {info.default})"
        help_ = (info.description or name.replace("_", " ")) + default
        if kinds == [bool]:
            group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(kinds[0]) is typing.Literal:
            group.add_argument(_flag(name), choices=list(typing.get_args(kinds[0])), help=help_)
        else:
            group.add_argument(_flag(name), type=parse_int if kinds == [int] else kinds[0], help=help_)


def add_linear_arguments(p: argparse.ArgumentParser) -> None:
    """The hybrid model's linear layers (docs/planner.md section 4.2): they override --model's."""
    add_shape_arguments(
        p.add_argument_group("linear layers of a hybrid model (override --model's)"), list(LINEAR_FLAGS)
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _model(args: argparse.Namespace) -> ModelShape:
    base = dict(MODEL_PRESETS[args.model], name=args.model) if args.model else {}
    if getattr(args, "linear_layers", None) == 0:  # --linear-layers 0: the preset without its linear layers
        base = {k: v for k, v in base.items() if k not in LINEAR_FLAGS}
    for key in MODEL_FLAGS:
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    missing = [_flag(k) for k in ("heads", "head_dim") if k not in base]
    if missing:
        raise ValueError(f"model shape needs {' and '.join(missing)} (or --model NAME)")
    try:
        return ModelShape(**base)
    except ValidationError as exc:  # ModelShape's own checks, said in flags
        raise ValueError("model shape: " + "; ".join(_flag_message(e) for e in exc.errors())) from None


def _flag_message(err: Any) -> str:
    """One pydantic error of ModelShape with its field names written as the flags that set them."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err.get("loc"):  # a field's own bound (e.g. >= 1): name the field's flag and its value
        msg = f"{_flag(str(err['loc'][0]))}={err.get('input')!r}: {msg}"
    return re.sub(r"\b([a-z]+(?:_[a-z]+)+)=", lambda m: _flag(m.group(1)) + "=", msg)


def plot_plans(plans: PlanList, path: str) -> None:
    """Write a stacked bar chart (compute / exposed all-to-all / exposed ring) per candidate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'hybrid-cp[plot]' (or pip install matplotlib)"
        ) from exc
    labels = [f"u{p.ulysses} r{p.ring} dp{p.dp}" for p in plans]
    # per-GPU-normalised time (time/dp) so candidates with different dp compare on throughput
    parts = {
        "attention": [p.estimate.attention_s / p.dp * 1e3 for p in plans],
        "ring steps": [p.estimate.ring_overhead_s / p.dp * 1e3 for p in plans],
        "rest of layer": [p.estimate.rest_s / p.dp * 1e3 for p in plans],
        "exposed all-to-all": [p.estimate.a2a_s / p.dp * 1e3 for p in plans],
        "exposed ring": [p.estimate.ring_exposed_s / p.dp * 1e3 for p in plans],
    }
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(plans) + 2), 4.5))
    bottom = [0.0] * len(plans)
    for name, vals in parts.items():
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per layer per sequence (time / dp)")
    ax.set_title("hybrid-cp plan: predicted time per candidate, best first")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``hybrid-cp plan`` on parsed flags; returns the process exit code."""
    if args.seq_len is None and not args.max_seq and not args.lengths:
        raise UsageError(
            "--seq-len is required (or --max-seq to find the longest sequence that fits, or --lengths "
            "for a batch of documents)"
        )
    try:
        cluster = _cluster(args)
        model = _model(args)
        if args.lengths:
            return lengths_main(args, cluster, model, parse_count)
        if args.max_seq:
            return max_seq_main(args, cluster, model)
        host = _check_memory_flags(args, cluster)
        plans = plan(
            cluster, model, args.seq_len, batch=args.batch, world_size=args.world_size,
            memory_budget=args.memory_budget, dp=args.dp, dtype=args.dtype, layout=args.layout, causal=args.causal,
            ladder=memory_ladder(args.head_chunks, args.tiled_mlp, args.loss_chunk, args.prefetch), host_memory=host,
        )  # fmt: skip
        if args.plot:
            plot_plans(plans, args.plot)
    except (ClusterError, PlanError, ValueError, RuntimeError) as exc:
        return fail("plan", str(exc))
    if args.json:
        print(json.dumps(plans.to_dict(), indent=2))
    else:
        print(plans.explain(top=args.top or None))
        print()
        print("chosen: " + plans.best.explain())
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


COMMAND = Command(
    "plan",
    "rank (ulysses, ring) splits for a cluster and model with the cost model",
    "Rank (ulysses, ring, dp) splits by predicted throughput and print the chosen plan.",
    add_arguments,
    run,
)
main = COMMAND.main


def add_max_seq_arguments(parser: Any) -> None:
    """The `--max-seq` flags of `hybrid-cp plan`, and the memory options' ladder both modes use."""
    g = parser.add_argument_group(
        "memory options: the ladder --max-seq prints; with --seq-len each split takes its first rung that fits"
    )
    g.add_argument(
        "--max-seq",
        action="store_true",
        help="print the longest sequence that fits per option set, with its (u, r, head_chunks)",
    )
    g.add_argument(
        "--head-chunks",
        type=int,
        default=8,
        help="largest head_chunks to try (default 8; 1 keeps every rung unchunked)",
    )
    g.add_argument("--tiled-mlp", type=int, default=8192, metavar="TOKENS", help="MLP chunk (default 8192)")
    g.add_argument(
        "--loss-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="loss chunk (default: 256 MiB of fp32 logits, as hcp.tiled_cross_entropy)",
    )
    g.add_argument(
        "--host-memory",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="host RAM per GPU for offloaded checkpoints, e.g. 200G (default: the cluster's "
        "host_memory_gb / GPUs per node; unbounded when the cluster does not say)",
    )
    g.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="offloaded checkpoints without prefetch (one layer input fewer on the device)",
    )


def _pinned(options: Any) -> str:
    """The ladder's pinned column: whether offloaded checkpoints use pinned host buffers."""
    return ("yes" if options.pin_memory else "no") if options.offload_checkpoints else "-"


def _check_memory_flags(args: Any, cluster: Any) -> float | None:
    """The ladder's flags checked; returns the host memory per GPU for offloaded checkpoints (None: unbounded)."""
    host = args.host_memory if args.host_memory is not None else cluster.host_memory_per_gpu
    if args.head_chunks < 1 or args.tiled_mlp < 1 or (args.loss_chunk is not None and args.loss_chunk < 1):
        raise UsageError(
            f"--head-chunks={args.head_chunks}, --tiled-mlp={args.tiled_mlp} and "
            f"--loss-chunk={args.loss_chunk} must be >= 1"
        )
    if host is not None and host <= 0:
        raise UsageError(f"--host-memory={args.host_memory} must be > 0 bytes")
    return host


def max_seq_main(args: Any, cluster: Any, model: ModelShape) -> int:
    """`hybrid-cp plan --max-seq`: print (or --json) the ladder of `topology.memory.max_seq_table`."""
    world = args.world_size or cluster.world_size
    budget = args.memory_budget or cluster.accelerator.memory_budget
    if model.vocab == 0:
        raise UsageError("--max-seq needs the vocabulary size for the loss: use --model NAME (e.g. llama3-8b)")
    host = _check_memory_flags(args, cluster)
    rows = max_seq_table(
        model,
        world,
        budget,
        dtype=args.dtype,
        layout=args.layout,
        dp=args.dp or 1,
        head_chunks=args.head_chunks,
        tiled_mlp=args.tiled_mlp,
        loss_chunk=args.loss_chunk,
        host_memory=host,
        prefetch=args.prefetch,
    )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "options": name,
                        "seq_len": b.seq_len if b else 0,
                        **(
                            {
                                "ulysses": b.ulysses,
                                "ring": b.ring,
                                "dp": b.dp,
                                "head_chunks": b.options.head_chunks,
                                "attention_forwards": attention_forwards(model, b.ulysses, b.options),
                                "memory": b.estimate.to_dict(),
                            }
                            if b
                            else {}
                        ),
                    }
                    for name, b in rows
                ],
                indent=2,
            )
        )
        return 0
    host_text = f"{host / GiB:.1f} GiB/GPU" if host is not None else "unbounded (the cluster does not say)"
    held = f" active, {model.held_params / 1e9:.2f}B held" if model.expert_params else ""
    print(
        f"{cluster.describe()}\nmodel {model.name}: {model.params / 1e9:.2f}B parameters{held}, layers={model.layers} "
        f"hidden={model.d_model} heads={model.heads}/{model.n_kv} vocab={model.vocab}; {args.dtype}, AdamW, "
        f"FSDP2 over {world} GPUs; budget {budget / GiB:.1f} GiB/GPU, host memory {host_text}"
    )
    print(
        f"{'options':<36} {'max seq':>6} {'u':>3} {'r':>3} {'chunks':>6} {'peak GiB':>9} {'host GiB':>9} "
        f"{'pinned':>6} {'attn fwd':>8}  peak at"
    )
    for name, b in rows:
        if b is None:
            print(f"{name:<36} {'none fits':>6}")
            continue
        e = b.estimate
        print(
            f"{name:<36} {b.seq_len / 2**20:>5.2f}M {b.ulysses:>3} {b.ring:>3} {b.options.head_chunks:>6} "
            f"{e.peak / GiB:>9.1f} {e.host / GiB:>9.1f} {_pinned(b.options):>6} "
            f"{attention_forwards(model, b.ulysses, b.options):>8}  {e.peak_phase}"
        )
    return 0
