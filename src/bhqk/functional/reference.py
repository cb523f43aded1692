"""The reference backend: the executable spec. Every other backend is tested against it.

It reads like the formulas: S = Q·Kᵀ·scale → softcap → + bias → mask → P = softmax(S) → dropout → O = P·V,
in float32 (float64 stays float64), building the full [B, H, Q, K] tensors. The mask and the bias
are materialized once. NaN/inf in v reach only the rows that may attend their key (``nonfinite``).
Sinks: the head's sink logit is one more column of S that takes part in the softmax and is then
dropped (it has no value), so P's rows sum to 1 − the sink's share and lse includes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..shapes import compute_dtype, per_query_head
from .nonfinite import finite_part, poison
from .problem import Problem


def scores(p: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S [B, H, Q, K] (scaled, soft-capped, biased, -inf where not allowed) and ``allowed``, bool
    [#B, #H, Q, K]: where the mask permits and the bias is not -inf (None: everywhere)."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    dt = compute_dtype(p.q)
    bias = p.bias.materialize(B, H, Q, K, device=p.q.device, dtype=dt) if p.bias is not None else None  # [#B, #H, #Q, #K]
    allowed = p.mask.materialize(B, H, Q, K, device=p.q.device) if p.mask is not None else None  # [#B, #H, #Q, #K]
    if bias is not None:
        allowed = bias > float("-inf") if allowed is None else allowed & (bias > float("-inf"))
    k = per_query_head(p.k, H).to(dt)  # [B, H, K, d]
    if allowed is not None:  # keys no query may attend: zero them so NaN/inf there cannot reach any gradient
        k = k.masked_fill(~allowed.any(dim=-2)[..., None], 0.0)  # allowed [#B, #H, Q, K] -> any row [#B, #H, K, 1]
    S = torch.einsum("bhqd,bhkd->bhqk", p.q.to(dt), k) * p.scale  # [B, H, Q, K]
    if p.softcap is not None:
        S = p.softcap * torch.tanh(S / p.softcap)
    if bias is not None:
        S = S + bias
    if allowed is not None:
        S = S.masked_fill(~allowed, float("-inf"))
    return S, allowed


def softmax_rows(S: torch.Tensor, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """P = softmax(S) over K and lse = log Σ exp(S) [B, H, Q]. A row with no finite score
    (fully masked, or K = 0) gets P = 0 and lse = -inf, with finite gradients.
    ``sinks`` [H]: each row's softmax also counts exp(sink[h]) (GPT-OSS): P = softmax([S, sink])
    without its last column, lse = log(Σ exp(S) + exp(sink)); a fully masked row gets P = 0, lse = sink."""
    if sinks is not None:
        sink = sinks.to(S.dtype)[None, :, None, None].expand(*S.shape[:-1], 1)  # [H] -> [B, H, Q, 1]
        P, lse = softmax_rows(torch.cat([S, sink], dim=-1))  # [B, H, Q, K+1]
        return P[..., :-1], lse  # the sink's column has no value
    m = S.amax(dim=-1, keepdim=True) if S.shape[-1] else S.new_zeros(*S.shape[:-1], 1)  # [B, H, Q, 1]
    m = torch.where(torch.isfinite(m), m, 0.0).detach()  # P does not depend on it
    E = torch.exp(S - m)
    l = E.sum(dim=-1, keepdim=True)  # [B, H, Q, 1]
    P = E / torch.where(l > 0, l, 1.0)
    lse = (torch.log(l) + m).squeeze(-1)  # [B, H, Q]
    return P, lse


def weights(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(P [B, H, Q, K], lse [B, H, Q]) in the compute dtype."""
    return softmax_rows(scores(p)[0], p.sinks)


def why_not(p: Problem, need_lse: bool) -> str | None:
    """The spec takes every call (building [B, H, Q, K])."""
    return None


def run(p: Problem, need_lse: bool = False, plan: None = None,
        keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry (no plan): O [B, H, Q, dv] in the input dtype and lse [B, H, Q]
    (float32/64; returned even when not asked, since it is computed anyway: observers get it).
    Dropout (``p.dropout_p > 0``) zeroes entries of P and scales the rest by 1/(1 - p): those where
    ``keep`` (bool [B, H, Q, K], e.g. ``tiled.dropout_keep``) is False, or drawn by ``F.dropout``
    when no ``keep`` is given."""
    S, _ = scores(p)
    P, lse = softmax_rows(S, p.sinks)
    if p.dropout_p > 0:
        P = F.dropout(P, p.dropout_p) if keep is None else P * keep / (1.0 - p.dropout_p)
    O = weighted_values(P, per_query_head(p.v, p.ext.H).to(S.dtype), lambda: S > float("-inf"))  # [B, H, Q, dv]
    return O.to(p.q.dtype), lse


def weighted_values(P: torch.Tensor, v: torch.Tensor, reach: Callable[[], torch.Tensor]) -> torch.Tensor:
    """O = P·V [B, h, Q, dv] for P [B, h, Q, K] and v [B, h, K, dv], NaN/inf in v reaching exactly the
    rows that may attend their key (``reach()``, bool [B, h, Q, K], asked only when v holds any):
    the one P·V of the formula (``run``, and the edits that give or change P)."""
    v, flags = finite_part(v)  # [B, h, K, dv]: NaN/inf as 0; flags [B, h, K, 3·dv]
    O = torch.einsum("bhqk,bhkv->bhqv", P, v)  # [B, h, Q, dv]
    if flags is not None:  # NaN/inf in v reach exactly the rows that may attend their key
        O = O + poison(torch.einsum("bhqk,bhkc->bhqc", reach().to(P.dtype), flags))  # [B, h, Q, dv]
    return O
