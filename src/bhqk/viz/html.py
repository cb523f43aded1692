"""One self-contained interactive HTML page of captured attention (inline CSS and JS, no network;
package data in ``viz/assets/attention.*``; no matplotlib). Choose a layer and a head (or click a
thumbnail in the layers × heads overview); hover a token or a heatmap cell to see where it attends,
click to pin. Heatmaps are drawn on a <canvas> from weights stored 8 bits per cell
(:func:`encode_weights`); the named shapes of the call are shown above the views.
"""

from __future__ import annotations

import base64
import html as _html
import json
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .labels import check_labels
from .template import asset, fill, script_json

if TYPE_CHECKING:
    from ..inspect.capture import Capture


def encode_weights(w: torch.Tensor) -> tuple[float, str]:
    """One head's weights [r, K] → (scale, text): ``scale`` is the largest weight and ``text`` is
    base64 of the zlib-deflated bytes round(w / scale · 255), row-major (0 when all are 0)."""
    (scale, text), = encode_heads(w[None])  # [1, r, K]
    return scale, text


def encode_heads(W: torch.Tensor) -> list[tuple[float, str]]:
    """:func:`encode_weights` for every head of W [h, r, K] at once (one pass of tensor ops)."""
    scale = W.amax((1, 2)) if W.numel() else W.new_zeros(W.shape[0])  # [h]
    q = (W / scale.clamp(min=1e-30)[:, None, None] * 255).round().to(torch.uint8).numpy()  # [h, r, K]
    return [(float(s), base64.b64encode(zlib.compress(q[i].tobytes(), 6)).decode("ascii"))
            for i, s in enumerate(scale.tolist())]


def decode_weights(scale: float, text: str, K: int) -> torch.Tensor:
    """The inverse of :func:`encode_weights`, to within scale / 510: → [r, K] float32."""
    raw = zlib.decompress(base64.b64decode(text))
    q = torch.frombuffer(bytearray(raw), dtype=torch.uint8).float()  # [r·K]
    return (q * (scale / 255)).reshape(-1, K)  # [r, K]


def masked_rows(W: torch.Tensor) -> list[list[int]]:
    """Per head, the rows of W [h, r, K] that are all 0: fully masked queries (drawn grey)."""
    empty = (W.sum(-1) == 0).tolist()  # [h, r, K] -> [h, r]
    return [[r for r, e in enumerate(row) if e] for row in empty]


def page_data(cap: Capture, tokens: Sequence[str] | None = None, *, key_tokens: Sequence[str] | None = None,
              b: int = 0, special: Iterable[str] = ("[CLS]", "[SEP]"), notice: str | None = None) -> dict:
    """What the page shows, as plain JSON-able data: tokens, and per layer its named shapes, its
    captured heads, their weights [r, K] (8 bits per cell, see :func:`encode_weights`) and head
    statistics (with the share on each ``special`` token that is among the keys); ``notice`` is shown
    above the views (e.g. that the input was cut). ``tokens`` needs one token per query of every call
    and, unless ``key_tokens`` is given, one per key too (else a ShapeError)."""
    from ..inspect.stats import head_stats
    from ..inspect.trace import call_shapes

    if not cap.records:
        raise ValueError("html: the capture holds no records; run the model inside `with capture(...)`.")
    if any(r.weights is None for r in cap.records):
        raise ValueError("html: the page needs the weights; capture with what=(..., 'weights').")
    keys = key_tokens if key_tokens is not None else tokens
    for rec in cap.records:  # one token per query and per key of every call the page shows
        check_labels("html", tokens, key_tokens, rec.sizes["Q"], rec.sizes["K"], rec.name)
    special = tuple(s for s in special if keys is not None and s in keys)  # shares only of tokens that are there
    stats = head_stats(cap, keys, b=b, special=special)
    by = {(s.index, s.head): s for s in stats}
    layers: list[dict[str, Any]] = []
    for rec in cap.records:
        shapes = list(call_shapes(rec.sizes).items())
        W = rec["weights"][b].float().cpu()  # [B, h, r, K] -> [h, r, K]
        heads = []
        for h, (scale, text), masked in zip(rec.heads, encode_heads(W), masked_rows(W)):
            st = by[(rec.index, h)]
            heads.append({
                "head": h, "scale": scale, "w": text, "masked": masked,
                "stats": {"entropy": round(st.entropy, 3), "distance": round(st.distance, 2), "first": round(st.first, 3),
                          **{f"on {t}": round(v, 3) for t, v in st.special.items()}},
            })
        layers.append({"index": rec.index, "name": rec.name, "backend": rec.backend, "shapes": shapes,
                       "rows": rec.query_positions, "K": rec.sizes["K"],
                       "mask": repr(rec.mask) if rec.mask is not None else "none", "heads": heads})
    Kmax = max(la["K"] for la in layers)
    Qmax = max(la["rows"][-1] + 1 if la["rows"] else 0 for la in layers)
    qt = list(tokens) if tokens is not None else [str(i) for i in range(Qmax)]
    kt = list(keys) if keys is not None else [str(i) for i in range(Kmax)]
    return {"tokens": qt, "keyTokens": kt, "b": b, "layers": layers, "notice": notice}


def render(data: dict, title: str = "bhqk · attention") -> str:
    """The page as one HTML string."""
    blob = script_json(json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    return fill("attention.html", title=_html.escape(title), css=asset("attention.css"), js=asset("attention.js"), data=blob)


def html(cap: Capture, tokens: Sequence[str] | None = None, path: str | Path = "attention.html", *,
         key_tokens: Sequence[str] | None = None, b: int = 0, layer: int | str | None = None, head: int | None = None,
         title: str | None = None, special: Iterable[str] = ("[CLS]", "[SEP]"), notice: str | None = None) -> Path:
    """Write the interactive page for ``cap`` (one token per query; ``key_tokens`` for cross-attention)
    to ``path`` and return the path; it opens on ``layer`` (call index or name) and ``head``. The file
    works offline in any current browser (it needs DecompressionStream: Chromium 80, Firefox 113,
    Safari 16.4). ``notice`` is a line shown above the views."""
    data = page_data(cap, tokens, key_tokens=key_tokens, b=b, special=special, notice=notice)
    li = 0 if layer is None else cap.records.index(cap[layer])
    heads = cap.records[li].heads
    if head is not None and head not in heads:
        raise ValueError(f"html: head {head} was not captured for {cap.records[li].name!r}; captured heads: {heads}.")
    data["start"] = [li, 0 if head is None else heads.index(head)]
    if title is None:
        title = "bhqk · attention" + (f" · {' '.join(tokens)}" if tokens is not None else "")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data, title), encoding="utf-8")
    return out
