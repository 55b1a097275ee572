"""The `hybrid-cp` command: demo, attention-demo, plan."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("hybrid_cp.train_demo", "the README's main job: train a small Llama with CP on 8 CPU processes vs 1"),
    "attention-demo": ("hybrid_cp.demo", "exact hybrid attention on local CPU processes vs one device"),
    "plan": ("topology.cli", "rank (ulysses, ring) splits for a cluster and model with the cost model"),
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

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
