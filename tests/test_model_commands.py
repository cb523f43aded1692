"""Real models on the command line, the same in every command: one resolver of ``--model`` (a model
name, a GGUF file, a folder; a typo lists the names), a bad ``attn_implementation`` named before
anything loads, prompts longer than the model's context refused with the numbers, an empty chat
message refused, ``bhqk needle``'s line per prompt on stderr (``bhqk stats``'s label: tests/test_pretrained.py). The real
SmolLM2 is tests/conftest.py's session fixture; the commands are handed it instead of loading it again."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest
import torch

from bhqk.errors import BackendError, LoadError
from bhqk.inspect import needle
from bhqk.models import gguf, real
from test_cli import run

pytestmark = pytest.mark.protocol  # transformers through bhqk (make test-newest, make test-lowest)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def nothing_loads(monkeypatch):
    """A load of any model fails the test: what is refused must be refused before."""

    def no(*args, **kwargs):
        raise AssertionError("a model was loaded (or its file hashed) before the mistake was refused")

    for name in ("sha256_of", "check_parts", "convert"):
        monkeypatch.setattr(gguf, name, no)
    monkeypatch.setattr(real, "read_config", no)  # a folder's config.json is read before its weights


# ---- a bad attention implementation is named, with the choices, before anything loads -----------------


def test_an_unknown_bhqk_backend_is_named_with_bhqks_choices(nothing_loads):
    with pytest.raises(BackendError) as e:
        real.pretrained("smollm2-135m", attn_implementation="bhqk:nosuch")
    text = str(e.value)  # old: "cannot load the model in …; delete the cache folder (rm -r …)", transformers' list
    assert "'nosuch'" in text and "bhqk:tiled" in text and "bhqk:reference" in text, text
    assert "rm -r" not in text and "delete" not in text


def test_an_unknown_implementation_lists_bhqks_and_transformers(nothing_loads, tmp_path):
    with pytest.raises(BackendError, match=r"'nosuch'.*bhqk:tiled.*eager.*sdpa"):
        real.pretrained("smollm2-135m", attn_implementation="nosuch")
    with pytest.raises(BackendError, match=r"'bhqk:nosuch'"):  # a local folder: the same check, before config.json
        real.load_model(tmp_path, "bhqk:nosuch")


def test_show_and_trace_refuse_an_unknown_backend_when_parsed():
    for cmd in ("show", "trace"):
        code, out, err = run([cmd, "some words", "--backend", "nosuch"])
        assert code == 2 and "--backend" in err and "tiled" in err, err  # old: accepted, failed later


# ---- one resolver of --model ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "smollm2-135", "hello"],
    ["needle", "--model", "smollm2-135", "--lengths", "256"],
    ["stats", "--model", "smollm2-135", "some words here"],
    ["budget", "--model", "smollm2-135"],
    ["show", "--model", "smollm2-135", "some words here"],
    ["trace", "--model", "smollm2-135", "some words here"],
], ids=lambda a: a[0])
def test_a_typo_in_model_lists_the_known_names_in_every_command(argv, nothing_loads, tmp_path):
    code, out, err = run([*argv, *(["--out", str(tmp_path)] if argv[0] in ("needle", "stats", "show") else [])])
    assert code == 2 and "Traceback" not in err, err
    assert "smollm2-135m" in err and "Did you mean 'smollm2-135m'" in err, err  # old: "not a folder", no names
    assert "not a folder" not in err


def test_trace_and_show_take_the_model_name_the_other_commands_take(cli_model):
    from bhqk.viz.cli import run_sentence

    code, out, err = run(["trace", "--model", "smollm2-135m", "The cat sat on the mat."])
    assert code == 0, err  # old: "smollm2-135m is not a folder"
    assert out.count("model.layers.") >= 30 and "[B=1, H=9" in out, out[:2000]
    cap, tokens = run_sentence("The cat sat on the mat.", "smollm2-135m")  # what bhqk show draws (the drawing: 14 s)
    assert len(cap) == 30 and cap.records[0].sizes["H"] == 9 and len(tokens) == cap.records[0].sizes["Q"]
    assert cli_model == [("smollm2-135m", "auto")] * 2


# ---- prompts longer than the model's context --------------------------------------------------------------


def test_generate_refuses_a_prompt_beyond_the_context_with_the_numbers(cli_model, smollm2):
    limit = smollm2[0].config.max_position_embeddings  # 8,192
    ids = ",".join(["100"] * 9000)
    code, out, err = run(["generate", "--model", "smollm2-135m", "--ids", ids, "-n", "1"])
    assert code == 2, err  # old: ran, with transformers' reminder only
    assert "9,000 tokens" in err and f"{limit:,}" in err and "--max-new-tokens" in err, err
    code, out, err = run(["generate", "--model", "smollm2-135m", "--ids", ",".join(["100"] * 8000), "-n", "500"])
    assert code == 2 and "8,000 tokens" in err and "500 more" in err, err


def test_the_needle_grid_refuses_lengths_beyond_the_context_before_running_any(smollm2, monkeypatch):
    model, tok = smollm2
    monkeypatch.setattr(needle, "ask", lambda *a, **k: pytest.fail("a prompt ran"))
    with pytest.raises(ValueError, match=r"lengths \[9000\].*context of 8,192"):
        needle.grid(model, tok, [1024, 9000], [0.5], progress=False)  # old: ran, then 0 % found


def test_cli_needle_refuses_a_length_beyond_the_context(cli_model, tmp_path):
    code, out, err = run(["needle", "--model", "smollm2-135m", "--lengths", "9000", "--out", str(tmp_path)])
    assert code == 2 and "8,192" in err and "9000" in err, err
    assert not (tmp_path / "needle.json").exists()


# ---- the empty chat message, needle's progress, stats's label ---------------------------------------------


@pytest.mark.parametrize("prompt", ["", "   "])
def test_generate_refuses_an_empty_chat_message(prompt, nothing_loads):
    code, out, err = run(["generate", "--model", "smollm2-135m", prompt])
    assert code == 2 and "empty" in err and "Traceback" not in err, err  # old: rc 0, an answer to nothing


def test_cli_needle_prints_a_line_per_prompt_on_stderr(cli_model, tmp_path):
    code, out, err = run(["needle", "--model", "smollm2-135m", "--lengths", "128", "--depths", "0,1",
                          "--max-new-tokens", "1", "--out", str(tmp_path)])
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("needle ")]  # old: nothing until the table
    assert len(lines) == 2, err
    for i, (line, depth) in enumerate(zip(lines, ("0", "1"))):
        assert re.fullmatch(rf"needle {i + 1}/2: length 128, depth {depth}, trial 0: (found|not found) \(\d+\.\d s\)", line)


# ---- the README's shown (```py) blocks import the bhqk names they use --------------------------------------


def test_readme_py_blocks_import_the_bhqk_classes_and_functions_they_use():
    exported: dict[str, str] = {}
    for mod in ("bhqk", "bhqk.budget", "bhqk.inspect", "bhqk.models", "bhqk.masks", "bhqk.viz"):
        m = importlib.import_module(mod)
        for name in getattr(m, "__all__", []):
            obj = getattr(m, name, None)
            if callable(obj):  # a class or a function (a module may be named without import: bhqk, masks)
                exported.setdefault(name, mod)
    text = (ROOT / "README.md").read_text()
    missing = []
    for block in re.finditer(r"```py\n(.*?)```", text, flags=re.S):
        tree = ast.parse(block.group(1))
        defined = set(dir(builtins))
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in n.names}
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        line = text.count("\n", 0, block.start()) + 1
        missing += [f"README.md:{line} uses {u} ({exported[u]}) without importing it" for u in used - defined if u in exported]
    assert not missing, missing  # old: the budget block used Plan.load without importing Plan


def test_resolve_returns_names_and_paths_and_lists_names(tmp_path):
    assert real.resolve("smollm2-135m") == "smollm2-135m"
    assert real.resolve(tmp_path) == tmp_path
    with pytest.raises(LoadError, match=r"no model 'nosuch'.*smollm2-135m"):
        real.resolve("nosuch")
    assert real.context_length(torch.nn.Linear(1, 1)) is None


def test_needle_on_a_folder_without_tokenizer_is_one_error(tmp_path):
    import transformers

    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(tmp_path / "tiny")
    code, out, err = run(["needle", "--model", str(tmp_path / "tiny"), "--lengths", "128", "--out", str(tmp_path)])
    assert code == 2 and "tokenizer" in err and "Traceback" not in err, err
