"""A transformers ``Cache`` that holds only what a :class:`~bhqk.budget.Plan` keeps.

Per layer, the full K/V heads store every key and value; the streaming K/V heads store their first
``sink`` keys and the most recent ``window`` (positions as written: rotary embeddings stay as they
were applied). ``update()`` cannot return one [B, Hkv, K, d] tensor (the groups hold different
lengths), so it returns :class:`GroupedKV`: a storage-less tensor of the shape a plain cache would
return, holding each group. bhqk's Hugging Face attention function (``attn_implementation="bhqk"``)
recognises it (``bhqk_attend``) and runs one attention call per group — full heads with the model's
mask, streaming heads with the model's mask gathered at the positions they hold, ANDed with the
streaming mask — and puts the query heads back in the model's order. Any other attention
implementation gets a ``BackendError`` on its first use of the keys, never a wrong answer.

Layout of a streaming group (n stored positions, Q new keys, P positions written before):

- P ≤ sink + window (nothing evicted yet): positions 0 … P+Q−1, so the model's mask applies as it is
  and the streaming mask is ``~key_span(0, S) | sliding_window(W, align="bottom_right")``;
- P > sink + window: positions 0 … S−1, then P−W … P+Q−1 (contiguous): the same streaming mask on
  these K' = S+W+Q columns is exactly what each query may see, and the model's mask is taken at
  those columns (a [B, 1, Q, K'] gather).

Rolling back (``crop``, assisted decoding): transformers calls ``activate_past_recording()`` first;
then the streaming heads keep every new position (the tail after the sink stays contiguous, so the
same masks apply) until the next ``crop``, which removes the rejected positions and only then evicts
down to sink + window — exact. Without past recording a ``crop`` that removes positions is exact
while the streaming heads still hold what the next query needs (nothing evicted yet), and is
otherwise refused with a ``ValueError`` saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import masks, observe
from ..errors import BackendError, ShapeError
from ..integrations.hf_attention import _mask_and_bias
from ..integrations.hf_mask import AllKeys
from ..nn.cache import own, take_heads
from .mask import streaming_mask


@dataclass
class Group:
    """K/V heads of one layer that share a layout: ``kv`` their indices in the model's order, ``keys``
    [B, h, K_g, d] and ``values`` [B, h, K_g, dv]; ``columns`` None (positions 0 … K−1 of the call)
    or int64 [K_g] (the positions held, for an evicted streaming group); ``streaming``: whether the
    streaming mask applies."""

    kv: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    columns: torch.Tensor | None
    streaming: bool


class GroupedKV(torch.Tensor):
    """The keys (or values) ``update()`` returns for a layer with streaming heads: to shape queries it
    is [B, Hkv, K, d] (K = every position written), but it holds no data of its own; ``groups`` does.
    Only bhqk's attention function reads it (``bhqk_attend``); any torch operation raises."""

    _is_param = False
    groups: list[Group]
    sink: int
    window: int
    role: str

    @staticmethod
    def __new__(cls, groups: list[Group], shape: tuple[int, ...], like: torch.Tensor, sink: int, window: int, role: str):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device, requires_grad=False)
        self.groups, self.sink, self.window, self.role = groups, sink, window, role
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
        return f"GroupedKV({self.role} {list(self.shape)}; {parts})"

    def bhqk_attend(self, attend: Callable, module, query: torch.Tensor, value: torch.Tensor, attention_mask,
                    **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` [B, H, Q, d] over each group with ``attend`` (bhqk's attention function,
        same contract) → (out [B, Q, H, dv], weights [B, H, Q, K] or None), heads in the model's order."""
        if not isinstance(value, GroupedKV) or value.groups is not self.groups:
            raise BackendError("bhqk budget cache: keys and values of different caches reached the attention function.")
        for k in ("position_bias", "indices"):
            if kw.get(k) is not None:
                raise TypeError(f"bhqk budget cache: {k!r} is not supported with a head-wise budget cache.")
        if len(self.groups) > 1 and (observe.active() or observe.editors()):
            raise ValueError("bhqk budget cache layer: capture and edit name heads by their index in the call, but a "
                             "layer with full and streaming heads runs one call per group, so those indices would be "
                             "the group's, not the model's; capture or edit the model without the budget cache: "
                             "with plan.emulate(model): ...")
        B, H, Q, _ = query.shape
        Hkv, K = self.shape[1], self.shape[2]
        G = H // Hkv  # query heads per K/V head
        want_w = bool(kw.pop("output_attentions", False))
        sinks = {n: kw.pop(n, None) for n in ("s_aux", "sinks")}
        out: torch.Tensor | None = None  # [B, Q, H, dv]: each group writes its heads
        wt: torch.Tensor | None = None  # [B, H, Q, K]
        for g in self.groups:
            qh = [kv * G + j for kv in g.kv for j in range(G)]
            qi = torch.tensor(qh, device=query.device)
            q = take_heads(query, 1, qh)  # [B, H, Q, d] -> [B, h, Q, d] (a view where the heads are a run)
            mask = self._mask(attention_mask, module, B, Q, K, g) if g.streaming else attention_mask
            extra = {n: (None if s is None else take_heads(s.reshape(H), 0, qh))  # [H] -> [h]
                     for n, s in sinks.items()}
            o, w = attend(module, q, g.keys, g.values, mask, output_attentions=want_w, **extra, **kw)  # [B, Q, h, dv]
            if out is None:
                out = o.new_empty(B, Q, H, o.shape[-1])
            out.index_copy_(2, qi.to(o.device), o)  # [B, Q, h, dv] into the model's head order
            if want_w:
                assert w is not None
                if g.columns is not None:  # [B, h, Q, K'] -> [B, h, Q, K]: the positions held
                    w = w.new_zeros(B, len(qh), Q, K).index_copy(3, g.columns.to(w.device), w)
                if wt is None:
                    wt = w.new_empty(B, H, Q, K)
                wt.index_copy_(1, qi.to(w.device), w)  # [B, h, Q, K] into the model's head order
        assert out is not None
        return out, wt

    def _mask(self, attention_mask, module, B: int, Q: int, K: int, g: Group):
        """The streaming group's mask: the model's mask (at the held positions) & the streaming mask."""
        m, bias, _ = _mask_and_bias(attention_mask, module, None, Q)
        stream = streaming_mask(self.sink, self.window)
        if g.columns is None and bias is None:  # positions 0 … K−1: structured, as the model's mask
            return stream if m is None else m & stream
        K2 = g.keys.shape[-2]
        cols = torch.arange(K) if g.columns is None else g.columns
        dev = g.keys.device
        allowed = stream.materialize(1, 1, Q, K2, dev)  # [1, 1, Q, K']
        if m is not None:
            blk = m.block(masks.Extent(B, 1, Q, K), 0, Q, 0, K, dev)  # [.., Q, K]
            while blk.dim() < 4:
                blk = blk[None]
            allowed = allowed & blk.index_select(3, cols.to(dev))  # [#B, #H, Q, K']
        if bias is not None:  # an additive mask: its values at the held positions, forbidden entries lowest
            b = bias.index_select(-1, cols.to(bias.device))  # [.., Q, K']
            return torch.where(allowed.to(b.device), b, torch.finfo(b.dtype).min)
        if bool(allowed.all()):
            return AllKeys(K2)
        return masks.dense(allowed)


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
    """One layer of a :class:`BudgetCache`: full K/V heads ``full`` keep every position, streaming
    heads ``stream`` the first ``sink`` and the last ``window`` (see the module doc for the layout)."""

    is_sliding = False
    is_croppable = True  # exactly, with activate_past_recording() (module doc)

    def __init__(self, full: list[int], stream: list[int], sink: int, window: int, index: int) -> None:
        super().__init__()
        self.full, self.stream, self.sink, self.window, self.index = full, stream, sink, window, index
        self.length = 0  # positions written
        self.tail = 0  # streaming heads hold positions 0 … S−1 and max(S, tail) … length−1
        self.record_past = False  # keep every new position until the next crop (assisted decoding)
        self.fk: torch.Tensor | None = None  # [B, h_full, length, d]
        self.fv: torch.Tensor | None = None
        self.sk: torch.Tensor | None = None  # [B, h_stream, min(length, S + W), d]
        self.sv: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"BudgetLayer({self.index}: full kv {self.full}, streaming kv {self.stream}, {self.length} written)"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write Q new positions (key_states [B, Hkv, Q, d], value_states [B, Hkv, Q, dv]); return what
        this call's queries may read: plain tensors if every head is full, else :class:`GroupedKV`."""
        Hkv = len(self.full) + len(self.stream)
        if key_states.dim() != 4 or key_states.shape[1] != Hkv or value_states.shape[1] != Hkv:
            raise ShapeError(f"budget cache layer {self.index}: the plan has Hkv={Hkv} K/V heads but the model "
                             f"wrote keys of shape {list(key_states.shape)} ([B, Hkv, Q, d]).")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        P, Q = self.length, key_states.shape[-2]
        self.length = P + Q
        if not self.stream:  # every head full: a plain growing cache
            self.fk, self.fv = _cat(self.fk, key_states), _cat(self.fv, value_states)
            return self.fk, self.fv
        groups = []
        if self.full:  # a copy of their own (a view would keep every head's keys alive)
            self.fk = own(_cat(self.fk, take_heads(key_states, 1, self.full)))  # [B, h_full, P + Q, d]
            self.fv = own(_cat(self.fv, take_heads(value_states, 1, self.full)))  # [B, h_full, P + Q, dv]
            groups.append(Group(self.full, self.fk, self.fv, None, False))
        n = 0 if self.sk is None else self.sk.shape[-2]
        kk = _cat(self.sk, take_heads(key_states, 1, self.stream))  # [B, h_stream, n + Q, d] (a view on the prefill)
        vv = _cat(self.sv, take_heads(value_states, 1, self.stream))  # [B, h_stream, n + Q, dv]
        S, W = self.sink, self.window
        cols = None
        if n < P:  # evicted before: positions 0 … S−1, then tail … P + Q − 1 (tail = P − W unless recording)
            cols = torch.cat([torch.arange(S), torch.arange(self.tail, P + Q)]).to(key_states.device)  # [n + Q]
        groups.append(Group(self.stream, kk, vv, cols, True))
        self.sk, self.sv = kk, vv
        if not self.record_past:
            self._evict()
        self.sk, self.sv = own(self.sk), own(self.sv)  # the prefill's view of every head: copied unless evicted
        shape_k = (key_states.shape[0], Hkv, P + Q, key_states.shape[-1])
        shape_v = (value_states.shape[0], Hkv, P + Q, value_states.shape[-1])
        return (GroupedKV(groups, shape_k, key_states, S, W, "keys"),
                GroupedKV(groups, shape_v, value_states, S, W, "values"))

    def _evict(self) -> None:
        """Keep the streaming heads' first S and last W positions."""
        S, W = self.sink, self.window
        if self.sk is None or self.sv is None or self.sk.shape[-2] <= S + W:
            return
        end = self.sk.shape[-2]
        self.sk = torch.cat([self.sk[..., :S, :], self.sk[..., end - W:, :]], dim=-2)  # [B, h_stream, S + W, d]
        self.sv = torch.cat([self.sv[..., :S, :], self.sv[..., end - W:, :]], dim=-2)  # [B, h_stream, S + W, dv]
        self.tail = self.length - W

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep every new position of the streaming heads until the next :meth:`crop` (which evicts).
        ``kwargs``: what transformers passes to every layer (5.25: ``recurrent_states_to_keep``, for
        linear-attention layers; a layer of keys and values has no recurrent state to keep)."""
        self.record_past = True

    def positions(self, kv: int) -> torch.Tensor:
        """The positions K/V head ``kv`` holds now (int64, ascending)."""
        if kv in self.full:
            return torch.arange(self.length)
        if kv not in self.stream:
            raise ShapeError(f"budget cache layer {self.index}: no K/V head {kv} (Hkv={len(self.full) + len(self.stream)}).")
        S, L = self.sink, self.length
        return torch.cat([torch.arange(min(S, L)), torch.arange(min(max(S, self.tail), L), L)])  # a stream < S: 0 … L−1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fk, self.fv, self.sk, self.sv) if t is not None)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # the model's mask spans every position; streaming heads gather theirs

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length, self.tail, self.fk, self.fv, self.sk, self.sv = 0, 0, None, None, None, None
        self.is_initialized = False

    def _each(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fk, self.fv, self.sk, self.sv = (None if t is None else fn(t) for t in (self.fk, self.fv, self.sk, self.sv))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each(lambda t: t.index_select(0, beam_idx.to(t.device)))  # [B, h, n, d] rows reordered

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each(lambda t: t.repeat_interleave(repeats, dim=0))  # [B, h, n, d] -> [B·r, h, n, d]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each(lambda t: t[indices, ...])  # [B, h, n, d] -> [b, h, n, d]

    def check_crop(self, tokens_to_remove: int) -> int:
        """The length ``crop(tokens_to_remove)`` would keep, or the ValueError it would raise (nothing changed)."""
        L, S, W = self.length, self.sink, self.window
        target = L + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        if not 0 <= target <= L:
            raise ValueError(f"budget cache layer {self.index}: cannot crop to {target} positions; it holds {L}.")
        if target < L and self.stream:
            first = max(S, self.tail)  # the first tail position held
            need = max(S, target - W)  # the first tail position the query at `target` sees
            if target > S and need < first:
                raise ValueError(
                    f"budget cache layer {self.index}: cannot crop to {target} positions: its streaming heads (sink={S}, "
                    f"window={W}) keep positions {first}…{L - 1} after the sink, and the next query would need {need}…"
                    f"{target - 1}. Call cache.activate_past_recording() before the forward to be rolled back "
                    f"(transformers' assisted decoding does) so that eviction waits for the crop.")
        return target

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers ≥ 5.24; a positive value is the
        length to keep, as older versions call it), then evict down to sink + window. Exact, or a
        ValueError when the streaming heads already evicted what the next query would need."""
        target = self.check_crop(tokens_to_remove)
        L = self.length
        if target < L:
            self._each_full(lambda t: t[..., :target, :])  # [B, h_full, L, d] -> [B, h_full, target, d]
            if self.sk is not None and self.sv is not None:
                keep = int((self.positions(self.stream[0]) < target).sum())  # the held positions are ascending
                self.sk, self.sv = self.sk[..., :keep, :], self.sv[..., :keep, :]  # [B, h_stream, keep, d]
            self.length = target
            self.tail = min(self.tail, target)
        self._evict()

    def _each_full(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fk, self.fv = (None if t is None else fn(t) for t in (self.fk, self.fv))

    def offload(self):
        raise NotImplementedError("a budget cache is not offloaded.")

    def prefetch(self):
        pass


class BudgetCache(Cache):
    """A transformers ``Cache`` for ``model.generate(..., cache=plan.cache())`` (``past_key_values=``
    before transformers 5.24): per layer, the plan's full K/V heads keep every key and value, streaming
    heads their sink and window. The model must run bhqk's attention (``attn_implementation="bhqk"``)."""

    def __init__(self, plan: Any) -> None:  # a bhqk.budget.Plan (not imported: plan.py imports this module)
        layers = []
        for li in range(plan.num_layers):
            full = [g for g in range(plan.num_kv_heads) if bool(plan.full[li, g])]
            stream = [g for g in range(plan.num_kv_heads) if not bool(plan.full[li, g])]
            layers.append(BudgetLayer(full, stream, plan.sink, plan.window, li))
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.plan, self.budget_layers = plan, layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ShapeError(f"budget cache: the model wrote layer {layer_idx} but the plan has layers="
                             f"{len(self.layers)} (× Hkv={self.plan.num_kv_heads} K/V heads).")
        return self.budget_layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def crop(self, max_length: int) -> None:
        """Every layer cropped, or none: each layer's crop is checked first (a refused one raises
        before any layer changed)."""
        for layer in self.budget_layers:
            layer.check_crop(max_length)
        for layer in self.budget_layers:
            layer.crop(max_length)

    def nbytes(self) -> int:
        """Bytes of keys and values held now, over every layer."""
        return sum(layer.nbytes() for layer in self.budget_layers)

    def positions(self, layer: int, kv: int) -> torch.Tensor:
        """The positions K/V head ``kv`` of ``layer`` holds now."""
        return self.budget_layers[layer].positions(kv)

    def __repr__(self) -> str:
        return f"BudgetCache({self.plan!r}; {self.nbytes()} bytes held)"


__all__ = ["BudgetCache", "BudgetLayer", "GroupedKV", "Group"]
