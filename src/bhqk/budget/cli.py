"""``bhqk budget --model PATH_OR_NAME --full 0.5 [--sink 64 --window 256 --score fisher] [--save plan.json]``:
score every layer × K/V head of a causal LM, keep the top fraction full, print the plan and the bytes
of keys and values it holds at ``--length`` tokens against the model's own cache.

Each score's options are flags, made from its fields (``bhqk.budget.find.SCORES``): ``--probe-length``
(the tokens a score reads), ``--batch``, ``--steps``, ``--checkpoint``, ``--resume`` and the others;
a flag of another score than ``--score`` is refused. The scores that read real text read ``--text
FILE`` (default Python's own documentation, ``pydoc_data.topics``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from ..console import int_at_least, lines_off_terminal, plain, say, stage
from .find import SCORES, TIE_ORDERS, find
from .plan import model_map

LENGTH = 8192  # --length's default


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def tie_order(text: str) -> str:
    """An argparse type: how ties are ordered, ``index`` or ``copy-mass`` (``find``'s ``ties="copy mass"``;
    either spelling, with a space, a hyphen or an underscore, means the same)."""
    value = " ".join(text.replace("-", " ").replace("_", " ").split())
    if value not in TIE_ORDERS:
        raise argparse.ArgumentTypeError(f"expected index or copy-mass, got {text!r}")
    return value


def _flag(option: str) -> str:
    """A score option's flag: ``--probe-length`` for ``length`` (``--length`` counts bytes), else ``--<option>``."""
    return "--probe-length" if option == "length" else "--" + option.replace("_", "-")


def _options() -> dict[str, dict[str, dataclasses.Field]]:
    """Every score option: its name -> {score name: its field}."""
    out: dict[str, dict[str, dataclasses.Field]] = {}
    for name, cls in SCORES.items():
        for f in cls.options():
            out.setdefault(f.name, {})[name] = f
    return out


def cmd_budget(a: argparse.Namespace) -> str:
    with lines_off_terminal():
        return budget(a)


def budget(a: argparse.Namespace) -> str:
    """``bhqk budget``; off a terminal a line per stage on stderr. A length beyond the model's context is
    refused before any head is scored."""
    from ..integrations.hf_attention import implementation
    from ..models.real import context_length, load_model

    t0 = time.perf_counter()
    options = {k: getattr(a, "score_" + k) for k in _options() if getattr(a, "score_" + k) is not None}
    for k in options:
        if a.score not in _options()[k]:
            raise ValueError(f"{_flag(k)} belongs to --score {' and '.join(_options()[k])} (got --score {a.score}).")
    texts = None
    if a.text is not None:
        texts = [Path(a.text).read_text()]
        if SCORES[a.score].reads != "real text":
            readers = ", ".join(n for n, c in SCORES.items() if c.reads == "real text")
            raise ValueError(f"--text is the text of --score {readers} (got --score {a.score}).")
    with stage(f"loading {a.model}"):
        loaded = load_model(a.model, implementation("auto"))
    model, tokenizer = loaded.causal("a budget plan (it is for decoders)", tokenizer=False)
    limit = context_length(model)
    for flag, n in (("--length", a.length), ("--probe-length", options.get("length"))):
        if limit is not None and n is not None and n > limit:
            raise ValueError(f"{flag} {n:,} is beyond the context of {loaded.name}: it reads at most {limit:,} positions "
                             f"(max_position_embeddings); give {flag} {limit:,} or less.")
    length = a.length if a.length is not None else min(LENGTH, limit or LENGTH)
    t1 = time.perf_counter()
    say(f"budget: scoring every K/V head by {a.score} …")
    plan = find(model, full=a.full, sink=a.sink, window=a.window, score=a.score, tokenizer=tokenizer, seed=a.seed,
                ties=a.ties, texts=texts, progress=lambda line: print(line, file=sys.stderr, flush=True), **options)
    t2 = time.perf_counter()
    held, own = plan.nbytes(length, model)
    lines = [str(plan), "",
             f"model: {model_map(model).shape.describe()}; loaded in {t1 - t0:.1f} s, scored in {t2 - t1:.1f} s",
             f"keys and values at {length:,} tokens (batch 1, {next(model.parameters()).dtype}): plan {_mib(held)}, "
             f"the model's own cache {_mib(own)} ({held / own:.3f}×; saves {_mib(own - held)})"]
    if a.save:
        lines.append(f"saved {plan.save(a.save)}")
    return "\n".join(lines)


def add_budget_parser(sub) -> argparse.ArgumentParser:
    def fraction(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {s!r}") from None
        if not 0 <= v <= 1:
            raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
        return v

    b = sub.add_parser("budget", help="choose which K/V heads keep every key (the rest keep a sink and a window)",
                       description=plain(__doc__))
    b.add_argument("--model", required=True,
                   help="a model name (smollm2-135m, gemma3-270m), a .gguf file or a local Hugging Face folder")
    b.add_argument("--full", type=fraction, default=0.5,
                   help="fraction of K/V heads that keep what the model keeps, among those whose layer sees "
                        "further back than the streaming window (default 0.5)")
    b.add_argument("--sink", type=int_at_least(0), default=64, help="first keys a streaming head keeps (default 64)")
    b.add_argument("--window", type=int_at_least(0), default=256, help="recent keys a streaming head keeps (default 256)")
    b.add_argument("--score", choices=list(SCORES), default="fisher",
                   help="how heads are ranked (default fisher: one forward and one backward on --text)")
    b.add_argument("--ties", type=tie_order, default="index", metavar="{index,copy-mass}",
                   help="order of heads the score ties: index (earlier layers first, default) or copy-mass (retrieval; "
                        "in Python ties=\"copy mass\", also accepted here)")
    b.add_argument("--length", type=int_at_least(1), default=None,
                   help=f"tokens at which bytes are counted, at most the model's context (default {LENGTH}, or the "
                        f"context where it is shorter)")
    b.add_argument("--seed", type=int, default=0, help="seed of the probe sequences (default 0)")
    b.add_argument("--text", default=None, metavar="FILE",
                   help="the text the scores that read real text read (default: Python's pydoc_data.topics)")
    for option, fields in _options().items():  # each score's fields, as flags
        f = next(iter(fields.values()))
        kind = str(f.type)
        typ = int_at_least(0 if option in ("steps", "until") else 1) if "int" in kind else float if "float" in kind else str
        defaults = ", ".join(f"{n} {fd.default}" for n, fd in fields.items() if fd.default is not None)
        docs = "; ".join(dict.fromkeys(fd.metadata["doc"] for fd in fields.values()))
        b.add_argument(_flag(option), dest="score_" + option, type=typ, default=None, metavar=option.upper(),
                       help=f"--score {', '.join(fields)}: {docs}" + (f" (default {defaults})" if defaults else ""))
    b.add_argument("--save", default=None, metavar="PLAN.json", help="write the plan as JSON")
    b.set_defaults(func=cmd_budget)
    return b


__all__ = ["add_budget_parser", "cmd_budget", "tie_order"]
