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
from bhqk.evaluate import needle
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


# ---- issue 40, item 9: the commands' edges -----------------------------------------------------------------


def test_stats_refuses_max_tokens_beyond_the_context_with_the_numbers(cli_model, tmp_path):
    code, out, err = run(["stats", "--model", "smollm2-135m", "--max-tokens", "9000", "some words to read here",
                          "--out", str(tmp_path)])
    assert code == 2, err  # old: ran, as if the model read 9,000 positions
    assert "--max-tokens 9,000" in err and "8,192" in err, err


@pytest.fixture
def no_scoring(monkeypatch):
    """``bhqk budget`` scores nothing: ``find`` records its keywords and returns a plan of every head streaming."""
    from bhqk.budget import Plan, cli, model_map

    asked: list = []

    def find(model, **kw):
        asked.append(kw)
        shape = model_map(model).shape
        return Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), kw["sink"], kw["window"], model=shape)

    monkeypatch.setattr(cli, "find", find)
    return asked


@pytest.mark.parametrize("argv", [["--length", "100000"], ["--score", "kl", "--probe-length", "9000"]],
                         ids=["length", "probe-length"])
def test_budget_refuses_lengths_beyond_the_context_before_any_work(argv, cli_model, no_scoring):
    code, out, err = run(["budget", "--model", "smollm2-135m", *argv])
    assert code == 2, err  # old: --length 100000 accepted; --probe-length 9000 computed for minutes, then failed
    assert f"{argv[-2]} {int(argv[-1]):,}" in err and "8,192" in err, err
    assert no_scoring == []


@pytest.mark.parametrize("spelling", ["copy-mass", "copy mass", "copy_mass"])
def test_budget_ties_copy_mass_is_one_order_however_it_is_spelled(spelling, cli_model, no_scoring):
    code, out, err = run(["budget", "--model", "smollm2-135m", "--score", "retrieval", "--ties", spelling])
    assert code == 0, err  # old: --ties "copy mass" (find's spelling) refused, "copy-mass" refused by find
    assert no_scoring[-1]["ties"] == "copy mass"
    code, out, err = run(["budget", "--model", "smollm2-135m", "--ties", "copymass"])
    assert code == 2 and "index or copy-mass" in err, err


def test_generate_uses_the_chat_template_where_there_is_one_and_raw_text_with_raw(cli_model, smollm2, monkeypatch):
    model, tok = smollm2
    question = "The capital of France is"
    chat = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    raw = tok(question)["input_ids"]
    assert chat != raw

    def prompt_ids(*flags: str) -> list[int]:
        code, out, err = run(["generate", "--model", "smollm2-135m", question, "-n", "1", "--show-ids", *flags])
        assert code == 0, err
        return [int(x) for x in out.strip().splitlines()[-1].split(",")][:-1]  # the last id is the new one

    assert prompt_ids() == chat
    assert prompt_ids("--raw") == raw  # old: --raw unknown; every prompt went through the template
    monkeypatch.setattr(tok, "chat_template", None)  # a pretrained model's tokenizer: no template, the text as it is
    assert prompt_ids() == raw


def test_generate_runs_with_a_saved_budget_plan(cli_model, smollm2, tmp_path, monkeypatch):
    from bhqk.budget import Plan, model_map

    model, _ = smollm2
    shape = model_map(model).shape
    assert shape.name == "smollm2-135m"  # what the plan records as made for: the name, not the cache folder
    Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), 4, 8, model=shape).save(tmp_path / "plan.json")
    Plan(torch.zeros(32, 2, dtype=torch.bool)).save(tmp_path / "other.json")
    made = []
    cache = Plan.cache
    monkeypatch.setattr(Plan, "cache", lambda self, *a, **k: made.append(self) or cache(self, *a, **k))
    code, out, err = run(["generate", "--model", "smollm2-135m", "--ids", "1,2,3", "-n", "2", "--plan",
                          str(tmp_path / "plan.json")])
    assert code == 0 and len(made) == 1 and made[0].window == 8, err  # old: --plan unknown
    code, out, err = run(["generate", "--model", "smollm2-135m", "--ids", "1,2,3", "-n", "2", "--plan",
                          str(tmp_path / "other.json")])
    assert code == 2 and "the plan is [layers=32, Hkv=2]" in err, err


def test_generate_without_a_prompt_says_the_prompt_is_missing(nothing_loads):
    code, out, err = run(["generate", "--model", "smollm2-135m"])
    assert code == 2 and "prompt is missing" in err and "not both" not in err, err  # old: "… or --ids, not both."
    code, out, err = run(["generate", "--model", "smollm2-135m", "hello", "--ids", "1,2"])
    assert code == 2 and "not both" in err, err


def test_long_commands_print_a_line_per_stage_off_a_terminal(cli_model, no_scoring, tmp_path):
    code, out, err = run(["grade", "--model", "smollm2-135m", "--task", "needle", "--lengths", "128", "--trials", "1",
                          "--out", str(tmp_path / "grade")])
    assert code == 0, err
    assert "loading smollm2-135m …" in err and re.search(r"^grade 1/1 \(\d+\.\d s\)$", err, re.M), err  # old: silent
    code, out, err = run(["stats", "--model", "smollm2-135m", "some words to read here", "--out", str(tmp_path / "s")])
    assert code == 0, err
    assert "loading smollm2-135m …" in err and re.search(r"^bhqk stats 30/30 \(", err, re.M), err  # old: silent
    code, out, err = run(["budget", "--model", "smollm2-135m", "--score", "retrieval"])
    assert code == 0, err
    assert "loading smollm2-135m …" in err and "budget: scoring every K/V head by retrieval" in err, err


@pytest.mark.parametrize("command", ["stats", "budget"])
def test_help_is_plain_words(command):
    code, out, err = run([command, "--help"])
    assert code == 0 and "``" not in out and ":func:" not in out, out  # old: the module docstring's reST


def test_depths_progressions_include_their_end():
    from bhqk.console import fraction_list

    assert fraction_list("0,0.3,...,1") == [0.0, 0.3, 0.6, 0.9, 1.0]  # old: stopped at 0.9
    assert fraction_list("0,0.1,...,1") == [round(0.1 * i, 10) for i in range(11)]
    assert fraction_list("0,0.25,…,1") == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_a_loaded_folder_goes_by_its_name(tmp_path):
    import transformers

    from bhqk.budget import model_map

    folder = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(folder)
    loaded = real.load_model(folder, "bhqk:tiled")
    assert loaded.decoder and loaded.tokenizer is None and loaded.name == "tiny-llama" and loaded.folder == folder
    assert model_map(loaded.model).shape.name == "tiny-llama"  # a plan's "made for"
    assert loaded.model.config._attn_implementation == "bhqk:tiled"
