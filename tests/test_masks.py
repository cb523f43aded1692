"""Masks are values: materialize vs the definition, combinators, drawing, tile classification."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bhqk import MaskError, masks
from bhqk.masks import Extent, Tile
from conftest import mask_kinds


def test_causal_alignments_drawn():
    assert masks.causal("top_left").draw(3, 5) == "■ · · · ·\n■ ■ · · ·\n■ ■ ■ · ·"
    assert masks.causal("bottom_right").draw(3, 5) == "■ ■ ■ · ·\n■ ■ ■ ■ ·\n■ ■ ■ ■ ■"
    assert masks.causal().draw(3, 3) == masks.causal("top_left").draw(3, 3)
    assert "■" in str(masks.causal()) and "causal()" in str(masks.causal())


def test_definitions_by_index():
    B, H, Q, K = 2, 3, 6, 9
    b = torch.arange(B)[:, None, None, None]  # [B, 1, 1, 1]
    q = torch.arange(Q)[None, None, :, None]  # [1, 1, Q, 1]
    k = torch.arange(K)[None, None, None, :]  # [1, 1, 1, K]
    off = K - Q
    lengths = torch.tensor([4, 9])
    ids_q, ids_k = torch.tensor([0, 0, 1, 1, 1, 2]), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    cases = {
        masks.causal("top_left"): k <= q,
        masks.causal("bottom_right"): k <= q + off,
        masks.sliding_window(2, 1, align="bottom_right"): (k >= q + off - 2) & (k <= q + off + 1),
        masks.padding(lengths): k < lengths[b],
        masks.prefix_lm(3, align="top_left"): (k < 3) | (k <= q),
        masks.document(ids_q, ids_k): ids_q[None, None, :, None] == ids_k[None, None, None, :],
        masks.key_padding(torch.arange(K)[None] < lengths[:, None]): k < lengths[b],
    }
    for m, want in cases.items():
        got = m.materialize(B, H, Q, K)
        assert got.dim() == 4, m
        assert torch.equal(got.expand(B, H, Q, K), want.expand(B, H, Q, K)), m


@st.composite
def extents(draw):
    return Extent(draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 20)), draw(st.integers(1, 20)))


@settings(max_examples=60, deadline=None)
@given(ext=extents(), names=st.lists(st.sampled_from(list(mask_kinds(1, 1, 1, 1))), min_size=1, max_size=3),
       ops=st.lists(st.sampled_from(["&", "|", "~"]), min_size=2, max_size=2), seed=st.integers(0, 1000))
def test_combinators_equal_boolean_algebra_of_materialized(ext, names, ops, seed):
    kinds = mask_kinds(ext.B, ext.H, ext.Q, ext.K, seed)
    ms = [kinds[n] for n in names]
    dense = [m.materialize(ext.B, ext.H, ext.Q, ext.K).expand(ext.B, ext.H, ext.Q, ext.K) for m in ms]
    combined, want = ms[0], dense[0]
    for op, m, d in zip(ops, ms[1:] + ms[:1], dense[1:] + dense[:1]):
        if op == "&":
            combined, want = combined & m, want & d
        elif op == "|":
            combined, want = combined | m, want | d
        else:
            combined, want = ~combined, ~want
    got = combined.materialize(ext.B, ext.H, ext.Q, ext.K).expand(ext.B, ext.H, ext.Q, ext.K)
    assert torch.equal(got, want)


@settings(max_examples=80, deadline=None)
@given(ext=extents(), name=st.sampled_from(list(mask_kinds(1, 1, 1, 1))), negate=st.booleans(),
       seed=st.integers(0, 1000), data=st.data())
def test_tile_classification_is_never_wrong(ext, name, negate, seed, data):
    m = mask_kinds(ext.B, ext.H, ext.Q, ext.K, seed)[name]
    m = ~m if negate else m
    full = m.materialize(ext.B, ext.H, ext.Q, ext.K).expand(ext.B, ext.H, ext.Q, ext.K)
    q0 = data.draw(st.integers(0, ext.Q - 1))
    q1 = data.draw(st.integers(q0 + 1, ext.Q))
    k0 = data.draw(st.integers(0, ext.K - 1))
    k1 = data.draw(st.integers(k0 + 1, ext.K))
    tile = full[:, :, q0:q1, k0:k1]
    kind = m.classify(ext, q0, q1, k0, k1)
    if kind is Tile.EMPTY:
        assert not tile.any()
    elif kind is Tile.FULL:
        assert tile.all()
    block = m.block(ext, q0, q1, k0, k1)
    assert torch.equal(block.expand_as(tile) if block.dim() == 4 else block.expand(tile.shape), tile)


def test_classification_is_exact_for_structured_masks_on_simple_tiles():
    ext = Extent(1, 1, 64, 64)
    c = masks.causal()
    assert c.classify(ext, 32, 48, 0, 16) is Tile.FULL
    assert c.classify(ext, 0, 16, 32, 48) is Tile.EMPTY
    assert c.classify(ext, 16, 32, 16, 32) is Tile.PARTIAL
    w = masks.sliding_window(8)
    assert w.classify(ext, 48, 64, 0, 16) is Tile.EMPTY
    p = masks.padding(torch.tensor([40]))
    assert p.classify(ext, 0, 64, 48, 64) is Tile.EMPTY and p.classify(ext, 0, 64, 0, 32) is Tile.FULL
    d = masks.document(torch.arange(64) // 16)
    assert d.classify(ext, 0, 16, 16, 32) is Tile.EMPTY and d.classify(ext, 16, 32, 16, 32) is Tile.FULL


def test_converters():
    hf = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(masks.from_hf(hf).materialize(2, 1, 2, 3)[:, 0, 0], hf.bool())
    kpm = torch.tensor([[False, True, False]])  # torch MHA: True = padding
    assert torch.equal(masks.from_torch_mha(key_padding_mask=kpm, num_heads=2).materialize(1, 2, 1, 3)[0, 0, 0],
                       torch.tensor([True, False, True]))
    kw = masks.to_sdpa(masks.causal("top_left"), 1, 1, 3, 5)
    assert kw == {"attn_mask": None, "is_causal": True}
    kw = masks.to_sdpa(masks.causal("bottom_right"), 1, 1, 3, 5)
    assert kw["is_causal"] is False and kw["attn_mask"][0, 0, 0].tolist() == [True, True, True, False, False]


def test_bad_masks_are_errors():
    with pytest.raises(MaskError, match="top_left"):
        masks.causal("middle")
    with pytest.raises(ValueError, match="left >= 0"):
        masks.sliding_window(-1)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        masks.key_padding(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool tensor"):
        masks.predicate(lambda b, h, q, k: q - k).materialize(1, 1, 2, 2)


def test_masks_render_in_jupyter_bounded_at_any_length():
    """_repr_html_: the repr and the drawing of batch 0, head 0, at most HTML_MAX × HTML_MAX entries
    (a large mask shows its corner, and only that block is evaluated)."""
    def drawn(page):  # the ■ of the drawing (the legend has one too)
        return page.split("<pre", 1)[1].count("■")

    small = masks.sliding_window(2)._repr_html_()
    assert "sliding_window(2" in small and drawn(small) == 8 * 3 - 3  # rows 0 and 1 see 1 and 2 keys
    big = masks.dense(torch.ones(1, 1, 5000, 5000, dtype=torch.bool).tril())._repr_html_()
    assert "the corner of 5000 × 5000" in big and drawn(big) == 48 * 49 // 2 and len(big) < 10_000
    assert drawn(masks.causal()._repr_html_()) == 8 * 9 // 2  # a size-free mask: drawn at 8 × 8


@pytest.mark.parametrize("backend", ["spans", "tiled", "torch", "reference"])
@pytest.mark.parametrize("kind", ["padding", "key_padding"])
def test_a_mask_is_a_value_writing_into_the_tensor_it_was_built_from_changes_nothing(kind, backend):
    """Masks are values (docs/design.md §2): a padding mask keeps its lengths (its tile classification
    summarizes them at construction), so a later in-place write to the caller's tensor must not make
    the backends that classify tiles skip keys the others attend (found in review)."""
    import bhqk
    from tolerance import assert_close

    B, H, N = 2, 2, 300
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, 8, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([100, 200])
    valid = torch.arange(N)[None, :] < lengths[:, None]  # [B, K]: the same keys as a bool
    m = masks.padding(lengths) if kind == "padding" else masks.key_padding(valid)
    want = bhqk.attention(q, k, v, m.materialize(B, H, N, N), backend="reference")  # the mask as built
    lengths.fill_(280)
    valid.fill_(True)
    got = bhqk.attention(q.float(), k.float(), v.float(), m, backend=backend)
    assert_close(got, want, dtype=torch.float32, n=N, msg=f"{kind} on {backend} after an in-place write")


# ---- what each mask declares of itself agrees with what it is ------------------------------------------

def _declaring_kinds(B, H, Q, K):
    kinds = dict(mask_kinds(B, H, Q, K))
    c = masks.causal("bottom_right")
    kinds.update({
        "per_head": masks.per_head([c, masks.sliding_window(1, align="bottom_right"), None]),
        "per_head_same": masks.per_head([c, c, c]),
        "dense_by_head": masks.dense(torch.rand(B, H, Q, K, generator=torch.Generator().manual_seed(4)) > 0.5),
        "predicate_by_head": masks.predicate(lambda b, h, q, k: (q + h) >= k, "by_head"),
        "window&~span": masks.sliding_window(2, align="bottom_right") & ~masks.key_span(0, 1),
        "causal|window": masks.causal("bottom_right") | masks.sliding_window(1, 1, align="bottom_right"),
    })
    return kinds


@pytest.mark.parametrize("Q, K", [(6, 6), (4, 9)])
def test_declared_properties_agree_with_the_materialized_mask(Q, K):
    """head_dependent, shift_invariant, only_past, causal_diagonal, head_groups and select_heads:
    a property a mask declares True (or a value it gives) holds on its materialized entries."""
    B, H = 2, 3
    ext = Extent(B, H, Q, K)
    i, j = torch.arange(Q)[:, None], torch.arange(K)[None, :]
    for name, m in _declaring_kinds(B, H, Q, K).items():
        t = m.materialize(B, H, Q, K).expand(B, H, Q, K)
        if not m.head_dependent:
            assert bool((t == t[:, :1]).all()), name
        if m.shift_invariant:  # entries depend on k − q only: equal along every diagonal
            assert torch.equal(t[..., 1:, 1:], t[..., :-1, :-1]), name
        if m.only_past(ext):
            assert not bool(t[..., j > i + K - Q].any()), name
        if (c := m.causal_diagonal(ext)) is not None:
            assert torch.equal(t, (j <= i + c).expand(B, H, Q, K)), name
        groups = m.head_groups(H)
        assert sorted(h for g in groups for h in g) == list(range(H)), name
        for hs in groups:
            sub = m.select_heads(hs, H)
            if sub is not None:
                assert torch.equal(sub.materialize(B, len(hs), Q, K).expand(B, len(hs), Q, K), t[:, hs]), name
    kinds = _declaring_kinds(B, H, Q, K)
    assert kinds["per_head"].head_dependent and kinds["dense_by_head"].head_dependent
    assert kinds["predicate_by_head"].head_dependent and not kinds["per_head_same"].head_dependent
    assert kinds["window&~span"].only_past(ext) and kinds["window"].shift_invariant
    assert kinds["per_head"].head_groups(H) == [[0], [1], [2]]


def test_the_polarity_warning_is_said_where_a_tensor_becomes_the_calls_mask():
    """A tensor in nn.MultiheadAttention polarity warns where it becomes a call's mask (``as_mask``),
    outside any ``~``; building the mask warns of nothing."""
    import warnings

    from bhqk.errors import MisuseWarning

    mha = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # True = masked out
    with warnings.catch_warnings():
        warnings.simplefilter("error", MisuseWarning)
        m = masks.dense(mha) & masks.padding(4)  # no warning yet
        masks.as_mask(~m)
        masks.as_mask(masks.per_head([~masks.dense(mha), masks.causal()]))
    with pytest.warns(MisuseWarning, match="polarity"):
        masks.as_mask(m)
    with pytest.warns(MisuseWarning, match="polarity"):
        masks.as_mask(masks.per_head([masks.dense(mha), masks.causal()]))
