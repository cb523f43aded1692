"""KVCache: the keys and values of past positions, per layer, for incremental decoding.

Each step appends Q new positions in place (buffers grown by doubling, :class:`KVCache`); the queries
are the *last* Q positions of the keys, so mask with ``causal(align="bottom_right")``::

    step 1 (prefill, Q=K=3)      step 2 (Q=1, K=4)
    ■ · ·                        ■ ■ ■ ■     ← the new query sees every cached key and itself
    ■ ■ ·
    ■ ■ ■

Under autograd (new keys that require grad) the cache never writes into a tensor a graph may hold:
each step builds new buffers with ``torch.cat``, so backward through every step works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..errors import ShapeError


class CacheLayer(Protocol):
    """One layer of a :class:`KVCache`: what ``KVCache`` and ``MultiHeadAttention`` call (:class:`LayerCache`
    is one). ``length``: positions seen; ``span(new)``: positions [first, last + 1) a call of ``new``
    covers; ``check_crop``: the ValueError ``crop`` would raise, nothing changed; ``state()``: plain data
    with at least ``length``, ``keys``, ``values`` (stored shapes or None), ``capacity``, ``grown_from``."""

    @property
    def length(self) -> int: ...
    def span(self, new: int) -> tuple[int, int]: ...
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def check_crop(self, length: int) -> None: ...
    def crop(self, length: int) -> None: ...
    def reset(self) -> None: ...
    def nbytes(self) -> int: ...
    def state(self) -> dict: ...


class AttendingLayer(CacheLayer, Protocol):
    """A layer that attends itself (its K/V heads hold different positions, say): it stores k [B, Hkv, Q, d],
    v [B, Hkv, Q, dv] and attends q [B, H, Q, d] over what it holds (``mask`` [Q, length + Q], as for a
    plain layer) → (o [B, H, Q, dv], weights [B, H, Q, K] or None). ``MultiHeadAttention`` calls it,
    inside its observe scope, instead of ``update``."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, bias=None,
                  dropout_p: float = 0.0, backend: str = "auto", sinks: torch.Tensor | None = None,
                  return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class LayerCache:
    """One layer's keys and values. Absolute positions ``start … end-1`` are stored at buffer
    indices ``0 … end-start-1``; ``end`` is how many positions this layer has seen. ``check``: called
    with each call's k, v before anything is stored (e.g. a budget plan's sizes; it raises to refuse)."""

    def __init__(self, capacity: int | None = None, window: int | None = None, index: int = 0,
                 check: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.capacity, self.window, self.index, self.check = capacity, window, index, check
        self.k: torch.Tensor | None = None  # [B, Hkv, capacity, d]
        self.v: torch.Tensor | None = None  # [B, Hkv, capacity, dv]
        self.start = 0
        self.end = 0
        self.allocated: int | None = None  # positions of the first allocation (None until the first call)
        self.grown = 0  # reallocations to a larger size since then

    @property
    def planned(self) -> int:
        """Positions the first call allocates room for (at least that call's own): ``capacity`` if
        given, else twice the window, else 16."""
        return self.capacity or (2 * self.window if self.window is not None else 16)

    @property
    def length(self) -> int:
        """Positions seen so far: the position of the next token."""
        return self.end

    @property
    def kept(self) -> int:
        """Positions stored now (``length`` unless the window evicted some)."""
        return self.end - self.start

    def span(self, new: int) -> tuple[int, int]:
        """Absolute positions ``[first, last + 1)`` of the keys that ``update`` returns after
        appending ``new`` positions: build padding masks for exactly these keys."""
        if self.window is None:
            return self.start, self.end + new
        return max(self.start, self.end - (self.window - 1)), self.end + new

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys [B, Hkv, kept, d] (a view)."""
        return None if self.k is None else self.k[:, :, : self.kept]

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values [B, Hkv, kept, dv] (a view)."""
        return None if self.v is None else self.v[:, :, : self.kept]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k [B, Hkv, Q, d], v [B, Hkv, Q, dv] in place; return the keys and values the new
        queries attend to: [B, Hkv, K, d], [B, Hkv, K, dv] (views), the new ones last."""
        self._check(k, v)
        new = k.shape[2]
        first, last = self.span(new)
        if self._tracks_grad(k, v):
            return self._append_out_of_place(k, v, first)
        k_buf, v_buf = self._make_room(k, v)
        i = self.end - self.start
        k_buf[:, :, i : i + new].copy_(k)  # [B, Hkv, Q, d] into the buffer
        v_buf[:, :, i : i + new].copy_(v)  # [B, Hkv, Q, dv] into the buffer
        self.end += new
        lo, hi = first - self.start, last - self.start
        return k_buf[:, :, lo:hi], v_buf[:, :, lo:hi]  # [B, Hkv, K, d], [B, Hkv, K, dv]

    def _tracks_grad(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Autograd may hold views of the buffers (an earlier step's keys): never write into them."""
        held = self.k is not None and self.v is not None and (self.k.requires_grad or self.v.requires_grad)
        if not torch.is_grad_enabled():
            return held
        return k.requires_grad or v.requires_grad or held

    def _append_out_of_place(self, k: torch.Tensor, v: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Under autograd: new buffers holding exactly the keys this step attends to, built with
        ``torch.cat`` (the old buffers, which earlier steps' graphs saved, are left untouched)."""
        lo, kept = first - self.start, self.end - self.start
        if self.k is None or self.v is None:  # (set and cleared together)
            self.k, self.v = k, v  # [B, Hkv, Q, d], [B, Hkv, Q, dv]
        else:
            self.k = torch.cat([self.k[:, :, lo:kept], k], dim=2)  # [B, Hkv, K, d]
            self.v = torch.cat([self.v[:, :, lo:kept], v], dim=2)  # [B, Hkv, K, dv]
        self.start, self.end = first, self.end + k.shape[2]
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (roll back a draft, retry a step)."""
        self.check_crop(length)
        self.end = length

    def check_crop(self, length: int) -> None:
        """The ValueError ``crop(length)`` would raise, raised with nothing changed."""
        if not 0 <= length <= self.end:
            raise ValueError(f"KVCache layer {self.index}: cannot crop to {length}; it holds positions 0…{self.end - 1}.")
        need = length if self.window is None else max(0, length - (self.window - 1))
        if need < self.start:
            raise ValueError(
                f"KVCache layer {self.index}: cannot crop to {length}; the sliding window (W={self.window}) "
                f"already evicted positions before {self.start} that the next query would need."
            )

    def reset(self) -> None:
        """Empty the layer; the buffers are kept for the next sequence."""
        self.start = self.end = 0

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ShapeError(
                f"KVCache layer {self.index}: k must be [B, Hkv, Q, d] and v [B, Hkv, Q, dv] with the same B, Hkv, Q; "
                f"got k {list(k.shape)}, v {list(v.shape)}."
            )
        if self.check is not None:
            self.check(k, v)
        if self.k is None or self.v is None:  # (set and cleared together)
            return
        if self.kept == 0 and (k.shape[:2] + k.shape[3:] != self.k.shape[:2] + self.k.shape[3:]
                               or v.shape[3] != self.v.shape[3] or k.dtype != self.k.dtype or k.device != self.k.device):
            self.k = self.v = None  # an empty (reset) cache takes new sizes: allocate afresh
            return
        B, Hkv, _, d = self.k.shape
        dv = self.v.shape[-1]
        for name, got, want in (("B", k.shape[0], B), ("Hkv", k.shape[1], Hkv), ("d", k.shape[3], d), ("dv", v.shape[3], dv)):
            if got != want:
                raise ShapeError(f"KVCache layer {self.index} holds {name}={want} but the new keys/values have {name}={got}.")
        if k.dtype != self.k.dtype or k.device != self.k.device:
            raise ShapeError(
                f"KVCache layer {self.index} holds {self.k.dtype} on {self.k.device}; got {k.dtype} on {k.device}."
            )

    def _make_room(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers with room for ``k_new``/``v_new`` after the kept positions: these, compacted, or new ones."""
        new, kept = k_new.shape[2], self.end - self.start
        old_k, old_v = self.k, self.v
        if old_k is not None and old_v is not None:  # (set and cleared together)
            cap = old_k.shape[2]
            if kept + new <= cap:
                return old_k, old_v
            if self.window is not None and kept > self.window - 1:  # evict what no future query can see
                keep = self.window - 1
                src = slice(kept - keep, kept)
                old_k[:, :, :keep] = old_k[:, :, src].clone()  # [B, Hkv, W-1, d]: move the window to the front
                old_v[:, :, :keep] = old_v[:, :, src].clone()
                self.start = self.end - keep
                kept = keep
                if kept + new <= cap:
                    return old_k, old_v
        else:
            cap = 0
        if cap == 0:  # first allocation: as asked, else room to compact only every ~W steps
            capacity = max(self.planned, kept + new)
            self.allocated, self.grown = capacity, 0
        else:
            capacity = max(kept + new, 2 * cap)  # doubling: amortised O(1) copies per position
            self.grown += 1
        B, Hkv, _, d = k_new.shape
        k = k_new.new_empty(B, Hkv, capacity, d)  # [B, Hkv, capacity, d]
        v = v_new.new_empty(B, Hkv, capacity, v_new.shape[-1])  # [B, Hkv, capacity, dv]
        if old_k is not None and old_v is not None and kept:
            k[:, :, :kept] = old_k[:, :, :kept]
            v[:, :, :kept] = old_v[:, :, :kept]
        self.k, self.v = k, v
        return k, v

    def nbytes(self) -> int:
        """Bytes of the key and value buffers (as allocated: ``capacity`` positions)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def state(self) -> dict:
        """Length, stored shapes [B, Hkv, kept, ·], ``capacity`` (positions the buffers hold; before the
        first call, what it will allocate) and ``grown_from`` (the first allocation, once outgrown)."""
        shape = None if self.k is None else [*self.k.shape[:2], self.kept, self.k.shape[3]]
        vshape = None if self.v is None else [*self.v.shape[:2], self.kept, self.v.shape[3]]
        cap = self.planned if self.k is None else self.k.shape[2]
        return {"length": self.end, "kept": self.kept, "capacity": cap, "keys": shape, "values": vshape,
                "grown_from": self.allocated if self.grown and self.k is not None else None}

    def __repr__(self) -> str:
        return f"LayerCache(layer {self.index}, {_describe(self.state())})"


def _describe(st: dict) -> str:
    """``length=…, keys=…, values=…, capacity=…`` (+ ``grown from N`` once the buffers outgrew their first size)."""
    grown = f", grown from {st['grown_from']}" if st["grown_from"] is not None else ""
    return f"length={st['length']}, keys={st['keys']}, values={st['values']}, capacity={st['capacity']}{grown}"


class KVCache:
    """Keys and values of past positions for ``num_layers`` attention layers.

    ``capacity``: positions the buffers hold, allocated at the first call (default 16; give the prompt
    plus the new tokens to allocate once); a longer sequence reallocates them at twice the size
    (amortised O(1) copies per position) and ``repr`` then says ``grown from N``. ``window``: keep only
    what ``sliding_window(window - 1, align="bottom_right")`` can still see; ``crop(n)`` rolls back to n
    positions. ``layers``: per-layer caches to hold instead (:class:`CacheLayer`, :class:`AttendingLayer`;
    e.g. ``plan.kv_cache(model)``). Pass ``cache[i]`` to layer i: ``mha(x, mask=causal("bottom_right"),
    cache=cache[i])``.
    """

    def __init__(self, num_layers: int | None = None, *, capacity: int | None = None, window: int | None = None,
                 layers: Sequence[CacheLayer] | None = None) -> None:
        n = (1 if layers is None else len(layers)) if num_layers is None else num_layers
        if n < 1:
            raise ValueError(f"KVCache needs num_layers >= 1, got {n}.")
        if capacity is not None and capacity < 1:
            raise ValueError(f"KVCache capacity must be >= 1, got {capacity}.")
        if window is not None and window < 1:
            raise ValueError(f"KVCache window must be >= 1 (keys each query sees, itself included), got {window}.")
        self.capacity, self.window = capacity, window
        self.layers: list[CacheLayer] = [LayerCache(capacity, window, i) for i in range(n)]
        if layers is not None:
            if window is not None or capacity is not None:
                given = "window" if window is not None else "capacity"
                raise ValueError(f"KVCache: give {given}= or layers=, not both (the layers have their own).")
            if len(layers) != n:
                raise ShapeError(f"KVCache: {len(layers)} layers given but num_layers={n}.")
            self.layers = list(layers)

    def __getitem__(self, i: int) -> CacheLayer:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    @property
    def length(self) -> int:
        """Positions seen (the first layer's count; every layer agrees between steps)."""
        return self.layers[0].length

    def span(self, new: int) -> tuple[int, int]:
        """Absolute positions ``[first, last + 1)`` of the keys each layer attends to after
        appending ``new`` positions (slice a [B, K_total] padding mask with it)."""
        return self.layers[0].span(new)

    def nbytes(self) -> int:
        """Bytes of the key and value buffers of every layer (as allocated)."""
        return sum(layer.nbytes() for layer in self.layers)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-layer cache can stand in for its layer."""
        if len(self.layers) != 1:
            raise ValueError(f"this KVCache has {len(self.layers)} layers; pass cache[i] to layer i.")
        return self.layers[0].update(k, v)

    def crop(self, length: int) -> None:
        """Roll every layer back to ``length`` positions (every layer or none: a layer that cannot is
        found before any layer changes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache: cannot crop to {length}; it holds positions 0…{self.length - 1}.")
        for layer in self.layers:
            layer.check_crop(length)
        for layer in self.layers:
            layer.crop(length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def state(self) -> dict:
        """Length, window and per-layer stored shapes [B, Hkv, kept, d] — plain data to print or log."""
        return {"length": self.length, "window": self.window, "layers": [layer.state() for layer in self.layers]}

    def __repr__(self) -> str:
        w = "" if self.window is None else f", window={self.window}"
        first = _describe(self.layers[0].state()).removeprefix(f"length={self.length}, ")
        return f"KVCache(layers={len(self.layers)}, length={self.length}{w}, {first})"
