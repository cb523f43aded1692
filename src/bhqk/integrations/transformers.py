"""Hugging Face transformers on bhqk: ``attn_implementation="bhqk"`` for any model that calls
attention through transformers' ``AttentionInterface``.

    from bhqk.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="bhqk")
    model.set_attn_implementation("bhqk:tiled")  # or pick a backend later

``register()`` adds, under ``"bhqk"`` (backend ``auto``) and ``"bhqk:<backend>"`` for every backend of
:func:`bhqk.functional.names`, two things — both are needed (without a mask builder transformers hands
a custom attention function ``attention_mask=None`` and padding is silently dropped):

- an **attention function** (:func:`~bhqk.integrations.hf_attention.attention_forward`): q [B, H, Q, d],
  k [B, Hkv, K, d], v [B, Hkv, K, dv] in (GQA without repeating K/V), ``(out [B, Q, H, dv], weights
  [B, H, Q, K] or None)`` out; every keyword argument transformers passes is honoured or refused with
  a ``TypeError`` naming it;
- a **mask builder** (:func:`~bhqk.integrations.hf_mask.build_mask`) returning an :class:`HFMask`: a
  bhqk mask to bhqk's attention function (``.structure``: causal, sliding window, chunks and packed
  sequences, padding, recovered by evaluating transformers' ``mask_function``, else dense), and to any
  other code the tensor transformers' own ``eager_mask`` builds. A mask the model changed arrives as a
  plain tensor and is used as one (bool: True = attend; float: additive).

:func:`parse_implementation` reads the ``"bhqk:<backend>"`` name, :func:`implementation` writes it.
:mod:`~bhqk.integrations.hf_mask` (the mask), :mod:`~bhqk.integrations.hf_attention` (the attention
function) and :mod:`~bhqk.integrations.model_map` (one map of a model's layers) hold the code; this
module is their public face; models load through :func:`bhqk.models.real.load_model`.
"""

from __future__ import annotations

from .hf_attention import IGNORED, attention_forward, check_implementation, implementation, names, parse_implementation, register
from .hf_mask import ROW_BLOCK_ENTRIES, AllKeys, HFMask, build_mask
from .model_map import ModelMap, ModelShape, address, cache_keyword, decoder_stack, model_map

__all__ = ["register", "names", "check_implementation", "parse_implementation", "implementation",
           "build_mask", "attention_forward", "AllKeys", "HFMask", "cache_keyword", "decoder_stack", "model_map",
           "ModelMap", "ModelShape", "address", "IGNORED", "ROW_BLOCK_ENTRIES"]
