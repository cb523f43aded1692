"""What a ``capture`` or an ``edit`` block selects: which attention calls (call indices, their order
inside the block, and/or module-path globs matched against ``model.named_modules()``), and the
selected query heads and rows of a call's tensors and of the call itself."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch

from ..bias import Bias
from ..functional.problem import Problem
from ..masks import Mask
from ..shapes import Sizes, as_4d, per_query_head


def selectors(layers: int | str | Iterable[int | str] | None, who: str) -> list[int | str] | None:
    """``layers`` as a list (None: every call), each a call index ≥ 0 or a module-path glob; else a
    ValueError naming ``who`` ("capture", "edit")."""
    if layers is None:
        return None
    out = [layers] if isinstance(layers, (int, str)) else list(layers)
    for sel in out:
        if isinstance(sel, bool) or not isinstance(sel, (int, str)) or (isinstance(sel, int) and sel < 0):
            raise ValueError(f"{who}: layers takes call indices >= 0 and module-path names, got {sel!r}.")
    return out


def selected(layers: list[int | str] | None, index: int, name: str) -> bool:
    """The call ``index`` of module path ``name`` is one of ``layers`` (None: every call)."""
    if layers is None:
        return True
    return any(sel == index if isinstance(sel, int) else fnmatch.fnmatchcase(name, sel) for sel in layers)


def heads_rows(t: torch.Tensor, heads: list[int], rows: list[int] | None = None) -> torch.Tensor:
    """A tensor of every query head and row (q, out, lse): [B, H, Q, ·] -> [B, h, r, ·], the query
    heads ``heads`` and the rows ``rows`` (None: all)."""
    t = t.index_select(1, torch.tensor(heads, device=t.device))  # [B, H, Q, ·] -> [B, h, Q, ·]
    return t if rows is None else t.index_select(2, torch.tensor(rows, device=t.device))  # [B, h, Q, ·] -> [B, h, r, ·]


def value_heads(t: torch.Tensor, heads: list[int], H: int) -> torch.Tensor:
    """A value broadcastable to [B, H, ·, ·] (a mask or bias tile, an edit's tensor) on the query heads
    ``heads``: [#B, #h, ·, ·] (a head axis of size 1 is kept: it broadcasts)."""
    t = as_4d(t)  # [#B, #H, ·, ·]
    if t.shape[1] == H and H != 1:
        t = t.index_select(1, torch.tensor(heads, device=t.device))  # [#B, H, ·, ·] -> [#B, h, ·, ·]
    return t


def sub_call(p: Problem, heads: list[int], mask: Mask | None, bias: Bias | None, rows: list[int] | None = None) -> Problem:
    """The call on the query heads ``heads`` and the query rows ``rows`` (None: all): q [B, h, r, d],
    k and v [B, h, K, ·] (head h reads K/V head h // G), sinks [h], with ``mask`` and ``bias`` (values
    of that h-head, r-row call)."""
    q = heads_rows(p.q, heads, rows)  # [B, H, Q, d] -> [B, h, r, d]
    k, v = (per_query_head(t, p.ext.H, heads) for t in (p.k, p.v))  # [B, Hkv, K, ·] -> [B, h, K, ·]
    s = p.sizes
    sizes = Sizes(B=s["B"], H=len(heads), Hkv=len(heads), Q=q.shape[2], K=s["K"], d=s["d"], dv=s["dv"])
    sinks = None if p.sinks is None else p.sinks.index_select(0, torch.tensor(heads, device=p.sinks.device))  # [H] -> [h]
    return Problem(q, k, v, sizes, mask, bias, p.scale, p.softcap, p.dropout_p, dict(p.options), sinks)
