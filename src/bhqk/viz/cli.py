"""``bhqk show "The cat sat on the mat." --out DIR``: one sentence through a BERT (the bundled
all-MiniLM-L6-v2 by default), its attention captured from whatever backend ran, written as PNGs and
one interactive HTML page. :func:`show` is the same as a function (``bhqk demo`` calls it)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from ..inspect.capture import Capture, capture
from ..inspect.stats import HeadStats

SPECIAL = ("[CLS]", "[SEP]")


def pick_head(stats: Sequence[HeadStats]) -> HeadStats:
    """The most focused head (lowest entropy) among those that put under half their attention on
    [CLS]/[SEP]: a head that looks at words, so the picture has something to say."""
    wordy = [s for s in stats if sum(s.special.values()) < 0.5] or list(stats)
    return min(wordy, key=lambda s: (s.entropy, s.index, s.head))


def run_sentence(sentence: str, model: str | Path | None = None, backend: str = "auto") -> tuple[Capture, list[str]]:
    """Capture every layer and head of ``sentence`` through a BERT folder (default: bundled MiniLM)."""
    from ..models.bert import SentenceEncoder

    enc = SentenceEncoder.from_pretrained(model, backend=backend)
    tokens = enc.tokenizer.encode(sentence).tokens
    ids, attention_mask = enc.tokenize([sentence])  # [1, N], [1, N]
    with torch.no_grad(), capture(model=enc.model, what=("weights",)) as cap:
        enc.model(ids, attention_mask)
    return cap, list(tokens)


def show(sentence: str, out_dir: str | Path, *, model: str | Path | None = None, layer: int | None = None,
         head: int | None = None, backend: str = "auto", report: list[str] | None = None) -> list[Path]:
    """Write ``attention.png`` (one head, tokens on both axes), ``attention_grid.png`` (layers ×
    heads) and ``attention.html`` (interactive) for ``sentence`` into ``out_dir``; return the paths.
    ``layer``/``head`` default to the most focused head that is not parked on [CLS]/[SEP]. Lines
    describing what was drawn are appended to ``report`` when given."""
    from .heatmap import grid, heatmap
    from .html import html

    cap, tokens = run_sentence(sentence, model, backend)
    H = cap.records[0].sizes["H"]
    if layer is not None and not 0 <= layer < len(cap):
        raise ValueError(f"--layer {layer} is out of range: the model has {len(cap)} layers (0 … {len(cap) - 1}).")
    if head is not None and not 0 <= head < H:
        raise ValueError(f"--head {head} is out of range: the model has H={H} heads (0 … {H - 1}).")
    stats = cap.stats(tokens, special=SPECIAL)
    if layer is None or head is None:
        best = pick_head([s for s in stats if (layer is None or s.index == layer) and (head is None or s.head == head)])
        layer, head = best.index, best.head
    rec = cap[layer]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "attention.png", out / "attention_grid.png", out / "attention.html"]
    heatmap(cap, tokens, layer=layer, head=head, path=paths[0])
    grid(cap, path=paths[1])
    html(cap, tokens, paths[2], layer=layer, head=head, title=f"bhqk · attention · {sentence}")
    if report is not None:
        st = next(s for s in stats if s.index == layer and s.head == head)
        s = rec.sizes
        report += [
            f"{len(cap)} attention calls captured from backend {rec.backend!r}: weights [B={s['B']}, H={s['H']}, "
            f"Q={s['Q']}, K={s['K']}] each; tokens: {' '.join(tokens)}",
            f"attention.png shows layer {layer} ({rec.name}), head {head}: entropy {st.entropy:.2f} nats, "
            f"mean distance {st.distance:.2f} tokens, on [CLS]/[SEP] {sum(st.special.values()):.2f}",
        ]
    return paths


def cmd_show(a: argparse.Namespace) -> str:
    report: list[str] = []
    paths = show(a.sentence, a.out, model=a.model, layer=a.layer, head=a.head, backend=a.backend, report=report)
    return "\n".join(report + ["wrote:"] + [f"  {p}" for p in paths])


def add_show_parser(sub) -> argparse.ArgumentParser:
    """Register ``bhqk show`` on an argparse subparsers object."""
    s = sub.add_parser("show", help="pictures and an interactive page of a sentence's attention (bundled MiniLM)",
                       description="Run one sentence through a BERT encoder, capture every layer's attention "
                                   "weights [B, H, Q, K] and write attention.png, attention_grid.png and "
                                   "attention.html (rows = queries, columns = keys).")
    s.add_argument("sentence", help='the text, e.g. "The cat sat on the mat."')
    s.add_argument("--model", default=None, help="a local Hugging Face BERT folder (default: the bundled all-MiniLM-L6-v2)")
    s.add_argument("--layer", type=int, default=None, help="layer (attention call index) for attention.png; default: picked")
    s.add_argument("--head", type=int, default=None, help="head for attention.png; default: the most focused word-to-word head")
    s.add_argument("--backend", default="auto", help="attention backend the model runs on (auto, reference, torch, tiled)")
    s.add_argument("--out", required=True, help="folder to write the PNGs and the HTML page into")
    s.set_defaults(func=cmd_show)
    return s
