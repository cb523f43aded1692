"""The "torch" backend: an adapter to ``F.scaled_dot_product_attention``, used only where it gives
the reference's answer. PyTorch's bool mask has bhqk's polarity (True = may attend); its
``is_causal`` is top-left, so a bottom-right causal mask with Q ≠ K becomes a dense mask.

PyTorch's kernels let NaN/inf cross the mask (0·NaN, inf - inf) and its fused kernel turns a NaN
query row into zeros, so a call whose q (or, with a mask or bias, k or v) holds NaN/inf is handed
to the tiled backend (:func:`hands_off`; the registry runs it, which has dropout too): the same
answer as every other backend."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..bias import Bias, in_dtype
from ..masks import to_sdpa, top_left_count
from ..shapes import finite, per_query_head
from ..shortcuts import Shortcut, declare
from . import nonfinite
from .costs import Costs, Estimate
from .problem import Problem

_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
HAS_GQA = _TORCH >= (2, 5)  # enable_gqa= and zero output for fully masked rows arrived in 2.5


def structure_free(p: Problem) -> bool:
    """True when SDPA can take the call without a dense [.., Q, K] mask or bias: no mask, or one
    that is exactly SDPA's top-left ``is_causal`` (``causal_diagonal`` 0) at a positive scale."""
    if p.bias is not None:
        return False
    if p.every_key:
        return True
    return p.mask is not None and p.mask.causal_diagonal(p.ext) == 0 and p.scale_positive


def share(p: Problem, plan: None = None) -> float | None:
    """Its claim as an exact fused kernel (``Backend.share``): the fraction of the B·H·Q·K scores
    it computes, where it needs no dense mask or bias (is_causal skips the upper triangle), else
    None; None too for dropout on the CPU, which runs SDPA's math path ([B, H, Q, K] in memory)."""
    if not structure_free(p) or (p.dropout_p > 0 and p.q.device.type == "cpu"):
        return None
    Q, K = p.ext.Q, p.ext.K
    if p.every_key or Q * K == 0:
        return 1.0
    return top_left_count(Q, K) / (Q * K)  # is_causal is top-left: row i sees keys 0..i


PACKING = declare(Shortcut(
    "decode GQA packing", "reading each K/V head G times at a decode step", "applies to one query, no mask or bias "
    "to build (a decode step), Hkv < H: the G query heads of a K/V head become G queries of one SDPA call",
    "nothing kept", "none needed: computed from the call's own tensors"))

DENSE_LIMIT = 1 << 24  # entries of a dense mask/bias above which auto never hands one to SDPA


def estimate(p: Problem, grad: bool, c: Costs) -> Estimate:
    """Seconds by this machine's costs (``costs.Costs``): per call, per score entry (× the head
    width over 64) and per entry of the dense mask/bias built for it; forward+backward × its ratio."""
    e = p.ext
    if p.dropout_p > 0 and p.q.device.type == "cpu":
        return Estimate(math.inf, "its dropout runs SDPA's math path, which builds [B, H, Q, K]")
    dense = 0 if structure_free(p) else e.B * e.Q * e.K * (e.H if p.bias is not None else 1)
    if dense > DENSE_LIMIT:
        return Estimate(math.inf, f"it would need a dense mask/bias of {dense} entries (> {DENSE_LIMIT}); "
                        "auto does not build O(Q·K) tensors for it")
    width = (p.sizes["d"] + p.sizes["dv"]) / 128
    t = c.sdpa_call + e.B * e.H * e.Q * e.K * (c.sdpa_elem * width + (c.sdpa_mask_elem if dense else 0.0))
    return Estimate(t * ((c.sdpa_backward or 1.0) if grad else 1.0), f"dense mask {dense / 1e6:.3g} M entries" if dense else "")


def why_not(p: Problem, need_lse: bool) -> str | None:
    if need_lse:
        return "F.scaled_dot_product_attention does not return the log-sum-exp"
    if p.softcap is not None:
        return "F.scaled_dot_product_attention has no softcap"
    if p.sinks is not None:
        return "F.scaled_dot_product_attention has no sinks (a logit in the softmax denominator without a value)"
    if not HAS_GQA and p.mask is not None:
        return f"torch {torch.__version__} SDPA gives NaN for fully masked rows (fixed in 2.5)"
    return None


def _bias(p: Problem, bias_: Bias) -> torch.Tensor:
    """The bias [#B, #H, Q, K] in q's dtype, finite however negative (``bias.in_dtype``)."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    return in_dtype(bias_, p.q.dtype, lambda dt: bias_.materialize(B, H, Q, K, device=p.q.device, dtype=dt))


def hands_off(p: Problem, plan: None = None) -> tuple[str, str] | None:
    """("tiled", why) when SDPA would let NaN/inf in the inputs cross the mask, else None. Without a
    mask or bias every row attends every key, so NaN/inf in k or v reach every row in SDPA as in
    the formula; only q is checked."""
    return nonfinite.hand_off(p, p.every_key and p.bias is None, "SDPA")


@dataclass(frozen=True)
class Call:
    """SDPA's arguments for one call: ``attn_mask`` (None, or the dense mask/bias it must be handed),
    ``is_causal`` (top-left), the scale and dropout; ``every_key``: every row sees every key, so
    only q needs the NaN/inf check (:func:`hands_off`). A call without a tensor is the same for
    every call of its family: the decision ``auto`` keeps for the family holds it (:func:`fast`)."""

    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float
    dropout_p: float
    every_key: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """out [B, H, Q, dv] of q [B, H, Q, d], k [B, Hkv, K, d], v [B, Hkv, K, dv] (finite inputs)."""
        B, H, Q, d = q.shape
        Hkv = k.shape[1]
        attn_mask, is_causal = self.attn_mask, self.is_causal
        if Q == 1 and Hkv != H and attn_mask is None and not is_causal and PACKING.on:  # one query, nothing masked: the G
            G = H // Hkv  # query heads of a K/V head become G queries of one call, which reads each K/V head once (not G times)
            PACKING.hits += 1
            out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G, d), k, v, None, self.dropout_p, False,
                                                 scale=self.scale)  # [B, H, 1, d] -> [B, Hkv, G, d] -> [B, Hkv, G, dv]
            return out.reshape(B, H, 1, v.shape[-1])  # [B, Hkv, G, dv] -> [B, H, Q=1, dv]
        gqa = {"enable_gqa": True} if Hkv != H and HAS_GQA else {}
        if Hkv != H and not HAS_GQA:
            k, v = per_query_head(k, H), per_query_head(v, H)  # [B, Hkv, K, x] -> [B, H, K, x]
        return F.scaled_dot_product_attention(q, k, v, attn_mask, self.dropout_p, is_causal, scale=self.scale,
                                              **gqa)  # [B, H, Q, dv]

    def on_finite(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """The call where its inputs are finite (q; and k, v unless ``every_key``), else None: such a
        call is handed to the tiled backend (:func:`hands_off`), which the caller's full path does."""
        if not finite(q) or not (self.every_key or (finite(k) and finite(v))):
            return None
        return self(q, k, v)


def call(p: Problem) -> Call:
    """SDPA's arguments for ``p``: no mask where every query sees every key (a decode step),
    ``is_causal`` where the mask is exactly its top-left causal one at a positive scale, else the
    dense mask (with a bias: the bias, −inf where the mask forbids)."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    allowed = p.every_key
    if p.bias is None and allowed:  # every query sees every key (a decode step): no mask to build
        return Call(None, False, p.scale, p.dropout_p, True)
    kw = to_sdpa(None if allowed else p.mask, B, H, Q, K, device=p.q.device)
    attn_mask, is_causal = kw["attn_mask"], kw["is_causal"]
    if is_causal and p.mask is not None and (p.bias is not None or not p.scale_positive):  # no is_causal with a mask
        attn_mask, is_causal = p.mask.materialize(B, H, Q, K, device=p.q.device), False  # nor at a scale <= 0
    if p.bias is not None:
        bias = _bias(p, p.bias)
        attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
    return Call(attn_mask, is_causal, p.scale, p.dropout_p, False)


def fast(p: Problem) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
    """``Backend.fast``: the :class:`Call` of ``p``'s whole family on finite inputs
    (:meth:`Call.on_finite`), where it holds no tensor (no dense mask or bias: :func:`structure_free`),
    else None."""
    return call(p).on_finite if structure_free(p) else None


def run(p: Problem, need_lse: bool = False, plan: None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry (no plan): SDPA on a call it computes right (finite inputs: see
    :func:`hands_off`): out [B, H, Q, dv], no lse."""
    return call(p)(p.q, p.k, p.v), None
