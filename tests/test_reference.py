"""The reference backend against implementations nobody here wrote: F.scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import bhqk
from bhqk import masks
from conftest import mask_kinds, qkv
from tolerance import assert_paths_close


def sdpa(q, k, v, allowed=None, bias=None, scale=None):
    """PyTorch's math path with K/V expanded to H heads (GQA) and mask+bias as one float mask."""
    H = q.shape[1]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    attn = None
    if bias is not None:
        attn = bias.to(q.dtype)
    if allowed is not None:
        attn = allowed if attn is None else attn.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", list(mask_kinds(2, 4, 5, 7)) + ["none"])
def test_reference_matches_sdpa_every_mask(kind, dtype):
    B, H, Hkv, Q, K = 2, 4, 2, 5, 7
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=6, dtype=dtype)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    out = bhqk.attention(q, k, v, m, backend="reference")
    allowed = None if m is None else m.materialize(B, H, Q, K)
    want = sdpa(q, k, v, allowed)
    if allowed is not None:  # SDPA's convention for rows with nothing to attend is also 0 in torch>=2.5
        dead = ~allowed.expand(B, H, Q, K).any(-1, keepdim=True)
        want = want.masked_fill(dead, 0.0)
    assert_paths_close(out, want, n=K)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3), Hkv=st.integers(1, 3), groups=st.integers(1, 3), Q=st.sampled_from([1, 2, 7, 13]),
    K=st.sampled_from([1, 3, 7, 16]), d=st.sampled_from([1, 4, 7]), dv=st.sampled_from([1, 5, 8]),
    use_bias=st.booleans(), layout=st.sampled_from(["bhnd", "bnhd"]), seed=st.integers(0, 10_000),
)
def test_reference_matches_sdpa_random_shapes(B, Hkv, groups, Q, K, d, dv, use_bias, layout, seed):
    H = Hkv * groups
    q, k, v = qkv(B, H, Hkv, Q, K, d, dv, seed=seed)
    bias = torch.randn(1, H, Q, K, dtype=q.dtype) if use_bias else None
    want = sdpa(q, k, v, bias=bias)
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, N, d] -> [B, N, H, d]
    out = bhqk.attention(q, k, v, bias=bias, backend="reference", layout=layout)
    if layout == "bnhd":
        out = out.transpose(1, 2)  # [B, Q, H, dv] -> [B, H, Q, dv]
    assert_paths_close(out, want, n=K, magnitude=max(1.0, float(v.abs().max())) * (1 + d * float(q.abs().max() * k.abs().max())
                                                                             + (float(bias.abs().max()) if use_bias else 0.0)))


def test_reference_gradients_match_sdpa():
    B, H, Hkv, Q, K = 2, 4, 2, 6, 9
    m = masks.causal("bottom_right") & masks.padding(torch.tensor([9, 5]))
    bias = bhqk.bias.alibi(H, align="bottom_right")
    q, k, v = qkv(B, H, Hkv, Q, K, 8, 5, requires_grad=True)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(B, H, Q, 5, dtype=torch.float64)
    (bhqk.attention(q, k, v, m, bias=bias, backend="reference") * dout).sum().backward()
    allowed = m.materialize(B, H, Q, K)
    (sdpa(q2, k2, v2, allowed, bias.materialize(B, H, Q, K, dtype=torch.float64)) * dout).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert_paths_close(a.grad, b.grad, n=max(K, B * H * Q))


def test_scale_defaults_to_inverse_sqrt_d_and_can_be_set():
    q, k, v = qkv(1, 2, None, 3, 4, d=16)
    default = bhqk.attention(q, k, v, backend="reference")
    explicit = bhqk.attention(q, k, v, scale=0.25, backend="reference")
    torch.testing.assert_close(default, explicit)
    assert not torch.allclose(bhqk.attention(q, k, v, scale=1.0, backend="reference"), default)


def test_softcap_applies_tanh_before_bias():
    q, k, v = qkv(1, 2, None, 3, 4, d=8)
    bias = torch.randn(1, 2, 3, 4, dtype=q.dtype)
    c = 0.5
    S = c * torch.tanh((q @ k.transpose(-2, -1)) / 8**0.5 / c) + bias  # [B, H, Q, K]
    want = torch.softmax(S, -1) @ v
    torch.testing.assert_close(bhqk.attention(q, k, v, bias=bias, softcap=c, backend="reference"), want)


def test_why_not_words():
    q, k, v = qkv(1, 2, None, 3, 4, 8)
    assert bhqk.why_not("reference", q, k, v) is None
    assert "log-sum-exp" in bhqk.why_not("torch", q, k, v, return_lse=True)
    assert "softcap" in bhqk.why_not("torch", q, k, v, softcap=5.0)
    with pytest.raises(bhqk.BackendError, match="unknown backend"):
        bhqk.why_not("nope", q, k, v)
    with pytest.raises(bhqk.BackendError, match="log-sum-exp"):
        bhqk.attention(q, k, v, backend="torch", return_lse=True)


