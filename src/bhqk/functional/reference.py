"""The reference backend: the executable spec. Every other backend is tested against it.

It reads like the formulas: S = Q·Kᵀ·scale → softcap → + bias → mask → P = softmax(S) → O = P·V,
in float32 (float64 stays float64), building the full [B, H, Q, K] tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .problem import Problem


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """[B, Hkv, K, x] -> [B, H, K, x]: query head h uses key/value head h // (H / Hkv)."""
    return t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def allowed(p: Problem) -> torch.Tensor | None:
    """Bool [#B, #H, Q, K]: where the mask permits and the bias is not -inf (None: everywhere)."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    a = p.mask.materialize(B, H, Q, K, device=p.q.device) if p.mask is not None else None
    if p.bias is not None:
        finite = torch.isfinite(p.bias.materialize(B, H, Q, K, device=p.q.device))
        a = finite if a is None else a & finite
    return a


def scores(p: Problem, where: torch.Tensor | None = None) -> torch.Tensor:
    """S [B, H, Q, K]: scaled, soft-capped, biased, and -inf where the mask forbids."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    dt = _compute_dtype(p.q)
    k = _heads(p.k, H).to(dt)  # [B, H, K, d]
    if where is not None:  # keys no query may attend: zero them so NaN/inf there cannot reach any gradient
        k = k.masked_fill(~where.any(dim=-2)[..., None], 0.0)
    S = torch.einsum("bhqd,bhkd->bhqk", p.q.to(dt), k) * p.scale  # [B, H, Q, K]
    if p.softcap is not None:
        S = p.softcap * torch.tanh(S / p.softcap)
    if p.bias is not None:
        S = S + p.bias.materialize(B, H, Q, K, device=S.device, dtype=dt)
    if p.mask is not None:
        S = S.masked_fill(~p.mask.materialize(B, H, Q, K, device=S.device), float("-inf"))
    return S


def softmax_rows(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P = softmax(S) over K and lse = log Σ exp(S) [B, H, Q]. A row with no finite score
    (fully masked) gets P = 0 and lse = -inf, with finite gradients."""
    m = S.amax(dim=-1, keepdim=True).detach()  # [B, H, Q, 1]; P does not depend on it
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    E = torch.exp(S - m)
    l = E.sum(dim=-1, keepdim=True)  # [B, H, Q, 1]
    P = E / torch.where(l > 0, l, torch.ones_like(l))
    lse = (torch.log(l) + m).squeeze(-1)  # [B, H, Q]
    return P, lse


def weights(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(P [B, H, Q, K], lse [B, H, Q]) in the compute dtype."""
    return softmax_rows(scores(p, allowed(p)))


def run(p: Problem, need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """O [B, H, Q, dv] in the input dtype, and lse [B, H, Q] (float32/64) when asked."""
    S = scores(p, allowed(p))
    P, lse = softmax_rows(S)
    if p.dropout_p > 0:
        P = F.dropout(P, p.dropout_p)
    v = _heads(p.v, p.ext.H).to(S.dtype)  # [B, H, K, dv]
    reachable = torch.isfinite(S).any(dim=-2)[..., None]  # [B, H, K, 1]: some query may attend this key
    v = v.masked_fill(~reachable, 0.0)  # values no query may attend never reach the output (NaN-safe)
    O = torch.einsum("bhqk,bhkv->bhqv", P, v)  # [B, H, Q, dv]
    return O.to(p.q.dtype), (lse if need_lse else None)
