"""Gates between full and streaming attention, one per K/V head (DuoAttention's mixing).

Inside ``with gated(model, g, sink, window):`` every query head of K/V head (layer l, head j) outputs
``O = g[l, j] · O_full + (1 − g[l, j]) · O_stream``: the model's own attention call and the same call
with the streaming mask (:func:`~bhqk.budget.streaming_mask`) ANDed into the model's structured mask,
both on bhqk's fast path. ``g`` is float [layers, Hkv], or [layers, Hkv, N] for one gate per query row
of an N-token prefill, and may require gradients; g = 1 is the model as it is. The mixing is an
attention implementation registered with transformers under :data:`NAME`; the block switches the model
to it and back.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import MaskError, ShapeError
from ..integrations.hf_attention import _mask_and_bias, attention_forward, parse_implementation
from ..integrations.hf_mask import build_mask
from ..integrations.model_map import ModelMap, model_map
from ..masks import Mask
from .mask import streaming_mask

NAME = "bhqk-gates"

# id(attention module) -> (its layer's gates [Hkv] or [Hkv, N], the streaming mask); the backend
_GATES: contextvars.ContextVar[tuple[dict[int, tuple[torch.Tensor, Mask]], str] | None] = \
    contextvars.ContextVar("bhqk_gates", default=None)


def _gated_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw: Any):
    """transformers' attention-function contract (``attention_forward``'s): the call as the model makes
    it, mixed per query head with the same call under the streaming mask where the module is gated."""
    state = _GATES.get()
    backend = "auto" if state is None else state[1]
    out, weights = attention_forward(module, query, key, value, attention_mask, backend=backend, **kw)  # [B, Q, H, dv]
    got = None if state is None else state[0].get(id(module))
    if got is None:
        return out, weights
    g, stream = got
    B, H, Q, _ = query.shape
    Hkv = key.shape[1]
    if g.shape[0] != Hkv or (g.dim() == 2 and g.shape[1] != Q):
        want = f"[Hkv={Hkv}]" if g.dim() == 1 else f"[Hkv={Hkv}, N={Q}]"
        raise ShapeError(f"bhqk.budget.gated: the gates of {type(module).__name__} are {list(g.shape)} but its call "
                         f"needs {want} (per-row gates fit a prefill of N tokens only).")
    mask, bias, built = _mask_and_bias(attention_mask, module, kw.get("is_causal"), Q)
    if not built or bias is not None:
        raise MaskError(f"bhqk.budget.gated: {type(module).__name__} got an attention mask bhqk's mask builder did "
                        f"not make (an additive float mask or none); the streaming mask is ANDed into a structured mask "
                        f"only. Load the model with attn_implementation='bhqk'.")
    kw = {k: v for k, v in kw.items() if k != "output_attentions"}
    o_s, _ = attention_forward(module, query, key, value, stream if mask is None else mask & stream,
                               backend=backend, **kw)  # [B, Q, H, dv]
    gq = g.to(out.dtype).repeat_interleave(H // Hkv, dim=0)  # [Hkv(, Q)] -> [H(, Q)]: a query head reads its K/V head's
    gq = gq[None, None, :, None] if g.dim() == 1 else gq.T[None, :, :, None]  # [1, 1|Q, H, 1]
    return o_s + gq * (out - o_s), weights  # [B, Q, H, dv]


@contextlib.contextmanager
def gated(model: nn.Module | ModelMap, gates: torch.Tensor, sink: int, window: int) -> Iterator[None]:
    """Inside the block each K/V head's query heads output ``gates·O_full + (1 − gates)·O_stream``
    (module doc); ``gates``: float [layers, Hkv] or [layers, Hkv, N] (may require gradients). The
    model must be a Hugging Face causal LM; it runs on bhqk's attention inside and on its own after."""
    if not hasattr(model.model if isinstance(model, ModelMap) else model, "set_attn_implementation"):
        raise TypeError(f"bhqk.budget.gated: mixes the heads of a Hugging Face causal LM; got {type(model).__name__}.")
    m = model_map(model)
    model = m.model
    L, Hkv = m.shape.layers, m.shape.kv_heads
    if not isinstance(gates, torch.Tensor) or not gates.is_floating_point() or gates.dim() not in (2, 3) \
            or tuple(gates.shape[:2]) != (L, Hkv):
        got = f"{gates.dtype} {list(gates.shape)}" if isinstance(gates, torch.Tensor) else type(gates).__name__
        raise ShapeError(f"bhqk.budget.gated: gates must be a float tensor [layers={L}, Hkv={Hkv}] or [layers, Hkv, N], "
                         f"got {got}.")
    stream = streaming_mask(sink, window)
    table = {id(m.module(li)): (gates[li], stream) for li in range(L)}
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    impl = getattr(model.config, "_attn_implementation", None)
    backend = parse_implementation(impl) or "auto"
    AttentionInterface.register(NAME, _gated_attention)
    AttentionMaskInterface.register(NAME, build_mask)
    token = _GATES.set((table, backend))
    model.set_attn_implementation(NAME)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_attn_implementation(impl)  # type: ignore[operator]
        _GATES.reset(token)


__all__ = ["gated", "NAME"]
