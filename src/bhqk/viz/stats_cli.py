"""``bhqk stats [TEXT | --file text.txt] [--model DIR] [--out DIR] [--json FILE] [--csv FILE] [--top N]``:
every layer and head of a local Hugging Face model (``attn_implementation="bhqk"``; the bundled
all-MiniLM-L6-v2 when no ``--model`` is given, as ``bhqk show``) on a text of any length; prints the
head table (the mean statistics over the tokens; ``--top N``: the N heads of each role column) and
the roles found, writes ``overview.png`` (layers × heads: entropy, sink, previous-token),
``received.png`` (the attention each key receives, its peaks labelled with their tokens) and
``stats.html`` (both inlined, self-contained), and with ``--json``/``--csv`` the whole table as data.
``--plan PLAN.json`` (a causal LM): the forward runs with the plan's KV cache (``plan.cache(model)``), so
the table is the budget model's — its streaming heads see only their sink and window.
The statistics are computed tile by tile: no [Q, K] matrix is built."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from ..console import attention_progress, int_at_least, lines_off_terminal, plain, stage
from ..errors import LoadError
from ..inspect.rowstats import STATISTICS

DEFAULT_OUT = "bhqk-stats"
MIN_TEXT_TOKENS = 2  # tokens of text (besides the model's special tokens): prev needs a previous token
# What the command captures: every statistic of bhqk.inspect.rowstats.STATISTICS that needs no option (and
# offset 1, the window): each is a column of the head table it prints.
STATS = tuple(n for n, s in STATISTICS.items() if not s.always and s.option is None)
TOP_COLUMNS = ("sink", "prev", "local", "entropy")  # what --top N ranks (entropy: the lowest, the most focused)


def load(model: str | Path | None, backend: str = "auto"):
    """The model ``bhqk stats`` reads, on bhqk (``backend``), as :func:`bhqk.models.real.load_model` loads
    it: None is the bundled all-MiniLM-L6-v2, else what ``--model`` names in every command (a model name
    such as ``smollm2-135m``, a GGUF file, or a local Hugging Face folder with its tokenizer files). A
    folder without tokenizer files is refused before its weights load."""
    from ..integrations.hf_attention import implementation
    from ..models.bert import bundled_model_dir
    from ..models.real import TOKENIZER_FILES, load_model, resolve

    if model is None:
        return load_model(bundled_model_dir(), implementation(backend))
    found = Path(resolve(model))
    if (found / "config.json").is_file() and not any((found / f).is_file() for f in TOKENIZER_FILES):
        raise LoadError(f"--model {found} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): bhqk stats turns the "
                        "text into tokens with the model's tokenizer; copy the tokenizer files of the model it was "
                        "trained with into the folder.")
    with stage(f"loading {model}"):
        return load_model(model, implementation(backend))


def tokenize(loaded, text: str) -> tuple[dict, list[str], int]:
    """(model inputs [1, N], the N tokens, how many of them are text, not special tokens). The tokenizer's
    own warning about a sequence longer than the model takes is not printed: :func:`run` cuts the text."""
    from ..models.real import encode

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"the text is empty ({text[:20]!r}); bhqk stats needs at least {MIN_TEXT_TOKENS} tokens of text.")
    inputs, tokens = encode(loaded, text, verbose=False)
    special = set(getattr(loaded.tokenizer, "all_special_tokens", None) or ())
    return inputs, tokens, sum(t not in special for t in tokens)


def run(model_dir: str | Path | None, text: str, *, out: str | Path = DEFAULT_OUT, max_tokens: int | None = None,
        window: int = 8, backend: str = "auto", positions: tuple[int, ...] = (), top: int | None = None,
        json_path: str | Path | None = None, csv_path: str | Path | None = None,
        plan: Any = None) -> tuple[str, dict[str, Path]]:
    """The report (text) and the files written. ``model_dir`` None: the bundled MiniLM. ``plan``: a KV
    budget plan (``bhqk.budget.Plan``) whose cache the forward runs with (a causal LM; checked against
    the model before the forward)."""
    from ..inspect.capture import capture
    from ..integrations.model_map import cache_keyword
    from . import stats_page

    if max_tokens is not None and max_tokens < MIN_TEXT_TOKENS:
        raise ValueError(f"--max-tokens must be at least {MIN_TEXT_TOKENS}, got {max_tokens}.")
    if not isinstance(text, str) or not text.strip():  # before any model is loaded
        raise ValueError(f"the text is empty ({text[:20]!r}); bhqk stats needs at least {MIN_TEXT_TOKENS} tokens of text.")
    loaded = load(model_dir, backend)
    if plan is not None:
        if not loaded.decoder:
            raise ValueError(f"--plan: a KV budget runs a causal language model with its cache; {loaded.folder} is "
                             f"not one (an encoder attends without a cache).")
        plan.check(loaded.model)  # a plan made for another model fails here, before the forward
    name = loaded.name if model_dir is not None else "all-MiniLM-L6-v2 (bundled)"
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise ValueError(f"--max-tokens {max_tokens:,} is beyond the context of {name}: it reads at most {limit:,} "
                         f"positions (max_position_embeddings); give --max-tokens {limit:,} or less.")
    inputs, tokens, words = tokenize(loaded, text)
    if words < MIN_TEXT_TOKENS:
        raise ValueError(f"the text has {words} token{'' if words == 1 else 's'} besides the model's special tokens "
                         f"({tokens}); bhqk stats needs at least {MIN_TEXT_TOKENS} (a previous token to look at).")
    N = inputs["input_ids"].shape[1]
    keep = min(N, max_tokens or limit or N)
    inputs = {k: v[:, :keep] for k, v in inputs.items()}  # [1, N] -> [1, keep]
    tokens = tokens[:keep]
    layers = getattr(loaded.model.config, "num_hidden_layers", None)
    t0 = time.perf_counter()
    with torch.no_grad(), attention_progress("bhqk stats", total=layers), \
            capture(model=loaded.model, what=STATS, offsets=(1,), window=window) as cap:
        cache = {} if plan is None else {cache_keyword(loaded.model): plan.cache(loaded.model)}
        loaded.model(**inputs, **cache)
    seconds = time.perf_counter() - t0
    table = cap.head_table(positions)
    cut = "" if keep >= N else f" (cut from {N}" + (f": the model reads at most {limit:,} positions)" if max_tokens is None
                                                   else ": --max-tokens)")
    meta = {"model": str(loaded.folder), "tokens": f"{keep}{cut}", "layers × heads": f"{len(table.layers)} × {table.num_heads}",
            "window": str(window), "forward + statistics": f"{seconds:.2f} s"}
    if plan is not None:
        meta["plan"] = repr(plan)
    files = stats_page.write(table, cap.records, out, title=f"attention statistics: {name}", meta=meta, tokens=tokens)
    if json_path is not None:
        files["json"] = Path(json_path)
        table.to_json(json_path)
    if csv_path is not None:
        files["csv"] = Path(csv_path)
        table.to_csv(csv_path)
    roles = table.roles()
    lines = [f"{name}: {keep} tokens{cut}, {len(table.layers)} layers × {table.num_heads} heads, "
             f"forward + statistics {seconds:.2f} s", *([] if plan is None else [f"KV cache: {plan!r}"]), ""]
    lines += [top_heads(table, top), ""] if top is not None else [str(table), ""]
    lines.append("roles: " + (", ".join(f"layer {r.layer} head {r.head} {r.role} {r.score:.2f}" for r in roles)
                              if roles else "none found"))
    lines.append("wrote " + ", ".join(str(p) for p in files.values()))
    return "\n".join(lines), files


def top_heads(table, n: int) -> str:
    """The ``n`` heads of each role column (highest first; entropy: lowest first), one table."""
    from ..text import table as md

    rows = []
    for col in TOP_COLUMNS:
        if col in table.values:
            lowest = col == "entropy"
            for rank, h in enumerate(table.top(col, n, lowest=lowest), 1):
                rows.append([col + (" (lowest)" if lowest else ""), rank, h.layer, h.name, h.head, f"{h.value:.3f}"])
    return md(["column", "rank", "layer", "name", "head", "value"], rows)


def read_text(args: argparse.Namespace) -> str:
    """The text of ``--file`` (UTF-8; a file that is not names itself) or the argument."""
    if args.file is None:
        if args.text is None:
            raise ValueError("pass a text or --file text.txt.")
        return args.text
    path = Path(args.file)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--file {path} is not UTF-8 text ({e.reason} at byte {e.start}); bhqk stats reads UTF-8.") from None


def cmd_stats(args: argparse.Namespace) -> str:
    plan = None if args.plan is None else args.load_plan(args.plan)  # before the model: a bad plan fails at once
    with lines_off_terminal():  # off a terminal: a line per stage and per attention call on stderr
        return run(args.model, read_text(args), out=args.out, max_tokens=args.max_tokens, window=args.window,
                   backend=args.backend, top=args.top, json_path=args.json, csv_path=args.csv, plan=plan)[0]


def add_stats_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("stats", help="attention statistics of every layer and head of a local model, at any length",
                       description=plain(__doc__))
    s.add_argument("text", nargs="?", default=None, help="the text (or --file)")
    s.add_argument("--model", default=None, help="a model name (smollm2-135m, gemma3-270m), a GGUF file, or a local Hugging "
                                                 "Face model folder (config.json, weights, tokenizer); default: the bundled "
                                                 "all-MiniLM-L6-v2")
    s.add_argument("--file", default=None, help="read the text from this file (UTF-8)")
    s.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the pictures and the page (default {DEFAULT_OUT})")
    s.add_argument("--max-tokens", type=int_at_least(MIN_TEXT_TOKENS), default=None,
                   help="cut the text to this many tokens, at most the model's context (default: the model's limit; "
                        "a longer text is cut there, and the report says so)")
    s.add_argument("--window", type=int_at_least(1), default=8,
                   help="'local' is the attention within this many keys (default 8)")
    s.add_argument("--backend", default="auto", choices=("auto", "tiled", "torch", "reference"),
                   help="the attention backend the forward runs on (default auto); the statistics are the same")
    s.add_argument("--json", default=None, metavar="FILE",
                   help="write the whole head table as JSON (HeadTable.from_json reads it)")
    s.add_argument("--csv", default=None, metavar="FILE", help="write the whole head table as CSV, one line per head")
    s.add_argument("--top", type=int_at_least(1), default=None, metavar="N",
                   help=f"print only the N heads of each of {', '.join(TOP_COLUMNS)} (entropy: the lowest) instead of "
                        "every row")
    s.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="run the forward with the KV cache of a head-wise budget plan (bhqk.budget.Plan.load): the "
                        "budget model's statistics")
    s.set_defaults(func=cmd_stats)
    return s


__all__ = ["run", "load", "tokenize", "add_stats_parser", "cmd_stats", "top_heads"]
