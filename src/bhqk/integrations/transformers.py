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

The mask builder returns a bhqk mask value, never transformers' dense [B, 1, Q, K] tensor where the
structure is known: ``causal`` (aligned from the cache offsets), ``sliding_window``, chunks and
packed sequences as ``document``, ``key_padding`` from the 2-D ``attention_mask``, and their ``&``.
Transformers describes the pattern by a ``mask_function`` closure; bhqk does not read closures. It
evaluates the function (its public contract: indices in, bool out) and keeps a structured mask only
if it equals the evaluation on every entry; otherwise it returns the dense mask transformers' own
``sdpa_mask`` builds. The one exception is transformers' plain ``causal_mask_function`` /
``bidirectional_mask_function``, recognised by identity. The attention function receives whatever
the builder returned as ``attention_mask``.

Names: ``"bhqk"`` (backend ``auto``), ``"bhqk:tiled"``, ``"bhqk:reference"``, ``"bhqk:torch"``.
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
from ..masks import KeysBelow, Mask, causal, dense, document, from_hf, key_padding, predicate, sliding_window
from ..models.loading import read_config

BACKENDS = ("auto", "tiled", "reference", "torch")
ROW_BLOCK_ENTRIES = 1 << 22  # entries of transformers' mask evaluated at once while checking a structure


def names(name: str = "bhqk") -> list[str]:
    """The implementation names ``register(name)`` adds: ``name`` (auto) and ``name:<backend>``."""
    return [name if b == "auto" else f"{name}:{b}" for b in BACKENDS]


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
    **kwargs,
) -> Mask:
    """transformers' mask-interface call → one bhqk mask for [B, H, Q=q_length, K=kv_length].

    Query i sits at position ``q_offset + i``, key j at ``kv_offset + j`` (a KV cache gives offsets).
    ``attention_mask`` [B, ≥ kv_offset + K] marks real tokens (1) and padding (0)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    mask_function = causal_mask_function if mask_function is None else mask_function
    B, Q, K = int(batch_size), int(q_length), int(kv_length)
    if isinstance(attention_mask, Mask):  # built before (generate() with a static cache) and handed back
        if getattr(attention_mask, "shape", None) != (B, 1, Q, K):
            raise MaskError(f"bhqk mask builder: got a prepared mask for {getattr(attention_mask, 'shape', '?')} "
                            f"but this call is [B={B}, 1, Q={Q}, K={K}].")
        return attention_mask
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a StaticCache gives q_offset as a tensor
    attention_mask = None if attention_mask is None else attention_mask.bool()  # [B, ≥ kv_offset + K]
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
    return _stamp(out, B, Q, K)


def _stamp(mask: Mask, B: int, Q: int, K: int) -> Mask:
    """Give a fresh mask value the ``ndim``/``shape`` transformers reads from an attention_mask it is
    handed back (``generate`` with a static cache builds masks once and passes them to ``forward``)."""
    vars(mask).update(ndim=4, shape=(B, 1, Q, K))  # plain attributes for transformers, not part of the Mask type
    return mask


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


def _mask_and_bias(attention_mask, module, is_causal: bool | None, Q: int):
    """What transformers passed as attention_mask → (bhqk mask or None, additive float [.., Q, K] or None)."""
    if isinstance(attention_mask, AllKeys):
        return None, None
    if isinstance(attention_mask, Mask):
        return attention_mask, None
    if attention_mask is None:  # no builder ran: as SDPA, is_causal (default module.is_causal, else True)
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        return (causal("top_left") if is_causal and Q > 1 else None), None
    if not isinstance(attention_mask, torch.Tensor):
        raise MaskError(f"attention_mask must be a bhqk mask, a tensor or None, got {type(attention_mask).__name__}.")
    if attention_mask.dim() == 2:  # [B, K]: 1 = real token, 0 = padding, any dtype
        return from_hf(attention_mask), None
    if attention_mask.dtype == torch.bool:
        return dense(attention_mask), None
    if attention_mask.is_floating_point():  # a custom additive 4-D mask: 0 to attend, very negative to mask
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2  # [#B, #H, Q, K]
        rest = torch.where(allowed, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
        return dense(allowed), (rest if bool(rest.any()) else None)
    raise MaskError(f"attention_mask has dtype {attention_mask.dtype}; expected bool (True = attend) or float (additive).")


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
    sliding_window: int | None = None,  # already part of the mask value the builder returned
    *,
    backend: str = "auto",
    **kwargs,
):
    """transformers' attention-function contract on bhqk: query [B, H, Q, d], key [B, Hkv, K, d],
    value [B, Hkv, K, dv] → (out [B, Q, H, dv], weights [B, H, Q, K] with output_attentions, else None).

    ``position_bias`` (T5) is bhqk's ``bias=``; ``softcap`` (Gemma 2) caps the scores; ``s_aux``
    (GPT-OSS) is bhqk's ``sinks=``, per-head logits in each row's denominator; dropout only
    in training. Each call runs in ``observe.scope(module)``, so ``bhqk.capture(model=...)`` names
    it by the module's path."""
    Q = query.shape[2]
    mask, extra = _mask_and_bias(attention_mask, module, is_causal, Q)
    bias = position_bias
    if extra is not None:
        bias = extra if bias is None else bias + extra
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    with observe.scope(module):  # capture and trace name the call by this module's path
        out = attention(query, key, value, mask, bias=bias, scale=scaling, softcap=softcap, sinks=s_aux,
                        dropout_p=dropout_p, backend=backend)  # [B, H, Q, dv]; s_aux: GPT-OSS's per-head sinks [H]
    weights = None
    if kwargs.get("output_attentions"):
        weights = attention_weights(query, key, mask, bias=bias, scale=scaling, softcap=softcap, sinks=s_aux)  # [B, H, Q, K]
    return out.transpose(1, 2).contiguous(), weights  # [B, H, Q, dv] -> [B, Q, H, dv]


def _attention_for(backend: str) -> Callable:
    def bhqk_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    bhqk_attention.__name__ = f"bhqk_attention_{backend}"
    bhqk_attention.__doc__ = f"{attention_forward.__doc__}\n\n    Backend: {backend!r}."
    return bhqk_attention


def register(name: str = "bhqk") -> list[str]:
    """Add bhqk to transformers under ``name`` (backend ``auto``) and ``name:tiled``,
    ``name:reference``, ``name:torch``: an attention function and a mask builder under each.
    Returns the names. Afterwards ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` work."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    out = names(name)
    for n, backend in zip(out, BACKENDS):
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


__all__ = ["register", "names", "build_mask", "attention_forward", "AllKeys", "load_folder", "Loaded", "encode",
           "is_decoder_config"]
