"""A transformers ``Cache`` that holds only what a :class:`~bhqk.budget.Plan` keeps (docs/design.md §9).

Per layer of the model's own type (full attention, or sliding / chunked with window w), the full K/V
heads keep what the model's own layer keeps (every position, or the w − 1 last) and the streaming
heads, of those, the first ``sink`` and the last ``window`` positions (as written: rotary embeddings
stay applied). A layer whose heads are all full is the model's own layer, tensor for tensor.
``get_mask_sizes`` reports the model's own frame o … P+Q−1; ``update()`` returns a :class:`GroupedKV`
(a storage-less tensor of the frame's shape holding each group) that only bhqk's attention function
reads (``bhqk_attend``: one call per group; one call over every position while observed or edited);
any other implementation gets a ``BackendError``. ``bits`` (8 or 4): the full heads' positions older
than the last ``residual`` are integers, read block by block (:mod:`bhqk.budget.quant`). ``crop`` is
exact after ``activate_past_recording()`` (dropping waits for the crop), else refused with a
``ValueError`` once the layer dropped what the next query needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import masks, observe
from ..errors import BackendError, ShapeError
from ..integrations.hf_attention import model_mask
from ..integrations.hf_mask import AllKeys
from ..shapes import as_4d
from .mask import at_columns, held_mask, one_call_mask, streaming_mask
from .quant import BLOCK, RESIDUAL, Quantized, age
from .quant import attend as attend_quantized
from .quant import check as check_bits
from .ring import attend_groups, fits_plan, own, split_kv, spread, take_heads


@dataclass
class Group:
    """K/V heads of one layer that share a layout: ``kv`` their indices in the model's order, ``keys``
    [B, h, K_g, d] and ``values`` [B, h, K_g, dv]; ``columns`` None (the whole frame of the call) or
    int64 [K_g] (the frame's columns held, ascending); ``streaming``: whether the streaming mask applies."""

    kv: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    columns: torch.Tensor | None
    streaming: bool
    qkeys: Quantized | None = None  # the frame's first columns 0 … nq − 1 in integers (``bits``); ``keys`` the rest
    qvalues: Quantized | None = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) in float over every column held: the quantized columns dequantized (a copy)."""
        if self.qkeys is None or self.qvalues is None:
            return self.keys, self.values
        return (torch.cat([self.qkeys.dequantize(), self.keys], dim=-2),  # [B, h, nq + n, d]
                torch.cat([self.qvalues.dequantize(), self.values], dim=-2))


class GroupedKV(torch.Tensor):
    """The keys (or values) ``update()`` returns for a layer with streaming heads: to shape queries it
    is [B, Hkv, K, d] (K = the frame: positions ``first`` … ``first`` + K − 1, what the model's own
    cache would return), but it holds no data of its own; ``groups`` does. Only bhqk's attention
    function reads it (``bhqk_attend``); any torch operation raises."""

    _is_param = False
    groups: list[Group]
    sink: int
    window: int
    first: int
    role: str
    block: int = BLOCK  # quantized positions dequantized at a time (the layer's)

    @staticmethod
    def __new__(cls, groups: list[Group], shape: tuple[int, ...], like: torch.Tensor, sink: int, window: int,
                first: int, role: str):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device, requires_grad=False)
        self.groups, self.sink, self.window, self.first, self.role = groups, sink, window, first, role
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise _refuse(func)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _refuse(func)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]  # noqa: ARG002
        parts = ", ".join(f"{'streaming' if g.streaming else 'full'} kv {g.kv}: {g.keys.shape[-2]} keys" for g in self.groups)
        return f"GroupedKV({self.role} {list(self.shape)} from position {self.first}; {parts})"

    def bhqk_attend(self, attend: Callable, module, query: torch.Tensor, value: torch.Tensor, attention_mask,
                    **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` [B, H, Q, d] over each group with ``attend`` (bhqk's attention function,
        same contract) → (out [B, Q, H, dv], weights [B, H, Q, K] or None), heads in the model's order.
        While something observes or edits, one call over every position instead (:meth:`_one_call`)."""
        if not isinstance(value, GroupedKV) or value.groups is not self.groups:
            raise BackendError("bhqk budget cache: keys and values of different caches reached the attention function.")
        for k in ("position_bias", "indices"):
            if kw.get(k) is not None:
                raise TypeError(f"bhqk budget cache: {k!r} is not supported with a head-wise budget cache.")
        B, H, Q, _ = query.shape
        Hkv, K = self.shape[1], self.shape[2]
        m, bias = model_mask(attention_mask, module, Q, K, kw.get("is_causal"), kw.get("sliding_window"),
                             kw.get("position_ids"), kw.get("cu_seq_lens_q"), kw.get("cu_seq_lens_k"))
        if observe.active() or observe.editors():
            return self._one_call(attend, module, query, m, bias, **kw)
        want_w = bool(kw.pop("output_attentions", False))
        sinks = {n: kw.pop(n, None) for n in ("s_aux", "sinks")}

        def call(qh: list[int], g: Group) -> tuple[torch.Tensor, torch.Tensor | None]:
            q = take_heads(query, 1, qh)  # [B, H, Q, d] -> [B, h, Q, d] (a view where the heads are a run)
            extra = {n: (None if s is None else take_heads(s.reshape(H), 0, qh))  # [H] -> [h]
                     for n, s in sinks.items()}
            if g.qkeys is not None and not want_w:  # block by block from the integers (never one float copy)
                return self._quantized(module, q, g, m, bias, B, Q, K, extra, kw), None  # [B, Q, h, dv]
            keys, values = g.dense()  # weights asked for: the float keys (a copy of the quantized ones)
            mask = self._mask(m, bias, B, Q, K, g) if g.streaming else attention_mask
            return attend(module, q, keys, values, mask, output_attentions=want_w, **extra, **kw)  # [B, Q, h, dv]

        return attend_groups([(g.kv, g.columns, g) for g in self.groups], H // Hkv, H, K, 2, call)  # [B, Q, H, dv]

    def _quantized(self, module, q: torch.Tensor, g: Group, m, bias, B: int, Q: int, K: int,
                   sinks: dict[str, torch.Tensor | None], kw: dict[str, Any]) -> torch.Tensor:
        """A full group whose first columns are quantized (:func:`bhqk.budget.quant.attend`): q [B, h, Q, d]
        → out [B, Q, h, dv], the model's mask and bias taken per block of columns."""
        assert g.qkeys is not None and g.qvalues is not None and g.columns is None
        if kw.get("dropout") and getattr(module, "training", False):
            raise ValueError("bhqk budget cache: a quantized cache is for inference; dropout is not supported.")
        dev = q.device

        def masks_at(a: int, b: int):  # columns a … b − 1 of the frame: ([#B, #H, #Q, b − a] bools or None, bias)
            mk = None if m is None else as_4d(m.block(masks.Extent(B, 1, Q, K), 0, Q, a, b, dev))
            return mk, (None if bias is None else bias[..., a:b])

        s = next((t for t in sinks.values() if t is not None), None)  # [h] or None
        ctx = contextlib.nullcontext() if observe.quiet() else observe.scope(module)
        with ctx:
            out = attend_quantized(q, g.qkeys, g.qvalues, g.keys, g.values, masks_at, scale=kw.get("scaling"),
                                   softcap=kw.get("softcap"), sinks=s, block=self.block)  # [B, h, Q, dv]
        return out.transpose(1, 2)  # [B, Q, h, dv]

    def _one_call(self, attend: Callable, module, query: torch.Tensor, m, bias,
                  **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer as capture, trace and edit see it: ONE attention call over every position written,
        0 … N − 1 (key index = position, heads in the model's order, as in ``plan.emulate``), the groups'
        keys and values spread into [B, Hkv, N, ·] (:func:`spread`, :func:`one_call_mask`): O(N·d) per K/V head."""
        B, H, Q, _ = query.shape
        Hkv, K, o = self.shape[1], self.shape[2], self.first
        N = o + K
        dev = query.device
        m, bias = _at_positions(m, bias, o, B, H, Q, K, dev)
        stream_kv = [kv for g in self.groups if g.streaming for kv in g.kv]
        mask = one_call_mask(m, self.sink, self.window, stream_kv, H, Hkv)
        frame = torch.arange(o, N, device=dev)  # [K] the positions of the frame's columns
        held = [frame if g.columns is None else g.columns.to(dev) + o for g in self.groups]  # [K'] per group
        dense = [g.dense() for g in self.groups]  # quantized columns dequantized: what the emulated run attends
        keys = spread([(g.kv, k, pos) for g, (k, _), pos in zip(self.groups, dense, held)], Hkv, N)  # [B, Hkv, N, d]
        values = spread([(g.kv, v, pos) for g, (_, v), pos in zip(self.groups, dense, held)], Hkv, N)  # [B, Hkv, N, dv]
        kw["position_bias"] = bias
        out, w = attend(module, query, keys, values, AllKeys(N) if mask is None else mask, **kw)  # [B, Q, H, dv]
        return out, (None if w is None else w[..., o:])  # [B, H, Q, N] -> the frame's [B, H, Q, K], as the groups'

    def _mask(self, m, bias, B: int, Q: int, K: int, g: Group):
        """The streaming group's mask: the model's mask ``m`` (at the columns held) & the streaming mask."""
        sink = max(0, self.sink - self.first)  # the sink positions still in the frame are its first columns
        if g.columns is None and bias is None:  # the whole frame: structured, as the model's mask
            stream = streaming_mask(sink, self.window)
            return stream if m is None else m & stream
        dev = g.keys.device
        cols = (torch.arange(K) if g.columns is None else g.columns).to(dev)  # [K']
        allowed = held_mask(cols, torch.arange(K - Q, K, device=dev), sink, self.window)  # [1, 1, Q, K']
        if m is not None:
            allowed = allowed & at_columns(m, B, Q, K, cols, dev)  # [#B, #H, Q, K']
        if bias is not None:  # an additive mask: its values at the columns held, forbidden entries lowest
            b = bias.index_select(-1, cols.to(bias.device))  # [.., Q, K']
            return torch.where(allowed.to(b.device), b, torch.finfo(b.dtype).min)
        if bool(allowed.all()):
            return AllKeys(len(cols))
        return masks.dense(allowed)


def _at_positions(m, bias, o: int, B: int, H: int, Q: int, K: int, dev) -> tuple[masks.Mask | None, torch.Tensor | None]:
    """The model's mask and additive bias over a frame of K columns (positions o … o + K − 1) as masks of a
    call over every position 0 … o + K − 1: nothing before ``o`` visible. A structured mask becomes dense
    ([#B, #H, Q, o + K] bools) past the layer's window: O(Q·N) for that call (a decode step: Q = 1)."""
    if o == 0:
        return m, bias
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (o, 0))  # [.., Q, K] -> [.., Q, o + K]: forbidden there by the mask
    if m is None:
        return masks.key_span(0, o), bias
    blk = as_4d(m.block(masks.Extent(B, H, Q, K), 0, Q, 0, K, dev))  # [#B, #H, #Q, #K]
    blk = blk.expand(*blk.shape[:2], Q, K)  # [#B, #H, Q, K]
    out = blk.new_zeros(*blk.shape[:2], Q, o + K)  # [#B, #H, Q, N]
    out[..., o:] = blk
    return masks.dense(out), bias


def _refuse(func) -> BackendError:
    name = getattr(func, "__name__", str(func))
    return BackendError(
        f"keys/values of a head-wise budget cache (bhqk.budget) reached {name}: full and streaming K/V heads hold "
        f"different numbers of keys, so only bhqk's attention function can read them. Load the model with "
        f"attn_implementation=\"bhqk\" (bhqk.integrations.transformers.register()), or use an ordinary cache.")


_T = torch.Tensor
_METADATA = frozenset({
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.layout.__get__,  # type: ignore[attr-defined]
    _T.requires_grad.__get__, _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_meta.__get__,  # type: ignore[attr-defined]
    _T.size, _T.dim, _T.numel, _T.element_size, _T.is_floating_point, _T.get_device, _T.__len__, _T.__hash__,
})


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=-2)  # [B, h, n, d] + [B, h, Q, d] -> [B, h, n + Q, d]


class BudgetLayer(CacheLayerMixin):
    """One layer of a :class:`BudgetCache`: full K/V heads ``full`` keep what the model's own layer
    keeps (every position, or the ``span − 1`` last of a sliding or chunked layer whose queries see
    ``span`` keys at most), streaming heads ``stream`` of those the first ``sink`` and the last
    ``window`` (module doc); ``expect``: (Hkv, d or None) the keys written must have."""

    is_sliding = False  # per instance: True for a sliding or chunked layer (its span)
    is_croppable = True  # exactly, with activate_past_recording() (module doc)

    def __init__(self, full: list[int], stream: list[int], sink: int, window: int, index: int,
                 span: int | None = None, expect: tuple[int, int | None] | None = None, bits: int | None = None,
                 group: int | None = None, residual: int = RESIDUAL, block: int = BLOCK) -> None:
        super().__init__()
        self.bits, self.group, self.residual, self.block = bits, group, residual, block  # quantized full heads (module doc)
        self.qk: Quantized | None = None  # [B, h_full, nq, ·] the full heads' positions before fk's, in integers
        self.qv: Quantized | None = None
        self.full, self.stream, self.sink, self.window, self.index = full, stream, sink, window, index
        self.span = span
        self.is_sliding = span is not None  # transformers sizes the sliding and chunked masks by the first such layer
        self.expect = expect
        self.length = 0  # positions written
        self.record_past = False  # keep every new position until the next crop (assisted decoding)
        self.fk: torch.Tensor | None = None  # [B, h_full, n_full, d]: positions length − n_full … length − 1 (in float)
        self.fv: torch.Tensor | None = None
        self.sk: torch.Tensor | None = None  # [B, h_stream, len(held), d]: positions held
        self.sv: torch.Tensor | None = None
        self.held = torch.zeros(0, dtype=torch.long)  # int64, ascending: the positions the streaming heads hold

    def __repr__(self) -> str:
        kind = "full attention" if self.span is None else f"window {self.span}"
        return f"BudgetLayer({self.index}, {kind}: full kv {self.full}, streaming kv {self.stream}, {self.length} written)"

    def first(self, length: int) -> int:
        """The first position a query at ``length`` (or later) may see under the model's mask: the
        model's own layer's kv_offset."""
        return 0 if self.span is None else max(0, length - self.span + 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def check_keys(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A ``ShapeError`` naming both shapes unless the keys [B, Hkv, Q, d] fit the plan."""
        fits_plan(key_states, value_states, len(self.full) + len(self.stream), None if self.expect is None else self.expect[1],
                  f"budget cache layer {self.index}")
        if self.bits is not None:  # the head size, known now (a cache made without the model): before anything is stored
            self.group = check_bits(self.bits, self.group, key_states.shape[-1], f"budget cache layer {self.index}")
            if self.group is not None and value_states.shape[-1] % self.group:
                check_bits(self.bits, self.group, value_states.shape[-1], f"budget cache layer {self.index} (values)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write Q new positions (key_states [B, Hkv, Q, d], value_states [B, Hkv, Q, dv]); return what
        this call's queries may read: plain tensors if every head is full (a :class:`GroupedKV` of one
        group while observed past the layer's window: read over every position), else :class:`GroupedKV`."""
        self.check_keys(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        P, Q = self.length, key_states.shape[-2]
        o = self.first(P)  # the frame of this call: positions o … P + Q − 1
        self.length = P + Q
        if not self.stream and self.bits is None:
            keys, values = self._own_layer(key_states, value_states)  # [B, Hkv, P + Q − o, ·]
            if o == 0 or not (observe.active() or observe.editors()):
                return keys, values
            # observed past the layer's window: seen over every position, as every budget layer (_one_call)
            return self._grouped([Group(self.full, keys, values, None, False)], key_states, value_states, o)
        groups = []
        if self.full:
            fk = _cat(self.fk, take_heads(key_states, 1, self.full))  # [B, h_full, n + Q, d] (n ≥ P − o held)
            fv = _cat(self.fv, take_heads(value_states, 1, self.full))  # [B, h_full, n + Q, dv]
            K = P + Q - o
            nq = 0 if self.qk is None or self.qv is None else self.qk.n
            a = P + Q - fk.shape[-2] - nq  # the first position held: a … a + nq − 1 quantized, then fk's
            inq = max(0, a + nq - max(a, o))  # quantized positions in the frame (its first columns)
            if inq and self.qk is not None and self.qv is not None:
                groups.append(Group(self.full, fk, fv, None, False, self.qk.narrow(nq - inq, inq),
                                    self.qv.narrow(nq - inq, inq)))  # columns 0 … inq − 1 quantized, the rest fk's
            else:
                groups.append(Group(self.full, fk[..., fk.shape[-2] - K:, :], fv[..., fv.shape[-2] - K:, :], None, False))
            self.fk, self.fv = fk, fv  # [B, h_full, n + Q, ·]: narrowed (and owned) below
            if self.bits is not None and not self.record_past:  # else at the next crop, after the rejected are gone
                self._age()
        if self.stream:
            pos = torch.cat([self.held, torch.arange(P, P + Q)])  # [n + Q] ascending
            sk = _cat(self.sk, take_heads(key_states, 1, self.stream))  # [B, h_stream, n + Q, d] (a view on the prefill)
            sv = _cat(self.sv, take_heads(value_states, 1, self.stream))  # [B, h_stream, n + Q, dv]
            old = int((pos < o).sum())  # held from before the frame (past recording): not this call's
            cols = pos[old:] - o  # [K'] the frame's columns held
            whole = len(cols) == P + Q - o  # every column of the frame (cols ascending, distinct)
            groups.append(Group(self.stream, sk[..., old:, :], sv[..., old:, :],
                                None if whole else cols.to(key_states.device), True))
            self.sk, self.sv, self.held = sk, sv, pos
        if not self.record_past:
            self._evict()
        self._own()
        return self._grouped(groups, key_states, value_states, o)

    def _grouped(self, groups: list[Group], key_states: torch.Tensor, value_states: torch.Tensor,
                 o: int) -> tuple[GroupedKV, GroupedKV]:
        """The keys and values of the frame o … length − 1 as two :class:`GroupedKV` over ``groups``."""
        shape_k = (key_states.shape[0], len(self.full) + len(self.stream), self.length - o, key_states.shape[-1])
        shape_v = (*shape_k[:3], value_states.shape[-1])
        k = GroupedKV(groups, shape_k, key_states, self.sink, self.window, o, "keys")
        v = GroupedKV(groups, shape_v, value_states, self.sink, self.window, o, "values")
        k.block = v.block = self.block
        return k, v

    def _age(self) -> None:
        """Quantize the full heads' float positions older than the last ``residual`` (:func:`bhqk.budget.quant.age`;
        the float tail is owned by ``_own``)."""
        assert self.fk is not None and self.fv is not None and self.bits is not None and self.group is not None
        self.qk, self.qv, self.fk, self.fv = age(self.qk, self.qv, self.fk, self.fv, self.bits, self.group, self.residual)

    def _n_full(self) -> int:
        """Positions the full heads hold (quantized and float)."""
        return (0 if self.fk is None else self.fk.shape[-2]) + (0 if self.qk is None else self.qk.n)

    def _own_layer(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head full: the model's own layer, tensor for tensor (transformers' ``DynamicLayer``, or
        ``DynamicSlidingWindowLayer`` keeping the ``span − 1`` last positions as views of the call's keys:
        a decode step's [B, Hkv, span, ·] keeps one position more alive than it holds, as theirs does; a
        longer call's, the prefill, is copied so that the whole prompt's keys are not kept alive)."""
        keys = torch.cat([key_states[..., :0, :] if self.fk is None else self.fk, key_states], dim=-2)  # [B, Hkv, n + Q, d]
        values = torch.cat([value_states[..., :0, :] if self.fv is None else self.fv, value_states], dim=-2)  # as theirs: a copy
        self.fk, self.fv = keys, values
        if self.span is None:
            return keys, values
        if not self.record_past:
            self.fk, self.fv = keys[:, :, -self.span + 1:, :], values[:, :, -self.span + 1:, :]  # [B, Hkv, span − 1, ·]
            if keys.shape[-2] > self.span:  # a view would keep more than one dropped position alive: copy it
                self.fk, self.fv = self.fk.clone(), self.fv.clone()
            return keys, values
        seen = self.span - 1 + key_states.shape[-2]  # what get_mask_sizes announced
        return keys[:, :, -seen:, :], values[:, :, -seen:, :]  # [B, Hkv, span − 1 + Q, ·]

    def _evict(self) -> None:
        """Drop what no later query may see: full heads before ``first(length)``, streaming heads also
        the positions between the sink and the last ``window``."""
        L = self.length
        f = self.first(L)
        if self.qk is not None and self.qv is not None and self._n_full() > L - f:  # the oldest are the quantized ones
            d = min(self.qk.n, self._n_full() - (L - f))
            self.qk, self.qv = self.qk.narrow(d, self.qk.n - d), self.qv.narrow(d, self.qv.n - d)  # [B, h_full, nq − d, ·]
        n = 0 if self.fk is None else self.fk.shape[-2]
        m = n - (L - f) + (0 if self.qk is None else self.qk.n)  # float positions to drop
        if self.fk is not None and self.fv is not None and m > 0:
            self.fk, self.fv = self.fk[..., m:, :], self.fv[..., m:, :]  # [B, h_full, n − m, ·]
        if self.sk is None or self.sv is None:
            return
        p = self.held
        keep = (p >= f) & ((p < self.sink) | (p >= L - self.window))  # [n]
        if not bool(keep.all()):
            idx = keep.nonzero().flatten()  # [n'] the sink part and the recent part
            if len(idx) and int(idx[-1] - idx[0]) + 1 == len(idx):  # one run: a view
                self.sk, self.sv = self.sk[..., int(idx[0]):int(idx[-1]) + 1, :], self.sv[..., int(idx[0]):int(idx[-1]) + 1, :]
            else:
                i = idx.to(self.sk.device)
                self.sk, self.sv = self.sk.index_select(-2, i), self.sv.index_select(-2, i)  # [B, h_stream, n', ·]
            self.held = p[keep]

    def _own(self) -> None:
        """What a layer with streaming heads stores owns its storage (a view of the call's [B, Hkv, N, d]
        would keep every head's keys alive, and ``nbytes`` would not be what is held)."""
        self._each(own)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep every new position until the next :meth:`crop` (which drops what no later query may see).
        ``kwargs``: what transformers passes to every layer (5.25: ``recurrent_states_to_keep``, for
        linear-attention layers; a layer of keys and values has no recurrent state to keep)."""
        self.record_past = True

    def positions(self, kv: int) -> torch.Tensor:
        """The positions K/V head ``kv`` holds now (int64, ascending)."""
        if kv in self.full:
            n = self._n_full()
            return torch.arange(self.length - n, self.length)
        if kv not in self.stream:
            raise ShapeError(f"budget cache layer {self.index}: no K/V head {kv} (Hkv={len(self.full) + len(self.stream)}).")
        return self.held.clone()

    def nbytes(self) -> int:
        """Bytes of memory this layer's keys and values keep allocated: the storages of the float tensors it
        holds, each once (:meth:`BudgetCache.nbytes`), and the quantized positions' integers, scales and zeros."""
        floats = [t for t in (self.fk, self.fv, self.sk, self.sv) if t is not None]
        return _storage_bytes(floats) + sum(t.nbytes() for t in (self.qk, self.qv) if t is not None)

    def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """(kv_length, kv_offset) as the model's own layer reports them: the frame o … length + Q − 1."""
        o = self.first(self.length)
        return self.length + query_length - o, o

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.length

    def get_max_length(self, *args: Any, **kwargs: Any) -> int:
        return -1 if self.span is None else self.span

    def reset(self, *args: Any, **kwargs: Any) -> None:
        self.length, self.fk, self.fv, self.sk, self.sv, self.qk, self.qv = 0, None, None, None, None, None, None
        self.held = torch.zeros(0, dtype=torch.long)
        self.is_initialized = False

    def _each(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fk, self.fv, self.sk, self.sv = (None if t is None else fn(t) for t in (self.fk, self.fv, self.sk, self.sv))
        self.qk, self.qv = (None if t is None else t.map(fn) for t in (self.qk, self.qv))

    def reorder_cache(self, beam_idx: torch.LongTensor, *args: Any, **kwargs: Any) -> None:
        self._each(lambda t: t.index_select(0, beam_idx.to(t.device)))  # [B, h, n, d] rows reordered

    def batch_repeat_interleave(self, repeats: int, *args: Any, **kwargs: Any) -> None:
        self._each(lambda t: t.repeat_interleave(repeats, dim=0))  # [B, h, n, d] -> [B·r, h, n, d]

    def batch_select_indices(self, indices: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self._each(lambda t: t[indices, ...])  # [B, h, n, d] -> [b, h, n, d]

    def check_crop(self, tokens_to_remove: int) -> int:
        """The length ``crop(tokens_to_remove)`` would keep, or the ValueError it would raise (nothing changed)."""
        L = self.length
        if tokens_to_remove > 0:  # transformers < 5.24 passed the length to keep; its layers now refuse it too
            raise ValueError(f"budget cache layer {self.index}: crop takes minus the number of positions to remove "
                             f"(transformers' convention), got {tokens_to_remove}.")
        target = L + tokens_to_remove
        if not 0 <= target <= L:
            raise ValueError(f"budget cache layer {self.index}: cannot crop to {target} positions; it holds {L}.")
        if target == L:
            return target
        p = torch.arange(self.first(target), target)  # what the query at `target` may see under the model's mask
        lacking = []
        if self.full and len(p) and int(p[0]) < L - self._n_full():
            lacking.append(("full", p))
        if self.stream:
            need = p[(p < self.sink) | (p >= target - self.window)]
            if not bool(torch.isin(need, self.held).all()):
                lacking.append(("streaming", need))
        if lacking:
            kind, need = lacking[0]
            held = self.positions((self.full if kind == "full" else self.stream)[0]).tolist()
            raise ValueError(
                f"budget cache layer {self.index}: cannot crop to {target} positions: its {kind} heads (sink={self.sink}, "
                f"window={self.window}{'' if self.span is None else f', the layer window {self.span}'}) hold "
                f"{_ranges(held)}, and the next query would need {_ranges(need.tolist())}. Call "
                f"cache.activate_past_recording() before the forward to be rolled back (transformers' assisted "
                f"decoding does) so that dropping waits for the crop.")
        return target

    def crop(self, tokens_to_remove: int, *args: Any, **kwargs: Any) -> None:
        """Remove the last ``-tokens_to_remove`` positions (≤ 0, as transformers calls it), then drop what
        no later query may see. Exact, or a ValueError when the layer already dropped what the next query
        would need."""
        target = self.check_crop(tokens_to_remove)
        L = self.length
        if target < L:
            gone = L - target
            if self.fk is not None and self.fv is not None:
                keep = max(0, self.fk.shape[-2] - gone)
                gone_q = gone - (self.fk.shape[-2] - keep)  # the rest from the quantized positions (stay integers)
                self.fk, self.fv = self.fk[..., :keep, :], self.fv[..., :keep, :]  # [B, h_full, keep, ·]
                if self.qk is not None and self.qv is not None and gone_q > 0:
                    q = max(0, self.qk.n - gone_q)
                    self.qk, self.qv = self.qk.narrow(0, q), self.qv.narrow(0, q)  # [B, h_full, q, ·]
            if self.sk is not None and self.sv is not None:
                keep = int((self.held < target).sum())  # the held positions are ascending
                self.sk, self.sv, self.held = self.sk[..., :keep, :], self.sv[..., :keep, :], self.held[:keep]
            self.length = target
        if self.bits is not None and self.fk is not None:
            self._age()
        self._evict()
        if self.stream or self.bits is not None:
            self._own()

    def offload(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("a budget cache is not offloaded.")

    def prefetch(self, *args: Any, **kwargs: Any):
        pass


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage once (a view counts what it keeps alive)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(t.device, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def _ranges(ps: list[int]) -> str:
    """``0…2, 11…15`` (ascending positions as runs)."""
    if not ps:
        return "nothing"
    runs, start = [], ps[0]
    for i, a in enumerate(ps):
        if i + 1 == len(ps) or ps[i + 1] != a + 1:
            runs.append(f"{start}" if start == a else f"{start}…{a}")
            start = ps[i + 1] if i + 1 < len(ps) else a
    return ", ".join(runs)


class BudgetCache(Cache):
    """A transformers ``Cache`` for ``model.generate(..., cache=plan.cache(model))`` (``past_key_values=``
    before transformers 5.24): per layer, the plan's full K/V heads keep what the model's own cache
    keeps, the streaming heads their sink and window of it. The model must run bhqk's attention
    (``attn_implementation="bhqk"``). ``shape``: the model's :class:`~bhqk.budget.plan.ModelShape`
    (default: what the plan records; without either, every layer full attention). ``bits`` (8 or 4): the
    full heads' positions older than the last ``residual`` are stored in integers, ``group`` channels a
    scale (default 32 where it divides d, else d), and read ``block`` positions at a time
    (:mod:`bhqk.budget.quant`); None: float, as the model's own cache."""

    def __init__(self, plan: Any, shape: Any = None, bits: int | None = None, group: int | None = None,
                 residual: int = RESIDUAL, block: int = BLOCK) -> None:  # plan: a bhqk.budget.Plan (plan.py imports this module)
        shape = shape if shape is not None else plan.model
        if bits is None:
            if group is not None:
                raise ValueError(f"budget cache: group={group!r} is the quantization's group; pass bits=8 or 4 with it.")
        else:
            group = check_bits(bits, group, None if shape is None else shape.head_dim, "budget cache")
        for name, v, low in (("residual", residual, 0), ("block", block, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"budget cache: {name} must be an int >= {low} (positions), got {v!r}.")
        keeps = plan.full | plan.free(shape)  # [L, Hkv] a head within its layer's own window keeps what a full one does
        layers = []
        for li in range(plan.num_layers):
            full, stream = split_kv(keeps[li])
            span = None if shape is None else shape.windows[li]
            expect = (plan.num_kv_heads, None if shape is None else shape.head_dim)
            layers.append(BudgetLayer(full, stream, plan.sink, plan.window, li, span, expect, bits, group, residual, block))
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.plan, self.shape, self.budget_layers = plan, shape, layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ShapeError(f"budget cache: the model wrote layer {layer_idx} but the plan is {self.plan.describe()}.")
        layers = self.budget_layers
        if layer_idx == 0 and layers[0].length:  # a new forward: the last one wrote every layer of the plan?
            behind = [i for i, layer in enumerate(layers) if layer.length != layers[0].length]
            if behind:
                raise ShapeError(f"budget cache: the model's last forward wrote layers 0…{behind[0] - 1} but not "
                                 f"{behind[0]}…{len(layers) - 1}; the plan is {self.plan.describe()}: it fits a model "
                                 f"of {len(layers)} layers (plan.cache(model) checks it before any forward).")
        return layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        """Every layer cropped, or none: each layer's crop is checked first (a refused one raises
        before any layer changed)."""
        for layer in self.budget_layers:
            layer.check_crop(tokens_to_remove)
        for layer in self.budget_layers:
            layer.crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes of memory the keys and values keep allocated now, over every layer: the storages of the
        tensors held, each counted once. :meth:`Plan.nbytes <bhqk.budget.Plan.nbytes>` predicts the bytes
        of the positions held; the two are equal but on a sliding or chunked layer whose heads are all
        full, which keeps its ``window − 1`` positions as a view of the ``window`` its last decode step
        wrote (as transformers' own ``DynamicSlidingWindowLayer`` does): one position more per such
        layer (B·Hkv·(d + dv) elements). Quantized positions count their integers, scales and zeros."""
        return sum(layer.nbytes() for layer in self.budget_layers)  # no storage is shared between layers

    def positions(self, layer: int, kv: int) -> torch.Tensor:
        """The positions K/V head ``kv`` of ``layer`` holds now."""
        return self.budget_layers[layer].positions(kv)

    def __repr__(self) -> str:
        return f"BudgetCache({self.plan!r}; {self.nbytes()} bytes held)"


__all__ = ["BudgetCache", "BudgetLayer", "GroupedKV", "Group"]
