"""A mask given as a bool tensor broadcastable to [B, H, Q, K] (True = may attend)."""

from __future__ import annotations

import torch

from ..errors import MaskError, warn_misuse
from ..shapes import Sizes, check_broadcast, tile_of
from .base import NEGATED, Extent, Mask, grid_of_dense


class Dense(Mask):
    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise MaskError(f"mask must be a bool tensor or a bhqk.masks mask, got {type(tensor).__name__}.")
        if tensor.dtype != torch.bool:
            hint = (
                " A float tensor is an additive bias: pass it as bias= (bhqk.bias.dense), not as mask."
                if tensor.is_floating_point()
                else " Convert 0/1 masks with .bool() (True = may attend), or use bhqk.masks.from_hf."
            )
            raise MaskError(f"mask must have dtype torch.bool (True = may attend), got {tensor.dtype}.{hint}")
        if tensor.dim() > 4:
            raise MaskError(f"mask has {tensor.dim()} axes {list(tensor.shape)}; it must broadcast to [B, H, Q, K].")
        self.tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))  # [#B, #H, #Q, #K]
        self._polarity_checked = False

    def check(self, ext: Extent) -> None:
        check_broadcast("mask", self.tensor.shape, Sizes(B=ext.B, H=ext.H, Q=ext.Q, K=ext.K), MaskError)
        if ext.Q == ext.K and not self._polarity_checked and not NEGATED.get():
            self._polarity_checked = True
            warn_if_inverted(self.tensor)


    def block(self, ext, q0, q1, k0, k1, device=None):
        t = tile_of(self.tensor, q0, q1, k0, k1)  # [#B, #H, #q, #k]
        return t if device is None else t.to(device)

    def natural_size(self):
        return (self.tensor.shape[2], self.tensor.shape[3])

    def __repr__(self) -> str:
        return f"dense(<bool {list(self.tensor.shape)}>)"

    def classify_grid(self, ext, block_q, block_k):
        return grid_of_dense(self.tensor, ext, block_q, block_k)


def warn_if_inverted(t: torch.Tensor) -> None:
    """A self-attention mask [#B, #H, N, N] that forbids every query its own key and allows some later
    key is, almost surely, ``nn.MultiheadAttention``'s polarity (True = masked out): warn."""
    n = t.shape[-1]
    if n < 2 or t.shape[-2] != n or bool(t.diagonal(dim1=-2, dim2=-1).any()):
        return
    if bool(torch.triu(t, diagonal=1).any()):  # [#B, #H, N, N]: some query may attend a later key
        warn_misuse(
            "mask forbids every query its own position and allows later keys: this looks like a mask in "
            "nn.MultiheadAttention polarity (True = masked out). bhqk masks use True = may attend: convert "
            "with bhqk.masks.from_torch_mha(attn_mask=..., num_heads=H), invert with ~mask, or use "
            "bhqk.masks.causal()."
        )


def dense(tensor: torch.Tensor) -> Dense:
    """A bool tensor that broadcasts to [B, H, Q, K]; True = may attend."""
    return Dense(tensor)
