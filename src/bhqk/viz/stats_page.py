"""Pictures of attention statistics at any length, bounded in size: a layers × heads overview
(:func:`overview_png`: entropy, sink, previous-token), the per-key "received" curve with its peaks
labelled by their tokens (:func:`received_png`, :func:`received_peaks`), and one head's statistic
along the sequence (:func:`head_png`, :func:`head_series`), as PNG files (also as ``bhqk.viz.*``) and
as one self-contained HTML page (images inlined as data URIs, no script, no network).

The curve of a layer is the attention each key receives per row and head (``received`` summed over
heads and batch, divided by the number of real rows × heads), averaged into at most ``points`` bins,
so the picture has the same size at 1k and at 128k tokens.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ..inspect.heads import HeadTable, bin_mean, received_curve, sparkline

OVERVIEW = ("entropy", "sink", "prev")
POINTS = 1000  # bins of a received curve


def received_curves(records: Sequence, points: int = POINTS) -> tuple[list[str], list[torch.Tensor], int]:
    """(layer names, one curve per layer [≤ points], K): each key's received attention per real row and
    head, the first record of each layer name (a prefill), binned to at most ``points`` values."""
    seen: dict[str, torch.Tensor] = {}
    K = 0
    for r in records:
        if r.name in seen or r.received is None or r.real is None:
            continue
        curve = received_curve(r)  # [K]
        K = max(K, curve.numel())
        seen[r.name] = bin_mean(curve, points)
    return list(seen), list(seen.values()), K


def overview_png(table: HeadTable, path: str | Path, columns: Sequence[str] = OVERVIEW) -> Path:
    """One heatmap per column (layers down, heads across) in one PNG."""
    plt = _pyplot()
    cols = [c for c in columns if c in table.values]
    L, H = len(table.layers), table.num_heads
    fig, axes = plt.subplots(1, max(1, len(cols)), figsize=(1.2 + 3.2 * max(1, len(cols)), 1.2 + min(8.0, 0.25 * L + 1)),
                             squeeze=False)
    for ax, c in zip(axes[0], cols):
        im = ax.imshow(table.values[c].numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(c)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(0, H, max(1, H // 8)))
        ax.set_yticks(range(0, L, max(1, L // 12)))
        fig.colorbar(im, ax=ax, shrink=0.8)
    return _save(fig, path)


def received_peaks(records: Sequence, tokens: Sequence[str] | None = None, n: int = 5) -> list[tuple[int, str, float]]:
    """The ``n`` keys that receive the most attention (per real row and head, averaged over the layers,
    first record of each): (key position, its token or ``#position`` without ``tokens``, value), highest first."""
    curves = [received_curve(r) for r in {r.name: r for r in reversed(list(records))
                                          if r.received is not None and r.real is not None}.values()]
    if not curves:
        raise ValueError("received_peaks: no record holds received attention; capture(what=(..., 'received')).")
    K = min(c.numel() for c in curves)
    if tokens is not None and len(tokens) < K:
        raise ValueError(f"received_peaks: {len(tokens)} tokens for K={K} keys; pass one token per key.")
    mean = torch.stack([c[:K] for c in curves]).mean(0)  # [layers, K] -> [K]
    vals, keys = mean.topk(min(n, K))
    return [(int(k), tokens[int(k)] if tokens is not None else f"#{int(k)}", float(v)) for v, k in zip(vals, keys)]


def received_png(records: Sequence, path: str | Path, points: int = POINTS, *, tokens: Sequence[str] | None = None,
                 peaks: int = 5) -> Path:
    """The received curve of every layer in one PNG (log scale: sinks tower over the rest); the ``peaks``
    keys that receive the most are marked and labelled with their tokens (their position without ``tokens``)."""
    plt = _pyplot()
    names, curves, K = received_curves(records, points)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    cmap = plt.get_cmap("viridis")
    for i, (n, c) in enumerate(zip(names, curves)):
        x = torch.linspace(0, max(K - 1, 0), c.numel())
        ax.plot(x.numpy(), c.clamp(min=1e-12).numpy(), lw=0.9, color=cmap(i / max(1, len(names) - 1)), label=n)
    if curves and peaks:
        for i, (k, tok, v) in enumerate(sorted(received_peaks(records, tokens, peaks))):
            ax.annotate(f"{tok} ({k})", (k, v), xytext=(k, 1.03 + 0.08 * (i % 2)), textcoords=("data", "axes fraction"),
                        fontsize=7, ha="center", arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"})
    ax.set_yscale("log")
    ax.set_xlabel("key position")
    ax.set_ylabel("attention received per row and head")
    ax.set_title(f"attention received by each key ({K} keys, {len(names)} layers)", pad=30 if peaks else 6)
    if 0 < len(names) <= 8:
        ax.legend(fontsize=7)
    return _save(fig, path)


def head_series(records: Sequence, layer: int | str, head: int, column: str = "entropy", *,
                b: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's per-row statistic along the sequence: (query positions [r], values [r], NaN on rows that
    do not count: padding), from the first record of ``layer`` (a module path, or the model's layer index
    as in :class:`HeadTable`), batch element ``b``. ``column``: entropy, distance, sink, local, prev or
    ``offset o``."""
    from ..inspect.heads import layer_id

    recs = [r for r in records if r.real is not None]
    names = list(dict.fromkeys(r.name for r in recs))
    pick = [n for i, n in enumerate(names) if (n == layer if isinstance(layer, str) else layer_id(n, i) == layer)]
    if not pick:
        raise KeyError(f"head_series: no captured layer {layer!r}; layers (index, name): "
                       f"{[(layer_id(n, i), n) for i, n in enumerate(names)][:8]}.")
    rec = next(r for r in recs if r.name == pick[0])
    if head not in rec.heads:
        raise KeyError(f"head_series: head {head} was not captured for {rec.name!r}; captured heads: {rec.heads}.")
    o = 1 if column == "prev" else int(column.split()[1]) if column.startswith("offset ") else None
    t = rec.offset(o) if o is not None else getattr(rec, column, None)
    if t is None:
        raise KeyError(f"head_series: {column!r} was not captured for {rec.name!r}; captured: {rec.captured()}.")
    i = rec.heads.index(head)
    vals = torch.where(rec.real[b, i], t[b, i].double(), float("nan"))  # [r]
    return torch.tensor(rec.query_positions), vals


def head_png(records: Sequence, layer: int | str, head: int, path: str | Path, column: str = "entropy", *,
             tokens: Sequence[str] | None = None, b: int = 0) -> Path:
    """One head's ``column`` along the sequence (:func:`head_series`), token labels on the axis when
    there are at most 60 of them."""
    plt = _pyplot()
    x, y = head_series(records, layer, head, column, b=b)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(x.numpy(), y.numpy(), lw=0.9, marker="." if x.numel() <= 200 else None)
    ax.set_xlabel("query position")
    ax.set_ylabel(column)
    ax.set_title(f"layer {layer} head {head}: {column} of each row ({x.numel()} rows)")
    if tokens is not None and x.numel() <= 60:
        ax.set_xticks(x.numpy(), [tokens[int(p)] if int(p) < len(tokens) else "" for p in x], rotation=90, fontsize=7)
    return _save(fig, path)


def _pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    """``fig`` laid out, written to ``path`` as a PNG and closed."""
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def _cell(x) -> str:
    """A head-table cell as text: numbers to 3 decimals, '-' where not captured."""
    if isinstance(x, float):
        return "-" if math.isnan(x) else f"{x:.3f}"
    return str(x)


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def page(table: HeadTable, overview: Path, received: Path, title: str = "attention statistics",
         meta: dict[str, str] | None = None) -> str:
    """The HTML page: the two pictures inlined, the roles found, the head table (L·H rows)."""
    roles = table.roles()
    role_rows = "".join(f"<tr><td>{r.layer}</td><td>{html.escape(r.name)}</td><td>{r.head}</td><td>{html.escape(r.role)}</td>"
                        f"<td>{r.score:.3f}</td></tr>" for r in roles)
    role_rows = role_rows or "<tr><td colspan=5>none above the thresholds</td></tr>"
    roles_head = "<tr><th>layer</th><th>name</th><th>head</th><th>role</th><th>score</th></tr>"
    alt = "overview: entropy, sink, previous-token per layer and head"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["layer", "name", "head", *table.columns])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(x))}</td>" for x in row) + "</tr>" for row in table.rows())
    info = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in (meta or {}).items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:16px;color:#222}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1><ul>{info}</ul>
<h2>Layers × heads</h2><img alt="{alt}" data-testid="overview" src="{_data_uri(overview)}">
<h2>Attention received by each key</h2><img alt="received curve" data-testid="received" src="{_data_uri(received)}">
<h2>Roles</h2><table data-testid="roles">{roles_head}{role_rows}</table>
<h2>Head table</h2><table data-testid="heads"><tr>{head}</tr>{body}</table>
</body></html>
"""


def write(table: HeadTable, records: Sequence, out: str | Path, title: str = "attention statistics",
          meta: dict[str, str] | None = None, tokens: Sequence[str] | None = None) -> dict[str, Path]:
    """overview.png, received.png (peaks labelled with ``tokens``) and stats.html in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ov = overview_png(table, out / "overview.png")
    rc = received_png(records, out / "received.png", tokens=tokens)
    pg = out / "stats.html"
    pg.write_text(page(table, ov, rc, title, meta), encoding="utf-8")
    return {"overview": ov, "received": rc, "page": pg}


__all__ = ["write", "page", "overview_png", "received_png", "received_peaks", "received_curves", "head_png", "head_series",
           "bin_mean", "sparkline", "received_curve"]
