"""The one-way flow of docs/design.md §3: a module imports only from its own or lower layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "bhqk"

# layer of each top-level part of the package (lower numbers are lower layers)
LAYERS = {
    "errors": 0, "dims": 0, "text": 0, "observe": 0, "explain": 0, "shortcuts": 0,
    "shapes": 1, "masks": 1, "bias": 1,
    "functional": 2, "console": 2,  # console: argparse types and progress of every command (reads the backend names)
    "nn": 3,
    "models": 4, "distributed": 4, "integrations": 4,
    "corpus": 4,  # the filler text and the prompts: read by budget (scores' text, learn's prompts) and evaluate
    "inspect": 5, "viz": 5,
    "budget": 6,  # plans from statistics, per-head caches: above inspect and integrations
    "evaluate": 7,  # grading, tasks, the needle grid: above budget (they take a Plan)
    "demo": 8, "cli": 8, "__init__": 9, "__main__": 9,
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


# ---- no two modules import each other (docs/design.md §3): a pair that does is one module in two files

# Pairs allowed to import each other: none (a new entry needs a reason written here).
KNOWN_PAIRS: set[tuple[str, str]] = set()


def _module_imports(path: Path, root: Path = SRC) -> set[str]:
    """The files of the package (paths relative to ``root``) that ``path`` imports, at any depth of
    its code (an import inside a function counts: it is still a dependency)."""
    tree = ast.parse(path.read_text())
    pkg = list(path.relative_to(root).parts[:-1])

    def file_of(parts: list[str]) -> str | None:
        if (root.joinpath(*parts).with_suffix(".py")).is_file():
            return "/".join(parts) + ".py"
        if (root.joinpath(*parts) / "__init__.py").is_file():
            return "/".join(parts + ["__init__.py"])
        return None

    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "bhqk":
                base = []
            else:
                continue
            mod = (node.module or "").split(".") if node.module else []
            mod = mod[1:] if not node.level else mod  # absolute: drop "bhqk"
            targets.append(base + mod)
            targets += [base + mod + [a.name] for a in node.names]  # `from . import x`: x may be a module
        elif isinstance(node, ast.Import):
            targets += [a.name.split(".")[1:] for a in node.names if a.name.startswith("bhqk.")]
        for parts in targets:
            f = file_of(parts) if parts else None
            if f is not None and not f.endswith("__init__.py"):
                found.add(f)
    found.discard(str(path.relative_to(root)))
    return found


def _mutual_imports(root: Path = SRC) -> set[tuple[str, str]]:
    graph = {str(p.relative_to(root)): _module_imports(p, root) for p in root.rglob("*.py")}
    return {(a, b) for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, set())}


def test_no_two_modules_import_each_other():
    pairs = _mutual_imports() - KNOWN_PAIRS
    assert not pairs, "modules importing each other: " + ", ".join(f"{a} <-> {b}" for a, b in sorted(pairs))


def test_the_checker_sees_a_pair_importing_each_other(tmp_path):
    (tmp_path / "masks").mkdir()
    (tmp_path / "masks" / "__init__.py").write_text("")
    (tmp_path / "masks" / "a.py").write_text("from .b import x\n")
    (tmp_path / "masks" / "b.py").write_text("def f():\n    from . import a\n")  # inside a function counts too
    (tmp_path / "masks" / "c.py").write_text("from bhqk.masks.a import y\n")  # one way only: fine
    assert _mutual_imports(tmp_path) == {("masks/a.py", "masks/b.py")}


def test_import_bhqk_does_not_load_torch_dynamo():
    """``import bhqk`` leaves ``torch._dynamo`` (about 1 s to import) to the first compiled call:
    every CLI start and every subprocess pays what the import pays."""
    code = "import sys, bhqk; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
