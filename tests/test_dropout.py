"""Dropout in the tiled backend: the keep-mask is regenerated per tile from a seed and (b, h, q, k),
never stored. Forward and backward drop the same entries (checked against the reference given the
regenerated mask, outputs and gradients); the keep rate and the independence of entries are within
statistical bounds; p = 0 is bit-identical to no dropout; the seed follows torch.manual_seed."""

from __future__ import annotations

import math

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.functional import prepare, reference, tiled
from conftest import qkv
from tolerance import assert_close, assert_paths_close


def _tiled_and_keep(q, k, v, mask=None, *, p, seed=0, sinks=None, blocks=(8, 16), **kw):
    """The tiled call under torch.manual_seed(seed), and the keep-mask [B, H, Q, K] it used."""
    torch.manual_seed(seed)
    out, lse = bhqk.attention(q, k, v, mask, dropout_p=p, sinks=sinks, backend="tiled", return_lse=True,
                              block_q=blocks[0], block_k=blocks[1], **kw)
    torch.manual_seed(seed)
    B, H, Q, _ = q.shape
    keep = tiled.dropout_keep(tiled.dropout_seed(), B, H, Q, k.shape[2], p)
    return out, lse, keep


def formula(q, k, v, allowed, keep, p, scale):
    """fp64 from the definition: P = softmax over allowed keys, O = (P ∘ keep / (1 - p)) · V."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))  # [B, H, K, ·]
    S = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    E = torch.where(allowed, torch.exp(S - S.amax(-1, keepdim=True).detach()), 0.0)
    P = E / E.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("bhqk,bhkv->bhqv", P * keep / (1 - p), v)


@pytest.mark.parametrize("mask", [None, masks.causal("bottom_right"), masks.sliding_window(5, align="top_left")])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_forward_and_backward_drop_the_same_entries_as_the_regenerated_mask(mask, with_sinks):
    B, H, Hkv, Q, K, d, dv = 2, 4, 2, 29, 45, 8, 6
    q, k, v = qkv(B, H, Hkv, Q, K, d=d, dv=dv, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True) if with_sinks else None
    p = 0.3
    out, lse, keep = _tiled_and_keep(q, k, v, mask, p=p, sinks=sinks, seed=7)
    want, want_lse = reference.run(prepare(q, k, v, mask, dropout_p=p, sinks=sinks), True, keep=keep)
    assert_paths_close(out, want, n=K)
    assert_paths_close(lse, want_lse, n=K)  # lse is computed without dropout
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    wrt = (q, k, v) + ((sinks,) if with_sinks else ())
    got = torch.autograd.grad((out * dout).sum() + 0.5 * lse.sum(), wrt)
    expect = torch.autograd.grad((want * dout).sum() + 0.5 * want_lse.sum(), wrt)
    for g, w in zip(got, expect):
        assert_paths_close(g, w, n=max(K, B * H * Q))


def test_the_reference_given_the_mask_is_the_formula():
    B, H, Q, K = 1, 2, 9, 11
    q, k, v = qkv(B, H, None, Q, K)
    keep = tiled.dropout_keep(123, B, H, Q, K, 0.25)
    got, _ = reference.run(prepare(q, k, v, masks.causal("top_left"), dropout_p=0.25), keep=keep)
    allowed = masks.causal("top_left").materialize(B, H, Q, K)
    assert_paths_close(got, formula(q, k, v, allowed, keep, 0.25, 8 ** -0.5), n=K)


def test_gradients_match_autograd_of_the_formula_given_the_mask():
    B, H, Hkv, Q, K = 1, 4, 1, 17, 23
    q, k, v = qkv(B, H, Hkv, Q, K, d=4, dv=3, requires_grad=True)
    out, _, keep = _tiled_and_keep(q, k, v, p=0.5, seed=11, blocks=(4, 8))
    want = formula(q, k, v, torch.ones(B, H, Q, K, dtype=torch.bool), keep, 0.5, 0.5)
    assert_paths_close(out, want, n=K)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    for g, w in zip(torch.autograd.grad((out * dout).sum(), (q, k, v)), torch.autograd.grad((want * dout).sum(), (q, k, v))):
        assert_paths_close(g, w, n=max(K, B * H * Q))


def test_the_mask_does_not_depend_on_the_tiles_or_the_threads():
    q, k, v = qkv(2, 4, 2, 40, 70, dtype=torch.float32)
    outs = []
    for blocks in ((8, 16), (16, 32), (40, 70), (3, 5)):
        torch.manual_seed(3)
        outs.append(bhqk.attention(q, k, v, dropout_p=0.2, backend="tiled", block_q=blocks[0], block_k=blocks[1]))
    for o in outs[1:]:
        assert_paths_close(o, outs[0], n=70)


def test_keep_rate_and_independence_are_within_statistical_bounds():
    B, H, Q, K = 2, 3, 256, 512
    for p in (0.1, 0.5, 0.9):
        keep = tiled.dropout_keep(99, B, H, Q, K, p).double()
        n = keep.numel()
        rate, sd = keep.mean().item(), math.sqrt(p * (1 - p) / n)
        assert abs(rate - (1 - p)) < 5 * sd, (p, rate)
        # neighbours (along K, along Q, across heads, across batch) and 2x2 rectangles are uncorrelated
        z = (keep - (1 - p)) / math.sqrt(p * (1 - p))
        for a, b in ((z[..., 1:], z[..., :-1]), (z[:, :, 1:], z[:, :, :-1]), (z[:, 1:], z[:, :-1]), (z[1:], z[:-1]),
                     (z[:, :, 1:, 1:] * z[:, :, :-1, :-1], z[:, :, 1:, :-1] * z[:, :, :-1, 1:])):
            corr = (a * b).mean().item()
            assert abs(corr) < 5 / math.sqrt(a.numel()), (p, corr)
    # every pair of rows (and of keys) is uncorrelated: no pair's correlation beyond 6σ of independence
    # (a one-round hash of row ^ key fails this: some row pairs correlate at 10σ)
    keep = tiled.dropout_keep(17, 1, 2, 256, 4096, 0.1).double().flatten(0, 2)  # [(B H Q), K]
    z = (keep - keep.mean()) / keep.std()
    for zz, n in ((z, z.shape[1]), (z.T[:512], z.shape[0])):
        corr = (zz @ zz.T) / n  # [rows, rows]
        off = corr[~torch.eye(corr.shape[0], dtype=torch.bool)]
        assert abs(off.std().item() * math.sqrt(n) - 1) < 0.05 and off.abs().max().item() < 6 / math.sqrt(n)
    # per-row keep counts are binomial: their spread matches
    keep = tiled.dropout_keep(5, 1, 1, 512, 1024, 0.3).double()
    rows = keep.sum(-1).squeeze()
    assert abs(rows.var().item() / (1024 * 0.3 * 0.7) - 1) < 0.25


def test_seeds_differ_between_calls_and_follow_manual_seed():
    q, k, v = qkv(1, 2, None, 64, 64, dtype=torch.float32)
    torch.manual_seed(0)
    a = bhqk.attention(q, k, v, dropout_p=0.5, backend="tiled")
    b = bhqk.attention(q, k, v, dropout_p=0.5, backend="tiled")
    torch.manual_seed(0)
    a2 = bhqk.attention(q, k, v, dropout_p=0.5, backend="tiled")
    assert torch.equal(a, a2) and not torch.allclose(a, b)
    assert not torch.equal(tiled.dropout_keep(1, 1, 2, 8, 8, 0.5), tiled.dropout_keep(2, 1, 2, 8, 8, 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_p_zero_is_bit_identical_to_no_dropout(dtype):
    q, k, v = qkv(2, 4, 2, 33, 65, dtype=dtype, requires_grad=True)
    outs, grads = [], []
    for kw in ({}, {"dropout_p": 0.0}):
        out = bhqk.attention(q, k, v, masks.causal("bottom_right"), backend="tiled", block_q=8, block_k=16, **kw)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_drops_the_same_entries(dtype):
    q, k, v = qkv(1, 4, 2, 48, 80, d=16, dtype=dtype)
    out, _, keep = _tiled_and_keep(q, k, v, masks.causal("bottom_right"), p=0.2, seed=2, blocks=(16, 32))
    want, _ = reference.run(prepare(*(t.double() for t in (q, k, v)), masks.causal("bottom_right"), dropout_p=0.2), keep=keep)
    assert out.dtype == dtype
    assert_close(out, want, n=80)


def test_module_in_training_uses_tiled_dropout_and_auto_no_longer_refuses_it():
    q, k, v = qkv(1, 2, None, 100, 100, dtype=torch.float32)
    assert tiled.why_not(prepare(q, k, v, masks.sliding_window(8), dropout_p=0.1), False) is None
    torch.manual_seed(0)
    m = bhqk.MultiHeadAttention(16, 2, dropout=0.5, backend="tiled")
    x = torch.randn(1, 20, 16)
    m.train()
    a, b = m(x), m(x)
    assert not torch.allclose(a, b)  # dropout is on in training
    m.eval()
    assert torch.equal(m(x), m(x))
