"""KVCache: incremental attention equals a full recompute; windows, rollback, in-place writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bhqk import masks
from bhqk.errors import MaskError, ShapeError
from bhqk.nn import KVCache, MultiHeadAttention
from tolerance import assert_models_close


def make_mha(D=32, H=4, Hkv=None, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(D, H, num_kv_heads=Hkv).eval()


def run_chunks(m, x, chunks, cache, mask_fn):
    """Feed x [B, N, D] in chunks through the cache; the outputs side by side [B, N, D]."""
    outs, s = [], 0
    for n in chunks:
        outs.append(m(x[:, s : s + n], mask=mask_fn(s, s + n), cache=cache))
        s += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("Hkv", [None, 2, 1])
def test_incremental_equals_full_recompute(Hkv):
    m = make_mha(Hkv=Hkv)
    x = torch.randn(2, 23, 32)
    full = m(x, mask=masks.causal())
    cache = KVCache(1, capacity=23)
    inc = run_chunks(m, x, [9, 1, 1, 5, 1, 1, 1, 4], cache, lambda s, e: masks.causal("bottom_right"))
    assert_models_close(inc, full, width=32, layers=1)
    assert cache.length == 23
    assert cache.state()["layers"][0]["keys"] == [2, Hkv or 4, 23, 8]


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    capacity=st.one_of(st.none(), st.integers(1, 40)),
    B=st.integers(1, 3),
)
def test_any_chunking_any_capacity(chunks, capacity, B):
    m = make_mha(D=16, H=2)
    N = sum(chunks)
    x = torch.randn(B, N, 16)
    full = m(x, mask=masks.causal())
    inc = run_chunks(m, x, chunks, KVCache(1, capacity=capacity), lambda s, e: masks.causal("bottom_right"))
    assert_models_close(inc, full, width=32, layers=1)


@torch.no_grad()  # inference; under autograd each step builds new buffers (see the autograd test)
def test_writes_in_place_into_preallocated_buffers():
    m = make_mha()
    cache = KVCache(1, capacity=16)
    x = torch.randn(1, 16, 32)
    m(x[:, :4], mask=masks.causal(), cache=cache)
    ptr = cache[0].k.data_ptr()
    for i in range(4, 16):
        m(x[:, i : i + 1], cache=cache)
    assert cache[0].k.data_ptr() == ptr, "the buffer was reallocated although capacity sufficed"
    assert cache[0].k.shape[2] == 16


def test_grows_past_capacity_and_keeps_values():
    m = make_mha()
    x = torch.randn(1, 30, 32)
    cache = KVCache(1, capacity=4)
    inc = run_chunks(m, x, [3] + [1] * 27, cache, lambda s, e: masks.causal("bottom_right"))
    assert_models_close(inc, m(x, mask=masks.causal()), width=32, layers=1)
    assert cache[0].k.shape[2] >= 30


def test_key_padding_with_cache():
    """A left-padded batch: the mask covers cached + new keys, [B, K_total]."""
    m = make_mha()
    x = torch.randn(2, 12, 32)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :3] = False
    full = m(x, mask=masks.causal() & masks.key_padding(valid))
    cache = KVCache(1)

    def mask(s, e):
        return masks.causal("bottom_right") & masks.key_padding(valid[:, :e])

    inc = run_chunks(m, x, [5, 1, 2, 1, 3], cache, mask)
    assert_models_close(inc[1, 3:], full[1, 3:], width=32, layers=1)
    assert_models_close(inc[0], full[0], width=32, layers=1)


@pytest.mark.parametrize("W", [1, 3, 6])
def test_sliding_window_eviction_equals_windowed_recompute(W):
    m = make_mha()
    x = torch.randn(2, 40, 32)
    window_mask = masks.sliding_window(W - 1, align="bottom_right")
    full = m(x, mask=masks.sliding_window(W - 1))
    cache = KVCache(1, window=W)
    chunks = [5, 1, 1, 7] + [1] * 26
    inc = run_chunks(m, x, chunks, cache, lambda s, e: window_mask)
    assert_models_close(inc, full, width=32, layers=1)
    assert cache.length == 40
    assert cache[0].kept < 40 and cache[0].k.shape[2] <= max(2 * W, 16, 7 + W)


def test_window_decoding_needs_no_mask_after_eviction():
    """With Q=1 the cache returns exactly the W keys the query may see."""
    m = make_mha()
    W = 4
    x = torch.randn(1, 20, 32)
    full = m(x, mask=masks.sliding_window(W - 1))
    cache = KVCache(1, window=W)
    outs = [m(x[:, i : i + 1], cache=cache) for i in range(20)]
    assert_models_close(torch.cat(outs, 1), full, width=32, layers=1)
    assert cache.span(1) == (20 - (W - 1), 21)


def test_span_matches_the_returned_keys():
    m = make_mha()
    x = torch.randn(1, 10, 32)
    for window in (None, 3):
        cache = KVCache(1, window=window)
        m(x[:, :6], mask=masks.causal(), cache=cache)
        first, last = cache.span(2)
        _, w = m(x[:, 6:8], mask=masks.causal("bottom_right"), cache=cache, return_weights=True)
        assert w.shape == (1, 4, 2, last - first)


def test_crop_rolls_back_and_recomputes_the_same():
    m = make_mha()
    x = torch.randn(1, 12, 32)
    draft = torch.randn(1, 4, 32)
    cache = KVCache(1)
    m(x[:, :8], mask=masks.causal(), cache=cache)
    m(draft, mask=masks.causal("bottom_right"), cache=cache)  # a rejected draft of 4 positions
    assert cache.length == 12
    cache.crop(8)
    assert cache.length == 8
    out = m(x[:, 8:], mask=masks.causal("bottom_right"), cache=cache)
    assert_models_close(out, m(x, mask=masks.causal())[:, 8:], width=32, layers=1)


def test_crop_errors():
    m = make_mha()
    cache = KVCache(1, window=3)
    m(torch.randn(1, 40, 32), mask=masks.sliding_window(2), cache=cache)
    for _ in range(20):
        m(torch.randn(1, 1, 32), cache=cache)
    with pytest.raises(ValueError, match="cannot crop to 61"):
        cache.crop(61)
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(5)
    cache.crop(59)  # still within the stored window
    assert cache.length == 59


@torch.no_grad()  # capacity is the inference buffers' (under autograd buffers hold exactly K)
def test_multi_layer_state_and_repr():
    cache = KVCache(3, capacity=8)
    ms = [make_mha(seed=i) for i in range(3)]
    x = torch.randn(2, 5, 32)
    for i, m in enumerate(ms):
        m(x, mask=masks.causal(), cache=cache[i])
    st_ = cache.state()
    assert st_["length"] == 5 and len(st_["layers"]) == 3
    assert all(layer["keys"] == [2, 4, 5, 8] and layer["capacity"] == 8 for layer in st_["layers"])
    assert "length=5" in repr(cache) and "[2, 4, 5, 8]" in repr(cache)
    with pytest.raises(ValueError, match=r"pass cache\[i\]"):
        ms[0](x, cache=cache)


def test_errors_name_what_is_wrong():
    m = make_mha()
    cache = KVCache(1)
    m(torch.randn(2, 3, 32), mask=masks.causal(), cache=cache)
    with pytest.raises(ShapeError, match="B=2"):
        m(torch.randn(3, 1, 32), cache=cache)
    with pytest.raises(MaskError, match="align"):
        m(torch.randn(2, 2, 32), mask=masks.causal(), cache=cache)  # Q=2 ≠ K=5 needs an explicit alignment
    with pytest.raises(ValueError, match="self-attention"):
        m(torch.randn(2, 1, 32), torch.randn(2, 4, 32), cache=cache)
    with pytest.raises(ValueError, match="window"):
        KVCache(1, window=0)


def test_reset():
    m = make_mha()
    cache = KVCache(1)
    x = torch.randn(1, 6, 32)
    m(x, mask=masks.causal(), cache=cache)
    cache.reset()
    assert cache.length == 0
    torch.testing.assert_close(m(x, mask=masks.causal(), cache=cache), m(x, mask=masks.causal()))


@torch.no_grad()  # in-place buffers are the inference path
def test_reset_keeps_buffers_and_accepts_new_sizes():
    m = make_mha()
    cache = KVCache(1, capacity=8)
    m(torch.randn(2, 3, 32), mask=masks.causal(), cache=cache)
    ptr = cache[0].k.data_ptr()
    cache.reset()
    m(torch.randn(2, 2, 32), mask=masks.causal(), cache=cache)
    assert cache[0].k.data_ptr() == ptr and cache.length == 2
    cache.reset()
    x = torch.randn(3, 4, 32)  # another batch size after a reset
    torch.testing.assert_close(m(x, mask=masks.causal(), cache=cache), m(x, mask=masks.causal()))


def test_backend_can_be_chosen_per_call():
    from bhqk.errors import BackendError

    m = make_mha()
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(m(x, mask=masks.causal(), backend="reference"), m(x, mask=masks.causal(), backend="torch"))
    with pytest.raises(BackendError, match="unknown backend"):
        m(x, backend="nope")


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_cache_under_autograd_prefill_decode_backward(window, backend):
    """Training through a prefill and decode steps: backward works (no in-place write into a tensor a
    graph saved) and the gradients equal those of one full causal call."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, backend=backend)
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    m = m.double()
    full_mask = masks.causal() if window is None else masks.sliding_window(window - 1, align="top_left")
    step_mask = masks.causal("bottom_right") if window is None else masks.sliding_window(window - 1, align="bottom_right")
    g = torch.randn(2, 7, 16, dtype=torch.float64)
    (m(x, mask=full_mask) * g).sum().backward()
    want_x, want_w = x.grad.clone(), m.q_proj.weight.grad.clone()
    x.grad = None
    m.zero_grad()
    cache = KVCache(1, window=window)
    inc = run_chunks(m, x, [4, 1, 1, 1], cache, lambda s, e: step_mask)  # prefill 4, then decode
    (inc * g).sum().backward()
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(m.q_proj.weight.grad, want_w)
    assert cache.length == 7
    with torch.no_grad():  # the same cache then keeps decoding without autograd
        m(torch.randn(2, 1, 16, dtype=torch.float64), mask=step_mask, cache=cache)
    assert cache.length == 8


@torch.no_grad()  # the inference buffers
def test_print_says_the_capacity_before_use_and_when_it_was_outgrown():
    """The buffers are allocated at the first call with room for `capacity` positions; a longer
    sequence reallocates them at twice the size, and print() says so."""
    cache = KVCache(num_layers=1, capacity=8)
    assert repr(cache) == "KVCache(layers=1, length=0, keys=None, values=None, capacity=8)"
    assert repr(cache[0]) == "LayerCache(layer 0, length=0, keys=None, values=None, capacity=8)"
    assert "capacity=16)" in repr(KVCache(2)) and "capacity=6)" in repr(KVCache(1, window=3))  # what the first call allocates
    m, x = make_mha(), torch.randn(1, 12, 32)
    m(x[:, :8], mask=masks.causal(), cache=cache)
    assert repr(cache).endswith("keys=[1, 4, 8, 8], values=[1, 4, 8, 8], capacity=8)")  # full, not grown
    m(x[:, 8:9], cache=cache)
    assert repr(cache).endswith("capacity=16, grown from 8)") and cache.state()["layers"][0]["grown_from"] == 8
    assert "grown from 8" in repr(cache[0]) and cache[0].k.shape[2] == 16
    cache.reset()
    m(x[:, :3], mask=masks.causal(), cache=cache)  # a reset keeps the grown buffers
    assert repr(cache).endswith("capacity=16, grown from 8)")
