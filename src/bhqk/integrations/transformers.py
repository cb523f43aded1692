"""Hugging Face transformers on bhqk: ``attn_implementation="bhqk"`` for any model that calls
attention through transformers' ``AttentionInterface``.

    from bhqk.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="bhqk")
    model.set_attn_implementation("bhqk:tiled")  # or pick a backend later

``register()`` adds, under each name, two things — both are needed:

- an **attention function** (``AttentionInterface``): q [B, H, Q, d], k [B, Hkv, K, d],
  v [B, Hkv, K, dv] in (GQA without repeating K/V), ``(out [B, Q, H, dv], weights [B, H, Q, K] or
  None)`` out;
- a **mask builder** (``masking_utils.AttentionMaskInterface``). Without one, transformers hands a
  custom attention function ``attention_mask=None`` and padding is silently dropped.

The mask builder returns an :class:`HFMask`: to bhqk's attention function it is a bhqk mask
(``.structure``); to any other code (model code, hooks, user code) it is the tensor transformers'
own ``eager_mask`` builds for the same call, float [B, 1, Q, K] with 0 = attend and
``finfo(dtype).min`` = masked, made on first use. The structure is known where transformers' pattern
is: ``causal`` (aligned from the cache offsets), ``sliding_window``, chunks and packed sequences as
``document``, ``key_padding`` from the 2-D ``attention_mask``, and their ``&``. Transformers
describes the pattern by a ``mask_function`` closure; bhqk does not read closures. It evaluates the
function (its public contract: indices in, bool out) and keeps a structured mask only if it equals
the evaluation on every entry; otherwise the structure is the dense mask transformers' own
``sdpa_mask`` builds. The one exception is transformers' plain ``causal_mask_function`` /
``bidirectional_mask_function``, recognised by identity.

The attention function uses the structure of an :class:`HFMask` it receives unchanged; a mask the
model changed (Doge adds its dynamic mask, DeepSeek V3.2's indexer masks keys) arrives as a plain
tensor and is used as one (bool: True = attend; float: additive). Every keyword argument
transformers passes is either honoured or refused with a ``TypeError`` naming it.

Names: ``"bhqk"`` (backend ``auto``) and ``"bhqk:<backend>"`` for every backend in bhqk's registry
(:func:`bhqk.functional.names`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import observe
from ..errors import LoadError, MaskError
from ..functional import attention, attention_weights
from ..functional import names as backend_names
from ..masks import KeysBelow, Mask, causal, dense, document, from_hf, key_padding, predicate, sliding_window
from ..masks import sliding_window as sliding_window_mask
from ..models.loading import read_config

ROW_BLOCK_ENTRIES = 1 << 22  # entries of transformers' mask evaluated at once while checking a structure


def _backends() -> list[str]:
    """bhqk's registered backends, ``auto`` first (read from the registry at each call)."""
    return ["auto", *(b for b in backend_names() if b != "auto")]


def names(name: str = "bhqk") -> list[str]:
    """The implementation names ``register(name)`` adds: ``name`` (auto) and ``name:<backend>`` for
    every backend registered now."""
    return [name if b == "auto" else f"{name}:{b}" for b in _backends()]


# ---- the mask as a tensor -----------------------------------------------------------------------


class HFMask(torch.Tensor):
    """A bhqk mask inside a Hugging Face model. bhqk's attention function reads ``structure``; to
    everything else it is a tensor: the one transformers' ``eager_mask`` returns for the same call,
    float [B, 1, Q, K] (0 = attend, ``finfo(dtype).min`` = masked; eager is the implementation every
    model's code supports), built on first use and kept.

    A wrapper subclass without storage: ``shape``, ``dtype``, ``device`` and ``ndim`` answer without
    building; any torch op on it (indexing, ``!=``, ``masked_fill``, ``torch.cat`` …) builds the
    tensor and runs on it (``__torch_function__``, above autograd), and its result is a plain tensor
    (``detach`` gives an HFMask again). So a mask the model changed reaches the attention function as
    a plain tensor. An in-place op on the mask, or on a view of its tensor, bumps the tensor's
    version: the attention function then uses the tensor, not the stale structure."""

    _is_param = False  # torch.Tensor only annotates it (nn.Parameter's isinstance reads it): a value, so pdoc can place it

    structure: Mask
    _build: Callable[[], torch.Tensor]
    _tensor: torch.Tensor | None
    _built_version: int

    @staticmethod
    def __new__(cls, structure: Mask, shape: tuple[int, ...], dtype: torch.dtype, device, build: Callable[[], torch.Tensor]):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device(device),
                                                   requires_grad=False)
        self.structure, self._build, self._tensor, self._built_version = structure, build, None, 0
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:  # shape, dtype, device …: the wrapper answers, nothing is built
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.detach and not args[0].modified:
            return args[0].__deepcopy__({})  # detach() (checkpointing, hooks) keeps the mask a mask
        # every other op runs on the built tensor, above autograd: a view of it shares its version
        # counter, an in-place op bumps it, and the result is a plain tensor
        return func(*_unwrap(args), **_unwrap(kwargs))

    def tensor(self) -> torch.Tensor:
        """The tensor transformers would have passed (built once): float [B, 1, Q, K]."""
        if self._tensor is None:
            with torch.inference_mode(False):  # a normal tensor: its version counter tells in-place changes
                t = self._build()  # [B, 1, Q, K]
            if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
                raise MaskError(f"HFMask: built a {t.dtype} tensor of shape {list(t.shape)} for a mask declared "
                                f"{self.dtype} {list(self.shape)}.")
            self._tensor, self._built_version = t, t._version
        return self._tensor

    @property
    def modified(self) -> bool:
        """Whether the tensor was changed in place since it was built (the structure is stale then)."""
        return self._tensor is not None and self._tensor._version != self._built_version

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # ops that did not pass __torch_function__
        return func(*_unwrap(args), **_unwrap(kwargs or {}))

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]  # noqa: ARG002
        B, _, Q, K = self.shape
        return f"HFMask({self.structure!r}, [B={B}, 1, Q={Q}, K={K}], {self.dtype})"

    def __reduce_ex__(self, proto):
        return self.tensor().__reduce_ex__(proto)  # a pickle holds the plain tensor

    def __deepcopy__(self, memo):
        if self.modified:  # the tensor is the mask now
            return self.tensor().clone()
        return HFMask(self.structure, tuple(self.shape), self.dtype, self.device, self._build)

    def numpy(self, *, force: bool = False):
        return self.tensor().numpy(force=force)


def _unwrap(tree):
    """``tree`` with every HFMask replaced by its built tensor."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.tensor() if isinstance(x, HFMask) else x, tree)


_T = torch.Tensor
_METADATA = frozenset({  # answered by the wrapper itself, without building the tensor
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.layout.__get__,  # type: ignore[attr-defined]
    _T.requires_grad.__get__, _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_meta.__get__,  # type: ignore[attr-defined]
    _T.is_quantized.__get__, _T.size, _T.dim, _T.numel, _T.nelement,  # type: ignore[attr-defined]
    _T.element_size, _T.is_floating_point, _T.is_complex, _T.get_device, _T.__len__, _T.__hash__, _T.requires_grad_,
})


# ---- mask builder -------------------------------------------------------------------------------


class AllKeys(KeysBelow):
    """Every key visible (bidirectional attention without padding). Unlike ``None``, it tells the
    attention function that the builder ran and found nothing to mask: no ``is_causal`` fallback."""

    def __init__(self, K: int) -> None:
        super().__init__(K, "all_keys")

    def __repr__(self) -> str:
        return "all_keys()"


def _align(c: int, Q: int, K: int) -> str | None:
    """bhqk's name for "query i sits at key position i + c", or None where neither alignment is it."""
    if c == K - Q:
        return "bottom_right"
    if c == 0:
        return "top_left"
    return None


def _band(c: int, Q: int, K: int, left: int | None, right: int) -> Mask:
    """Key j visible from query i when ``i + c - left <= j <= i + c + right`` (``left=None``: no
    lower bound, i.e. causal for ``right=0``)."""
    align = _align(c, Q, K)
    if align is not None:
        return causal(align) if left is None and right == 0 else sliding_window(Q + K if left is None else left, right, align)

    def band(b, h, qi, ki):  # pure: the tiled backend calls it from its worker threads
        pos = qi + c  # query position in key coordinates
        ok = ki <= pos + right
        return ok if left is None else ok & (ki >= pos - left)

    return predicate(band, f"band(offset={c}, left={left}, right={right})")


def _evaluate(mask_function: Callable, B: int, q0: int, q1: int, K: int, q_offset: int, kv_offset: int,
              use_vmap: bool, device, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Transformers' mask function on rows q0:q1 (and the padding of ``attention_mask``, if given): bool [B, 1, q, K]."""
    from transformers.masking_utils import sdpa_mask

    full = sdpa_mask(batch_size=B, q_length=q1 - q0, kv_length=K, q_offset=q_offset + q0, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)  # [B, 1, q, K]
    assert full is not None  # sdpa_mask returns None only when a skip is allowed
    return full


def _blocks(B: int, Q: int, K: int):
    step = max(1, ROW_BLOCK_ENTRIES // max(1, B * K))
    return [(q0, min(Q, q0 + step)) for q0 in range(0, Q, step)]


def _matches(cands: list[Mask], evaluate, B: int, Q: int, K: int, first: torch.Tensor | None = None) -> Mask | None:
    """The first candidate equal to the evaluated mask on every entry (None if none is). ``first``
    [B, Q], if given, receives each row's first visible key (-1 for none)."""
    from ..masks import Extent

    ext = Extent(B, 1, Q, K)
    alive = list(cands)
    for q0, q1 in _blocks(B, Q, K):
        if not alive and first is None:
            return None
        ev = evaluate(q0, q1)  # [B, 1, q, K]
        if first is not None:
            first[:, q0:q1] = torch.where(ev.any(-1), ev.to(torch.uint8).argmax(-1), -1)[:, 0]  # [B, q]
        alive = [m for m in alive if bool((m.block(ext, q0, q1, 0, K, ev.device) == ev).all())]
    return alive[0] if alive else None


def _padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> Mask | None:
    """``key_padding`` from the 2-D attention_mask [B, ≥ kv_offset + K] (1 = real token), or None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise MaskError(f"bhqk mask builder: attention_mask must be [B, K], got shape {list(attention_mask.shape)}.")
    from transformers.masking_utils import prepare_padding_mask

    padded = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # [B, ≥ kv_offset + K]
    assert padded is not None  # None only for attention_mask None
    valid = padded[:, kv_offset:kv_offset + kv_length]  # [B, K]
    return None if bool(valid.all()) else key_padding(valid)


def build_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    config=None,
    dtype: torch.dtype = torch.float32,
    **kwargs,
) -> HFMask:
    """transformers' mask-interface call → an :class:`HFMask` for [B, H, Q=q_length, K=kv_length].

    Query i sits at position ``q_offset + i``, key j at ``kv_offset + j`` (a KV cache gives offsets).
    ``attention_mask`` [B, ≥ kv_offset + K] marks real tokens (1) and padding (0). ``dtype`` (the
    model's, which transformers passes) is the dtype of the mask's tensor."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, eager_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    B, Q, K = int(batch_size), int(q_length), int(kv_length)
    if isinstance(attention_mask, HFMask):  # built before and handed back (transformers itself returns 4-D masks as is)
        if tuple(attention_mask.shape) != (B, 1, Q, K):
            raise MaskError(f"bhqk mask builder: got a prepared mask for {list(attention_mask.shape)} "
                            f"but this call is [B={B}, 1, Q={Q}, K={K}].")
        return attention_mask
    attention_mask = None if attention_mask is None else attention_mask.bool()  # [B, ≥ kv_offset + K]
    hf_args: dict[str, Any] = dict(batch_size=B, q_length=Q, kv_length=K, q_offset=q_offset, kv_offset=kv_offset,
                   mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap, device=device)
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a StaticCache gives q_offset as a tensor
    c = q_offset - kv_offset  # query i sits at key index i + c
    pad = _padding(attention_mask, K, kv_offset)

    if mask_function is causal_mask_function:
        structure: Mask | None = _band(c, Q, K, None, 0)
    elif mask_function is bidirectional_mask_function:
        structure = AllKeys(K)
    else:
        structure = _structure(mask_function, B, Q, K, q_offset, kv_offset, c, attention_mask, local_size,
                               config, use_vmap, device)
    if structure is None:  # unknown structure: the dense mask transformers' sdpa builder makes
        full = _evaluate(mask_function, B, 0, Q, K, q_offset, kv_offset, use_vmap, device, attention_mask)  # [B, 1, Q, K]
        out: Mask = dense(full.bool())
    elif isinstance(structure, AllKeys):
        out = AllKeys(K) if pad is None else pad
    else:
        out = structure if pad is None else structure & pad

    def build() -> torch.Tensor:  # transformers' own eager mask for this call: float [B, 1, Q, K]
        return eager_mask(**hf_args, dtype=dtype)

    return HFMask(out, (B, 1, Q, K), dtype, device, build)


def _structure(mask_function, B, Q, K, q_offset, kv_offset, c, attention_mask, local_size, config, use_vmap, device):
    """A structured mask equal to ``mask_function`` on every entry, or None."""
    def evaluate(q0, q1):
        return _evaluate(mask_function, B, q0, q1, K, q_offset, kv_offset, use_vmap, device)

    def ints(*xs):
        return sorted({int(x) for x in xs if isinstance(x, int) and x > 0})

    # transformers passes local_size = the window or the chunk size; the config says which it has
    chunk = getattr(config, "attention_chunk_size", None)
    window_sizes = ints(local_size if config is None or chunk is None else None, getattr(config, "sliding_window", None))
    chunk_sizes = ints(chunk, local_size if config is None else None)
    windows = []
    for W in window_sizes:
        windows.append(_band(c, Q, K, W - 1, 0))  # causal window: the W keys ending at the query's own
        windows.append(_band(c, Q, K, W, W))  # bidirectional window: |i - j| <= W
    cands = [_band(c, Q, K, None, 0), AllKeys(K), *windows]
    if chunk_sizes:  # chunked attention: chunks of C positions counted after the left padding
        lp = torch.zeros(B, dtype=torch.long)
        if attention_mask is not None:
            lp = (attention_mask.long().cumsum(-1) == 0).sum(-1).cpu()  # [B] left-padding tokens
        for C in chunk_sizes:
            q_ids = torch.div(torch.arange(Q) + q_offset - lp[:, None], C, rounding_mode="floor")  # [B, Q]
            k_ids = torch.div(torch.arange(K) + kv_offset - lp[:, None], C, rounding_mode="floor")  # [B, K]
            cands.append(_band(c, Q, K, None, 0) & document(q_ids, k_ids))
    found = _matches(cands, evaluate, B, Q, K)
    if found is not None or not (Q == K and c == 0):  # packed sequences only come without a cache
        return found
    # packed sequences: a document starts at each row whose first visible key is itself
    first = torch.full((B, Q), -1, dtype=torch.long)
    _matches([], evaluate, B, Q, K, first)
    starts = first == torch.arange(Q)  # [B, Q]
    starts[:, 0] = True
    ids = starts.long().cumsum(-1) - 1  # [B, Q] document index of each position
    docs = document(ids)
    return _matches([_band(0, Q, K, None, 0) & docs, *(w & docs for w in windows)], evaluate, B, Q, K)


# ---- attention function -------------------------------------------------------------------------


# keyword arguments transformers passes that cannot change the attention's result: flags for other
# outputs, and inputs the module already turned into q, k, v (a cache, positions, encoder states)
IGNORED = frozenset({"num_items_in_batch", "output_hidden_states", "output_router_logits", "use_cache", "return_dict",
                     "deterministic", "seq_idx", "max_length_q", "max_length_k", "cache", "past_key_values",
                     "past_key_value", "cache_position", "layer_idx", "position_embeddings", "encoder_hidden_states",
                     "encoder_attention_mask", "token_type_ids"})  # token types: read by a mask builder (Gemma 3), if any


def _mask_and_bias(attention_mask, module, is_causal: bool | None, Q: int):
    """What transformers passed as attention_mask → (bhqk mask or None, additive float [.., Q, K] or
    None, whether a builder made it)."""
    if isinstance(attention_mask, HFMask):
        if not attention_mask.modified:
            s = attention_mask.structure
            return (None if isinstance(s, AllKeys) else s), None, True
        attention_mask = attention_mask.tensor()  # changed in place: the structure is stale
    if isinstance(attention_mask, AllKeys):
        return None, None, True
    if isinstance(attention_mask, Mask):
        return attention_mask, None, True
    if attention_mask is None:  # no builder ran: as SDPA, is_causal (default module.is_causal, else True)
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        return (causal("top_left") if is_causal and Q > 1 else None), None, False
    if not isinstance(attention_mask, torch.Tensor):
        raise MaskError(f"attention_mask must be a bhqk mask, a tensor or None, got {type(attention_mask).__name__}.")
    if attention_mask.dim() == 2:  # [B, K]: 1 = real token, 0 = padding, any dtype
        return from_hf(attention_mask), None, True
    if attention_mask.dtype == torch.bool:
        return dense(attention_mask), None, True
    if attention_mask.is_floating_point():  # an additive 4-D mask: 0 to attend, very negative to mask
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2  # [#B, #H, Q, K]
        rest = torch.where(allowed, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
        return dense(allowed), (rest if bool(rest.any()) else None), True
    raise MaskError(f"attention_mask has dtype {attention_mask.dtype}; expected bool (True = attend) or float (additive).")


def _selected(indices: torch.Tensor, B: int, Q: int, K: int) -> Mask:
    """A sparse-attention indexer's choice (DeepSeek V3.2's ``indices``: [B, Q, topk] or [B, H, Q, topk]
    key indices per query, −1 = none) as a mask: bool [B, 1 or H, Q, K]."""
    if indices.dim() == 3:
        indices = indices[:, None]  # [B, Q, topk] -> [B, 1, Q, topk]
    if indices.dim() != 4 or indices.shape[0] != B or indices.shape[2] != Q:
        raise MaskError(f"indices must be [B={B}, Q={Q}, topk] or [B, H, Q, topk] key indices, got {list(indices.shape)}.")
    idx = indices.long()
    if bool(((idx < -1) | (idx >= K)).any()):
        raise MaskError(f"indices must lie in [0, K={K}) (or be -1 for none), got {int(idx.min())} .. {int(idx.max())}.")
    idx = torch.where(idx < 0, K, idx)  # -1 → the spare column K, dropped below
    sel = torch.zeros(*idx.shape[:3], K + 1, dtype=torch.bool, device=idx.device)  # [B, h, Q, K + 1]
    sel.scatter_(-1, idx, True)
    return dense(sel[..., :K])  # [B, h, Q, K]


def _unbuilt(mask: Mask | None, Q: int, K: int, is_causal: bool, sliding_window, position_ids, cu_q, cu_k) -> Mask | None:
    """No mask builder ran: the window and packed sequences transformers passes as keyword arguments.
    The window is aligned as the causal mask is (top-left for Q > 1, as SDPA's is_causal), bottom-right
    for one query (decoding); ``left = W − 1`` keys back and, without causality, ``W − 1`` ahead
    (transformers' flash-attention convention)."""
    if sliding_window is not None:
        W = int(sliding_window)
        if W < 1:
            raise MaskError(f"sliding_window must be a positive number of keys, got {sliding_window}.")
        win = sliding_window_mask(W - 1, 0 if is_causal else W - 1, "top_left" if Q > 1 else "bottom_right")
        mask = win if mask is None else mask & win
    ids = None
    if cu_q is not None or cu_k is not None:  # varlen packing (DataCollatorWithFlattening): one row of documents
        if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k) or Q != K:
            raise MaskError("cu_seq_lens_q and cu_seq_lens_k must be equal (self-attention over packed documents) "
                            "when no mask builder ran.")
        ids = torch.searchsorted(cu_k[1:].long(), torch.arange(K, device=cu_k.device), right=True)[None]  # [1, K]
    elif position_ids is not None and Q == K:
        from transformers.masking_utils import find_packed_sequence_indices

        ids = find_packed_sequence_indices(position_ids.reshape(-1, Q))  # [#B, Q] document index, None if one document
    if ids is not None:
        mask = document(ids) if mask is None else mask & document(ids)
    return mask


def _sinks(s_aux, sinks, H: int):
    """GPT-OSS's ``s_aux`` or another model's ``sinks``: one logit per head, [H] (or broadcastable)."""
    if s_aux is not None and sinks is not None:
        raise TypeError("bhqk attention: got both s_aux and sinks; pass one.")
    s, name = (s_aux, "s_aux") if s_aux is not None else (sinks, "sinks")
    if s is None:
        return None
    if s.numel() != H:  # [H], or [1, H, 1, 1] (one query of one sequence: the same thing)
        raise MaskError(f"{name} must hold one logit per head, [H={H}]; got shape {list(s.shape)} "
                        f"(per-query sinks are not supported by bhqk).")
    return s.reshape(H)  # [H] | [1, H, 1, 1] -> [H]


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    indices: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    output_attentions: bool = False,
    *,
    backend: str = "auto",
    **kwargs,
):
    """transformers' attention-function contract on bhqk: query [B, H, Q, d], key [B, Hkv, K, d],
    value [B, Hkv, K, dv] → (out [B, Q, H, dv], weights [B, H, Q, K] with output_attentions, else None).

    ``position_bias`` (T5) is bhqk's ``bias=``; ``softcap`` (Gemma 2) caps the scores; ``s_aux``
    (GPT-OSS) or ``sinks`` [H] is bhqk's ``sinks=``, per-head logits in each row's denominator;
    ``indices`` (a sparse-attention indexer's keys per query) is ANDed into the mask; dropout only in
    training. Where no mask builder ran (``attention_mask=None``), ``is_causal``, ``sliding_window``
    and packed sequences (``position_ids`` restarting, or ``cu_seq_lens_q/k``) make the mask; a
    builder's mask already holds them (transformers' eager and sdpa read them from the mask too).
    Keyword arguments that cannot change the result (``use_cache``, a cache, encoder states the module
    already projected, any argument set to None) are ignored; any other raises a ``TypeError`` naming
    it. Each call runs in ``observe.scope(module)``, so ``bhqk.capture(model=...)`` names it by the
    module's path."""
    attend = getattr(key, "bhqk_attend", None)  # keys a head-wise budget cache holds per group of heads (bhqk.budget)
    if attend is not None:
        return attend(attention_forward, module, query, value, attention_mask, dropout=dropout, scaling=scaling,
                      is_causal=is_causal, softcap=softcap, position_bias=position_bias, s_aux=s_aux, sinks=sinks,
                      sliding_window=sliding_window, indices=indices, position_ids=position_ids,
                      cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, output_attentions=output_attentions,
                      backend=backend, **kwargs)
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED and v is not None) if kwargs.keys() - IGNORED else ()
    if unknown:  # an argument set to None asks for nothing
        raise TypeError(f"bhqk attention ({type(module).__name__}): keyword argument(s) {', '.join(map(repr, unknown))} "
                        f"not handled; bhqk would compute something else than the model asks for. Handled: dropout, "
                        f"scaling, is_causal, softcap, position_bias, s_aux, sinks, sliding_window, indices, "
                        f"position_ids, cu_seq_lens_q/k, output_attentions.")
    B, H, Q, K = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    mask, extra, built = _mask_and_bias(attention_mask, module, is_causal, Q)
    if not built:
        causal_here = getattr(module, "is_causal", True) if is_causal is None else is_causal
        mask = _unbuilt(mask, Q, K, bool(causal_here), sliding_window, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    if indices is not None:
        sel = _selected(indices, B, Q, K)
        mask = sel if mask is None else mask & sel
    bias = position_bias
    if extra is not None:
        bias = extra if bias is None else bias + extra
    sink = _sinks(s_aux, sinks, H)
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    if observe.quiet():  # nobody to name the module to (the scope would do nothing): no context manager per call
        out = attention(query, key, value, mask, bias=bias, scale=scaling, softcap=softcap, sinks=sink,
                        dropout_p=dropout_p, backend=backend)  # [B, H, Q, dv]
    else:
        with observe.scope(module):  # capture and trace name the call by this module's path
            out = attention(query, key, value, mask, bias=bias, scale=scaling, softcap=softcap, sinks=sink,
                            dropout_p=dropout_p, backend=backend)  # [B, H, Q, dv]
    weights = None
    if output_attentions:
        weights = attention_weights(query, key, mask, bias=bias, scale=scaling, softcap=softcap, sinks=sink)  # [B, H, Q, K]
    return out.transpose(1, 2).contiguous(), weights  # [B, H, Q, dv] -> [B, Q, H, dv]


def _attention_for(backend: str) -> Callable:
    def bhqk_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    bhqk_attention.__name__ = f"bhqk_attention_{backend}"
    bhqk_attention.__doc__ = f"{attention_forward.__doc__}\n\n    Backend: {backend!r}."
    return bhqk_attention


def register(name: str = "bhqk") -> list[str]:
    """Add bhqk to transformers under ``name`` (backend ``auto``) and ``name:<backend>`` for each backend
    in bhqk's registry: an attention function and a mask builder under each.
    Returns the names. Afterwards ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` work."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    out = names(name)
    for n, backend in zip(out, _backends()):
        AttentionInterface.register(n, _attention_for(backend))
        AttentionMaskInterface.register(n, build_mask)
    return out


# ---- local model folders (for the command line) ---------------------------------------------------


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")


@dataclass
class Loaded:
    """A Hugging Face model from a local folder on bhqk: ``decoder`` models are causal LMs."""

    model: torch.nn.Module
    tokenizer: Any | None  # a transformers tokenizer (PreTrainedTokenizerBase)
    decoder: bool
    folder: Path


def is_decoder_config(config: dict) -> bool:
    """A causal language model by its config.json (architectures or is_decoder)."""
    archs = config.get("architectures") or []
    return bool(config.get("is_decoder")) or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def load_folder(folder: str | Path, name: str = "bhqk", dtype: torch.dtype = torch.float32) -> Loaded:
    """Model and tokenizer from a local folder, offline, with ``attn_implementation=name``
    (registered first). Decoders load as ``AutoModelForCausalLM``, others as ``AutoModel``."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    decoder = is_decoder_config(read_config(folder))
    register(name.split(":")[0])
    cls = AutoModelForCausalLM if decoder else AutoModel
    model = cls.from_pretrained(folder, attn_implementation=name, local_files_only=True, dtype=dtype).eval()
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):  # else AutoTokenizer may make an empty one
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Loaded(model, tokenizer, decoder, folder)


def encode(loaded: Loaded, text: str) -> tuple[dict, list[str]]:
    """The model inputs for ``text`` (input_ids and attention_mask [1, N]) and its N tokens."""
    if loaded.tokenizer is None:
        raise LoadError(f"{loaded.folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass token ids instead.")
    enc = loaded.tokenizer(text, return_tensors="pt")
    inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    return inputs, loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())


__all__ = ["register", "names", "build_mask", "attention_forward", "AllKeys", "HFMask", "load_folder", "Loaded", "encode",
           "is_decoder_config"]
