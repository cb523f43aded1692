"""Named converters between bhqk's mask polarity (True = may attend) and other libraries'."""

from __future__ import annotations

import torch

from ..errors import MaskError
from .base import Extent, Mask, _as_mask
from .causal import Causal
from .dense import dense
from .padding import key_padding


def from_torch_mha(
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    *,
    num_heads: int,
    batch_size: int | None = None,
) -> Mask | None:
    """``nn.MultiheadAttention`` masks (bool, **True = masked out**) as one bhqk mask.

    ``key_padding_mask`` is [B, K]; ``attn_mask`` is [Q, K] or [B·H, Q, K]. A float attn_mask is
    additive: pass it through :func:`bhqk.bias.from_torch_mha` instead."""
    out: Mask | None = None
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise MaskError(f"from_torch_mha: key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}.")
        out = key_padding(~key_padding_mask)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise MaskError(
                f"from_torch_mha: attn_mask has dtype {attn_mask.dtype}; a float attn_mask is additive, "
                f"convert it with bhqk.bias.from_torch_mha and pass it as bias=."
            )
        if attn_mask.dim() == 3:
            bh, Q, K = attn_mask.shape
            if bh % num_heads:
                raise MaskError(f"from_torch_mha: attn_mask's first axis {bh} is not B·H with H={num_heads}.")
            allowed = (~attn_mask).reshape(bh // num_heads, num_heads, Q, K)  # [B·H, Q, K] -> [B, H, Q, K]
        elif attn_mask.dim() == 2:
            allowed = ~attn_mask  # [Q, K]
        else:
            raise MaskError(f"from_torch_mha: attn_mask must be [Q, K] or [B·H, Q, K], got shape {list(attn_mask.shape)}.")
        m = dense(allowed)
        out = m if out is None else out & m
    return out


def from_hf(attention_mask: torch.Tensor) -> Mask:
    """Hugging Face ``attention_mask`` [B, K] (1 = real token, 0 = padding)."""
    if attention_mask.dim() != 2:
        raise MaskError(f"from_hf: attention_mask must be [B, K], got shape {list(attention_mask.shape)}.")
    return key_padding(attention_mask.bool())


def to_sdpa(mask: Mask | None, B: int, H: int, Q: int, K: int, device=None) -> dict:
    """Keyword arguments for ``F.scaled_dot_product_attention`` with the same meaning:
    ``is_causal=True`` only where PyTorch's top-left causal agrees; otherwise a dense bool mask."""
    if mask is None:
        return {"attn_mask": None, "is_causal": False}
    if isinstance(mask, Causal) and (mask.align == "top_left" or Q == K):
        return {"attn_mask": None, "is_causal": True}
    return {"attn_mask": mask.materialize(B, H, Q, K, device=device), "is_causal": False}


def as_mask(mask: Mask | torch.Tensor | None) -> Mask | None:
    """Accept a bhqk mask, a bool tensor (wrapped by ``dense``) or None: the ``mask`` argument of
    every attention call (the same conversion as ``&`` and ``|`` use)."""
    if mask is None:
        return None
    if not isinstance(mask, (Mask, torch.Tensor)):
        raise MaskError(f"mask must be a bhqk mask or a bool tensor broadcastable to [B, H, Q, K] (True = may attend), "
                        f"got {type(mask).__name__}.")
    return _as_mask(mask)


__all__ = ["from_torch_mha", "from_hf", "to_sdpa", "as_mask", "Extent"]
