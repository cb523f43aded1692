"""The "torch" backend: an adapter to ``F.scaled_dot_product_attention``, used only where it gives
the reference's answer. PyTorch's bool mask has bhqk's polarity (True = may attend); its
``is_causal`` is top-left, so a bottom-right causal mask with Q ≠ K becomes a dense mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import Causal, to_sdpa
from .problem import Problem

_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
HAS_GQA = _TORCH >= (2, 5)  # enable_gqa= and zero output for fully masked rows arrived in 2.5


def structure_free(p: Problem) -> bool:
    """True when SDPA can take the call without a dense [.., Q, K] mask or bias."""
    if p.bias is not None:
        return False
    if p.mask is None:
        return True
    return isinstance(p.mask, Causal) and (p.mask.align == "top_left" or p.ext.Q == p.ext.K)


def why_not(p: Problem, need_lse: bool) -> str | None:
    if need_lse:
        return "F.scaled_dot_product_attention does not return the log-sum-exp"
    if p.softcap is not None:
        return "F.scaled_dot_product_attention has no softcap"
    if not HAS_GQA and p.mask is not None:
        return f"torch {torch.__version__} SDPA gives NaN for fully masked rows (fixed in 2.5)"
    return None


def _finite(t: torch.Tensor) -> bool:
    """No NaN/inf in ``t``: a finite sum proves it cheaply; only a non-finite sum needs the full check."""
    dt = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=dt))) or bool(torch.isfinite(t).all())


def _sanitize(p: Problem, allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero K/V rows that no query may attend, but only if they hold NaN/inf (pytorch#101967)."""
    k, v = p.k, p.v
    if allowed is None or (_finite(k) and _finite(v)):
        return k, v
    H = p.ext.H
    k = k.repeat_interleave(p.groups, dim=1)  # [B, Hkv, K, d] -> [B, H, K, d]
    v = v.repeat_interleave(p.groups, dim=1)
    reachable = allowed.expand(p.ext.B, H, p.ext.Q, p.ext.K).any(dim=-2)[..., None]  # [B, H, K, 1]
    return k.masked_fill(~reachable, 0.0), v.masked_fill(~reachable, 0.0)


def run(p: Problem, need_lse: bool = False) -> tuple[torch.Tensor, None]:
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    kw = to_sdpa(p.mask, B, H, Q, K, device=p.q.device)
    attn_mask, is_causal = kw["attn_mask"], kw["is_causal"]
    allowed = attn_mask
    if is_causal and (p.bias is not None or (Q < K and not (_finite(p.k) and _finite(p.v)))):
        allowed = p.mask.materialize(B, H, Q, K, device=p.q.device)  # SDPA takes no is_causal with a mask
        attn_mask, is_causal = allowed, False
    if p.bias is not None:
        bias = p.bias.materialize(B, H, Q, K, device=p.q.device, dtype=p.q.dtype)
        attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
        allowed = torch.isfinite(attn_mask)
    k, v = _sanitize(p, allowed)
    gqa = k.shape[1] != H
    if gqa and not HAS_GQA:
        k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))  # [B, Hkv, K, x] -> [B, H, K, x]
    extra = {"enable_gqa": True} if gqa and HAS_GQA else {}
    out = F.scaled_dot_product_attention(
        p.q, k, v, attn_mask=attn_mask, dropout_p=p.dropout_p, is_causal=is_causal, scale=p.scale, **extra
    )  # [B, H, Q, dv]
    return out, None
