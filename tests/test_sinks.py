"""Sinks (GPT-OSS's ``s_aux``): a per-head logit in each row's softmax denominator that carries no
value. Checked against an fp64 formula written here, against transformers' GPT-OSS eager attention,
by gradcheck (q, k, v, sinks) on the reference and tiled backends, and through lse, weights,
capture, merge, the torch backend's refusal and the module's parameter."""

from __future__ import annotations

import types

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.errors import BackendError, ShapeError
from bhqk.functional import prepare
from bhqk.functional.merge import merge, with_sinks
from conftest import mask_kinds, qkv
from tolerance import assert_close, assert_paths_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


def formula(q, k, v, allowed, sinks, scale):
    """out [B, H, Q, dv] and lse [B, H, Q] in fp64, written from the definition:
    w_qk = exp(S_qk) / (Σ_k' exp(S_qk') + exp(sink_h)) over allowed keys; out = Σ_k w_qk v_k."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(G, dim=1) for t in (k, v))  # [B, H, K, ·]
    S = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    E = torch.where(allowed, torch.exp(S), 0.0)  # [B, H, Q, K]
    den = E.sum(-1) + torch.exp(sinks.double())[None, :, None]  # [B, H, Q]
    return torch.einsum("bhqk,bhkv->bhqv", E / den[..., None], v), torch.log(den)


def _allowed(mask, B, H, Q, K):
    return torch.ones(B, H, Q, K, dtype=torch.bool) if mask is None else mask.materialize(B, H, Q, K).expand(B, H, Q, K)


@pytest.mark.parametrize("kind", [None, "causal_br", "document", "~causal"])
def test_weights_sum_to_one_minus_the_sinks_share(kind):
    """(out and lse with sinks on every backend and mask kind: tests/test_semantics.py)"""
    B, H, Hkv, Q, K = 2, 4, 2, 13, 21
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=5)
    sinks = torch.linspace(-2.0, 3.0, H, dtype=torch.float64)
    mask = None if kind is None else mask_kinds(B, H, Q, K)[kind]
    _, want_lse = formula(q, k, v, _allowed(mask, B, H, Q, K), sinks, 8 ** -0.5)
    P = bhqk.attention_weights(q, k, mask, sinks=sinks)
    share = torch.exp(sinks[None, :, None] - want_lse)  # [B, H, Q]
    assert_close(P.sum(-1), 1.0 - share, n=K)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("mask", [None, masks.causal("bottom_right")])
def test_gradcheck_q_k_v_sinks(backend, mask):
    q, k, v = qkv(1, 4, 2, 5, 7, d=3, dv=2, requires_grad=True)
    sinks = torch.tensor([0.3, -0.7, 1.1, 0.0], dtype=torch.float64, requires_grad=True)
    extra = {"block_q": 2, "block_k": 4} if backend == "tiled" else {}

    def f(q, k, v, sinks):
        out, lse = bhqk.attention(q, k, v, mask, sinks=sinks, backend=backend, return_lse=True, **extra)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_tiled_gradients_equal_the_formulas_autograd():
    B, H, Hkv, Q, K = 2, 4, 1, 19, 33
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=6, requires_grad=True)
    sinks = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    mask = masks.sliding_window(4, align="bottom_right") & masks.causal("bottom_right")
    dout = torch.randn(B, H, Q, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out, lse = bhqk.attention(q, k, v, mask, sinks=sinks, backend="tiled", return_lse=True, block_q=4, block_k=8)
    got = torch.autograd.grad((out * dout).sum() + 0.3 * lse.sum(), (q, k, v, sinks))
    w_out, w_lse = formula(q, k, v, _allowed(mask, B, H, Q, K), sinks, 8 ** -0.5)
    want = torch.autograd.grad((w_out * dout).sum() + 0.3 * w_lse.sum(), (q, k, v, sinks))
    for g, w in zip(got, want):
        assert_paths_close(g, w, n=max(K, B * H * Q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_sinks_in_low_precision_are_close_to_fp64(dtype):
    q, k, v = qkv(1, 4, None, 40, 70, d=16, dtype=dtype)
    sinks = torch.tensor([0.0, 2.0, -3.0, 5.0], dtype=dtype)
    out = bhqk.attention(q, k, v, masks.causal("bottom_right"), sinks=sinks, backend="tiled", block_q=16, block_k=16)
    want, _ = formula(q, k, v, _allowed(masks.causal("bottom_right"), 1, 4, 40, 70), sinks, 0.25)
    assert out.dtype == dtype
    assert_close(out, want, n=70)


def test_transformers_gpt_oss_eager_attention_agrees():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, H, Hkv, N, d = 2, 4, 2, 11, 8
    q, k, v = qkv(B, H, Hkv, N, N, d=d)
    sinks = torch.tensor([0.2, -1.5, 2.5, 0.0], dtype=torch.float64)
    module = types.SimpleNamespace(num_key_value_groups=H // Hkv, sinks=sinks, training=False)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    additive = torch.zeros(B, 1, N, N, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    want, want_w = eager_attention_forward(module, q, k, v, additive, scaling=d ** -0.5)  # [B, N, H, d], [B, H, N, N]
    for backend in ("reference", "tiled"):
        got = bhqk.attention(q, k, v, masks.causal(), sinks=sinks, backend=backend, layout="bhnd").transpose(1, 2)
        assert_paths_close(got, want, n=N)
    assert_paths_close(bhqk.attention_weights(q, k, masks.causal(), sinks=sinks), want_w, n=N)


def test_capture_shows_the_weights_with_the_sink():
    q, k, v = qkv(1, 4, None, 9, 9)
    sinks = torch.tensor([1.0, 0.0, -1.0, 3.0], dtype=torch.float64)
    want = bhqk.attention_weights(q, k, masks.causal(), sinks=sinks)
    for backend in ("reference", "tiled"):
        with bhqk.capture(what=("weights", "lse")) as cap:
            bhqk.attention(q, k, v, masks.causal(), sinks=sinks, backend=backend)
        assert_paths_close(cap[0].weights, want, n=9)


def test_merge_of_sink_free_partials_then_the_sink_once_is_exact():
    q, k, v = qkv(2, 4, None, 7, 20)
    sinks = torch.tensor([0.5, -0.5, 1.5, 4.0], dtype=torch.float64)
    whole, whole_lse = bhqk.attention(q, k, v, sinks=sinks, backend="reference", return_lse=True)
    a = bhqk.attention(q, k[:, :, :8], v[:, :, :8], backend="tiled", return_lse=True)
    b = bhqk.attention(q, k[:, :, 8:], v[:, :, 8:], backend="tiled", return_lse=True)
    out, lse = with_sinks(*merge(*a, *b), sinks)
    assert_paths_close(out, whole, n=20)
    assert_paths_close(lse, whole_lse, n=20)
    empty_out, empty_lse = with_sinks(torch.zeros(1, 4, 2, 3, dtype=torch.float64),
                                      torch.full((1, 4, 2), float("-inf"), dtype=torch.float64), sinks)
    assert bool((empty_out == 0).all()) and torch.equal(empty_lse, sinks[None, :, None].expand(1, 4, 2))
    with pytest.raises(ShapeError, match="sinks must be \\[H=4\\]"):
        with_sinks(out, lse, sinks[:3])


def test_torch_backend_refuses_sinks_and_auto_never_sends_them_there():
    q, k, v = qkv(1, 4, None, 100, 100, dtype=torch.float32)
    sinks = torch.zeros(4)
    with pytest.raises(BackendError, match="no sinks"):
        bhqk.attention(q, k, v, sinks=sinks, backend="torch")
    p = prepare(q, k, v, sinks=sinks)
    from bhqk.functional import registry

    assert registry.decide(p, False).name != "torch"
    tiny = prepare(*qkv(1, 4, None, 3, 3, dtype=torch.float32), sinks=sinks)
    assert registry.decide(tiny, False).name != "torch"
    out = bhqk.attention(q, k, v, sinks=sinks)  # auto
    assert_paths_close(out, bhqk.attention(q, k, v, sinks=sinks, backend="reference"), n=100)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3), r"sinks has number of query heads H=3 but q has H=4"),
    (torch.zeros(1, 4), r"sinks must be 1-D \[H\] .* got 2-D shape \[1, 4\]"),
    (torch.zeros(4, dtype=torch.long), "floating-point"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0]), "finite"),
    (torch.tensor([0.0, float("inf"), 0.0, 0.0]), "finite"),
    ([0.0, 0.0, 0.0, 0.0], "must be a tensor"),
])
def test_bad_sinks_are_shape_errors_naming_sinks_and_H(bad, match):
    q, k, v = qkv(1, 4, None, 3, 5, dtype=torch.float32)
    with pytest.raises(ShapeError, match=match):
        bhqk.attention(q, k, v, sinks=bad)


def test_module_sinks_parameter_learns_and_reaches_every_path():
    torch.manual_seed(0)
    m = bhqk.MultiHeadAttention(16, 4, sinks=True).double()
    assert isinstance(m.sinks, torch.nn.Parameter) and m.sinks.shape == (4,) and bool((m.sinks == 0).all())
    assert bhqk.MultiHeadAttention(16, 4).sinks is None
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([1.0, -1.0, 0.5, 2.0]))
    outs = [m(x, mask=masks.causal(), backend=b) for b in ("reference", "tiled")]
    assert_paths_close(outs[0], outs[1], n=16)
    _, w = m(x, mask=masks.causal(), return_weights=True)
    assert bool((w.sum(-1) < 1).all())
    outs[1].sum().backward()
    assert m.sinks.grad is not None and bool((m.sinks.grad != 0).all())
