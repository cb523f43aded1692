"""NaN/inf held in v: they reach exactly the query rows that may attend their key, on every backend.

The torch, spans and flex backends hand a call with NaN/inf inputs to the tiled backend
(:func:`hand_off`); the reference and tiled compute it with the two helpers below.

A backend multiplies P by v with the non-finite values replaced by 0 (so P = 0 at a masked key never
meets 0·NaN) and counts, per output row, the NaN, +inf and -inf values among the keys that row may
attend: ``hits = reach @ flags`` with ``reach`` the rows' may-attend indicator [.., r, k] and
``flags`` [.., k, 3·dv]. :func:`poison` turns the counts into what the formula gives there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..shapes import all_finite

if TYPE_CHECKING:
    from .problem import Problem


def hand_off(p: Problem, every_key: bool, who: str) -> tuple[str, str] | None:
    """("tiled", why) when ``who``'s kernel would let NaN/inf cross the mask: q, or k or v unless
    ``every_key`` (every row attends every key: NaN/inf in k or v then reach every row, as in the
    formula), holds NaN/inf; else None. The one check of the backends that hand such calls to the
    tiled backend (``Backend.hands_off``: torch, spans, flex)."""
    if all_finite(p.q, *(() if every_key else (p.k, p.v))):
        return None
    return "tiled", f"q, k or v holds NaN/inf, which {who} lets cross the mask"


def finite_part(v: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(v with NaN/inf replaced by 0, flags [.., K, 3·dv] marking NaN | +inf | -inf in v), or
    (v, None) when v is finite. flags has ``dtype`` (default v's: the dtype the scores are
    computed in, which the reach indicator multiplying them has)."""
    if all_finite(v):
        return v, None
    flags = torch.cat([v.isnan(), v == float("inf"), v == float("-inf")], dim=-1).to(dtype or v.dtype)  # [.., K, 3·dv]
    return v.masked_fill(~torch.isfinite(v), 0.0), flags


def poison(hits: torch.Tensor) -> torch.Tensor:
    """Counts [.., r, 3·dv] of NaN / +inf / -inf values each row attends -> what they add to the
    row's output [.., r, dv]: NaN (a NaN, or both infinities), ±inf, or 0."""
    nan, pos, neg = (hits > 0).chunk(3, dim=-1)  # [.., r, dv] each
    out = torch.zeros(nan.shape, dtype=hits.dtype, device=hits.device)
    out.masked_fill_(pos, float("inf")).masked_fill_(neg, float("-inf"))
    return out.masked_fill_(nan | (pos & neg), float("nan"))
