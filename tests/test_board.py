"""bhqk.evaluate.board, the KV-compression table: the compression ratio of known configurations computed
by hand, ``fit`` taking the most full heads within the bytes (and the cache really holding what is
counted, floats and integers), ``Plan.top`` as find cuts, ``Plan.bits`` kept and refused, and on
SmolLM2-135M a board that grades, stores every reply, resumes without answering again and refuses a
file of other settings; ``bhqk grade --ratio``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bhqk.budget import Plan
from bhqk.budget.plan import model_map
from bhqk.errors import LoadError
from bhqk.evaluate import board, grade
from test_budget_layers import _inputs, _model
from test_cli import run

pytestmark = pytest.mark.protocol  # transformers through bhqk


def _scored(model, sink=3, window=5, seed=0) -> Plan:
    """A plan with random scores (ties included) over the model's K/V heads, no head full."""
    shape = model_map(model).shape
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (shape.layers, shape.kv_heads), generator=g).double()  # ties on purpose
    return Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), sink, window, scores=scores, model=shape)


def test_the_ratio_of_known_configurations_by_hand():
    """A tiny Llama-like model (2 layers × 2 K/V heads, d = 16, fp32) after n = 100 tokens: its own cache
    holds 2·2·100 positions × (K + V) × 16 × 4 bytes; every head full at 4 bits in groups of 16 with a float
    window of 64 holds 36 positions of (8 bytes of nibbles + 2 fp16 scales and zeros) and 64 of floats; one
    full head and three streaming heads of sink 3 + window 5 hold 100 + 3·8 positions."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, head_dim=16)
    model = transformers.LlamaForCausalLM(cfg).eval()
    n, per = 100, 2 * 16 * 4  # K + V of one position of one head, fp32
    own = 4 * n * per
    assert board.own_nbytes(model, n) == own
    assert board.ratio(None, model, n) == 0
    allq = Plan(torch.ones(2, 2, dtype=torch.bool), bits=4)
    qpos = 2 * (16 * 4 // 8 + 2 * 2 * 1)  # K + V: 8 bytes of nibbles, one fp16 scale and zero per group of 16
    held = 4 * (36 * qpos + 64 * per)
    assert board.held(allq, model, n) == held and board.ratio(allq, model, n) == pytest.approx(1 - held / own, abs=1e-15)
    one = Plan(torch.tensor([[True, False], [False, False]]), sink=3, window=5)
    assert board.ratio(one, model, n) == pytest.approx(1 - (n + 3 * 8) / (4 * n), abs=1e-15)
    assert board.ratio(Plan(torch.ones(2, 2, dtype=torch.bool), bits=8), model, 64) == 0  # all in the float window


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
@torch.no_grad()
def test_fit_takes_the_most_full_heads_within_the_bytes_and_the_cache_holds_them(name, bits):
    """For every reachable ratio: the fitted plan holds at most (1 − ratio) of the model's own bytes, one
    more full head would hold more, its heads are the top of the scores; the cache a forward of n tokens
    fills holds exactly the bytes counted; a ratio below every head streaming is None."""
    model = _llama() if name == "llama" else _model("gemma3")
    scored = _scored(model)
    shape = model_map(model).shape
    n = 24
    own = board.own_nbytes(model, n)
    reached = 0
    for target in (0.0, 0.2, 0.4, 0.5, 0.6, 0.75, 0.9):
        p = board.fit(Plan(**{**scored.__dict__, "bits": bits}), model, n, target)
        if p is None:
            assert all(scored.top(k).nbytes(n, model, bits=bits)[0] > (1 - target) * own
                       for k in range(int((~scored.free(shape)).sum()) + 1))
            continue
        reached += 1
        k = int((p.full & ~p.free(shape)).sum())
        assert p.nbytes(n, model)[0] <= (1 - target) * own and p.bits == bits
        for more in range(k + 1, int((~p.free(shape)).sum()) + 1):  # every larger count holds more
            assert p.top(more).nbytes(n, model)[0] > (1 - target) * own, (target, k, more)
        assert torch.equal(p.full, scored.top(k).full)
        ids, am = _inputs(B=1, N=n)
        cache = p.cache(model)
        model(input_ids=ids, attention_mask=am, cache=cache)
        assert cache.nbytes() == board.held(p, model, n), (target, k)
    assert reached >= 3
    with pytest.raises(ValueError, match="ratio must be in"):
        board.fit(scored, model, n, 1.0)


def _llama():
    import transformers

    from test_budget_layers import COMMON

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **COMMON)).eval()


def test_plan_top_cuts_as_find_does_and_keeps_free_heads():
    """The best n heads by scores, ties by tie_scores, then the lower index; heads whose layer's own
    window fits the streaming window stay full outside n; n beyond the heads that matter is refused."""
    full = torch.zeros(2, 3, dtype=torch.bool)
    s = torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 1.0]])
    tie = torch.tensor([[0.0, 0.5, 0.1], [0.1, 0.0, 0.0]])
    p = Plan(full, 2, 4, scores=s)
    assert p.top(2).full.tolist() == [[False, True, True], [False, False, False]]  # index breaks the tie of three 2s
    q = Plan(full, 2, 4, scores=s, tie_scores=tie)
    assert q.top(2).full.tolist() == [[False, True, True], [False, False, False]]
    assert q.top(1).full.tolist() == [[False, True, False], [False, False, False]]  # tie score 0.5 first
    assert q.top(3).full.tolist() == [[False, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="n=7 but only 6"):
        p.top(7)
    with pytest.raises(ValueError, match="no scores"):
        Plan(full).top(1)
    gemma = _model("gemma3")  # sliding layers of window 7: free under window 6 (sees 7 keys)
    shape = model_map(gemma).shape
    g = Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), 1, 6,
             scores=torch.arange(shape.layers * shape.kv_heads).double().reshape(shape.layers, shape.kv_heads), model=shape)
    assert g.top(0).full.tolist() == [[True, True], [True, True], [False, False]]
    assert g.top(1).full.tolist() == [[True, True], [True, True], [False, True]]
    with pytest.raises(ValueError, match="n=3 but only 2"):
        g.top(3)


def test_plan_bits_is_kept_used_and_refused(tmp_path):
    """``Plan(bits=4)``: saved and loaded, in the summary, the default of ``cache`` and ``nbytes``;
    bits other than 8 and 4 refused, in the constructor and in a file."""
    model = _llama()
    shape = model_map(model).shape
    p = Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), bits=4, model=shape)
    assert "4-bit integers" in p.summary()
    back = Plan.load(p.save(tmp_path / "p.json"))
    assert back.bits == 4 and torch.equal(back.full, p.full)
    assert p.nbytes(100, model) == p.nbytes(100, model, bits=4) != Plan(p.full).nbytes(100, model)
    assert p.cache(model).budget_layers[0].bits == 4 and p.cache(model, bits=8).budget_layers[0].bits == 8
    for bad in (3, 16, True, "4"):
        with pytest.raises(ValueError, match="bits must be one of 8, 4"):
            Plan(p.full, bits=bad)
    d = p.to_dict() | {"bits": 2}
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(LoadError, match='"bits" must be 8, 4 or null'):
        Plan.load(tmp_path / "bad.json")


def test_method_names_are_parsed_or_refused():
    assert board.parse("full") == board.Method("full", None, None)
    assert board.parse("bits4") == board.Method("bits4", None, 4)
    assert board.parse("fisher+bits8") == board.Method("fisher+bits8", "fisher", 8)
    assert board.parse("best").score == "best" and board.parse("streaming").fixed
    for bad, msg in (("bits3", "bits8 or bits4"), ("fisher+bits2", "takes 8 or 4"), ("best+bits4", "chooses its own"),
                     ("nonsense", "expected full, bits8")):
        with pytest.raises(ValueError, match=msg):
            board.parse(bad)


def test_a_board_grades_stores_every_reply_and_resumes(smollm2, tmp_path, monkeypatch):
    """Full attention, every head quantized, and a retrieval plan at ratio 0.5 on a prompt of 288 tokens:
    each cell's replies are what ``grade.reply`` gives for its cache; a board opened again on the file
    answers nothing again; other settings on that file are refused; a cell that cannot reach a ratio says
    why; the table has every cell."""
    model, tok = smollm2
    path = tmp_path / "board.json"
    calls = []
    real = grade.reply
    monkeypatch.setattr(grade, "reply", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    b = board.Board(model, tok, length=288, tasks=["needle"], trials=1, scores=["retrieval"], path=path,
                    log=lambda s: None)
    b.run(["full", "bits4", "streaming", "retrieval"], ratios=(0.5,))
    data = json.loads(path.read_text())
    assert set(data["cells"]) == {"full@0", "bits4@0.5", "streaming@0.5", "retrieval@0.5"}
    assert len(calls) == 3  # streaming (sink 64 + window 256 of 288) cannot reach 0.5: not graded
    st = data["cells"]["streaming@0.5"]
    assert not st["reached"] and "ratio" in st["why"] and st["entries"] == []
    q = data["cells"]["bits4@0.5"]
    assert q["reached"] and q["ratio_reached"] == pytest.approx(board.ratio(Plan.from_dict(q["plan"]), model, 288))
    assert q["ratio_reached"] >= 0.5 and Plan.from_dict(q["plan"]).bits == 4
    r = Plan.from_dict(data["cells"]["retrieval@0.5"]["plan"])
    assert (r.sink, r.window) == (16, 64) and q["held"] > 0  # the board's 64 + 256 cannot reach 0.5 at 288 tokens
    assert 1 - r.nbytes(288, model)[0] / data["own_bytes"] >= 0.5
    for c in ("full@0", "bits4@0.5", "retrieval@0.5"):
        assert len(data["cells"][c]["entries"]) == 1
    assert [e["correct"] for e in data["cells"]["full@0"]["entries"]] == [
        p.score(e["reply"]) for p, e in zip(b.prompts, data["cells"]["full@0"]["entries"])]
    calls.clear()
    b.run(["retrieval+bits4"], ratios=(0.25,))  # keeps every head at 4 bits: bits4's cache, its replies
    twin = b.data["cells"]["retrieval+bits4@0.25"]
    assert calls == [] and twin["same_as"] == "bits4@0.5" and twin["entries"] == q["entries"]
    cands = b.candidates(0.5)  # best's: each cache once (every head full at 4 bits under one name)
    assert len({board.same_cache(c) for c in cands.values()}) == len(cands)
    assert sum(bool(c.full.all()) and c.bits == 4 for c in cands.values()) == 1
    assert board.same_cache(replace(r, sink=4, window=8)) != board.same_cache(r)
    del b.data["cells"]["retrieval+bits4@0.25"]
    b._save()
    again = board.Board(model, tok, length=288, tasks=["needle"], trials=1, scores=["retrieval"], path=path,
                        log=lambda s: None)
    again.run(["full", "bits4", "streaming", "retrieval"], ratios=(0.5,))
    assert calls == [] and json.loads(path.read_text())["cells"] == data["cells"]
    t = again.table()
    assert "full attention: 1/1 [" in t and "cannot reach" in t and "| retrieval |" in t and "ratio 0.5" in t
    with pytest.raises(ValueError, match="other trials"):
        board.Board(model, tok, length=288, tasks=["needle"], trials=2, scores=["retrieval"], path=path)
    with pytest.raises(ValueError, match="scores are among"):
        board.Board(model, tok, length=288, scores=["nope"])


def test_cli_grade_ratio_prints_the_table_and_resumes(cli_model, tmp_path):
    argv = ["grade", "--ratio", "0.5", "--methods", "full", "bits8", "--lengths", "288", "--trials", "1",
            "--task", "needle", "--out", str(tmp_path)]
    code, out, err = run(argv)
    assert code == 0, err
    assert "| bits8 |" in out and "1/1 [" in out and "board.json" in out
    data = json.loads((tmp_path / "board.json").read_text())
    assert data["cells"]["bits8@0.5"]["ratio_reached"] >= 0.5 and len(data["cells"]["bits8@0.5"]["entries"]) == 1
    code, out2, err = run(argv)  # resumes: nothing new, the same table
    assert code == 0 and out2 == out, err
    for bad, msg in ((["--methods", "bits3"], "bits8 or bits4"), (["--lengths", "256,512"], "one prompt length"),
                     (["--scores", "fisher,nope"], "scores are among"),
                     (["--compare", "full"], "not part of the table")):
        code, out, err = run(["grade", "--ratio", "0.5", *bad, "--out", str(tmp_path / "x")])
        assert code == 2 and msg in err and "Traceback" not in err, err
    code, out, err = run(["grade", "--methods", "full", "--out", str(tmp_path / "y")])
    assert code == 2 and "give --ratio" in err, err


def test_the_table_of_stored_cells_says_what_failed_and_what_cannot_reach():
    """``board.table`` of a stored board: accuracies with intervals and the paired difference, a method that
    did not run ("fails") told apart from one whose cache cannot reach the ratio, a cell still running."""
    e = [{"correct": c} for c in (True, True, False, True)]
    data = {"prompts": [{}] * 4, "tasks": ["needle"], "length": 64, "seed": 0, "best": {}, "cells": {
        "full@0": {"method": "full", "ratio": 0.0, "reached": True, "entries": e, "held": 8, "ratio_reached": 0.0},
        "x@0.5": {"method": "x", "ratio": 0.5, "reached": True, "entries": e[:2] + [{"correct": False}] * 2,
                  "held": 4, "ratio_reached": 0.5},
        "x@0.75": {"method": "x", "ratio": 0.75, "reached": False, "why": "holds 0.300 of the bytes", "entries": []},
        "kvpress:duo@0.5": {"method": "kvpress:duo", "ratio": 0.5, "reached": False, "failed": True,
                            "why": "ConnectionError: no Hub", "entries": []},
        "kvpress:duo@0.75": {"method": "kvpress:duo", "ratio": 0.75, "reached": True, "entries": e[:1], "held": 2,
                             "ratio_reached": 0.75}}}
    t = board.table(data)
    lo, hi = grade.wilson(2, 4)
    assert f"| x | 2/4 [{lo:.2f}, {hi:.2f}] at 0.500; -0.25 [" in t
    assert "cannot reach: holds 0.300 of the bytes" in t and "fails: ConnectionError: no Hub" in t
    assert "cannot reach: ConnectionError" not in t and "running (1/4)" in t and "full attention: 3/4" in t
