"""One map of a model (:func:`model_map`): its layers, their attention modules under canonical addresses
(``"layers.3.attn"``, whatever the model calls them), each layer's attention type and window, H, Hkv, d
(:class:`ModelShape`), the text config and the next-token logits of final hidden states — found once,
in this one place, and handed on to scores, gates, plans, caches, capture and edit.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ShapeError

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_ADDRESS = re.compile(r"layers\.(\d+)\.attn")


def address(layer: int) -> str:
    """The canonical address of layer ``layer``'s attention module: ``"layers.{layer}.attn"``."""
    return f"layers.{layer}.attn"


@dataclass(frozen=True)
class ModelShape:
    """What a plan is made for: ``layers``, query heads ``heads`` (H), K/V heads ``kv_heads`` (Hkv),
    ``head_dim`` (d), each layer's attention as the model masks it (``layer_types``: transformers'
    ``full_attention``, ``sliding_attention`` or ``chunked_attention``; ``windows``: the keys a query
    of the layer sees at most, itself included — the sliding window or the chunk size — or None for
    every key) and the model's ``name`` and ``model_type`` where known."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]
    name: str | None = None
    model_type: str | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.layers or len(self.windows) != self.layers:
            raise ShapeError(f"ModelShape: {len(self.layer_types)} layer types and {len(self.windows)} windows for "
                             f"layers={self.layers}.")
        for li, (t, w) in enumerate(zip(self.layer_types, self.windows)):
            if t not in LAYER_TYPES:
                raise ShapeError(f"ModelShape: layer {li} is {t!r}; a budget plan covers layers of keys and values "
                                 f"({', '.join(LAYER_TYPES)}).")
            if (t == "full_attention") != (w is None) or (w is not None and w < 1):
                raise ShapeError(f"ModelShape: layer {li} is {t!r} with window {w!r} (a full-attention layer has none, "
                                 f"a sliding or chunked one a window >= 1).")

    def sizes(self) -> tuple[int, int, int, int]:
        return self.layers, self.heads, self.kv_heads, self.head_dim

    def describe(self) -> str:
        """``[layers=18, H=4, Hkv=1, d=256; 15 sliding_attention (window 512) + 3 full_attention] (gemma3)``."""
        kinds: dict[tuple[str, int | None], int] = {}
        for t, w in zip(self.layer_types, self.windows):
            kinds[(t, w)] = kinds.get((t, w), 0) + 1
        types = " + ".join(f"{n} {t}" + ("" if w is None else f" (window {w})") for (t, w), n in kinds.items())
        who = " / ".join(x for x in (self.name, self.model_type) if x)
        return (f"[layers={self.layers}, H={self.heads}, Hkv={self.kv_heads}, d={self.head_dim}; {types}]"
                + (f" ({who})" if who else ""))

    def to_dict(self) -> dict:
        return {"name": self.name, "model_type": self.model_type, "layers": self.layers, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "layer_types": list(self.layer_types),
                "windows": list(self.windows)}


@dataclass(frozen=True, eq=False)
class ModelMap:
    """A model's layers, found once (:func:`model_map`): ``shape`` (:class:`ModelShape`), ``paths`` (the
    module path of each layer's attention module, by layer), ``decoder`` (a causal LM's decoder stack:
    the module whose output has ``last_hidden_state`` and which holds ``layers``; None for bhqk's own
    models) and ``config`` (the text config; None for bhqk's own models)."""

    model: nn.Module
    shape: ModelShape
    paths: tuple[str, ...]
    decoder: nn.Module | None
    config: Any | None

    @property
    def addresses(self) -> list[str]:
        """``["layers.0.attn", …]``: the canonical address of each layer's attention module."""
        return [address(li) for li in range(self.shape.layers)]

    def module(self, layer: int) -> nn.Module:
        """The attention module of layer ``layer``."""
        return self.model.get_submodule(self.paths[layer])

    def path(self, name: str) -> str:
        """The module path of a canonical address (``"layers.3.attn"`` → ``"model.layers.3.self_attn"``);
        any other name is returned as it is."""
        m = _ADDRESS.fullmatch(name)
        if m is None:
            return name
        li = int(m.group(1))
        if li >= len(self.paths):
            raise ValueError(f"{name!r}: the model has {len(self.paths)} layers (layers.0.attn … "
                             f"layers.{len(self.paths) - 1}.attn).")
        return self.paths[li]

    def paths_matching(self, glob: str) -> list[str]:
        """The module paths of the layers whose canonical address matches ``glob`` (``"layers.*.attn"``)."""
        return [p for li, p in enumerate(self.paths) if fnmatch.fnmatchcase(address(li), glob)]

    def address_of(self, path: str) -> str | None:
        """The canonical address of an attention module's path (None: not a layer's attention module)."""
        try:
            return address(self.paths.index(path))
        except ValueError:
            return None

    @property
    def vocab_size(self) -> int:
        if self.config is None:
            raise TypeError(f"{type(self.model).__name__}: bhqk's own models have no text config.")
        return int(self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def hidden(self, ids: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        """The decoder's final hidden states [B, N, D] of ``ids`` [B, N] (or ``inputs_embeds=``), no cache."""
        return self.stack()(input_ids=ids, use_cache=False, **kw).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next-token logits of final hidden states [..., D] -> [..., V]: the output embedding, then
        the final soft cap where the model has one (Gemma 2 and 3)."""
        self.stack()
        z = self.model.get_output_embeddings()(hidden)  # type: ignore[operator]  # [..., V]
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            z = cap * torch.tanh(z / cap)
        return z

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next-token log-probabilities of final hidden states [..., D] -> [..., V], in float32: the one
        place the scores and grading read the model's distribution."""
        return torch.log_softmax(self.logits(hidden).float(), -1)

    def stack(self) -> Any:
        """The decoder stack (a ``TypeError`` for a model that has none)."""
        if self.decoder is None:
            raise TypeError(f"{type(self.model).__name__} is not a Hugging Face causal LM: it has no decoder stack.")
        return self.decoder


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) transformers config: its decoder's."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def decoder_stack(model: Any) -> Any:
    """A causal LM's decoder (the module whose output has ``last_hidden_state`` and which holds
    ``layers``): ``model.get_decoder()``, or ``model.model`` where ``get_decoder()`` gives the causal LM
    itself (transformers 5.x's ``Llama4ForCausalLM``)."""
    dec = model.get_decoder()
    if dec is model:
        dec = getattr(model, "model", None)
        if dec is None or dec is model:
            raise TypeError(f"{type(model).__name__}: its get_decoder() is the model itself and it has no .model: "
                            f"the decoder stack behind the output layer is not found.")
    return dec


def cache_keyword(model: Any) -> str:
    """The keyword a transformers model's ``forward`` and ``generate`` take a ``Cache`` by: ``"cache"``
    where its forward has that parameter (transformers 5.24 renamed ``past_key_values`` to it and warns
    about the old name), else ``"past_key_values"`` (older 5.x)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def model_map(model: nn.Module | ModelMap) -> ModelMap:
    """The :class:`ModelMap` of a Hugging Face causal LM (its config: sizes, each layer's type and window
    as transformers' ``DynamicCache(config=...)`` reads them; its attention modules: the modules with a
    ``layer_idx``, one per layer) or of a bhqk model (its ``MultiHeadAttention`` modules, in order; every
    layer full attention). A map is returned as it is."""
    if isinstance(model, ModelMap):
        return model
    from ..nn import MultiHeadAttention

    own = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if own:
        sizes = {(m.num_heads, m.num_kv_heads, m.head_dim) for _, m in own}
        if len(sizes) != 1:
            raise ShapeError(f"{type(model).__name__}: its attention modules differ in (H, Hkv, d): {sorted(sizes)}; "
                             f"a budget plan needs one K/V head count per layer.")
        (H, Hkv, d), = sizes
        L = len(own)
        shape = ModelShape(L, H, Hkv, d, ("full_attention",) * L, (None,) * L, None, type(model).__name__)
        return ModelMap(model, shape, tuple(n for n, _ in own), None, None)
    config = getattr(model, "config", None)
    if config is None:
        raise ShapeError(f"{type(model).__name__} has no .config: bhqk maps a Hugging Face causal LM (layers, attention "
                         f"heads and K/V heads come from its config) or a model of bhqk's MultiHeadAttention modules.")
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = text_config(config)
    L = int(text.num_hidden_layers)
    H = int(text.num_attention_heads)
    Hkv = int(getattr(text, "num_key_value_heads", None) or H)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // H)
    types, kwargs = get_layer_types_and_kwargs(text)  # what the model's own DynamicCache(config=) is made of
    windows = tuple(None if t == "full_attention" else kw.get("sliding_window") for t, kw in zip(types, kwargs))
    name = getattr(config, "name_or_path", None) or None
    shape = ModelShape(L, H, Hkv, d, tuple(types), windows, name, getattr(config, "model_type", None) or None)
    found = sorted((m.layer_idx, n) for n, m in model.named_modules()
                   if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int))
    if [li for li, _ in found] != list(range(L)):
        raise ShapeError(f"{type(model).__name__}: its config has {L} layers but its attention modules with a layer_idx "
                         f"are {[n for _, n in found][:6]} (layer_idx {[li for li, _ in found][:6]}): one per layer "
                         f"is needed.")
    try:
        dec = decoder_stack(model) if hasattr(model, "get_decoder") else None
    except (TypeError, AttributeError):
        dec = None
    return ModelMap(model, shape, tuple(n for _, n in found), dec, text)


__all__ = ["ModelMap", "ModelShape", "model_map", "address", "decoder_stack", "cache_keyword", "text_config",
           "LAYER_TYPES"]
