"""``with bhqk.capture(...) as cap: model(x)`` records attention scores, weights, log-sum-exp,
per-head outputs and attention statistics of the selected calls, heads and query rows. Nothing is
stored on modules, and the forward runs on whatever backend it chose.

For each selected call S and P are recomputed from q and k for the selected heads and rows only
([B, h, r, K]), with the call's log-sum-exp when the backend returned one: one head of one layer
costs O(Q·K) for that head alone. Statistics are computed tile by tile (:mod:`bhqk.inspect.rowstats`:
per row [B, h, r] and per key [B, h, K], never a [Q, K] matrix), so every layer and head of a long
sequence can be captured at once. Outside a ``with capture`` block nothing is computed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import bias as bias_
from .. import masks, observe
from ..functional import reference
from ..functional.problem import Problem
from ..masks import Mask
from ..shapes import as_4d, compute_dtype
from .heads import HeadTable, head_table, received_curve, record_sums, sparkline
from .layers import Selection, heads_rows, sub_call, value_heads
from .rowstats import STATISTICS, Want, row_stats, runs
from .stats import head_stats, summary_table

MATRICES = ("scores", "weights", "lse", "head_outputs")
STATS = tuple(n for n, s in STATISTICS.items() if not s.always)  # what= may name these (rowstats.STATISTICS)
WHAT = MATRICES + STATS
# The named axes of each intermediate (H and Q hold only the captured heads and rows): the matrices,
# then each statistic's tensors as rowstats.STATISTICS declares them.
AXES = {
    "scores": ("B", "H", "Q", "K"),
    "weights": ("B", "H", "Q", "K"),
    "lse": ("B", "H", "Q"),
    "head_outputs": ("B", "H", "Q", "dv"),
    **{name: axes for s in STATISTICS.values() for name, axes in s.outputs.items()},
}


@dataclass
class Record:
    """One captured attention call; it reads like a mapping of its tensors: ``rec["entropy"]`` (or
    ``rec.entropy``; None when not captured), ``rec["offset(1)"]``, ``list(rec)`` = :meth:`captured`.

    ``heads`` are the query-head indices kept (axis H of every tensor here), ``rows`` the query indices
    kept (axis Q; ``None`` = all). ``scores`` S and ``weights`` P are [B, h, r, K] (float32, float64
    for float64 inputs; S is -inf where masked; P is before dropout), ``lse`` [B, h, r],
    ``head_outputs`` O [B, h, r, dv] (what the backend returned, before heads are merged). The
    statistics (``entropy``, ``distance``, ``sink``, :meth:`offset`, ``local``, ``topk_weights`` /
    ``topk_keys``, ``received``, ``max``, ``mass``, ``real``) are those of :mod:`bhqk.inspect.rowstats`;
    every name and its axes: :data:`AXES`.
    """

    index: int  # order of the attention call inside the capture block
    name: str  # module path (capture(model=...)) or "attention.<index>"
    backend: str
    sizes: dict[str, int]  # the call's named sizes: B, H, Hkv, Q, K, d, dv
    heads: list[int]
    rows: list[int] | None
    mask: Mask | str | None = None  # a loaded record (load_records) holds the mask's text
    offsets: dict[int, torch.Tensor] | None = None
    window: int | None = None
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # name (of AXES) -> tensor, captured only
    address: str | None = None  # the canonical address "layers.3.attn" (capture(model=...) of a mapped model)

    def __getattr__(self, name: str) -> torch.Tensor | None:
        """``rec.entropy``: the tensor named in :data:`AXES`, None when not captured."""
        if name in AXES and "values" in self.__dict__:
            return self.values.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in AXES:
            if value is None:
                self.values.pop(name, None)
            else:
                self.values[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getitem__(self, name: str) -> torch.Tensor:
        """``rec["entropy"]``, ``rec["offset(1)"]``: a captured tensor (KeyError, saying how to capture it, if not)."""
        if name.startswith("offset(") and name.endswith(")"):
            return self.offset(int(name[7:-1]))
        if name not in AXES:
            raise KeyError(f"no tensor {name!r}; a record holds {list(AXES)} and offset(o).")
        if name not in self.values:
            raise KeyError(f"{name!r} was not captured for {self.name!r} (captured: {self.captured()}).")
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.captured()

    def __iter__(self) -> Iterator[str]:
        return iter(self.captured())

    def keys(self) -> list[str]:
        return self.captured()

    def offset(self, o: int) -> torch.Tensor:
        """[B, h, r]: P on key pos(i) − ``o`` (0 where that key does not exist)."""
        if not self.offsets or o not in self.offsets:
            have = sorted(self.offsets or {})
            raise KeyError(f"offset {o} was not captured for {self.name!r} (captured: {have}); pass offsets=(..., {o}) "
                           "to capture().")
        return self.offsets[o]

    def captured(self) -> list[str]:
        """The names of the tensors this record holds."""
        names = [w for w in AXES if w in self.values]
        return names + [f"offset({o})" for o in sorted(self.offsets or {})]

    @property
    def query_positions(self) -> list[int]:
        """The query index of each captured row."""
        return list(range(self.sizes["Q"])) if self.rows is None else list(self.rows)

    def shape(self, what: str = "weights") -> str:
        """The named shape of a captured tensor, e.g. ``[B=1, H=1 of 12, Q=9, K=9]``."""
        t = self.values.get(what)
        if t is None:
            return f"{what}: not captured"
        names = AXES[what]
        full = {"H": self.sizes["H"], "Q": self.sizes["Q"]}
        parts = []
        for n, s in zip(names, t.shape):
            parts.append(f"{n}={s} of {full[n]}" if n in full and s != full[n] else f"{n}={s}")
        return "[" + ", ".join(parts) + "]"

    def head(self, h: int, what: str = "weights", b: int = 0) -> torch.Tensor:
        """One head's tensor for batch element ``b``: [r, K] (or [r] for lse); ``h`` is a head index of
        the call (not a position in ``heads``)."""
        if h not in self.heads:
            raise KeyError(f"head {h} was not captured for {self.name!r}; captured heads: {self.heads}.")
        t = self.values.get(what)
        if t is None:
            raise KeyError(f"{what!r} was not captured; pass what=(..., {what!r}) to capture().")
        return t[b, self.heads.index(h)]

    def __repr__(self) -> str:
        got = ", ".join(f"{w} {self.shape(w)}" for w in AXES if w in self.values)
        if self.offsets:
            got += ", offsets " + str(sorted(self.offsets))
        return f"Record(#{self.index} {self.name!r}, backend={self.backend!r}, {got})"

    def head_means(self) -> dict[str, torch.Tensor]:
        """Each captured per-row statistic averaged over the real rows of every batch element: [h]."""
        if self.real is None:
            return {}
        count, sums = record_sums(self)  # [h], {column: [h]}: as in head_table
        return {c: s / count.clamp(min=1) for c, s in sums.items()}

    def _repr_html_(self) -> str:
        """Jupyter: the call, its named shapes, per-head means and the received curve (bounded size:
        at most 64 heads listed and a 240-point curve, at any Q and K)."""
        import html

        s = self.sizes
        sizes = ", ".join(f"{k}={v}" for k, v in s.items())
        shapes = "".join(f"<li><code>{html.escape(n)}</code> {html.escape(self.shape(n))}</li>"
                         for n in AXES if n in self.values)
        parts = [f"<div><b>Record #{self.index}</b> <code>{html.escape(self.name)}</code> ({html.escape(self.backend)}; "
                 f"{html.escape(sizes)})<ul>{shapes}</ul>"]
        means = self.head_means()
        if means:
            cols = list(means)
            head = "".join(f"<th>{html.escape(c)}</th>" for c in ["head", *cols])
            body = "".join("<tr>" + f"<td>{h}</td>" + "".join(f"<td>{float(means[c][i]):.3f}</td>" for c in cols) + "</tr>"
                           for i, h in enumerate(self.heads[:64]))
            more = f"<div>… {len(self.heads) - 64} more heads</div>" if len(self.heads) > 64 else ""
            parts.append(f"<table style='font-size:12px'><tr>{head}</tr>{body}</table>{more}")
        if self.received is not None and self.real is not None:
            curve = received_curve(self)  # [K]
            parts.append(f"<div style='font-size:12px'>attention received per key (log scale, K={curve.numel()})</div>"
                         + sparkline(curve))
        parts.append("</div>")
        return "".join(parts)


def _tile(get, rows: list[int] | None, Q: int, K: int, heads: list[int], H: int) -> torch.Tensor:
    """A mask or bias evaluated on the selected rows only, heads selected: [#B, #h, r, K]."""
    spans = [(0, Q)] if rows is None else runs(rows)
    parts = []
    for q0, q1 in spans:
        t = as_4d(get(q0, q1))  # [#B, #H, #q, #K]
        parts.append(t.expand(*t.shape[:2], q1 - q0, K))  # [#B, #H, q, K]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [#B, #H, r, K]
    return value_heads(t, heads, H)  # [#B, #H, r, K] -> [#B, #h, r, K]


def narrow(p: Problem, heads: list[int], rows: list[int] | None) -> Problem:
    """The call restricted to the query heads ``heads`` and the query rows ``rows`` (None: all):
    q [B, h, r, d], k and v [B, h, K, ·] (the K/V head of each selected head), the mask and the bias
    as dense [#B, #h, r, K] tiles. Nothing of the other heads' [Q, K] is built."""
    ext, dev = p.ext, p.q.device
    mask = bias = None
    if p.mask is not None:
        mask = masks.dense(_tile(lambda q0, q1: p.mask.block(ext, q0, q1, 0, ext.K, dev), rows, ext.Q, ext.K, heads, ext.H))
    if p.bias is not None:
        dt = compute_dtype(p.q)
        bias = bias_.dense(_tile(lambda q0, q1: p.bias.block(ext, q0, q1, 0, ext.K, dev, dt), rows, ext.Q, ext.K, heads, ext.H))
    return sub_call(p, heads, mask, bias, rows)


def recompute(p: Problem, heads: list[int], rows: list[int] | None, lse: torch.Tensor | None = None):
    """(S, P, lse) for the selected heads and rows of one call: [B, h, r, K], [B, h, r, K], [B, h, r].

    The reference's scores on the call narrowed to those heads and rows (:func:`narrow`). With ``lse``
    (the call's log-sum-exp [B, H, Q]) P = exp(S − lse) and no row reduction is needed.
    """
    narrowed = narrow(p, heads, rows)
    S, _ = reference.scores(narrowed)  # [B, h, r, K]
    if lse is None:
        return (S, *reference.softmax_rows(S, narrowed.sinks))
    lse_sel = heads_rows(lse, heads, rows).to(S.dtype)  # [B, H, Q] -> [B, h, r]
    finite = torch.isfinite(lse_sel)[..., None]  # [B, h, r, 1]; -inf marks a fully masked row
    P = torch.where(finite, torch.exp(S - torch.where(finite, lse_sel[..., None], 0.0)), 0.0)
    return S, P, lse_sel


class Capture:
    """An observer that keeps the selected intermediates of each attention call (see :func:`capture`)."""

    def __init__(self, layers: int | str | Iterable[int | str] | None = None,
                 heads: int | Iterable[int] | None = None, rows: int | Iterable[int] | None = None,
                 what: str | Iterable[str] = ("weights",), model: nn.Module | None = None,
                 offsets: Iterable[int] = (), window: int | None = None, topk: int = 0, block_q: int | None = None,
                 block_k: int | None = None, who: str = "capture") -> None:
        self.what = (what,) if isinstance(what, str) else tuple(what)
        bad = [w for w in self.what if w not in WHAT]
        if bad:
            raise ValueError(f"{who}: unknown what={bad}; choose from {list(WHAT)}.")
        self.offsets = tuple(sorted({int(o) for o in offsets}))
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{who}: window must be a whole number of keys >= 1, got {window!r}.")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"{who}: topk must be a whole number >= 0, got {topk!r}.")
        want = Want(tuple(w for w in self.what if w in STATS), self.offsets, window, topk)
        given = {n for n, s in STATISTICS.items() if s.option and getattr(want, s.option)}  # offset, local, topk
        for n in STATS:
            option = STATISTICS[n].option
            if option and n in self.what and n not in given:
                raise ValueError(f"capture: what={n!r} needs {option}={_NEEDS[option]}.")
        self.want = want if (set(self.what) | given) & set(STATS) else None
        self.wants_lse = self.want is not None  # statistics start from each row's lse: asked of the call (observe)
        self.blocks = (block_q, block_k)
        self.selection = Selection(who, layers, heads, model, rows)  # the same selection and errors as edit
        self.layers, self.heads, self.rows = self.selection.layers, self.selection.heads, self.selection.rows
        self.records: list[Record] = []

    @property
    def calls(self) -> int:
        """Attention calls seen inside the block, selected or not."""
        return self.selection.calls

    # ---- observer -------------------------------------------------------------------------
    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event != "attention":
            return
        index, name, hit = self.selection.call(data.get("module"))
        if not hit:
            return
        p: Problem = data["problem"]
        heads = self.selection.heads_of(p.ext.H, name)
        rows = self.selection.rows_of(p.ext.Q, name)  # None: every row, no gather needed
        rec = Record(index, name, data["backend"], dict(p.sizes.size), heads, rows, p.mask,
                     address=self.selection.addresses.get(name))
        with torch.no_grad():
            if {"scores", "weights", "lse"} & set(self.what):
                S, P, lse = recompute(p, heads, rows, data.get("lse"))
                for n, t in (("scores", S), ("weights", P), ("lse", lse)):
                    if n in self.what:
                        rec.values[n] = t.detach()
            if "head_outputs" in self.what:
                rec.values["head_outputs"] = heads_rows(data["out"].detach(), heads, rows)  # [B, H, Q, dv] -> [B, h, r, dv]
            if self.want is not None:
                self._statistics(rec, p, heads, rows, data.get("lse"))
        self.records.append(rec)

    def _statistics(self, rec: Record, p: Problem, heads: list[int], rows: list[int] | None, lse) -> None:
        w = self.want
        assert w is not None  # called only when statistics were asked for
        st = row_stats(p, heads, rows, lse, w, block_q=self.blocks[0], block_k=self.blocks[1])
        for n in w.names():
            for out in STATISTICS[n].outputs:
                rec.values[out] = st[out]
        rec.window, rec.offsets = w.window, st.get("offset")
        if "lse" in self.what and "lse" not in rec.values:
            rec.values["lse"] = st["lse"]

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __getitem__(self, key: int | str) -> Record:
        """By call index (``cap[0]`` = the first attention call) or by name."""
        for r in self.records:
            if (r.index == key) if isinstance(key, int) else (r.name == key):
                return r
        have = [(r.index, r.name) for r in self.records]
        raise KeyError(f"no captured call {key!r}; captured (index, name): {have}.")

    def stack(self, what: str = "weights") -> torch.Tensor:
        """Every record's tensor stacked on a new leading layer axis: [L, B, h, r, K] for weights."""
        ts = [getattr(r, what) for r in self.records]
        if not ts or any(t is None for t in ts):
            raise KeyError(f"{what!r} was not captured for every call.")
        return torch.stack(ts)

    def head_table(self, positions: Sequence[int] = ()) -> HeadTable:
        """A table per layer (records grouped by name) × head of the captured statistics, each the mean
        over the real rows of every batch element and call; ``received@p`` for each key p in ``positions``.
        For role scores with their controls (previous-token, induction) see :func:`bhqk.inspect.detect`."""
        return head_table(self.records, positions)

    def stats(self, tokens: Sequence[str] | None = None, *, b: int = 0, special: Iterable[str] = ("[CLS]", "[SEP]")):
        """Per call and head of batch element ``b``, from captured weights (``what=("weights",)``): entropy,
        mean distance, share on the first token and on special tokens. For statistics of every layer and
        head without the weights, :meth:`head_table` is the one view (this says so when no weights were
        captured)."""
        if self.records and all(r.weights is None for r in self.records):
            raise KeyError(self._go_to_head_table("stats()"))
        return head_stats(self, tokens, b=b, special=special)

    def summary(self, tokens: Sequence[str] | None = None, *, b: int = 0, special: Iterable[str] = ("[CLS]", "[SEP]")) -> str:
        """The head statistics as a table: :meth:`head_table`'s (one row per layer and head) when statistics
        were captured, else one row per (call, head) from captured weights (:meth:`stats`)."""
        if self.records and all(r.real is not None for r in self.records):
            return str(self.head_table())
        if self.records and all(r.weights is None for r in self.records):
            raise KeyError(self._go_to_head_table("summary()"))
        return summary_table(self.stats(tokens, b=b, special=special), special=tuple(special) if tokens else ())

    def _go_to_head_table(self, what: str) -> str:
        if any(r.real is not None for r in self.records):
            return (f"cap.{what} reads captured weights; this capture holds statistics computed without them: "
                    "cap.head_table() is their table (str(table) prints it).")
        return (f"cap.{what} has nothing to read: capture statistics with what=('entropy', 'distance', 'sink', "
                "'received') and read cap.head_table().")

    # ---- taking it away -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the records (every captured tensor, the sizes, heads, rows) to ``path`` with ``torch.save``;
        :func:`load_records` reads them back (``head_table(load_records(path))``). Masks are kept as text."""
        return save_records(self.records, path)

    def __repr__(self) -> str:
        names = list(dict.fromkeys(r.name for r in self.records))
        shown = ", ".join(names[:4]) + (f", … ({len(names) - 4} more)" if len(names) > 4 else "")
        return (f"Capture({len(self.records)} of {self.calls} attention calls, {len(names)} layers [{shown}], "
                f"what={list(self.what)}" + (f", offsets={list(self.offsets)}" if self.offsets else "") + ")")

    def _repr_html_(self) -> str:
        """Jupyter: the summary, the head table as layers × heads grids (if statistics were captured)
        and the first records; bounded by L·H cells per statistic, not by Q or K."""
        import html

        parts = [f"<div><b>{html.escape(repr(self))}</b>"]
        if any(r.real is not None for r in self.records):
            parts.append(self.head_table()._repr_html_())
        items = "".join(f"<li>{html.escape(repr(r))}</li>" for r in self.records[:8])
        more = f"<li>… {len(self.records) - 8} more</li>" if len(self.records) > 8 else ""
        parts.append(f"<ul style='font-size:12px'>{items}{more}</ul></div>")
        return "".join(parts)

    def __str__(self) -> str:
        if not self.records:
            return f"capture: nothing recorded ({self.calls} attention calls seen)"
        lines = [f"capture: {len(self.records)} of {self.calls} attention calls"]
        for r in self.records:
            lines.append(f"  #{r.index} {r.name} ({r.backend}): " + ", ".join(
                f"{w} {r.shape(w)}" for w in AXES if w in r.values))
        return "\n".join(lines)


_NEEDS = {"offsets": "(o, ...): P on key pos(i) − o", "window": "W: the mass on keys with |pos(i) − k| < W",
          "topk": "t: the t largest weights of each row"}


def save_records(records: Iterable[Record], path: str | Path) -> Path:
    """Records as plain data (tensors, ints, strings; the mask as its repr) in one ``torch.save`` file."""
    data = []
    for r in records:
        d: dict[str, Any] = {"index": r.index, "name": r.name, "backend": r.backend, "sizes": dict(r.sizes),
                             "heads": list(r.heads), "rows": None if r.rows is None else list(r.rows),
                             "mask": None if r.mask is None else repr(r.mask), "window": r.window, "address": r.address,
                             "offsets": None if r.offsets is None else {int(o): t.cpu() for o, t in r.offsets.items()}}
        d.update({n: r.values[n].cpu() if n in r.values else None for n in AXES})
        data.append(d)
    path = Path(path)
    torch.save({"bhqk.records": 1, "records": data}, path)
    return path


def load_records(path: str | Path) -> list[Record]:
    """The records :func:`save_records` (or ``Capture.save``) wrote; ``record.mask`` is the mask's text."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises its own types for a file it cannot read
        raise ValueError(f"{path}: not a file of bhqk records ({type(e).__name__}: {e}).") from None
    if not isinstance(blob, dict) or blob.get("bhqk.records") != 1:
        raise ValueError(f"{path}: not a file of bhqk records (written by Capture.save / save_records).")
    out = []
    for d in blob["records"]:
        values = {n: d.pop(n) for n in list(d) if n in AXES}  # tensors by name (a file may lack newer names)
        out.append(Record(**d, values={n: t for n, t in values.items() if t is not None}))
    return out


@contextlib.contextmanager
def capture(layers: int | str | Iterable[int | str] | None = None, heads: int | Iterable[int] | None = None,
            what: str | Iterable[str] = ("weights",), *, rows: int | Iterable[int] | None = None,
            model: nn.Module | None = None, offsets: Iterable[int] = (), window: int | None = None, topk: int = 0,
            block_q: int | None = None, block_k: int | None = None) -> Iterator[Capture]:
    """Record attention intermediates of the calls inside the block.

    ``layers``: call indices (order of the attention calls in the block, from 0) and/or module-path
    names (globs allowed, e.g. ``"encoder.layer.*"``; names need ``model=``). ``heads``: query-head
    indices. ``rows``: query indices. ``None`` selects all; one index or a bare string selects one (the
    same selection, and errors, as ``edit``). ``what``: any of :data:`WHAT`: ``"scores"``, ``"weights"``,
    ``"lse"``, ``"head_outputs"`` and the statistics (``"entropy"``, ``"distance"``, ``"sink"``,
    ``"received"``, ...: O(r + K) per head; see :class:`Record`); ``offsets=(1, ...)`` adds P on key
    pos(i) − o, ``window=W`` the mass within W keys, ``topk=t`` each row's t heaviest keys. A block
    that recorded nothing raises at its end, naming what was given and what ran (or that no attention
    call ran on bhqk, and how to register it).
    """
    cap = Capture(layers, heads, rows, what, model, offsets, window, topk, block_q, block_k)
    with observe.observing(cap):
        yield cap
    cap.selection.finish()  # a block that recorded nothing says why (not when the block itself raised)


__all__ = ["capture", "Capture", "Record", "recompute", "narrow", "save_records", "load_records"]
