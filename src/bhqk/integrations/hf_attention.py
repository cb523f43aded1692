"""The attention function transformers calls for ``attn_implementation="bhqk"`` (and
``"bhqk:<backend>"``), and :func:`register`. See :mod:`bhqk.integrations.transformers`."""

from __future__ import annotations

import functools

import torch

from .. import observe
from ..errors import BackendError, MaskError
from ..functional import attention, attention_weights
from ..functional import names as backend_names
from ..masks import Mask, causal, dense, document, from_hf
from ..masks import sliding_window as sliding_window_mask
from .hf_mask import AllKeys, HFMask, build_mask


def _backends() -> list[str]:
    """bhqk's registered backends, ``auto`` first (read from the registry at each call)."""
    return ["auto", *(b for b in backend_names() if b != "auto")]


def parse_implementation(name: object) -> str | None:
    """bhqk's backend that a transformers ``attn_implementation`` names: ``"bhqk"`` → ``"auto"``,
    ``"bhqk:tiled"`` → ``"tiled"``; None for any other implementation (``"eager"``, ``"sdpa"``, …).
    The one reader of the ``"bhqk:<backend>"`` string; :func:`implementation` writes it."""
    if not isinstance(name, str):
        return None
    head, colon, backend = name.partition(":")
    if head != "bhqk":
        return None
    return backend if colon else "auto"


def implementation(backend: str = "auto") -> str:
    """transformers' ``attn_implementation`` for bhqk's ``backend``: ``"bhqk"`` for ``auto``, else
    ``"bhqk:<backend>"`` (the inverse of :func:`parse_implementation`)."""
    return "bhqk" if backend == "auto" else f"bhqk:{backend}"


def names(name: str = "bhqk") -> list[str]:
    """The implementation names ``register(name)`` adds: ``name`` (auto) and ``name:<backend>`` for
    every backend registered now."""
    return [name if b == "auto" else f"{name}:{b}" for b in _backends()]


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


def model_mask(attention_mask, module, Q: int, K: int, is_causal: bool | None = None, sliding_window=None,
               position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None):
    """The call's mask and additive bias as :func:`attention_forward` reads what transformers passed:
    (bhqk mask or None, float [.., Q, K] or None); where no mask builder ran, from ``is_causal``,
    ``sliding_window`` and packed sequences."""
    if type(attention_mask) is HFMask and attention_mask._tensor is None:  # the builder's mask, untouched (a decode step)
        structure = attention_mask.structure
        return (None if isinstance(structure, AllKeys) else structure), None
    mask, extra, built = _mask_and_bias(attention_mask, module, is_causal, Q)
    if not built:
        causal_here = getattr(module, "is_causal", True) if is_causal is None else is_causal
        mask = _unbuilt(mask, Q, K, bool(causal_here), sliding_window, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    return mask, extra


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
    # keys a head-wise budget cache holds per group of heads (bhqk.budget: a tensor subclass)
    attend = None if type(key) is torch.Tensor else getattr(key, "bhqk_attend", None)
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
    mask, extra = model_mask(attention_mask, module, Q, K, is_causal, sliding_window, position_ids, cu_seq_lens_q,
                             cu_seq_lens_k)
    if indices is not None:
        sel = _selected(indices, B, Q, K)
        mask = sel if mask is None else mask & sel
    bias = position_bias
    if extra is not None:
        bias = extra if bias is None else bias + extra
    sink = None if s_aux is None and sinks is None else _sinks(s_aux, sinks, H)
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


def check_implementation(name: str) -> None:
    """A BackendError naming ``name`` and the choices when it is not an attention implementation that
    loads: ``"bhqk"`` / ``"bhqk:<backend>"`` for a backend of :func:`bhqk.functional.names`, or one of
    transformers' own (``eager`` and its ``AttentionInterface``; hub kernels, ``org/name``, pass)."""
    backend = parse_implementation(name)
    if backend is not None:
        if name in names():
            return
        raise BackendError(f"attn_implementation={name!r}: bhqk has no backend {backend!r}; choose one of "
                           f"{', '.join(names())} (the backends of bhqk.functional.names()).")
    try:
        from transformers import AttentionInterface
    except ImportError:
        return  # the load that follows says what to install
    theirs = ["eager", *AttentionInterface._global_mapping]
    if name in theirs or "/" in name or "|" in name:
        return
    raise BackendError(f"attn_implementation={name!r} is not an attention implementation; choose bhqk's "
                       f"({', '.join(names())}) or transformers' ({', '.join(theirs)}).")


def register(name: str = "bhqk") -> list[str]:
    """Add bhqk to transformers under ``name`` (backend ``auto``) and ``name:<backend>`` for each backend
    in bhqk's registry: an attention function and a mask builder under each.
    Returns the names. Afterwards ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` work."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    out = names(name)
    for n, backend in zip(out, _backends()):
        fn = functools.partial(attention_forward, backend=backend)  # not a function around it: one frame less per call
        fn.__name__ = f"bhqk_attention_{backend}"  # type: ignore[attr-defined]
        fn.__doc__ = f"{attention_forward.__doc__}\n\n    Backend: {backend!r}."
        AttentionInterface.register(n, fn)
        AttentionMaskInterface.register(n, build_mask)
    return out
