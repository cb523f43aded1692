"""The README's Python examples run as written (in order, one namespace per section)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(_blocks()) >= 2


def test_readme_python_blocks_run(capsys):
    ns: dict = {}
    for i, block in enumerate(_blocks()):
        if block.lstrip().startswith(">>>"):
            continue
        try:
            exec(compile(block, f"README.md block {i}", "exec"), ns)
        except Exception as e:  # noqa: BLE001 - report which block failed
            raise AssertionError(f"README python block {i} failed: {e!r}\n{block}") from e
