"""Masks and biases restricted to, or changed on, some query heads of a call (for ``bhqk.edit``).

``mask_heads`` / ``bias_heads``: a call's mask or bias seen by a sub-call that runs only the heads
``heads`` (H = len(heads)); structured, head-independent values pass through unchanged (the fast
path still skips their empty tiles), dense ones are sliced, anything else is wrapped and evaluated
per tile. ``Edited`` / ``EditedBias``: the call's mask or bias with some heads' entries combined
with (or replaced by) another value, evaluated per tile: what observers (capture) see of an
edited call. Nothing here builds a [B, H, Q, K] tensor.
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


class HeadSubset(Mask):
    """``base`` (a mask of an H-head call) read on the heads ``heads`` only: a mask of an h-head call."""

    def __init__(self, base: Mask, heads: list[int], H: int) -> None:
        self.base, self.heads, self.H = base, list(heads), H

    def check(self, ext):
        self.base.check(_full(ext, self.H))

    def block(self, ext, q0, q1, k0, k1, device=None):
        return value_heads(self.base.block(_full(ext, self.H), q0, q1, k0, k1, device), self.heads, self.H)  # [#B, #h, q, k]

    def classify(self, ext, q0, q1, k0, k1):  # over every head of the call: never wrong for a subset
        return self.base.classify(_full(ext, self.H), q0, q1, k0, k1)

    def classify_grid(self, ext, block_q, block_k):
        return self.base.classify_grid(_full(ext, self.H), block_q, block_k)

    def mask_mod(self, B, H, Q, K, device=None):
        f = self.base.mask_mod(B, self.H, Q, K, device)
        idx = torch.tensor(self.heads, dtype=torch.long, device=device)
        return lambda b, h, q_idx, kv_idx: f(b, idx[h], q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{self.base!r}[heads {self.heads}]"


def mask_heads(m: Mask | None, heads: list[int], H: int) -> Mask | None:
    """The mask of the sub-call on ``heads``: ``m`` itself when it is the same for every head, the
    mask's own selection where it can make one (``Mask.select_heads``), else ``m`` read per tile."""
    if m is None or (len(heads) == H and heads == list(range(H))):
        return m
    return m.select_heads(heads, H) or HeadSubset(m, heads, H)


class _BiasSubset(Bias):
    def __init__(self, base: Bias, heads: list[int], H: int) -> None:
        self.base, self.heads, self.H = base, list(heads), H
        self.floor = base.floor

    def check(self, ext):
        self.base.check(_full(ext, self.H))

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        return value_heads(self.base.block(_full(ext, self.H), q0, q1, k0, k1, device, dtype), self.heads, self.H)

    def __repr__(self) -> str:
        return f"{self.base!r}[heads {self.heads}]"


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


class Edited(Mask):
    """The call's mask with each part's heads ANDed with (or, ``replace``, replaced by) its mask."""

    def __init__(self, base: Mask | None, H: int, parts: list[Part]) -> None:
        self.base, self.H, self.parts = base, H, parts

    def check(self, ext):
        if self.base is not None:
            self.base.check(ext)
        for heads, m, _ in self.parts:
            assert isinstance(m, Mask)
            m.check(_full(ext, len(heads)))

    def block(self, ext, q0, q1, k0, k1, device=None):
        base = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device) if self.base is None else \
            as_4d(self.base.block(ext, q0, q1, k0, k1, device))  # [#B, #H, #q, #k]
        tiles = [as_4d(m.block(_full(ext, len(h)), q0, q1, k0, k1, device)) for h, m, _ in self.parts]  # type: ignore[union-attr]
        return _stitch(base, tiles, self.parts, self.H, q1 - q0, k1 - k0, operator.and_)  # [B?, H, q, k]

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

    def __repr__(self) -> str:
        return f"edited({self.base!r}, " + ", ".join(f"heads {h}: {'=' if r else '&'} {m!r}" for h, m, r in self.parts) + ")"


class EditedBias(Bias):
    """The call's bias with each part's heads plus (or, ``replace``, replaced by) its bias."""

    def __init__(self, base: Bias | None, H: int, parts: list[Part]) -> None:
        self.base, self.H, self.parts = base, H, parts
        self.floor = min([0.0 if base is None else base.floor] + [b.floor for _, b, _ in parts])  # type: ignore[attr-defined]

    def check(self, ext):
        if self.base is not None:
            self.base.check(ext)
        for heads, b, _ in self.parts:
            assert isinstance(b, Bias)
            b.check(_full(ext, len(heads)))

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        base = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device) if self.base is None else \
            as_4d(self.base.block(ext, q0, q1, k0, k1, device, dtype))  # [#B, #H, #q, #k]
        tiles = [as_4d(b.block(_full(ext, len(h)), q0, q1, k0, k1, device, dtype)) for h, b, _ in self.parts]  # type: ignore[union-attr]
        return _stitch(base, tiles, self.parts, self.H, q1 - q0, k1 - k0, operator.add)  # [B?, H, q, k]

    def __repr__(self) -> str:
        return f"edited({self.base!r}, " + ", ".join(f"heads {h}: {'=' if r else '+'} {b!r}" for h, b, r in self.parts) + ")"
