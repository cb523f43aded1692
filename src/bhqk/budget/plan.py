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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import masks
from ..errors import LoadError, ShapeError
from ..text import table
from .mask import streaming_mask

FORMAT = "bhqk.budget.Plan/1"


def model_sizes(model: nn.Module) -> tuple[int, int, int, int, list[str]]:
    """(layers, query heads H, K/V heads Hkv, head dim d, attention module paths) of a Hugging Face
    decoder (its config), or of a bhqk model (its ``MultiHeadAttention`` modules, in order) — the
    sizes a plan must fit."""
    from ..nn import MultiHeadAttention

    own = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if own:
        sizes = {(m.num_heads, m.num_kv_heads, m.head_dim) for _, m in own}
        if len(sizes) != 1:
            raise ShapeError(f"{type(model).__name__}: its attention modules differ in (H, Hkv, d): {sorted(sizes)}; "
                             f"a budget plan needs one K/V head count per layer.")
        (H, Hkv, d), = sizes
        return len(own), H, Hkv, d, [n for n, _ in own]
    config = getattr(model, "config", None)
    if config is None:
        raise ShapeError(f"{type(model).__name__} has no .config; a budget plan needs a Hugging Face model "
                         f"(layers, attention heads and K/V heads come from its config).")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    L = int(text.num_hidden_layers)
    H = int(text.num_attention_heads)
    Hkv = int(getattr(text, "num_key_value_heads", None) or H)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // H)
    return L, H, Hkv, d, attention_modules(model)


def attention_modules(model: nn.Module) -> list[str]:
    """The module paths of the model's attention layers, by their ``layer_idx`` (Hugging Face)."""
    found = [(m.layer_idx, n) for n, m in model.named_modules()
             if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]
    return [n for _, n in sorted(found)]


@dataclass
class Plan:
    """Which K/V heads keep every key. ``full``: bool [layers, Hkv] (True = full, False = streaming:
    ``sink`` first keys + ``window`` recent keys). ``scores`` (float [layers, Hkv], optional) and
    ``score`` (its name) say how it was chosen, ``tie_scores`` and ``tie_score`` the second key that
    broke its ties (``find``; then the lower index); ``layers`` names the layers (module paths)."""

    full: torch.Tensor
    sink: int = 64
    window: int = 256
    scores: torch.Tensor | None = None
    score: str | None = None
    layers: list[str] | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    tie_scores: torch.Tensor | None = None
    tie_score: str | None = None

    def __post_init__(self) -> None:
        full = self.full
        if not isinstance(full, torch.Tensor):
            full = torch.as_tensor(full)
        if full.dtype != torch.bool or full.dim() != 2:
            raise ShapeError(f"Plan: full must be a bool tensor [layers, Hkv] (True = keeps every key), got "
                             f"{full.dtype} {list(full.shape)}.")
        self.full = full.detach().cpu().clone()
        for name in ("sink", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Plan: {name} must be an int >= 0 (keys), got {v!r}.")
        for name in ("scores", "tie_scores"):
            if getattr(self, name) is None:
                continue
            s = torch.as_tensor(getattr(self, name), dtype=torch.float64).cpu()
            if tuple(s.shape) != tuple(self.full.shape):
                raise ShapeError(f"Plan: {name} has shape {list(s.shape)} but full is [layers={self.full.shape[0]}, "
                                 f"Hkv={self.full.shape[1]}].")
            setattr(self, name, s)
        if self.tie_scores is not None and self.scores is None:
            raise ValueError("Plan: tie_scores break ties of scores; pass scores too.")
        if self.layers is not None and len(self.layers) != self.full.shape[0]:
            raise ShapeError(f"Plan: {len(self.layers)} layer names for {self.full.shape[0]} layers.")

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

    def check(self, model: nn.Module) -> None:
        """A ``ShapeError`` naming layers and K/V heads unless the plan fits ``model``."""
        L, H, Hkv, _, _ = model_sizes(model)
        if (L, Hkv) != (self.num_layers, self.num_kv_heads):
            raise ShapeError(f"Plan is [layers={self.num_layers}, Hkv={self.num_kv_heads}] but the model "
                             f"({type(model).__name__}) has layers={L}, Hkv={Hkv} K/V heads (H={H} query heads).")

    def held(self, length: int) -> int:
        """K/V positions held over all layers and K/V heads after ``length`` tokens (per sequence)."""
        stream = min(length, self.sink + self.window)
        n_full = int(self.full.sum())
        return n_full * length + (self.full.numel() - n_full) * stream

    def nbytes(self, length: int, model: nn.Module, batch: int = 1, dtype: torch.dtype | None = None) -> tuple[int, int]:
        """(bytes of keys and values this plan's cache holds, bytes a full cache holds) after
        ``length`` tokens of ``batch`` sequences (``dtype``: the model's by default)."""
        self.check(model)
        L, _, Hkv, d, _ = model_sizes(model)
        dt = dtype or next(model.parameters()).dtype
        per = 2 * d * torch.empty((), dtype=dt).element_size() * batch  # key + value of one position
        return self.held(length) * per, L * Hkv * length * per

    # ---- use ------------------------------------------------------------------------------------
    def cache(self, model: nn.Module | None = None):
        """A transformers ``Cache`` holding only what this plan keeps (:class:`bhqk.budget.BudgetCache`);
        ``model``: checked against the plan first."""
        from .cache import BudgetCache

        if model is not None:
            self.check(model)
        return BudgetCache(self)

    def kv_cache(self, model: nn.Module | None = None, capacity: int | None = None):
        """A :class:`bhqk.nn.KVCache` for bhqk's own models (``gpt2.generate(..., cache=plan.kv_cache(gpt2))``):
        per layer the full K/V heads keep every position, the streaming heads ``sink`` + a ring of
        ``window`` + 1; ``model``: checked against the plan first; ``capacity``: the full heads' buffers."""
        from ..nn import KVCache

        if model is not None:
            self.check(model)
        return KVCache(self.num_layers, capacity=capacity, plan=self)

    @contextlib.contextmanager
    def emulate(self, model: nn.Module) -> Iterator[None]:
        """Inside the block, the model's streaming heads see only what the plan keeps, by
        ``bhqk.edit(mask=...)`` on their query heads with an ordinary cache (nothing is saved: the
        reference the budget cache must equal). The mask counts keys by their index in the cache, so
        give ``generate`` a cache that keeps every position (``transformers.DynamicCache()``): the
        default cache of a model with sliding-window layers drops old keys and re-indexes the rest."""
        from ..inspect import edit

        self.check(model)
        L, H, Hkv, _, paths = model_sizes(model)
        if len(paths) != L:
            raise ShapeError(f"Plan.emulate: found {len(paths)} attention modules with a layer_idx in "
                             f"{type(model).__name__} but its config has {L} layers.")
        G = H // Hkv
        with contextlib.ExitStack() as stack:
            for li, path in enumerate(paths):
                heads = [g * G + j for g in range(Hkv) if not bool(self.full[li, g]) for j in range(G)]
                if heads:
                    stack.enter_context(edit(path, heads, model=model, mask=self.mask()))
            yield

    # ---- show -----------------------------------------------------------------------------------
    def decided(self) -> list[list[str]]:
        """[layers][Hkv]: which key put each K/V head on its side of the cut (full vs streaming) —
        ``score`` when its score alone separates it from every head on the other side, else
        ``tie_score`` when that separates it from the other side's heads of equal score, else
        ``"index"`` when the lower index does (the last tie-break of ``find``); ``"hand"`` where the
        plan contradicts its keys (built by hand), ``"-"`` without scores or without a cut."""
        L, Hkv = self.num_layers, self.num_kv_heads
        out = [["-"] * Hkv for _ in range(L)]
        if self.scores is None or bool(self.full.all()) or not bool(self.full.any()):
            return out
        flat = self.full.flatten()  # [L·Hkv]
        keys = [(self.score or "score", self.scores.flatten())]  # [L·Hkv] each
        if self.tie_scores is not None:
            keys.append((self.tie_score or "tie score", self.tie_scores.flatten()))
        index = torch.arange(flat.numel(), dtype=torch.float64)
        keys.append(("index", -index))  # a lower index ranks higher
        known = ~torch.stack([k.isnan() for _, k in keys]).any(0)  # [L·Hkv] heads with every key
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
        return (f"Plan: {n} of {total} K/V heads full ({self.num_layers} layers × "
                f"{self.num_kv_heads} K/V heads); streaming heads keep sink={self.sink} + window={self.window}{by}")

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
                title = f"layer {li} kv head {g}: {'full' if full else 'streaming'}" + ("" if v is None else f", score {v:.3f}")
                if self.tie_scores is not None:
                    title += f", {self.tie_score or 'tie score'} {float(self.tie_scores[li, g]):.4f}"
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
                "notes": self.notes}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> Plan:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise LoadError(f"{source}: not a bhqk budget plan (expected \"format\": {FORMAT!r}).")
        try:
            full = torch.tensor(d["full"], dtype=torch.long).bool()
            sc, tie = (None if d.get(k) is None else  # [[x or None]] -> [layers, Hkv], None -> nan
                       torch.tensor([[math.nan if x is None else x for x in r] for r in d[k]], dtype=torch.float64)
                       for k in ("scores", "tie_scores"))
            return cls(full, int(d["sink"]), int(d["window"]), sc, d.get("score"), d.get("layers"), d.get("notes") or {},
                       tie, d.get("tie_score"))
        except (KeyError, TypeError, ValueError) as e:
            raise LoadError(f"{source}: a malformed plan ({type(e).__name__}: {e}).") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise LoadError(f"{path}: not JSON ({e}).") from None
        return cls.from_dict(d, str(path))


def _num(t: torch.Tensor | None, li: int, g: int, digits: int = 3) -> str:
    return "-" if t is None or math.isnan(float(t[li, g])) else f"{float(t[li, g]):.{digits}f}"


__all__ = ["Plan", "streaming_mask", "model_sizes", "attention_modules"]
