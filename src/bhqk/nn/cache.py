"""KVCache: the keys and values of past positions, per layer, for incremental decoding.

Buffers are [B, Hkv, capacity, d] and [B, Hkv, capacity, dv], allocated at the first call and written
in place (no ``torch.cat`` per step). A sequence longer than ``capacity`` does not fail: the buffers are
reallocated at twice the size (amortised O(1) copies per position) and ``repr`` says ``grown from N``;
give the prompt plus the new tokens as ``capacity`` to allocate once. Under autograd (new keys that
require grad, e.g. training through a prefill and decode steps) the cache never writes into a tensor
a graph may hold: each step builds new buffers with ``torch.cat``, so backward through every step works. Each step appends Q new
positions; the queries are the *last* Q positions of the keys, so mask with
``causal(align="bottom_right")``::

    step 1 (prefill, Q=K=3)      step 2 (Q=1, K=4)
    ■ · ·                        ■ ■ ■ ■     ← the new query sees every cached key and itself
    ■ ■ ·
    ■ ■ ■

``window=W`` evicts keys no future query can see under ``sliding_window(W - 1, align="bottom_right")``
(each query sees W keys ending at itself). ``crop(n)`` rolls back to n positions.

``plan=`` (a head-wise KV budget, ``bhqk.budget.Plan``; ``plan.kv_cache(model)``): per layer the plan's
full K/V heads keep every position (a :class:`LayerCache`) and its streaming heads keep the first
``sink`` positions and a ring of the ``window + 1`` most recent (:class:`BudgetLayerCache`; the extra
slot takes each decode step's new key in place, over the one position no query can see any more).
Such a layer attends itself — one attention call per group of heads (one call over every position
while capture, trace or edit look) — so ``MultiHeadAttention`` hands it the queries
(:meth:`BudgetLayerCache.attention`) instead of calling ``update``. A layer
whose heads are all full is a plain :class:`LayerCache`: an all-full plan is the ordinary cache.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import masks, observe
from ..errors import MaskError, ShapeError
from ..functional import attention, attention_weights


class LayerCache:
    """One layer's keys and values. Absolute positions ``start … end-1`` are stored at buffer
    indices ``0 … end-start-1``; ``end`` is how many positions this layer has seen. ``expect``:
    (Hkv, d or None) the keys written must have (a budget plan's, checked before they are stored)."""

    def __init__(self, capacity: int | None = None, window: int | None = None, index: int = 0,
                 expect: tuple[int, int | None] | None = None) -> None:
        self.capacity, self.window, self.index, self.expect = capacity, window, index, expect
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
        if not 0 <= length <= self.end:
            raise ValueError(f"KVCache layer {self.index}: cannot crop to {length}; it holds positions 0…{self.end - 1}.")
        need = length if self.window is None else max(0, length - (self.window - 1))
        if need < self.start:
            raise ValueError(
                f"KVCache layer {self.index}: cannot crop to {length}; the sliding window (W={self.window}) "
                f"already evicted positions before {self.start} that the next query would need."
            )
        self.end = length

    def reset(self) -> None:
        """Empty the layer; the buffers are kept for the next sequence."""
        self.start = self.end = 0

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ShapeError(
                f"KVCache layer {self.index}: k must be [B, Hkv, Q, d] and v [B, Hkv, Q, dv] with the same B, Hkv, Q; "
                f"got k {list(k.shape)}, v {list(v.shape)}."
            )
        _expected(self.expect, k, self.index)
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


def _expected(expect: tuple[int, int | None] | None, k: torch.Tensor, index: int) -> None:
    """A ``ShapeError`` naming both shapes unless the keys k [B, Hkv, Q, d] have the plan's (Hkv, d)."""
    if expect is None:
        return
    Hkv, d = expect
    if k.shape[1] != Hkv or (d is not None and k.shape[3] != d):
        raise ShapeError(f"KVCache layer {index}: the plan has Hkv={Hkv} K/V heads" + ("" if d is None else f", d={d}")
                         + f" but the model wrote keys of shape {list(k.shape)} ([B, Hkv, Q, d]).")


def take_heads(x: torch.Tensor, dim: int, heads: list[int]) -> torch.Tensor:
    """``x.index_select(dim, heads)`` — a view (``narrow``) where ``heads`` is an ascending run
    (no copy: a group of heads next to each other, e.g. a layer's streaming K/V heads)."""
    if heads and heads == list(range(heads[0], heads[0] + len(heads))):
        return x.narrow(dim, heads[0], len(heads))
    return x.index_select(dim, torch.tensor(heads, device=x.device))


def own(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied if it is a view into a larger storage (a cache must not keep the rest alive)."""
    return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x


# ---- a budget layer seen as one call (while something observes or edits it) -----------------------


def spread(parts: list[tuple[list[int], torch.Tensor, torch.Tensor]], Hkv: int, N: int) -> torch.Tensor:
    """What each group of K/V heads holds, laid out over every position: ``parts`` of (K/V head indices,
    t [B, h, n, ·], the positions held int64 [n]) → [B, Hkv, N, ·], zeros where a head holds nothing
    (a mask that forbids those positions must go with it: nothing may read the zeros)."""
    t0 = parts[0][1]
    out = t0.new_zeros(t0.shape[0], Hkv, N, t0.shape[-1])  # [B, Hkv, N, ·]
    for kv, t, pos in parts:
        kvi = torch.tensor(kv, device=t.device)
        out[:, kvi[:, None], pos.to(t.device)[None, :]] = t  # [B, h, n, ·] into [B, Hkv, N, ·] at (head, position)
    return out


def one_call_mask(model: masks.Mask | None, stream: masks.Mask, stream_kv: list[int], H: int, Hkv: int) -> masks.Mask | None:
    """The mask of a budget layer run as one call over every position: the query heads of the streaming
    K/V heads ``stream_kv`` see ``model & stream`` (which forbids every position they dropped), the
    others ``model`` — a ``per_head`` mask of two parts (the span path runs each as a call of its own)."""
    if not stream_kv:
        return model
    both = stream if model is None else model & stream
    if len(stream_kv) == Hkv:
        return both
    G = H // Hkv  # query heads per K/V head
    return masks.per_head([both if h // G in stream_kv else model for h in range(H)])


class BudgetLayerCache:
    """One layer of a head-wise budget: K/V heads ``full`` keep every position (a :class:`LayerCache`),
    heads ``stream`` their first ``sink`` positions and the most recent ones, in a buffer of
    R = sink + window + 1 slots: position p < sink in slot p, p ≥ sink in slot sink + (p − sink) mod
    (window + 1). A query at position i of a streaming head sees keys 0 … sink−1 and i − window … i
    (``~key_span(0, sink) | sliding_window(window, align="bottom_right")``) ANDed with the mask it
    is given, which covers every position as for a plain cache ([Q, length + Q])."""

    def __init__(self, full: list[int], stream: list[int], sink: int, window: int,
                 capacity: int | None = None, index: int = 0, head_dim: int | None = None) -> None:
        self.full, self.stream, self.sink, self.window, self.index = full, stream, sink, window, index
        self.head_dim = head_dim  # the plan's, where it records it (checked before anything is stored)
        self.full_cache = LayerCache(capacity, None, index) if full else None
        self.slots = sink + window + 1  # R
        self.k: torch.Tensor | None = None  # [B, h_stream, R, d]
        self.v: torch.Tensor | None = None  # [B, h_stream, R, dv]
        self.end = 0

    @property
    def length(self) -> int:
        """Positions seen so far: the position of the next token."""
        return self.end

    def span(self, new: int) -> tuple[int, int]:
        """The positions the mask of a call with ``new`` tokens covers: every one, as a plain cache."""
        return 0, self.end + new

    def positions(self, kv: int | None = None, end: int | None = None) -> torch.Tensor:
        """int64: the position held in each filled slot of the streaming heads (``kv`` a full head:
        every position), after ``end`` positions (default: now)."""
        end = self.end if end is None else end
        if kv is not None and kv in self.full:
            return torch.arange(end)
        if kv is not None and kv not in self.stream:
            raise ShapeError(f"budget layer {self.index}: no K/V head {kv} (Hkv={len(self.full) + len(self.stream)}).")
        S, ring = self.sink, self.window + 1
        if end <= self.slots:
            return torch.arange(end)
        j = torch.arange(ring)  # ring slot S + j holds the latest p < end with (p − S) mod ring == j
        return torch.cat([torch.arange(S), end - 1 - (end - 1 - S - j) % ring])  # [R]

    def _slot(self, p: torch.Tensor) -> torch.Tensor:
        S = self.sink
        return torch.where(p < S, p, S + (p - S) % (self.window + 1))

    def _write(self, k: torch.Tensor, v: torch.Tensor, P: int) -> None:
        """Store the streaming heads' new positions P … P+Q−1 that a later query can still see."""
        Q = k.shape[2]
        if self.k is None or self.v is None:
            B, h, _, d = k.shape
            self.k = k.new_empty(B, h, self.slots, d)  # [B, h_stream, R, d]
            self.v = v.new_empty(B, h, self.slots, v.shape[-1])  # [B, h_stream, R, dv]
        pos = torch.arange(P, P + Q)
        keep = (pos < self.sink) | (pos >= P + Q - (self.window + 1))  # [Q]: the sink and the last window + 1
        idx = keep.nonzero().flatten()  # [Q] bool -> [kept] positions
        slots = self._slot(pos[idx]).to(k.device)
        idx = idx.to(k.device)
        self.k.index_copy_(2, slots, k.index_select(2, idx))  # [B, h, n, d] into their slots
        self.v.index_copy_(2, slots, v.index_select(2, idx))  # [B, h, n, dv] into their slots

    def _fit(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The ring's buffers against this call's keys and values [B, Hkv, Q, ·]: an empty cache (``end``
        0, after ``reset``) takes new sizes; a filled one refuses other sizes, naming them."""
        if self.k is None or self.v is None:
            return
        want = (k.shape[0], len(self.stream), k.shape[3], v.shape[3], k.dtype, k.device)
        held = (self.k.shape[0], self.k.shape[1], self.k.shape[3], self.v.shape[3], self.k.dtype, self.k.device)
        if want == held:
            return
        if self.end == 0:
            self.k = self.v = None
            return
        raise ShapeError(f"budget layer {self.index}: holds B={held[0]}, d={held[2]}, dv={held[3]}, {held[4]} on "
                         f"{held[5]} for {self.end} positions but got B={want[0]}, d={want[2]}, dv={want[3]}, "
                         f"{want[4]} on {want[5]}; reset() the cache first.")

    def _given_mask(self, mask, B: int, Q: int, K: int, cols: torch.Tensor, device) -> torch.Tensor | None:
        """The given mask ([Q, K] over every position) at the columns ``cols``: bool [#B, 1, Q, len(cols)]."""
        m = masks.as_mask(mask)
        if m is None:
            return None
        if m.head_dependent:
            raise MaskError(f"budget layer {self.index}: a head-dependent mask ({m!r}) cannot be taken at the held "
                            f"positions of the streaming heads; give a mask that is the same for every head.")
        blk = m.block(masks.Extent(B, 1, Q, K), 0, Q, 0, K, device)  # [.., Q, K]
        while blk.dim() < 4:
            blk = blk[None]  # [.., Q, K] -> [1, .., Q, K] up to 4 axes
        return blk.index_select(3, cols.to(device))  # [#B, #H, Q, K']

    def _stream_call(self, k: torch.Tensor, v: torch.Tensor, mask, P: int):
        """(keys [B, h, K', d], values, the mask, positions [K']) the streaming heads attend to, having
        stored what they keep."""
        Q, B, dev = k.shape[2], k.shape[0], k.device
        K = P + Q
        stream = ~masks.key_span(0, self.sink) | masks.sliding_window(self.window, align="bottom_right")
        m = masks.as_mask(mask)
        if Q == 1:  # decode: write in place, then the query sees every filled slot
            self._write(k, v, P)
            n = min(K, self.slots)
            pos = self.positions(end=K)
            assert self.k is not None and self.v is not None
            if K <= self.slots:  # slots = positions 0 … P
                return self.k[:, :, :n], self.v[:, :, :n], m, pos
            got = self._given_mask(m, B, Q, K, pos, dev)
            return self.k, self.v, (None if got is None else masks.dense(got)), pos
        if P + Q <= self.slots:  # positions 0 … P+Q−1 in their slots: the masks apply as they are
            self._write(k, v, P)
            assert self.k is not None and self.v is not None
            both = stream if m is None else m & stream
            return self.k[:, :, :K], self.v[:, :, :K], both, torch.arange(K)
        if P <= self.slots:  # still positions 0 … P−1: attend over them and the new keys, then store
            kk = k if P == 0 or self.k is None else torch.cat([self.k[:, :, :P], k], 2)  # [B, h, P + Q, d]
            vv = v if P == 0 or self.v is None else torch.cat([self.v[:, :, :P], v], 2)  # [B, h, P + Q, dv]
            self._write(k, v, P)
            return kk, vv, (stream if m is None else m & stream), torch.arange(K)
        # evicted before and Q > 1: the held slots and the new keys, with a mask built from their positions
        assert self.k is not None and self.v is not None
        pos = torch.cat([self.positions(end=P), torch.arange(P, K)])  # [R + Q]
        kk = torch.cat([self.k, k], 2)  # [B, h, R + Q, d]
        vv = torch.cat([self.v, v], 2)  # [B, h, R + Q, dv]
        qpos = torch.arange(P, K)[:, None]  # [Q, 1]
        allowed = (pos[None] <= qpos) & ((pos[None] < self.sink) | (pos[None] >= qpos - self.window))  # [Q, R + Q]
        allowed = allowed.to(dev)[None, None]  # [1, 1, Q, R + Q]
        got = self._given_mask(m, B, Q, K, pos, dev)
        if got is not None:
            allowed = allowed & got
        self._write(k, v, P)
        return kk, vv, masks.dense(allowed), pos

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, bias=None,
                  dropout_p: float = 0.0, backend: str = "auto", sinks: torch.Tensor | None = None,
                  return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store this call's k [B, Hkv, Q, d], v [B, Hkv, Q, dv] and attend q [B, H, Q, d] over what
        each group of heads holds (``mask`` [Q, length + Q] as for a plain cache) → (o [B, H, Q, dv]
        in the model's head order, weights [B, H, Q, length + Q] with zeros at evicted keys, or None).
        While something observes or edits (capture, trace, ``bhqk.edit``) the groups run as one call over
        every position (:func:`spread`, :func:`one_call_mask`), so heads and keys are the model's: O(K·d)
        more per K/V head and call (a copy; nothing changes when nobody looks)."""
        Hkv = len(self.full) + len(self.stream)
        if (k.dim() != 4 or v.dim() != 4 or k.shape[1] != Hkv or v.shape[1] != Hkv or k.shape[:3] != v.shape[:3]
                or (self.head_dim is not None and k.shape[3] != self.head_dim)):
            d = "" if self.head_dim is None else f", d={self.head_dim}"
            raise ShapeError(f"budget layer {self.index}: the plan has Hkv={Hkv} K/V heads{d} but got keys "
                             f"{list(k.shape)} and values {list(v.shape)} ([B, Hkv, Q, d]).")
        if bias is not None:
            raise ValueError(f"budget layer {self.index}: bias= is not supported with a head-wise budget cache "
                             f"(its streaming heads hold a subset of the keys the bias covers).")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError(f"budget layer {self.index}: a head-wise budget cache is for inference (its ring buffer "
                             f"is written in place); run under torch.no_grad().")
        B, H, Q, _ = q.shape
        G = H // Hkv
        P, K = self.end, self.end + k.shape[2]
        m = masks.as_mask(mask)
        if m is not None and m.head_dependent:  # checked before anything is written
            raise MaskError(f"budget layer {self.index}: mask= is head-dependent ({m!r}); the streaming heads' "
                            f"held positions take one mask for every head.")
        self._fit(k, v)
        parts: list[tuple[list[int], torch.Tensor, torch.Tensor, Any, torch.Tensor]] = []
        if self.full_cache is not None:  # [B, Hkv, Q, d] -> [B, h_full, Q, d] (views where the heads are a run)
            kf, vf = self.full_cache.update(take_heads(k, 1, self.full), take_heads(v, 1, self.full))  # [B, h_full, K, d]
            parts.append((self.full, kf, vf, mask, torch.arange(K)))
        ks, vs = take_heads(k, 1, self.stream), take_heads(v, 1, self.stream)  # [B, Hkv, Q, ·] -> [B, h_stream, Q, ·]
        parts.append((self.stream, *self._stream_call(ks, vs, mask, P)))
        self.end = K
        if observe.active() or observe.editors():  # seen as one call: heads and keys in the model's numbering
            spread_k = spread([(kv, kk, pos) for kv, kk, _, _, pos in parts], Hkv, K)  # [B, Hkv, K, d]
            spread_v = spread([(kv, vv, pos) for kv, _, vv, _, pos in parts], Hkv, K)  # [B, Hkv, K, dv]
            stream = ~masks.key_span(0, self.sink) | masks.sliding_window(self.window, align="bottom_right")
            m = one_call_mask(masks.as_mask(mask), stream, self.stream, H, Hkv)
            out = attention(q, spread_k, spread_v, m, dropout_p=dropout_p, backend=backend, sinks=sinks)  # [B, H, Q, dv]
            return out, (attention_weights(q, spread_k, m, sinks=sinks) if return_weights else None)  # [B, H, Q, K]
        o = q.new_empty(B, H, Q, v.shape[-1])  # [B, H, Q, dv]: each group writes its heads
        w_all = q.new_zeros(B, H, Q, K) if return_weights else None  # [B, H, Q, K]: zeros at evicted keys
        for kv, kk, vv, m, pos in parts:
            qh = [g * G + j for g in kv for j in range(G)]
            qq = take_heads(q, 1, qh)  # [B, H, Q, d] -> [B, h, Q, d]
            sk = None if sinks is None else take_heads(sinks, 0, qh)  # [H] -> [h]
            qi = torch.tensor(qh, device=q.device)
            o.index_copy_(1, qi, attention(qq, kk, vv, m, dropout_p=dropout_p, backend=backend, sinks=sk))  # [B, h, Q, dv]
            if w_all is not None:
                w = attention_weights(qq, kk, m, sinks=sk)  # [B, h, Q, K']
                w_all.index_copy_(1, qi, w.new_zeros(B, len(qh), Q, K).index_copy(3, pos.to(w.device), w))  # [B, h, Q, K]
        return o, w_all

    def update(self, k: torch.Tensor, v: torch.Tensor):
        raise TypeError(f"budget layer {self.index}: its heads hold different keys, so it cannot return one "
                        f"[B, Hkv, K, d] tensor; MultiHeadAttention calls .attention(q, k, v, mask) instead.")

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on — exact while the streaming heads still hold what
        the next query needs (nothing evicted yet, or ``length`` ≥ the current length − 1: the ring's
        spare slot); else a ValueError saying why."""
        self.check_crop(length)
        if self.full_cache is not None:
            self.full_cache.crop(length)
        self.end = length

    def check_crop(self, length: int) -> None:
        """The ValueError ``crop(length)`` would raise, raised with nothing changed."""
        if not 0 <= length <= self.end:
            raise ValueError(f"KVCache layer {self.index}: cannot crop to {length}; it holds positions 0…{self.end - 1}.")
        if self.end > self.slots and length < self.end - 1:
            lowest = self.end - (self.window + 1)
            raise ValueError(
                f"KVCache layer {self.index}: cannot crop to {length}; its streaming heads (sink={self.sink}, "
                f"window={self.window}) keep positions from {lowest} on, and the next query (at {length}) would "
                f"need positions {max(self.sink, length - self.window)}…{length - 1}, evicted.")

    def reset(self) -> None:
        if self.full_cache is not None:
            self.full_cache.reset()
        self.end = 0

    def nbytes(self) -> int:
        """Bytes of the key and value buffers: the full heads' (``capacity`` positions) and the
        streaming heads' R = sink + window + 1 slots."""
        held = sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)
        return held + (0 if self.full_cache is None else self.full_cache.nbytes())

    def state(self) -> dict:
        """Length; the streaming heads' stored shapes [B, h_stream, kept, ·] in ``slots`` slots; the full
        heads' :meth:`LayerCache.state` (``full``, None without full heads)."""
        kept = min(self.end, self.slots)
        return {"length": self.end, "kept": kept, "capacity": self.slots, "grown_from": None,
                "keys": None if self.k is None else [*self.k.shape[:2], kept, self.k.shape[3]],
                "values": None if self.v is None else [*self.v.shape[:2], kept, self.v.shape[3]],
                "full_kv": self.full, "stream_kv": self.stream, "slots": self.slots,
                "full": None if self.full_cache is None else self.full_cache.state()}

    def __repr__(self) -> str:
        return (f"BudgetLayerCache(layer {self.index}, length={self.end}, full kv {self.full}, "
                f"streaming kv {self.stream} in {self.slots} slots)")


def _describe(st: dict) -> str:
    """``length=…, keys=…, values=…, capacity=…`` (+ ``grown from N`` once the buffers outgrew their first size)."""
    grown = f", grown from {st['grown_from']}" if st["grown_from"] is not None else ""
    return f"length={st['length']}, keys={st['keys']}, values={st['values']}, capacity={st['capacity']}{grown}"


class KVCache:
    """Keys and values of past positions for ``num_layers`` attention layers.

    ``capacity``: positions the buffers hold, allocated at the first call (default 16; e.g. prompt +
    new tokens). A longer sequence reallocates them at twice the size, and ``repr`` then says
    ``grown from N``. ``window``: keep only what ``sliding_window(window - 1, align="bottom_right")`` can
    still see. ``plan``: a head-wise KV budget (``bhqk.budget.Plan``: ``full`` bool [num_layers, Hkv],
    ``sink``, ``window``; module doc). Pass ``cache[i]`` to layer i: ``mha(x, mask=causal("bottom_right"),
    cache=cache[i])``.
    """

    def __init__(self, num_layers: int = 1, *, capacity: int | None = None, window: int | None = None,
                 plan: Any = None) -> None:
        if num_layers < 1:
            raise ValueError(f"KVCache needs num_layers >= 1, got {num_layers}.")
        if capacity is not None and capacity < 1:
            raise ValueError(f"KVCache capacity must be >= 1, got {capacity}.")
        if window is not None and window < 1:
            raise ValueError(f"KVCache window must be >= 1 (keys each query sees, itself included), got {window}.")
        self.capacity, self.window, self.plan = capacity, window, plan
        self.layers: list[LayerCache | BudgetLayerCache] = [LayerCache(capacity, window, i) for i in range(num_layers)]
        if plan is not None:
            if window is not None:
                raise ValueError("KVCache: give window= or plan=, not both (a plan's streaming heads have their own window).")
            full = plan.full
            if full.dim() != 2 or full.shape[0] != num_layers:
                raise ShapeError(f"KVCache: the plan is [layers={full.shape[0]}, Hkv={full.shape[-1]}] but the cache "
                                 f"has num_layers={num_layers}.")
            made_for = getattr(plan, "model", None)
            d = None if made_for is None else made_for.head_dim
            for i in range(num_layers):
                keep = [g for g in range(full.shape[1]) if bool(full[i, g])]
                stream = [g for g in range(full.shape[1]) if not bool(full[i, g])]
                self.layers[i] = (BudgetLayerCache(keep, stream, plan.sink, plan.window, capacity, i, d) if stream else
                                  LayerCache(capacity, None, i, (full.shape[1], d)))

    def __getitem__(self, i: int) -> LayerCache | BudgetLayerCache:
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
        """Roll every layer back to ``length`` positions (every layer or none: a budget layer that
        cannot is found before any layer changes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache: cannot crop to {length}; it holds positions 0…{self.length - 1}.")
        for layer in self.layers:
            if isinstance(layer, BudgetLayerCache):
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
