"""``bhqk budget --model PATH_OR_NAME --full 0.5 [--sink 64 --window 256 --score retrieval] [--save plan.json]``:
score every layer × K/V head of a causal LM, keep the top fraction full, print the plan and the bytes
of keys and values it holds at ``--length`` tokens against a full cache."""

from __future__ import annotations

import argparse
import time

from ..errors import LoadError
from .find import SCORES, find
from .plan import model_shape


def load_model(source: str):
    """(model, tokenizer) for a model name, a ``.gguf`` file or a local Hugging Face folder, running
    bhqk's attention (a folder may lack tokenizer files: the induction score needs none); the names of
    every command (:func:`bhqk.models.real.open_model`)."""
    from ..models.real import open_model

    loaded = open_model(source)
    if not loaded.decoder:
        raise LoadError(f"--model {source}: not a causal language model (a budget plan is for decoders).")
    return loaded.model, loaded.tokenizer


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_budget(a: argparse.Namespace) -> str:
    t0 = time.perf_counter()
    model, tokenizer = load_model(a.model)
    t1 = time.perf_counter()
    plan = find(model, full=a.full, sink=a.sink, window=a.window, score=a.score, tokenizer=tokenizer, seed=a.seed,
                ties=a.ties.replace("-", " "))
    t2 = time.perf_counter()
    held, own = plan.nbytes(a.length, model)
    lines = [str(plan), "",
             f"model: {model_shape(model).describe()}; loaded in {t1 - t0:.1f} s, scored in {t2 - t1:.1f} s",
             f"keys and values at {a.length:,} tokens (batch 1, {next(model.parameters()).dtype}): plan {_mib(held)}, "
             f"the model's own cache {_mib(own)} ({held / own:.3f}×; saves {_mib(own - held)})"]
    if a.save:
        lines.append(f"saved {plan.save(a.save)}")
    return "\n".join(lines)


def add_budget_parser(sub) -> argparse.ArgumentParser:
    from ..models.cli import int_at_least

    def fraction(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {s!r}") from None
        if not 0 <= v <= 1:
            raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
        return v

    b = sub.add_parser("budget", help="choose which K/V heads keep every key (the rest keep a sink and a window)",
                       description=__doc__)
    b.add_argument("--model", required=True,
                   help="a model name (smollm2-135m, gemma3-270m), a .gguf file or a local Hugging Face folder")
    b.add_argument("--full", type=fraction, default=0.5,
                   help="fraction of K/V heads that keep what the model keeps, among those whose layer sees "
                        "further back than the streaming window (default 0.5)")
    b.add_argument("--sink", type=int_at_least(0), default=64, help="first keys a streaming head keeps (default 64)")
    b.add_argument("--window", type=int_at_least(0), default=256, help="recent keys a streaming head keeps (default 256)")
    b.add_argument("--score", choices=SCORES, default="retrieval", help="how heads are ranked (default retrieval)")
    b.add_argument("--ties", choices=("index", "copy-mass"), default="index",
                   help="order of heads the score ties: index (earlier layers first, default) or copy-mass (retrieval)")
    b.add_argument("--length", type=int_at_least(1), default=8192, help="tokens at which bytes are counted (default 8192)")
    b.add_argument("--seed", type=int, default=0, help="seed of the probe sequences (default 0)")
    b.add_argument("--save", default=None, metavar="PLAN.json", help="write the plan as JSON")
    b.set_defaults(func=cmd_budget)
    return b


__all__ = ["add_budget_parser", "cmd_budget", "load_model"]
