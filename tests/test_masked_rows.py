"""Fully masked rows give 0 and finite gradients; NaN in unattended K/V never leaks. Every backend."""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from conftest import concrete_backends, qkv


def _fully_masked_row_mask(B, Q, K):
    allowed = torch.rand(B, 1, Q, K, generator=torch.Generator().manual_seed(0)) > 0.3
    allowed[:, :, 1] = False  # query 1 may attend to nothing
    allowed[:, :, 0, 0] = True
    return allowed


@pytest.mark.parametrize("backend", concrete_backends())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fully_masked_rows_zero_output_and_finite_grads(backend, dtype):
    B, H, Q, K = 2, 4, 70, 80  # big enough that auto-like policies would not pick the reference
    q, k, v = qkv(B, H, 2, Q, K, 8, 6, dtype=dtype, requires_grad=True)
    allowed = _fully_masked_row_mask(B, Q, K)
    out = bhqk.attention(q, k, v, allowed, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[:, :, 1] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 1] == 0).all()
    P = bhqk.attention_weights(q, k, allowed)
    assert (P[:, :, 1] == 0).all()


@pytest.mark.parametrize("backend", concrete_backends())
def test_fully_masked_by_structured_mask(backend):
    # padding length 0 for batch element 1: every query of that element is fully masked
    q, k, v = qkv(2, 2, None, 65, 66, 8, requires_grad=True)
    out = bhqk.attention(q, k, v, masks.padding(torch.tensor([66, 0])), backend=backend)
    assert (out[1] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("backend", concrete_backends())
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_in_unattended_keys_and_values_never_leaks(backend, poison):
    B, H, Q, K = 2, 4, 66, 70
    q, k, v = qkv(B, H, 2, Q, K, 8)
    lengths = torch.tensor([50, 70])
    clean = bhqk.attention(q, k, v, masks.padding(lengths), backend="reference")
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 50:] = poison  # the padding of batch element 0
    v2[0, :, 50:] = poison
    for m in (masks.padding(lengths), masks.key_padding(torch.arange(K)[None] < lengths[:, None])):
        out = bhqk.attention(q, k2, v2, m, backend=backend)
        assert torch.isfinite(out).all(), backend
        torch.testing.assert_close(out, clean)


def test_auto_never_nan_with_padding():
    q, k, v = qkv(2, 4, None, 128, 128, 16, dtype=torch.float32)
    v[0, :, 100:] = float("nan")
    out = bhqk.attention(q, k, v, masks.padding(torch.tensor([100, 128])))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", concrete_backends())
def test_nan_in_unattended_keys_never_reaches_gradients(backend):
    B, H, Q, K = 2, 4, 66, 70
    lengths = torch.tensor([50, 70])
    q, k, v = qkv(B, H, 2, Q, K, 8, requires_grad=True)
    dout = torch.randn(B, H, Q, 8, dtype=q.dtype)
    (bhqk.attention(q, k, v, masks.padding(lengths), backend=backend) * dout).sum().backward()
    clean = [t.grad.clone() for t in (q, k, v)]
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[0, :, 50:] = float("nan")
    v2[0, :, 50:] = float("nan")
    q2 = q.detach().clone().requires_grad_(True)
    k2.requires_grad_(True)
    v2.requires_grad_(True)
    (bhqk.attention(q2, k2, v2, masks.padding(lengths), backend=backend) * dout).sum().backward()
    torch.testing.assert_close(q2.grad, clean[0])
    for got, want in ((k2.grad, clean[1]), (v2.grad, clean[2])):
        torch.testing.assert_close(got[1], want[1])
        torch.testing.assert_close(got[0, :, :50], want[0, :, :50])  # real keys of the poisoned element
        assert (got[0, :, 50:] == 0).all()  # keys no query may attend get no gradient
