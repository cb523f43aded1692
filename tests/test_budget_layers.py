"""Head-wise KV budgets on every layer type transformers has (tiny random models, fp32, no network):
full attention, sliding windows (Mistral: every layer; Qwen2: some; Gemma 2 and 3: alternating;
GPT-OSS: alternating, with attention sinks) and chunked attention (Llama 4). Per layer the budget
cache keeps what the model's own cache keeps (``DynamicCache(config=model.config)``), its streaming
heads the sink and window of that; its bytes are what ``plan.nbytes`` says and never above the
model's own; generation with it equals the plan emulated by edits; an all-full plan is the model's
own cache, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
import transformers

from bhqk.budget import Plan, find
from bhqk.budget.plan import kept_streaming, model_map
from bhqk.errors import ShapeError
from bhqk.integrations.transformers import register
from handmade import CharTokenizer  # characters as token ids
from test_budget import V, _generate, _inputs  # ids [B, N] (row 1 left-padded), their mask; greedy (sequences, logits)
from tolerance import assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
S, W = 3, 5  # the streaming window (W + 1 = 6 keys) is narrower than every model window below (7, 8)
WIN, CHUNK = 7, 8
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, attn_implementation="bhqk")


def _model(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "mistral":  # every layer a sliding window
        m = t.MistralForCausalLM(t.MistralConfig(num_hidden_layers=2, sliding_window=WIN, **COMMON))
    elif name == "qwen2":  # max_window_layers=1: layer 0 full, layer 1 sliding
        m = t.Qwen2ForCausalLM(t.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=WIN,
                                             max_window_layers=1, **COMMON))
    elif name == "gemma2":  # sliding, full (and soft-capped logits)
        m = t.Gemma2ForCausalLM(t.Gemma2Config(num_hidden_layers=2, sliding_window=WIN, head_dim=16, **COMMON))
    elif name == "gemma3":  # as Gemma 3: sliding layers, then a global one
        m = t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            num_hidden_layers=3, sliding_window=WIN, head_dim=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], **COMMON))
    elif name == "gpt_oss":  # sliding, full; a learned sink logit per head (s_aux)
        m = t.GptOssForCausalLM(t.GptOssConfig(num_hidden_layers=2, sliding_window=WIN, head_dim=16,
                                               num_local_experts=2, num_experts_per_tok=1, **COMMON))
    elif name == "llama4":  # chunked attention in three layers of four, the fourth full (no rotary)
        m = t.Llama4ForCausalLM(t.Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=CHUNK, head_dim=16,
                                                   num_local_experts=1, intermediate_size_mlp=96, **COMMON))
    else:
        raise ValueError(name)
    return m.eval()


KINDS = {"mistral": ["sliding_attention"] * 2, "qwen2": ["full_attention", "sliding_attention"],
         "gemma2": ["sliding_attention", "full_attention"],
         "gemma3": ["sliding_attention", "sliding_attention", "full_attention"],
         "gpt_oss": ["sliding_attention", "full_attention"], "llama4": ["chunked_attention"] * 3 + ["full_attention"]}
NAMES = list(KINDS)


def _mixed(model) -> Plan:
    """Layer 0's K/V head 0 and the last layer's last head full, every other head streaming."""
    shape = model_map(model).shape
    full = torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool)
    full[0, 0] = full[-1, -1] = True
    return Plan(full, sink=S, window=W)


def _bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _allocated(cache) -> int:
    """Bytes of the storages under a budget cache's tensors, measured from the tensors, each storage once."""
    storages = {}
    for layer in cache.budget_layers:
        for t in (layer.fk, layer.fv, layer.sk, layer.sv):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _position(model, B: int) -> int:
    """Bytes of one position's keys and values over every K/V head of a layer (fp32)."""
    shape = model_map(model).shape
    return B * shape.kv_heads * 2 * shape.head_dim * 4


def _sliding(shape) -> int:
    return sum(w is not None for w in shape.windows)


@pytest.mark.parametrize("plan_kind", ["all full", "mixed"])
@torch.no_grad()
def test_cache_nbytes_is_the_storage_its_tensors_hold_and_the_plan_predicts_it_within_a_position(plan_kind):
    """On a sliding-window model (a tiny Gemma 3: two sliding layers of window 7, one global), ``cache.nbytes()``
    is the memory its tensors really keep allocated (their storages), after a prefill longer than the
    window and after each decode step; ``plan.nbytes`` predicts the positions held, at most one position
    per sliding layer below it (a layer of full heads keeps its window − 1 positions as a view of the
    window its last step wrote, as transformers' own layer does) — issue 40, item 9: Gemma 3 270M's
    cache said 12,288 bytes less than it held."""
    model = _model("gemma3")
    shape = model_map(model).shape
    plan = (Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), sink=S, window=W) if plan_kind == "all full"
            else _mixed(model))
    ids, am = _inputs(B=2, N=24)
    cache = plan.cache(model)
    N = 16  # > WIN: the prefill's keys beyond the window must not stay alive behind a view
    model(input_ids=ids[:, :N], attention_mask=am[:, :N], cache=cache)
    for n in range(N, ids.shape[1] + 1):
        if n > N:
            model(input_ids=ids[:, n - 1:n], attention_mask=am[:, :n], cache=cache)
        predicted = plan.nbytes(n, model, batch=2)[0]
        assert cache.nbytes() == _allocated(cache), n
        slack = 0 if plan_kind == "mixed" or n == N else _position(model, 2) * _sliding(shape)
        assert cache.nbytes() - predicted == slack, (n, cache.nbytes(), predicted)


@pytest.mark.parametrize("name", NAMES)
def test_the_model_shape_is_what_the_models_own_cache_is_made_of(name):
    model = _model(name)
    shape = model_map(model).shape
    assert list(shape.layer_types) == KINDS[name]
    own = transformers.DynamicCache(config=model.config)
    for layer, t, w in zip(own.layers, shape.layer_types, shape.windows):
        assert w == (None if t == "full_attention" else getattr(layer, "sliding_window", None))
        assert w in (None, WIN, CHUNK)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_bytes_are_the_models_own_cache_and_the_plan_holds_what_it_says(name):
    """After a forward of n tokens (and each decode step after it) the model's own cache holds
    ``nbytes(n)[1]`` in its tensors, the budget cache ``nbytes(n)[0]`` — each streaming head exactly the
    positions a later query may see under its layer's window and the streaming mask — never more."""
    model = _model(name)
    shape = model_map(model).shape
    ids, am = _inputs(B=2, N=22)
    plan, every = _mixed(model), Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), sink=S, window=W)
    own, cache, all_full = transformers.DynamicCache(config=model.config), plan.cache(model), every.cache(model)
    N = 12
    for c in (own, cache, all_full):
        model(input_ids=ids[:, :N], attention_mask=am[:, :N], cache=c)
    for n in range(N, ids.shape[1] + 1):
        if n > N:
            for c in (own, cache, all_full):
                model(input_ids=ids[:, n - 1:n], attention_mask=am[:, :n], cache=c)
        held, theirs = plan.nbytes(n, model, batch=2)
        assert theirs == _bytes(own), (name, n)
        assert held == cache.nbytes() == _allocated(cache) and every.nbytes(n, model, batch=2) == (theirs, theirs)
        assert all_full.nbytes() == _allocated(all_full)  # a sliding layer: one position more after a decode step
        assert 0 <= all_full.nbytes() - theirs <= (n > N) * _position(model, 2) * _sliding(shape), (name, n)
        assert held < theirs or n <= S + W
        for li, w in enumerate(shape.windows):
            first = 0 if w is None else max(0, n - w + 1)
            own_kept = own.layers[li].keys.shape[-2]
            for g in range(shape.kv_heads):
                got = cache.positions(li, g).tolist()
                if bool(plan.full[li, g]):
                    want = list(range(n - own_kept, n))  # the model's own cache's positions
                else:
                    want = [p for p in range(first, n) if p < S or p >= n - W]
                    assert len(want) == kept_streaming(n, w, S, W)
                assert got == want, (name, n, li, g)


@pytest.mark.parametrize("name", NAMES)
def test_generation_with_the_budget_cache_equals_the_emulated_plan(name):
    model = _model(name)
    ids, am = _inputs()
    plan = _mixed(model)
    seq, logits = _generate(model, ids, am, cache=plan.cache(model))
    with plan.emulate(model):  # a cache that keeps every position (the streaming mask counts from position 0)
        ref_seq, ref = _generate(model, ids, am, cache=transformers.DynamicCache())
    assert_models_close(logits, ref, width=96, layers=model.config.num_hidden_layers, msg=f"{name}: budget vs emulated")
    assert torch.equal(seq, ref_seq)
    _, plain = _generate(model, ids, am)
    assert (plain - ref).abs().max() > 1e-3, "the streaming mask must change something (else the test proves nothing)"


@pytest.mark.parametrize("name", NAMES)
def test_an_all_full_plan_is_the_models_own_cache_tensor_for_tensor(name):
    model = _model(name)
    ids, am = _inputs()
    shape = model_map(model).shape
    plan = Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), sink=S, window=W)
    cache, own = plan.cache(model), transformers.DynamicCache(config=model.config)
    seq, logits = _generate(model, ids, am, cache=cache)
    ref_seq, ref = _generate(model, ids, am, cache=own)
    assert torch.equal(logits, ref) and torch.equal(seq, ref_seq)
    assert cache.is_sliding == own.is_sliding
    for mine, theirs in zip(cache.budget_layers, own.layers):
        assert torch.equal(mine.fk, theirs.keys) and torch.equal(mine.fv, theirs.values)
        assert mine.get_mask_sizes(1) == theirs.get_mask_sizes(1)


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_assisted_decoding_with_the_budget_cache_is_greedy_decoding_with_it(name):
    """A draft model of other weights: drafts are rejected and the cache cropped, past the model's window."""
    model = _model(name)
    ids, am = _inputs(B=1)
    plan = _mixed(model)
    seq, _ = _generate(model, ids, am, n=12, cache=plan.cache(model))
    torch.manual_seed(1)
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **COMMON)).eval()
    assisted = model.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              assistant_model=draft, cache=plan.cache(model))
    assert torch.equal(assisted, seq)


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_emulate_refuses_a_cache_that_dropped_keys(name):
    """The model's default cache drops a sliding (chunked) layer's old keys and counts the rest from the
    first it keeps: the streaming mask would mark other keys, so the emulation says so."""
    model = _model(name)
    ids, am = _inputs()
    with pytest.raises(ValueError, match=r"transformers.DynamicCache\(\)"), _mixed(model).emulate(model):
        _generate(model, ids, am)


@pytest.mark.parametrize("name", NAMES)
def test_the_causal_scores_run_on_every_layer_type(name):
    """kl, fisher (find's default) and learned give one finite score per K/V head on every layer type,
    Llama 4 included (its ForCausalLM's get_decoder() is the model itself, which every score failed on);
    kl and fisher are above 0 for some head (streaming it changes the output); learned's gates left 1 (a
    training step ran; that they rank the right head is tested on the hand-built model)."""
    model = _model(name)
    shape = model_map(model).shape
    for score, kw in (("kl", dict(length=64)), ("fisher", dict(length=64)),
                      ("learned", dict(steps=1, length=240, keys=1, words=2))):
        plan = find(model, full=0.5, sink=S, window=W, score=score, tokenizer=CharTokenizer(V), **kw)
        assert plan.scores.shape == (shape.layers, shape.kv_heads) and torch.isfinite(plan.scores).all(), (score, plan)
        if score == "learned":
            assert (plan.scores < 1).all(), plan.scores
        else:
            assert plan.scores.max() > 0, (score, plan.scores)


def test_find_chooses_among_the_heads_whose_window_reaches_beyond_the_streaming_window():
    """Qwen2 with layer 0 full attention and layer 1 a window of 7 keys: with window=6 a streaming head
    of layer 1 sees what a full one sees, so layer 1 is kept full outside the fraction and half of
    layer 0 is chosen; with window=5 every head counts."""
    model = _model("qwen2")
    plan = find(model, full=0.5, sink=S, window=WIN - 1, score="retrieval", length=32, batch=2)
    assert plan.full[1].all() and int(plan.full[0].sum()) == 1
    assert plan.free().tolist() == [[False, False], [True, True]]
    assert plan.decided()[1] == ["model window", "model window"] and "index" in plan.decided()[0] + ["retrieval"]
    assert "2 of them within their layer's own window" in plan.summary()
    assert plan.model == model_map(model).shape and plan.nbytes(64, model)[0] < plan.nbytes(64, model)[1]
    wide = find(model, full=0.5, sink=S, window=WIN - 2, score="retrieval", length=32, batch=2)
    assert int(wide.full.sum()) == 2 and not wide.free().any()
    every = find(model, full=1.0, sink=S, window=WIN - 1, score="retrieval", length=32, batch=2)
    assert every.full.all() and every.nbytes(64, model)[0] == every.nbytes(64, model)[1]


def test_a_plan_for_other_layer_types_is_refused_naming_both():
    gemma, mistral = _model("gemma2"), _model("mistral")  # both 2 layers of Hkv=2 K/V heads, other layer types
    plan = find(gemma, full=0.5, sink=S, window=W, score="retrieval", length=32, batch=2)
    with pytest.raises(ShapeError, match=r"sliding_attention \(window 7\) \+ 1 full_attention\].*"
                                         r"is \[layers=2, H=4, Hkv=2, d=16; 2 sliding_attention"):
        plan.cache(mistral)
    with pytest.raises(ShapeError, match="made for"):
        plan.nbytes(10, mistral)


def test_the_models_own_layout_written_as_a_plan_is_the_models_own_cache():
    """Global layers full, sliding layers streaming with sink=0 and window = the model's window − 1: the
    sliding heads see what the model lets them see, so the plan is the model's own cache, logits and
    tensors exactly (the streaming heads within their layer's window run as full heads)."""
    model = _model("gemma3")
    shape = model_map(model).shape
    full = torch.tensor([[t == "full_attention"] * shape.kv_heads for t in shape.layer_types])  # [L, Hkv]
    plan = Plan(full, sink=0, window=WIN - 1)
    assert plan.free(shape)[:2].all() and not plan.full[:2].any()
    ids, am = _inputs()
    cache, own = plan.cache(model), transformers.DynamicCache(config=model.config)
    seq, logits = _generate(model, ids, am, cache=cache)
    ref_seq, ref = _generate(model, ids, am, cache=own)
    assert torch.equal(logits, ref) and torch.equal(seq, ref_seq)
    for mine, theirs in zip(cache.budget_layers, own.layers):
        assert torch.equal(mine.fk, theirs.keys) and torch.equal(mine.fv, theirs.values)
    n = seq.shape[1] - 1
    held, theirs = plan.nbytes(n, model, batch=2)
    assert held == theirs == _bytes(own) and cache.nbytes() == _allocated(cache)
    assert cache.nbytes() - held == _position(model, 2) * _sliding(shape)  # the view each decode step leaves, as theirs
    with plan.emulate(model):  # nothing to edit (so even the model's own cache may be given): the model itself
        assert torch.equal(_generate(model, ids, am, cache=transformers.DynamicCache(config=model.config))[1], logits)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "llama4"])
@torch.no_grad()
def test_any_chunking_past_the_window_equals_one_emulated_forward(name):
    """Prefill in chunks (Q > 1 after the layers dropped keys: a frame that starts past position 0) and
    single steps read what each layer holds."""
    model = _model(name)
    ids, am = _inputs(N=24)
    plan = _mixed(model)
    cache, outs, s = plan.cache(model), [], 0
    for c in (9, 1, 6, 1, 7):
        outs.append(model(input_ids=ids[:, s:s + c], attention_mask=am[:, :s + c], cache=cache).logits)  # [B, c, V]
        s += c
    with plan.emulate(model):
        ref = model(input_ids=ids, attention_mask=am).logits  # [B, N, V]
    assert_models_close(torch.cat(outs, 1), ref, width=96, layers=model.config.num_hidden_layers, msg=name)
