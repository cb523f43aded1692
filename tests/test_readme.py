"""Every Python block of the README runs on its own, and prints what the README says it prints.

A ```python block followed directly by a ```text block is checked against it line by line
(trailing spaces ignored). Blocks fenced as ```py are shown, not run (they need several processes).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"```(\w*)\n(.*?)```", flags=re.S)


def _examples() -> list[tuple[int, str, str | None]]:
    """(line number, python code, expected output or None) for each ```python block."""
    text = README.read_text()
    found = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(found):
        if m.group(1) != "python":
            continue
        nxt = found[i + 1] if i + 1 < len(found) else None
        between = text[m.end(): nxt.start()] if nxt else ""
        expected = nxt.group(2) if nxt and nxt.group(1) == "text" and not between.strip() else None
        out.append((text.count("\n", 0, m.start()) + 1, m.group(2), expected))
    return out


def test_readme_has_examples_with_outputs():
    examples = _examples()
    assert len(examples) >= 8
    assert sum(e is not None for _, _, e in examples) >= 6


@pytest.mark.parametrize("line, code, expected", _examples(), ids=lambda x: f"line{x}" if isinstance(x, int) else "")
def test_readme_block_runs_alone_and_prints_what_it_says(line, code, expected):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})  # noqa: S102 - the README's own code
    if expected is not None:
        got = [s.rstrip() for s in buf.getvalue().rstrip("\n").splitlines()]
        want = [s.rstrip() for s in expected.rstrip("\n").splitlines()]
        assert got == want, f"README.md line {line} printed:\n" + "\n".join(got)
