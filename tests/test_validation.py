"""Arguments are checked where they enter: every bad value is a ValueError/TypeError subclass that names
the argument; calls that run but almost surely mean something else warn with MisuseWarning."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import bhqk
from bhqk import masks
from bhqk.errors import MaskError, MisuseWarning, ShapeError
from bhqk.nn import MultiHeadAttention

# --- mask constructors ---------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: masks.padding(2.5), r"padding: lengths must be an integer.*2\.5"),
    (lambda: masks.padding(2.0), r"padding: lengths must be an integer.*2\.0"),
    (lambda: masks.padding(True), r"padding: lengths must be an integer.*True"),
    (lambda: masks.padding("3"), r"padding: lengths must be an integer.*'3'"),
    (lambda: masks.padding(-1), r"padding: lengths must be an integer with lengths >= 0, got -1"),
    (lambda: masks.padding(torch.tensor([2.5, 3.0])), r"padding: lengths must be .*1-D integer tensor.*float32"),
    (lambda: masks.padding(torch.tensor([True, False])), r"padding: lengths must be .*torch.bool"),
    (lambda: masks.padding(torch.tensor([[1, 2]])), r"padding: lengths must be .*shape \[1, 2\]"),
    (lambda: masks.padding(torch.tensor([3, -1])), r"padding: lengths must be >= 0, got \[3, -1\]"),
    (lambda: masks.padding([3, 2.5]), r"padding: lengths\[1\] must be an integer"),
    (lambda: masks.padding([]), r"padding: lengths is an empty list"),
    (lambda: masks.sliding_window("3"), r"sliding_window: left must be an integer.*'3'"),
    (lambda: masks.sliding_window(2.0), r"sliding_window: left must be an integer"),
    (lambda: masks.sliding_window(2, right=-1), r"sliding_window: right must be an integer with right >= 0"),
    (lambda: masks.sliding_window(2, align="left"), r"sliding_window: align must be 'top_left' or 'bottom_right'"),
    (lambda: masks.causal(align=1), r"causal: align must be 'top_left' or 'bottom_right'"),
    (lambda: masks.prefix_lm(1.5), r"prefix_lm: prefix_len must be an integer"),
    (lambda: masks.prefix_lm(2, align="x"), r"prefix_lm: align must be"),
    (lambda: masks.predicate("not a function"), r"predicate: fn must be a function"),
    (lambda: masks.predicate(lambda b, h, q, k: q >= k, name=3), r"predicate: name must be a string"),
    (lambda: masks.document(torch.tensor([0.0, 1.0])), r"document: q_ids must be an integer tensor"),
    (lambda: masks.key_padding(torch.ones(2, 3, dtype=torch.long)), r"key_padding: valid must be a bool tensor.*from_hf"),
    (lambda: masks.dense(torch.ones(3, 3)), r"mask must have dtype torch.bool.*bias="),
    (lambda: masks.from_hf(torch.tensor([[1.0, 0.5]])), r"from_hf: attention_mask must hold only 1 .* and 0"),
    (lambda: masks.from_hf(torch.tensor([[0.0, float("-inf")]])), r"from_hf: attention_mask must hold only 1"),
    (lambda: masks.from_hf([[1, 0]]), r"from_hf: attention_mask must be a tensor \[B, K\]"),
    (lambda: masks.causal().materialize(1, 1, -3, 4), r"materialize: Q must be an integer with Q >= 0, got -3"),
    (lambda: masks.causal().materialize(1, 1.5, 3, 3), r"materialize: H must be an integer"),
    (lambda: masks.causal().materialize(-1, 1, 3, 3), r"materialize: B must be an integer with B >= 0"),
    (lambda: masks.and_masks(), r"and_masks needs at least one mask"),
    (lambda: masks.or_masks(), r"or_masks needs at least one mask"),
    (lambda: masks.and_masks(masks.causal(), 3), r"cannot combine a mask with int"),
])
def test_mask_arguments_are_mask_errors_naming_the_argument(make, match):
    with pytest.raises(MaskError, match=match):
        make()


def test_padding_takes_a_list_and_a_zero_d_tensor():
    want = masks.padding(torch.tensor([3, 4])).materialize(2, 1, 2, 5)
    assert torch.equal(masks.padding([3, 4]).materialize(2, 1, 2, 5), want)
    assert torch.equal(masks.padding((3, 4)).materialize(2, 1, 2, 5), want)
    assert torch.equal(masks.padding(torch.tensor(3)).materialize(1, 1, 2, 5), masks.padding(3).materialize(1, 1, 2, 5))
    prefix = masks.prefix_lm([1, 2], align="top_left").materialize(2, 1, 3, 3)  # [B=2, 1, Q=3, K=3]
    assert torch.equal(prefix[1, 0, 0], torch.tensor([True, True, False]))


def test_padding_lengths_are_one_count_on_every_backend():
    """padding(2.5) used to attend 3 keys on the reference and 2 on tiled; integers only now, and
    every backend attends exactly the first `length` keys."""
    q = torch.randn(2, 2, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    outs = [bhqk.attention(q, k, v, masks.padding([3, 5]), backend=b) for b in ("reference", "tiled", "torch")]
    want = bhqk.attention(q, k, v, torch.arange(6)[None, None, None, :] < torch.tensor([3, 5])[:, None, None, None])
    for out in outs:
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", ["reference", "tiled", "torch"])
@pytest.mark.parametrize("fn, match", [
    (lambda b, h, q, k: torch.ones(3, dtype=torch.bool), r"fn returned shape \[3\], which does not broadcast"),
    (lambda b, h, q, k: q - k, r"fn must return a bool tensor.*dtype torch.int64"),
    (lambda b, h, q, k: True, r"fn must return a bool tensor.*got bool"),
])
def test_predicate_result_of_wrong_shape_or_dtype(backend, fn, match):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(MaskError, match=r"predicate bad: " + match):
        bhqk.attention(q, q, q, masks.predicate(fn, "bad"), backend=backend)


def test_predicate_may_return_any_broadcastable_shape():
    m = masks.predicate(lambda b, h, q, k: (q >= k)[0, 0], "2-D")  # [q, k]
    assert torch.equal(m.materialize(1, 1, 4, 4)[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


# --- nn.MultiheadAttention conversions ------------------------------------------------------------

def test_from_torch_mha_is_keyword_only():
    causal_mha = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)  # True = masked out
    with pytest.raises(TypeError, match="keyword arguments only.*key_padding_mask=.*attn_mask="):
        masks.from_torch_mha(causal_mha, num_heads=1)
    got = masks.from_torch_mha(attn_mask=causal_mha, num_heads=1).materialize(1, 1, 4, 4)
    assert torch.equal(got[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("kw, match", [
    ({"num_heads": 0, "attn_mask": torch.zeros(2, 2, dtype=torch.bool)},
     r"from_torch_mha: num_heads must be an integer with num_heads >= 1"),
    ({"num_heads": 2, "attn_mask": torch.zeros(6, 2, 2, dtype=torch.bool), "batch_size": 2},
     r"first axis 6 is not B·H with B=2, H=2"),
    ({"num_heads": 2, "key_padding_mask": torch.zeros(3, 4, dtype=torch.bool), "batch_size": 2},
     r"key_padding_mask has B=3 but batch_size=2"),
    ({"num_heads": 2, "key_padding_mask": torch.zeros(3, 4)}, r"key_padding_mask must be a bool tensor \[B, K\]"),
    ({"num_heads": 2, "key_padding_mask": torch.zeros(4, dtype=torch.bool)}, r"key_padding_mask must be a bool tensor \[B, K\]"),
])
def test_from_torch_mha_arguments(kw, match):
    with pytest.raises(MaskError, match=match):
        masks.from_torch_mha(**kw)


def _silent(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MisuseWarning)
        return fn()


def test_mask_in_torch_polarity_warns():
    q = torch.randn(1, 2, 5, 8)
    causal_mha = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # True = masked out
    with pytest.warns(MisuseWarning, match="nn.MultiheadAttention polarity.*from_torch_mha") as rec:
        bhqk.attention(q, q, q, causal_mha)
    assert rec[0].filename == __file__  # attributed to the caller's line, not the library's
    with pytest.warns(MisuseWarning):
        bhqk.attention(q, q, q, masks.dense(causal_mha) & masks.padding(4), backend="tiled")
    with pytest.warns(MisuseWarning):
        bhqk.MultiHeadAttention(8, 2)(torch.randn(1, 5, 8), mask=causal_mha[None, None].expand(1, 2, 5, 5))
    # the same tensor correctly converted or inverted, a causal mask, a strictly-past mask: silent
    _silent(lambda: bhqk.attention(q, q, q, masks.from_torch_mha(attn_mask=causal_mha, num_heads=2)))
    _silent(lambda: bhqk.attention(q, q, q, ~masks.dense(causal_mha)))
    _silent(lambda: bhqk.attention(q, q, q, ~(masks.dense(causal_mha) & masks.padding(4))))
    _silent(lambda: bhqk.attention(q, q, q, ~causal_mha))
    _silent(lambda: bhqk.attention(q, q, q, torch.ones(5, 5, dtype=torch.bool).tril(-1)))
    _silent(lambda: bhqk.attention(q, q[:, :, :3], q[:, :, :3], torch.ones(5, 3, dtype=torch.bool).triu(1)))  # Q ≠ K


def test_from_torch_sequence_first_warns_and_hints():
    ref = nn.MultiheadAttention(16, 4)  # batch_first=False: [N, B, D]
    with pytest.warns(MisuseWarning, match=r"sequence-first.*\[B, N, D\].*transpose"):
        m = MultiHeadAttention.from_torch(ref)
    m = _silent(lambda: MultiHeadAttention.from_torch(ref, batch_first=True))
    _silent(lambda: MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 4, batch_first=True)))
    x, ctx = torch.randn(5, 2, 16), torch.randn(7, 2, 16)  # sequence-first [N, B, D], fed as is
    with pytest.raises(ShapeError, match=r"(?s)key has batch size B=7 but x has B=5.*sequence-first.*transpose"):
        m(x, ctx)
    with pytest.raises(ValueError, match="always batch-first"):
        MultiHeadAttention.from_torch(ref, batch_first=False)
    with pytest.raises(TypeError, match="nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(3, 3))


def test_other_layout_is_named_in_the_shape_error():
    q, k = torch.randn(2, 7, 8, 16), torch.randn(2, 5, 2, 16)  # [B, N, H, d]: Q=7, K=5, H=8, Hkv=2
    with pytest.raises(ShapeError, match=r"(?s)H=7 is not divisible by Hkv=5.*fit layout='bnhd'"):
        bhqk.attention(q, k, k)
    out = bhqk.attention(q, k, k, layout="bnhd")
    assert out.shape == (2, 7, 8, 16)
    with pytest.raises(ShapeError) as e:
        bhqk.attention(q, torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16))  # fits neither
    assert "fit layout" not in str(e.value)


# --- MultiHeadAttention ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, kw, err, match", [
    ((-16, 4), {}, ShapeError, r"d_model \(D, the model width\) must be an integer >= 1, got -16"),
    ((16, 0), {}, ShapeError, r"num_heads \(H, query heads\) must be an integer >= 1, got 0"),
    ((16, 4.0), {}, ShapeError, r"num_heads .* got 4\.0"),
    ((16.0, 4), {}, ShapeError, r"d_model .* got 16\.0"),
    ((True, 1), {}, ShapeError, r"d_model .* got True"),
    (("16", 4), {}, ShapeError, r"d_model .* got '16'"),
    ((16, 4), {"num_kv_heads": -2}, ShapeError, r"num_kv_heads .* got -2"),
    ((16, 4), {"num_kv_heads": 3}, ShapeError, r"H=4 is not divisible by Hkv=3"),
    ((16, 4), {"head_dim": 0}, ShapeError, r"head_dim \(d, the head dimension\) must be an integer >= 1, got 0"),
    ((16, 4), {"kdim": "8"}, ShapeError, r"kdim .* got '8'"),
    ((16, 4), {"vdim": 0}, ShapeError, r"vdim .* got 0"),
    ((16, 4), {"dropout": 1.5}, ValueError, r"dropout must be a probability in \[0, 1\), got 1\.5"),
    ((16, 4), {"dropout": math.nan}, ValueError, r"dropout must be a probability"),
    ((16, 4), {"bias": "yes"}, TypeError, r"bias must be True or False"),
    ((16, 4), {"backend": 3}, TypeError, r"backend must be a backend name"),
])
def test_impossible_module_sizes(args, kw, err, match):
    with pytest.raises(err, match=match):
        MultiHeadAttention(*args, **kw)


def test_input_dtype_must_match_the_module():
    m = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ShapeError,
                       match=r"x has dtype torch.float64 but the module's parameters are torch.float32.*x.to\(torch.float32\)"):
        m(x.double())
    with pytest.raises(ShapeError, match=r"key has dtype torch.float16 but the module's parameters are torch.float32"):
        m(x, x.half())
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        m([[1.0] * 16])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inside the projections
        assert m(x.bfloat16()).dtype == torch.bfloat16
    assert m.double()(x.double()).dtype == torch.float64


@pytest.mark.parametrize("attn_mask, num_heads, match", [
    (torch.zeros(5, 3, 3), 2, r"bias.from_torch_mha: attn_mask's first axis 5 is not B·H with H=2"),
    (torch.zeros(3, 3, dtype=torch.bool), 1, r"must be a float tensor .* got dtype torch.bool; a bool attn_mask is a mask"),
    (torch.zeros(1, 1, 3, 3), 1, r"must be \[Q, K\] or \[B·H, Q, K\], got shape \[1, 1, 3, 3\]"),
    (torch.zeros(3, 3), 0, r"num_heads must be an integer with num_heads >= 1"),
])
def test_bias_from_torch_mha_names_what_is_wrong(attn_mask, num_heads, match):
    with pytest.raises(MaskError, match=match):
        bhqk.bias.from_torch_mha(attn_mask, num_heads=num_heads)


@pytest.mark.parametrize("backend", ["auto", "torch", "spans", "tiled"])
def test_a_call_with_gradients_warns_nothing(backend):
    """The finiteness checks read a sum of each input: of a detached view, so torch does not warn
    ("Converting a tensor with requires_grad=True to a scalar") on every call with gradients."""
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bhqk.attention(q, q, q, masks.causal(), backend=backend).sum().backward()
