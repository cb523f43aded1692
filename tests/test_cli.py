"""The ``bhqk`` command line, in-process (``bhqk.cli.main``), and one smoke test of the installed
entry point. Every mistake: exit status 2, one message, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bhqk import cli, console, masks

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


def run(argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    """``bhqk ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    try:
        if stdin is not None:
            sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse: --help, --version, a bad option
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = old_stdin
    return code, out.getvalue(), err.getvalue()


def assert_one_error(code: int, out: str, err: str, command: str = "") -> None:
    """Exit 2, nothing on stdout, one ``bhqk CMD: error:`` message on stderr, no traceback."""
    assert code == 2, (code, out, err)
    assert out == ""
    assert "Traceback" not in err
    assert err.count("error:") == 1 and err.startswith(f"bhqk {command}".rstrip() + ":"), err


# --- a tiny GPT-2 folder written with Hugging Face's names (no transformers import) -------------

V, P, D, L = 50, 32, 16, 2


def gpt2_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    sd = {"transformer.wte.weight": r(V, D), "transformer.wpe.weight": r(P, D),
          "transformer.ln_f.weight": torch.ones(D), "transformer.ln_f.bias": torch.zeros(D)}
    for i in range(L):
        h = f"transformer.h.{i}."
        sd |= {h + "ln_1.weight": torch.ones(D), h + "ln_1.bias": torch.zeros(D),
               h + "ln_2.weight": torch.ones(D), h + "ln_2.bias": torch.zeros(D),
               h + "attn.c_attn.weight": r(D, 3 * D), h + "attn.c_attn.bias": r(3 * D),  # Conv1D [in, out]
               h + "attn.c_proj.weight": r(D, D), h + "attn.c_proj.bias": r(D),
               h + "mlp.c_fc.weight": r(D, 4 * D), h + "mlp.c_fc.bias": r(4 * D),
               h + "mlp.c_proj.weight": r(4 * D, D), h + "mlp.c_proj.bias": r(D)}
    return sd


def write_gpt2(folder: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": V, "n_positions": P, "n_embd": D, "n_layer": L, "n_head": 2}))
    save_file(gpt2_state() if state is None else state, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return write_gpt2(tmp_path_factory.mktemp("gpt2"))


# --- help, version ------------------------------------------------------------------------------


def test_help_on_every_option_of_every_subcommand():
    p = cli.parser()
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) >= {"explain", "mask", "demo", "embed", "generate", "show"}
    for name, sp in [("bhqk", p), *subs.choices.items()]:
        for action in sp._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}"
    for argv in (["--help"], *([c, "--help"] for c in subs.choices)):
        code, out, err = run(argv)
        assert code == 0 and out.startswith("usage: bhqk") and err == ""


def test_version():
    code, out, _ = run(["--version"])
    assert code == 0 and out.startswith("bhqk ") and f"torch {torch.__version__}" in out


# --- errors: one message, whole, in flag syntax -------------------------------------------------


def test_library_error_hint_is_in_flag_syntax():
    code, out, err = run(["mask", "causal", "-Q", "3", "-K", "5"])
    assert_one_error(code, out, err, "mask")
    assert "--align top_left" in err and "--align bottom_right" in err and "align='" not in err
    code, out, err = run(["explain", "-H", "6", "--kv-heads", "4", "-Q", "1", "-d", "2"])
    assert_one_error(code, out, err, "explain")
    assert "H=6 is not divisible by Hkv=4" in err


def test_flag_syntax_rewrites_only_hints_for_the_commands_options():
    flags = {"align": "--align", "backend": "--backend"}
    assert cli.in_flag_syntax("pass align='top_left' or align=\"bottom_right\".", flags) == \
        "pass --align top_left or --align bottom_right."
    assert cli.in_flag_syntax("pass backend='reference' to accept it", flags) == "pass --backend reference to accept it"
    kept = "causal(align='top_left') and sliding_window(2, align='top_left'), model_type='bert', lang='en'"
    assert cli.in_flag_syntax(kept, flags) == kept  # a repr or an unknown name stays as written


def test_multi_line_library_error_is_printed_whole(tmp_path):
    state = gpt2_state()
    state["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(D, 3 * D)  # wrong shape
    del state["transformer.ln_f.bias"]  # missing
    folder = write_gpt2(tmp_path / "bad", state)
    with pytest.raises(ValueError) as e:
        from bhqk.models.gpt2 import GPT2

        GPT2.from_pretrained(folder)
    lines = str(e.value).splitlines()
    assert len(lines) >= 2  # the library's message is multi-line
    code, out, err = run(["generate", "--model", str(folder), "--ids", "1,2"])
    assert_one_error(code, out, err, "generate")
    for line in lines:
        assert line.strip() in err
    assert err.rstrip().count("\n") == len(lines) - 1


@pytest.mark.parametrize("argv, words", [
    (["mask", "causal", "--q-len", "-3"], "--q-len/-Q: must be >= 1, got -3"),
    (["mask", "causal", "-Q", "x"], "expected an integer, got 'x'"),
    (["mask", "padding", "--lengths", ""], "--lengths"),
    (["mask", "padding", "--lengths", "3,-1"], ">= 0"),
    (["mask", "sliding_window", "--left", "-1"], "--left"),
    (["mask", "document", "-Q", "4"], "bhqk mask: error:"),  # 8 document ids for 4 queries
    (["mask", "spiral"], "invalid choice"),
    (["explain", "-H", "0", "-Q", "1", "-d", "1"], "--heads/-H: must be >= 1"),
    (["generate", "--model", "x", "--ids", "1", "--temperature", "nan"], "--temperature: must be a finite number"),
    (["generate", "--model", "x", "--ids", "1", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["generate", "--model", "x", "--ids", "1", "--top-k", "0"], "--top-k: must be >= 1, got 0"),
    (["generate", "--model", "x", "--ids", "1,a"], "--ids"),
    (["generate", "--model", "x", "--ids", "1", "-n", "-2"], "--max-new-tokens/-n: must be >= 0"),
    (["generate", "--model", "x", "--ids", "1", "--backend", "fast"], "unknown backend 'fast'"),
    (["embed", ""], "a sentence is empty"),
    (["embed", "  "], "a sentence is empty"),
    (["show", ""], "the text is empty"),  # refused as embed refuses it, before a model is loaded or a file written
    (["show", "   "], "the text is empty"),
    (["trace", " \t"], "the text is empty"),
    (["embed", "hello", "--out", "vectors.csv"], "use one of .npy, .json"),
    (["embed"], "no sentences"),
    (["embed", "hello", "--file", "/nonexistent/sentences.txt"], "No such file or directory: /nonexistent/sentences.txt"),
    (["generate", "--model", "/nonexistent/folder", "--ids", "1"], "nor a file or folder"),
    (["nonsense"], "invalid choice"),
    ([], "required"),
])
def test_bad_arguments_exit_2_with_one_message(argv, words):
    code, out, err = run(argv)
    command = argv[0] if argv and argv[0] in ("mask", "explain", "generate", "embed", "show", "trace") else ""
    assert_one_error(code, out, err, command)
    assert words in err


def test_show_refuses_blank_text_before_writing_anything(tmp_path, monkeypatch):
    from bhqk import viz

    monkeypatch.chdir(tmp_path)  # where the default folder bhqk-show/ would be written
    for text in ("", "   "):
        for argv in (["show", text], ["show", text, "--out", "pictures"]):
            assert_one_error(*run(argv), "show")
        with pytest.raises(ValueError, match="the text is empty"):
            viz.show(text, "pictures")
    assert list(tmp_path.iterdir()) == []


def test_sizes_too_large_to_draw_are_refused_before_anything_is_built(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a mask was built or drawn for a size the command refuses")

    monkeypatch.setattr(cli, "build_mask", boom)
    monkeypatch.setattr(masks.Mask, "draw", boom)
    for argv in (["mask", "causal", "--q-len", "200000", "--k-len", "200000"], ["mask", "full", "--q-len", "200000"],
                 ["mask", "padding", "-Q", "400", "-K", "400", "--lengths", "1,2"]):
        code, out, err = run(argv)
        assert_one_error(code, out, err, "mask")
        assert f"{cli.MAX_DRAW_CELLS:,}" in err  # the message gives the limit
    code, out, err = run(["mask", "padding", "-Q", "1", "--lengths", ",".join(["1"] * 10_000)])
    assert_one_error(code, out, err, "mask")
    assert f"B=10000 batch elements; bhqk mask draws at most {cli.MAX_DRAW_BATCH}" in err
    monkeypatch.undo()
    code, out, _ = run(["mask", "full", "-Q", "512", "-K", "512"])  # at the limit: drawn
    assert code == 0 and out.count("\n") == 1 + 512  # the title, then one row per query


# --- generate -----------------------------------------------------------------------------------


def test_generate_with_ids(gpt2):
    code, out, err = run(["generate", "--model", str(gpt2), "--ids", "1,2,3", "-n", "4"])
    assert code == 0 and err == ""  # no progress bar when not on a terminal
    ids = [int(x) for x in out.strip().split(",")]
    assert ids[:3] == [1, 2, 3] and len(ids) == 7 and all(0 <= i < V for i in ids)


@pytest.mark.parametrize("damage", ["truncated", "empty", "random"])
def test_generate_with_a_damaged_checkpoint(gpt2, tmp_path, damage):
    folder = tmp_path / damage
    folder.mkdir()
    (folder / "config.json").write_bytes((gpt2 / "config.json").read_bytes())
    raw = (gpt2 / "model.safetensors").read_bytes()
    body = {"truncated": raw[: len(raw) // 2], "empty": b"", "random": os.urandom(4096)}[damage]
    (folder / "model.safetensors").write_bytes(body)
    code, out, err = run(["generate", "--model", str(folder), "--ids", "1,2"])
    assert_one_error(code, out, err, "generate")
    assert "model.safetensors" in err or str(folder) in err


def test_progress_shows_on_a_terminal_only(gpt2, monkeypatch):
    monkeypatch.setattr(console, "progress_enabled", lambda: True)
    code, _, err = run(["generate", "--model", str(gpt2), "--ids", "1,2,3", "-n", "3"])
    assert code == 0 and "loading GPT-2" in err and "generating" in err
    monkeypatch.setattr(console, "progress_enabled", lambda: False)
    code, _, err = run(["generate", "--model", str(gpt2), "--ids", "1,2,3", "-n", "3"])
    assert code == 0 and err == ""


def test_progress_is_off_when_piped(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal, as when piped
    assert console.progress_enabled() is False
    assert console.progress(range(3)).disable


# --- embed --out --------------------------------------------------------------------------------


def test_embed_writes_npy_and_json(tmp_path):
    import numpy as np

    sentences = ["A man is eating food.", "A man eats a meal.", "The sky is blue."]
    (tmp_path / "more.txt").write_text("\n".join(sentences[1:]) + "\n\n")
    code, out, err = run(["embed", sentences[0], "--file", str(tmp_path / "more.txt"),
                          "--out", str(tmp_path / "v" / "e.npy")])
    assert code == 0 and err == "" and "wrote embeddings [S=3, D=384]" in out
    emb = np.load(tmp_path / "v" / "e.npy")
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    code, out, err = run(["embed", "--file", "-", "--out", str(tmp_path / "e.json")], stdin="\n".join(sentences))
    assert code == 0, err
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["sentences"] == sentences and data["shape"] == [3, 384]
    assert np.allclose(np.array(data["embeddings"]), emb, atol=1e-6)
    sim = emb @ emb.T
    assert sim[0, 1] > sim[0, 2]  # eating food ~ eats a meal, not the sky


# --- the installed entry point, once ------------------------------------------------------------


def test_installed_entry_point_smoke():
    exe = Path(sys.executable).with_name("bhqk")
    assert exe.is_file(), f"{exe} missing: install the package (pip install -e .)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(cli.__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([str(exe), "mask", "causal", "-Q", "3", "-K", "5"], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("bhqk mask: error:") and "--align top_left" in r.stderr


def test_readme_install_comment_names_every_dependency():
    """The README's `pip install` line says what the library pulls in: every dependency in pyproject.toml."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps]
    line = next(x for x in (root / "README.md").read_text().splitlines() if x.startswith("pip install /path/to/bhqk "))
    comment = line.split("#", 1)[1]
    assert names and all(n in comment for n in names), (names, comment)
