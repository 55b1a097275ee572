"""Time of hybrid models' linear layers under context parallelism vs one rank's local shard computation.

    python benchmarks/linear_layers.py                          # 2 ranks, 4096 tokens, 7 repeats, every case
    python benchmarks/linear_layers.py --cases op:gdn op:mamba2 --tokens 8192
    python benchmarks/linear_layers.py --cases layer:gdn layer:mamba2 --repeat 9
    python benchmarks/linear_layers.py --flush-denormal             # subnormal floats flushed to zero

docs/linear.md's time table is `--tokens 4096 --repeat 7` with and without `--flush-denormal` (the
default cases; 7 to 8.5 minutes each on the 2-core machine at load average 13 and 21).

Each of `ranks` gloo processes (a ring of `ranks`, ulysses 1, one torch thread each) times, side by side
in one run and in alternation, for zigzag and contiguous rows:

- *local*: what its own shard costs without context parallelism (wrong across shards, but the floor):
  the operator or the whole block run on the shard as if it were the whole sequence;
- *cp*: the same computation made context parallel (`recurrence.causal_conv` + `recurrence.linear_scan`,
  the summary all-gather, the scan and the correction; the block through `route_linear_layers`);
- *exchange*: the layer's all-gathers alone (`comm.gather_summaries` of the same slots and sizes,
  summaries and conv halo, forward and backward),

all forward + backward. Cases: `probe:gdn` (no context parallelism: the chunked kernel on the shard at
width dv vs `GatedDelta.probe` at dv + dk, the "local" and "cp" columns; what a continuing run pays),
`op:gdn` (causal conv over q|k|v, silu, transformers' torch chunked gated delta rule, dk = dv = 128,
8 heads), `op:mamba2` (causal conv over x|B|C, silu, transformers' torch SSD
`mamba2_chunk_scan`, head dim 64, state 256, chunk 256: no probe, a scalar decay per head),
`layer:gdn` (transformers' `Qwen3NextGatedDeltaNet` with its projections, gate, gated norm and out_proj,
Qwen3-Next-80B-A3B's dk = dv = 128 and 2:1 value:key heads, heads and hidden divided by 4: hidden 512,
4 key / 8 value heads), `layer:mamba2` (transformers' `BambaMixer`, Bamba-9B's head dim 64, state 256,
chunk 256, expand 2, heads and hidden divided by 8: hidden 512, 16 heads). Prints a markdown table:
per case and layout the slowest rank's median local time, and min / median over repeats of
cp / local and cp / (local + exchange) (the slowest rank each, per repeat), by wall time and by each
process's CPU time (`time.process_time`: on a machine shared with other work it leaves out the time
the core was taken away). CPU only (there is no GPU here); the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("probe:gdn", "op:gdn", "op:mamba2", "layer:gdn", "layer:mamba2")
LAYOUTS = ("zigzag", "contiguous")
CONV = 4  # the blocks' causal conv kernel (Qwen3-Next, Bamba)


def _time(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): the second does not count time other work on the
    machine took the core away (it does count the exchange's copies, not waiting for the other rank)."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _local_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv of the shard alone (zeros before it), x [B, n, C], weight [C, K]."""
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[-1])
    return out[..., : x.shape[1]].transpose(1, 2)


def _backward(out: torch.Tensor) -> None:
    out.float().square().mean().backward()


def _exchange(cp, lay, state_numel: int, channels: int):
    """The layer's all-gathers alone: the summaries (fp32) and the conv halo of every exporting run."""
    from hybrid_cp.engine.comm import gather_summaries
    from hybrid_cp.engine.recurrence import scan_plan

    slots = scan_plan(lay, cp.size).slots
    state = torch.zeros(slots, state_numel, requires_grad=True)
    halo = torch.zeros(slots, 1, CONV - 1, channels, requires_grad=True)

    def run():
        if slots:
            _backward(gather_summaries(cp, state, "bench_state").sum() + gather_summaries(cp, halo, "bench_halo").sum())

    return run


def _op_gdn(cp, lay, tokens: int, heads: int = 8, dim: int = 128):
    """(local, cp, exchange) closures of the Gated DeltaNet operator: conv -> silu -> chunked delta rule."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from hybrid_cp.engine.layout import shard_tokens
    from hybrid_cp.engine.recurrence import GatedDelta, causal_conv, linear_scan

    kernel = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    gen = torch.Generator().manual_seed(0)
    width = 3 * heads * dim
    x = torch.randn(1, tokens, width, generator=gen)
    a = torch.randn(1, tokens, heads, generator=gen)
    b = torch.randn(1, tokens, heads, generator=gen)
    weight = (torch.randn(width, CONV, generator=gen) * 0.5).requires_grad_()
    xs = [shard_tokens(t, cp, 1, lay).requires_grad_() for t in (x, a, b)]
    kind = GatedDelta(kernel)

    def core(conv):
        mixed = F.silu(conv(xs[0], weight))
        q, k, v = (t.unflatten(-1, (heads, dim)) for t in mixed.split(heads * dim, dim=-1))
        return q, k, v, -F.softplus(xs[1]) * 0.1, xs[2].sigmoid()

    def local():
        q, k, v, g, beta = core(lambda t, w: _local_conv(t, w, None))
        _backward(kernel(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0])

    def scan():
        _backward(linear_scan(cp, lay, kind, core(lambda t, w: causal_conv(cp, lay, t, w))))

    return local, scan, _exchange(cp, lay, heads * dim * 2 * dim, width)


def _probe_gdn(cp, lay, tokens: int, heads: int = 8, dim: int = 128):
    """(plain, probe, nothing) closures: the chunked kernel on the shard at width dv from zero vs the probe
    (`GatedDelta.probe`: width dv + dk from [0 | I]), forward + backward, no context parallelism."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from hybrid_cp.engine.layout import shard_tokens
    from hybrid_cp.engine.recurrence import GatedDelta

    kind = GatedDelta(getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule))
    gen = torch.Generator().manual_seed(0)
    shapes = [(heads, dim)] * 3 + [(heads,), (heads,)]
    xs = [shard_tokens(torch.randn(1, tokens, *s, generator=gen), cp, 1, lay).requires_grad_() for s in shapes]

    def inputs():
        return xs[:3] + [-F.softplus(xs[3]) * 0.1, xs[4].sigmoid()]

    def plain():
        out, final = kind.plain(inputs(), final=True)
        _backward(out + final.sum() * 0)

    def probe():
        out, final, trans, aux = kind.probe(inputs())
        _backward(out + aux.sum() * 0 + final.sum() * 0 + trans.sum() * 0)

    return plain, probe, lambda: None


def _op_mamba2(cp, lay, tokens: int, heads: int = 16, head_dim: int = 64, state: int = 256, chunk: int = 256):
    """(local, cp, exchange) closures of the Mamba2 operator: conv over x|B|C -> silu -> SSD (one group)."""
    from transformers.models.bamba import modeling_bamba

    from hybrid_cp.engine.layout import shard_tokens
    from hybrid_cp.engine.recurrence import Mamba2, causal_conv, linear_scan

    kernel = getattr(modeling_bamba.mamba2_chunk_scan, "__wrapped__", modeling_bamba.mamba2_chunk_scan)
    gen = torch.Generator().manual_seed(0)
    width = heads * head_dim + 2 * state
    xs = [
        shard_tokens(t, cp, 1, lay).requires_grad_()
        for t in (torch.randn(1, tokens, width, generator=gen), torch.randn(1, tokens, heads, generator=gen))
    ]
    weight = (torch.randn(width, CONV, generator=gen) * 0.5).requires_grad_()
    params = [
        (-torch.rand(heads, generator=gen) - 0.2).requires_grad_(),
        torch.randn(heads).requires_grad_(),
        torch.randn(heads).requires_grad_(),
    ]  # A < 0, D, dt_bias
    kind = Mamba2(kernel, params[0], chunk, params[1], params[2])

    def core(conv):
        h = F.silu(conv(xs[0], weight))
        x, b, c = h.split([heads * head_dim, state, state], dim=-1)
        n = x.shape[1]
        return x.reshape(1, n, heads, head_dim), xs[1], b.reshape(1, n, 1, state), c.reshape(1, n, 1, state)

    def local():
        x, dt, b, c = core(lambda t, w: _local_conv(t, w, None))
        _backward(kind.plain((x, dt, b, c), final=False)[0])

    def scan():
        _backward(linear_scan(cp, lay, kind, core(lambda t, w: causal_conv(cp, lay, t, w))))

    return local, scan, _exchange(cp, lay, heads * (1 + head_dim * state), width)


def _block(case: str):
    """The transformers block of `case`, its hidden size, summary numel and conv channels."""
    if case == "layer:gdn":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        cfg = Qwen3NextConfig(
            hidden_size=512,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=CONV,
            num_hidden_layers=1,
            layer_types=["linear_attention"],
        )
        block = Qwen3NextGatedDeltaNet(cfg, 0)
        return block, 512, 8 * 128 * 256, block.conv_dim
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

    cfg = BambaConfig(
        hidden_size=512,
        mamba_n_heads=16,
        mamba_d_head=64,
        mamba_d_state=256,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_d_conv=CONV,
        num_hidden_layers=1,
    )
    block = BambaMixer(cfg, 0)
    return block, 512, 16 * (1 + 64 * 256), block.conv_dim


def _layer(cp, lay, tokens: int, case: str):
    """(local, cp, exchange) closures of a whole block: the model's module on the shard alone vs routed."""
    import hybrid_cp as hcp
    from hybrid_cp.integrations.linear_layers import route_linear_layers

    torch.manual_seed(0)
    block, hidden, numel, channels = _block(case)
    routed = copy.deepcopy(block)
    assert route_linear_layers(routed, cp) == 1
    h = hcp.shard(torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(1)), cp).requires_grad_()

    def local():
        _backward(block(h))

    def scan():
        _backward(routed(h))

    return local, scan, _exchange(cp, lay, numel, channels)


def rank_times(tokens: int, repeat: int, cases: list[str], flush_denormal: bool = False) -> dict:
    """On every rank: {(case, layout): [((wall, cpu) of local, of cp, of exchange) per repeat]}. Every repeat runs every
    (case, layout) once, local and cp back to back (their order alternates between repeats), so a
    change in the machine's load falls on both; the first repeat is a warm-up and dropped."""
    import hybrid_cp as hcp
    from topology.layouts import layout_of

    torch.set_flush_denormal(flush_denormal)  # for local and cp alike (docs/linear.md: the probe's subnormals)
    world, fns = dist.get_world_size(), {}
    meshes = [hcp.init_cp_mesh(1, world, layout=layout) for layout in LAYOUTS]
    for cp, layout in zip(meshes, LAYOUTS):
        lay = layout_of(layout, 1, world, seq_len=tokens)
        for case in cases:
            if case.startswith("layer:"):
                fns[(case, layout)] = _layer(cp, lay, tokens, case)
            else:
                build = {"probe:gdn": _probe_gdn, "op:gdn": _op_gdn, "op:mamba2": _op_mamba2}[case]
                fns[(case, layout)] = build(cp, lay, tokens)
    out = {key: [] for key in fns}
    for i in range(repeat + 1):
        for key, (local, scan, exchange) in fns.items():
            a, b = (_time(local), _time(scan)) if i % 2 else (_time(scan), _time(local))[::-1]
            out[key].append((a, b, _time(exchange)))
    for cp in meshes:
        hcp.destroy_cp_mesh(cp)
    return {key: rows[1:] for key, rows in out.items()}


def table(per_rank: list[dict], cases: list[str], ranks: int, tokens: int) -> str:
    """The markdown table of the slowest rank's ratios per repeat, min / median over repeats, by wall
    time and by CPU time (each rank's own, the slowest rank's per repeat)."""
    lines = [
        f"| case | layout | local shard ({tokens // ranks} tokens), wall median | cp / local, wall min | "
        f"median | cp / (local + exchange), wall min | median | cp / (local + exchange), CPU min | median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for layout in LAYOUTS:
            reps = per_rank[0][(case, layout)]
            cells = []
            for clock in (0, 1):
                worst = [
                    [max(r[(case, layout)][i][j][clock] for r in per_rank) for j in range(3)] for i in range(len(reps))
                ]
                cells.append(
                    (
                        [c / a for a, c, _ in worst],
                        [c / (a + e) for a, c, e in worst],
                        statistics.median(a for a, _, _ in worst),
                    )
                )
            (plain, full, local), (_, cpu, _) = cells
            lines.append(
                f"| {case} | {layout} | {local * 1e3:.0f} ms | {min(plain):.2f} | "
                f"{statistics.median(plain):.2f} | {min(full):.2f} | {statistics.median(full):.2f} | "
                f"{min(cpu):.2f} | {statistics.median(cpu):.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument(
        "--flush-denormal",
        action="store_true",
        help="torch.set_flush_denormal(True) on every rank, for local and cp alike: x86 CPUs take "
        "microcode traps on subnormal floats, which the probe's decaying transition makes",
    )
    args = parser.parse_args()
    from hybrid_cp.testing import WorkerPool

    before = os.getloadavg()
    with WorkerPool(args.ranks, threads=1, extra_paths=[os.path.dirname(os.path.abspath(__file__))]) as pool:
        rows = pool.run(
            rank_times,
            timeout=3600,
            tokens=args.tokens,
            repeat=args.repeat,
            cases=args.cases,
            flush_denormal=args.flush_denormal,
        )
    after = os.getloadavg()
    print(
        f"ranks={args.ranks} tokens={args.tokens} repeat={args.repeat}, 1 thread per rank, "
        f"flush denormals {'on' if args.flush_denormal else 'off'}, "
        f"load average (1 min) {before[0]:.1f} before, {after[0]:.1f} after, {os.cpu_count()} cores"
    )
    print(table(rows, args.cases, args.ranks, args.tokens))


if __name__ == "__main__":
    main()
