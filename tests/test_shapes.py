"""``check_qkv`` keeps the sizes of calls that passed, by everything its checks read (shapes, dtypes,
devices, layout): a kept call is not checked again, a call differing in any of them is, errors are
never kept, and the sizes handed out are copies (binding into one leaves the next call's alone)."""

from __future__ import annotations

import pytest
import torch

from bhqk import shapes
from bhqk.errors import ShapeError


def _qkv(Q=1, K=6, H=4, Hkv=2, d=8, dtype=torch.float32):
    return torch.zeros(2, H, Q, d, dtype=dtype), torch.zeros(2, Hkv, K, d, dtype=dtype), torch.zeros(2, Hkv, K, d, dtype=dtype)


def test_a_kept_call_gets_a_copy_of_its_sizes():
    q, k, v = _qkv()
    first = shapes.check_qkv(q, k, v)
    first.bind("sinks", (4,), ("H",))  # what prepare does with sinks
    first.bind("extra", (3,), ("X",))
    again = shapes.check_qkv(q, k, v)  # kept: a fresh copy, without the names bound into the first
    assert again.size == {"B": 2, "H": 4, "Q": 1, "d": 8, "Hkv": 2, "K": 6, "dv": 8}
    assert [arg for arg, *_ in again.seen] == ["q", "k", "v"]
    assert "X" not in shapes.check_qkv(q, k, v).size


@pytest.mark.parametrize("change", ["dtype", "device", "layout", "shape"])
def test_a_call_that_differs_from_a_kept_one_in_what_the_checks_read_is_checked(change):
    q, k, v = _qkv()
    shapes.check_qkv(q, k, v)  # passes and is kept
    if change == "dtype":
        with pytest.raises(ShapeError, match="k has dtype torch.float64 but q has torch.float32"):
            shapes.check_qkv(q, k.double(), v)
    elif change == "device":
        with pytest.raises(ShapeError, match="k is on meta but q is on cpu"):
            shapes.check_qkv(q, k.to("meta"), v)
    elif change == "layout":  # the same tensors read as [B, N, H, d]: H=1 query heads, Hkv=6 key heads
        with pytest.raises(ShapeError, match="not divisible"):
            shapes.check_qkv(q, k, v, layout="bnhd")
    else:
        with pytest.raises(ShapeError, match="v has"):
            shapes.check_qkv(q, k, v[:, :, :5])


def test_errors_are_not_kept():
    q, k, v = _qkv(H=3, Hkv=2)
    for _ in range(2):  # the second call is refused as the first was
        with pytest.raises(ShapeError, match="H=3 is not divisible by Hkv=2"):
            shapes.check_qkv(q, k, v)


def test_the_kept_calls_are_bounded(monkeypatch):
    shapes.CHECKED.clear()
    monkeypatch.setattr(shapes.CHECKED, "size", 3)
    for K in range(1, 8):  # a decode loop: one new K per step
        q, k, v = _qkv(K=K)
        assert shapes.check_qkv(q, k, v)["K"] == K
        assert len(shapes.CHECKED) <= 3


def test_a_problems_extent_is_bound_once_and_follows_a_replace():
    import dataclasses

    from bhqk.functional import prepare

    q, k, v = _qkv(Q=3, K=6)
    p = prepare(q, k, v)
    assert (p.ext.B, p.ext.H, p.ext.Q, p.ext.K) == (2, 4, 3, 6)
    assert p.ext is p.ext  # bound once, not rebuilt per read
    sizes = shapes.Sizes(**{**p.sizes.size, "Q": 1})
    moved = dataclasses.replace(p, q=q[:, :, :1], sizes=sizes)  # a problem for other sizes: its extent follows
    assert (moved.ext.Q, moved.ext.K) == (1, 6) and (p.ext.Q, p.ext.K) == (3, 6)
