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
(:func:`bhqk.functional.names`); :func:`parse_implementation` reads such a name, :func:`implementation`
writes it.

The code lives in three files, one concern each (as transformers keeps ``masking_utils`` apart from
its attention functions): :mod:`~bhqk.integrations.hf_mask` (the mask tensor and its structure),
:mod:`~bhqk.integrations.hf_attention` (the attention function and :func:`register`) and
:mod:`~bhqk.integrations.model_map` (one map of a model's layers). This module is their public face;
models load through :func:`bhqk.models.real.load_model`.
"""

from __future__ import annotations

from .hf_attention import IGNORED, attention_forward, check_implementation, implementation, names, parse_implementation, register
from .hf_mask import ROW_BLOCK_ENTRIES, AllKeys, HFMask, build_mask
from .model_map import ModelMap, ModelShape, address, cache_keyword, decoder_stack, model_map

__all__ = ["register", "names", "check_implementation", "parse_implementation", "implementation",
           "build_mask", "attention_forward", "AllKeys", "HFMask", "cache_keyword", "decoder_stack", "model_map",
           "ModelMap", "ModelShape", "address", "IGNORED", "ROW_BLOCK_ENTRIES"]
