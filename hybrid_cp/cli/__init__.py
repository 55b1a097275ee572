"""The `hybrid-cp` command: one subcommand per module of this package, named like the command.

    hybrid-cp demo            train a small Llama with CP on local CPU processes and on one (demo.py)
    hybrid-cp attention-demo  exact hybrid attention on local CPU processes vs one device (attention_demo.py)
    hybrid-cp plan            rank (ulysses, ring, dp) splits with the cost model (plan.py)
    hybrid-cp calibrate       measure this machine and write a cluster file (calibrate.py)
    hybrid-cp bench           time one attention call next to the plan's prediction (bench.py)

Each command module has `COMMAND` (its flags and its run function) and `main(argv)` to run it alone.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import attention_demo, bench, calibrate, demo, plan
from .command import Command, add_to

__all__ = ["COMMANDS", "main", "parser"]

COMMANDS: tuple[Command, ...] = (demo.COMMAND, attention_demo.COMMAND, plan.COMMAND, calibrate.COMMAND, bench.COMMAND)


def parser() -> argparse.ArgumentParser:
    """The `hybrid-cp` parser, every command a subcommand with its own flags."""
    top = argparse.ArgumentParser(
        prog="hybrid-cp",
        description="Context-parallel attention for PyTorch: demos, the planner and this machine's measurements.",
        epilog="hybrid-cp COMMAND --help shows a command's options.",
    )
    commands = top.add_subparsers(title="commands", metavar="COMMAND")
    for command in COMMANDS:
        add_to(commands, command)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hybrid-cp`; the process exit status (the help when no command is given)."""
    top = parser()
    args = top.parse_args(list(sys.argv[1:] if argv is None else argv))
    if getattr(args, "command", None) is None:
        top.print_help()
        return 0
    return args.command.invoke(args)
