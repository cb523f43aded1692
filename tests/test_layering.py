"""The one-way flow of docs/design.md §3: a module imports only from its own or lower layers."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "bhqk"

# layer of each top-level part of the package (lower numbers are lower layers)
LAYERS = {
    "errors": 0, "dims": 0, "text": 0, "observe": 0, "explain": 0,
    "shapes": 1, "masks": 1, "bias": 1,
    "functional": 2,
    "nn": 3,
    "models": 4, "distributed": 4, "integrations": 4,
    "inspect": 5, "viz": 5,
    "demo": 6, "cli": 6, "__init__": 7, "__main__": 7,
}


def _part(path: Path, root: Path = SRC) -> str:
    rel = path.relative_to(root).parts
    return rel[0].removesuffix(".py")


def _imported_parts(path: Path, root: Path = SRC) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(root).parts[:-1]  # package of this module inside bhqk
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(pkg[: len(pkg) - (node.level - 1)]) if node.level > 1 else list(pkg)
                target = base + (node.module.split(".") if node.module else [])
                if target:
                    found.add(target[0])
                else:
                    found.update(a.name for a in node.names)
            elif node.module and node.module.startswith("bhqk."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("bhqk."):
                    found.add(a.name.split(".")[1])
    return found


def test_every_part_has_a_layer():
    parts = {_part(p) for p in SRC.rglob("*.py")}
    assert parts <= set(LAYERS), parts - set(LAYERS)


def _violations(root: Path = SRC) -> list[str]:
    bad = []
    for path in root.rglob("*.py"):
        me = _part(path, root)
        for other in _imported_parts(path, root):
            if other in LAYERS and LAYERS[other] > LAYERS[me]:
                bad.append(f"{path.relative_to(root)} ({me}, layer {LAYERS[me]}) imports {other} (layer {LAYERS[other]})")
    return bad


def test_imports_flow_one_way():
    bad = _violations()
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path):
    # a package tree with upward imports, relative and absolute, and one allowed downward import
    (tmp_path / "masks").mkdir()
    (tmp_path / "masks" / "bad.py").write_text("from ..nn import MultiHeadAttention\nfrom ..errors import MaskError\n")
    (tmp_path / "shapes.py").write_text("import bhqk.functional.api\n")
    bad = sorted(_violations(tmp_path))
    assert len(bad) == 2, bad
    assert "imports nn" in bad[0] and "masks/bad.py" in bad[0]
    assert "imports functional" in bad[1] and "shapes.py" in bad[1]
