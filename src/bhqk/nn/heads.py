"""Split and merge heads: the only reshapes in the library, written as einops patterns."""

from __future__ import annotations

import torch
from einops import rearrange

from ..errors import ShapeError


def split_heads(x: torch.Tensor, num_heads: int, arg: str = "x") -> torch.Tensor:
    """[B, N, H·d] -> [B, H, N, d]."""
    if x.dim() != 3:
        raise ShapeError(f"{arg} must be 3-D [B, N, H·d] before splitting heads, got shape {list(x.shape)}.")
    if x.shape[-1] % num_heads:
        raise ShapeError(
            f"{arg} has width {x.shape[-1]}, not divisible by H={num_heads}; splitting into heads needs H·d = width."
        )
    return rearrange(x, "b n (h d) -> b h n d", h=num_heads)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, N, d] -> [B, N, H·d] (concatenate the heads)."""
    return rearrange(x, "b h n d -> b n (h d)")
