"""Head-wise KV budgets (bhqk.budget): plans, their errors and files; the budget cache holds exactly
what each K/V head can still see, and generation with it equals generation with an ordinary cache
and the streaming heads restricted by ``bhqk.edit(mask=...)`` (tiny random models, fp32, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from bhqk import masks
from bhqk.budget import BudgetCache, GroupedKV, Plan, find, streaming_mask
from bhqk.budget.find import rank, score_keys
from bhqk.errors import BackendError, LoadError, ShapeError
from bhqk.integrations.transformers import register
from tolerance import assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
V = 100
S, W = 3, 5  # small sink and window: a 20-token prompt and 10 new tokens go well past them


def _llama(H=8, Hkv=2, layers=2):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=H,
        num_key_value_heads=Hkv, max_position_embeddings=256, attn_implementation="bhqk")).eval()


def _mistral():  # every layer a sliding window of 7 keys (the model's own), wider than W and narrower than S + W
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=7, max_position_embeddings=256, attn_implementation="bhqk")).eval()


def _qwen2():  # one full layer, one sliding layer
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=7, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"], max_position_embeddings=256,
        attn_implementation="bhqk")).eval()


MODELS = {"mha": lambda: _llama(4, 4), "gqa": _llama, "mistral-window": _mistral, "qwen2-mixed": _qwen2}


def _inputs(B=2, N=20, pad=4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, N), generator=g)
    am = torch.ones_like(ids)
    if B > 1:
        ids[1, :pad], am[1, :pad] = 0, 0  # left padding
    return ids, am


def _generate(model, ids, am, n=10, **kw):
    out = model.generate(ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits)  # [B, N + n], [n, B, V]


def _mixed(model) -> Plan:
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    full = torch.zeros(L, Hkv, dtype=torch.bool)
    full[0, 0] = full[-1, -1] = True  # a full head in some layers, every layer some streaming
    return Plan(full, sink=S, window=W)


# ---- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, kind", [("mha", "streaming"), ("gqa", "mixed"), ("mistral-window", "mixed"),
                                        ("qwen2-mixed", "mixed")])
def test_generation_with_the_budget_cache_equals_the_edited_model(name, kind):
    model = MODELS[name]()
    ids, am = _inputs()
    plan = _mixed(model)
    if kind == "streaming":  # StreamingLLM: every head sink + window
        plan = Plan(torch.zeros_like(plan.full), sink=S, window=W)
    seq, logits = _generate(model, ids, am, cache=plan.cache(model))
    with plan.emulate(model):  # a cache whose key index is the position (a sliding-window layer re-indexes)
        ref_seq, ref = _generate(model, ids, am, cache=transformers.DynamicCache())
    assert_models_close(logits, ref, width=96, layers=2, msg=f"{name}, {kind}: budget cache vs edit(mask=...)")
    assert torch.equal(seq, ref_seq)
    if kind == "streaming":
        _, plain = _generate(model, ids, am)
        assert (plain - ref).abs().max() > 1e-3, "the streaming mask must change something (else the test proves nothing)"


def test_an_all_full_plan_is_the_models_own_generation():
    model = _llama()
    ids, am = _inputs()
    plan = Plan(torch.ones(2, 2, dtype=torch.bool), sink=S, window=W)
    seq, logits = _generate(model, ids, am, cache=plan.cache(model))
    ref_seq, ref = _generate(model, ids, am)
    assert torch.equal(logits, ref) and torch.equal(seq, ref_seq)


def test_a_second_prefill_after_eviction_reads_the_kept_keys():
    """Q > 1 new tokens after the streaming heads evicted keys (chunked prefill): the model's mask is
    taken at the positions held."""
    model = _llama()
    ids, am = _inputs(N=30)
    plan = _mixed(model)
    cache = plan.cache(model)
    with torch.no_grad():
        model(input_ids=ids[:, :14], attention_mask=am[:, :14], cache=cache)
        out = model(input_ids=ids[:, 14:], attention_mask=am, cache=cache).logits  # [B, 16, V]
        with plan.emulate(model):
            ref = model(input_ids=ids, attention_mask=am).logits[:, 14:]  # [B, 16, V]
    assert_models_close(out, ref, width=96, layers=2)
    assert cache.positions(0, 1).tolist() == [0, 1, 2, 25, 26, 27, 28, 29]


# ---- what the cache holds ---------------------------------------------------------------------------


def test_the_cache_holds_the_sink_and_the_window_of_streaming_heads_and_everything_of_full_heads():
    model = _llama()
    ids, am = _inputs(N=6)
    plan = _mixed(model)
    cache = plan.cache(model)
    _generate(model, ids, am, n=1, cache=cache)  # prefill of 6 < S + W: nothing evicted yet
    assert cache.positions(0, 1).tolist() == list(range(6))
    cache = plan.cache(model)
    seq, _ = _generate(model, ids, am, n=20, cache=cache)
    written = 6 + 20 - 1  # the last token is generated, not written
    assert cache.get_seq_length() == written
    assert cache.positions(0, 0).tolist() == list(range(written))  # full
    assert cache.positions(0, 1).tolist() == [0, 1, 2] + list(range(written - W, written))  # streaming
    # the keys held are the keys written at those positions (rotary as applied then)
    with torch.no_grad():
        ref = transformers.DynamicCache()
        full_am = torch.cat([am, torch.ones(2, written - 6, dtype=am.dtype)], 1)  # [B, written]
        pos = (full_am.cumsum(-1) - 1).masked_fill(full_am == 0, 1)  # generate's positions under left padding
        model(input_ids=seq[:, :written], attention_mask=full_am, position_ids=pos, cache=ref)
    layer, real = cache.layers[0], full_am.bool()  # [B, written]: keys at padding positions are never read
    kept = cache.positions(0, 1)
    held, want = layer.sk, ref.layers[0].keys[:, [1]][:, :, kept]  # [B, 1, S + W, d]
    torch.testing.assert_close(held[real[:, kept][:, None]], want[real[:, kept][:, None]])
    torch.testing.assert_close(layer.fk[real[:, None]], ref.layers[0].keys[:, [0]][real[:, None]])
    B, d = 2, 8
    per = 2 * d * 4 * B  # key + value, float32, both rows of the batch
    full_heads, stream_heads = 2, 2
    assert cache.nbytes() == per * (full_heads * written + stream_heads * (S + W))
    held, full = plan.nbytes(written, model, batch=B)
    assert held == cache.nbytes() and full == per * 4 * written
    for lay in cache.layers:  # what nbytes counts is all they keep alive: no view into the model's [B, Hkv, N, d]
        for t in (lay.fk, lay.fv, lay.sk, lay.sv):
            assert t is None or t.untyped_storage().nbytes() == t.numel() * t.element_size()
    cache = plan.cache(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=am, cache=cache)  # a prefill of 6 < S + W: the streaming heads keep all
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
               for lay in cache.layers for t in (lay.fk, lay.fv, lay.sk, lay.sv) if t is not None)


def test_grouped_keys_refuse_any_other_attention_implementation():
    model = _llama()
    ids, am = _inputs()
    plan = _mixed(model)
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with pytest.raises(BackendError, match="attn_implementation=\"bhqk\""):
            _generate(model, ids, am, n=2, cache=plan.cache(model))
    model.set_attn_implementation("bhqk")
    k = plan.cache(model).layers[0].update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))[0]
    assert isinstance(k, GroupedKV) and k.shape == (1, 2, 3, 8)
    with pytest.raises(BackendError):
        k + 1


# ---- plans ----------------------------------------------------------------------------------------


def test_plan_errors_name_layers_and_kv_heads():
    model = _llama()
    with pytest.raises(ShapeError, match=r"layers=3, Hkv=2\].*\[layers=2, H=8, Hkv=2, d=8"):
        Plan(torch.ones(3, 2, dtype=torch.bool)).check(model)
    with pytest.raises(ShapeError, match="Hkv=4"):
        Plan(torch.ones(2, 4, dtype=torch.bool)).cache(model)
    with pytest.raises(ShapeError, match="bool tensor"):
        Plan(torch.ones(2, 2))
    with pytest.raises(ShapeError, match=r"\[layers, Hkv\]"):
        Plan(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sink"):
        Plan(torch.ones(2, 2, dtype=torch.bool), sink=-1)
    ids, am = _inputs()
    with pytest.raises(ShapeError, match="Hkv=4"):  # a cache made without the model: refused at the first write
        _generate(model, ids, am, n=1, cache=Plan(torch.zeros(2, 4, dtype=torch.bool)).cache())
    with pytest.raises(ShapeError, match="layer 1 .*layers=1"):
        _generate(model, ids, am, n=1, cache=Plan(torch.zeros(1, 2, dtype=torch.bool)).cache())


def test_plan_prints_renders_saves_and_loads(tmp_path):
    scores = torch.tensor([[0.9, 0.1], [0.2, float("nan")]], dtype=torch.float64)
    plan = Plan(torch.tensor([[True, False], [False, True]]), sink=4, window=16, scores=scores, score="induction",
                layers=["a.0", "a.1"])
    text = str(plan)
    assert "2 of 4 K/V heads full" in text and "sink=4 + window=16" in text
    assert "| 0     | a.0  | 0       | 0.9       | full      | induction  |" in text
    assert "| 1     | a.1  | 1       | -         | full      | -          |" in text
    assert plan._repr_html_().count("<td") == 4
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert torch.equal(back.full, plan.full)
    assert (back.sink, back.window, back.score, back.layers) == (4, 16, "induction", ["a.0", "a.1"])
    assert torch.equal(back.scores.nan_to_num(-1.0), scores.double().nan_to_num(-1.0))  # exact, NaN kept
    tied = Plan(plan.full, scores=scores, score="retrieval", tie_scores=scores * 2, tie_score="copy mass")
    back = Plan.load(tied.save(tmp_path / "tied.json"))
    assert back.tie_score == "copy mass" and back.decided() == tied.decided()
    assert torch.equal(back.tie_scores.nan_to_num(-1.0), (scores * 2).double().nan_to_num(-1.0))
    assert "| copy mass |" in str(back) and "decided by" in str(back)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(LoadError, match="not a bhqk budget plan"):
        Plan.load(tmp_path / "bad.json")
    (tmp_path / "worse.json").write_text('{"format": "bhqk.budget.Plan/1", "full": [[1, 0]]}')
    with pytest.raises(LoadError, match="malformed"):
        Plan.load(tmp_path / "worse.json")


def test_scores_orders_of_magnitude_apart_print_apart():
    """Fisher scores span orders of magnitude: the table, its cells' titles and the tie column print
    significant digits, so 1e-5, 2e-5 and 0.3 do not all read 0.000 (issue 40, item 9)."""
    scores = torch.tensor([[0.3, 2e-5, 1e-5]], dtype=torch.float64)
    plan = Plan(torch.tensor([[True, False, False]]), scores=scores, score="fisher", tie_scores=scores / 7,
                tie_score="copy mass")
    cells = [row[3:5] for row in plan.rows()]
    assert cells == [["0.3", "0.04286"], ["2e-05", "2.857e-06"], ["1e-05", "1.429e-06"]]
    assert "| 2e-05  |" in str(plan) and "| 1e-05  |" in str(plan) and "0.000" not in str(plan)
    html = plan._repr_html_()
    assert "score 2e-05, copy mass 2.857e-06" in html and "score 1e-05" in html and "0.000" not in html


def _plan_file(tmp_path, name="plan.json", **edit):
    """A saved plan (made for a model of 2 sliding layers, window 8, and 1 full one) with ``edit``'s
    fields replaced (``...`` removes one), as a user who edits the file by hand leaves it."""
    from bhqk.budget.plan import ModelShape

    shape = ModelShape(3, 4, 2, 8, ("sliding_attention", "sliding_attention", "full_attention"), (8, 8, None),
                       "tiny", "gemma3")
    plan = Plan(torch.tensor([[True, False], [False, False], [True, True]]), sink=4, window=16,
                scores=torch.tensor([[0.5, 0.1], [0.2, float("nan")], [0.9, 0.8]]), score="fisher",
                layers=["l.0", "l.1", "l.2"], model=shape)
    d = plan.to_dict()
    for k, v in edit.items():
        if v is ...:
            del d[k]
        else:
            d[k] = v
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path, plan


FULL = [[1, 0], [0, 0], [1, 1]]
MODEL = {"name": "tiny", "model_type": "gemma3", "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 8,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "windows": [8, 8, None]}


@pytest.mark.parametrize("edit, message", [
    ({"window": 2.5}, r'"window" must be a whole number >= 0 \(keys\), got 2.5\.'),
    ({"window": "256"}, r'"window" must be a whole number >= 0 \(keys\), got "256"\.'),
    ({"sink": True}, r'"sink" must be a whole number >= 0 \(keys\), got true\.'),
    ({"sink": -3}, r'"sink" must be a whole number >= 0 \(keys\), got -3\.'),
    ({"window": ...}, r'no "window" field'),
    ({"windw": 300}, r'unknown field "windw" \(a plan has "format", "sink", "window"'),
    ({"full": [[1, 0], [0, 2], [1, 1]]}, r'"full" row 1, K/V head 1 is 2; an entry is 0/1 or false/true'),
    ({"full": [[1, 0], [-1, 0], [1, 1]]}, r'"full" row 1, K/V head 0 is -1; an entry is 0/1'),
    ({"full": [[1, 0.5], [0, 0], [1, 1]]}, r'"full" row 0, K/V head 1 is 0.5; an entry is 0/1'),
    ({"full": [[1, 0], [0, 0], [1, "1"]]}, r'"full" row 2, K/V head 1 is "1"; an entry is 0/1'),
    ({"full": [[1, 0], [0], [1, 1]]}, r'"full" row 1 has 1 entries but row 0 has 2 \(one per K/V head\)'),
    ({"full": [[1, 0], 1, [1, 1]]}, r'"full" row 1 is 1; "full" must be a list of rows, one per layer'),
    ({"full": []}, r'"full" must be a list of rows, one per layer, .*; got \[\]'),
    ({"full": [[1, 0], [0, 0]]}, r'"scores" has 3 rows but "full" has 2 \(one per layer\)'),
    ({"scores": [[0.5, 0.1], [0.2], [0.9, 0.8]]}, r'"scores" row 1 has 1 entries but "full" has 2 K/V heads'),
    ({"scores": [[0.5, 0.1], [0.2, "high"], [0.9, 0.8]]}, r'"scores" row 1, K/V head 1 is "high"; an entry is a number or null'),
    ({"scores": [[0.5, 0.1], [0.2, None]]}, r'"scores" has 2 rows but "full" has 3'),
    ({"tie_scores": [[0.5, 0.1], [0.2, True], [0.9, 0.8]]}, r'"tie_scores" row 1, K/V head 1 is true'),
    ({"tie_scores": [[0.5, 0.1], [0.2, 0], [0.9, 0.8]], "scores": None}, r'"tie_scores" break ties of "scores"'),
    ({"layers": ["l.0", "l.1"]}, r'"layers" names 2 layers but "full" has 3 rows'),
    ({"layers": ["l.0", 1, "l.2"]}, r'"layers" must be null or a list of 3 strings'),
    ({"layers": "l"}, r'"layers" must be null or a list of 3 strings'),
    ({"score": 3}, r'"score" names a score: a string or null, got 3'),
    ({"notes": [1]}, r'"notes" must be an object or null, got \[1\]'),
    ({"model": "gemma"}, r'"model" must be an object \(what the plan was made for\) or null, got "gemma"'),
    ({"model": {**MODEL, "head_dim": 8.0}}, r'"model".head_dim must be a whole number >= 1, got 8.0'),
    ({"model": {**MODEL, "windows": [8, 8]}}, r'"model": 3 layer types and 2 windows for layers=3'),
    ({"model": {**MODEL, "windows": [8, 8.5, None]}}, r'"model".windows\[1\] must be a whole number or null, got 8.5'),
    ({"model": {**MODEL, "windows": [8, None, None]}}, r'"model": layer 1 is .sliding_attention. with window None'),
    ({"model": {**MODEL, "kv_heads": 4}}, r'"full" is \[layers=3, Hkv=2\] but "model" says it was made for \[layers=3, H=4, '
                                          r'Hkv=4'),
    ({"model": {**MODEL, "heads": 3}}, r'"model": heads=3 is not a multiple of kv_heads=2'),
    ({"model": {**MODEL, "layer": 3}}, r'"model" has unknown field "layer"'),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else "")
def test_a_hand_edited_plan_file_is_refused_naming_the_file_the_field_the_row_and_the_value(tmp_path, edit, message):
    """A plan file is read as written or refused: a window of 2.5 is not a window of 2, "256" not 256, a
    head of 2 or -1 not a full head, 0.5 not a streaming one, and a short row names its row (issue 40,
    item 9)."""
    path, _ = _plan_file(tmp_path, **edit)
    with pytest.raises(LoadError, match=r"^" + str(path).replace("\\", "\\\\") + ": a malformed plan: " + message):
        Plan.load(path)


def test_a_plan_file_of_true_false_and_of_1_0_loads_as_written(tmp_path):
    path, plan = _plan_file(tmp_path)
    back = Plan.load(path)
    assert torch.equal(back.full, plan.full) and back.model == plan.model and back.layers == plan.layers
    assert (back.sink, back.window) == (4, 16) and back.scores[1, 1].isnan() and back.scores[2, 0] == plan.scores[2, 0]
    path, _ = _plan_file(tmp_path, "bools.json", full=[[True, False], [False, False], [True, True]],
                         scores=[[1, 0], [0, None], [2, 1]])  # whole numbers are scores too
    again = Plan.load(path)
    assert torch.equal(again.full, plan.full) and again.scores[2, 0] == 2.0


def test_every_plan_file_the_repo_stores_loads():
    """Every saved plan in the repository (benchmarks/results and anywhere else), and every plan a board
    (bhqk.evaluate.board) stores with its cells, passes the strict loader."""
    root = Path(__file__).resolve().parents[1]
    found = [p for d in ("benchmarks", "docs", "examples", "tests") for p in (root / d).rglob("*.json")
             if '"bhqk.budget.Plan/1"' in p.read_text(errors="replace")]
    files = [p for p in found if json.loads(p.read_text()).get("format") == "bhqk.budget.Plan/1"]
    boards = [p for p in found if json.loads(p.read_text()).get("format") == "bhqk.evaluate.board/1"]
    assert len(files) >= 2 and set(files) | set(boards) == set(found), found
    plans = [(str(p), Plan.load(p)) for p in files] + [
        (f"{p}: {k}", Plan.from_dict(c["plan"], str(p))) for p in boards
        for k, c in json.loads(p.read_text())["cells"].items() if c.get("plan")]
    for where, plan in plans:
        assert plan.model is not None and plan.full.shape == (plan.model.layers, plan.model.kv_heads), where


def test_a_plan_of_python_lists_names_the_row_that_is_wrong():
    """``Plan(full=[[...], ...])`` checks its rows as the file loader does (torch would say only
    "expected sequence of length 2")."""
    with pytest.raises(ShapeError, match=r"full row 1 has 1 entries but row 0 has 2 \(one per K/V head\)"):
        Plan([[True, False], [True]])
    with pytest.raises(ShapeError, match=r"full row 0, K/V head 1 is 2; an entry is 0/1 or false/true"):
        Plan([[1, 2]])
    with pytest.raises(ShapeError, match=r"scores row 0, K/V head 0 is '0.5'; an entry is a number or None"):
        Plan([[True, False]], scores=[["0.5", 0.1]])
    with pytest.raises(ShapeError, match=r"scores row 1 has 1 entries but full has 2 K/V heads"):
        Plan([[True, False], [False, True]], scores=[[0.5, 0.1], [0.2]])
    with pytest.raises(ValueError, match=r"layers names the layers: a list of str"):
        Plan([[True, False]], layers=[0])
    with pytest.raises(ValueError, match=r"model is what the plan was made for: a ModelShape or None"):
        Plan([[True, False]], model={"layers": 1})
    assert torch.equal(Plan([[1, 0]], scores=[[0.5, None]]).full, torch.tensor([[True, False]]))


def test_the_streaming_mask_is_sink_plus_window_plus_own_key():
    m = streaming_mask(2, 3).materialize(1, 1, 8, 8)[0, 0]  # [Q, K]
    for i in range(8):
        seen = [j for j in range(8) if m[i, j] and j <= i]
        assert seen == sorted(set(range(min(2, i + 1))) | set(range(max(0, i - 3), i + 1)))
    assert torch.equal(streaming_mask(2, 3).materialize(1, 1, 8, 8),
                       (~masks.key_span(0, 2) | masks.sliding_window(3, align="bottom_right")).materialize(1, 1, 8, 8))


# ---- finding a plan ---------------------------------------------------------------------------------


class _CharTokenizer:  # a tokenizer's call: no special tokens to add, lists unless return_tensors="pt"
    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [1 + ord(c) % (V - 1) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


@pytest.mark.parametrize("score", ["induction", "retrieval", "distant"])
def test_find_keeps_the_top_fraction_by_the_kv_heads_max_score(score):
    model = _llama(layers=2)
    plan = find(model, full=0.5, sink=S, window=W, score=score, tokenizer=_CharTokenizer(), length=32, batch=2)
    assert plan.full.shape == (2, 2) and int(plan.full.sum()) == 2 and plan.score == score
    assert plan.layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert float(plan.scores[plan.full].min()) >= float(plan.scores[~plan.full].max())
    (_, kv, per_q), = score_keys(model, score, window=W, tokenizer=_CharTokenizer(), length=32, batch=2)
    torch.testing.assert_close(kv, per_q.reshape(2, 2, 4).amax(-1))  # a K/V head: the max of its 4 query heads
    torch.testing.assert_close(kv.double(), plan.scores)
    assert model.config._attn_implementation == "bhqk"


def test_find_breaks_ties_of_the_retrieval_score_by_index_or_by_copy_mass():
    """A random model never copies the needle, so every K/V head's retrieval score is 0 (one tie across
    the cut): by default the full heads are the first by index (earlier layers); with
    ``ties="copy mass"`` those with the most copy mass, which is not the index order."""
    model = _llama(layers=3, H=4, Hkv=4)
    (first, k1, _), (second, k2, _) = score_keys(model, "retrieval", length=32, batch=2, ties="copy mass")
    assert (first, second) == ("retrieval", "copy mass")
    assert [name for name, _, _ in score_keys(model, "retrieval", length=32, batch=2)] == ["retrieval"]
    plan = find(model, full=0.5, score="retrieval", length=32, batch=2, ties="copy mass")
    n = int(plan.full.sum())
    a, b = k1.flatten().tolist(), k2.flatten().tolist()
    want = sorted(range(len(a)), key=lambda i: (-a[i], -b[i], i))[:n]  # the first key, then the second, then index
    by_index = sorted(range(len(a)), key=lambda i: (-a[i], i))[:n]
    assert sorted(want) != sorted(by_index), "the first key must tie across the cut (else this proves nothing)"
    assert sorted(plan.full.flatten().nonzero().flatten().tolist()) == sorted(want)
    torch.testing.assert_close(plan.tie_scores, k2.double())
    assert plan.tie_score == "copy mass" and "ties by copy mass" in str(plan)
    verdicts = [v for row in plan.decided() for v in row]
    assert "copy mass" in verdicts and set(verdicts) <= {"retrieval", "copy mass"}
    default = find(model, full=0.5, score="retrieval", length=32, batch=2)  # ties by index: the earlier layers full
    assert sorted(default.full.flatten().nonzero().flatten().tolist()) == sorted(by_index)
    assert default.tie_score is None and set(v for row in default.decided() for v in row) <= {"retrieval", "index"}
    with pytest.raises(ValueError, match="ties must be one of"):
        find(model, full=0.5, score="retrieval", length=32, batch=2, ties="layer")


def test_rank_and_decided_follow_the_keys_in_order():
    k1 = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    k2 = torch.tensor([[0.0, 0.1], [0.3, 0.1]])
    assert rank([k1, k2]).tolist() == [0, 2, 1, 3]  # 1 ties with 3 on both keys: the lower index first
    assert rank([k1]).tolist() == [0, 1, 2, 3]
    plan = Plan(torch.tensor([[True, True], [True, False]]), scores=k1, score="a", tie_scores=k2, tie_score="b")
    assert plan.decided() == [["a", "index"], ["b", "index"]]
    plan = Plan(torch.tensor([[True, False], [False, True]]), scores=k1, score="a", tie_scores=k2, tie_score="b")
    assert plan.decided() == [["a", "hand"], ["hand", "hand"]]  # 3 is full though 2 ranks above it
    assert Plan(torch.ones(2, 2, dtype=torch.bool), scores=k1).decided() == [["-", "-"], ["-", "-"]]
    with pytest.raises(ValueError, match="tie_scores"):
        Plan(torch.ones(2, 2, dtype=torch.bool), tie_scores=k2)


def test_find_on_a_model_loaded_with_another_attention_restores_it():
    model = _llama()
    model.set_attn_implementation("sdpa")
    plan = find(model, full=0.25, score="retrieval", length=16, batch=1)
    assert int(plan.full.sum()) == 1 and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="tokenizer"):
        find(model, score="distant")
    with pytest.raises(ValueError, match=r"score='fisher'\) reads real text: pass tokenizer=.*'retrieval' reads"):
        find(model)  # the default score reads the model's output on real text
    with pytest.raises(ValueError, match="full"):
        find(model, full=1.5)


def test_budget_cache_repr_and_type():
    model = _llama()
    cache = _mixed(model).cache(model)
    assert isinstance(cache, BudgetCache) and isinstance(cache, transformers.Cache)
    assert "0 bytes held" in repr(cache)


# ---- the command line -------------------------------------------------------------------------------


def test_cli_budget_prints_the_plan_and_the_bytes_and_saves_it(tmp_path, capsys):
    from bhqk.cli import main

    folder = tmp_path / "tiny"
    _llama().save_pretrained(folder)
    argv = ["budget", "--model", str(folder), "--full", "0.5", "--sink", "4", "--window", "8", "--score", "retrieval",
            "--length", "256", "--save", str(tmp_path / "plan.json")]  # the model's context: 256 positions
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 of 4 K/V heads full" in out and "| 1     | model.layers.1.self_attn |" in out
    # 2 full heads × 256 + 2 streaming × 12 positions, of 4 × 256; d = 8, fp32, key + value
    assert f"({(2 * 256 + 2 * 12) / (4 * 256):.3f}×" in out and "the model's own cache 0.1 MiB" in out
    assert Plan.load(tmp_path / "plan.json").full.sum() == 2
    assert main(["budget", "--model", str(tmp_path / "nothing")]) == 2
    assert "not a known name" in capsys.readouterr().err  # the names of every command (bhqk.models.real.resolve)


def test_attention_weights_come_back_in_the_models_head_order_with_evicted_keys_zero():
    model = _llama()
    ids, am = _inputs(N=20, B=1)
    plan = _mixed(model)  # layer 0: K/V head 0 full (query heads 0-3), head 1 streams (4-7)
    cache, ref = plan.cache(model), transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :14], cache=cache)
        model(input_ids=ids[:, :14], cache=ref)
        w = model(input_ids=ids[:, 14:], cache=cache, output_attentions=True).attentions[0]  # [B, H, 6, 20]
        w_ref = model(input_ids=ids[:, 14:], cache=ref, output_attentions=True).attentions[0]
    torch.testing.assert_close(w[:, :4], w_ref[:, :4])  # full heads of the first layer: the model's own weights
    allowed = (streaming_mask(S, W) & masks.causal("bottom_right")).materialize(1, 1, 6, 20)[0, 0]  # [6, 20]
    assert bool((w[:, 4:] * ~allowed).eq(0).all()) and not bool((w_ref[:, 4:] * ~allowed).eq(0).all())
    torch.testing.assert_close(w[:, 4:].sum(-1), torch.ones(1, 4, 6))


# ---- rolling back (crop) ------------------------------------------------------------------------------


def test_crop_before_eviction_is_exact_and_after_it_says_why():
    model = _llama()
    ids, am = _inputs(B=1, N=14)
    plan = _mixed(model)
    cache = plan.cache(model)
    with torch.no_grad():
        model(input_ids=ids[:, :6], cache=cache)  # 6 < S + W = 8: nothing evicted
        with pytest.raises(ValueError, match="minus the number of positions"):
            cache.crop(4)  # a length to keep (transformers < 5.24): refused, as transformers' own layers do
        cache.crop(tokens_to_remove=-2)  # Cache.crop's own parameter name
        assert cache.get_seq_length() == 4 and cache.positions(0, 1).tolist() == [0, 1, 2, 3]
        out = model(input_ids=ids[:, 4:14], cache=cache).logits  # [1, 10, V]
        with plan.emulate(model):
            ref = model(input_ids=ids).logits[:, 4:]
        assert_models_close(out, ref, width=96, layers=2)
        cache.crop(0)  # nothing to remove: a no-op after eviction too
        assert cache.get_seq_length() == 14
        with pytest.raises(ValueError, match="activate_past_recording"):
            cache.crop(-1)  # position 13 − W = 8 was evicted; the query at 13 would need it


def test_a_refused_crop_leaves_every_layer_as_it_was():
    """Layer 0 all full could crop, layer 1's streaming head cannot: crop is every layer or none."""
    model = _llama()
    ids, _ = _inputs(B=1, N=14)
    plan = Plan(torch.tensor([[True, True], [True, False]]), sink=S, window=W)
    cache = plan.cache(model)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-4)
    assert [layer.length for layer in cache.budget_layers] == [14, 14] and cache.get_seq_length() == 14


def test_find_names_what_it_cannot_do():
    with pytest.raises(ValueError, match="ties='copy mass' orders the ties of score='retrieval'"):
        find(_llama(), full=0.5, score="induction", ties="copy mass")
    from bhqk.models.gpt2 import GPT2, GPT2Config

    with pytest.raises(TypeError, match="scores a Hugging Face causal LM.*GPT2.*Plan\\(full="):
        find(GPT2(GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2, n_inner=32)), full=0.5)


def test_crop_after_past_recording_is_exact_and_evicts_afterwards():
    """transformers' assisted decoding: activate_past_recording, a forward over draft tokens, crop the
    rejected ones; the streaming heads then hold sink + window again, and the next forward equals the
    edited model's."""
    model = _llama()
    ids, am = _inputs(B=2, N=24)
    plan = _mixed(model)
    cache = plan.cache(model)
    cache.activate_past_recording()
    with torch.no_grad():
        model(input_ids=ids[:, :14], attention_mask=am[:, :14], cache=cache)
        model(input_ids=ids[:, 14:19], attention_mask=am[:, :19], cache=cache)  # 5 draft tokens
        assert cache.positions(0, 1).tolist() == list(range(19))  # recording: nothing evicted yet
        cache.crop(-3)  # 2 accepted
        assert cache.get_seq_length() == 16 and cache.positions(0, 1).tolist() == [0, 1, 2] + list(range(11, 16))
        assert cache.layers[0].sk.shape[-2] == S + W
        out = model(input_ids=ids[:, 16:], attention_mask=am, cache=cache).logits  # [B, 8, V]
        with plan.emulate(model):
            ref = model(input_ids=ids, attention_mask=am).logits[:, 16:]
    assert_models_close(out, ref, width=96, layers=2)


def test_assisted_decoding_with_the_budget_cache_is_greedy_decoding_with_it():
    model = _llama()
    ids, am = _inputs(B=1, N=20)
    plan = _mixed(model)
    seq, _ = _generate(model, ids, am, n=12, cache=plan.cache(model))
    assisted = model.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              assistant_model=_llama(layers=1), cache=plan.cache(model))
    assert torch.equal(assisted, seq)


def test_a_stream_shorter_than_the_sink_holds_every_position_and_crops():
    """A streaming head that has seen fewer positions than ``sink`` (a 13-token prompt and 4 new tokens
    with sink=64): it holds them all, and a crop (assisted decoding of a short prompt) is exact."""
    model = _llama()
    ids, am = _inputs(B=1, N=13)
    plan = Plan(_mixed(model).full, sink=64, window=W)
    seq, _ = _generate(model, ids, am, n=4, cache=(cache := plan.cache(model)))
    assert cache.positions(0, 1).tolist() == list(range(16))
    cache.crop(-3)
    assert cache.get_seq_length() == 13 and cache.positions(0, 1).tolist() == list(range(13))
    with torch.no_grad():
        out = model(input_ids=seq[:, 13:], cache=cache).logits  # [1, 4, V]
        with plan.emulate(model):
            ref = model(input_ids=seq).logits[:, 13:]
    assert_models_close(out, ref, width=96, layers=2)
    assisted = model.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0,
                              assistant_model=_llama(layers=1), cache=plan.cache(model))
    assert torch.equal(assisted, seq)


# ---- what a plan was made for ---------------------------------------------------------------------------


def test_a_plan_records_what_it_was_made_for_and_its_file_keeps_it(tmp_path):
    from bhqk.budget.plan import ModelShape, model_map

    model = _llama()
    plan = find(model, full=0.5, sink=S, window=W, score="retrieval", length=16, batch=1)
    shape = model_map(model).shape
    assert plan.model == shape == ModelShape(2, 8, 2, 8, ("full_attention",) * 2, (None, None), None, "llama")
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert back.model == shape and "made for [layers=2, H=8, Hkv=2, d=8; 2 full_attention] (llama)" in str(back)
    old = plan.to_dict()
    del old["model"]  # a file written before plans recorded it
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = Plan.load(tmp_path / "old.json")
    assert older.model is None and torch.equal(older.full, plan.full)
    assert older.check(model).shape == shape  # layers and K/V heads are all it can check
    with pytest.raises(ShapeError, match=r"Hkv=2\] but the plan says it was made for \[layers=2, H=8, Hkv=3"):
        Plan(plan.full, model=ModelShape(2, 8, 3, 8, ("full_attention",) * 2, (None, None)))


def test_every_entry_point_refuses_a_plan_for_another_model_before_any_forward():
    """Same layers and K/V heads, another head size (d=8 against d=16): refused with both shapes named
    by check, cache(model), nbytes, emulate and needle.grid before a forward; a cache made without the
    model refuses the first keys written, before storing them."""
    from bhqk.evaluate import needle

    model, other = _llama(), _llama(H=4, Hkv=2)  # d = 64 / 8 = 8 and 64 / 4 = 16
    plan = find(model, full=0.5, sink=S, window=W, score="retrieval", length=16, batch=1)
    both = r"the plan is \[layers=2, Hkv=2\] made for \[layers=2, H=8, Hkv=2, d=8.*is \[layers=2, H=4, Hkv=2, d=16"
    forwards = []
    other.register_forward_pre_hook(lambda *a: forwards.append(1))
    for call in (lambda: plan.check(other), lambda: plan.cache(other), lambda: plan.nbytes(8, other),
                 lambda: plan.emulate(other).__enter__(), lambda: needle.grid(other, None, [64], [0.5], plan=plan)):
        with pytest.raises(ShapeError, match=both):
            call()
    assert not forwards
    ids, am = _inputs()
    cache = plan.cache()
    with pytest.raises(ShapeError, match=r"layer 0: the plan has Hkv=2 K/V heads, d=8 but the model wrote keys of "
                                         r"shape \[2, 2, 20, 16\]"):
        _generate(other, ids, am, n=2, cache=cache)
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0  # nothing was written


def test_a_cache_made_without_the_model_refuses_a_plan_of_more_layers_at_the_next_forward():
    """Made without the model, the cache cannot know the model's depth before it runs: a plan of more
    layers is refused when the next forward starts (the last one left layers unwritten), so
    ``generate`` stops at its second step instead of returning tokens."""
    model = _llama()
    ids, am = _inputs()
    deeper = Plan(torch.zeros(3, 2, dtype=torch.bool), sink=S, window=W)
    with pytest.raises(ShapeError, match=r"wrote layers 0…1 but not 2…2; the plan is \[layers=3, Hkv=2\]"):
        _generate(model, ids, am, n=3, cache=deeper.cache())
    with pytest.raises(ShapeError, match=r"\[layers=3, Hkv=2\] but LlamaForCausalLM is \[layers=2"):
        deeper.cache(model)


def test_negative_lengths_are_refused_naming_the_argument():
    model = _llama()
    plan = _mixed(model)
    with pytest.raises(ValueError, match="Plan.nbytes: length must be an int >= 0, got -5"):
        plan.nbytes(-5, model)
    with pytest.raises(ValueError, match="Plan.held: length must be an int >= 0, got -1"):
        plan.held(-1)
    with pytest.raises(ValueError, match="Plan.nbytes: batch must be an int >= 1, got 0"):
        plan.nbytes(5, model, batch=0)
    assert plan.nbytes(0, model) == (0, 0)


def test_cli_needle_refuses_a_plan_for_another_model_before_generating(tmp_path, serve, capsys):
    """``bhqk needle --plan`` with a plan of 32 layers on a 2-layer model: an error naming both shapes
    (it printed "found 0 of 1"), and no generation ran."""
    from bhqk.cli import main

    model = _llama()
    tokenizer = object()  # never asked: the plan is refused first
    serve((model, tokenizer))
    Plan(torch.zeros(32, 2, dtype=torch.bool)).save(tmp_path / "plan32.json")
    model.generate = lambda *a, **k: pytest.fail("generated with a plan for another model")
    code = main(["needle", "--model", "smollm2-135m", "--lengths", "64", "--depths", "0.5", "--out", str(tmp_path),
                 "--plan", str(tmp_path / "plan32.json")])
    err = capsys.readouterr().err
    assert code == 2 and "the plan is [layers=32, Hkv=2] but LlamaForCausalLM is [layers=2, H=8, Hkv=2" in err, err


def test_a_score_is_a_dataclass_of_its_options_and_the_cli_makes_its_flags_from_them():
    import argparse
    import dataclasses

    from bhqk.budget.cli import _flag, add_budget_parser
    from bhqk.budget.find import SCORES, Retrieval, make_score

    model = _llama(layers=2)
    by_name = find(model, full=0.5, sink=S, window=W, score="retrieval", length=32, batch=2)
    by_value = find(model, full=0.5, sink=S, window=W, score=Retrieval(length=32, batch=2))
    assert torch.equal(by_name.full, by_value.full)  # the same score run twice: the same cut, scores within rounding
    torch.testing.assert_close(by_name.scores, by_value.scores)
    with pytest.raises(ValueError, match=r"\['steps'\] are not its options \(batch, length\); steps belongs to 'learned'"):
        find(model, score="kl", tokenizer=_CharTokenizer(), steps=3)
    with pytest.raises(ValueError, match="length must be a whole number >= 1, got 2.5"):
        find(model, score="retrieval", length=2.5)
    assert make_score("learned", steps=None) == SCORES["learned"]()  # None: the default
    flags = {a.dest: a for a in add_budget_parser(argparse.ArgumentParser().add_subparsers())._actions}
    for name, cls in SCORES.items():
        for f in dataclasses.fields(cls):  # every option of every score is a flag, and its help names the score
            action = flags["score_" + f.name]
            assert _flag(f.name) in action.option_strings and name in action.help and f.metadata["doc"] in action.help
