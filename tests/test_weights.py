"""attention_weights against the explicit formula softmax(Q·Kᵀ·scale + bias, masked)."""

from __future__ import annotations

import torch

import bhqk
from bhqk import masks
from conftest import mask_kinds, qkv


def test_weights_equal_explicit_softmax():
    q, k, _ = qkv(2, 4, 2, 5, 7, 8)
    P = bhqk.attention_weights(q, k)
    S = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 8**0.5  # [B, H, Q, K]
    torch.testing.assert_close(P, torch.softmax(S, -1))
    torch.testing.assert_close(P.sum(-1), torch.ones(2, 4, 5, dtype=P.dtype))


def test_weights_with_every_mask_are_zero_where_masked_and_rows_sum_to_one_or_zero():
    B, H, Q, K = 2, 4, 5, 7
    q, k, _ = qkv(B, H, None, Q, K, 8)
    for name, m in mask_kinds(B, H, Q, K).items():
        P = bhqk.attention_weights(q, k, m)
        allowed = m.materialize(B, H, Q, K).expand(B, H, Q, K)
        assert (P[~allowed] == 0).all(), name
        rows = allowed.any(-1)
        torch.testing.assert_close(P.sum(-1)[rows], torch.ones_like(P.sum(-1)[rows]), msg=name)
        assert (P.sum(-1)[~rows] == 0).all(), name


def test_weights_times_v_is_attention():
    q, k, v = qkv(2, 4, 4, 6, 9, 8, 3)
    m = masks.causal("bottom_right")
    P = bhqk.attention_weights(q, k, m)
    torch.testing.assert_close(P @ v, bhqk.attention(q, k, v, m, backend="reference"))


def test_weights_bnhd_layout():
    q, k, _ = qkv(2, 3, None, 4, 5, 8)
    P = bhqk.attention_weights(q.transpose(1, 2), k.transpose(1, 2), layout="bnhd")  # [B, N, H, d] inputs
    torch.testing.assert_close(P, bhqk.attention_weights(q, k))
