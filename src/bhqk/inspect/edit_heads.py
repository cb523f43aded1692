"""Masks and biases restricted to, or changed on, some query heads of a call (for ``bhqk.edit``):
``mask_heads`` / ``bias_heads`` for a sub-call that runs only some heads (structured values stay
structured where they can), ``Edited`` / ``EditedBias`` for what observers (capture) see of an edited
call. Nothing here builds a [B, H, Q, K] tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from ..bias import Bias
from ..bias import Dense as DenseBias
from ..bias import Sum as BiasSum
from ..masks import Extent, Mask, Tile
from ..shapes import as_4d
from .layers import value_heads


def _full(ext: Extent, H: int) -> Extent:
    return Extent(ext.B, H, ext.Q, ext.K)


class _Subset:
    """``base`` (a mask or bias of an H-head call) read on the heads ``heads`` only: a value of an h-head call."""

    def __init__(self, base, heads: list[int], H: int) -> None:
        self.base, self.heads, self.H = base, list(heads), H

    def check(self, ext):
        self.base.check(_full(ext, self.H))

    def block(self, ext, q0, q1, k0, k1, *args, **kw):  # device (and a bias's dtype)
        return value_heads(self.base.block(_full(ext, self.H), q0, q1, k0, k1, *args, **kw), self.heads, self.H)  # [#B, #h, q, k]

    def __repr__(self) -> str:
        return f"{self.base!r}[heads {self.heads}]"


class HeadSubset(_Subset, Mask):
    """A mask of an H-head call read on some heads: a mask of an h-head call."""

    def classify(self, ext, q0, q1, k0, k1):  # over every head of the call: never wrong for a subset
        return self.base.classify(_full(ext, self.H), q0, q1, k0, k1)

    def classify_grid(self, ext, block_q, block_k):
        return self.base.classify_grid(_full(ext, self.H), block_q, block_k)

    def mask_mod(self, B, H, Q, K, device=None):
        f = self.base.mask_mod(B, self.H, Q, K, device)
        idx = torch.tensor(self.heads, dtype=torch.long, device=device)
        return lambda b, h, q_idx, kv_idx: f(b, idx[h], q_idx, kv_idx)


def mask_heads(m: Mask | None, heads: list[int], H: int) -> Mask | None:
    """The mask of the sub-call on ``heads``: ``m`` itself when it is the same for every head, the
    mask's own selection where it can make one (``Mask.select_heads``), else ``m`` read per tile."""
    if m is None or (len(heads) == H and heads == list(range(H))):
        return m
    return m.select_heads(heads, H) or HeadSubset(m, heads, H)


class _BiasSubset(_Subset, Bias):
    def __init__(self, base: Bias, heads: list[int], H: int) -> None:
        super().__init__(base, heads, H)
        self.floor = base.floor


def bias_heads(b: Bias | None, heads: list[int], H: int) -> Bias | None:
    """The bias of the sub-call on ``heads``; dense parts stay dense (the tiled backend's bias
    gradients see them)."""
    if b is None or (len(heads) == H and heads == list(range(H))):
        return b
    if isinstance(b, DenseBias):
        return DenseBias(value_heads(b.tensor, heads, H))  # [#B, #h, #Q, #K]
    if isinstance(b, BiasSum):
        a, c = bias_heads(b.a, heads, H), bias_heads(b.b, heads, H)
        assert a is not None and c is not None
        return BiasSum(a, c)
    return _BiasSubset(b, heads, H)


# ---- the edited call as observers see it ---------------------------------------------------------------

Part = tuple[list[int], object, bool]  # (heads, value of an h-head call, replace: True = instead of the base)


def _stitch(base: torch.Tensor, tiles: list[torch.Tensor], parts: list[Part], H: int, q: int, k: int,
            combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The call's tile ``base`` [#B, #H, #q, #k] with each part's heads combined (``combine``) with, or
    replaced by, the part's tile [#B, #h, #q, #k]: [B?, H, q, k]."""
    B = max([base.shape[0]] + [t.shape[0] for t in tiles])
    out = base.expand(B, H, q, k).clone()  # [B?, H, q, k]
    for (heads, _, replace), t in zip(parts, tiles):
        idx = torch.tensor(heads, device=out.device)
        new = t.expand(B, len(heads), q, k)  # [B?, h, q, k]
        out[:, idx] = new if replace else combine(out[:, idx], new)
    return out


class _Edited:
    """The call's mask or bias ``base`` (None: none) with each part's heads combined with (``combine``; or,
    ``replace``, replaced by) the part's value, read per tile."""

    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sign = ""

    def __init__(self, base, H: int, parts: list[Part]) -> None:
        self.base, self.H, self.parts = base, H, parts

    def check(self, ext):
        if self.base is not None:
            self.base.check(ext)
        for heads, v, _ in self.parts:
            v.check(_full(ext, len(heads)))  # type: ignore[attr-defined]

    def _block(self, none: torch.Tensor, ext, q0, q1, k0, k1, *args) -> torch.Tensor:
        """The tile [B?, H, q, k]; ``none``: the base's tile when there is no base; ``args``: device (and dtype)."""
        base = none if self.base is None else as_4d(self.base.block(ext, q0, q1, k0, k1, *args))  # [#B, #H, #q, #k]
        tiles = [as_4d(v.block(_full(ext, len(h)), q0, q1, k0, k1, *args)) for h, v, _ in self.parts]  # type: ignore[attr-defined]
        return _stitch(base, tiles, self.parts, self.H, q1 - q0, k1 - k0, self.combine)

    def __repr__(self) -> str:
        parts = ", ".join(f"heads {h}: {'=' if r else self.sign} {v!r}" for h, v, r in self.parts)
        return f"edited({self.base!r}, {parts})"


class Edited(_Edited, Mask):
    """The call's mask with each part's heads ANDed with (or, ``replace``, replaced by) its mask."""

    combine, sign = staticmethod(operator.and_), "&"

    def block(self, ext, q0, q1, k0, k1, device=None):
        return self._block(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device), ext, q0, q1, k0, k1, device)

    def classify(self, ext, q0, q1, k0, k1):
        if self.base is not None and not any(r for _, _, r in self.parts) and \
                self.base.classify(ext, q0, q1, k0, k1) is Tile.EMPTY:
            return Tile.EMPTY
        return Tile.PARTIAL

    def classify_grid(self, ext, block_q, block_k):
        nq, nk = -(-ext.Q // block_q), -(-ext.K // block_k)
        none = torch.zeros(nq, nk, dtype=torch.bool)
        if self.base is None or any(r for _, _, r in self.parts):
            return none, none
        return self.base.classify_grid(ext, block_q, block_k)[0], none


class EditedBias(_Edited, Bias):
    """The call's bias with each part's heads plus (or, ``replace``, replaced by) its bias."""

    combine, sign = staticmethod(operator.add), "+"

    def __init__(self, base: Bias | None, H: int, parts: list[Part]) -> None:
        super().__init__(base, H, parts)
        self.floor = min([0.0 if base is None else base.floor] + [b.floor for _, b, _ in parts])  # type: ignore[attr-defined]

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        return self._block(torch.zeros(1, 1, 1, 1, dtype=dtype, device=device), ext, q0, q1, k0, k1, device, dtype)
