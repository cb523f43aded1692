"""What a streaming head sees (docs/design.md §2, §9)."""

from __future__ import annotations

from .. import masks


def streaming_mask(sink: int, window: int) -> masks.Mask:
    """What a streaming head may see (before the model's own mask): keys 0 … sink−1, and the
    ``window`` keys before the query plus its own (the query at row i sits at key i + K − Q)::

        sink=1, window=2, Q = K = 6:   ■ · · · · ·
                                       ■ ■ · · · ·
                                       ■ ■ ■ · · ·
                                       ■ ■ ■ ■ · ·
                                       ■ · ■ ■ ■ ·
                                       ■ · · ■ ■ ■
    A streaming head's call ANDs it with the model's own mask (causal, padding, a sliding window)."""
    return ~masks.key_span(0, sink) | masks.sliding_window(window, align="bottom_right")


__all__ = ["streaming_mask"]
