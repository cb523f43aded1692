"""Knock-out masks: a span of keys (or a block of queries × keys) that may NOT be attended.

The polarity stays bhqk's: ``True`` = may attend. ``key_span(a, b)`` is False on the keys
``a … b-1`` and True everywhere else, so ``mask & key_span(a, b)`` removes those keys and the softmax
renormalizes over the rest ("knock out"; ``bhqk.edit(..., mask=key_span(0, 1))`` removes the sink
key 0). ``block_span(q0, q1, k0, k1)`` removes them only for the queries at positions ``q0 … q1-1``.
Query positions are key coordinates: the query at row i sits at position ``i + K − Q`` (the
decoding convention; ``i`` itself in self-attention), so a block stays put during decoding.

``key_span(1, 3)`` at Q = K = 4, and ``block_span(2, 4, 0, 2)``::

    ■ · · ■        ■ ■ ■ ■
    ■ · · ■        ■ ■ ■ ■
    ■ · · ■        · · ■ ■
    ■ · · ■        · · ■ ■

Knocking out is not zeroing weights: a knocked-out key's weight goes to the other keys of its row
(they still sum to 1); ``bhqk.edit(..., weights=P)`` with zeros in P takes P as given (rows then
sum to less than 1).
"""

from __future__ import annotations

from . import args
from .base import Arithmetic, Extent, positions, scalar


class Span(Arithmetic):
    """May attend everywhere except keys ``[k0, k1)`` for queries at positions ``[q0, q1)``
    (``q0=0, q1=None``: every query)."""

    head_dependent = False
    arithmetic = False  # the tiled planner classifies it by its whole grid (grid_leaves), not top-down

    def __init__(self, k0: int, k1: int, q0: int = 0, q1: int | None = None, who: str = "block_span") -> None:
        self.k0 = args.count(who, "key start", k0)
        self.k1 = args.count(who, "key stop", k1, minimum=self.k0)
        self.q0 = args.count(who, "query start", q0)
        self.q1 = None if q1 is None else args.count(who, "query stop", q1, minimum=self.q0)
        self.who = who

    def _q(self, ext: Extent) -> tuple[int, int]:
        """The blocked rows [r0, r1) of the call (query positions shifted by K − Q), clipped to [0, Q)."""
        off = ext.K - ext.Q
        q1 = ext.Q + off if self.q1 is None else self.q1
        return min(max(self.q0 - off, 0), ext.Q), min(max(q1 - off, 0), ext.Q)

    def block(self, ext, q0, q1, k0, k1, device=None):
        r0, r1 = self._q(ext)
        qi, ki = positions(q0, q1, k0, k1, device)
        out = ~((qi >= r0) & (qi < r1) & (ki >= self.k0) & (ki < self.k1))  # [q, k]
        return out

    def edges(self, ext, q0, q1, k0, k1):
        r0, r1 = self._q(ext)
        inside = (q0 >= r0) & (q1 <= r1) & (k0 >= self.k0) & (k1 <= self.k1)  # every entry blocked
        # full: the tile misses the blocked rows or the blocked keys (or they are none)
        misses_rows = (r1 <= r0) | (r1 <= q0) | (q1 <= r0)
        return inside, misses_rows | (self.k1 <= self.k0) | (self.k1 <= k0) | (k1 <= self.k0)

    def mask_mod(self, B, H, Q, K, device=None):
        r0, r1 = self._q(Extent(B, H, Q, K))
        a, b, c, d = (scalar(x, device) for x in (r0, r1, self.k0, self.k1))
        return lambda bi, h, q_idx, kv_idx: ~((q_idx >= a) & (q_idx < b) & (kv_idx >= c) & (kv_idx < d))

    def __repr__(self) -> str:
        if self.who == "key_span":
            return f"key_span({self.k0}, {self.k1})"
        return f"block_span({self.q0}, {self.q1}, {self.k0}, {self.k1})"


def key_span(start: int, stop: int) -> Span:
    """Keys ``start … stop-1`` may NOT be attended by any query (False there, True elsewhere).
    ``key_span(0, 1)`` knocks out the first key (the attention sink)."""
    return Span(start, stop, who="key_span")


def block_span(q_start: int, q_stop: int, k_start: int, k_stop: int) -> Span:
    """The queries at positions ``q_start … q_stop-1`` may NOT attend keys ``k_start … k_stop-1``
    (Geva et al.'s attention knockout from one span to another); every other pair may. Query
    positions are key coordinates (row i is at i + K − Q)."""
    return Span(k_start, k_stop, q_start, q_stop, who="block_span")
