"""Dense masks are classified into tiles one grid at a time (one vectorised reduction, cached on the
mask); the result must equal classifying each tile on its own (``Mask.classify``, which evaluates
the tile; combinations combine their parts' classes), for any mask, broadcast shape and grid."""

from __future__ import annotations

from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bhqk import masks
from bhqk.functional import prepare
from bhqk.functional.tiled_plan import _cuts, classify_leaves, grid_codes, make_plan
from bhqk.masks import Extent, Mask, Tile
from bhqk.masks.dense import GRID_CODES


def per_tile(mask: Mask, ext: Extent, bq: int, bk: int) -> list[list[Tile]]:
    qc, kc = _cuts(ext.Q, bq), _cuts(ext.K, bk)
    return [[mask.classify(ext, q0, q1, k0, k1) for k0, k1 in pairwise(kc)] for q0, q1 in pairwise(qc)]


@st.composite
def dense_masks(draw):
    B, H, Q, K = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 70)), draw(st.integers(1, 70))
    shape = [b if draw(st.booleans()) else 1 for b in (B, H, Q, K)]  # some axes broadcast
    kind = draw(st.sampled_from(["random", "sparse", "dense", "band"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "band":
        shape[2], shape[3] = Q, K
        w = draw(st.integers(0, 20))
        qi, ki = torch.arange(Q)[:, None], torch.arange(K)[None, :]
        t = ((ki <= qi) & (ki > qi - w)).expand(shape)
    else:
        p = {"random": 0.5, "sparse": 0.97, "dense": 0.03}[kind]
        t = torch.rand(shape, generator=g) > p
    return Extent(B, H, Q, K), t


@settings(max_examples=150, deadline=None)
@given(dense_masks(), st.integers(1, 40), st.integers(1, 40))
def test_grid_classification_equals_per_tile(case, bq, bk):
    ext, t = case
    m = masks.dense(t)
    codes = m.grid_codes(ext, bq, bk)
    assert [[GRID_CODES[c] for c in row] for row in codes.tolist()] == per_tile(m, ext, bq, bk)
    again = m.grid_codes(ext, bq, bk)  # cached: the same answer
    assert torch.equal(again, codes)


@settings(max_examples=60, deadline=None)
@given(dense_masks(), st.integers(1, 24), st.integers(1, 24), st.sampled_from(["and", "or", "not", "and_causal"]))
def test_combinations_and_leaves_cover_the_grid_with_the_right_classes(case, bq, bk, op):
    ext, t = case
    d = masks.dense(t)
    other = masks.dense(torch.rand(t.shape, generator=torch.Generator().manual_seed(1)) > 0.5)
    mask = {"and": d & other, "or": d | other, "not": ~d,
            "and_causal": d & masks.causal("bottom_right")}[op]
    truth = per_tile(mask, ext, bq, bk)
    codes = grid_codes(mask, ext, bq, bk)
    assert [[GRID_CODES[c] for c in row] for row in codes.tolist()] == truth
    qc, kc = _cuts(ext.Q, bq), _cuts(ext.K, bk)
    seen = [[None] * (len(kc) - 1) for _ in range(len(qc) - 1)]
    for i0, i1, j0, j1, tile in classify_leaves(mask, ext, qc, kc):  # merged rectangles, each block once
        assert tile is Tile.PARTIAL or (i1 - i0) * (j1 - j0) >= 1
        assert tile is not Tile.PARTIAL or (i1 - i0, j1 - j0) == (1, 1)
        for i in range(i0, i1):
            for j in range(j0, j1):
                assert seen[i][j] is None
                seen[i][j] = tile
    assert seen == truth


def test_dense_window_plans_like_the_structured_mask():
    N = 512
    q = torch.empty(1, 2, N, 16)
    structured = masks.sliding_window(64)
    dense = masks.dense(structured.materialize(1, 1, N, N))
    for bq, bk in ((64, 64), (32, 128), (128, 32)):
        a, b = make_plan(prepare(q, q, q, structured), bq, bk), make_plan(prepare(q, q, q, dense), bq, bk)
        assert (a.computed, a.partial, a.partial_elems) == (b.computed, b.partial, b.partial_elems)


def test_empty_extent_and_broadcast_mask():
    m = masks.dense(torch.tensor([True, False, True]))  # [1, 1, 1, K]: broadcast over Q
    codes = m.grid_codes(Extent(2, 1, 5, 3), 2, 1)
    assert codes.tolist() == [[1, 0, 1]] * 3
    assert masks.dense(torch.ones(1, 1, 0, 4, dtype=torch.bool)).grid_codes(Extent(1, 1, 0, 4), 2, 2).shape == (0, 2)


def test_classification_is_shared_by_masks_on_one_tensor_until_it_changes():
    t = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    t[..., :16] = True
    ext = Extent(1, 1, 32, 32)
    first = masks.dense(t).grid_codes(ext, 16, 16)
    assert first.tolist() == [[1, 0], [1, 0]]
    assert masks.dense(t)._grids is masks.dense(t)._grids  # a model's layers share one classification
    t[0, 0, 20, 20] = True  # changed in place: classified again, never stale
    assert masks.dense(t).grid_codes(ext, 16, 16).tolist() == [[1, 0], [1, 2]]
