"""Rows of text cells as an aligned table, the form `dapo-train eval` and `dapo-train compare` print."""

from __future__ import annotations

from collections.abc import Sequence


def aligned_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """-> the header line, a rule of dashes, one line per row. Each column is as wide as its widest
    cell and two spaces from the next; the first `left` columns (names) are flush left, the others
    (numbers) flush right, so digits line up."""
    widths = [max(len(cells[i]) for cells in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths))
        return "  ".join(cell.ljust(width) if i < left else cell.rjust(width) for i, (cell, width) in pairs)

    return [line(headers), line(["-" * width for width in widths]), *(line(cells) for cells in rows)]
