"""The microscope on a budget-run model: ``bhqk.capture`` and ``bhqk.edit`` over ``generate(cache=plan.cache(m))``
(and bhqk's own ``plan.kv_cache(m)``) name heads by the model's index and keys by their position, whatever the
layer's grouping (full and streaming heads, all streaming, all full past a sliding window), so every record and
every edit equals the same on the emulated run (``plan.emulate`` over a cache that keeps every position), at the
prefill and at each decode step after eviction (tiny random models, fp32, no network)."""

from __future__ import annotations

import pytest
import torch
import transformers

import bhqk
import bhqk.budget.cache
from bhqk import edits, masks
from bhqk.bias import alibi
from bhqk.budget import Plan
from bhqk.budget.plan import model_map
from bhqk.inspect.heads import layer_id
from test_budget import S, W, _generate, _inputs, _llama
from test_budget_kvcache import _gpt2
from test_budget_layers import WIN, _mixed, _model
from test_stats_cli import llama_folder  # noqa: F401  (a pytest fixture: a tiny random Llama with a tokenizer)
from tolerance import assert_models_close, assert_paths_close

pytestmark = pytest.mark.protocol  # transformers through bhqk (make test-newest, make test-lowest)

KW = dict(what=("weights", "lse", "head_outputs", "entropy", "distance", "sink", "received", "max"),
          offsets=(0, 1, 3), window=3, topk=3)  # every statistic of rowstats.STATISTICS, and the matrices
WIDTH = 96  # the widest matmul of the tiny models (intermediate_size)
NEW = 4  # new tokens: the prefill of 20 (past S + W + 1 and the sliding windows), then 3 decode steps


def _whole_sliding_layer(model) -> Plan:
    """Gemma 3's first sliding layer all full (its own layer, read past its window), the second all
    streaming, the global layer mixed."""
    shape = model_map(model).shape
    full = torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool)
    full[0] = True
    full[-1, -1] = True
    return Plan(full, sink=S, window=W)


def _streaming(model) -> Plan:
    shape = model_map(model).shape
    return Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), sink=S, window=W)


def _free(model) -> Plan:
    """Qwen2's sliding layer within the streaming window (w = W + 1 keys): its heads run as full heads."""
    return Plan(_mixed(model).full, sink=S, window=WIN - 1)


CASES = {  # name: (model, plan)
    "llama-gqa": (_llama, _mixed),  # full-attention layers, H=8 over Hkv=2
    "llama-streaming": (_llama, _streaming),  # every layer one group of streaming heads (StreamingLLM)
    "mistral": (lambda: _model("mistral"), _mixed),  # every layer a sliding window
    "qwen2": (lambda: _model("qwen2"), _mixed),  # a full layer, then a sliding one
    "qwen2-free": (lambda: _model("qwen2"), _free),  # the sliding layer's heads within its own window
    "gemma3": (lambda: _model("gemma3"), _mixed),  # sliding, sliding (all streaming), global
    "gemma3-whole": (lambda: _model("gemma3"), _whole_sliding_layer),
    "gpt_oss": (lambda: _model("gpt_oss"), _mixed),  # attention sinks (s_aux)
    "llama4": (lambda: _model("llama4"), _mixed),  # chunked layers
}


def _streaming_query_heads(plan: Plan, model, li: int) -> list[int]:
    shape = model_map(model).shape
    G = shape.heads // shape.kv_heads
    keeps = plan.full | plan.free(shape)  # [L, Hkv]
    return [g * G + j for g in range(shape.kv_heads) if not bool(keeps[li, g]) for j in range(G)]


def _same_records(got, want, layers: int, msg: str) -> None:
    """Every record of ``got`` equals ``want``'s: the same calls, sizes and heads; every tensor within the
    bound of two model paths (each layer's error, then a sum over K keys)."""
    assert [(r.name, r.sizes, r.heads, r.rows) for r in got] == [(r.name, r.sizes, r.heads, r.rows) for r in want], msg
    for a, b in zip(got, want):
        at = f"{msg}: {a.name} #{a.index} (Q={a.sizes['Q']}, K={a.sizes['K']})"
        assert a.captured() == b.captured(), at
        assert torch.equal(a.real, b.real), f"{at}: real rows"
        n = WIDTH * layers ** 2 * a.sizes["K"]
        for name in a.captured():
            if name in ("real", "topk_keys"):
                continue
            assert_paths_close(a[name], b[name], n=n, msg=f"{at}: {name}")
        picked = b.weights.gather(-1, a.topk_keys)  # the emulated run's weights at the keys the budget run names
        assert_paths_close(picked, b.topk_weights, n=n, msg=f"{at}: topk_keys")


@pytest.mark.parametrize("name", list(CASES))
def test_capture_over_generate_with_the_budget_cache_equals_capture_over_the_emulated_run(name):
    make, make_plan = CASES[name]
    model = make()
    plan = make_plan(model)
    layers = model_map(model).shape.layers
    ids, am = _inputs()
    with bhqk.capture(model=model, **KW) as cap:
        seq, logits = _generate(model, ids, am, n=NEW, cache=(cache := plan.cache(model)))
    with plan.emulate(model), bhqk.capture(model=model, **KW) as ref:
        ref_seq, ref_logits = _generate(model, ids, am, n=NEW, cache=transformers.DynamicCache())
    assert torch.equal(seq, ref_seq)
    assert_models_close(logits, ref_logits, width=WIDTH, layers=layers, msg=name)
    n = logits.shape[0]  # the prefill, then a decode step per new token but the last
    assert len(cap.records) == layers * n and [r.sizes["Q"] for r in cap.records[layers:]] == [1] * layers * (n - 1)
    _same_records(cap.records, ref.records, layers, name)
    # what was dropped is attended by nobody: the streaming heads' keys between the sink and the window receive 0
    last = cap.records[-layers:]  # the last decode step, K = every position written
    sink, window = plan.sink, plan.window
    assert last[0].sizes["K"] == cache.get_seq_length() > sink + window + 1
    dropped = 0
    for rec in last:
        li = layer_id(rec.name, -1)
        K = rec.sizes["K"]
        for h in _streaming_query_heads(plan, model, li):
            gone = rec.received[:, h, sink:K - 1 - window]  # [B, positions dropped]
            assert torch.equal(gone, torch.zeros_like(gone)), (name, li, h)
            dropped += gone.numel()
            held = cache.positions(li, h // (rec.sizes["H"] // rec.sizes["Hkv"])).tolist()
            assert all(p < sink or p >= K - 1 - window for p in held)
    assert dropped > 0


def _edited(model, plan, path: str, stream_q: int, full_q: int, cache):
    """A knock-out and a scale on a streaming head; ALiBi and a score edit by key position (not by the
    distance to the query) on a full head."""
    with bhqk.edit(path, heads=[stream_q], model=model, mask=masks.key_span(1, 2), scale=1.5), \
            bhqk.edit(path, heads=[full_q], model=model, bias=alibi(1, align="bottom_right"),
                      do=edits.at("scores", lambda s: s - 0.01 * torch.arange(s.shape[-1], dtype=s.dtype) ** 2)):
        return _generate(model, *_inputs(), n=NEW, cache=cache)


@pytest.mark.parametrize("name", ["llama-gqa", "mistral", "gemma3"])
def test_edits_of_a_streaming_and_a_full_head_equal_them_on_the_emulated_run(name):
    """Heads by the model's index, masks and scores in key positions (a sliding layer past its window
    included: a frame's column would be another position)."""
    make, make_plan = CASES[name]
    model = make()
    plan = make_plan(model)
    layers = model_map(model).shape.layers
    li = 0
    path = model_map(model).paths[li]
    stream_q = _streaming_query_heads(plan, model, li)[0]
    full_q = next(h for h in range(model_map(model).shape.heads) if h not in _streaming_query_heads(plan, model, li))
    seq, logits = _edited(model, plan, path, stream_q, full_q, plan.cache(model))
    with plan.emulate(model):
        ref_seq, ref = _edited(model, plan, path, stream_q, full_q, transformers.DynamicCache())
        _, unedited = _generate(model, *_inputs(), n=NEW, cache=transformers.DynamicCache())
    assert_models_close(logits, ref, width=WIDTH, layers=layers, msg=name)
    assert torch.equal(seq, ref_seq)
    assert (unedited - ref).abs().max() > 1e-3, "the edits must change something (else the test proves nothing)"


@torch.no_grad()
def test_capture_and_edit_over_bhqks_own_budget_kvcache_equal_the_emulated_run():
    """bhqk's GPT-2 with ``plan.kv_cache``: a mixed layer (one call per group) and an all-streaming one
    (a ring of slots) read as calls over every position, heads in the model's order."""
    model = _gpt2()
    ids, am = _inputs()
    plan = Plan(torch.tensor([[True, False, True, False], [False, False, False, False]]), sink=S, window=W)
    with bhqk.capture(model=model, **KW) as cap:
        seq = model.generate(ids, NEW, attention_mask=am, cache=plan.kv_cache(model))
    with plan.emulate(model), bhqk.capture(model=model, **KW) as ref:
        ref_seq = model.generate(ids, NEW, attention_mask=am)
    assert torch.equal(seq, ref_seq)
    assert len(cap.records) == 2 * NEW and cap.records[-1].sizes["K"] == ids.shape[1] + NEW - 1
    _same_records(cap.records, ref.records, 2, "gpt2")
    path = model_map(model).paths[0]

    def edited(cache):
        with bhqk.edit(path, heads=[1], model=model, mask=masks.key_span(1, 2)), \
                bhqk.edit(path, heads=[2], model=model, do=edits.at("weights", lambda p: p * 0.5)), \
                bhqk.capture(model=model, what=("weights",)) as c:
            return model.generate(ids, NEW, attention_mask=am, cache=cache), c

    got, c_got = edited(plan.kv_cache(model))
    with plan.emulate(model):
        want, c_want = edited(model.new_cache())
    assert torch.equal(got, want)
    for a, b in zip(c_got.records, c_want.records, strict=True):
        assert_paths_close(a.weights, b.weights, n=64 * 4 * a.sizes["K"], msg=a.name)
    changed = (c_want.records[-2].weights[:, 1:3] - ref.records[-2].weights[:, 1:3]).abs().max()  # layer 0, last step
    assert changed > 1e-3, "the edits must change something (else the test proves nothing)"


def test_cli_stats_with_a_plan_prints_the_budget_models_head_table(llama_folder, tmp_path, capsys):  # noqa: F811
    """``bhqk stats --plan``: the table of the forward with the plan's cache, equal to the emulated plan's;
    its streaming heads look no further than their window (the model's own heads do)."""
    from bhqk.cli import main
    from bhqk.inspect.heads import HeadTable
    from bhqk.viz.stats_cli import STATS, load, tokenize

    folder = llama_folder
    plan = Plan(torch.tensor([[True, False], [False, True]]), sink=S, window=W)
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 8)
    argv = ["stats", "--model", str(folder), "--file", str(text), "--out", str(tmp_path / "out"), "--window", "4"]
    assert main([*argv, "--plan", str(plan.save(tmp_path / "plan.json")), "--json", str(tmp_path / "t.json")]) == 0
    assert "KV cache: Plan: 2 of 4 K/V heads full" in capsys.readouterr().out
    got = HeadTable.from_json(tmp_path / "t.json")
    loaded = load(folder)
    inputs, _, _ = tokenize(loaded, text.read_text())
    with torch.no_grad(), plan.emulate(loaded.model), \
            bhqk.capture(model=loaded.model, what=STATS, offsets=(1,), window=4) as cap:
        loaded.model(**inputs)
    want = cap.head_table()
    assert got.layers == want.layers and got.columns == want.columns
    N = inputs["input_ids"].shape[1]
    for col in want.columns:
        assert_paths_close(got[col], want[col], dtype=torch.float32, n=WIDTH * 4 * N, msg=col)
    assert main([*argv, "--json", str(tmp_path / "plain.json")]) == 0  # the model itself
    plain = HeadTable.from_json(tmp_path / "plain.json")
    assert N > S + W + 1
    assert_paths_close(got["distance"][0, :2], plain["distance"][0, :2], dtype=torch.float32, n=WIDTH * N)  # layer 0 full
    assert (plain["distance"][0, 2:] - got["distance"][0, 2:]).min() > 1.0  # its streaming heads look less far
    assert main([*argv, "--plan", str(Plan(torch.ones(3, 2, dtype=torch.bool)).save(tmp_path / "p3.json"))]) == 2
    assert "layers=3" in capsys.readouterr().err


def test_nothing_changes_when_nobody_looks(monkeypatch):
    """Without capture, trace or edit a layer runs its groups as before: the one-call view is never built."""
    def refuse(*a, **k):
        raise AssertionError("the one-call view was built with nobody looking")

    monkeypatch.setattr(bhqk.budget.cache, "spread", refuse)
    model = _model("gemma3")
    plan = _whole_sliding_layer(model)  # mixed, all-streaming and all-full sliding layers
    _generate(model, *_inputs(), n=NEW, cache=plan.cache(model))
    with pytest.raises(AssertionError, match="nobody looking"), bhqk.capture(model=model):
        _generate(model, *_inputs(), n=NEW, cache=plan.cache(model))
