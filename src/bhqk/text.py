"""Text rendering shared by errors, masks, explain and trace: tables and ■/· grids. No torch math."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def named_shape(names: Sequence[str], sizes: Sequence[int]) -> str:
    """``[B=2, H=8, Q=5, d=8]``."""
    return "[" + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)) + "]"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain Markdown table with padded columns."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line([str(h) for h in header]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def grid(cells: Sequence[Sequence[bool]], on: str = "■", off: str = "·") -> str:
    """Rows of a boolean table as text: one row per query, one column per key."""
    return "\n".join(" ".join(on if c else off for c in row) for row in cells)


def number_grid(values: Sequence[Sequence[float]], fmt: str = "{:8.4f}") -> str:
    """Rows of numbers, right-aligned."""
    return "\n".join(" ".join(fmt.format(x) for x in row) for row in values)
