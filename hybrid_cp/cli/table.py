"""The one table formatter of the `hybrid-cp` commands and the benchmarks.

Cells are formatted with a per-column format spec (``",", ".3e"``...); the aligned text form pads
every column to its widest cell (the first column left-aligned, the rest right-aligned, as numbers
read best); the Markdown form needs no widths, so its lines are produced as the rows arrive and a
benchmark can print each row the moment it is measured.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

__all__ = ["format_table", "table_lines"]


def _cells(row: Sequence[Any], formats: Sequence[str] | None) -> list[str]:
    specs = list(formats or []) + [""] * (len(row) - len(formats or []))
    return [cell if isinstance(cell, str) else format(cell, spec) for cell, spec in zip(row, specs)]


def table_lines(
    header: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    formats: Sequence[str] | None = None,
    markdown: bool = False,
    align: str | None = None,
    gap: int = 2,
    indent: str = "",
) -> Iterator[str]:
    """The lines of a table: ``header`` then one line per row (a string cell is printed as it is,
    any other cell through ``format(cell, formats[i])``).

    ``markdown`` gives ``| a | b |`` lines under a ``|---|`` rule, yielded as ``rows`` yields; else
    the columns are padded to their widest cell, ``gap`` spaces apart, aligned by ``align`` (one
    ``<`` or ``>`` per column; default: first column left, the others right)."""
    if markdown:
        yield "| " + " | ".join(header) + " |"
        yield "|" + "---|" * len(header)
        for row in rows:
            yield "| " + " | ".join(_cells(row, formats)) + " |"
        return
    body = [_cells(row, formats) for row in rows]
    widths = [max(len(line[i]) for line in [list(header), *body]) for i in range(len(header))]
    sides = align or "<" + ">" * (len(header) - 1)
    for line in [list(header), *body]:
        padded = [f"{cell:{side}{width}}" for cell, side, width in zip(line, sides, widths)]
        yield (indent + (" " * gap).join(padded)).rstrip()


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]], **options: Any) -> str:
    """:func:`table_lines` joined into one string (the options are the same)."""
    return "\n".join(table_lines(header, rows, **options))
