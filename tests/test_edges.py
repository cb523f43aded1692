"""Numerical and size edges, decided once and held by every backend (docs/design.md §2, "Decided edges").

- NaN/inf in v (or +inf in k) at key j never reaches a query row that may not attend j, for any
  tile size; a row that does attend it gets what the formula gives (NaN/inf).
- A query row holding NaN gives NaN in that row's output (the formula's answer), on every backend;
  a fully masked row stays 0 whatever its query holds.
- A finite bias, however negative (``torch.finfo(float32).min``, Hugging Face's padding idiom), is
  a number, never -inf: a row biased by it on every key gets the formula's answer (the mean of v).
- scale / softcap NaN or inf, a bias holding +inf or NaN: a ValueError naming the argument.
- B, Q or K = 0: output of the right shape with fully-masked-row semantics (out 0, weights of
  shape [.., 0], lse -inf), on every backend, ``auto`` and ``attention_weights``.
"""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.errors import MaskError, ShapeError
from bhqk.functional import flex
from conftest import concrete_backends, qkv
from tolerance import assert_close

BACKENDS = concrete_backends()
NAN, INF = float("nan"), float("inf")


def _banded(Q, K):
    """A mask in which query row i may attend keys [i-2, i+2] only: each key is attended by some rows, not others."""
    i, j = torch.arange(Q)[:, None], torch.arange(K)[None]
    return (j - i).abs() <= 2  # [Q, K]


# ---- non-finite values ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend, blocks", [(b, None) for b in BACKENDS] + [("tiled", (16, 16)), ("tiled", (32, 8))])
@pytest.mark.parametrize("poison", [NAN, INF, -INF])
def test_nonfinite_value_reaches_only_rows_that_attend_it(backend, blocks, poison):
    Q = K = 40
    q, k, v = qkv(2, 4, 2, Q, K, 8, dtype=torch.float32)
    allowed = _banded(Q, K)
    j = 20
    v[0, 1, j, 3] = poison  # kv head 1 serves query heads 2, 3
    kw = {"block_q": blocks[0], "block_k": blocks[1]} if blocks else {}
    out = bhqk.attention(q, k, v, allowed, backend=backend, **kw)
    attends = allowed[:, j]  # [Q]
    clean = bhqk.attention(q, k, v.nan_to_num(0.0, 0.0, 0.0), allowed, backend="reference")
    hit = out[0, 2:, attends, 3]
    assert not torch.isfinite(hit).any(), "a row that attends the poisoned value gets the formula's NaN/inf"
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[0, 2:, attends, 3] = False
    assert torch.isfinite(out[rest]).all(), "NaN/inf reached a row that may not attend the key"
    torch.testing.assert_close(out[rest], clean[rest])


@pytest.mark.parametrize("backend", ["torch", "flex", "auto"])
def test_a_call_handed_to_tiled_is_traced_as_tiled(backend):
    """SDPA and FlexAttention let NaN/inf cross the mask: such a call is computed by tiled, and says so."""
    q, k, v = qkv(1, 2, None, 12, 12, 8, dtype=torch.float32)
    v[0, 1, 5, 0] = NAN
    m = _banded(12, 12)
    with torch.no_grad(), flex.uncompiled(), bhqk.trace() as t:
        out = bhqk.attention(q, k, v, m, backend=backend)
        bhqk.attention(q, k, v.nan_to_num(0.0), m, backend=backend)
        reason = bhqk.choose_backend(q, k, v, m).reason
    assert [c.backend for c in t.calls] == ["tiled", "torch" if backend == "auto" else backend]
    torch.testing.assert_close(out, bhqk.attention(q, k, v, m, backend="tiled"), equal_nan=True)
    assert "torch hands it to tiled: q, k or v holds NaN/inf, which SDPA lets cross the mask" in reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_value_gradients_stay_with_rows_that_attend_it(backend):
    Q = K = 40
    q, k, v = qkv(1, 2, None, Q, K, 8, dtype=torch.float64)
    allowed = _banded(Q, K)
    v[0, 0, 20] = NAN
    q.requires_grad_(True)
    out = bhqk.attention(q, k, v, allowed, backend=backend)
    out[torch.isfinite(out)].sum().backward()
    rows = ~allowed[:, 20]
    assert torch.isfinite(q.grad[0, 0, rows]).all() and torch.isfinite(q.grad[0, 1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [INF, -INF, NAN])
def test_nonfinite_key_never_reaches_rows_that_cannot_attend_it(backend, poison):
    Q = K = 40
    q, k, v = qkv(2, 2, None, Q, K, 8, dtype=torch.float32)
    allowed = _banded(Q, K)
    k[1, 0, 7] = poison
    out = bhqk.attention(q, k, v, allowed, backend=backend)
    rows = ~allowed[:, 7]
    clean = bhqk.attention(q, k.nan_to_num(0.0, 0.0, 0.0), v, allowed, backend="reference")
    assert torch.isfinite(out[1, 0, rows]).all()
    torch.testing.assert_close(out[1, 0, rows], clean[1, 0, rows])
    torch.testing.assert_close(out[0], clean[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("K", [7, 300])
def test_nan_query_row_gives_nan_in_that_row_only(backend, K):
    q, k, v = qkv(1, 2, None, 5, K, 8, dtype=torch.float32)
    q[0, 1, 2, 0] = NAN
    out = bhqk.attention(q, k, v, backend=backend)
    assert torch.isnan(out[0, 1, 2]).all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, 1, 2] = False
    assert torch.isfinite(out[keep]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_in_fully_masked_row_gives_zero(backend):
    q, k, v = qkv(1, 2, None, 5, 9, 8, dtype=torch.float32)
    q[0, 1, 2] = NAN
    allowed = torch.ones(5, 9, dtype=torch.bool)
    allowed[2] = False
    out = bhqk.attention(q, k, v, allowed, backend=backend)
    assert (out[0, :, 2] == 0).all() and torch.isfinite(out).all()


# ---- a huge finite bias ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finfo_min_bias_on_every_key_gives_the_formula(backend, dtype):
    Q, K = 6, 300
    q, k, v = qkv(2, 2, None, Q, K, 8, dtype=torch.float64)
    lowest = torch.finfo(dtype).min  # Hugging Face pads with the model dtype's lowest value
    bias = torch.zeros(2, 1, 1, K, dtype=dtype)
    bias[1] = lowest  # batch element 1: every key "padded"
    bias[0, ..., 200:] = lowest  # batch element 0: keys 200… padded
    want = bhqk.attention(q, k, v, bias=bias.double(), backend="reference")
    torch.testing.assert_close(want[1], v[1].mean(dim=-2, keepdim=True).expand(2, Q, 8))
    got = bhqk.attention(q.to(dtype), k.to(dtype), v.to(dtype), bias=bias, backend=backend)
    want = bhqk.attention(*(t.to(dtype).double() for t in (q, k, v)), bias=bias.double(), backend="reference")
    assert_close(got, want, n=K, msg="the model dtype's lowest as padding")  # an error of the inputs' rounding is no error
    float32_bias = bias.float().masked_fill(bias < 0, torch.finfo(torch.float32).min)  # the float32 idiom with bf16 inputs
    got = bhqk.attention(q.to(dtype), k.to(dtype), v.to(dtype), bias=float32_bias, backend=backend)
    assert_close(got, want, n=K, msg="float32's lowest as padding")


# ---- argument validation --------------------------------------------------------------------------


@pytest.mark.parametrize("kw, name", [
    ({"scale": NAN}, "scale"), ({"scale": INF}, "scale"), ({"scale": -INF}, "scale"),
    ({"softcap": INF}, "softcap"), ({"softcap": NAN}, "softcap"),
    ({"bias": torch.full((5, 7), INF)}, "bias"), ({"bias": torch.full((5, 7), NAN)}, "bias"),
])
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_nonfinite_arguments_are_errors_naming_them(kw, name, backend):
    q, k, v = qkv(1, 2, None, 5, 7, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=name) as e:
        bhqk.attention(q, k, v, backend=backend, **kw)
    assert isinstance(e.value, (ShapeError, MaskError))


def test_bias_with_minus_inf_is_a_mask_not_an_error():
    q, k, v = qkv(1, 2, None, 5, 7, 8)
    bias = torch.zeros(5, 7, dtype=torch.float64)
    bias[:, 3] = -INF
    allowed = torch.ones(5, 7, dtype=torch.bool)
    allowed[:, 3] = False
    torch.testing.assert_close(bhqk.attention(q, k, v, bias=bias), bhqk.attention(q, k, v, allowed))


# ---- empty sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("B, Q, K", [(2, 5, 0), (2, 0, 7), (0, 5, 7), (2, 0, 0)])
@pytest.mark.parametrize("mask", [None, "causal", "padding0"])
def test_empty_sizes_give_fully_masked_semantics(backend, B, Q, K, mask):
    q, k, v = qkv(B, 4, 2, Q, K, 8, 6, dtype=torch.float32)
    m = {None: None, "causal": masks.causal("bottom_right"), "padding0": masks.padding(0)}[mask]
    out = bhqk.attention(q, k, v, m, backend=backend)
    assert out.shape == (B, 4, Q, 6) and out.dtype == q.dtype
    assert (out == 0).all()
    P = bhqk.attention_weights(q, k, m)
    assert P.shape == (B, 4, Q, K)
    if backend in ("reference", "tiled"):
        out2, lse = bhqk.attention(q, k, v, m, backend=backend, return_lse=True)
        assert lse.shape == (B, 4, Q) and (lse == -INF).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_keys_gradients_are_zero(backend):
    q, k, v = qkv(2, 2, None, 5, 0, 8, dtype=torch.float64, requires_grad=True)
    bhqk.attention(q, k, v, backend=backend).sum().backward()
    assert q.grad is not None and (q.grad == 0).all()
