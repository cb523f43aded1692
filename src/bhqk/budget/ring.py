"""Head-wise KV budgets on bhqk's own models (``plan.kv_cache(model)``; docs/design.md §9): per layer
the full K/V heads keep every position (a :class:`~bhqk.nn.LayerCache`), the streaming heads the
first ``sink`` positions and a ring of the ``window + 1`` most recent (:class:`BudgetLayerCache`, which
attends itself: ``nn.cache.AttendingLayer``). A layer whose heads are all full is a plain
``LayerCache``. Also the pieces both budget caches share (this one and :mod:`bhqk.budget.cache`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .. import masks, observe
from ..errors import MaskError, ShapeError
from ..functional import attention, attention_weights
from ..nn.cache import CacheLayer, LayerCache
from .mask import at_columns, held_mask, one_call_mask, streaming_mask


def take_heads(x: torch.Tensor, dim: int, heads: list[int]) -> torch.Tensor:
    """``x.index_select(dim, heads)`` — a view (``narrow``) where ``heads`` is an ascending run."""
    if heads and heads == list(range(heads[0], heads[0] + len(heads))):
        return x.narrow(dim, heads[0], len(heads))
    return x.index_select(dim, torch.tensor(heads, device=x.device))


def own(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied if it is a view into a larger storage (a cache must not keep the rest alive)."""
    return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x


def split_kv(keeps: torch.Tensor) -> tuple[list[int], list[int]]:
    """One layer's K/V heads by ``keeps`` bool [Hkv] (True: keeps what a full head keeps) → (full, streaming)."""
    heads = range(len(keeps))
    return [g for g in heads if bool(keeps[g])], [g for g in heads if not bool(keeps[g])]


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


def attend_groups(groups: list[tuple[list[int], torch.Tensor | None, Any]], G: int, H: int, K: int, dim: int,
                  call: Callable[[list[int], Any], tuple[torch.Tensor, torch.Tensor | None]]
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention call per group of K/V heads, written into one output in the model's head order (no
    concatenation). ``groups``: (K/V heads, the K columns they hold int64 [K'] or None for all, what
    ``call`` reads); ``call(query heads, that)`` → (out, its h heads at ``dim``; weights [B, h, Q, K'] or
    None). Returns (out, the H heads at ``dim``; weights [B, H, Q, K], zeros at columns not held, or None)."""
    out: torch.Tensor | None = None
    wt: torch.Tensor | None = None
    for kv, cols, part in groups:
        qh = [g * G + j for g in kv for j in range(G)]  # the query heads of K/V heads kv
        o, w = call(qh, part)
        qi = torch.tensor(qh, device=o.device)
        if out is None:
            out = o.new_empty(*o.shape[:dim], H, *o.shape[dim + 1:])  # o's shape with H heads at dim
        out.index_copy_(dim, qi, o)  # [.., h, ..] into [.., H, ..]
        if w is not None:
            if cols is not None:  # [B, h, Q, K'] -> [B, h, Q, K]: zeros at the columns not held
                w = w.new_zeros(*w.shape[:3], K).index_copy(3, cols.to(w.device), w)
            if wt is None:
                wt = w.new_empty(w.shape[0], H, *w.shape[2:])  # [B, H, Q, K]
            wt.index_copy_(1, qi.to(w.device), w)  # [B, h, Q, K] into [B, H, Q, K]
    assert out is not None
    return out, wt


def fits_plan(k: torch.Tensor, v: torch.Tensor, Hkv: int, d: int | None, where: str) -> None:
    """A ``ShapeError`` naming both shapes unless k [B, Hkv, Q, d], v [B, Hkv, Q, dv] have the plan's
    Hkv (and d, where the plan records it) — checked before anything is stored."""
    if (k.dim() != 4 or v.dim() != 4 or k.shape[1] != Hkv or k.shape[:3] != v.shape[:3]
            or (d is not None and k.shape[3] != d)):
        raise ShapeError(f"{where}: the plan has Hkv={Hkv} K/V heads" + ("" if d is None else f", d={d}")
                         + f" but the model wrote keys of shape {list(k.shape)} and values of shape "
                         f"{list(v.shape)} ([B, Hkv, Q, d]).")


def layer_cache(full: torch.Tensor, sink: int, window: int, capacity: int | None, index: int,
                head_dim: int | None, quantized: Callable[..., CacheLayer] | None = None) -> CacheLayer:
    """Layer ``index`` of a plan (``full`` bool [Hkv]: its full K/V heads): a :class:`BudgetLayerCache`,
    or a plain ``LayerCache`` (checking the plan's sizes) when every head is full. ``quantized``: makes
    the full heads' layer instead of a ``LayerCache`` (``quantized(index=, fits=)``: a
    :class:`~bhqk.budget.quant.QuantizedLayerCache`)."""
    keep, stream = split_kv(full)
    fits = partial(fits_plan, Hkv=len(full), d=head_dim, where=f"KVCache layer {index}")
    if stream:
        inner = None if quantized is None or not keep else quantized(index=index, fits=None)
        return BudgetLayerCache(keep, stream, sink, window, capacity, index, head_dim, inner)
    return LayerCache(capacity, None, index, fits) if quantized is None else quantized(index=index, fits=fits)


class BudgetLayerCache:
    """One layer of a head-wise budget: K/V heads ``full`` keep every position (a :class:`LayerCache`),
    heads ``stream`` their first ``sink`` positions and the most recent ones, in a buffer of
    R = sink + window + 1 slots: position p < sink in slot p, p ≥ sink in slot sink + (p − sink) mod
    (window + 1). A query at position i of a streaming head sees keys 0 … sink−1 and i − window … i
    (:func:`~bhqk.budget.mask.streaming_mask`) ANDed with the mask it is given, which covers every
    position as for a plain cache ([Q, length + Q])."""

    def __init__(self, full: list[int], stream: list[int], sink: int, window: int,
                 capacity: int | None = None, index: int = 0, head_dim: int | None = None,
                 full_cache: CacheLayer | None = None) -> None:
        self.full, self.stream, self.sink, self.window, self.index = full, stream, sink, window, index
        self.head_dim = head_dim  # the plan's, where it records it (checked before anything is stored)
        # the full heads' layer: a LayerCache, or one that attends itself (a quantized one, nn.cache.AttendingLayer)
        self.full_cache = full_cache if full_cache is not None else (LayerCache(capacity, None, index) if full else None)
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
        p, S = pos[idx], self.sink
        slots = torch.where(p < S, p, S + (p - S) % (self.window + 1)).to(k.device)  # position p's slot
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

    def _stream_call(self, k: torch.Tensor, v: torch.Tensor, mask, P: int):
        """(keys [B, h, K', d], values, the mask, positions [K']) the streaming heads attend to, having
        stored what they keep."""
        Q, B, dev = k.shape[2], k.shape[0], k.device
        K = P + Q
        stream = streaming_mask(self.sink, self.window)
        m = masks.as_mask(mask)  # head-independent (attention checked it)
        if Q == 1:  # decode: write in place, then the query sees every filled slot
            self._write(k, v, P)
            n = min(K, self.slots)
            pos = self.positions(end=K)
            assert self.k is not None and self.v is not None
            if K <= self.slots:  # slots = positions 0 … P
                return self.k[:, :, :n], self.v[:, :, :n], m, pos
            return self.k, self.v, (None if m is None else masks.dense(at_columns(m, B, Q, K, pos, dev))), pos
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
        allowed = held_mask(pos, torch.arange(P, K), self.sink, self.window).to(dev)  # [1, 1, Q, R + Q]
        if m is not None:
            allowed = allowed & at_columns(m, B, Q, K, pos, dev)  # [#B, #H, Q, R + Q]
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
        fits_plan(k, v, Hkv, self.head_dim, f"budget layer {self.index}")
        if bias is not None:
            raise ValueError(f"budget layer {self.index}: bias= is not supported with a head-wise budget cache "
                             f"(its streaming heads hold a subset of the keys the bias covers).")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError(f"budget layer {self.index}: a head-wise budget cache is for inference (its ring buffer "
                             f"is written in place); run under torch.no_grad().")
        H = q.shape[1]
        P, K = self.end, self.end + k.shape[2]
        m = masks.as_mask(mask)
        if m is not None and m.head_dependent:  # checked before anything is written
            raise MaskError(f"budget layer {self.index}: mask= is head-dependent ({m!r}); the streaming heads' "
                            f"held positions take one mask for every head.")
        self._fit(k, v)
        parts: list[tuple[list[int], Any, Any, Any, torch.Tensor]] = []
        observed = observe.active() or observe.editors()
        if self.full_cache is not None:  # [B, Hkv, Q, d] -> [B, h_full, Q, d] (views where the heads are a run)
            kn, vn = take_heads(k, 1, self.full), take_heads(v, 1, self.full)
            if getattr(self.full_cache, "attention", None) is not None and not observed:
                parts.append((self.full, kn, vn, self.full_cache, torch.arange(K)))  # it stores and attends (call)
            else:
                kf, vf = self.full_cache.update(kn, vn)  # [B, h_full, K, d] (a quantized layer's: dequantized)
                parts.append((self.full, kf, vf, mask, torch.arange(K)))
        ks, vs = take_heads(k, 1, self.stream), take_heads(v, 1, self.stream)  # [B, Hkv, Q, ·] -> [B, h_stream, Q, ·]
        parts.append((self.stream, *self._stream_call(ks, vs, mask, P)))
        self.end = K
        if observed:  # seen as one call: heads and keys in the model's numbering
            spread_k = spread([(kv, kk, pos) for kv, kk, _, _, pos in parts], Hkv, K)  # [B, Hkv, K, d]
            spread_v = spread([(kv, vv, pos) for kv, _, vv, _, pos in parts], Hkv, K)  # [B, Hkv, K, dv]
            m = one_call_mask(masks.as_mask(mask), self.sink, self.window, self.stream, H, Hkv)
            out = attention(q, spread_k, spread_v, m, dropout_p=dropout_p, backend=backend, sinks=sinks)  # [B, H, Q, dv]
            return out, (attention_weights(q, spread_k, m, sinks=sinks) if return_weights else None)  # [B, H, Q, K]

        def call(qh: list[int], part: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
            kk, vv, m = part
            qq = take_heads(q, 1, qh)  # [B, H, Q, d] -> [B, h, Q, d]
            sk = None if sinks is None else take_heads(sinks, 0, qh)  # [H] -> [h]
            if getattr(m, "attention", None) is not None:  # the full heads' layer attends itself over its new kk, vv
                return m.attention(qq, kk, vv, mask, dropout_p=dropout_p, backend=backend, sinks=sk,
                                   return_weights=return_weights)  # [B, h, Q, dv], [B, h, Q, K] or None
            o = attention(qq, kk, vv, m, dropout_p=dropout_p, backend=backend, sinks=sk)  # [B, h, Q, dv]
            return o, (attention_weights(qq, kk, m, sinks=sk) if return_weights else None)  # [B, h, Q, K']

        return attend_groups([(kv, pos, (kk, vv, m)) for kv, kk, vv, m, pos in parts], H // Hkv, H, K, 1, call)

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


__all__ = ["BudgetLayerCache", "layer_cache", "take_heads", "own", "split_kv", "spread", "attend_groups", "fits_plan"]
