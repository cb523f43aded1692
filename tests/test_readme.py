"""Every Python block of the README runs on its own, and prints what the README says it prints.

A ```python block followed directly by a ```text block is checked against it line by line
(trailing spaces ignored). Blocks fenced as ```py are shown, not run (they need several processes,
or a pretrained model and minutes); one that begins with its imports stands alone, so every name it
reads is defined in it, above the line that reads it.
"""

from __future__ import annotations

import ast
import builtins
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


def _shown() -> list[tuple[int, str]]:
    """(line number, code) for each ```py block (shown, not run) that begins with an import: a whole program."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1) == "py" and m.group(2).lstrip().startswith(("import ", "from "))]


def _undefined(code: str) -> list[str]:
    """The names ``code`` reads that it neither imports, assigns nor defines on an earlier line (or the same)."""
    tree = ast.parse(code)
    bound: dict[str, int] = {}
    reads: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                reads.append((node.id, node.lineno))
            else:
                bound[node.id] = min(bound.get(node.id, node.lineno), node.lineno)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                name = (a.asname or a.name).split(".")[0]
                bound[name] = min(bound.get(name, node.lineno), node.lineno)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound[node.name] = min(bound.get(node.name, node.lineno), node.lineno)
        elif isinstance(node, ast.arg):
            bound[node.arg] = min(bound.get(node.arg, node.lineno), node.lineno)
    return sorted({f"{name} (line {line})" for name, line in reads
                   if not hasattr(builtins, name) and not (name in bound and bound[name] <= line)})


def test_shown_blocks_have_blocks_to_check():
    assert len(_shown()) >= 2  # the budget's find and the distributed ring


@pytest.mark.parametrize("line, code", _shown(), ids=lambda x: f"line{x}" if isinstance(x, int) else "")
def test_a_shown_block_that_begins_with_its_imports_defines_every_name_it_reads(line, code):
    """A reader copies such a block whole: ``find``'s once used ``ids`` it never defined (issue 40, item 9)."""
    missing = _undefined(code)
    assert not missing, f"README.md line {line}: a ```py block reads names it never defines: {', '.join(missing)}"
