"""MultiHeadAttention against torch.nn.MultiheadAttention with copied weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bhqk
from bhqk import masks
from tolerance import assert_paths_close

CHAIN = 2 * 16 + 7  # the sums behind one output: q/k/v projection (E = 16), attention (K = 7), out projection


def _inputs(B=2, Q=5, K=7, E=16, kdim=None, vdim=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, Q, E, generator=g)
    key = torch.randn(B, K, kdim or E, generator=g)
    value = torch.randn(B, K, vdim or kdim or E, generator=g)
    return x, key, value


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_outputs_and_weights_equal(batch_first, separate, bias):
    torch.manual_seed(0)
    E, H = 16, 4
    kdim = 12 if separate else None
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias).eval()
    ours = bhqk.MultiHeadAttention.from_torch(ref).eval()
    x, key, value = _inputs(kdim=kdim)
    t = (lambda a: a) if batch_first else (lambda a: a.transpose(0, 1))  # [B, N, E] <-> [N, B, E]
    want, want_avg = ref(t(x), t(key), t(value), need_weights=True)
    _, want_heads = ref(t(x), t(key), t(value), need_weights=True, average_attn_weights=False)
    got, got_w = ours(x, key, value, return_weights=True)
    assert_paths_close(got, t(want), n=CHAIN)
    assert_paths_close(got_w, want_heads, n=CHAIN)  # [B, H, Q, K]
    assert_paths_close(got_w.mean(1), want_avg, n=CHAIN)


def test_from_torch_converted_masks():
    torch.manual_seed(1)
    B, Q, K, E, H = 2, 5, 7, 16, 4
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = bhqk.MultiHeadAttention.from_torch(ref).eval()
    x, key, value = _inputs(B, Q, K, E)
    kpm = torch.zeros(B, K, dtype=torch.bool)
    kpm[0, 5:] = True  # True = padding in torch's polarity
    attn_mask = torch.triu(torch.ones(Q, K, dtype=torch.bool), diagonal=3)  # True = masked out
    want, want_w = ref(x, key, value, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
    m = masks.from_torch_mha(key_padding_mask=kpm, attn_mask=attn_mask, num_heads=H)
    got, got_w = ours(x, key, value, mask=m, return_weights=True)
    assert_paths_close(got, want, n=CHAIN)
    assert_paths_close(got_w, want_w, n=CHAIN)
    # per-head [B·H, Q, K] masks
    per_head = torch.rand(B * H, Q, K, generator=torch.Generator().manual_seed(0)) > 0.7
    per_head[..., 0] = False
    want = ref(x, key, value, attn_mask=per_head, need_weights=False)[0]
    got = ours(x, key, value, mask=masks.from_torch_mha(attn_mask=per_head, num_heads=H))
    assert_paths_close(got, want, n=CHAIN)
    # a float attn_mask is additive: it goes through bias=
    float_mask = torch.randn(Q, K)
    want = ref(x, key, value, attn_mask=float_mask, need_weights=False)[0]
    got = ours(x, key, value, bias=bhqk.bias.from_torch_mha(float_mask, num_heads=H))
    assert_paths_close(got, want, n=CHAIN)
    with pytest.raises(bhqk.MaskError, match="bias"):
        masks.from_torch_mha(attn_mask=float_mask, num_heads=H)


def test_self_attention_gqa_and_training_dropout():
    torch.manual_seed(0)
    mha = bhqk.MultiHeadAttention(32, 8, num_kv_heads=2, dropout=0.5)
    assert mha.k_proj.out_features == 2 * 4 and mha.q_proj.out_features == 8 * 4
    x = torch.randn(2, 6, 32)
    mha.eval()
    a, b = mha(x), mha(x)
    torch.testing.assert_close(a, b)  # no dropout in eval
    mha.train()
    assert not torch.allclose(mha(x), a)  # dropout in training


def test_module_equals_functional_composition():
    torch.manual_seed(0)
    mha = bhqk.MultiHeadAttention(24, 3, head_dim=5).eval()  # d ≠ D/H is allowed when given
    x, ctx = torch.randn(2, 4, 24), torch.randn(2, 9, 24)
    q = bhqk.split_heads(mha.q_proj(x), 3)  # [B, H, Q, d]
    k = bhqk.split_heads(mha.k_proj(ctx), 3)
    v = bhqk.split_heads(mha.v_proj(ctx), 3)
    want = mha.out_proj(bhqk.merge_heads(bhqk.attention(q, k, v)))
    torch.testing.assert_close(mha(x, ctx), want)


def test_module_gradients_flow():
    mha = bhqk.MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    mha(x, mask=masks.causal()).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in mha.parameters())
