"""bhqk.evaluate.grade and bhqk.evaluate.tasks: the intervals on known counts, the task prompts (seeded,
exact) and their scoring rules, and on SmolLM2-135M (tests/conftest.py's session fixture) a plan that
streams every head graded below full attention, by the answers and by the KL divergence."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from bhqk.evaluate import grade, tasks
from bhqk.evaluate.grade import MIN_PAIRS, Z95, mcnemar, paired, wilson
from test_cli import run
from tolerance import bound

pytestmark = pytest.mark.protocol  # transformers through bhqk (make test-newest, make test-lowest)

# ---- intervals on known counts -------------------------------------------------------------------


def test_wilson_on_known_counts():
    # the textbook values (Wilson 1927; e.g. Newcombe 1998, Table I): 5/10 -> 0.2366-0.7634, 1/10 -> 0.0179-0.4042
    assert wilson(5, 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    assert wilson(1, 10) == pytest.approx((0.017876, 0.404150), abs=1e-6)
    # the ends in closed form: 0 of n -> [0, z²/(n + z²)], n of n -> [n/(n + z²), 1]
    z2 = Z95**2
    for n in (1, 10, 50, 200):
        assert wilson(0, n) == pytest.approx((0.0, z2 / (n + z2)), abs=1e-12)
        assert wilson(n, n) == pytest.approx((n / (n + z2), 1.0), abs=1e-12)
    # symmetric: k of n mirrors n − k of n
    lo, hi = wilson(13, 40)
    assert wilson(27, 40) == pytest.approx((1 - hi, 1 - lo), abs=1e-12)
    for bad in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="wilson"):
            wilson(*bad)


def test_mcnemar_exact_on_known_counts():
    # two-sided binomial test at 1/2 among the discordant pairs, derived by hand
    assert mcnemar(8, 2) == pytest.approx(2 * (1 + 10 + 45) / 1024, abs=1e-15)
    assert mcnemar(2, 8) == mcnemar(8, 2)
    assert mcnemar(10, 0) == pytest.approx(2 / 1024, abs=1e-15)
    assert mcnemar(5, 0) == pytest.approx(2 / 32, abs=1e-15)  # 5 wins of 5 is not yet significant at 5 %
    assert mcnemar(3, 3) == 1.0 and mcnemar(0, 0) == 1.0


def _pairs(both: int, x_only: int, y_only: int, neither: int) -> tuple[list[bool], list[bool]]:
    x = [True] * both + [True] * x_only + [False] * y_only + [False] * neither
    y = [True] * both + [False] * x_only + [True] * y_only + [False] * neither
    return x, y


def test_paired_difference_on_constructed_pairs():
    # perfectly concordant pairs: the difference is exactly 0 (correlation 1)
    d = paired(*_pairs(10, 0, 0, 10))
    assert (d.diff, d.lo, d.hi, d.p) == (0.0, 0.0, 0.0, 1.0)
    # uncorrelated pairs (a = b = c = d = 5): Newcombe's interval is ±√2 × the Wilson half-width of 10/20
    w = (wilson(10, 20)[1] - wilson(10, 20)[0]) / 2
    d = paired(*_pairs(5, 5, 5, 5))
    assert d.diff == 0 and d.lo == pytest.approx(-math.sqrt(2) * w, abs=1e-12) and d.hi == pytest.approx(math.sqrt(2) * w)
    assert (d.both, d.x_only, d.y_only, d.neither, d.n) == (5, 5, 5, 5, 20)
    # x always right, y always wrong: difference 1, its low end 1 − √2 · z²/(n + z²) (both ends of the Wilson intervals)
    n, z2 = 30, Z95**2
    d = paired([True] * n, [False] * n)
    assert d.diff == 1 and d.hi == 1 and d.lo == pytest.approx(1 - math.sqrt(2) * z2 / (n + z2), abs=1e-12)
    assert d.p == pytest.approx(2 / 2**n)
    # swapping x and y negates the interval
    x, y = _pairs(20, 7, 2, 11)
    a, b = paired(x, y), paired(y, x)
    assert (a.diff, a.lo, a.hi) == pytest.approx((-b.diff, -b.hi, -b.lo), abs=1e-12)
    assert a.lo < a.diff < a.hi and a.p == b.p == mcnemar(7, 2)
    with pytest.raises(ValueError, match="paired"):
        paired([True], [True, False])


def test_too_few_pairs_give_no_interval():
    """Two prompts, one right and one wrong under both configurations: Newcombe's interval collapses to
    [0, 0] (the pairs' correlation is 1), which would read as certainty; below MIN_PAIRS prompts the text
    says the count is too small and the summary gives no interval."""
    d = paired([True, False], [True, False])
    assert (d.diff, d.lo, d.hi) == (0.0, 0.0, 0.0) and not d.enough
    assert str(d).startswith("+0.000 (no interval: 2 prompts are too few, need 10;") and "[" not in str(d)
    assert paired(*_pairs(5, 2, 1, 1)).enough is False and paired(*_pairs(5, 2, 1, 2)).enough is True
    assert MIN_PAIRS == 10 and str(paired(*_pairs(5, 2, 1, 2))).startswith("+0.100 [")
    prompts = [_prompt("needle", 1024, i) for i in range(3)]
    g = grade.Grades(prompts, {"full": [{"correct": True}] * 3, "plan": [{"correct": True}] * 3})
    d = g.summary()["groups"][-1]["difference"]["plan"]
    assert d["diff"] == 0 and d["lo"] is None and d["hi"] is None
    assert "too few" in g.table()


@pytest.mark.parametrize("n,pa,pb,pboth", [(60, 0.9, 0.8, 0.78), (40, 0.95, 0.5, 0.5)])
def test_paired_interval_covers_the_true_difference(n, pa, pb, pboth):
    """On simulated paired results (seeded) the interval covers the true difference about 95 % of the time.
    The pairs are strongly correlated, as two plans on the same prompts are: an interval that ignored
    the correlation (Newcombe's unpaired method) covers 0.99 of the time here and fails the upper bound."""
    rng = random.Random(0)
    hit, draws = 0, 1000
    for _ in range(draws):
        x, y = [], []
        for _ in range(n):
            u = rng.random()
            x.append(u < pa)
            y.append(u < pboth or pa <= u < pa + pb - pboth)
        d = paired(x, y)
        hit += d.lo <= pa - pb <= d.hi
    assert 0.925 <= hit / draws <= 0.975, hit / draws


def test_bootstrap_interval():
    assert grade.bootstrap(torch.full((7,), 2.5), lambda s: s.mean(1)) == pytest.approx((2.5, 2.5))
    # a large sample: the percentile interval of the mean is the normal one, mean ± z·sd/√n, within 10 % of its width
    g = torch.Generator().manual_seed(1)
    v = torch.randn(400, generator=g, dtype=torch.float64) * 3 + 1
    lo, hi = grade.bootstrap(v, lambda s: s.mean(1), draws=4000, seed=0)
    half = Z95 * float(v.std()) / math.sqrt(400)
    assert lo == pytest.approx(float(v.mean()) - half, abs=0.1 * half)
    assert hi == pytest.approx(float(v.mean()) + half, abs=0.1 * half)
    assert grade.bootstrap(v, lambda s: s.mean(1), seed=3) == grade.bootstrap(v, lambda s: s.mean(1), seed=3)


# ---- grades from hand-made replies -----------------------------------------------------------------


def _prompt(task: str, length: int, trial: int, answer=("12345",)) -> tasks.Prompt:
    return tasks.Prompt(task, length, trial, 0, [0] * 4, tuple(answer), (), (), (0,))


def test_grades_count_and_pair_hand_made_entries():
    prompts = [_prompt("needle", L, i) for L in (1024, 2048) for i in range(10)]
    right = {"full": [True] * 20, "half": [True] * 8 + [False] * 2 + [True] * 5 + [False] * 5}
    entries = {name: [{"length": p.length, "correct": r, "prefill_s": 1.0, "decode_s": 0.5, "new_tokens": 6}
                      for p, r in zip(prompts, rs)] for name, rs in right.items()}
    g = grade.Grades(prompts, entries)
    assert g.accuracy("half", "needle", 1024) == (8, 10, *wilson(8, 10))
    assert g.accuracy("half", "needle") == (13, 20, *wilson(13, 20))
    assert g.difference("half", "full") == paired(right["half"], right["full"])
    s = g.summary()
    last = s["groups"][-1]
    assert (last["task"], last["length"]) == ("needle", None)
    assert last["difference"]["half"]["only_reference"] == 7 and last["difference"]["half"]["only_this"] == 0
    table = g.table()
    assert f"13/20 = 0.65 [{wilson(13, 20)[0]:.2f}, {wilson(13, 20)[1]:.2f}]" in table
    assert "difference from full" in table and "-0.350" in table
    assert g.cost()[1024] == {"prefill_s": 1.0, "decode_s": 0.5, "new_tokens": 6, "replies": 20}


# ---- the tasks: scoring rules --------------------------------------------------------------------


def test_scoring_rules_on_hand_made_replies():
    ok = tasks.correct
    assert ok("needle", "The pass key is 48213.", ["48213"]) and not ok("needle", "148213", ["48213"])
    # multikey: the asked number, and no other key's number
    assert ok("multikey", " 48213.", ["48213"], ["11111", "22222"])
    assert not ok("multikey", " 11111.", ["48213"], ["11111", "22222"])
    assert not ok("multikey", " 48213 or 22222", ["48213"], ["11111", "22222"])
    assert ok("multikey", " 48213, found in section 3.2", ["48213"], ["11111"])  # other numbers are not distractors
    # multivalue: every value, in any order and form
    assert ok("multivalue", ":\n1. 33333\n2. 11111\n3. 22222", ["11111", "22222", "33333"])
    assert not ok("multivalue", ": 11111 and 22222", ["11111", "22222", "33333"])
    # vartrack: exactly the asked chain's names (a set), other words ignored, the other chain's names refused
    chain, other = ["QPFCE", "HJKLA"], ["ZZTOP", "MNBVC"]
    assert ok("vartrack", " HJKLA, QPFCE.", chain, other) and ok("vartrack", " QPFCE and HJKLA (see ABCDE)", chain, other)
    assert not ok("vartrack", " QPFCE.", chain, other) and not ok("vartrack", " QPFCE, HJKLA, ZZTOP", chain, other)
    with pytest.raises(ValueError, match="task must be one of"):
        ok("sum", "1", ["1"])


# ---- the tasks: prompts (the tokenizer of SmolLM2) ------------------------------------------------------


def test_task_prompts_are_seeded_and_exact(smollm2):
    _, tok = smollm2
    for task in tasks.TASKS:
        a = tasks.make_set(tok, [task], [512, 700], trials=2, seed=5)
        b = tasks.make_set(tok, [task], [512, 700], trials=2, seed=5)
        c = tasks.make_set(tok, [task], [512, 700], trials=2, seed=6)
        assert [(p.ids, p.answer, p.distractors) for p in a] == [(p.ids, p.answer, p.distractors) for p in b]
        assert all(p.answer != q.answer and p.ids != q.ids for p, q in zip(a, c)), task  # another seed, other prompts
        assert tasks.make(tok, task, 700, 1, 5).ids == a[3].ids  # a prompt does not depend on the others made with it
        for p in a:
            spec = tasks.SPECS[task]
            assert len(p.ids) == p.length and p.max_new_tokens == spec.max_new_tokens + spec.per_item * len(p.answer)
            assert len(p.at) == len(p.inserted) and list(p.at) == sorted(p.at)
            for at, sentence in zip(p.at, p.inserted):  # each inserted sentence starts where it says
                assert tok.decode(p.ids[at : at + 40]).strip().startswith(sentence), (task, sentence)
            text = tok.decode(p.ids)
            assert all(x in text for x in p.answer + p.distractors)
            assert text.endswith(p.prefix) and (p.prefix == "") == (task == "needle")
            nums = [x for s in p.inserted for x in set(tasks.numbers(s))]
            assert len(set(nums)) == len(nums)  # values are distinct within a prompt
    p = tasks.make(tok, "vartrack", 700, 0, 5, hops=3, chains=2)
    for chain in (p.answer, p.distractors):  # each chain's assignments keep their order
        first = [next(i for i, s in enumerate(p.inserted) if s.startswith(f"VAR {v} =")) for v in chain]
        assert first == sorted(first) and p.inserted[first[0]].split("= ")[1][:-1].isdigit()
    with pytest.raises(ValueError, match="too short"):
        tasks.make(tok, "multikey", 80)
    with pytest.raises(ValueError, match="depth"):
        tasks.make(tok, "needle", 512, depth=(0.5, 0.2))
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.make(tok, "sum", 512)


# ---- on SmolLM2 --------------------------------------------------------------------------------------


def test_reply_is_generates_greedy_answer(smollm2):
    """``reply``'s own greedy loop (prefill, then one token per step, up to end of turn) gives
    ``model.generate``'s greedy tokens."""
    model, tok = smollm2
    p = tasks.make(tok, "multikey", 200, 0, 0)
    p.max_new_tokens = 6
    e = grade.reply(model, tok, p)
    with torch.no_grad():
        out = model.generate(torch.tensor([p.ids]), max_new_tokens=6, do_sample=False, pad_token_id=2)[0, 200:]
    assert e["reply"] == tok.decode(out, skip_special_tokens=True).strip()
    assert e["new_tokens"] == len([t for t in out.tolist() if t != model.generation_config.eos_token_id])
    assert e["correct"] == p.score(e["reply"]) and e["prefill_s"] > 0


@pytest.fixture
def cli_model(smollm2, serve):
    """The command loads the session's model instead of a second copy."""
    serve(smollm2)


def test_streaming_every_head_grades_below_full_attention(cli_model, smollm2, tmp_path):
    """``bhqk grade --compare full PLAN.json``: a plan that streams every K/V head with a sink of 4 and
    a window of 16 cannot reach a needle of a 320-token prompt (depth 0.1 … 0.9), so it finds none where
    full attention finds them; its KL divergence from full attention on 256 tokens is positive."""
    from bhqk.budget import Plan

    cfg = smollm2[0].config
    plan = tmp_path / "stream.json"
    Plan(torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, dtype=torch.bool), 4, 16).save(plan)
    code, out, err = run(["grade", "--compare", "full", str(plan), "--task", "needle", "--lengths", "320", "--trials", "2",
                          "--kl-lengths", "256", "--chunks", "1", "--out", str(tmp_path)])
    assert code == 0, err
    data = json.loads((tmp_path / "grade.json").read_text())
    s = data["tasks"]["summary"]
    assert s["reference"] == "full" and data["configs"] == ["full", str(plan)]
    whole = s["groups"][-1]
    got = whole["accuracy"]
    assert got["full"]["correct"] == 2 and got[str(plan)]["correct"] == 0, data["tasks"]["entries"]
    d = whole["difference"][str(plan)]
    assert d["diff"] == -1 and d["only_reference"] == 2 and d["hi"] is None  # 2 prompts: too few for an interval
    kl = data["divergence"][0]
    assert kl["start"] == 4 + 16 + 1 and kl["summary"]["full"]["kl"] == 0 and kl["summary"][str(plan)]["kl"] > 0.1
    assert kl["summary"][str(plan)]["ppl_ratio"] > 1
    assert "2/2 = 1.00 [" in out and "0/2 = 0.00 [" in out and "difference from full" in out and "KL" in out
    assert "-1.000 (no interval: 2 prompts are too few" in out


def test_named_configurations(smollm2, tmp_path):
    from bhqk.budget import Plan
    from bhqk.cli import named_plans

    model = smollm2[0]
    Plan(torch.ones(30, 3, dtype=torch.bool), 8, 32).save(tmp_path / "p.json")
    got = named_plans(["full", "streaming", str(tmp_path / "p.json")], model, sink=2, window=5)
    assert list(got) == ["full", "streaming", str(tmp_path / "p.json")] and got["full"] is None
    s = got["streaming"]
    assert not s.full.any() and s.full.shape == (30, 3) and (s.sink, s.window) == (2, 5)
    assert got[str(tmp_path / "p.json")].full.all() and got[str(tmp_path / "p.json")].window == 32
    with pytest.raises(ValueError, match="twice"):
        named_plans(["full", "full"], model, 2, 5)


def test_kl_of_a_plan_that_keeps_everything_is_zero(smollm2):
    """Through the budget cache an all-full plan computes the model's own distribution (KL within
    rounding of two float32 paths), an all-streaming one does not; each chunk is its own sample."""
    from bhqk.budget import Plan

    model, tok = smollm2
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    plans = {"model": None, "all full": Plan(torch.ones(L, Hkv, dtype=torch.bool), 4, 16),
             "all streaming": Plan(torch.zeros(L, Hkv, dtype=torch.bool), 4, 16)}
    d = grade.divergence(model, tok, plans, length=192, chunks=2, progress=False)
    assert d.start == 21 and len(d.kl["all full"]) == 2
    assert d.kl["model"] == [0.0, 0.0] and d.nll["model"] == d.reference_nll
    # KL ≤ ½·max|Δ log p|² summed where p lives: Δ within the bound of two float32 paths of the model's width and depth
    delta = bound(torch.float32, n=model.config.intermediate_size * L**2, magnitude=30.0, factor=16.0)
    assert max(d.kl["all full"]) <= 2 * delta**2 + 1e-9, d.kl
    assert min(d.kl["all streaming"]) > 0.05, d.kl
    s = d.summary()
    assert s["all streaming"]["ppl_ratio"] > 1 and s["all full"]["ppl_ratio"] == pytest.approx(1, abs=1e-4)
    assert s["all streaming"]["kl_ci"][0] <= s["all streaming"]["kl"] <= s["all streaming"]["kl_ci"][1]
    with pytest.raises(ValueError, match="100 sequences of 8192 tokens need"):
        grade.text_chunks(tok, 8192, 100)


def test_kl_reads_a_quantized_plan_as_decoding_does(smollm2):
    """A plan with bits is read in pieces (``grade.PIECE`` tokens a call): in one call its queries would see
    only floats (what a call writes is quantized after it) and its KL would be 0. Read in pieces, a float
    plan with streaming heads gives the one call's hidden states (the cache across calls is exact); a 4-bit
    plan gives them exactly where no older position is an integer yet, and differs after."""
    from dataclasses import replace

    from bhqk.budget import Plan
    from bhqk.budget.quant import RESIDUAL

    model, tok = smollm2
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    ids = grade.text_chunks(tok, 192, 1)  # [1, 192]
    full = torch.zeros(L, Hkv, dtype=torch.bool)
    full[::2] = True  # every other layer full, the rest streaming
    mixed = Plan(full, 4, 16)
    tol = bound(torch.float32, n=model.config.intermediate_size * L**2, magnitude=30.0, factor=16.0)
    with torch.no_grad():
        once = grade._hidden(model, ids, mixed)  # [192, D]
        pieces = grade._hidden(model, ids, mixed, step=grade.PIECE)
        quant = grade._hidden(model, ids, replace(mixed, bits=4))  # in pieces by default
        quant_once = grade._hidden(model, ids, replace(mixed, bits=4), step=192)
    scale = once.abs().max()
    assert (pieces - once).abs().max() <= tol * scale
    assert (quant_once - once).abs().max() <= tol * scale  # one call: the integers are never read
    first = RESIDUAL + grade.PIECE  # the first call that finds positions older than the float window
    early = (quant[:first] - once[:first]).abs().max()  # rounding of other call sizes only
    later = (quant[first:] - once[first:]).abs().amax(-1)  # [192 − first] every later row reads integers
    assert early <= tol * scale and later.min() > 100 * early and later.min() > 0
    d = grade.divergence(model, tok, {"bits4": replace(mixed, bits=4), "floats": mixed}, length=192, chunks=1,
                         progress=False)
    assert d.kl["bits4"][0] > d.kl["floats"][0] > 0


def test_cli_grade_options_are_checked(tmp_path):
    for argv, msg in [(["--task", "sum"], "expected tasks among"),
                      (["--compare", "full", "--depths", "0.5"], "unrecognized arguments: --depths"),
                      (["--compare", "full", "--plan", str(tmp_path / "p.json")], "not both"),
                      (["--compare", "full", str(tmp_path / "missing.json")], "missing.json")]:
        code, out, err = run(["grade", *argv, "--out", str(tmp_path)])
        assert code == 2 and msg in err and "Traceback" not in err and err.startswith("bhqk grade: error:"), err
