"""The tiled backend against the reference: outputs, lse and gradients, every mask kind, odd sizes,
GQA/MQA, biases, softcap, fully masked rows, NaN in unattended K/V; its internal forward/backward
contract (given lse/out); its tile plans; and the ``auto`` policy that chooses it."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import bhqk
from bhqk import masks
from bhqk.errors import BackendError
from bhqk.functional import prepare, tiled
from bhqk.functional.merge import merge
from bhqk.functional.tiled_plan import (
    BLOCK_K,
    CPU_MODEL,
    Rect,
    RowGroup,
    _pow2_floor,
    classify_leaves,
    device_mode,
    make_plan,
    plan_for,
    split,
    workers,
)
from bhqk.masks import Tile
from conftest import mask_kinds, qkv
from tolerance import assert_close, assert_low_precision_close, assert_paths_close, bound

NEG_INF = float("-inf")


def run_both(q, k, v, mask=None, *, bias=None, blocks=(8, 16), dout_seed=1, lse_weight=0.0, **kw):
    """Outputs, lse and gradients (q, k, v[, bias]) of tiled and reference on the same call."""
    results = []
    for backend in ("tiled", "reference"):
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        b = bias.detach().clone().requires_grad_(True) if isinstance(bias, torch.Tensor) else bias
        extra = dict(block_q=blocks[0], block_k=blocks[1]) if backend == "tiled" and blocks else {}
        out, lse = bhqk.attention(*ts, mask, bias=b, backend=backend, return_lse=True, **kw, **extra)
        g = torch.Generator().manual_seed(dout_seed)
        dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
        loss = (out * dout).sum()
        if lse_weight:
            loss = loss + lse_weight * torch.where(torch.isfinite(lse), lse, 0.0).sum()
        wrt = ts + ([b] if isinstance(b, torch.Tensor) else [])
        results.append((out, lse, torch.autograd.grad(loss, wrt)))
    return results


def assert_same(a, b, magnitude=None):
    """tiled ``a`` and reference ``b`` (same dtype) within tests/tolerance.py's bound for two paths:
    n the longest sum behind a value (K for out and lse; B·H·Q rows for a broadcast bias's gradient)."""
    (out, lse, grads), (out_r, lse_r, grads_r) = a, b
    B, H, Q, _ = out.shape
    K = grads[1].shape[2]
    assert_paths_close(out, out_r, n=K, magnitude=magnitude, msg="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_r))  # -inf exactly on fully masked rows
    finite, finite_r = lse.masked_fill(torch.isinf(lse), 0), lse_r.masked_fill(torch.isinf(lse_r), 0)
    assert_paths_close(finite, finite_r, n=K, magnitude=magnitude, msg="lse")
    for name, g, g_r in zip(("dq", "dk", "dv", "dbias"), grads, grads_r):
        assert_paths_close(g, g_r, n=max(K, B * H * Q), magnitude=magnitude, msg=name)


# ---- against the reference, float64 --------------------------------------------------------------

@pytest.mark.parametrize("kind", list(mask_kinds(2, 4, 33, 47)) + ["none"])
def test_every_mask_kind_outputs_lse_and_grads(kind):
    B, H, Hkv, Q, K = 2, 4, 2, 33, 47  # block 8 × 16 does not divide Q or K
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=5)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    assert_same(*run_both(q, k, v, m))


@pytest.mark.parametrize("Q,K", [(1, 1), (1, 7), (7, 1), (7, 7), (97, 97), (33, 130)])
@pytest.mark.parametrize("blocks", [(8, 16), (5, 3), None])
def test_odd_sizes_and_tile_sizes(Q, K, blocks):
    q, k, v = qkv(2, 2, None, Q, K, d=7, dv=3)
    assert_same(*run_both(q, k, v, blocks=blocks))
    if Q <= K:
        assert_same(*run_both(q, k, v, masks.causal("bottom_right"), blocks=blocks))


@pytest.mark.parametrize("Hkv", [1, 2, 6])
def test_gqa_and_mqa(Hkv):
    q, k, v = qkv(2, 6, Hkv, 21, 30, d=8, dv=12)
    assert_same(*run_both(q, k, v, masks.causal("top_left")))
    per_head = torch.rand(2, 6, 21, 30, generator=torch.Generator().manual_seed(3)) > 0.3  # differs by head
    assert_same(*run_both(q, k, v, per_head))


def test_alibi_softcap_dense_bias_and_combinations():
    B, H, Q, K = 2, 4, 19, 26
    q, k, v = qkv(B, H, 2, Q, K, d=8, dv=6)
    alibi = bhqk.bias.alibi(H, align="bottom_right")
    dense = torch.randn(B, 1, Q, K, dtype=q.dtype)
    assert_same(*run_both(q, k, v, masks.causal("bottom_right"), bias=alibi))
    assert_same(*run_both(q, k, v, softcap=1.5))
    assert_same(*run_both(q, k, v, masks.sliding_window(4, 2, align="top_left"), softcap=0.7, bias=alibi))
    assert_same(*run_both(q, k, v, bias=dense))  # its gradient too
    row_bias = torch.randn(1, H, 1, K, dtype=q.dtype)  # [1, H, 1, K]
    assert_same(*run_both(q, k, v, masks.padding(torch.tensor([26, 9])), bias=row_bias, softcap=3.0))
    both = bhqk.bias.dense(dense) + alibi  # a sum of biases: the dense part still gets its gradient
    t = dense.clone().requires_grad_(True)
    out = bhqk.attention(q, k, v, bias=bhqk.bias.dense(t) + alibi, backend="tiled", block_q=4, block_k=8)
    (g,) = torch.autograd.grad(out.sum(), t)
    t2 = dense.clone().requires_grad_(True)
    (g2,) = torch.autograd.grad(bhqk.attention(q, k, v, bias=bhqk.bias.dense(t2) + alibi, backend="reference").sum(), t2)
    torch.testing.assert_close(g, g2)
    torch.testing.assert_close(bhqk.attention(q, k, v, bias=both, backend="tiled", block_q=4, block_k=8),
                               bhqk.attention(q, k, v, bias=both, backend="reference"))



def test_bias_with_minus_inf_masks_like_a_mask():
    q, k, v = qkv(1, 2, None, 9, 12, d=4)
    bias = torch.zeros(1, 1, 9, 12, dtype=q.dtype)
    bias[..., 5:] = NEG_INF
    bias[..., 3, :] = NEG_INF  # a fully masked row, by the bias alone
    a, b = run_both(q, k, v, bias=bias, blocks=(4, 4))
    assert_same((a[0], a[1], a[2][:3]), (b[0], b[1], b[2][:3]))
    assert (a[0][..., 3, :] == 0).all() and torch.isinf(a[1][..., 3]).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("step", [3.0, 40.0])  # the row max grows by 12 or 160 per tile of 4 keys
def test_scores_growing_along_the_keys_rescale_exactly(dtype, step):
    q = torch.ones(1, 2, 9, 4, dtype=dtype)
    k = (torch.arange(30, dtype=dtype) * step)[None, None, :, None].expand(1, 2, 30, 4) / 2  # S = step·j
    k = torch.cat([k[:, :, :15], k[:, :, 15:].flip(2)], dim=2).contiguous()  # up, then down
    v = torch.randn(1, 2, 30, 3, dtype=dtype, generator=torch.Generator().manual_seed(0))
    a, b = run_both(q, k, v, blocks=(4, 4))
    assert_same(a, b, magnitude=float(step * 29 * v.abs().max()))  # an error of S's rounding: eps·max|S|·max|v|
    assert torch.isfinite(a[0]).all()


def test_lse_is_differentiable():
    q, k, v = qkv(2, 2, None, 13, 17, d=8)
    assert_same(*run_both(q, k, v, masks.causal("bottom_right"), lse_weight=0.3))


def test_bnhd_layout_and_noncontiguous_inputs():
    q, k, v = qkv(2, 4, 2, 11, 15, d=8)
    ql, kl, vl = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # same values, bnhd strides
    assert not ql.is_contiguous()
    assert_same(*run_both(ql, kl, vl, masks.causal("top_left")))
    qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, H, d]
    got = bhqk.attention(qn, kn, vn, layout="bnhd", backend="tiled", block_q=4, block_k=4)
    want = bhqk.attention(qn, kn, vn, layout="bnhd", backend="reference")
    torch.testing.assert_close(got, want)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 3), groups=st.integers(1, 3), Q=st.integers(1, 40), K=st.integers(1, 40),
    d=st.sampled_from([1, 4, 9]), dv=st.sampled_from([1, 3, 8]), bq=st.integers(1, 24), bk=st.integers(1, 24),
    kind=st.sampled_from(list(mask_kinds(1, 1, 4, 4)) + ["none"]), seed=st.integers(0, 10_000),
)
def test_random_shapes_masks_and_blocks(B, Hkv, groups, Q, K, d, dv, bq, bk, kind, seed):
    H = Hkv * groups
    q, k, v = qkv(B, H, Hkv, Q, K, d, dv, seed=seed)
    m = None if kind == "none" else mask_kinds(B, H, Q, K, seed=seed)[kind]
    assert_same(*run_both(q, k, v, m, blocks=(bq, bk)))


@pytest.mark.slow
@pytest.mark.parametrize("N", [1025])
def test_large_odd_size_every_mask(N):
    q, k, v = qkv(1, 2, 1, N, N, d=8, dv=8)
    for m in [None, *mask_kinds(1, 2, N, N).values()]:
        assert_same(*run_both(q, k, v, m, blocks=None))


def test_1025_with_default_tiles():
    q, k, v = qkv(1, 2, 1, 1025, 1025, d=8, dv=4)
    assert_same(*run_both(q, k, v, masks.causal(), blocks=None))
    assert_same(*run_both(q, k, v, masks.sliding_window(100, align="top_left"), blocks=(128, 64)))


def test_gradcheck_float64():
    q, k, v = qkv(1, 2, 1, 6, 7, d=3, dv=2, requires_grad=True)
    bias = torch.randn(1, 2, 6, 7, dtype=torch.float64, requires_grad=True)
    m = masks.causal("bottom_right")

    def f(q, k, v, bias):
        return bhqk.attention(q, k, v, m, bias=bias, softcap=2.0, backend="tiled", block_q=2, block_k=3)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


# ---- float32 and low precision -----------------------------------------------------------------

def test_float32_matches_reference_default_tolerance():
    q, k, v = qkv(2, 4, 2, 70, 90, d=16, dtype=torch.float32)
    a, b = run_both(q, k, v, masks.causal("bottom_right"), bias=bhqk.bias.alibi(4, "bottom_right"), blocks=(32, 16))
    assert a[0].dtype == torch.float32 and a[1].dtype == torch.float32
    assert_same(a, b)


def _math_path(q, k, v, mask, dout):
    """PyTorch's math path at q's precision: its output and gradients."""
    ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    kk = ts[1].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vv = ts[2].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(ts[0], kk, vv, attn_mask=mask)
    return out, torch.autograd.grad(out, ts, dout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_the_math_path_error(dtype):
    B, H, Hkv, Q, K, d = 1, 4, 2, 77, 90, 16
    q, k, v = (t.to(dtype) for t in qkv(B, H, Hkv, Q, K, d, dtype=torch.float64))
    m = masks.causal("bottom_right")
    allowed = m.materialize(B, H, Q, K)
    dout = torch.randn(B, H, Q, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    exact = bhqk.attention(q64, k64, v64, m, backend="reference")
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), dout.double())
    math_out, math_grads = _math_path(q, k, v, allowed, dout)
    ts = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = bhqk.attention(*ts, m, backend="tiled", block_q=16, block_k=32)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, ts, dout)
    assert_low_precision_close(out, exact, math_out, n=K, msg="out")
    for g, e, gm in zip(grads, exact_grads, math_grads):
        assert g.dtype == dtype
        assert_low_precision_close(g, e, gm, n=max(K, Q), msg="grad")


# ---- masking edge cases ------------------------------------------------------------------------

def test_fully_masked_rows_zero_minus_inf_lse_finite_zero_grads():
    q, k, v = qkv(2, 4, 2, 9, 5, d=4, requires_grad=True)
    m = masks.causal("bottom_right")  # Q > K: the first 4 queries see no key
    out, lse = bhqk.attention(q, k, v, m, backend="tiled", return_lse=True, block_q=2, block_k=2)
    assert (out[:, :, :4] == 0).all() and torch.isinf(lse[:, :, :4]).all() and (lse[:, :, :4] < 0).all()
    assert torch.isfinite(lse[:, :, 4:]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, :4] == 0).all()


def assert_same_output_grads_as(a, clean, ref):
    """Output and lse as the reference; gradients as the unpoisoned run (the reference's own dq is
    NaN when an unattended K row holds NaN: 0·NaN in dS·K)."""
    K = a[2][1].shape[2]
    assert_paths_close(a[0], ref[0], n=K)
    assert_paths_close(a[1], ref[1], n=K)
    assert_paths_close(a[0], clean[0], n=K)
    for g, g_clean in zip(a[2], clean[2]):
        assert torch.isfinite(g).all()
        assert_paths_close(g, g_clean, n=max(K, a[0].shape[2]))


@pytest.mark.parametrize("Hkv", [1, 4])  # GQA takes the per-query-head path, Hkv = H the per-tile one
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_in_unattended_keys_and_values_never_leaks(Hkv, poison):
    B, H, Q, K = 2, 4, 23, 30
    q, k, v = qkv(B, H, Hkv, Q, K, d=8)
    per_head = torch.ones(B, H, Q, K, dtype=torch.bool)
    per_head[:, 1, :, 10:14] = False  # keys 10..13 unattended by head 1 only
    lengths = torch.tensor([20, 30])
    for m in (masks.padding(lengths), masks.padding(lengths) & masks.dense(per_head)):
        clean = run_both(q, k, v, m, blocks=(8, 8))[0]
        k2, v2 = k.clone(), v.clone()
        k2[0, :, 20:], v2[0, :, 20:] = poison, poison  # the padding of batch element 0
        a, ref = run_both(q, k2, v2, m, blocks=(8, 8))
        assert_same_output_grads_as(a, clean, ref)
    if Hkv == H:  # a key row unattended by head 1 only may hold NaN for head 1
        clean = run_both(q, k, v, masks.dense(per_head), blocks=(8, 8))[0]
        k2, v2 = k.clone(), v.clone()
        k2[:, 1, 10:14], v2[:, 1, 10:14] = poison, poison
        a, ref = run_both(q, k2, v2, masks.dense(per_head), blocks=(8, 8))
        assert_same_output_grads_as(a, clean, ref)


def test_nan_in_a_fully_masked_query_row_gives_zero():
    q, k, v = qkv(1, 2, None, 12, 12, d=4)
    allowed = torch.ones(1, 1, 12, 12, dtype=torch.bool)
    allowed[..., 3, :] = False
    q = q.clone()
    q[:, :, 3] = float("nan")  # e.g. garbage in a padding query
    out = bhqk.attention(q, k, v, allowed, backend="tiled", block_q=4, block_k=4)
    torch.testing.assert_close(out, bhqk.attention(q, k, v, allowed, backend="reference"))
    assert (out[:, :, 3] == 0).all()


def test_nan_in_an_attended_value_poisons_the_rows_that_attend_it():
    q, k, v = qkv(1, 1, None, 8, 8, d=4)
    v = v.clone()
    v[0, 0, 5] = float("nan")
    out = bhqk.attention(q, k, v, masks.causal(), backend="tiled", block_q=4, block_k=4)
    assert torch.isnan(out[0, 0, 5:]).all()  # these attend key 5, as the reference
    assert torch.isfinite(out[0, 0, :4]).all()


def _grads(backend, q, k, v, m, dout):
    ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = bhqk.attention(*ts, m, backend=backend, block_q=4, block_k=4) if backend == "tiled" else \
        bhqk.attention(*ts, m, backend=backend)
    return (out, *torch.autograd.grad(out, ts, dout.to(out.dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hkv", [2, 4])  # GQA takes the per-query-head path, Hkv = H the per-tile one
def test_low_precision_nonfinite_keys_and_values_reach_exactly_the_rows_that_may_attend_them(dtype, Hkv):
    """Issue 18 item 2: bf16/fp16 with NaN/inf in k or v crashed the tiled path (its NaN/inf flags
    were kept in the input dtype, multiplied with float32 scores). Unattended: nothing changes,
    forward or backward; attended: NaN/inf exactly in the rows that may attend them."""
    B, H, Q, K = 2, 4, 6, 12
    q, k, v = (t.to(dtype) for t in qkv(B, H, Hkv, Q, K, d=8))
    dout = torch.randn(B, H, Q, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    m = masks.padding(torch.tensor([7, 10]))
    clean = _grads("tiled", q, k, v, m, dout)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 10:] = float("nan")  # the repro: poison in the padding only
    v2[0, :, 7:] = float("inf")
    poisoned = _grads("tiled", q, k2, v2, m, dout)
    for got, want, n in zip(poisoned, clean, (K, B * Q, B * Q, B * Q)):
        assert torch.isfinite(got).all()
        assert_close(got.float(), want.double(), dtype=dtype, n=n)
    exact = _grads("reference", q.double(), k.double(), v.double(), m, dout)
    assert_close(poisoned[0].float(), exact[0], dtype=dtype, n=K)
    for backend in ("auto", "torch"):  # both hand such calls to the tiled backend
        assert_close(bhqk.attention(q, k2, v2, m, backend=backend).float(), exact[0], dtype=dtype, n=K)

    causal = masks.causal("top_left") & m  # row i may attend keys ≤ i
    k3, v3 = k2.clone(), v2.clone()
    v3[0, :, 4] = float("inf")  # batch 0: rows 4.. may attend key 4
    k3[1, :, 2] = float("nan")  # batch 1: rows 2.. may attend key 2
    out, dq, _, _ = _grads("tiled", q, k3, v3, causal, dout)
    want = bhqk.attention(q.double(), k3.double(), v3.double(), causal, backend="reference")
    attends = torch.zeros(B, 1, Q, 1, dtype=torch.bool)
    attends[0, :, 4:], attends[1, :, 2:] = True, True  # [B, 1, Q, 1]: the rows that may attend a poisoned key
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(torch.isinf(out), torch.isinf(want))
    assert torch.equal(~torch.isfinite(out).all(-1, keepdim=True), attends.expand(B, H, Q, 1))
    assert_close(torch.where(attends, 0.0, out.float()), torch.where(attends, 0.0, want), dtype=dtype, n=K)
    assert torch.isfinite(dq[~attends.expand(B, H, Q, 1).squeeze(-1)]).all()  # no row that may not attend them gets NaN


# ---- the internal forward/backward contract (ring attention builds on it) -------------------------

def test_forward_backward_with_global_lse_over_key_shards():
    B, H, Hkv, Q, K = 2, 4, 2, 17, 40
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=6)
    m = masks.causal("bottom_right")
    ref_q, ref_k, ref_v = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = bhqk.attention(ref_q, ref_k, ref_v, m, backend="reference")
    dout = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), dout)

    # two key shards; the mask is expressed per shard as a dense tile of the global causal mask
    full = m.materialize(B, H, Q, K)
    cut = 23
    shards = [(slice(0, cut)), (slice(cut, K))]
    parts = []
    for s in shards:
        p = prepare(q, k[:, :, s], v[:, :, s], masks.dense(full[..., s]), options={"block_q": 5, "block_k": 7})
        parts.append((p, *tiled.forward(p)))
    out, lse = merge(parts[0][1], parts[0][2], parts[1][1], parts[1][2])
    torch.testing.assert_close(out, ref.detach())
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for p, _, _ in parts:
        gq, gk, gv = tiled.backward(p, out, lse, dout)  # the global out and lse
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(torch.cat(dks, dim=2), want[1])
    torch.testing.assert_close(torch.cat(dvs, dim=2), want[2])


@pytest.mark.parametrize("kind", list(mask_kinds(2, 4, 45, 50)) + ["none"])
def test_row_groups_larger_than_the_grid(kind):
    """Row groups of several blocks: full regions as tall rectangles, partial blocks inside."""
    B, H, Hkv, Q, K = 2, 4, 2, 45, 50
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=5)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    ref_q, ref_k, ref_v = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, ref_lse = bhqk.attention(ref_q, ref_k, ref_v, m, backend="reference", return_lse=True)
    dout = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(4))
    want = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), dout)
    for bq, bk, group in [(4, 8, 16), (5, 3, 20), (8, 16, 45)]:
        p = prepare(q, k, v, m)
        plan = make_plan(p, bq, bk, group)
        out, lse = tiled.forward(p, plan)
        torch.testing.assert_close(out, ref.detach())
        torch.testing.assert_close(lse, ref_lse.detach())
        for g, w in zip(tiled.backward(p, out, lse, dout, plan=plan), want):
            torch.testing.assert_close(g, w)


def test_forward_returns_dtypes_and_no_graph():
    q, k, v = qkv(1, 2, None, 5, 6, d=4, dtype=torch.float32, requires_grad=True)
    out, lse = tiled.forward(prepare(q, k, v))
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (1, 2, 5)
    assert not out.requires_grad and not lse.requires_grad
    out64, lse64 = tiled.forward(prepare(*(t.double() for t in (q, k, v))))
    assert lse64.dtype == torch.float64
    outb, lseb = tiled.forward(prepare(*(t.detach().bfloat16() for t in (q, k, v))))
    assert outb.dtype == torch.bfloat16 and lseb.dtype == torch.float32



@pytest.mark.parametrize("device_path", [False, True])  # the device path: no optimistic exponent, no host reads
@pytest.mark.parametrize("shift", [0.0, 5.0, 30.0])  # added to the scores of keys 3:8 (natural log)
def test_online_softmax_step_keeps_the_softmax_of_the_keys_so_far(shift, device_path):
    """FlashAttention-2's Algorithm 1 invariant, after each ``_step``: O / l is the softmax over the
    keys fed so far times their values, m + log l their logsumexp (float64), and m stays within
    [max - 24, max] of their max (base 2), which keeps every P̃ entry below 2^24. The shifts make the
    later key blocks' max grow by nothing, by less than TAU (lazy: m may stay) and by far more than 24
    (the optimistic exponent's redo on the CPU path); the last rectangle covers only rows 2:4."""
    Q, K, d = 4, 8, 8
    q, k, v = qkv(1, 1, None, Q, K, d=d, dtype=torch.float64, seed=3)
    t = torch.zeros(1, 1, Q, K, dtype=torch.float64)
    t[..., 3:] = shift
    rects = [Rect(0, Q, 0, 3, False), Rect(0, Q, 3, 6, False), Rect(2, Q, 6, K, False)]
    group = RowGroup(0, Q, rects)
    S = (q @ k.transpose(-1, -2) * d**-0.5 + t)[0, 0]  # [Q, K], natural log
    seen = torch.zeros(Q, dtype=torch.long)  # keys fed so far, per row
    with device_mode() if device_path else contextlib.nullcontext():
        p = prepare(q, k, v, bias=bhqk.bias.dense(t))
        kn = tiled._Kernel.of(p, (slice(None), slice(None)), finite=True)
        work = tiled._ForwardWork(kn, [group], d, d, nonfinite_v=False)
        st = tiled._start_group(kn, work, group, tiled._grouped(p.q, kn))
        for rect in rects:
            # line 9's variant, as _forward_part chooses it: exact until the group is settled, then optimistic
            exponent = (tiled._exponent_device if device_path
                        else tiled._exponent_optimistic if st.settled else tiled._exponent_exact)
            tiled._step(kn, work, st, 0, rect, p.k, p.v, None, exponent)
            seen[rect.r0:rect.r1] = rect.k1
            for r in range(Q):
                keys = slice(0, int(seen[r]))
                m, l, O = st.m[0, r], st.l[0, r], st.O[0, r]  # base 2; n = 1, G = 1: rows (q g) are q
                assert_close(O / l, torch.softmax(S[r, keys], -1) @ v[0, 0, keys], n=keys.stop, msg=f"O/l row {r}")
                assert_close((m + torch.log2(l)) * math.log(2.0), torch.logsumexp(S[r, keys], -1), n=keys.stop, msg="m + log l")
                top = S[r, keys].max() / math.log(2.0)  # the max in base 2
                slack = bound(torch.float64, d, float(top.abs()) + 1.0)
                assert top - 24 - slack <= m <= top + slack, (r, float(m), float(top))

# ---- tile plans: skipping is exact and proportional ----------------------------------------------

@settings(max_examples=40, deadline=None)
@given(Q=st.integers(1, 50), K=st.integers(1, 50), bq=st.integers(1, 17), bk=st.integers(1, 17),
       kind=st.sampled_from(list(mask_kinds(1, 1, 4, 4))), seed=st.integers(0, 1000))
def test_tile_classes_are_never_wrong(Q, K, bq, bk, kind, seed):
    B, H = 2, 3
    m = mask_kinds(B, H, Q, K, seed=seed)[kind]
    dense = m.materialize(B, H, Q, K).expand(B, H, Q, K)
    from bhqk.masks import Extent

    qc, kc = list(range(0, Q, bq)) + [Q], list(range(0, K, bk)) + [K]
    seen = torch.zeros(len(qc) - 1, len(kc) - 1, dtype=torch.int)
    for i0, i1, j0, j1, t in classify_leaves(m, Extent(B, H, Q, K), qc, kc):
        seen[i0:i1, j0:j1] += 1
        tile = dense[:, :, qc[i0] : qc[i1], kc[j0] : kc[j1]]
        if t is Tile.EMPTY:
            assert not tile.any()
        elif t is Tile.FULL:
            assert tile.all()
        else:
            assert i1 - i0 == 1 and j1 - j0 == 1  # partial leaves are single blocks
    assert (seen == 1).all()  # the leaves cover the grid once


def test_plan_covers_every_allowed_entry_once():
    B, H, Q, K = 1, 2, 70, 90
    for name, m in mask_kinds(B, H, Q, K).items():
        q = torch.empty(B, H, Q, 8)
        k = torch.empty(B, H, K, 8)
        for bq, bk, group in [(8, 16, 32), (5, 7, 5), (16, 16, 64)]:
            plan = make_plan(prepare(q, k, k, m), bq, bk, group)
            cover = torch.zeros(Q, K, dtype=torch.int)
            for q0, q1, tiles in plan.rows:
                for r0, r1, k0, k1, _ in tiles:
                    assert q0 <= r0 < r1 <= q1
                    cover[r0:r1, k0:k1] += 1
            allowed = m.materialize(B, H, Q, K).expand(B, H, Q, K).any(1).any(0)
            assert cover.max() <= 1, name
            assert (cover[allowed] == 1).all(), name  # every entry some query may attend is computed once


class CountingCausal(masks.Causal):
    """A causal mask that records which tiles of it are evaluated."""

    def __init__(self):
        super().__init__("top_left")
        self.tiles = set()

    def block(self, ext, q0, q1, k0, k1, device=None):
        self.tiles.add((q0, k0))
        return super().block(ext, q0, q1, k0, k1, device)


def test_empty_tiles_skipped_full_tiles_never_evaluate_the_mask():
    q, k, v = qkv(1, 2, None, 64, 64, d=4, requires_grad=True)
    m = CountingCausal()
    out = bhqk.attention(q, k, v, m, backend="tiled", block_q=8, block_k=8)
    diagonal = {(8 * i, 8 * i) for i in range(8)}
    assert m.tiles == diagonal  # the 28 full tiles below the diagonal need no mask; 28 empty ones are skipped
    m.tiles.clear()
    out.sum().backward()
    assert m.tiles == diagonal


@pytest.mark.parametrize("name,mask,fraction", [
    ("causal", masks.causal(), 0.5),
    ("window", masks.sliding_window(256), 256 / 4096),
    ("document", masks.document(torch.arange(4096) // 512), 1 / 8),
    ("padding", masks.padding(2048), 0.5),
    ("prefix_lm", masks.prefix_lm(1024), 0.5 + 0.5 * (1024 / 4096) ** 2),
])
def test_structured_masks_skip_work_in_proportion(name, mask, fraction, two_threads):
    q = torch.empty(1, 8, 4096, 64)
    plan = plan_for(prepare(q, q, q, mask))
    useful = fraction  # share of the [Q, K] grid the mask allows
    assert useful <= plan.fraction(prepare(q, q, q, mask).ext) <= useful + 0.08, (name, plan.fraction)


def test_block_sizes_are_validated_and_do_not_change_results():
    q, k, v = qkv(1, 2, None, 20, 20, d=4)
    with pytest.raises(BackendError, match="block_q must be a positive integer"):
        bhqk.attention(q, k, v, backend="tiled", block_q=0)
    outs = [bhqk.attention(q, k, v, masks.causal(), backend="tiled", block_q=a, block_k=b) for a, b in [(1, 1), (3, 20), (64, 7)]]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0])


def test_heuristic_tile_sizes(two_threads):
    q = torch.empty(1, 8, 4096, 64)
    plan = plan_for(prepare(q, q, q))
    parts = len(split(1, 8, workers()))
    assert plan.block_k == BLOCK_K  # the default key block
    # a worker's score tile [B·H/workers, block_q, block_k] holds about CPU_MODEL.tile_elems: block_q a power of two in 16 … 2048
    assert plan.block_q == max(16, min(2048, _pow2_floor(CPU_MODEL.tile_elems * parts / (8 * BLOCK_K))))
    small = torch.empty(2, 4, 100, 16)
    plan = plan_for(prepare(small, small, small))
    assert plan.block_q <= 100 and plan.block_k <= 100
    win = plan_for(prepare(q, q, q, masks.sliding_window(256)))
    assert win.block_q * win.block_k < 512 * 256  # smaller tiles skip more of a narrow band
    assert make_plan(prepare(q, q, q, masks.sliding_window(256)), 512, 256).computed > win.computed


# ---- the auto policy -----------------------------------------------------------------------------

# (the policy's choices and reasons: tests/test_auto.py)


def test_auto_runs_tiled_with_gradients_and_lse():
    q, k, v = qkv(1, 2, None, 80, 90, d=8, dtype=torch.float32, requires_grad=True)
    out, lse = bhqk.attention(q, k, v, masks.sliding_window(5, align="bottom_right"), return_lse=True)
    ref, ref_lse = bhqk.attention(q, k, v, masks.sliding_window(5, align="bottom_right"), return_lse=True, backend="reference")
    assert_paths_close(out, ref, n=90)
    assert_paths_close(lse, ref_lse, n=90)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert_paths_close(a, b, n=90)


# ---- worker threads ------------------------------------------------------------------------------

@pytest.mark.parametrize("B,Hkv", [(1, 1), (3, 1), (1, 3)])  # query blocks, batch, heads shared out
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_way_of_sharing_out_the_work_gives_the_same_result(B, Hkv, threads):
    q, k, v = qkv(B, 3, Hkv, 40, 37, d=8, dv=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        a, b = run_both(q, k, v, masks.causal("bottom_right"), bias=torch.randn(B, 3, 1, 37, dtype=q.dtype), blocks=(8, 8))
        assert torch.get_num_threads() == threads  # the workers restored the caller's setting
    finally:
        torch.set_num_threads(before)
    assert_same(a, b)


def test_worker_threads_leave_grad_mode_and_threads_alone():
    import threading

    q, k, v = qkv(1, 4, 2, 30, 30, d=8, requires_grad=True)
    threads = torch.get_num_threads()
    out = bhqk.attention(q, k, v, backend="tiled", block_q=8, block_k=8)
    assert out.requires_grad and out.grad_fn is not None
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == threads and seen == [threads]  # a new thread gets the default back


def test_inference_mode_and_no_double_backward():
    q, k, v = qkv(1, 4, 2, 30, 30, d=8)
    with torch.inference_mode():
        out = bhqk.attention(q, k, v, masks.causal(), backend="tiled", block_q=8, block_k=8)
    torch.testing.assert_close(out, bhqk.attention(q, k, v, masks.causal(), backend="reference"))
    q.requires_grad_(True)
    out = bhqk.attention(q, k, v, backend="tiled", block_q=8, block_k=8)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()  # FA-2's backward is not itself differentiable: an error, not a silent 0


def test_plans_are_kept_per_mask_and_remade_when_its_tensor_is_written_in_place():
    q = torch.randn(1, 4, 600, 16)
    allowed = masks.sliding_window(64).materialize(1, 1, 600, 600).clone()  # [1, 1, Q, K]
    m = masks.dense(allowed)
    blocks = {"options": {"block_q": 64, "block_k": 64}}
    first = plan_for(prepare(q, q, q, m, **blocks))
    assert plan_for(prepare(q, q, q, m, **blocks)) is first  # every layer of a model shares one mask: planned once
    assert plan_for(prepare(q, q, q, allowed, **blocks)) is first  # or one tensor, wrapped anew at each call
    assert plan_for(prepare(q[:, :2], q[:, :2], q[:, :2], m, **blocks)) is not first  # other sizes: another plan
    allowed[..., :300, :] = True  # written in place: the kept plan would skip keys the mask now allows
    again = plan_for(prepare(q, q, q, m, **blocks))
    assert again is not first and again.computed > first.computed
    out = bhqk.attention(q, q, q, m, backend="tiled", block_q=64, block_k=64)
    torch.testing.assert_close(out, bhqk.attention(q, q, q, m, backend="reference"))
