"""What every `hybrid-cp` command module provides, and how its errors reach the user.

A command is a name, a one-line summary, a function that adds its flags to a parser and a function
that runs it on the parsed flags. `hybrid_cp.cli.main` hangs every command under one argparse parser
as a subcommand (``python -m hybrid_cp.cli COMMAND`` runs it too); :meth:`Command.main` runs one alone
(what the tests call).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hybrid_cp.errors import ConfigError

__all__ = ["Command", "UsageError", "add_to", "fail"]


class UsageError(ConfigError):
    """A combination of flags the command cannot use: reported as argparse reports a bad flag
    (usage line, message, exit status 2)."""


def fail(command: str, message: str) -> int:
    """Print why `hybrid-cp COMMAND` cannot go on, in the form every command uses; the exit status."""
    print(f"hybrid-cp {command}: error: {message}", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class Command:
    """One `hybrid-cp` command: ``add_arguments`` gives a parser its flags, ``run`` does the work and
    returns the exit status."""

    name: str
    summary: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def configure(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Give ``parser`` this command's flags and remember the command on the parsed namespace."""
        self.add_arguments(parser)
        parser.set_defaults(command=self, parser=parser)
        return parser

    def parser(self) -> argparse.ArgumentParser:
        return self.configure(
            argparse.ArgumentParser(
                prog=f"hybrid-cp {self.name}",
                description=self.description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )

    def invoke(self, args: argparse.Namespace) -> int:
        """Run on parsed flags; a :class:`UsageError` becomes argparse's error (SystemExit 2)."""
        try:
            return self.run(args)
        except UsageError as exc:
            args.parser.error(str(exc))  # exits

    def main(self, argv: Sequence[str] | None = None) -> int:
        """This command alone: parse ``argv`` (default: the process's arguments) and run."""
        args = self.parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        return self.invoke(args)


def add_to(subparsers: Any, command: Command) -> None:
    """Hang ``command`` under the `hybrid-cp` parser's subcommands."""
    command.configure(
        subparsers.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
