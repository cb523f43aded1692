"""Causal masks, with the alignment explicit when Q ≠ K.

Q=3, K=5, ``top_left`` (query i sees keys 0..i; PyTorch ``is_causal``)::

    ■ · · · ·
    ■ ■ · · ·
    ■ ■ ■ · ·

Q=3, K=5, ``bottom_right`` (the last query sees every key; FlashAttention ≥ 2.1, KV-cache decoding)::

    ■ ■ ■ · ·
    ■ ■ ■ ■ ·
    ■ ■ ■ ■ ■
"""

from __future__ import annotations

from . import args
from .base import Arithmetic, Extent, causal_offset, positions, scalar


class Causal(Arithmetic):
    """Query i may attend to key j when ``j <= i + offset`` (offset from the alignment)."""

    head_dependent, shift_invariant = False, True

    def only_past(self, ext: Extent) -> bool:
        return self.align == "bottom_right" or ext.Q == ext.K

    def causal_diagonal(self, ext: Extent) -> int | None:
        return self.offset(ext)

    def __init__(self, align: str | None = None) -> None:
        self.align = args.alignment("causal", align)

    def offset(self, ext: Extent) -> int:
        return causal_offset(self.align, ext.Q, ext.K, "causal")

    def check(self, ext: Extent) -> None:
        self.offset(ext)

    def block(self, ext, q0, q1, k0, k1, device=None):
        qi, ki = positions(q0, q1, k0, k1, device)
        return ki <= qi + self.offset(ext)  # [q, k]

    def edges(self, ext, q0, q1, k0, k1):
        off = self.offset(ext)
        return k0 > q1 - 1 + off, k1 - 1 <= q0 + off  # every key after the last row's position / at or before the first's

    def __repr__(self) -> str:
        return "causal()" if self.align is None else f"causal(align={self.align!r})"

    def mask_mod(self, B, H, Q, K, device=None):
        off = scalar(self.offset(Extent(B, H, Q, K)), device)
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + off


def top_left_count(Q: int, K: int) -> int:
    """Entries a top-left causal mask allows in a [Q, K] grid (PyTorch ``is_causal``: row i sees keys
    0..i, all K once i ≥ K)."""
    m = min(Q, K)
    return m * (m + 1) // 2 + (Q - m) * K


def causal(align: str | None = None) -> Causal:
    """Each query attends to its own position and earlier keys. ``align`` is required when Q ≠ K:
    ``"top_left"`` (PyTorch ``is_causal``) or ``"bottom_right"`` (FlashAttention ≥ 2.1, KV cache)."""
    return Causal(align)
