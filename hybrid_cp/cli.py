"""The `hybrid-cp` command: demo, attention-demo, plan, calibrate, bench."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("hybrid_cp.train_demo", "the README's main job: train a small Llama with CP on 8 CPU processes vs 1"),
    "attention-demo": ("hybrid_cp.demo", "exact hybrid attention on local CPU processes vs one device"),
    "plan": ("topology.cli", "rank (ulysses, ring) splits for a cluster and model with the cost model"),
    "calibrate": ("hybrid_cp.bench_cli:calibrate_main", "measure this machine's rates and write a cluster file for plan"),
    "bench": ("hybrid_cp.bench_cli:bench_main", "time one attention fwd+bwd per rank next to the plan's prediction"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        print("usage: hybrid-cp COMMAND [options]   (hybrid-cp COMMAND --help for its options)\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:{width}}  {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    import importlib

    module, _, func = COMMANDS[argv[0]][0].partition(":")
    return getattr(importlib.import_module(module), func or "main")(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
