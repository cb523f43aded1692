"""A mask from a function of indices, like FlexAttention's ``mask_mod``.

``predicate(lambda b, h, q, k: (q - k) % 2 == 0)`` at Q = K = 4::

    ■ · ■ ·
    · ■ · ■
    ■ · ■ ·
    · ■ · ■
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from ..errors import MaskError
from ..shapes import as_4d
from .base import Extent, Mask
from .dense import Dense


class Predicate(Mask):
    whole_grid = False  # its classify_grid calls fn on every entry: the fast paths classify it tile by tile

    @property
    def head_dependent(self) -> bool:  # type: ignore[override]
        """Whether fn's result has a head axis, asked of fn once on one entry of two heads."""
        if "_by_head" not in self.__dict__:
            try:
                self._by_head = as_4d(torch.as_tensor(self.block(Extent(1, 2, 1, 1), 0, 1, 0, 1))).shape[1] != 1
            except Exception:  # fn cannot take that one entry (it indexes by size): it may well differ by head
                self._by_head = True
        return self._by_head

    def select_heads(self, heads: list[int], H: int) -> Mask | None:
        if not self.head_dependent:
            return self
        fn, idx = self.fn, torch.tensor(heads, dtype=torch.long)

        def on_heads(b, h, q_idx, kv_idx):  # head i of the narrower call is head heads[i] of this one
            return fn(b, idx.to(h.device)[h], q_idx, kv_idx)

        return Predicate(on_heads, f"{self.name}[heads {heads}]")

    def __init__(self, fn: Callable[..., torch.Tensor], name: str | None = None, key: Hashable | torch.Tensor = None) -> None:
        if not callable(fn):
            raise MaskError(f"predicate: fn must be a function fn(b, h, q_idx, k_idx) -> bool tensor, got {type(fn).__name__}.")
        if name is not None and not isinstance(name, str):
            raise MaskError(f"predicate: name must be a string, got {type(name).__name__}.")
        try:
            hash(_key_of(key))
        except TypeError:
            raise MaskError(f"predicate: key must be a tensor fn reads, a tuple of tensors and hashable values, or a "
                            f"hashable value, got {type(key).__name__}.") from None
        self.fn, self.name, self.key = fn, name or getattr(fn, "__name__", "fn"), key

    def cache_key(self) -> Hashable | None:
        """What a plan kept for this mask is keyed by beyond the mask object (``masks.tensor_versions``):
        None (never kept) without ``key=``, else the key with each tensor as (address, version)."""
        return None if self.key is None else _key_of(self.key)

    def block(self, ext, q0, q1, k0, k1, device=None):
        b = torch.arange(ext.B, device=device)[:, None, None, None]  # [B, 1, 1, 1]
        h = torch.arange(ext.H, device=device)[None, :, None, None]  # [1, H, 1, 1]
        qi = torch.arange(q0, q1, device=device)[None, None, :, None]  # [1, 1, q, 1]
        ki = torch.arange(k0, k1, device=device)[None, None, None, :]  # [1, 1, 1, k]
        out = self.fn(b, h, qi, ki)
        want = (ext.B, ext.H, q1 - q0, k1 - k0)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = f"dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise MaskError(f"predicate {self.name}: fn must return a bool tensor (True = may attend) that broadcasts "
                            f"to the tile [B, H, q, k] = {list(want)}, got {got}.")
        if out.dim() > 4 or any(s not in (1, w) for s, w in zip(reversed(out.shape), reversed(want))):
            raise MaskError(f"predicate {self.name}: fn returned shape {list(out.shape)}, which does not broadcast to "
                            f"the tile [B, H, q, k] = {list(want)}; combine the index arguments it gets "
                            f"(b [B,1,1,1], h [1,H,1,1], q_idx [1,1,q,1], k_idx [1,1,1,k]) elementwise.")
        return out

    def __repr__(self) -> str:
        return f"predicate({self.name})"

    def mask_mod(self, B, H, Q, K, device=None):
        return self.fn  # already FlexAttention's form; keep it pure and vectorisable

    def classify_grid(self, ext: Extent, block_q, block_k):
        return Dense(self.block(ext, 0, ext.Q, 0, ext.K)).classify_grid(ext, block_q, block_k)  # O(Q·K), as create_block_mask


def _key_of(key) -> Hashable | None:
    """``key`` with each tensor as ("tensor", address, in-place version); None for an inference tensor
    (no version counter: never kept)."""
    if isinstance(key, torch.Tensor):
        return None if key.is_inference() else ("tensor", key.data_ptr(), key._version)
    if isinstance(key, tuple):
        parts = []
        for x in key:
            got = _key_of(x)
            if got is None and x is not None:  # an inference tensor in it
                return None
            parts.append(got)
        return tuple(parts)
    return key


def predicate(fn: Callable[..., torch.Tensor], name: str | None = None, *, key: Hashable | torch.Tensor = None) -> Predicate:
    """``fn(b, h, q_idx, k_idx)`` gets broadcastable index tensors and returns bool (True = may attend).

    ``key``: what ``fn``'s answer depends on besides its index arguments; plans and call masks the
    backends build from the mask are kept across calls only with one. None (the default): ``fn`` may
    read anything (a tensor the caller writes in place between calls), so every call plans anew (a
    classification of O(Q·K)). A tensor, or a tuple of tensors and hashable values: the tensors ``fn``
    reads; what was kept is used until one of them is written in place (a new ``_version``)::

        ids = torch.tensor([0, 0, 1, 1])  # document of each position
        m = masks.predicate(lambda b, h, q, k: ids[q] == ids[k], key=ids)  # ids[:] = ... plans anew

    Any other hashable value (``key="pure"``) promises that ``fn`` reads nothing that changes: kept
    for the life of the mask object."""
    return Predicate(fn, name, key)
