"""Which heads do what: a table per layer × head of attention statistics, and detectors for the usual
roles, each measured against the control it needs.

:func:`head_table` averages the statistics of captured records (``capture(what=("entropy", ...))``)
over the real rows (padding and rows that may attend nothing left out), every batch element and every
call of a layer (a prefill and its decode steps together). :func:`detect` runs a model on a repeated
random sequence and on a non-repeating control (:mod:`bhqk.inspect.detect`) and scores:

- ``prev``: P on the previous token (offset 1), on the control;
- ``induction``: P from a token of the second copy to the token after its match in the first copy
  (offset L − 1 for a copy of length L), on the repeated sequence, minus the same offset's P on the
  control, where nothing repeats (a head that just looks L − 1 back scores 0);
- ``sink``: P on key 0; ``local``: P within ``window`` keys; ``entropy``, ``distance``: as in capture;
- ``received@p``: the mean P each row gives to key p (chosen positions).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..text import table

ROW_STATS = ("entropy", "distance", "sink", "local")
# what a score must reach for :meth:`HeadTable.roles` to name the role (P mass; induction: above control)
ROLE_THRESHOLDS = {"prev": 0.5, "induction": 0.3, "sink": 0.5, "local": 0.9}


class _Record(Protocol):
    name: str
    heads: list[int]
    sizes: dict[str, int]
    real: torch.Tensor | None
    received: torch.Tensor | None
    offsets: dict[int, torch.Tensor] | None


@dataclass
class HeadTable:
    """Scores per layer × head: ``values[column]`` is a float tensor [L, H] (NaN where a head was not
    captured); ``layers`` names the L layers (module paths, or ``attention.<i>``)."""

    layers: list[str]
    num_heads: int
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # column -> what it means

    def __getitem__(self, column: str) -> torch.Tensor:
        if column not in self.values:
            raise KeyError(f"no column {column!r}; columns: {list(self.values)}.")
        return self.values[column]

    @property
    def columns(self) -> list[str]:
        return list(self.values)

    def top(self, column: str, n: int = 3) -> list[tuple[int, int, float]]:
        """The ``n`` heads with the highest ``column``: (layer index, head, value)."""
        v = self[column]
        flat = torch.where(torch.isnan(v), float("-inf"), v).flatten()  # [L, H] -> [L·H], index i = layer·H + head
        idx = flat.argsort(descending=True)[:n]
        H = v.shape[1]
        return [(int(i) // H, int(i) % H, float(flat[i])) for i in idx if math.isfinite(float(flat[i]))]

    def roles(self, thresholds: dict[str, float] | None = None) -> list[tuple[int, int, str, float]]:
        """(layer, head, role, score) for every head whose score reaches the role's threshold."""
        out = []
        for role, t in (thresholds or ROLE_THRESHOLDS).items():
            if role not in self.values:
                continue
            v = self.values[role]
            for li, h in (v >= t).nonzero().tolist():
                out.append((li, h, role, float(v[li, h])))
        return sorted(out)

    def rows(self) -> list[list]:
        out = []
        for li, name in enumerate(self.layers):
            for h in range(self.num_heads):
                vals = [self.values[c][li, h].item() for c in self.values]
                if all(math.isnan(x) for x in vals):
                    continue
                out.append([li, name, h] + [f"{x:.3f}" if not math.isnan(x) else "-" for x in vals])
        return out

    def __str__(self) -> str:
        return table(["layer", "name", "head"] + self.columns, self.rows())

    def __repr__(self) -> str:
        L, H = len(self.layers), self.num_heads
        lines = [f"HeadTable({L} layers × {H} heads; columns {', '.join(self.columns)})"]
        for col in self.columns:
            best = ", ".join(f"L{li}.H{h}={v:.2f}" for li, h, v in self.top(col, 3))
            lines.append(f"  top {col}: {best}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """A layers × heads grid per column, shaded by value (bounded: L·H cells per column)."""
        parts = [f"<div><b>{html.escape(repr(self).splitlines()[0])}</b>"]
        for col in self.columns:
            v = self.values[col]
            finite = v[~torch.isnan(v)]
            lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
            span = (hi - lo) or 1.0
            cells = []
            for li in range(v.shape[0]):
                row = "".join(
                    f"<td title='layer {li} head {h}: {float(v[li, h]):.3f}' style='width:14px;height:14px;background:"
                    f"rgba(40,90,200,{0 if math.isnan(float(v[li, h])) else (float(v[li, h]) - lo) / span:.2f})'></td>"
                    for h in range(v.shape[1]))
                cells.append(f"<tr><th style='font-size:10px'>{li}</th>{row}</tr>")
            note = html.escape(self.notes.get(col, ""))
            parts.append(f"<div style='display:inline-block;margin:4px;vertical-align:top'><div style='font-size:12px'>"
                         f"{html.escape(col)} [{lo:.2f}, {hi:.2f}]</div><table title='{note}' style='border-collapse:"
                         f"collapse'>{''.join(cells)}</table></div>")
        parts.append("</div>")
        return "".join(parts)

    def to_dict(self) -> dict:
        return {"layers": self.layers, "num_heads": self.num_heads,
                "values": {c: [[None if math.isnan(x) else round(x, 6) for x in row] for row in v.tolist()]
                           for c, v in self.values.items()}}


def _groups(records: Iterable[_Record]) -> dict[str, list[_Record]]:
    out: dict[str, list[_Record]] = {}
    for r in records:
        out.setdefault(r.name, []).append(r)
    return out


def record_sums(r: _Record, rows: slice | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One record's real rows counted per head, and each captured per-row statistic summed over them
    (float64 [h] each; ``offset o`` named ``prev`` for o = 1). ``rows``: only these rows."""
    if r.real is None:
        raise KeyError(f"record {r.name!r} holds no statistics: capture(what=('entropy', ...)).")
    sl = slice(None) if rows is None else rows
    real = r.real[:, :, sl].double()  # [B, h, r]
    sums = {}
    for col in ROW_STATS:
        t = getattr(r, col, None)
        if t is not None:
            sums[col] = (t[:, :, sl].double() * real).sum((0, 2))  # [B, h, r] -> [h]
    for o, t in sorted((r.offsets or {}).items()):
        sums["prev" if o == 1 else f"offset {o}"] = (t[:, :, sl].double() * real).sum((0, 2))  # [B, h, r] -> [h]
    return real.sum((0, 2)), sums


def head_table(records: Iterable[_Record], positions: Sequence[int] = (), rows: slice | None = None) -> HeadTable:
    """The mean of each captured per-row statistic over the real rows of every record of a layer
    (grouped by name), per head; ``offset o`` columns for captured offsets (``prev`` for o = 1);
    ``received@p`` for each key position p in ``positions``. ``rows``: only these rows of each record."""
    if rows is not None and positions:
        raise ValueError("head_table: received@p sums over every row of a record; it cannot be restricted to rows= "
                         "(pass positions= without rows=, or rows= without positions=).")
    groups = _groups(records)
    H = max((r.sizes["H"] for rs in groups.values() for r in rs), default=0)
    L = len(groups)
    sums: dict[str, torch.Tensor] = {}
    counts = torch.zeros(L, H, dtype=torch.float64)

    def add(col: str, li: int, heads: list[int], v: torch.Tensor) -> None:
        sums.setdefault(col, torch.zeros(L, H, dtype=torch.float64))
        sums[col][li, heads] += v

    for li, rs in enumerate(groups.values()):
        for r in rs:
            count, row_sums = record_sums(r, rows)
            counts[li, r.heads] += count
            for col, v in row_sums.items():
                add(col, li, r.heads, v)
            for pos in positions:
                if r.received is not None and 0 <= pos < r.received.shape[-1]:
                    add(f"received@{pos}", li, r.heads, r.received[..., pos].double().sum(0))
    n = torch.where(counts > 0, counts, float("nan"))
    values = {c: s / n for c, s in sums.items()}
    return HeadTable(list(groups), H, values)


__all__ = ["HeadTable", "head_table", "record_sums", "ROLE_THRESHOLDS"]
