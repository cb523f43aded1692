"""A head-wise KV budget: which key/value heads of which layer keep every key ("full") and which
keep only a sink and a recent window ("streaming").

A streaming head with sink S and window W sees keys 0 … S−1 and the W keys before its query plus
its own (key index coordinates, as in the model's cache), ANDed with the model's own mask:
``~masks.key_span(0, S) | masks.sliding_window(W, align="bottom_right")`` (docs/design.md §2).
All False = StreamingLLM on every head; all True = the model as it is.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import masks
from ..errors import LoadError, ShapeError
from ..integrations.model_map import ModelMap, ModelShape, model_map
from ..text import table
from .mask import streaming_mask

FORMAT = "bhqk.budget.Plan/1"


def kept_full(length: int, window: int | None) -> int:
    """Positions a K/V head of a layer keeps after ``length`` tokens, as the model's own cache does: every
    one, or the ``window − 1`` before the next query (transformers' sliding-window layers)."""
    return length if window is None else min(length, window - 1)


def kept_streaming(length: int, window: int | None, sink: int, recent: int) -> int:
    """Positions a streaming K/V head keeps after ``length`` tokens: of those a later query may still
    see under its layer's ``window`` (None: every position), the first ``sink`` and the last ``recent``."""
    first = 0 if window is None else max(0, length - window + 1)  # the first position the next query may see
    return (length - first) - max(0, length - recent - max(first, sink))  # minus the gap between sink and window


def rank(keys: list[torch.Tensor]) -> torch.Tensor:
    """The order of K/V heads, best first: by ``keys[0]`` [L, Hkv] descending, ties by ``keys[1]``
    and so on, then by index (layer · Hkv + head) ascending → int64 [L·Hkv] flat indices."""
    order = torch.arange(keys[0].numel())  # [L·Hkv]
    for k in reversed(keys):  # a stable sort per key, last key first: the first key decides, then the next
        flat = k.flatten()[order]  # [L·Hkv] in the current order
        order = order[torch.argsort(flat, descending=True, stable=True)]
    return order


@dataclass
class Plan:
    """Which K/V heads keep every key. ``full``: bool [layers, Hkv] (True = full, False = streaming:
    ``sink`` first keys + ``window`` recent keys). ``scores`` (float [layers, Hkv], optional) and
    ``score`` (its name) say how it was chosen, ``tie_scores`` and ``tie_score`` the second key that
    broke its ties (``find``; then the lower index); ``layers`` names the layers (module paths);
    ``model`` (a :class:`ModelShape`, optional) what the plan was made for: every use checks it first;
    ``bits`` (8, 4 or None) how its caches store the full heads' keys and values older than the last
    ``residual`` (:mod:`bhqk.budget.quant`: integers in groups; None: floats, as the model's own cache)."""

    full: torch.Tensor
    sink: int = 64
    window: int = 256
    scores: torch.Tensor | None = None
    score: str | None = None
    layers: list[str] | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    tie_scores: torch.Tensor | None = None
    tie_score: str | None = None
    model: ModelShape | None = None
    bits: int | None = None

    def __post_init__(self) -> None:
        full = self.full
        if isinstance(full, list | tuple):  # rows of True/False (or 1/0), each row named where it is wrong
            full = torch.tensor(_grid(full, "full", "full"), dtype=torch.bool)
        elif not isinstance(full, torch.Tensor):
            full = torch.as_tensor(full)
        if full.dtype != torch.bool or full.dim() != 2:
            raise ShapeError(f"Plan: full must be a bool tensor [layers, Hkv] (True = keeps every key), got "
                             f"{full.dtype} {list(full.shape)}.")
        self.full = full.detach().cpu().clone()
        for name in ("sink", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Plan: {name} must be an int >= 0 (keys), got {v!r}.")
        L, Hkv = self.full.shape
        for name in ("scores", "tie_scores"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, list | tuple):
                v = _grid(v, name, "scores", (L, Hkv))
            s = torch.as_tensor(v, dtype=torch.float64).cpu()
            if tuple(s.shape) != tuple(self.full.shape):
                raise ShapeError(f"Plan: {name} has shape {list(s.shape)} but full is [layers={L}, Hkv={Hkv}].")
            setattr(self, name, s)
        if self.tie_scores is not None and self.scores is None:
            raise ValueError("Plan: tie_scores break ties of scores; pass scores too.")
        for name in ("score", "tie_score"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"Plan: {name} names a score: a str or None, got {getattr(self, name)!r}.")
        if self.layers is not None:
            if not isinstance(self.layers, list | tuple) or not all(isinstance(n, str) for n in self.layers):
                raise ValueError(f"Plan: layers names the layers: a list of str (module paths), got {self.layers!r}.")
            if len(self.layers) != L:
                raise ShapeError(f"Plan: {len(self.layers)} layer names for {L} layers.")
            self.layers = list(self.layers)
        if not isinstance(self.notes, dict):
            raise ValueError(f"Plan: notes must be a dict, got {self.notes!r}.")
        if self.model is not None and not isinstance(self.model, ModelShape):
            raise ValueError(f"Plan: model is what the plan was made for: a ModelShape or None, got {self.model!r}.")
        if self.model is not None and (self.model.layers, self.model.kv_heads) != (L, Hkv):
            raise ShapeError(f"Plan: full is [layers={L}, Hkv={Hkv}] but the plan says "
                             f"it was made for {self.model.describe()}.")
        if self.bits is not None:
            from .quant import check as check_bits

            check_bits(self.bits, None, None if self.model is None else self.model.head_dim, "Plan")

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.full.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.full.shape[1])

    @property
    def fraction(self) -> float:
        """The fraction of K/V heads that keep every key."""
        return float(self.full.float().mean()) if self.full.numel() else 1.0

    def mask(self) -> masks.Mask:
        """The mask a streaming head adds to the model's (see :func:`streaming_mask`)."""
        return streaming_mask(self.sink, self.window)

    def describe(self) -> str:
        """The plan's shape, and what it was made for where it says: ``[layers=30, Hkv=3] made for …``."""
        return f"[layers={self.num_layers}, Hkv={self.num_kv_heads}]" + (
            "" if self.model is None else f" made for {self.model.describe()}")

    def check(self, model: nn.Module | ModelMap) -> ModelMap:
        """The model's :class:`~bhqk.integrations.model_map.ModelMap`, or a ``ShapeError`` naming both
        shapes unless the plan fits ``model`` (layers and K/V heads; and where the plan records what it
        was made for, query heads, head size and each layer's attention type and window too)."""
        m = model_map(model)
        self.fits(m.shape, type(m.model).__name__)
        return m

    def fits(self, got: ModelShape, what: str = "the model") -> ModelShape:
        """``got``, or a ``ShapeError`` naming both shapes unless the plan fits it (:meth:`check`)."""
        mine = self.model
        same = ((got.layers, got.kv_heads) == (self.num_layers, self.num_kv_heads) if mine is None else
                (mine.sizes(), mine.layer_types, mine.windows) == (got.sizes(), got.layer_types, got.windows))
        if not same:
            raise ShapeError(f"the plan is {self.describe()} but {what} is {got.describe()}; make a plan for this "
                             f"model (bhqk.budget.find(model), or Plan(full=bool [layers, Hkv])).")
        return got

    def free(self, shape: ModelShape | None = None) -> torch.Tensor:
        """bool [layers, Hkv]: the K/V heads whose layer's own window fits the streaming window (a sliding
        or chunked layer whose queries see at most ``window`` + 1 keys): full or streaming, they keep and
        see the same keys, so the cache and :meth:`emulate` run them as full heads (``shape``: the
        model's, default what the plan was made for; None: none)."""
        shape = shape or self.model
        out = torch.zeros_like(self.full)
        if shape is not None:
            for li, w in enumerate(shape.windows):
                out[li] = w is not None and w <= self.window + 1
        return out

    def top(self, n: int) -> Plan:
        """This plan with its best ``n`` K/V heads whose choice matters full — by ``scores``, ties by
        ``tie_scores``, then the lower index (:func:`rank`) — and the rest streaming; the heads of
        :meth:`free` stay full besides (``find`` cuts this way)."""
        if self.scores is None:
            raise ValueError("Plan.top: the plan has no scores to rank its heads by (find(model) makes one).")
        free = self.free().flatten()  # [L·Hkv]
        _count("Plan.top", "n", n)
        if n > int((~free).sum()):
            raise ValueError(f"Plan.top: n={n} but only {int((~free).sum())} K/V heads' choice matters.")
        order = rank([k for k in (self.scores, self.tie_scores) if k is not None])  # [L·Hkv] best first
        full = free.clone()  # [L·Hkv]
        full[order[~free[order]][:n]] = True  # the best n of the heads whose choice matters
        return replace(self, full=full.reshape(self.full.shape))  # [L·Hkv] -> [L, Hkv]

    def held(self, length: int, shape: ModelShape | None = None) -> int:
        """K/V positions held over all layers and K/V heads after ``length`` tokens (per sequence), each
        layer as the model masks it (``shape``: the model's, default what the plan was made for; without
        either, every layer full attention)."""
        _count("Plan.held", "length", length)
        return sum(n * full + (self.num_kv_heads - n) * stream for n, full, stream in self._kept(length, shape, self.full))

    def _kept(self, length: int, shape: ModelShape | None, keeps: torch.Tensor) -> list[tuple[int, int, int]]:
        """Per layer after ``length`` tokens: (its K/V heads that ``keeps`` [L, Hkv] marks full, positions a full
        head keeps, positions a streaming head keeps); ``shape`` as :meth:`held`."""
        shape = shape or self.model
        windows = (None,) * self.num_layers if shape is None else shape.windows
        return [(int(keeps[li].sum()), kept_full(length, w), kept_streaming(length, w, self.sink, self.window))
                for li, w in enumerate(windows)]

    def nbytes(self, length: int, model: nn.Module | ModelMap, batch: int = 1,
               dtype: torch.dtype | None = None, bits: int | None = None, group: int | None = None,
               residual: int | None = None) -> tuple[int, int]:
        """(bytes of keys and values this plan's cache holds, bytes the model's own cache —
        ``DynamicCache(config=model.config)`` — holds) after ``length`` tokens of ``batch`` sequences
        (``dtype``: the model's by default; ``bits``, ``group``, ``residual``: as :meth:`cache`). A prediction
        of the positions held (:meth:`BudgetCache.nbytes <bhqk.budget.cache.BudgetCache.nbytes>` says where
        the memory it measures differs)."""
        from .quant import RESIDUAL, position_bytes
        from .quant import check as check_bits

        bits = self.bits if bits is None else bits

        _count("Plan.nbytes", "length", length)
        _count("Plan.nbytes", "batch", batch, 1)
        m = self.check(model)
        shape = m.shape
        dt = dtype or next(m.model.parameters()).dtype
        per = 2 * shape.head_dim * torch.empty((), dtype=dt).element_size() * batch  # key + value of one position
        own = sum(shape.kv_heads * kept_full(length, w) for w in shape.windows)
        if bits is None:
            return self.held(length, shape) * per, own * per
        g = check_bits(bits, group, shape.head_dim, "Plan.nbytes")
        assert g is not None
        r = RESIDUAL if residual is None else residual
        _count("Plan.nbytes", "residual", r)
        qper = 2 * position_bytes(shape.head_dim, bits, g) * batch  # key + value of one quantized position
        total = 0
        for n_full, n, n_stream in self._kept(length, shape, self.full | self.free(shape)):  # full: quantized
            nq = max(0, n - r)  # held positions older than the last `residual`
            total += n_full * (nq * qper + (n - nq) * per) + (self.num_kv_heads - n_full) * n_stream * per
        return total, own * per

    # ---- use ------------------------------------------------------------------------------------
    def cache(self, model: nn.Module | ModelMap | None = None, bits: int | None = None, group: int | None = None,
              residual: int | None = None, block: int | None = None):
        """A transformers ``Cache`` holding only what this plan keeps (:class:`bhqk.budget.BudgetCache`: ``bits``
        (default the plan's), ``group``, ``residual`` (default 64), ``block`` (default 1024) are its). ``model``:
        checked against the plan first; without it, the cache checks the first keys the model writes (K/V heads, and the head
        size where the plan records it), and a plan of more layers than the model at its next forward."""
        from .cache import BudgetCache
        from .quant import BLOCK, RESIDUAL

        bits = self.bits if bits is None else bits

        shape = None if model is None else self.check(model).shape  # a plan of another model: refused first
        return BudgetCache(self, shape, bits, group, RESIDUAL if residual is None else residual,
                           BLOCK if block is None else block)

    def kv_cache(self, model: nn.Module | None = None, capacity: int | None = None, bits: int | None = None,
                 group: int | None = None, residual: int | None = None, block: int | None = None):
        """A :class:`bhqk.nn.KVCache` for bhqk's own models (``gpt2.generate(..., cache=plan.kv_cache(gpt2))``):
        per layer the full K/V heads keep every position, the streaming heads ``sink`` + a ring of
        ``window`` + 1; ``model``: checked against the plan first (without it, the first keys written
        are); ``capacity``: the full heads' buffers (:mod:`bhqk.budget.ring`). ``bits``, ``group``,
        ``residual``, ``block``: as :meth:`cache` (the full heads' old positions in integers)."""
        from functools import partial

        from ..nn import KVCache
        from .quant import BLOCK, RESIDUAL, QuantizedLayerCache
        from .quant import check as check_bits
        from .ring import layer_cache

        shape = self.model if model is None else self.check(model).shape
        d = None if shape is None else shape.head_dim
        bits = self.bits if bits is None else bits
        if bits is None:
            if group is not None or residual is not None or block is not None:
                raise ValueError("Plan.kv_cache: group, residual and block are the quantization's; pass bits=8 or 4 with them.")
            return KVCache(layers=[layer_cache(self.full[li], self.sink, self.window, capacity, li, d)
                                   for li in range(self.num_layers)])
        check_bits(bits, group, d, "Plan.kv_cache")
        quantized = partial(QuantizedLayerCache, bits, group, RESIDUAL if residual is None else residual,
                            BLOCK if block is None else block)
        return KVCache(layers=[layer_cache(self.full[li], self.sink, self.window, capacity, li, d, quantized)
                               for li in range(self.num_layers)])

    @contextlib.contextmanager
    def emulate(self, model: nn.Module | ModelMap) -> Iterator[None]:
        """Inside the block, the model's streaming heads see only what the plan keeps, by
        ``bhqk.edit(mask=...)`` on their query heads (nothing is saved: the reference the budget
        cache must equal). The streaming mask counts keys by their position, so the model's cache
        must keep every position: give ``generate`` ``cache=transformers.DynamicCache()`` on a model
        with sliding or chunked layers (its default cache drops their old keys and counts the rest
        from the first it keeps; the model's own mask stays right, the streaming mask would not): a
        call over such a cache is refused with a ``ValueError``."""
        from ..inspect import edit

        m = self.check(model)
        shape = m.shape
        G = shape.heads // shape.kv_heads
        keeps = self.full | self.free(shape)  # [L, Hkv] a head within its layer's own window sees what a full one does
        with contextlib.ExitStack() as stack:
            for li, path in enumerate(m.paths):
                heads = [g * G + j for g in range(shape.kv_heads) if not bool(keeps[li, g]) for j in range(G)]
                if heads:
                    hook = m.module(li).register_forward_pre_hook(_every_position(li), with_kwargs=True)
                    stack.callback(hook.remove)
                    stack.enter_context(edit(path, heads, model=m.model, mask=self.mask()))
            yield

    # ---- show -----------------------------------------------------------------------------------
    def decided(self) -> list[list[str]]:
        """[layers][Hkv]: which key put each K/V head on its side of the cut (full vs streaming) —
        ``score`` when its score alone separates it from every head on the other side, else
        ``tie_score`` when that separates it from the other side's heads of equal score, else
        ``"index"`` when the lower index does (the last tie-break of ``find``); ``"hand"`` where the
        plan contradicts its keys (built by hand), ``"-"`` without scores or without a cut;
        ``"model window"`` for a head whose layer's own window fits the streaming window
        (:meth:`free`: outside the cut, ``find`` keeps it full)."""
        L, Hkv = self.num_layers, self.num_kv_heads
        out = [["-"] * Hkv for _ in range(L)]
        free = self.free()  # [L, Hkv]
        for li, g in free.nonzero().tolist():
            out[li][g] = "model window"
        cut = self.full[~free]  # the heads the cut is among
        if self.scores is None or bool(cut.all()) or not bool(cut.any()):
            return out
        flat = self.full.flatten()  # [L·Hkv]
        keys = [(self.score or "score", self.scores.flatten())]  # [L·Hkv] each
        if self.tie_scores is not None:
            keys.append((self.tie_score or "tie score", self.tie_scores.flatten()))
        index = torch.arange(flat.numel(), dtype=torch.float64)
        keys.append(("index", -index))  # a lower index ranks higher
        known = ~torch.stack([k.isnan() for _, k in keys]).any(0) & ~free.flatten()  # [L·Hkv] heads in the cut with every key
        for i in range(flat.numel()):
            if not bool(known[i]):
                continue
            sign = 1.0 if bool(flat[i]) else -1.0  # full: must rank above the other side; streaming: below
            other = (flat != flat[i]) & known  # [L·Hkv] the other side, narrowed to the tied heads key by key
            verdict = "hand"
            for name, k in keys:
                d = sign * (k[i] - k[other])  # [n] > 0: this key puts head i on its side of that head
                if bool((d > 0).all()):
                    verdict = name
                    break
                if bool((d < 0).any()):
                    break  # a head on the other side ranks higher by this key: not find's order
                other = other & (k == k[i])  # [L·Hkv] the heads this key ties with go to the next key
            out[i // Hkv][i % Hkv] = verdict
        return out

    def rows(self) -> list[list[str]]:
        decided = self.decided()
        out = []
        for li in range(self.num_layers):
            name = self.layers[li] if self.layers else str(li)
            for g in range(self.num_kv_heads):
                row = [str(li), name, str(g), _num(self.scores, li, g)]
                if self.tie_scores is not None:
                    row.append(_num(self.tie_scores, li, g, 4))
                row += ["full" if bool(self.full[li, g]) else "streaming", decided[li][g]]
                out.append(row)
        return out

    def summary(self) -> str:
        n, total = int(self.full.sum()), self.full.numel()
        by = f", chosen by {self.score}" if self.score else ""
        if self.score and self.tie_score:
            by += f" (ties by {self.tie_score}, then index)"
        free = int(self.free().sum())
        fits = f", {free} of them within their layer's own window" if free else ""
        made = "" if self.model is None else f"; made for {self.model.describe()}"
        bits = "" if self.bits is None else f"; full heads' older keys and values in {self.bits}-bit integers"
        return (f"Plan: {n} of {total} K/V heads full{fits} ({self.num_layers} layers × "
                f"{self.num_kv_heads} K/V heads); streaming heads keep sink={self.sink} + window={self.window}{by}"
                f"{bits}{made}")

    def __str__(self) -> str:
        head = ["layer", "name", "kv head", self.score or "score"]
        if self.tie_scores is not None:
            head.append(self.tie_score or "tie score")
        return self.summary() + "\n\n" + table(head + ["keeps", "decided by"], self.rows())

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        """Layers × K/V heads, full heads filled, the score as the cell's shade and title."""
        cells = []
        s = self.scores
        lo, hi = 0.0, 1.0
        if s is not None and bool(torch.isfinite(s).any()):
            fin = s[torch.isfinite(s)]
            lo, hi = float(fin.min()), float(fin.max())
        span = (hi - lo) or 1.0
        for li in range(self.num_layers):
            row = []
            for g in range(self.num_kv_heads):
                full = bool(self.full[li, g])
                v = None if s is None else float(s[li, g])
                shade = 0.15 if v is None or math.isnan(v) else 0.15 + 0.85 * (v - lo) / span
                title = f"layer {li} kv head {g}: {'full' if full else 'streaming'}" + ("" if v is None else f", score {v:.3g}")
                if self.tie_scores is not None:
                    title += f", {self.tie_score or 'tie score'} {float(self.tie_scores[li, g]):.4g}"
                style = (f"width:16px;height:16px;background:rgba(200,60,40,{shade:.2f})" if full else
                         f"width:16px;height:16px;background:rgba(40,90,200,{shade * 0.5:.2f})")
                row.append(f"<td title='{html.escape(title)}' style='{style}'>{'■' if full else ''}</td>")
            cells.append(f"<tr><th style='font-size:10px'>{li}</th>{''.join(row)}</tr>")
        return (f"<div><b>{html.escape(self.summary())}</b><table style='border-collapse:collapse'>{''.join(cells)}"
                f"</table><div style='font-size:11px'>■ full (red: score), blank streaming</div></div>")

    # ---- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "sink": self.sink, "window": self.window, "score": self.score,
                "full": self.full.int().tolist(), "layers": self.layers,
                "scores": None if self.scores is None else
                [[None if math.isnan(x) else float(x) for x in row] for row in self.scores.tolist()],  # exact: ties survive
                "tie_score": self.tie_score,
                "tie_scores": None if self.tie_scores is None else
                [[None if math.isnan(x) else float(x) for x in row] for row in self.tie_scores.tolist()],
                "notes": self.notes, "model": None if self.model is None else self.model.to_dict(), "bits": self.bits}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> Plan:
        """The plan a :meth:`to_dict` (a plan file's JSON) describes, checked field by field: a ``LoadError``
        naming ``source`` (the file), the field, and the row and value where one is wrong — nothing is
        rounded, converted or read another way (a hand-edited ``"window": 2.5`` or a head of ``2`` is an
        error, not a window of 2 or a full head)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise LoadError(f"{source}: not a bhqk budget plan (expected \"format\": {FORMAT!r}).")

        def bad(msg: str) -> LoadError:
            return LoadError(f"{source}: a malformed plan: {msg}")

        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise bad(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(_json, unknown))} (a plan has "
                      f"{', '.join(map(_json, _FIELDS))}).")
        for name in ("full", "sink", "window"):
            if name not in d:
                raise bad(f"no {_json(name)} field.")
        for name in ("sink", "window"):
            v = d[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{_json(name)} must be a whole number >= 0 (keys), got {_json(v)}.")
        for name in ("score", "tie_score"):
            if d.get(name) is not None and not isinstance(d[name], str):
                raise bad(f"{_json(name)} names a score: a string or null, got {_json(d[name])}.")
        if d.get("bits") is not None and (isinstance(d["bits"], bool) or d["bits"] not in (8, 4)):
            raise bad(f"\"bits\" must be 8, 4 or null (keys and values as floats), got {_json(d['bits'])}.")
        if d.get("notes") is not None and not isinstance(d["notes"], dict):
            raise bad(f"\"notes\" must be an object or null, got {_json(d['notes'])}.")
        try:
            full = _grid(d["full"], "full", "full", show=_json)
            L, Hkv = len(full), len(full[0])
            sc, tie = (None if d.get(k) is None else  # [[x or null]] -> [layers, Hkv], null -> nan
                       _grid(d[k], k, "scores", (L, Hkv), show=_json) for k in ("scores", "tie_scores"))
            if tie is not None and sc is None:
                raise ValueError("\"tie_scores\" break ties of \"scores\", but there are no \"scores\".")
            layers = d.get("layers")
            if layers is not None and (not isinstance(layers, list) or not all(isinstance(n, str) for n in layers)):
                raise ValueError(f"\"layers\" must be null or a list of {L} strings (one name per row of \"full\"), "
                                 f"got {_json(layers)}.")
            if layers is not None and len(layers) != L:
                raise ValueError(f"\"layers\" names {len(layers)} layers but \"full\" has {L} rows (one per layer).")
            made_for = None if d.get("model") is None else _shape(d["model"], (L, Hkv))  # absent in older files
        except ValueError as e:  # ShapeError is a ValueError
            raise bad(str(e).removeprefix("Plan: ")) from None
        return cls(torch.tensor(full, dtype=torch.bool), d["sink"], d["window"],
                   None if sc is None else torch.tensor(sc, dtype=torch.float64), d.get("score"), layers,
                   d.get("notes") or {}, None if tie is None else torch.tensor(tie, dtype=torch.float64),
                   d.get("tie_score"), made_for, d.get("bits"))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise LoadError(f"{path}: not JSON ({e}).") from None
        return cls.from_dict(d, str(path))


_FIELDS = ("format", "sink", "window", "score", "full", "layers", "scores", "tie_score", "tie_scores", "notes", "model", "bits")


def _json(v: Any) -> str:
    """``v`` as a plan file spells it (``"256"`` a string, ``2.5`` a number, ``true``), cut at 80 characters."""
    try:
        out = json.dumps(v)
    except (TypeError, ValueError):
        out = repr(v)
    return out if len(out) <= 80 else out[:77] + "..."


def _grid(rows: Any, name: str, kind: str, shape: tuple[int, int] | None = None,
          show=repr) -> list[list[Any]]:
    """``rows`` (a list of lists: [layers][Hkv]) checked entry by entry → the same as lists of bool
    (``kind`` "full": each entry 0/1 or False/True) or of float (``kind`` "scores": each a number, or
    None → nan); a ``ShapeError`` naming ``name``, the row, the K/V head and the value, or the
    shape (``shape``: the (layers, Hkv) it must have; default: rectangular, at least one row)."""
    what = ("a list of rows, one per layer, each a list of 0/1 (or false/true) per K/V head (1 = keeps every key)"
            if kind == "full" else "a list of rows, one per layer, each a list of numbers (or null) per K/V head")
    if show is _json:  # a plan file's fields, as it spells them
        name, full = f'"{name}"', '"full"'
    else:
        full = "full"
    if not isinstance(rows, list | tuple) or not rows:
        raise ShapeError(f"Plan: {name} must be {what}; got {show(rows)}.")
    if shape is not None and len(rows) != shape[0]:
        raise ShapeError(f"Plan: {name} has {len(rows)} rows but {full} has {shape[0]} (one per layer).")
    out = []
    for li, row in enumerate(rows):
        if not isinstance(row, list | tuple):
            raise ShapeError(f"Plan: {name} row {li} is {show(row)}; {name} must be {what}.")
        want = len(rows[0]) if shape is None else shape[1]
        if len(row) != want:
            than = f"row 0 has {want}" if shape is None else f"{full} has {want} K/V heads"
            raise ShapeError(f"Plan: {name} row {li} has {len(row)} entries but {than} (one per K/V head).")
        got: list[Any] = []
        for g, x in enumerate(row):
            if kind == "full":
                ok = isinstance(x, bool) or (type(x) is int and x in (0, 1))
                if not ok:
                    raise ShapeError(f"Plan: {name} row {li}, K/V head {g} is {show(x)}; an entry is 0/1 or "
                                     f"false/true (1 = keeps every key, 0 = streaming).")
                got.append(bool(x))
            else:
                ok = x is None or (not isinstance(x, bool) and isinstance(x, int | float))
                if not ok:
                    raise ShapeError(f"Plan: {name} row {li}, K/V head {g} is {show(x)}; an entry is a number or "
                                     f"{'null' if show is _json else 'None'} (no score).")
                got.append(math.nan if x is None else float(x))
        out.append(got)
    return out


def _shape(d: Any, full: tuple[int, int]) -> ModelShape:
    """The :class:`ModelShape` a plan file's ``"model"`` describes, checked field by field (a ``ValueError``
    naming the field and value), and that it has the layers and K/V heads of ``full`` (layers, Hkv)."""
    if not isinstance(d, dict):
        raise ValueError(f"\"model\" must be an object (what the plan was made for) or null, got {_json(d)}.")
    keys = ("name", "model_type", "layers", "heads", "kv_heads", "head_dim", "layer_types", "windows")
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise ValueError(f"\"model\" has unknown field{'s' * (len(unknown) > 1)} {', '.join(map(_json, unknown))} "
                         f"(it has {', '.join(map(_json, keys))}).")
    for k in keys[2:]:
        if k not in d:
            raise ValueError(f"\"model\" has no {_json(k)} field.")
    for k in ("layers", "heads", "kv_heads", "head_dim"):
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"\"model\".{k} must be a whole number >= 1, got {_json(v)}.")
    for k in ("name", "model_type"):
        if d.get(k) is not None and not isinstance(d[k], str):
            raise ValueError(f"\"model\".{k} must be a string or null, got {_json(d[k])}.")
    types, windows = d["layer_types"], d["windows"]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"\"model\".layer_types must be a list of strings, got {_json(types)}.")
    if not isinstance(windows, list):
        raise ValueError(f"\"model\".windows must be a list (a whole number or null per layer), got {_json(windows)}.")
    for li, w in enumerate(windows):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise ValueError(f"\"model\".windows[{li}] must be a whole number or null, got {_json(w)}.")
    if d["heads"] % d["kv_heads"]:
        raise ValueError(f"\"model\": heads={d['heads']} is not a multiple of kv_heads={d['kv_heads']}.")
    try:
        shape = ModelShape(d["layers"], d["heads"], d["kv_heads"], d["head_dim"], tuple(types), tuple(windows),
                           d.get("name"), d.get("model_type"))
    except ShapeError as e:  # layer types or windows of another length; a layer whose type and window disagree
        raise ValueError(f"\"model\": {str(e).removeprefix('ModelShape: ')}") from None
    if (shape.layers, shape.kv_heads) != full:
        raise ValueError(f"\"full\" is [layers={full[0]}, Hkv={full[1]}] but \"model\" says it was made for "
                         f"{shape.describe()}.")
    return shape


def _count(who: str, name: str, v: Any, minimum: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{who}: {name} must be an int >= {minimum}, got {v!r}.")


def _every_position(layer: int):
    """A forward pre-hook for :meth:`Plan.emulate`: refuses a call whose cache (transformers') counts
    keys from a later position than 0 (a sliding or chunked layer's own cache, once it dropped keys)."""
    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        hidden = args[0] if args else kwargs.get("hidden_states")
        if cache is None or not hasattr(cache, "get_mask_sizes") or hidden is None:
            return None
        first = cache.get_mask_sizes(hidden.shape[1], getattr(module, "layer_idx", layer))[1]  # kv_offset
        if first:
            raise ValueError(f"Plan.emulate: layer {layer}'s cache holds keys from position {first} on "
                             f"({type(cache).__name__} with {type(cache.layers[layer]).__name__}); the streaming mask "
                             f"counts keys from position 0, so the reference would be wrong. Give generate a cache "
                             f"that keeps every position: cache=transformers.DynamicCache().")
        return None

    return hook


def _num(t: torch.Tensor | None, li: int, g: int, digits: int = 3) -> str:
    """A score as the table prints it: ``digits`` significant digits (``0.3``, ``2e-05``), so scores many
    orders of magnitude apart (fisher's) keep their order; ``-`` for none."""
    return "-" if t is None or math.isnan(float(t[li, g])) else f"{float(t[li, g]):.{digits}g}"


__all__ = ["Plan", "ModelShape", "ModelMap", "model_map", "streaming_mask", "kept_full", "kept_streaming"]
