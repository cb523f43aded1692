"""Masks that differ by head (``masks.per_head``, ``masks.choose``): materialize, draw, FlexAttention's
mask_mod and BlockMask, tile classification, GQA heads that share or differ, the span path's groups
of heads, edits and statistics, and the budgets' streaming heads on every backend.

The reference backend (``materialize``) is the spec: every other path is compared with it within
the bounds of tests/tolerance.py.
"""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.errors import MaskError
from bhqk.functional import flex, names, prepare, spans, spans_kernels, spans_plan
from bhqk.masks import Extent, Tile
from conftest import qkv
from tolerance import assert_close

S, W = 2, 3  # a streaming head's sink and window in the small calls here


def streaming() -> masks.Mask:
    """What a streaming head sees (issue 29): the first S keys and the W keys before its query, plus its own."""
    return ~masks.key_span(0, S) | masks.sliding_window(W, align="bottom_right")


def budget(full: list[bool]) -> masks.Mask:
    """Full heads see what causal allows; the others a sink and a window, ANDed with causal."""
    return masks.choose(torch.tensor(full), None, streaming()) & masks.causal("bottom_right")


def _parts(B, H, Q, K):
    dense = torch.rand(B, H, Q, K, generator=torch.Generator().manual_seed(1)) > 0.5  # a part that differs by head itself
    return [masks.causal("bottom_right"), masks.sliding_window(1, 1, align="bottom_right"), masks.dense(dense), None]


# ---- the mask as a value ------------------------------------------------------------------------------

def test_materialize_gives_each_head_its_part_at_that_head():
    B, H, Q, K = 2, 4, 5, 7
    parts = _parts(B, H, Q, K)
    m = masks.per_head(parts)
    got = m.materialize(B, H, Q, K).expand(B, H, Q, K)
    for h, part in enumerate(parts):
        want = torch.ones(B, H, Q, K, dtype=torch.bool) if part is None else part.materialize(B, H, Q, K).expand(B, H, Q, K)
        assert torch.equal(got[:, h], want[:, h]), h


def test_choose_is_per_head_of_two_masks_and_checks_its_arguments():
    heads = torch.tensor([True, False, False, True])
    a, b = masks.causal(), masks.sliding_window(1)
    got = masks.choose(heads, a, b).materialize(1, 4, 6, 6)
    want = masks.per_head([a, b, b, a]).materialize(1, 4, 6, 6)
    assert torch.equal(got, want)
    assert masks.choose(heads, a, b).head_groups(4) == [[0, 3], [1, 2]]
    with pytest.raises(MaskError, match=r"heads must be a bool tensor \[H\]"):
        masks.choose(torch.tensor([1, 0]), a, b)
    with pytest.raises(MaskError, match="per_head has 4 masks .* H=3"):
        masks.choose(heads, a, b).materialize(1, 3, 6, 6)
    with pytest.raises(MaskError, match="one per head"):
        masks.per_head(masks.causal())


def test_draw_shows_the_head_asked_for():
    m = masks.per_head([masks.causal(), masks.sliding_window(1), None])
    assert m.draw(4, 4, h=1) == masks.sliding_window(1).draw(4, 4)
    assert m.draw(4, 4, h=2) == masks.predicate(lambda b, h, q, k: q >= 0).draw(4, 4)  # every key
    assert m.draw(4, 4) == masks.causal().draw(4, 4)
    assert "heads [1]: sliding_window(1" in repr(m)
    assert "<pre" in m._repr_html_() and "cannot draw" not in m._repr_html_()


@pytest.mark.parametrize("G", [1, 2])
def test_flex_mask_mod_and_block_mask_agree_with_materialize(G):
    B, H, Q, K = 2, 4, 6, 9
    m = masks.per_head(_parts(B, H, Q, K)) & masks.padding(torch.tensor([9, 5]))
    mod = m.mask_mod(B, H, Q, K)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, H, Q, K)), indexing="ij")
    want = m.materialize(B, H, Q, K).expand(B, H, Q, K)
    assert torch.equal(mod(b, h, i, j), want)
    dense = m.block_mask(B, H, Q, K, block=3).to_dense()[0, 0].bool()  # [nq, nk]: tiles some head may attend
    some = want.any(0).any(0).unflatten(0, (2, 3)).unflatten(2, (3, 3)).any(1).any(-1)  # [Q, K] -> [nq, nk]
    assert torch.equal(dense, some)
    q, k, v = qkv(B, H, H // G, Q, K, 8, dtype=torch.float32)
    ref = bhqk.attention(q, k, v, m, backend="reference")
    with flex.uncompiled():
        assert_close(bhqk.attention(q, k, v, m, backend="flex"), ref, dtype=torch.float32, n=K)


def _exact(t: torch.Tensor) -> Tile:
    return Tile.EMPTY if not t.any() else Tile.FULL if t.all() else Tile.PARTIAL


def test_tile_classification_is_over_every_head_and_per_head_after_selection():
    B, H, Q, K = 1, 4, 16, 16
    m = budget([True, False, False, True])  # S = 2, W = 3
    ext = Extent(B, H, Q, K)
    t = m.materialize(B, H, Q, K).expand(B, H, Q, K)
    for q0 in range(0, Q, 4):
        for k0 in range(0, K, 4):
            got, want = m.classify(ext, q0, q0 + 4, k0, k0 + 4), _exact(t[..., q0:q0 + 4, k0:k0 + 4])
            assert got is want or got is Tile.PARTIAL, (q0, k0, got, want)  # never wrong over every head
            for hs in m.head_groups(H):
                sub = m.select_heads(hs, H)
                got, want = sub.classify(Extent(B, len(hs), Q, K), q0, q0 + 4, k0, k0 + 4), _exact(t[:, hs, q0:q0 + 4, k0:k0 + 4])
                assert got is want or got is Tile.PARTIAL, (hs, q0, k0, got, want)
    # rows 12…15, keys 4…7: full heads see all of it, streaming heads none; partial over every head
    assert m.classify(ext, 12, 16, 4, 8) is Tile.PARTIAL
    by_group = [m.select_heads(hs, H).classify(Extent(B, 2, Q, K), 12, 16, 4, 8) for hs in m.head_groups(H)]
    assert by_group == [Tile.FULL, Tile.EMPTY]
    empty, full = m.classify_grid(ext, 4, 4)
    blocks = t.any(0).any(0).unflatten(0, (4, 4)).unflatten(2, (4, 4))  # [Q, K] -> [nq, 4, nk, 4]
    assert torch.equal(empty, ~blocks.any(1).any(-1))
    assert torch.equal(full, t.all(0).all(0).unflatten(0, (4, 4)).unflatten(2, (4, 4)).all(1).all(-1))


def test_properties_are_derived_from_the_parts():
    m = budget([True, False, True, False])
    assert m.head_dependent and not m.shift_invariant  # key_span is not shift-invariant
    window = masks.choose([True, False], None, masks.sliding_window(3)) & masks.causal()
    assert window.head_dependent and window.shift_invariant and window.arithmetic
    c = masks.causal()
    assert not masks.per_head([c, c]).head_dependent  # one part: one structure
    assert m.only_past(Extent(1, 4, 8, 8))
    assert not masks.per_head([c, None]).only_past(Extent(1, 2, 8, 8))
    assert masks.per_head([masks.causal("bottom_right")] * 2).causal_diagonal(Extent(1, 2, 5, 8)) == 3
    assert masks.per_head([c, None]).causal_diagonal(Extent(1, 2, 8, 8)) is None
    assert masks.per_head([c, masks.predicate(lambda b, h, q, k: q >= k)]).whole_grid is False


# ---- GQA: the query heads of one KV head may share a part or differ ----------------------------------

@pytest.mark.parametrize("full, whole", [([True, True, False, False], True), ([True, False, True, False], False)])
def test_gqa_heads_of_one_kv_head_share_or_differ(full, whole):
    B, H, Hkv, Q, K, d = 2, 4, 2, 9, 12, 8
    q, k, v = qkv(B, H, Hkv, Q, K, d, dtype=torch.float64)
    m = budget(full)
    p = prepare(q, k, v, m)
    plan = spans.plan_for(p)
    assert [g.heads for g in plan.by_heads] == ([[0, 1], [2, 3]] if whole else [[0, 2], [1, 3]])
    sub = spans.on_heads(p, plan.by_heads[0].heads, plan.by_heads[0].mask)
    assert sub.k.shape[1] == (1 if whole else 2)  # whole KV groups stay grouped; split ones get a copy per query head
    for backend in ("spans", "tiled", "torch"):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        out = bhqk.attention(*ins, m, backend=backend)
        want = bhqk.attention(*ref, m, backend="reference")
        assert_close(out, want, dtype=torch.float64, n=K)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        for g, w in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(want, ref, dout)):
            assert_close(g, w, dtype=torch.float64, n=max(K, Q * H // Hkv))


# ---- the span path: one call per group of heads of equal structure ---------------------------------

def test_span_path_groups_heads_of_equal_structure(monkeypatch):
    B, H, Q, K, d = 1, 8, 512, 512, 16
    q, k, v = qkv(B, H, H, Q, K, d, dtype=torch.float32)
    stream = ~masks.key_span(0, 64) | masks.sliding_window(128, align="bottom_right")
    full = [True, False, False, True, False, False, False, False]
    m = masks.choose(torch.tensor(full), None, stream) & masks.causal()
    p = prepare(q, k, v, m)
    plan = spans.plan_for(p)
    assert [g.heads for g in plan.by_heads] == [[0, 3], [1, 2, 4, 5, 6, 7]]
    full_plan, stream_plan = (g.plan for g in plan.by_heads)
    assert full_plan.groups == [spans_plan.Group(0, Q, 1, 0, 0, K, False, True)]  # causal alone: one is_causal call
    assert stream_plan.fraction(p.ext) < 0.5  # the streaming heads compute their sink and window only
    calls = []
    real = spans_kernels._FWD
    monkeypatch.setattr(spans_kernels, "_FWD", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    out = bhqk.attention(q, k, v, m, backend="spans")
    want_calls = sum(len(list(spans_kernels.kernel_calls(spans.on_heads(p, g.heads, g.mask), g.plan))) for g in plan.by_heads)
    assert len(calls) == want_calls
    assert {c[1] for c in calls} == {2, 6}  # every kernel call runs one group's heads: 2 full, 6 streaming
    assert_close(out, bhqk.attention(q, k, v, m, backend="reference"), dtype=torch.float32, n=K)
    # the same mask given per head as a dense tensor has no groups: every call spans every head
    dense = masks.dense(m.materialize(B, H, Q, K))
    assert not spans.plan_for(prepare(q, k, v, dense)).by_heads
    assert spans.share(p) < spans.share(prepare(q, k, v, dense))


# ---- the budgets' streaming heads on every backend, forward and backward, MHA and GQA -------------------

@pytest.mark.parametrize("Hkv", [4, 2])
@pytest.mark.parametrize("backend", names())
def test_streaming_heads_and_causal_on_every_backend(backend, Hkv):
    B, H, Q, K, d = 2, 4, 11, 11, 8
    q, k, v = qkv(B, H, Hkv, Q, K, d, dtype=torch.float64)
    m = budget([False, True, True, False])  # GQA: KV head 0 serves a streaming and a full head
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = bhqk.attention(*ref, m, backend="reference")
    grad = backend != "flex"  # flex: no backward on the CPU (tests/test_semantics.py checks it refuses in words)
    with flex.uncompiled():
        out = bhqk.attention(*(ins if grad else [t.detach() for t in ins]), m, backend=backend)
    assert_close(out, want, dtype=torch.float64, n=K, msg=backend)
    if grad:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        for g, w in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(want, ref, dout)):
            assert_close(g, w, dtype=torch.float64, n=max(K, Q * H // Hkv), msg=backend)


# ---- edits and statistics --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["spans", "tiled", "reference"])
def test_a_mask_edit_on_named_heads_equals_the_per_head_mask(backend):
    """How the budgets emulate streaming heads: ``edit(heads=..., mask=streaming)`` is the per-head mask."""
    B, H, Hkv, Q, K, d = 1, 4, 2, 10, 10, 8
    q, k, v = qkv(B, H, Hkv, Q, K, d, dtype=torch.float64)
    with bhqk.edit(heads=[1, 2], mask=streaming()):
        got = bhqk.attention(q, k, v, masks.causal(), backend=backend)
    want = bhqk.attention(q, k, v, budget([True, False, False, True]), backend="reference")
    assert_close(got, want, dtype=torch.float64, n=K)
    # and an edit on a call whose own mask differs by head: ANDed into the named heads only
    with bhqk.edit(heads=[0], mask=masks.key_span(0, 1)):
        got = bhqk.attention(q, k, v, budget([True, False, False, True]), backend=backend)
    edited = masks.per_head([masks.key_span(0, 1), None, None, None]) & budget([True, False, False, True])
    assert_close(got, bhqk.attention(q, k, v, edited, backend="reference"), dtype=torch.float64, n=K)


def test_capture_statistics_see_each_heads_mask():
    B, H, Hkv, Q, K, d = 1, 4, 2, 12, 12, 8
    q, k, v = qkv(B, H, Hkv, Q, K, d, dtype=torch.float32)
    m = budget([True, False, False, True])
    dense = masks.dense(m.materialize(B, H, Q, K))  # the same mask, as a tensor
    got, want = {}, {}
    for key, mask in (("per_head", m), ("dense", dense)):
        with bhqk.capture(what=("weights", "entropy", "distance", "sink")) as cap:
            bhqk.attention(q, k, v, mask, backend="spans")
        (got if key == "per_head" else want).update(
            {n: getattr(cap[0], n) for n in ("weights", "entropy", "distance", "sink")})
    allowed = m.materialize(B, H, Q, K).expand(B, H, Q, K)
    assert bool((got["weights"][~allowed] == 0).all())
    for n in got:
        assert_close(got[n], want[n], dtype=torch.float32, n=K, msg=n)


def test_tiled_device_path_takes_per_head_masks():
    """The tiled device path (what CUDA tensors take; emulated on the CPU) stages a per-head mask's
    parts and equals the reference, forward and backward."""
    from bhqk.functional.tiled_plan import device_mode

    B, H, Hkv, Q, K, d = 2, 4, 2, 13, 13, 8
    q, k, v = qkv(B, H, Hkv, Q, K, d, dtype=torch.float64)
    ids = torch.tensor([0] * 6 + [1] * 7)
    m = masks.per_head([masks.document(ids), None, masks.padding(torch.tensor([9, 13])), masks.document(ids)]) & budget(
        [True, False, True, False])
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    with device_mode():
        out = bhqk.attention(*ins, m, backend="tiled")
    want = bhqk.attention(*ref, m, backend="reference")
    assert_close(out, want, dtype=torch.float64, n=K)
    for g, w in zip(torch.autograd.grad(out.sum(), ins), torch.autograd.grad(want.sum(), ref)):
        assert_close(g, w, dtype=torch.float64, n=max(K, 2 * Q))
