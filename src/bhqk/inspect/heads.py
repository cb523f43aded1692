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
- ``sink``: P on the first key the row may attend (key 0 when the row is not padded; the first real
  key of a left-padded row); ``local``: P within ``window`` keys; ``entropy``, ``distance``: as in capture;
- ``received@p``: the mean P each row gives to key p (chosen positions).

Rows of the table are layers named by the model: module paths, and the model's layer index of each
(:func:`layer_id`), which :meth:`HeadTable.roles` and :meth:`HeadTable.top` report.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from ..text import table
from .rowstats import STATISTICS

# The per-row statistics the head table averages over the real rows, as rowstats.STATISTICS marks them.
ROW_STATS = tuple(n for n, s in STATISTICS.items() if s.column)
# What a score must reach for :meth:`HeadTable.roles` to name the role: ``prev``, ``sink``, ``local`` are
# a share of each row's attention (P mass, 0 … 1); ``induction`` is P on the induction target on the
# repeated sequence minus the same offset's P on the control.
ROLE_THRESHOLDS = {"prev": 0.5, "induction": 0.3, "sink": 0.5, "local": 0.9}


class _Head(NamedTuple):
    layer: int  # the model's layer index (HeadTable.ids), not the row of the table
    head: int
    value: float


class Head(_Head):
    """One head of :meth:`HeadTable.top`: (layer, head, value) as a tuple; ``.name``: the module path."""

    name: str

    def __repr__(self) -> str:
        return f"Head(layer={self.layer}, head={self.head}, value={self.value:.4g}, name={self.name!r})"


class _Role(NamedTuple):
    layer: int  # the model's layer index (HeadTable.ids), not the row of the table
    head: int
    role: str
    score: float


class Role(_Role):
    """One role of :meth:`HeadTable.roles`: (layer, head, role, score) as a tuple; ``.name``: the module path."""

    name: str

    def __repr__(self) -> str:
        return f"Role(layer={self.layer}, head={self.head}, role={self.role!r}, score={self.score:.4g}, name={self.name!r})"


def _named(cls, name: str, *fields):
    t = cls(*fields)
    t.name = name
    return t


def layer_id(name: str, default: int) -> int:
    """The model's layer index in a module path: its first all-digit part (``model.layers.1.self_attn``
    → 1, ``encoder.layer.0.attention.self`` → 0, ``attention.3`` → 3); ``default`` when it has none."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else default


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
    captured), its rows in the order of ``layers`` (module paths, or ``attention.<i>``); ``ids`` holds
    the model's layer index of each row (see the module doc)."""

    layers: list[str]
    num_heads: int
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # column -> what it means
    ids: list[int] = field(default_factory=list)  # the model's layer index of each row (from the path)

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = [layer_id(n, i) for i, n in enumerate(self.layers)]

    def __getitem__(self, column: str) -> torch.Tensor:
        if column not in self.values:
            raise KeyError(f"no column {column!r}; columns: {list(self.values)}.")
        return self.values[column]

    @property
    def columns(self) -> list[str]:
        return list(self.values)

    def top(self, column: str, n: int = 3, *, lowest: bool = False) -> list[Head]:
        """The ``n`` heads with the highest ``column`` (``lowest``: the lowest): (layer, head, value), layer
        the model's index, ``.name`` the module path."""
        v = self[column]
        fill = float("inf") if lowest else float("-inf")
        flat = torch.where(torch.isnan(v), fill, v).flatten()  # [L, H] -> [L·H], index i = row·H + head
        idx = flat.argsort(descending=not lowest, stable=True)[:n]
        H = v.shape[1]
        return [_named(Head, self.layers[int(i) // H], self.ids[int(i) // H], int(i) % H, float(flat[i]))
                for i in idx if math.isfinite(float(flat[i]))]

    def roles(self, thresholds: dict[str, float] | None = None) -> list[Role]:
        """(layer, head, role, score) for every head whose score reaches the role's threshold (layer: the
        model's index; ``.name``: the module path). ``thresholds`` overrides :data:`ROLE_THRESHOLDS` for
        the roles it names (any column may be named) and keeps the others."""
        given = dict(thresholds or {})
        unknown = [r for r in given if r not in ROLE_THRESHOLDS and r not in self.values]
        if unknown:
            raise KeyError(f"roles: no role or column {unknown}; roles {list(ROLE_THRESHOLDS)}, columns {self.columns}.")
        out = []
        for role, t in {**ROLE_THRESHOLDS, **given}.items():
            if role not in self.values:
                continue
            v = self.values[role]
            for li, h in (v >= t).nonzero().tolist():
                out.append(_named(Role, self.layers[li], self.ids[li], h, role, float(v[li, h])))
        return sorted(out, key=lambda r: (r.layer, r.name, r.head, r.role))

    def rows(self) -> list[list]:
        """One row per captured head: [layer (the model's index), name, head, one float per column (NaN
        where not captured)]."""
        out = []
        for li, name in enumerate(self.layers):
            for h in range(self.num_heads):
                vals = [float(self.values[c][li, h]) for c in self.values]
                if all(math.isnan(x) for x in vals):
                    continue
                out.append([self.ids[li], name, h, *vals])
        return out

    def __str__(self) -> str:
        return table(["layer", "name", "head"] + self.columns,
                     [r[:3] + ["-" if math.isnan(x) else f"{x:.3f}" for x in r[3:]] for r in self.rows()])

    def __repr__(self) -> str:
        L, H = len(self.layers), self.num_heads
        lines = [f"HeadTable({L} layers × {H} heads; columns {', '.join(self.columns)})"]
        for col in self.columns:
            best = ", ".join(f"L{t.layer}.H{t.head}={t.value:.2f}" for t in self.top(col, 3))
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
                    f"<td title='layer {self.ids[li]} head {h}: {float(v[li, h]):.3f}' style='width:14px;height:14px;"
                    f"background:rgba(40,90,200,{0 if math.isnan(float(v[li, h])) else (float(v[li, h]) - lo) / span:.2f})'>"
                    "</td>" for h in range(v.shape[1]))
                cells.append(f"<tr><th style='font-size:10px'>{self.ids[li]}</th>{row}</tr>")
            note = html.escape(self.notes.get(col, ""))
            parts.append(f"<div style='display:inline-block;margin:4px;vertical-align:top'><div style='font-size:12px'>"
                         f"{html.escape(col)} [{lo:.2f}, {hi:.2f}]</div><table title='{note}' style='border-collapse:"
                         f"collapse'>{''.join(cells)}</table></div>")
        parts.append("</div>")
        return "".join(parts)

    # ---- taking it away ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain data: ``layers``, ``ids``, ``num_heads``, ``values`` (column -> [L][H] numbers, None where
        not captured), ``notes``. :meth:`from_dict` reads it back."""
        return {"layers": list(self.layers), "ids": list(self.ids), "num_heads": self.num_heads,
                "values": {c: [[None if math.isnan(x) else x for x in row] for row in v.double().tolist()]
                           for c, v in self.values.items()},
                "notes": dict(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> HeadTable:
        try:
            values = {c: torch.tensor([[math.nan if x is None else float(x) for x in row] for row in rows],
                                      dtype=torch.float64).reshape(len(d["layers"]), int(d["num_heads"]))  # [L, H]
                      for c, rows in d["values"].items()}
            return cls(list(d["layers"]), int(d["num_heads"]), values, dict(d.get("notes", {})), list(d.get("ids", [])))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"HeadTable.from_dict: not a head table ({type(e).__name__}: {e}); expected the keys "
                             "layers, num_heads, values ([L][H] per column).") from None

    def to_json(self, path: str | Path | None = None) -> str:
        """The table as JSON (:meth:`to_dict`; exact float64 values, ``null`` where not captured); written
        to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> HeadTable:
        """A table from :meth:`to_json`'s text or a file holding it."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            path = Path(source)
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}).") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"HeadTable.from_json: not JSON ({e}).") from None
        return cls.from_dict(d)

    def to_csv(self, path: str | Path | None = None) -> str:
        """One line per captured head: layer, name, head, then the columns (empty where not captured);
        written to ``path`` when given."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["layer", "name", "head", *self.columns])
        for r in self.rows():
            w.writerow(r[:3] + ["" if math.isnan(x) else repr(x) for x in r[3:]])
        text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


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
    groups: dict[str, list[_Record]] = {}  # the records of each layer (by name), in order
    for r in records:
        groups.setdefault(r.name, []).append(r)
    if positions:
        bad = [p for p in positions if isinstance(p, bool) or not isinstance(p, int) or p < 0]
        if bad:
            raise ValueError(f"head_table: positions are key positions >= 0, got {bad}.")
        Ks = [r.received.shape[-1] for rs in groups.values() for r in rs if r.received is not None]
        if not Ks:
            raise ValueError("head_table: positions= reads the attention each key receives; capture it with "
                             "what=(..., 'received').")
        beyond = [p for p in positions if p >= max(Ks)]
        if beyond:
            raise ValueError(f"head_table: positions {beyond} lie beyond every captured call's keys (K ≤ {max(Ks)}; "
                             f"positions run 0 … {max(Ks) - 1}).")
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


# ---- the received curve (notebook summaries here, pictures in bhqk.viz.stats_page) ---------------------


def received_curve(r) -> torch.Tensor:
    """A record's attention received by each key per real row and head: [K] (float64)."""
    return r.received.double().sum((0, 1)) / max(1.0, float(r.real.sum()))  # [B, h, K] -> [K]; real rows × heads × batch


def bin_mean(x: torch.Tensor, points: int) -> torch.Tensor:
    """``x`` [K] averaged into ceil(K / ceil(K / points)) ≤ points bins."""
    K = x.numel()
    if K <= points:
        return x
    w = math.ceil(K / points)
    pad = (-K) % w
    xp = torch.cat([x, x.new_full((pad,), float("nan"))])  # [K + pad]
    return xp.view(-1, w).nanmean(-1)  # [K + pad] -> [bins, w] -> [bins]


def sparkline(curve: torch.Tensor, width: int = 240, height: int = 40) -> str:
    """An inline SVG polyline of ``curve`` (any length: binned to ``width`` points), log-scaled."""
    c = bin_mean(curve.double(), width)
    if c.numel() == 0:
        return ""
    y = torch.log10(c.clamp(min=1e-9))
    lo, hi = float(y.min()), float(y.max())
    span = (hi - lo) or 1.0
    pts = " ".join(f"{i * width / max(1, c.numel() - 1):.1f},{height - (float(v) - lo) / span * height:.1f}"
                   for i, v in enumerate(y))
    return (f"<svg width='{width}' height='{height}' viewBox='0 0 {width} {height}'>"
            f"<polyline fill='none' stroke='#2a5ac8' stroke-width='1' points='{pts}'/></svg>")


__all__ = ["HeadTable", "Head", "Role", "head_table", "record_sums", "layer_id", "ROLE_THRESHOLDS", "received_curve",
           "bin_mean", "sparkline"]
