"""``with bhqk.capture(...) as cap: model(x)`` records attention scores, weights, log-sum-exp and
per-head outputs of the selected calls, heads and query rows. Nothing is stored on modules.

The forward is not changed: it runs on whatever backend it chose (tiled, torch, reference). For each
selected call the capture recomputes S and P from q and k for the selected heads and rows only
(``[B, h, r, K]``, h = selected heads, r = selected rows), using the call's saved log-sum-exp when the
backend returned one. Capturing one head of one layer therefore costs O(Q·K) for that head alone.
Outside a ``with capture`` block nothing is observed and nothing is computed.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import bias as bias_
from .. import masks, observe
from ..functional import reference
from ..functional.problem import Problem
from ..masks import Mask
from ..shapes import Sizes, as_4d, compute_dtype

WHAT = ("scores", "weights", "lse", "head_outputs")
# The named axes of each intermediate (H and Q hold only the captured heads and rows).
AXES = {
    "scores": ("B", "H", "Q", "K"),
    "weights": ("B", "H", "Q", "K"),
    "lse": ("B", "H", "Q"),
    "head_outputs": ("B", "H", "Q", "dv"),
}


@dataclass
class Record:
    """One captured attention call.

    ``heads`` are the query-head indices kept (axis H of every tensor here), ``rows`` the query indices
    kept (axis Q; ``None`` = all). ``scores`` S and ``weights`` P are [B, h, r, K] (float32, float64
    for float64 inputs; S is -inf where masked; P is before dropout), ``lse`` [B, h, r],
    ``head_outputs`` O [B, h, r, dv] (what the backend returned, before heads are merged).
    """

    index: int  # order of the attention call inside the capture block
    name: str  # module path (capture(model=...)) or "attention.<index>"
    backend: str
    sizes: dict[str, int]  # the call's named sizes: B, H, Hkv, Q, K, d, dv
    heads: list[int]
    rows: list[int] | None
    mask: Mask | None = None
    scores: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    head_outputs: torch.Tensor | None = None

    @property
    def query_positions(self) -> list[int]:
        """The query index of each captured row."""
        return list(range(self.sizes["Q"])) if self.rows is None else list(self.rows)

    def shape(self, what: str = "weights") -> str:
        """The named shape of a captured tensor, e.g. ``[B=1, H=1 of 12, Q=9, K=9]``."""
        t = getattr(self, what)
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
        t = getattr(self, what)
        if t is None:
            raise KeyError(f"{what!r} was not captured; pass what=(..., {what!r}) to capture().")
        return t[b, self.heads.index(h)]

    def __repr__(self) -> str:
        got = ", ".join(f"{w} {self.shape(w)}" for w in WHAT if getattr(self, w) is not None)
        return f"Record(#{self.index} {self.name!r}, backend={self.backend!r}, {got})"


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs [start, stop) of sorted unique query indices."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _tile(get, rows: list[int] | None, Q: int, K: int, heads: list[int], H: int) -> torch.Tensor:
    """A mask or bias evaluated on the selected rows only, heads selected: [#B, #h, r, K]."""
    spans = [(0, Q)] if rows is None else _runs(rows)
    parts = []
    for q0, q1 in spans:
        t = as_4d(get(q0, q1))  # [#B, #H, #q, #K]
        parts.append(t.expand(*t.shape[:2], q1 - q0, K))  # [#B, #H, q, K]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [#B, #H, r, K]
    if t.shape[1] == H and H != 1:
        t = t[:, heads]  # [#B, H, r, K] -> [#B, h, r, K]
    return t


def narrow(p: Problem, heads: list[int], rows: list[int] | None) -> Problem:
    """The call restricted to the query heads ``heads`` and the query rows ``rows`` (None: all):
    q [B, h, r, d], k and v [B, h, K, ·] (the K/V head of each selected head), the mask and the bias
    as dense [#B, #h, r, K] tiles. Nothing of the other heads' [Q, K] is built."""
    ext, dev = p.ext, p.q.device
    hi = torch.tensor(heads, device=dev)
    q = p.q.index_select(1, hi)  # [B, H, Q, d] -> [B, h, Q, d]
    if rows is not None:
        q = q.index_select(2, torch.tensor(rows, device=dev))  # [B, h, Q, d] -> [B, h, r, d]
    k, v = (t.index_select(1, hi // p.groups) for t in (p.k, p.v))  # [B, Hkv, K, ·] -> [B, h, K, ·]: head h reads K/V head h // G
    mask = bias = None
    if p.mask is not None:
        mask = masks.dense(_tile(lambda q0, q1: p.mask.block(ext, q0, q1, 0, ext.K, dev), rows, ext.Q, ext.K, heads, ext.H))
    if p.bias is not None:
        dt = compute_dtype(p.q)
        bias = bias_.dense(_tile(lambda q0, q1: p.bias.block(ext, q0, q1, 0, ext.K, dev, dt), rows, ext.Q, ext.K, heads, ext.H))
    sizes = Sizes(B=ext.B, H=len(heads), Hkv=len(heads), Q=q.shape[2], K=ext.K, d=q.shape[3], dv=v.shape[3])
    sinks = p.sinks[heads] if p.sinks is not None else None  # [H] -> [h]
    return Problem(q, k, v, sizes, mask, bias, p.scale, p.softcap, sinks=sinks)


def recompute(p: Problem, heads: list[int], rows: list[int] | None, lse: torch.Tensor | None = None):
    """(S, P, lse) for the selected heads and rows of one call: [B, h, r, K], [B, h, r, K], [B, h, r].

    The reference's scores on the call narrowed to those heads and rows (:func:`narrow`). With ``lse``
    (the call's log-sum-exp [B, H, Q]) P = exp(S − lse) and no row reduction is needed.
    """
    narrowed = narrow(p, heads, rows)
    S, _ = reference.scores(narrowed)  # [B, h, r, K]
    if lse is None:
        return (S, *reference.softmax_rows(S, narrowed.sinks))
    lse_sel = lse.index_select(1, torch.tensor(heads, device=lse.device)).to(S.dtype)  # [B, H, Q] -> [B, h, Q]
    if rows is not None:
        lse_sel = lse_sel.index_select(2, torch.tensor(rows, device=lse.device))  # [B, h, r]
    finite = torch.isfinite(lse_sel)[..., None]  # [B, h, r, 1]; -inf marks a fully masked row
    P = torch.where(finite, torch.exp(S - torch.where(finite, lse_sel[..., None], 0.0)), 0.0)
    return S, P, lse_sel


class Capture:
    """An observer that keeps the selected intermediates of each attention call (see :func:`capture`)."""

    def __init__(
        self,
        layers: int | str | Iterable[int | str] | None = None,
        heads: Iterable[int] | None = None,
        rows: Iterable[int] | None = None,
        what: str | Iterable[str] = ("weights",),
        model: nn.Module | None = None,
    ) -> None:
        self.what = (what,) if isinstance(what, str) else tuple(what)
        bad = [w for w in self.what if w not in WHAT]
        if bad:
            raise ValueError(f"capture: unknown what={bad}; choose from {list(WHAT)}.")
        if layers is not None and isinstance(layers, (int, str)):
            layers = [layers]
        self.layers = None if layers is None else list(layers)
        for sel in self.layers or []:
            if isinstance(sel, bool) or not isinstance(sel, (int, str)) or (isinstance(sel, int) and sel < 0):
                raise ValueError(f"capture: layers takes call indices >= 0 and module-path names, got {sel!r}.")
        self.heads = None if heads is None else sorted({int(h) for h in heads})
        self.rows = None if rows is None else sorted({int(r) for r in rows})
        self._names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self.records: list[Record] = []
        self.calls = 0  # attention calls seen, selected or not

    # ---- observer -------------------------------------------------------------------------
    def selected(self, index: int, name: str) -> bool:
        if self.layers is None:
            return True
        return any(sel == index if isinstance(sel, int) else fnmatch.fnmatchcase(name, sel) for sel in self.layers)

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event != "attention":
            return
        index = self.calls
        self.calls += 1
        name = self._names.get(id(data.get("module")), f"attention.{index}")
        if not self.selected(index, name):
            return
        p: Problem = data["problem"]
        H, Q = p.ext.H, p.ext.Q
        heads = list(range(H)) if self.heads is None else self.heads
        rows = self.rows
        for arg, sel, n, size in (("heads", heads, "H", H), ("rows", rows or [], "Q", Q)):
            if sel and not (sel[0] >= 0 and sel[-1] < size):
                raise IndexError(f"capture: {arg} {sel} out of range for call {name!r} with {n}={size}.")
        if rows is not None and len(rows) == Q:
            rows = None  # every row: no gather needed
        rec = Record(index, name, data["backend"], dict(p.sizes.size), heads, rows, p.mask)
        with torch.no_grad():
            if {"scores", "weights", "lse"} & set(self.what):
                S, P, lse = recompute(p, heads, rows, data.get("lse"))
                rec.scores = S.detach() if "scores" in self.what else None
                rec.weights = P.detach() if "weights" in self.what else None
                rec.lse = lse.detach() if "lse" in self.what else None
            if "head_outputs" in self.what:
                o = data["out"].detach()[:, heads]  # [B, H, Q, dv] -> [B, h, Q, dv]
                rec.head_outputs = o if rows is None else o[:, :, rows]  # [B, h, r, dv]
        self.records.append(rec)

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

    def stats(self, tokens: Sequence[str] | None = None, *, b: int = 0, special: Iterable[str] = ("[CLS]", "[SEP]")):
        """Per call and head: entropy, mean distance, share on the first token and on special tokens."""
        from .stats import head_stats

        return head_stats(self, tokens, b=b, special=special)

    def summary(self, tokens: Sequence[str] | None = None, *, b: int = 0, special: Iterable[str] = ("[CLS]", "[SEP]")) -> str:
        """The head statistics as a table, one row per (call, head)."""
        from .stats import summary_table

        return summary_table(self.stats(tokens, b=b, special=special), special=tuple(special) if tokens else ())

    def __str__(self) -> str:
        if not self.records:
            return f"capture: nothing recorded ({self.calls} attention calls seen)"
        lines = [f"capture: {len(self.records)} of {self.calls} attention calls"]
        for r in self.records:
            lines.append(f"  #{r.index} {r.name} ({r.backend}): " + ", ".join(
                f"{w} {r.shape(w)}" for w in WHAT if getattr(r, w) is not None))
        return "\n".join(lines)


@contextlib.contextmanager
def capture(
    layers: int | str | Iterable[int | str] | None = None,
    heads: Iterable[int] | None = None,
    what: str | Iterable[str] = ("weights",),
    *,
    rows: Iterable[int] | None = None,
    model: nn.Module | None = None,
) -> Iterator[Capture]:
    """Record attention intermediates of the calls inside the block.

    ``layers``: call indices (order of the attention calls in the block, from 0) and/or module-path
    names (globs allowed, e.g. ``"encoder.layer.*"``; names need ``model=``). ``heads``: query-head
    indices. ``rows``: query indices. ``what``: any of ``"scores"``, ``"weights"``, ``"lse"``,
    ``"head_outputs"``. ``None`` selects all. The forward itself is untouched.
    """
    cap = Capture(layers, heads, rows, what, model)
    with observe.observing(cap):
        yield cap


__all__ = ["capture", "Capture", "Record", "recompute", "narrow"]
