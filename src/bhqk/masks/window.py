"""Sliding-window (local) attention: query i sees keys from ``i - left`` to ``i + right``.

``sliding_window(2)`` at Q = K = 5::

    ■ · · · ·
    ■ ■ · · ·
    ■ ■ ■ · ·
    · ■ ■ ■ ·
    · · ■ ■ ■
"""

from __future__ import annotations

from . import args
from .base import Arithmetic, Extent, causal_offset, positions, scalar


class SlidingWindow(Arithmetic):
    head_dependent, shift_invariant = False, True

    def only_past(self, ext: Extent) -> bool:
        return (self.align == "bottom_right" or ext.Q == ext.K) and self.right == 0

    def __init__(self, left: int, right: int = 0, align: str | None = None) -> None:
        self.left = args.count("sliding_window", "left", left)
        self.right = args.count("sliding_window", "right", right)
        self.align = args.alignment("sliding_window", align)

    def offset(self, ext: Extent) -> int:
        return causal_offset(self.align, ext.Q, ext.K, "sliding_window")

    def check(self, ext: Extent) -> None:
        self.offset(ext)

    def block(self, ext, q0, q1, k0, k1, device=None):
        qi, ki = positions(q0, q1, k0, k1, device)
        pos = qi + self.offset(ext)  # [q, 1] query position in key coordinates
        return (ki >= pos - self.left) & (ki <= pos + self.right)  # [q, k]

    def edges(self, ext, q0, q1, k0, k1):
        off = self.offset(ext)
        first, last = q0 + off, q1 - 1 + off  # query positions at the tile's edges
        empty = (k1 - 1 < first - self.left) | (k0 > last + self.right)
        return empty, (k0 >= last - self.left) & (k1 - 1 <= first + self.right)

    def __repr__(self) -> str:
        a = "" if self.align is None else f", align={self.align!r}"
        return f"sliding_window({self.left}, right={self.right}{a})"

    def mask_mod(self, B, H, Q, K, device=None):
        off, left, right = (scalar(x, device) for x in (self.offset(Extent(B, H, Q, K)), self.left, self.right))

        def window(b, h, q_idx, kv_idx):
            pos = q_idx + off  # the query's position in key coordinates
            return (kv_idx >= pos - left) & (kv_idx <= pos + right)

        return window


def sliding_window(left: int, right: int = 0, align: str | None = None) -> SlidingWindow:
    """Query i may attend to keys ``i - left … i + right`` (``right=0``: causal local attention)."""
    return SlidingWindow(left, right, align)
