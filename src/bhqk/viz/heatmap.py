"""Pictures of attention with matplotlib (the optional ``viz`` extra), drawn on the Agg backend
without pyplot, so nothing global changes.

As in the seeds, a head's weights are a table: one row per query, one column per key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..inspect.trace import call_shapes
from ..masks import Mask
from ..text import named_shape
from .labels import check_labels

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..inspect.capture import Capture, Record

CMAP = "viridis"
DPI = 150


def _figure(width: float, height: float) -> Figure:
    """A Figure on its own Agg canvas (no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("bhqk.viz pictures need matplotlib: pip install 'bhqk[viz]'.") from e
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path | None) -> None:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI)


def _labels(tokens: Sequence[str] | None, n: int, positions: Sequence[int] | None = None) -> list[str]:
    pos = list(range(n)) if positions is None else list(positions)
    if tokens is None:
        return [str(i) for i in pos]
    return [str(tokens[i]) for i in pos]


def _select(src: Capture | Record | torch.Tensor, layer: int | str, head: int, b: int):
    """(weights [r, K], record or None) for one head of one call."""
    from ..inspect.capture import Capture

    if isinstance(src, torch.Tensor):
        P = src
        while P.dim() > 2:
            P = P[b] if P.dim() == 4 else P[head]  # [B, H, Q, K] -> [H, Q, K] -> [Q, K]
        return P, None
    rec = src[layer] if isinstance(src, Capture) else src
    return rec.head(head, "weights", b), rec


def draw_head(ax, P: torch.Tensor, q_labels: Sequence[str], k_labels: Sequence[str], *, allowed: torch.Tensor | None = None,
              numbers: bool | None = None, vmax: float | None = None):
    """Draw weights P [Q, K] on ``ax``: queries as rows, keys as columns; masked cells grey."""
    import numpy as np

    Q, K = P.shape
    data = P.detach().float().cpu().numpy()
    shown = np.ma.masked_where(~allowed.cpu().numpy(), data) if allowed is not None else data
    im = ax.imshow(shown, cmap=CMAP, vmin=0.0, vmax=vmax if vmax is not None else max(float(data.max()), 1e-6),
                   aspect="equal", interpolation="nearest")
    ax.set_facecolor("#d9d9d9")  # masked cells
    ax.set_xticks(range(K), labels=k_labels, rotation=60, ha="left", rotation_mode="anchor", fontsize=9)
    ax.set_yticks(range(Q), labels=q_labels, fontsize=9)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    if numbers is None:
        numbers = Q <= 16 and K <= 16
    if numbers:
        top = float(im.norm.vmax)
        for i in range(Q):
            for j in range(K):
                if allowed is not None and not bool(allowed[i, j]):
                    continue
                x = data[i, j]
                if x < 0.005:
                    continue  # leave near-zero cells blank so the pattern reads
                ax.text(j, i, f"{x:.2f}".lstrip("0") if x < 0.995 else "1", ha="center", va="center", fontsize=7,
                        color="black" if x > 0.6 * top else "white")
    return im


def heatmap(src: Capture | Record | torch.Tensor, tokens: Sequence[str] | None = None, *, layer: int | str = 0,
            head: int = 0, b: int = 0, key_tokens: Sequence[str] | None = None, title: str | None = None,
            path: str | Path | None = None) -> Figure:
    """One head's weights P [Q, K] with token labels on both axes (queries = rows, keys = columns),
    a colour bar and the named shape in the title. ``src``: a Capture (``layer`` = call index or
    name), a Record, or a tensor [Q, K] / [H, Q, K] / [B, H, Q, K]. ``tokens``: one per query of the call
    (and per key, unless ``key_tokens`` is given), else a ShapeError. Saved as PNG when ``path`` is given."""
    P, rec = _select(src, layer, head, b)
    Q, K = P.shape
    check_labels("heatmap", tokens, key_tokens, Q if rec is None else rec.sizes["Q"], K, None if rec is None else rec.name)
    positions = rec.query_positions if rec is not None else None
    q_labels = _labels(tokens, Q, positions)
    k_labels = _labels(key_tokens if key_tokens is not None else tokens, K)
    allowed = None
    if rec is not None and rec.mask is not None:
        s = rec.sizes
        full = rec.mask.materialize(s["B"], s["H"], s["Q"], s["K"])  # [#B, #H, #Q, #K]
        allowed = full[min(b, full.shape[0] - 1), min(head, full.shape[1] - 1)].expand(s["Q"], s["K"])
        allowed = allowed[positions]  # [r, K]
    longest = max((len(t) for t in q_labels + k_labels), default=1)
    cell = 0.42 if max(Q, K) <= 24 else max(0.12, 10.0 / max(Q, K))
    width = min(16.0, max(5.5, K * cell + 0.09 * longest + 1.8))
    height = min(16.0, max(4.5, Q * cell + 0.09 * longest + 1.3))
    fig = _figure(width, height)
    ax = fig.add_subplot()
    im = draw_head(ax, P, q_labels, k_labels, allowed=allowed)
    fig.colorbar(im, ax=ax, shrink=0.8, label="weight P (each row sums to 1)")
    ax.set_ylabel(f"query (Q={Q})")
    ax.set_xlabel(f"key (K={K})")
    if title is None:
        if rec is not None:
            named = "" if rec.name in (f"attention.{rec.index}", str(rec.index)) else f"{rec.name}, "
            shape = call_shapes(rec.sizes)["S, P"]
            title = (f"layer {rec.index}, head {head}  ({named}backend {rec.backend})\n"
                     f"P = softmax(Q·Kᵀ·scale) {shape}; shown P[b={b}, h={head}] {named_shape(('Q', 'K'), (Q, K))}")
        else:
            title = f"head {head}: P {named_shape(('Q', 'K'), (Q, K))}"
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
    return fig


def grid(cap: Capture, *, b: int = 0, layers: Sequence[int | str] | None = None, path: str | Path | None = None,
         title: str | None = None) -> Figure:
    """Every captured layer × head as small heatmaps (rows = layers, columns = heads), one colour scale."""
    recs = [cap[k] for k in layers] if layers is not None else list(cap.records)
    if not recs:
        raise ValueError("grid: the capture holds no records.")
    H = max(len(r.heads) for r in recs)
    L = len(recs)
    side = 1.05 if H <= 12 else max(0.5, 13.0 / H)
    fig = _figure(min(24.0, H * side + 1.6), min(24.0, L * side + 0.9))
    axes = fig.subplots(L, H, squeeze=False)
    im = None
    for i, rec in enumerate(recs):
        weights = rec.weights  # [B, h, r, K]
        if weights is None:
            raise ValueError(f"grid: record {rec.name!r} holds no weights; capture with what=(..., 'weights').")
        for j in range(H):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(rec.heads):
                ax.set_visible(False)
                continue
            P = weights[b, j].float().cpu().numpy()  # [r, K]
            im = ax.imshow(P, cmap=CMAP, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="equal")
            if i == 0:
                ax.set_title(f"head {rec.heads[j]}", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"layer {rec.index}", fontsize=8)
    if im is not None:  # (some record holds a head)
        fig.colorbar(im, ax=axes, shrink=0.6, aspect=30, pad=0.01, label="weight P")
    shape = call_shapes(recs[0].sizes)["S, P"]
    fig.suptitle(title or f"attention weights, {L} layers × {H} heads; each cell is P {shape} at b={b} "
                          f"(rows = queries, columns = keys)", fontsize=10)
    _save(fig, path)
    return fig


def mask(masks: Mask | Sequence[Mask] | Mapping[str, Mask], Q: int = 8, K: int | None = None, *,
         tokens: Sequence[str] | None = None, b: int = 0, B: int | None = None, path: str | Path | None = None) -> Figure:
    """Draw one or more masks as [Q, K] grids (dark = may attend, light = masked), side by side."""
    import numpy as np

    K = Q if K is None else K
    if isinstance(masks, Mask):
        masks = [masks]
    items = list(masks.items()) if isinstance(masks, Mapping) else [(repr(m), m) for m in masks]
    n = len(items)
    cell = 0.32 if max(Q, K) <= 24 else max(0.08, 8.0 / max(Q, K))
    w1, h1 = max(2.6, K * cell + 1.0), max(2.4, Q * cell + 1.2)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig = _figure(min(24.0, w1 * cols), min(24.0, h1 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    from matplotlib.colors import ListedColormap

    two = ListedColormap(["#f2f2f2", "#3b528b"])
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, (name, m) in zip(axes.flat, items):
        full = m.materialize(B if B is not None else b + 1, 1, Q, K)  # [#B, #H, #Q, #K]
        t = full[min(b, full.shape[0] - 1), 0].expand(Q, K).cpu().numpy().astype(np.int8)
        ax.imshow(t, cmap=two, vmin=0, vmax=1, interpolation="nearest", aspect="equal")
        ax.set_xticks(np.arange(-0.5, K), minor=True)
        ax.set_yticks(np.arange(-0.5, Q), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.8)
        ax.tick_params(which="both", length=0)
        names = list(tokens) if tokens is not None and len(tokens) == K == Q else None  # token names when they fit
        labels = names is not None
        ax.set_xticks(range(K), labels=names if names is not None else [str(i) for i in range(K)], fontsize=7,
                      rotation=60 if labels else 0, ha="left" if labels else "center", rotation_mode="anchor")
        ax.set_yticks(range(Q), labels=names if names is not None else [str(i) for i in range(Q)], fontsize=7)
        ax.xaxis.tick_top()
        for s in ax.spines.values():
            s.set_visible(False)
        ax.set_xlabel(f"{name}\n[Q={Q}, K={K}]", fontsize=8)
    fig.suptitle("masks: rows = queries, columns = keys; dark = may attend (True), light = masked", fontsize=9)
    _save(fig, path)
    return fig
