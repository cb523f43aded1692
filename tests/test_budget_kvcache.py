"""Head-wise KV budgets on bhqk's own models: ``plan.kv_cache(model)`` (``KVCache(layers=...)``) holds
what the plan keeps (full heads every position, streaming heads a sink and a ring of window + 1), and
GPT-2 with it equals GPT-2 with an ordinary cache and the streaming heads restricted by
``bhqk.edit(mask=...)`` (``plan.emulate``); an all-full plan is the ordinary cache exactly."""

from __future__ import annotations

import pytest
import torch

from bhqk import masks
from bhqk.budget import Plan
from bhqk.budget.ring import BudgetLayerCache
from bhqk.errors import MaskError, ShapeError
from bhqk.models.gpt2 import GPT2, GPT2Config
from bhqk.nn import KVCache, MultiHeadAttention
from test_budget import V, _inputs  # ids [B, N] (row 1 left-padded) and their attention mask
from tolerance import assert_close, assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

S, W = 3, 5  # R = S + W + 1 = 9 slots: a 20-token prompt and 10 new tokens wrap the ring


def _gpt2(n_head=4):
    torch.manual_seed(0)
    return GPT2(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=n_head, n_inner=64)).eval()


def _mixed(full_heads=((0, 0), (1, 3)), H=4) -> Plan:
    full = torch.zeros(2, H, dtype=torch.bool)
    for li, g in full_heads:
        full[li, g] = True
    return Plan(full, sink=S, window=W)


@torch.no_grad()
def _steps(model, seq, am, N, cache):
    """The logits generate computes, teacher-forced on ``seq`` [B, N + n]: the prompt's last row, then
    one decode step per token → [n, B, V]."""
    out = [model(seq[:, :N], am[:, :N], cache=cache, last_only=True)[:, -1]]
    for t in range(N, seq.shape[1] - 1):
        out.append(model(seq[:, t:t + 1], am[:, :t + 1], cache=cache, last_only=True)[:, -1])
    return torch.stack(out)  # [n, B, V]


def _full_am(am, n):
    return torch.cat([am, torch.ones(am.shape[0], n, dtype=am.dtype)], 1)  # [B, N + n]


@pytest.mark.parametrize("kind", ["mixed", "streaming"])
def test_gpt2_generation_with_the_budget_cache_equals_the_edited_model(kind):
    model = _gpt2()
    ids, am = _inputs()
    plan = _mixed() if kind == "mixed" else Plan(torch.zeros(2, 4, dtype=torch.bool), sink=S, window=W)
    n = 10
    seq = model.generate(ids, n, attention_mask=am, cache=plan.kv_cache(model))  # [B, N + n]
    with plan.emulate(model):
        ref_seq = model.generate(ids, n, attention_mask=am)
    assert torch.equal(seq, ref_seq)
    am2 = _full_am(am, n)
    logits = _steps(model, seq, am2, ids.shape[1], plan.kv_cache(model))
    with plan.emulate(model):
        ref = _steps(model, seq, am2, ids.shape[1], model.new_cache())
    assert_models_close(logits, ref, width=64, layers=2, msg=f"{kind}: budget KVCache vs edit(mask=...)")
    plain = _steps(model, seq, am2, ids.shape[1], model.new_cache())
    assert (plain - ref).abs().max() > 1e-3, "the streaming mask must change something (else the test proves nothing)"


def test_an_all_full_plan_is_the_ordinary_cache_exactly():
    model = _gpt2()
    ids, am = _inputs()
    plan = Plan(torch.ones(2, 4, dtype=torch.bool), sink=S, window=W)
    cache = plan.kv_cache(model)
    assert all(type(layer).__name__ == "LayerCache" for layer in cache)
    seq = model.generate(ids, 10, attention_mask=am, cache=cache)
    assert torch.equal(seq, model.generate(ids, 10, attention_mask=am))
    am2 = _full_am(am, 10)
    got = _steps(model, seq, am2, 20, plan.kv_cache(model))
    assert torch.equal(got, _steps(model, seq, am2, 20, model.new_cache()))


@pytest.mark.parametrize("chunks", [[20], [4, 1, 1, 1, 13], [9, 1, 10], [12, 6, 1, 1], [2, 7, 11]])
def test_any_chunking_equals_one_edited_forward(chunks):
    """Prefill in chunks (Q > 1 before and after the ring wrapped) and decode steps (Q = 1) read what is held."""
    model = _gpt2()
    ids, am = _inputs()
    plan = _mixed()
    cache = plan.kv_cache(model)
    outs, s = [], 0
    with torch.no_grad():
        for c in chunks:
            outs.append(model(ids[:, s:s + c], am[:, :s + c], cache=cache))  # [B, c, V]
            s += c
        with plan.emulate(model):
            ref = model(ids, am)  # [B, N, V]
    assert_models_close(torch.cat(outs, 1), ref, width=64, layers=2, msg=f"chunks {chunks}")  # chunks [B, n_i, V] -> [B, N, V]


@torch.no_grad()
def test_the_cache_holds_the_sink_and_a_ring_of_window_plus_one():
    model = _gpt2()
    ids, am = _inputs(N=6)
    plan = _mixed()
    cache = plan.kv_cache(model, capacity=32)
    layer = cache[0]
    assert isinstance(layer, BudgetLayerCache)
    wrote = []  # the keys [B, Hkv, Q, d] of each call, as the model handed them to the cache
    attend = layer.attention

    def spy(q, k, v, *args, **kwargs):
        wrote.append(k.clone())
        return attend(q, k, v, *args, **kwargs)

    layer.attention = spy
    model.generate(ids, 20, attention_mask=am, cache=cache)  # [B, 26]
    written = 6 + 20 - 1
    assert cache.length == written
    assert layer.positions(0).tolist() == list(range(written))  # full
    held = layer.positions(1)  # streaming: the slot of each position held
    assert sorted(held.tolist()) == [0, 1, 2] + list(range(written - W - 1, written))
    want = torch.cat(wrote, 2)[:, layer.stream]  # [B, Hkv, written, d] -> [B, 3, written, d]: the three streaming heads
    assert want.shape[2] == written
    assert torch.equal(layer.k, want[:, :, held])  # copies of what was written: bit for bit
    B, d = 2, 8
    per = d * 4 * B  # one position of one head, float32, both rows: keys or values
    assert layer.nbytes() == 2 * per * (1 * 32 + 3 * (S + W + 1))  # full head: its 32-position buffer
    assert cache.nbytes() == 2 * 2 * per * (1 * 32 + 3 * (S + W + 1))  # both layers: one full head, three streaming


@torch.no_grad()
def test_crop_is_exact_where_the_ring_holds_what_the_next_query_needs():
    model = _gpt2()
    ids, am = _inputs(B=1)
    plan = _mixed()
    cache = plan.kv_cache(model)
    model(ids[:, :15], cache=cache)
    a = model(ids[:, 15:16], cache=cache)  # [1, 1, V]: position 15
    cache.crop(15)  # one back: the ring (window + 1 slots) still holds 15 − W … 14, what position 15 sees
    b = model(ids[:, 15:16], cache=cache)
    assert torch.equal(b, a)  # the same state, the same step
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(10)
    short = plan.kv_cache(model)
    model(ids[:, :8], cache=short)  # 8 < R = 9: nothing evicted, any crop is exact
    short.crop(3)
    c = model(ids[:, 3:16], cache=short)[:, -1]
    with plan.emulate(model):
        ref = model(ids[:, :16])[:, -1]
    assert_models_close(c, ref, width=64, layers=2)


@torch.no_grad()
def test_weights_come_back_in_head_order_with_evicted_keys_zero():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    plan = Plan(torch.tensor([[True, False]]), sink=S, window=W)
    x = torch.randn(1, 16, 32)
    cache, plain = plan.kv_cache(), KVCache(1)
    mha(x[:, :12], mask=masks.causal("bottom_right"), cache=cache)
    mha(x[:, :12], mask=masks.causal("bottom_right"), cache=plain)
    out, w = mha(x[:, 12:], mask=masks.causal("bottom_right"), cache=cache, return_weights=True)  # [1, 4, 4, 16]
    out_ref, w_ref = mha(x[:, 12:], mask=masks.causal("bottom_right"), cache=plain, return_weights=True)
    assert_close(w[:, :2], w_ref[:, :2], n=16)  # K/V head 0 (query heads 0, 1) is full: a softmax over 16 keys
    allowed = (~masks.key_span(0, S) | masks.sliding_window(W, align="bottom_right")) & masks.causal("bottom_right")
    seen = allowed.materialize(1, 1, 4, 16)[0, 0]  # [4, 16]
    assert bool((w[:, 2:] * ~seen).eq(0).all()) and not bool((w_ref[:, 2:] * ~seen).eq(0).all())
    assert_close(w[:, 2:].sum(-1), torch.ones(1, 2, 4), n=16)  # rows of the streaming heads sum to 1


def test_errors_name_what_is_wrong():
    model = _gpt2()
    with pytest.raises(ShapeError, match=r"layers=3, Hkv=4\].*GPT2 is \[layers=2, H=4, Hkv=4, d=8"):
        Plan(torch.ones(3, 4, dtype=torch.bool)).kv_cache(model)
    with pytest.raises(ShapeError, match="num_layers=2"):
        KVCache(2, layers=Plan(torch.zeros(3, 4, dtype=torch.bool)).kv_cache().layers)
    with pytest.raises(ValueError, match="window= or layers="):
        KVCache(2, window=4, layers=_mixed().kv_cache().layers)
    ids, _ = _inputs(B=1)
    with pytest.raises(ShapeError, match="Hkv=2"):  # a cache made without the model: refused at the first write
        model(ids, cache=Plan(torch.zeros(2, 2, dtype=torch.bool)).kv_cache())
    cache = _mixed().kv_cache(model)
    with torch.no_grad():
        model(ids[:, :2], cache=cache)
    with pytest.raises(ValueError, match="empty cache"):
        model.generate(ids, 2, cache=cache)
    mha = MultiHeadAttention(32, 4).eval()
    one = Plan(torch.tensor([[True, False, False, False]])).kv_cache()
    with pytest.raises(ValueError, match="torch.no_grad"):
        mha(torch.randn(1, 3, 32, requires_grad=True), cache=one)
    with torch.no_grad(), pytest.raises(ValueError, match="bias="):
        mha(torch.randn(1, 3, 32), bias=torch.zeros(3, 3), cache=one)
    with pytest.raises(TypeError, match="attention"):
        one[0].update(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))


@torch.no_grad()
def test_a_refused_crop_or_call_changes_nothing_and_an_emptied_cache_takes_new_sizes():
    """crop is all layers or none (layer 0 all full could crop, layer 1's ring cannot); a head-dependent
    mask is refused before anything is written; after reset() the cache takes another batch size, and
    a filled cache names a size that does not fit; a cache of the wrong depth is refused by GPT-2."""
    model = _gpt2()
    ids, am = _inputs(B=1)
    plan = Plan(torch.tensor([[True] * 4, [True, False, False, False]]), sink=S, window=W)
    cache = plan.kv_cache(model)
    model(ids[:, :20], cache=cache)
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(12)
    assert [layer.length for layer in cache] == [20, 20]  # layer 0 (all full, a plain layer) was not cropped first
    layer = cache[1]
    k = torch.randn(1, 4, 1, 8)  # [B, Hkv, Q=1, d]
    per_head = masks.per_head([masks.causal("bottom_right")] * 2 + [masks.sliding_window(2, align="bottom_right")] * 2)
    with pytest.raises(MaskError, match="head-dependent"):
        layer.attention(torch.randn(1, 4, 1, 8), k, k, per_head)
    assert layer.length == 20 and layer.full_cache.length == 20
    k2 = torch.randn(2, 4, 1, 8)  # [B=2, Hkv, Q=1, d]: another batch size
    with pytest.raises(ShapeError, match="holds B=1.*but got B=2"):
        layer.attention(torch.randn(2, 4, 1, 8), k2, k2)
    assert layer.length == 20 and layer.full_cache.length == 20
    cache.reset()
    ids2, am2 = _inputs(B=2)
    got = model.generate(ids2, 4, attention_mask=am2, cache=cache)  # the emptied cache, another batch size
    with plan.emulate(model):
        assert torch.equal(got, model.generate(ids2, 4, attention_mask=am2))
    with pytest.raises(ValueError, match="cache= has 1 layers but this GPT-2 has 2"):
        model(ids[:, :4], cache=Plan(torch.ones(1, 4, dtype=torch.bool), sink=S, window=W).kv_cache())


@torch.no_grad()
def test_a_stream_shorter_than_the_sink_holds_every_position_and_crops():
    """sink=64 and 13 + 4 positions: the ring never wraps, every position is held, any crop is exact."""
    model = _gpt2()
    ids, am = _inputs(B=1, N=13)
    plan = Plan(_mixed().full, sink=64, window=W)
    cache = plan.kv_cache(model)
    seq = model.generate(ids, 4, attention_mask=am, cache=cache)  # [1, 17]
    assert cache.length == 16 and cache[0].positions(1).tolist() == list(range(16))
    cache.crop(13)
    assert cache[0].positions(1).tolist() == list(range(13))
    out = model(seq[:, 13:], cache=cache)  # [1, 4, V]
    with plan.emulate(model):
        ref = model(seq)[:, 13:]
    assert_models_close(out, ref, width=64, layers=2)


@torch.no_grad()
def test_a_plan_for_another_model_is_refused_before_anything_is_stored():
    """A plan records the model it was made for (GPT-2 here: d = 8): ``kv_cache(other)`` names both shapes;
    a cache made without the model refuses the first keys of another head size in every layer, a layer
    whose heads are all full (a plain LayerCache) too, before storing them."""
    from bhqk.budget.plan import model_map

    model = _gpt2()
    other = GPT2(GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=64)).eval()  # d = 16
    shape = model_map(model).shape
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.model_type) == (2, 4, 4, 8, "GPT2")
    ids, _ = _inputs(B=1)
    for full in (_mixed().full, torch.ones(2, 4, dtype=torch.bool)):
        plan = Plan(full, sink=S, window=W, model=shape)
        with pytest.raises(ShapeError, match=r"made for \[layers=2, H=4, Hkv=4, d=8.*GPT2 is \[layers=2, H=4, Hkv=4, d=16"):
            plan.kv_cache(other)
        cache = plan.kv_cache()
        with pytest.raises(ShapeError, match=r"layer 0: the plan has Hkv=4 K/V heads, d=8 but .* \[1, 4, 20, 16\]"):
            other(ids, cache=cache)
        assert cache.length == 0 and cache.nbytes() == 0
