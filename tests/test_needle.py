"""bhqk.evaluate.needle and ``bhqk needle``: the pass-key grid on SmolLM2-135M (tests/conftest.py's
session fixture ``smollm2``), its prompts (bhqk.corpus), its files, its hooks; the one greedy loop
(bhqk.integrations.greedy); and ``bhqk generate`` on the model."""

from __future__ import annotations

import json

import pytest
import torch

from bhqk import corpus
from bhqk.evaluate import needle
from bhqk.inspect.edit import parse_edit
from test_cli import run

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


@pytest.fixture(scope="module")
def small_grid(smollm2):
    """lengths 128, 256 × depths 0, 0.5, 1, one trial each, seed 0 (short prompts: each trial costs
    its 16 greedy steps more than its prompt; the long grids are docs/heads.md's)."""
    model, tok = smollm2
    return needle.grid(model, tok, [128, 256], [0.0, 0.5, 1.0], trials=1, seed=0, progress=False)


def test_the_model_finds_the_key_on_a_small_grid(small_grid):
    # measured: 6 of 6 found; the bound leaves two misses of margin (a different CPU's rounding, a
    # tokenizer version) while a model that cannot read the prompt (every head zeroed: found 0, below) fails it
    assert small_grid.mean() >= 4 / 6, small_grid.table()
    assert small_grid.accuracy().shape == (2, 3)


def test_json_and_png(small_grid, tmp_path):
    js, png = small_grid.save(tmp_path)
    data = json.loads(js.read_text())
    assert data["lengths"] == [128, 256] and data["depths"] == [0.0, 0.5, 1.0] and data["seed"] == 0
    assert len(data["trials"]) == 6
    for e in data["trials"]:
        assert set(e) >= {"length", "depth", "key", "answer", "found"}
        assert isinstance(e["key"], str) and e["key"].isdigit() and 5 <= len(e["key"]) <= 6
        assert isinstance(e["answer"], str) and isinstance(e["found"], bool)
        assert e["found"] == corpus.found_in(e["answer"], e["key"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    table = small_grid.table()
    assert table.splitlines()[0].split()[-3:] == ["0", "0.5", "1"] and "found" in table.splitlines()[-1]


def test_prompts_are_exact_and_deterministic(smollm2):
    _, tok = smollm2
    a = corpus.make_trials(tok, [256, 512], [0.0, 0.5, 1.0], trials=2, seed=3)
    b = corpus.make_trials(tok, [256, 512], [0.0, 0.5, 1.0], trials=2, seed=3)
    c = corpus.make_trials(tok, [256, 512], [0.0, 0.5, 1.0], trials=2, seed=4)
    assert [(t.key, t.ids) for t in a] == [(t.key, t.ids) for t in b]
    assert sum(x.key != y.key for x, y in zip(a, c)) >= len(a) - 1  # another seed, other keys
    alone = corpus.make_trials(tok, [512], [0.5], trials=2, seed=3)  # a cell does not depend on the others
    assert [t.ids for t in alone] == [t.ids for t in a if t.length == 512 and t.depth == 0.5]
    for t in a:
        assert len(t.ids) == t.length
        at = tok.decode(t.ids[t.needle_at : t.needle_at + 12])
        assert at.strip().startswith(f"The pass key is {t.key}."), at
    depth_order = [t.needle_at for t in a if t.length == 512 and t.trial == 0]
    assert depth_order == sorted(depth_order) and depth_order[0] < depth_order[-1]


def test_bad_grids_are_refused(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="depth must be in"):
        corpus.make_trial(tok, 256, 1.5)
    with pytest.raises(ValueError, match="too short"):
        corpus.make_trial(tok, 40, 0.5)
    with pytest.raises(ValueError, match="grid is empty"):
        needle.grid(model, tok, [], [0.5])
    with pytest.raises(ValueError, match="zero:LAYER.HEAD"):
        parse_edit("drop:1.2")
    assert parse_edit("zero:1.2,3.4") == [(1, 2), (3, 4)]


def test_found_is_a_whole_number():
    assert corpus.found_in("The pass key is 48213.", "48213")
    assert not corpus.found_in("148213", "48213") and not corpus.found_in("4821", "48213")


# ---- the command line --------------------------------------------------------------------------


def test_cli_needle_writes_the_grid_and_edits_heads(cli_model, smollm2, tmp_path):
    """Every head's output zeroed by --edit: the model cannot see the needle (the score can fail)."""
    cfg = smollm2[0].config
    every = ",".join(f"{layer}.{h}" for layer in range(cfg.num_hidden_layers) for h in range(cfg.num_attention_heads))
    code, out, err = run(["needle", "--model", "smollm2-135m", "--lengths", "256", "--depths", "0.5",
                          "--out", str(tmp_path), "--edit", f"zero:{every}"])
    assert code == 0, err
    assert cli_model == [("smollm2-135m", "auto")]
    data = json.loads((tmp_path / "needle.json").read_text())
    assert data["depths"] == [0.5] and data["edit"] == f"zero:{every}" and len(data["trials"]) == 1
    assert not data["trials"][0]["found"], data["trials"]
    assert (tmp_path / "needle.png").is_file() and "found 0 of 1" in out and "needle.png" in out


def test_depths_progression_on_the_command_line():
    from bhqk.console import fraction_list

    assert fraction_list("0,0.1,...,1") == [round(0.1 * i, 10) for i in range(11)]
    assert fraction_list("0,0.5,1") == [0.0, 0.5, 1.0]


def test_cli_needle_plan_without_budget_is_one_error(tmp_path):
    code, out, err = run(["needle", "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path)])
    # without bhqk.budget: "--plan needs bhqk.budget"; with it: the missing file. One line either way
    assert code == 2 and err.startswith("bhqk needle: error:") and "Traceback" not in err


def test_cli_needle_bad_options(tmp_path):
    for argv, msg in [(["--depths", "0,2"], "--depths: every depth must be a number in [0, 1]"),
                      (["--lengths", "10"], "--lengths: every value must be >= 64"),
                      (["--edit", "zero:x"], "zero:LAYER.HEAD")]:
        code, out, err = run(["needle", *argv, "--out", str(tmp_path)])
        assert code == 2 and msg in err, err


def test_cli_needle_refuses_the_graded_set_and_points_to_grade(tmp_path):
    """The graded set's options moved to ``bhqk grade``: ``bhqk needle`` refuses them (before any model
    loads) with the command to run instead."""
    for argv, flag in [(["--task", "needle"], "--task"), (["--compare", "full", "streaming"], "--compare"),
                       (["--kl-lengths", "256", "--chunks", "1"], "--kl-lengths")]:
        code, out, err = run(["needle", *argv, "--out", str(tmp_path)])
        assert code == 2 and f"bhqk grade {flag}" in err and "Traceback" not in err, err
    assert not (tmp_path / "needle.json").exists()


def test_greedy_is_generates_greedy_tokens_and_stops_at_an_end_token(smollm2):
    """The one loop (prefill, then one token per step at its true position) gives ``model.generate``'s
    greedy tokens, without the end token; a model without a cache (a function of ids) gets one whole
    forward per token; ``eos_ids`` joins the model's and the tokenizer's end tokens."""
    from bhqk.integrations.greedy import eos_ids, greedy

    model, tok = smollm2
    ids = corpus.make_trial(tok, 200, 0.5).ids
    r = greedy(model, ids, max_new_tokens=12, eos=eos_ids(model, tok))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=2)[0, 200:].tolist()
    want = out[: out.index(2)] if 2 in out else out
    assert r.tokens == want and r.prefill_s > 0 and r.cache.get_seq_length() == 200 + len(want) - (len(want) == 12)
    assert eos_ids(model, tok) == {2}
    assert greedy(model, ids, max_new_tokens=3, eos={r.tokens[0]}).tokens == []  # stops before an end token

    def counting(x):  # logits that make token (last + 1) % 7 the argmax: 1, 2, 3, then 4 is an end token
        return torch.nn.functional.one_hot((x + 1) % 7, 7).float()

    assert greedy(counting, [0], max_new_tokens=5, eos=[4]).tokens == [1, 2, 3]
    assert greedy(counting, [0], max_new_tokens=2).tokens == [1, 2]


def test_cli_generate_streams_the_chat_answer(cli_model, capfd):
    code, out, err = run(["generate", "--model", "smollm2-135m", "What is the capital of France?", "-n", "12"])
    assert code == 0, err
    streamed = capfd.readouterr().out + out  # TextStreamer prints as tokens arrive
    assert "Paris" in streamed


def test_cli_generate_ids_match_the_model(cli_model, smollm2):
    model, tok = smollm2
    ids = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    code, out, err = run(["generate", "--model", "smollm2-135m", "--ids", ",".join(map(str, ids)), "-n", "4", "--show-ids"])
    assert code == 0, err
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                              pad_token_id=model.generation_config.eos_token_id)[0].tolist()
    assert out.strip().splitlines()[-1] == ",".join(map(str, want))



def test_cli_needle_plan_generates_with_the_plans_cache(cli_model, smollm2, tmp_path, monkeypatch):
    """``bhqk needle --plan``: every generation runs on ``plan.cache()``. Every K/V head streaming with a
    tiny window (sink 4, window 8) cannot see a needle in the middle of 256 tokens: the answer changes
    from full attention's; an all-full plan gives exactly full attention's answer."""
    from bhqk.budget import BudgetCache, Plan

    model, tok = smollm2
    cfg = model.config
    full_answer = needle.ask(model, tok, corpus.make_trial(tok, 256, 0.5, 0, 0), max_new_tokens=8)["answer"]
    made = []
    init = BudgetCache.__init__

    def spy(self, p, *shape):
        made.append(p)
        init(self, p, *shape)

    monkeypatch.setattr(BudgetCache, "__init__", spy)
    answers = {}
    for all_full in (False, True):
        plan = Plan(torch.full((cfg.num_hidden_layers, cfg.num_key_value_heads), all_full), sink=4, window=8)
        plan.save(tmp_path / "plan.json")
        made.clear()
        code, out, err = run(["needle", "--model", "smollm2-135m", "--lengths", "256", "--depths", "0.5",
                              "--max-new-tokens", "8", "--out", str(tmp_path), "--plan", str(tmp_path / "plan.json")])
        assert code == 0, err
        assert len(made) == 1 and made[0].full.eq(all_full).all() and (made[0].sink, made[0].window) == (4, 8)
        answers[all_full] = json.loads((tmp_path / "needle.json").read_text())["trials"][0]
    assert answers[True]["answer"] == full_answer
    assert answers[False]["answer"] != full_answer and not answers[False]["found"], (answers, full_answer)


def test_ask_passes_the_cache_by_the_keyword_the_model_takes():
    """transformers 5.24 renamed generate's ``past_key_values`` to ``cache`` (a FutureWarning for the old
    name); older 5.x models take ``past_key_values``. ``ask`` uses the name the model's forward has."""
    import warnings

    import transformers

    from bhqk.integrations.transformers import cache_keyword, register

    register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, attn_implementation="bhqk")).eval()
    model.generation_config.pad_token_id = 0
    made = []

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def factory():
        made.append(transformers.DynamicCache())
        return made[-1]

    trial = corpus.Trial(length=5, depth=0.0, trial=0, key="1", ids=[1, 2, 3, 4, 5], needle_at=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        needle.ask(model, Tok(), trial, max_new_tokens=3, past_key_values=factory)
    assert len(made) == 1 and made[0].get_seq_length() == 5 + 3 - 1  # the cache given was the one filled
    assert cache_keyword(model) == "cache"

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values"


def test_kvpress_benchmark_loads_the_corpus_and_the_loop_without_bhqk(smollm2):
    """benchmarks/kvpress_needle.py runs in kvpress's environment (another transformers): it loads
    bhqk's corpus.py and integrations/greedy.py by path, which import nothing of bhqk, and makes the
    same prompts as bhqk.corpus."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    code = (f"import sys; sys.path.insert(0, {str(bench)!r}); import kvpress_needle as k; "
            "c = k.load_file(k.SRC / 'corpus.py', 'corpus'); g = k.load_file(k.SRC / 'integrations/greedy.py', 'greedy'); "
            "assert callable(c.make_trials) and callable(g.greedy); "
            "print(sorted(m for m in sys.modules if m == 'bhqk' or m.startswith('bhqk.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    sys.path.insert(0, str(bench))
    try:
        import kvpress_needle as k
    finally:
        sys.path.remove(str(bench))
    by_path = k.load_file(k.SRC / "corpus.py", "corpus")
    _, tok = smollm2
    assert [t.ids for t in by_path.make_trials(tok, [256], [0.0, 0.5], 1, 0)] == \
        [t.ids for t in corpus.make_trials(tok, [256], [0.0, 0.5], 1, 0)]
