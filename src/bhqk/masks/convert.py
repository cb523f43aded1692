"""Named converters between bhqk's mask polarity (True = may attend) and other libraries'."""

from __future__ import annotations

import torch

from ..errors import MaskError
from .args import _what, count
from .base import Extent, Mask, _as_mask
from .dense import dense, warn_if_inverted
from .padding import key_padding


def from_torch_mha(
    *args: object,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    num_heads: int,
    batch_size: int | None = None,
) -> Mask | None:
    """``nn.MultiheadAttention`` masks (bool, **True = masked out**) as one bhqk mask.

    Keyword arguments only, so a causal ``attn_mask`` can never be read as a key-padding mask:
    ``key_padding_mask`` is [B, K]; ``attn_mask`` is [Q, K] or [B·H, Q, K]. ``batch_size``, when
    given, is checked against both. A float attn_mask is additive: pass it through
    :func:`bhqk.bias.from_torch_mha` instead."""
    if args:
        raise TypeError(
            "from_torch_mha takes keyword arguments only: from_torch_mha(key_padding_mask=[B, K] and/or "
            "attn_mask=[Q, K] or [B·H, Q, K], num_heads=H); a positional tensor could be either."
        )
    num_heads = count("from_torch_mha", "num_heads", num_heads, minimum=1)
    if batch_size is not None:
        batch_size = count("from_torch_mha", "batch_size", batch_size, minimum=1)
    out: Mask | None = None
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
            raise MaskError("from_torch_mha: key_padding_mask must be a bool tensor [B, K] (True = padding), "
                            f"got {_what(key_padding_mask)}.")
        if batch_size is not None and key_padding_mask.shape[0] != batch_size:
            raise MaskError(f"from_torch_mha: key_padding_mask has B={key_padding_mask.shape[0]} but batch_size={batch_size}.")
        out = key_padding(~key_padding_mask)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise MaskError(f"from_torch_mha: attn_mask must be a bool tensor [Q, K] or [B·H, Q, K], got {_what(attn_mask)}.")
        if attn_mask.dtype != torch.bool:
            raise MaskError(
                f"from_torch_mha: attn_mask has dtype {attn_mask.dtype}; a float attn_mask is additive, "
                f"convert it with bhqk.bias.from_torch_mha and pass it as bias=."
            )
        if attn_mask.dim() == 3:
            bh, Q, K = attn_mask.shape
            if bh % num_heads or (batch_size is not None and bh != batch_size * num_heads):
                b = "B" if batch_size is None else f"B={batch_size}"
                raise MaskError(f"from_torch_mha: attn_mask's first axis {bh} is not B·H with {b}, H={num_heads}.")
            allowed = (~attn_mask).reshape(bh // num_heads, num_heads, Q, K)  # [B·H, Q, K] -> [B, H, Q, K]
        elif attn_mask.dim() == 2:
            allowed = ~attn_mask  # [Q, K]
        else:
            raise MaskError(f"from_torch_mha: attn_mask must be [Q, K] or [B·H, Q, K], got shape {list(attn_mask.shape)}.")
        m = dense(allowed)
        out = m if out is None else out & m
    return out


def from_hf(attention_mask: torch.Tensor) -> Mask:
    """Hugging Face ``attention_mask`` [B, K] (1 = real token, 0 = padding; integer, bool or float)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        got = f"shape {list(attention_mask.shape)}" if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise MaskError(f"from_hf: attention_mask must be a tensor [B, K] of 1 (real token) / 0 (padding), got {got}.")
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise MaskError(
            "from_hf: attention_mask must hold only 1 (real token) and 0 (padding); an additive mask "
            "(0 / -inf or finfo.min) is a bias: pass it as bias=."
        )
    return key_padding(attention_mask.bool())


def to_sdpa(mask: Mask | None, B: int, H: int, Q: int, K: int, device=None) -> dict:
    """Keyword arguments for ``F.scaled_dot_product_attention`` with the same meaning:
    ``is_causal=True`` only where PyTorch's top-left causal agrees; otherwise a dense bool mask."""
    if mask is None:
        return {"attn_mask": None, "is_causal": False}
    if mask.causal_diagonal(Extent(B, H, Q, K)) == 0:  # exactly key ≤ query: SDPA's top-left is_causal
        return {"attn_mask": None, "is_causal": True}
    return {"attn_mask": mask.materialize(B, H, Q, K, device=device), "is_causal": False}


def as_mask(mask: Mask | torch.Tensor | None) -> Mask | None:
    """Accept a bhqk mask, a bool tensor (wrapped by ``dense``) or None: the ``mask`` argument of
    every attention call (the same conversion as ``&`` and ``|`` use). The one place that warns
    about a tensor in ``nn.MultiheadAttention`` polarity (outside any ``~``)."""
    if mask is None:
        return None
    if not isinstance(mask, (Mask, torch.Tensor)):
        raise MaskError(f"mask must be a bhqk mask or a bool tensor broadcastable to [B, H, Q, K] (True = may attend), "
                        f"got {type(mask).__name__}.")
    out = _as_mask(mask)
    warn_if_inverted(out)
    return out


__all__ = ["from_torch_mha", "from_hf", "to_sdpa", "as_mask", "Extent"]
