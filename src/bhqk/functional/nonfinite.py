"""NaN/inf held in v: they reach exactly the query rows that may attend their key, on every backend.

A backend multiplies P by v with the non-finite values replaced by 0 (so P = 0 at a masked key never
meets 0·NaN) and counts, per output row, the NaN, +inf and -inf values among the keys that row may
attend: ``hits = reach @ flags`` with ``reach`` the rows' may-attend indicator [.., r, k] and
``flags`` [.., k, 3·dv]. :func:`poison` turns the counts into what the formula gives there.
"""

from __future__ import annotations

import torch

from ..shapes import all_finite


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
