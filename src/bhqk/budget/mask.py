"""What a streaming head sees (docs/design.md §2, §9): the mask, written once, as a structured mask
(:func:`streaming_mask`), at the positions a head holds (:func:`held_mask`) and per head over every
position (:func:`one_call_mask`); both budget caches (:mod:`bhqk.budget.ring`, :mod:`bhqk.budget.cache`)
use these."""

from __future__ import annotations

import torch

from .. import masks
from ..shapes import as_4d


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


def held_mask(keys: torch.Tensor, queries: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """:func:`streaming_mask` & causal for queries at positions ``queries`` int64 [Q] over keys held at
    positions ``keys`` int64 [K'] (the same coordinates) → bool [1, 1, Q, K']: O(Q·K'), never [Q, K]."""
    q = queries[:, None]  # [Q, 1]
    return ((keys[None] <= q) & ((keys[None] < sink) | (keys[None] >= q - window)))[None, None]  # [1, 1, Q, K']


def at_columns(m: masks.Mask, B: int, Q: int, K: int, cols: torch.Tensor, device) -> torch.Tensor:
    """A head-independent mask ``m`` of a [Q, K] call taken at the columns ``cols`` int64 [K'] → bool
    [#B, #H, Q, K'] (the model's mask at the keys a group holds)."""
    blk = as_4d(m.block(masks.Extent(B, 1, Q, K), 0, Q, 0, K, device))  # [#B, #H, #Q, #K]
    return blk.expand(*blk.shape[:2], Q, K).index_select(3, cols.to(device))  # [#B, #H, Q, K']


def one_call_mask(model: masks.Mask | None, sink: int, window: int, stream_kv: list[int], H: int,
                  Hkv: int) -> masks.Mask | None:
    """The mask of a budget layer run as one call over every position: the query heads of the streaming
    K/V heads ``stream_kv`` see ``model & streaming_mask(sink, window)`` (which forbids every position
    they dropped), the others ``model`` — a ``per_head`` mask of two parts (the span path runs each as a
    call of its own)."""
    if not stream_kv:
        return model
    stream = streaming_mask(sink, window)
    both = stream if model is None else model & stream
    if len(stream_kv) == Hkv:
        return both
    G = H // Hkv  # query heads per K/V head
    return masks.per_head([both if h // G in stream_kv else model for h in range(H)])


__all__ = ["streaming_mask", "held_mask", "at_columns", "one_call_mask"]
