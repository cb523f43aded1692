"""The span path (backend "spans"): PyTorch's fused CPU kernel over the key spans a mask allows.

What is specific to it: the plan (every allowed score entry in exactly one span, spans of many
query blocks batched into one kernel call), the merge of a row's spans by their lse, the chunking of
large masks, and what it refuses or hands off. Its answers against the float64 reference are checked
here on small blocks (so rows are split over many spans and groups batch several blocks); the
shared semantics grid covers it as one of ``functional.names()``."""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.functional import prepare as problem
from bhqk.functional import spans, spans_kernels, spans_plan
from conftest import mask_kinds, qkv
from tolerance import assert_close, assert_low_precision_close

B, H, Q, K = 2, 4, 37, 45
SMALL = {"block_q": 8, "block_k": 4}  # many blocks: rows over several spans, groups of several blocks


def coverage(p, plan) -> torch.Tensor:
    """How many spans of ``plan`` compute each entry of the [Q, K] grid (int [Q, K])."""
    c = torch.zeros(p.ext.Q, p.ext.K, dtype=torch.int64)
    for g in plan.groups:
        for j in range(g.n):
            r0, k0 = g.r0 + j * g.rows, g.k0 + j * g.kstep
            tile = torch.ones(g.rows, g.L, dtype=torch.int64)
            if g.causal:
                tile = torch.tril(tile)
            c[r0:r0 + g.rows, k0:k0 + g.L] += tile
    return c


STRIPES = masks.predicate(lambda b, h, q, k: (k % 12) < 4, "stripes")  # many spans of one length per block


@pytest.mark.parametrize("kind", list(mask_kinds(B, H, Q, K)) + ["none", "stripes"])
@pytest.mark.parametrize("blocks", [{}, SMALL, {"block_q": 5, "block_k": 3}])
def test_every_allowed_entry_is_in_exactly_one_span(kind, blocks):
    q, k, v = qkv(B, H, 2, Q, K, 8)
    m = {"none": None, "stripes": STRIPES}.get(kind) or mask_kinds(B, H, Q, K).get(kind)
    p = problem(q, k, v, m, options=blocks)
    plan = spans.plan_for(p)
    c = coverage(p, plan)
    full = torch.ones(Q, K, dtype=torch.bool)
    allowed = full if m is None else m.materialize(B, H, Q, K).any(dim=(0, 1)) & full  # [Q, K]
    assert (c[allowed] == 1).all(), "an allowed entry is computed by no span or by two"
    assert (c <= 1).all(), "an entry is computed twice"
    assert spans.share(p) == pytest.approx(int(c.sum()) / (Q * K))
    if plan.single:  # no merge: each row is in one span only
        spans_per_row = torch.zeros(Q, dtype=torch.int64)
        for g in plan.groups:
            spans_per_row[g.r0:g.r0 + g.n * g.rows] += 1
        assert (spans_per_row <= 1).all()


def test_a_window_is_one_batched_call_and_skips_what_it_cannot_see():
    N = 64
    q, k, v = qkv(1, 2, 1, N, N, 8)
    p = problem(q, k, v, masks.sliding_window(8), options={"block_q": 8, "block_k": 8})
    plan = spans.plan_for(p)
    assert plan.single  # one span per row: no merge
    batched = [g for g in plan.groups if g.n > 1]
    assert len(batched) == 1 and batched[0].kstep == 8 and batched[0].L == 16  # blocks 1 … 7, keys [8j - 8, 8j + 8)
    assert len(plan.groups) == 2  # and block 0 alone (keys 0 … 7)
    assert spans.share(p) == pytest.approx((8 * 8 + 7 * 8 * 16) / N**2)


@pytest.mark.parametrize("make", [lambda N: masks.sliding_window(191),  # w = 192 (key tiles of 64): 48 -> 32 rows
                                  lambda N: masks.sliding_window(300) & masks.causal(),  # w = 320: 80 -> 64 rows
                                  lambda N: masks.dense(masks.sliding_window(191).materialize(1, 1, N, N))],  # as HF passes it
                         ids=["window", "window&causal", "dense_window"])
def test_a_band_gets_blocks_of_whole_kernel_tiles_at_most_a_quarter_of_its_width(make):
    N = 640
    q, k, v = qkv(1, 2, 1, N, N, 8, requires_grad=True)
    m = make(N)
    plan = spans.plan_for(problem(q, k, v, m))
    band = max((g for g in plan.groups if g.n > 1), key=lambda g: g.entries)  # (the ramp before it is one call)
    default = spans.plan_for(problem(q, k, v, m, options={"block_q": spans_plan.BLOCK_Q}))  # the band at the default blocks
    mid = max((g for g in default.groups if g.n > 1), key=lambda g: g.entries)
    w = sum(g.L for g in default.groups if g.r0 <= mid.r0 + mid.rows < g.r0 + g.n * g.rows) - mid.rows
    assert band.kstep == band.rows and band.n > 1, "the band is one batched call"
    assert band.rows % spans_plan.KERNEL_TILE == 0 and band.rows <= max(spans_plan.KERNEL_TILE, w // 4)
    assert band.rows < spans_plan.BLOCK_Q and plan.computed < default.computed  # smaller blocks skip more of the band
    assert len(plan.groups) <= len(default.groups) + 6  # key tiles divide the block: one chain, not one call per block
    assert plan.groups[0].r0 == 0 and plan.groups[0].rows == band.r0  # the ramp before the band: one call
    allowed = m.materialize(1, 1, N, N)[0, 0]  # [Q, K]
    assert plan.backward is not None and spans_plan.TILE_64_ROWS in {g.rows for g in plan.backward.groups}
    for part in (plan, plan.backward):  # the backward's own blocks: the kernel's 64-row tiles
        c = coverage(problem(q, k, v, m), part)
        assert (c[allowed] == 1).all() and (c <= 1).all(), "an allowed entry in no span, or an entry in two"
    _compare(q, k, v, m, blocks={})


def test_no_mask_and_causal_are_single_kernel_calls(monkeypatch):
    calls = []
    real = spans_kernels._FWD
    monkeypatch.setattr(spans_kernels, "_FWD", lambda *a, **kw: calls.append(kw.get("attn_mask")) or real(*a, **kw))
    q, k, v = qkv(1, 2, 1, 33, 33, 8)
    for m in (None, masks.causal()):
        calls.clear()
        bhqk.attention(q, k, v, m, backend="spans")
        assert calls == [None]  # one call, no mask tensor: is_causal for the causal mask
    q, k, v = qkv(1, 2, 1, 300, 600, 8)  # Q·K above SMALL_MASK
    calls.clear()
    bhqk.attention(q, k, v, masks.causal("bottom_right"), backend="spans")
    assert calls == [None, None]  # keys before the diagonal, then top-left causal over the rest
    q, k, v = qkv(1, 2, 1, 9, 20, 8)
    calls.clear()
    bhqk.attention(q, k, v, masks.causal("bottom_right"), backend="spans")
    assert len(calls) == 1 and calls[0].shape[-2:] == (9, 20)  # few queries: one call with a small mask
    calls.clear()
    q, k, v = qkv(1, 2, 1, 1, 300, 8)
    bhqk.attention(q, k, v, masks.causal("bottom_right"), backend="spans")
    assert calls == [None]  # a decoding step sees every key: one call without a mask


def _loss(out, lse=None):
    w = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)
    s = (out * w).sum()
    return s if lse is None else s + 0.3 * torch.where(torch.isfinite(lse), lse, 0.0).sum()


def _grads(backend, q, k, v, m, with_lse=False, **kw):
    out, lse = bhqk.attention(q, k, v, m, backend=backend, return_lse=True, **kw)
    wrt = [q, k, v] + ([kw["sinks"]] if kw.get("sinks") is not None else [])
    return out, lse, torch.autograd.grad(_loss(out, lse if with_lse else None), wrt)


def _compare(q, k, v, m, with_lse=False, blocks=SMALL, **kw):
    out, lse, grads = _grads("spans", q, k, v, m, with_lse, **{**kw, **blocks})
    r_out, r_lse, r_grads = _grads("reference", q, k, v, m, with_lse, **kw)
    Kn, n_rows = k.shape[-2], q.shape[0] * q.shape[-2]
    assert_close(out, r_out, n=Kn, msg="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse)), "lse -inf on other rows"
    assert_close(lse, r_lse, n=Kn, msg="lse")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads):
        assert torch.isfinite(g).all(), name
        assert_close(g, r, n=max(Kn, n_rows), msg=name)


@pytest.mark.parametrize("kind", list(mask_kinds(B, H, Q, K)) + ["none", "stripes"])
@pytest.mark.parametrize("extra", ["plain", "bias", "sinks", "lse_grad"])
def test_equals_the_reference_outputs_and_gradients(kind, extra):
    q, k, v = qkv(B, H, 2, Q, K, 8, dv=8 if extra == "plain" else 6, requires_grad=True)
    m = {"none": None, "stripes": STRIPES}.get(kind) or mask_kinds(B, H, Q, K).get(kind)
    kw = {}
    if extra == "bias":
        bias = torch.randn(B, 1, Q, K, dtype=torch.float64)
        bias[0, 0, 3] = float("-inf")  # a row the bias masks fully
        kw["bias"] = bias
    if extra == "sinks":
        kw["sinks"] = torch.randn(H, dtype=torch.float64, requires_grad=True)
    _compare(q, k, v, m, with_lse=extra in ("lse_grad", "sinks"), **kw)


@pytest.mark.parametrize("Qn, Kn", [(9, 20), (20, 9), (1, 30), (70, 1000)])  # (70, 1000): above SMALL_MASK
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("blocks", [{}, SMALL])
def test_causal_with_q_not_k(Qn, Kn, align, blocks):
    q, k, v = qkv(2, 4, 1, Qn, Kn, 8, requires_grad=True)
    _compare(q, k, v, masks.causal(align) & masks.padding(torch.tensor([Kn, Kn - 3])), blocks=blocks)
    _compare(q, k, v, masks.causal(align), blocks=blocks)


def test_bnhd_layout_and_strided_views():
    q, k, v = qkv(2, 4, 2, 30, 30, 8, requires_grad=True)
    m = masks.sliding_window(5)
    want = bhqk.attention(q, k, v, m, backend="reference")
    got = bhqk.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m, backend="spans", layout="bnhd",
                         **SMALL)  # [B, N, H, d] views of bhnd tensors
    assert got.shape == (2, 30, 4, 8)
    assert_close(got.transpose(1, 2), want, n=30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["window", "document", "causal_br"])
def test_low_precision_against_torch_math(dtype, kind):
    q, k, v = qkv(B, H, 2, Q, K, 8)
    m = mask_kinds(B, H, Q, K)[kind]
    low = [t.to(dtype) for t in (q, k, v)]
    out, lse = bhqk.attention(*low, m, backend="spans", return_lse=True, **SMALL)
    assert out.dtype == dtype and lse.dtype == torch.float32
    exact = bhqk.attention(*(t.double() for t in low), m, backend="reference")
    dense = m.materialize(B, H, Q, K)
    math_ = torch.nn.functional.scaled_dot_product_attention(*(t.repeat_interleave(H // t.shape[1], 1) for t in low),
                                                              attn_mask=dense)  # PyTorch's own math at this precision
    assert_low_precision_close(out, exact, math_.nan_to_num(0.0), n=K)


def test_fully_masked_rows_and_empty_masks():
    q, k, v = qkv(2, 2, 1, 12, 10, 8, requires_grad=True)
    lengths = torch.tensor([0, 4])  # batch element 0: every row fully masked
    _compare(q, k, v, masks.padding(lengths))
    out, lse = bhqk.attention(q, k, v, masks.padding(0), backend="spans", return_lse=True)  # nothing to compute
    assert (out == 0).all() and (lse == float("-inf")).all()
    out.sum().backward()
    assert (q.grad == 0).all() and (k.grad == 0).all()
    sinks = torch.zeros(2)
    out, lse = bhqk.attention(q, k, v, masks.padding(0), backend="spans", return_lse=True, sinks=sinks)
    assert (out == 0).all() and (lse == 0).all()  # lse is the sink


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)])
def test_empty_sizes(shape):
    Bn, Qn, Kn = shape
    q, k, v = qkv(Bn, 4, 2, Qn, Kn, 8, 6, requires_grad=True)
    out, lse = bhqk.attention(q, k, v, masks.causal("bottom_right"), backend="spans", return_lse=True)
    assert out.shape == (Bn, 4, Qn, 6) and (out == 0).all() and (lse == float("-inf")).all()
    out.sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))


@pytest.mark.parametrize("kind", ["dense", "window", "document", "stripes"])
def test_large_calls_are_cut_into_calls_with_the_same_answer(monkeypatch, kind):
    monkeypatch.setattr(spans_plan, "MASK_ELEMS", 64)  # every block its own forward call
    monkeypatch.setattr(spans_kernels, "GRAD_ELEMS", 100)  # and backward calls of a block or two
    q, k, v = qkv(B, H, 2, Q, K, 8, requires_grad=True)
    m = STRIPES if kind == "stripes" else mask_kinds(B, H, Q, K)[kind]
    _compare(q, k, v, m, bias=torch.randn(1, H, Q, K, dtype=torch.float64) if kind == "dense" else None)


@pytest.mark.parametrize("kstep, L", [(0, 5), (4, 12), (4, 4), (3, 5), (6, 4)])
def test_key_gradients_of_a_group_land_on_their_keys(kstep, L):
    g = spans_plan.Group(r0=0, rows=2, n=4, k0=1, kstep=kstep, L=L, masked=False)
    part = torch.randn(2 * g.n, 3, L, 5, dtype=torch.float64)  # [B·n, Hkv, L, x]
    got = torch.zeros(2, 3, 40, 5, dtype=torch.float64)
    spans_kernels._add_keys(got, part, g, 2)
    want = torch.zeros_like(got)
    for b in range(2):
        for j in range(g.n):
            want[b, :, g.k0 + j * kstep:g.k0 + j * kstep + L] += part[b * g.n + j]
    assert_close(got, want, n=g.n)  # sums of up to n terms, in another order


def test_a_band_with_a_bias_batch_and_gqa_equals_the_reference():
    N = 512
    q, k, v = qkv(2, 2, 1, N, N, 8, requires_grad=True)
    bias = torch.randn(2, 1, N, N, dtype=torch.float64)  # every span masked, the ramp's mask per batch entry
    m = masks.sliding_window(150)
    plan = spans.plan_for(problem(q, k, v, m, bias=bias))
    assert any(g.n > 1 and g.kstep == g.rows < spans_plan.BLOCK_Q for g in plan.groups)  # the band's small blocks
    _compare(q, k, v, m, blocks={}, bias=bias)


def test_plans_are_kept_per_mask_remade_after_an_in_place_write_and_not_kept_for_inference_tensors():
    q = torch.randn(1, 2, 300, 8)
    allowed = masks.sliding_window(40).materialize(1, 1, 300, 300).clone()  # [1, 1, Q, K]
    first = spans.plan_for(problem(q, q, q, masks.dense(allowed)))
    assert spans.plan_for(problem(q, q, q, masks.dense(allowed))) is first  # one tensor, wrapped anew at each call
    window = masks.sliding_window(40)
    assert spans.plan_for(problem(q, q, q, window)) is spans.plan_for(problem(q, q, q, window))  # one mask object
    allowed[..., 200:, :] = True  # written in place: the kept plan would skip keys the mask now allows
    again = spans.plan_for(problem(q, q, q, masks.dense(allowed)))
    assert again is not first and again.computed > first.computed
    with torch.inference_mode():
        frozen = allowed.clone()  # an inference tensor: no version counter to key a kept plan by
    assert spans.plan_for(problem(q, q, q, masks.dense(frozen))) is not spans.plan_for(problem(q, q, q, masks.dense(frozen)))


def test_a_dense_masks_call_masks_are_built_once_and_follow_in_place_writes(monkeypatch):
    q, k, v = qkv(1, 2, 1, 300, 300, 8)
    allowed = masks.sliding_window(40).materialize(1, 1, 300, 300).clone()  # [1, 1, Q, K]
    built = []
    real = spans_kernels._mask
    monkeypatch.setattr(spans_kernels, "_mask", lambda *a: built.append(1) or real(*a))
    first = bhqk.attention(q, k, v, allowed, backend="spans")
    n = len(built)
    assert n > 0 and torch.equal(bhqk.attention(q, k, v, allowed, backend="spans"), first)
    assert len(built) == n, "the second call gathered its masks from the dense tensor again"
    allowed[..., 100:, :60] = False  # written in place: a new plan, new masks
    out = bhqk.attention(q, k, v, allowed, backend="spans")
    assert len(built) > n
    assert_close(out, bhqk.attention(q, k, v, allowed, backend="reference"), n=300)


@pytest.mark.parametrize("Qn, Kn", [(1, 1), (5, 9), (9, 5), (7, 7), (0, 4)])
def test_top_left_causal_count_is_what_the_mask_allows(Qn, Kn):
    allowed = masks.causal("top_left").materialize(1, 1, Qn, Kn)  # [1, 1, Q, K]
    assert masks.top_left_count(Qn, Kn) == int(allowed.sum())


def test_refusals_and_hand_offs():
    q, k, v = qkv(1, 2, 1, 6, 6, 8)
    assert "softcap" in bhqk.functional.why_not("spans", q, k, v, softcap=5.0)
    assert "dropout" in bhqk.functional.why_not("spans", q, k, v, dropout_p=0.1)
    bias = torch.zeros(6, 6, dtype=torch.float64, requires_grad=True)
    assert "bias" in bhqk.functional.why_not("spans", q, k, v, bias=bias)
    assert bhqk.functional.why_not("spans", q, k, v, masks.causal(), return_lse=True) is None
    k[0, 0, 2, 1] = float("nan")
    assert spans.hands_off(problem(q, k, v, masks.causal())) == (
        "tiled", "q, k or v holds NaN/inf, which the fused kernel lets cross the mask")


@pytest.mark.parametrize("scale", [0.0, -1.0, 1e-122])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_with_a_scale_the_kernels_is_causal_gets_wrong(scale, dtype):
    q, k, v = qkv(1, 2, 1, 6, 6, 4)
    want = bhqk.attention(q, k, v, masks.causal(), scale=scale, backend="reference")
    got = bhqk.attention(q.to(dtype), k.to(dtype), v.to(dtype), masks.causal(), scale=scale, backend="spans")
    assert_close(got, want, dtype=dtype, n=6)  # is_causal gives NaN there (-inf · scale): a masked span instead
