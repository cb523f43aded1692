"""merge: attention over A ∪ B from attention over A and over B (disjoint keys), exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bhqk
from bhqk import masks
from bhqk.errors import ShapeError
from bhqk.functional.merge import merge, merge_
from conftest import qkv
from tolerance import assert_close, assert_paths_close

NEG = float("-inf")


def _split_attention(q, k, v, base, in_a, **kw):
    """Attention over the keys in_a [K] and over the rest, each restricted further by ``base``."""
    part = lambda keep: masks.dense(keep[None, None, None, :]) if base is None else base & masks.dense(keep[None, None, None, :])  # noqa: E731
    a = bhqk.attention(q, k, v, part(in_a), backend="reference", return_lse=True, **kw)
    b = bhqk.attention(q, k, v, part(~in_a), backend="reference", return_lse=True, **kw)
    return a, b


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), g=st.integers(1, 2), Q=st.integers(1, 9), K=st.integers(1, 12),
       d=st.integers(1, 6), dv=st.integers(1, 6), kind=st.sampled_from(["none", "causal", "dense", "padding"]),
       data=st.data())
def test_merging_any_split_of_the_keys_equals_attention_over_all(B, Hkv, g, Q, K, d, dv, kind, data):
    H = Hkv * g
    seed = data.draw(st.integers(0, 2**16))
    q, k, v = qkv(B, H, Hkv, Q, K, d, dv, seed=seed)
    in_a = torch.tensor(data.draw(st.lists(st.booleans(), min_size=K, max_size=K)))
    gen = torch.Generator().manual_seed(seed)
    base = {
        "none": None,
        "causal": masks.causal("bottom_right"),
        "dense": masks.dense(torch.rand(B, 1, Q, K, generator=gen) > 0.5),  # some rows fully masked
        "padding": masks.padding(torch.randint(0, K + 1, (B,), generator=gen)),
    }[kind]
    (oa, la), (ob, lb) = _split_attention(q, k, v, base, in_a)
    want, want_lse = bhqk.attention(q, k, v, base, backend="reference", return_lse=True)
    out, lse = merge(oa, la, ob, lb)
    assert_paths_close(out, want, n=K)
    assert_paths_close(lse, want_lse, n=K)  # -inf where both are -inf
    out2, lse2 = merge(ob, lb, oa, la)  # the order does not matter
    assert_close(out2, out, n=2)
    assert_close(lse2, lse, n=2)


def test_three_way_split_merges_in_any_grouping():
    q, k, v = qkv(2, 4, 2, 6, 9, 5, 3)
    part = torch.tensor([0, 1, 2, 0, 1, 2, 2, 0, 1])
    res = [bhqk.attention(q, k, v, (part == i)[None, None, None, :], backend="reference", return_lse=True) for i in range(3)]
    left = merge(*merge(*res[0], *res[1]), *res[2])
    right = merge(*res[0], *merge(*res[1], *res[2]))
    want, want_lse = bhqk.attention(q, k, v, backend="reference", return_lse=True)
    for out, lse in (left, right):
        assert_paths_close(out, want, n=9)
        assert_paths_close(lse, want_lse, n=9)


def test_gradients_through_merge_equal_gradients_of_attention_over_all():
    q, k, v = qkv(2, 4, 2, 7, 10, 6, 5, requires_grad=True)
    in_a = torch.tensor([True, False] * 5)  # every row sees keys on both sides (no mask)
    (oa, la), (ob, lb) = _split_attention(q, k, v, None, in_a)
    out, _ = merge(oa, la, ob, lb)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((bhqk.attention(q, k, v, backend="reference") * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert_paths_close(a, b, n=10 * 7)


def test_one_empty_side_takes_the_other_even_if_it_holds_garbage():
    out_a = torch.full((1, 2, 3, 4), float("nan"), dtype=torch.float64)  # an empty side may hold anything
    lse_a = torch.full((1, 2, 3), NEG, dtype=torch.float64)
    out_b = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    lse_b = torch.randn(1, 2, 3, dtype=torch.float64)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
    out, lse = merge(out_b, lse_b, out_a, lse_a)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)


def test_both_sides_empty_give_zero_and_minus_inf_with_finite_gradients():
    out_a = torch.randn(2, 3, 4, 5, requires_grad=True)
    out_b = torch.randn(2, 3, 4, 5, requires_grad=True)
    lse_a = torch.full((2, 3, 4), NEG, requires_grad=True)
    lse_b = torch.full((2, 3, 4), NEG).index_fill(2, torch.tensor([1]), 0.5).requires_grad_()  # row 1 sees keys on b
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    dead = torch.tensor([0, 2, 3])
    assert (out[:, :, dead] == 0).all() and torch.isneginf(lse[:, :, dead]).all()
    assert torch.equal(out[:, :, 1], out_b[:, :, 1]) and (lse[:, :, 1] == 0.5).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (out_a, out_b, lse_a, lse_b):
        assert torch.isfinite(t.grad).all()
    assert (out_a.grad == 0).all()  # side a saw nothing: it contributes nothing
    assert (out_b.grad[:, :, dead] == 0).all() and (out_b.grad[:, :, 1] == 1).all()


def test_low_precision_outputs_merge_in_float32():
    q, k, v = qkv(1, 2, None, 5, 8, 4, dtype=torch.float32)
    keys = torch.arange(8) < 3
    (oa, la), (ob, lb) = _split_attention(q, k, v, None, keys)
    out, lse = merge(oa.bfloat16(), la, ob.bfloat16(), lb)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = bhqk.attention(q, k, v, backend="reference")
    assert_close(out, want, n=8)  # bf16's bound: the partials were rounded to it


def test_in_place_merge_equals_merge():
    q, k, v = qkv(2, 3, None, 6, 9, 4, dtype=torch.float32)
    m = masks.causal("top_left")  # query 0 sees only key 0: empty on side b
    (oa, la), (ob, lb) = _split_attention(q, k, v, m, torch.arange(9) < 2)
    acc_out, acc_lse = torch.zeros_like(oa), torch.full_like(la, NEG)
    for o, lse_ in ((oa, la), (ob, lb)):
        merge_(acc_out, acc_lse, o, lse_)
    out, lse = merge(oa, la, ob, lb)
    assert_close(acc_out, out, n=2)
    assert_close(acc_lse, lse, n=2)


@pytest.mark.parametrize("bad", ["out_shape", "lse_shape", "int"])
def test_mismatched_inputs_are_shape_errors(bad):
    out, lse = torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4)
    args = {
        "out_shape": (out, lse, torch.zeros(2, 3, 4, 6), lse),
        "lse_shape": (out, lse, out, torch.zeros(2, 3, 5)),
        "int": (out, lse, out, lse.long()),
    }[bad]
    with pytest.raises(ShapeError, match="merge"):
        merge(*args)
