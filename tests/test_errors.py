"""One test per user mistake: each error names the argument and the dimension that is wrong."""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from conftest import qkv


def test_inner_dimension_d_mismatch_names_d_and_both_shapes():
    q, k, v = torch.randn(2, 8, 5, 8), torch.randn(2, 8, 7, 16), torch.randn(2, 8, 7, 8)
    with pytest.raises(bhqk.ShapeError) as e:
        bhqk.attention(q, k, v)
    msg = str(e.value)
    assert "k has head dimension d=16 but q has d=8" in msg
    assert "Q·Kᵀ needs the same inner dimension d" in msg
    assert "q: [B=2, H=8, Q=5, d=8]" in msg and "k: [B=2, Hkv=8, K=7, d=16]" in msg
    assert isinstance(e.value, ValueError)


def test_v_key_length_differs_from_k():
    q, k, _ = qkv(2, 4, None, 5, 7, 8)
    v = torch.randn(2, 4, 6, 8, dtype=q.dtype)
    with pytest.raises(bhqk.ShapeError, match=r"v has key length K=6 but k has K=7.*one value vector per key"):
        bhqk.attention(q, k, v)


def test_batch_mismatch():
    q, k, v = qkv(2, 4, None, 5, 7, 8)
    with pytest.raises(bhqk.ShapeError, match=r"k has batch size B=3 but q has B=2"):
        bhqk.attention(q, k.repeat(3, 1, 1, 1)[:3], v)


def test_heads_not_divisible_by_kv_heads():
    q, k, v = qkv(1, 6, 4, 5, 7, 8)
    with pytest.raises(bhqk.ShapeError, match=r"H=6 is not divisible by Hkv=4"):
        bhqk.attention(q, k, v)


def test_kv_heads_mismatch_between_k_and_v():
    q, k, _ = qkv(1, 4, 2, 5, 7, 8)
    v = torch.randn(1, 4, 7, 8, dtype=q.dtype)
    with pytest.raises(bhqk.ShapeError, match=r"v has number of key/value heads Hkv=4 but k has Hkv=2"):
        bhqk.attention(q, k, v)


def test_model_width_not_divisible_by_heads():
    with pytest.raises(bhqk.ShapeError, match=r"D=10 is not divisible by H=4"):
        bhqk.MultiHeadAttention(10, 4)


def test_wrong_rank_says_what_each_axis_is():
    q = torch.randn(5, 8)
    with pytest.raises(bhqk.ShapeError, match=r"q must be 4-D \[B, H, Q, d\].*got 2-D.*Q \(query length\)"):
        bhqk.attention(q, q, q)


def test_mask_that_does_not_broadcast_names_the_axis():
    q, k, v = qkv(2, 4, None, 5, 7, 8)
    with pytest.raises(bhqk.MaskError, match=r"mask axis K \(key length\) has size 6 but K=7"):
        bhqk.attention(q, k, v, torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(bhqk.MaskError, match=r"mask axis B \(batch size\) has size 3 but B=2"):
        bhqk.attention(q, k, v, torch.ones(3, 1, 5, 7, dtype=torch.bool))
    with pytest.raises(bhqk.MaskError, match=r"5 axes"):
        bhqk.attention(q, k, v, torch.ones(1, 2, 4, 5, 7, dtype=torch.bool))


def test_float_mask_points_to_bias():
    q, k, v = qkv(1, 2, None, 3, 4, 8)
    with pytest.raises(bhqk.MaskError, match=r"additive bias: pass it as bias="):
        bhqk.attention(q, k, v, torch.zeros(3, 4))


def test_int_mask_points_to_bool():
    q, k, v = qkv(1, 2, None, 3, 4, 8)
    with pytest.raises(bhqk.MaskError, match=r"torch.bool"):
        bhqk.attention(q, k, v, torch.ones(3, 4, dtype=torch.long))


def test_nan_in_bias_is_an_error():
    q, k, v = qkv(1, 2, None, 3, 4, 8)
    b = torch.zeros(3, 4, dtype=q.dtype)
    b[0, 0] = float("nan")
    with pytest.raises(bhqk.MaskError, match=r"NaN"):
        bhqk.attention(q, k, v, bias=b)


def test_bool_bias_points_to_mask():
    q, k, v = qkv(1, 2, None, 3, 4, 8)
    with pytest.raises(bhqk.MaskError, match=r"bool tensor is a mask"):
        bhqk.attention(q, k, v, bias=torch.ones(3, 4, dtype=torch.bool))


def test_dtype_and_device_mismatch():
    q, k, v = qkv(1, 2, None, 3, 4, 8)
    with pytest.raises(bhqk.ShapeError, match=r"k has dtype torch.float32 but q has torch.float64"):
        bhqk.attention(q, k.float(), v)
    with pytest.raises(bhqk.ShapeError, match=r"floating-point"):
        bhqk.attention(q.long(), k.long(), v.long())
    with pytest.raises(bhqk.ShapeError, match=r"is on meta but q is on cpu"):
        bhqk.attention(q, k.to("meta"), v)


def test_causal_without_alignment_when_q_differs_from_k_explains_both_choices():
    q, k, v = qkv(1, 2, None, 3, 5, 8)
    with pytest.raises(bhqk.MaskError) as e:
        bhqk.attention(q, k, v, masks.causal())
    assert "top_left" in str(e.value) and "bottom_right" in str(e.value) and "Q=3 ≠ K=5" in str(e.value)


def test_padding_lengths_must_match_batch():
    q, k, v = qkv(2, 2, None, 3, 5, 8)
    with pytest.raises(bhqk.MaskError, match=r"lengths has 3 entries but B=2"):
        bhqk.attention(q, k, v, masks.padding(torch.tensor([1, 2, 3])))
    with pytest.raises(bhqk.MaskError, match=r"integer tensor"):
        masks.padding(torch.tensor([1.0, 2.0]))


def test_document_ids_length_must_match():
    q, k, v = qkv(1, 2, None, 3, 5, 8)
    with pytest.raises(bhqk.MaskError, match=r"k_ids has length 4 but K=5"):
        bhqk.attention(q, k, v, masks.document(torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1, 1])))


def test_alibi_head_count_must_match():
    q, k, v = qkv(1, 2, None, 3, 3, 8)
    with pytest.raises(bhqk.MaskError, match=r"alibi was built for 4 heads but H=2"):
        bhqk.attention(q, k, v, bias=bhqk.bias.alibi(4))


def test_module_input_width_and_layout_errors():
    mha = bhqk.MultiHeadAttention(16, 4)
    with pytest.raises(bhqk.ShapeError, match=r"x has model width D=12 but given has D=16"):
        mha(torch.randn(2, 5, 12))
    with pytest.raises(bhqk.ShapeError, match=r"key has batch size B=3 but x has B=2"):
        mha(torch.randn(2, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(bhqk.ShapeError, match=r"x must be 3-D \[B, Q, D\]"):
        mha(torch.randn(5, 16))
    with pytest.raises(bhqk.ShapeError, match=r"layout must be one of"):
        bhqk.attention(*qkv(1, 1, None, 2, 2, 2), layout="hbnd")


def test_split_heads_error_names_width():
    with pytest.raises(bhqk.ShapeError, match=r"width 10, not divisible by H=4"):
        bhqk.split_heads(torch.randn(1, 3, 10), 4)
