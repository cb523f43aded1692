"""``bhqk stats --model DIR --file text.txt [--out DIR]``: every layer and head of a local Hugging Face
model (``attn_implementation="bhqk"``) on a text of any length; prints the head table (the mean
statistics over the tokens, the roles found) and writes ``overview.png`` (layers × heads: entropy,
sink, previous-token), ``received.png`` (the attention each key receives) and ``stats.html`` (both
inlined, self-contained). The statistics are computed tile by tile: no [Q, K] matrix is built."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

DEFAULT_OUT = "bhqk-stats"


def run(model_dir: str | Path, text: str, *, out: str | Path = DEFAULT_OUT, max_tokens: int | None = None,
        window: int = 8, backend: str = "auto", positions: tuple[int, ...] = (0,)) -> tuple[str, dict[str, Path]]:
    """The report (text) and the files written."""
    from ..inspect.capture import capture
    from ..integrations.transformers import encode, load_folder
    from . import stats_page

    name = "bhqk" if backend == "auto" else f"bhqk:{backend}"
    loaded = load_folder(model_dir, name=name)
    inputs, tokens = encode(loaded, text)
    N = inputs["input_ids"].shape[1]
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or N
    keep = min(N, limit if max_tokens is None else max_tokens)
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}.")
    inputs = {k: v[:, :keep] for k, v in inputs.items()}
    t0 = time.perf_counter()
    with torch.no_grad(), capture(model=loaded.model, what=("entropy", "distance", "sink", "received"),
                                  offsets=(1,), window=window) as cap:
        loaded.model(**inputs)
    seconds = time.perf_counter() - t0
    table = cap.head_table(positions)
    cut = f" (cut from {N})" if keep < N else ""
    meta = {"model": str(model_dir), "tokens": f"{keep}{cut}", "layers × heads": f"{len(table.layers)} × {table.num_heads}",
            "window": str(window), "forward + statistics": f"{seconds:.2f} s"}
    files = stats_page.write(table, cap.records, out, title=f"attention statistics: {Path(model_dir).name}", meta=meta)
    roles = table.roles()
    lines = [f"{Path(model_dir).name}: {keep} tokens{cut}, {len(table.layers)} layers × {table.num_heads} heads, "
             f"forward + statistics {seconds:.2f} s", "", str(table), ""]
    lines.append("roles: " + (", ".join(f"layer {li} head {h} {r} {v:.2f}" for li, h, r, v in roles) if roles else "none found"))
    lines.append("wrote " + ", ".join(str(p) for p in files.values()))
    return "\n".join(lines), files


def cmd_stats(args: argparse.Namespace) -> str:
    if args.file is None and args.text is None:
        raise ValueError("pass --file text.txt or a text.")
    text = Path(args.file).read_text(encoding="utf-8") if args.file is not None else args.text
    report, _ = run(args.model, text, out=args.out, max_tokens=args.max_tokens, window=args.window, backend=args.backend)
    return report


def add_stats_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("stats", help="attention statistics of every layer and head of a local model, at any length",
                       description=__doc__)
    s.add_argument("text", nargs="?", default=None, help="the text (or --file)")
    s.add_argument("--model", required=True, help="a local Hugging Face model folder (config.json, weights, tokenizer)")
    s.add_argument("--file", default=None, help="read the text from this file")
    s.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the pictures and the page (default {DEFAULT_OUT})")
    s.add_argument("--max-tokens", type=int, default=None, help="cut the text to this many tokens (default: the model's limit)")
    s.add_argument("--window", type=int, default=8, help="'local' is the attention within this many keys (default 8)")
    s.add_argument("--backend", default="auto", choices=("auto", "tiled", "torch", "reference"),
                   help="the attention backend the forward runs on (default auto); the statistics are the same")
    s.set_defaults(func=cmd_stats)
    return s


__all__ = ["run", "add_stats_parser", "cmd_stats"]
