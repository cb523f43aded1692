"""The ``bhqk embed`` and ``bhqk generate`` subcommands, the argument types every subcommand checks
its options with, and the progress bars of long work. Each ``add_*_parser(sub)`` registers one
subcommand whose ``func(args)`` returns the text to print (the convention of ``bhqk.cli``).

Options are validated when they are parsed (an argparse ``type`` per kind of value), so a bad value
is one ``bhqk CMD: error: argument --x: ...`` line and exit status 2 before any work starts."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError

# --- argument types: each turns a bad value into one argparse error -----------------------------


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def finite_float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (``nan`` and ``inf`` are refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {value:g}")
        return value

    parse.__name__ = f"number >= {low:g}"
    return parse


def int_list(low: int | None = None) -> Callable[[str], list[int]]:
    """An argparse type: comma- (or space-) separated integers, at least one, each >= ``low``."""

    def parse(text: str) -> list[int]:
        parts = [x for x in text.replace(" ", ",").split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}")
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}") from None
        if low is not None and any(v < low for v in values):
            raise argparse.ArgumentTypeError(f"every value must be >= {low}, got {text!r}")
        return values

    parse.__name__ = "list of integers"
    return parse


def backend_name(text: str) -> str:
    """An argparse type: the name of a registered attention backend."""
    from ..functional import names

    if text not in names():
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose from {', '.join(names())}")
    return text


def sentence(text: str) -> str:
    """An argparse type: a sentence with at least one non-space character."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a sentence is empty ({text!r}); give every sentence some text")
    return text


def text(value: str) -> str:
    """An argparse type: a text with at least one non-space character (``bhqk show``, ``trace``, ``generate``)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"the text is empty ({value!r}); give some words to read")
    return value


def output_file(*suffixes: str) -> Callable[[str], Path]:
    """An argparse type: a path whose suffix says the format (one of ``suffixes``)."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: the suffix says the format; use one of {', '.join(suffixes)}")
        return path

    parse.__name__ = "output file"
    return parse


BACKEND_HELP = "attention backend: auto (default), reference, torch, tiled, or another registered name"

# --- progress on a terminal ---------------------------------------------------------------------


def progress_enabled() -> bool:
    """Progress bars only when both stdout and stderr are terminals (quiet when piped or captured)."""
    try:
        return sys.stderr.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def progress(iterable: Any = None, **kwargs: Any):
    """A tqdm bar on stderr, disabled unless :func:`progress_enabled`."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs in the venv)

    return tqdm(iterable, disable=not progress_enabled(), leave=False, dynamic_ncols=True, **kwargs)


@contextlib.contextmanager
def step(desc: str) -> Iterator[None]:
    """A one-step bar for work that reports nothing while it runs (e.g. loading a model)."""
    with progress(total=1, desc=desc, bar_format="{desc} … {elapsed}") as bar:
        yield
        bar.update(1)


class _Ticker:
    """An observer that advances a bar by one every ``per`` attention calls."""

    def __init__(self, bar, per: int = 1) -> None:
        self.bar, self.per, self.calls = bar, max(1, per), 0

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event == "attention":
            self.calls += 1
            if self.calls % self.per == 0:
                self.bar.update(1)


@contextlib.contextmanager
def attention_progress(desc: str, total: int | None = None, per: int = 1, unit: str = " attention call") -> Iterator[None]:
    """A bar that advances as attention calls run (one tick per ``per`` calls)."""
    from ..observe import observing

    with progress(total=total, desc=desc, unit=unit) as bar:
        if bar.disable:
            yield
            return
        with observing(_Ticker(bar, per)):
            yield


def load_model(load: Callable[[], Any], what: str, folder: str | Path | None) -> Any:
    """``load()`` with a progress step; a failure that is not already a bhqk error (a truncated or
    corrupted weights file read by a third-party library) becomes a LoadError naming the folder."""
    with step(f"loading {what}"):
        try:
            return load()
        except (ValueError, ImportError, FileNotFoundError):
            raise
        except Exception as e:  # third-party readers (safetensors, torch.load) raise their own types
            raise LoadError(f"cannot load {what} from {folder}: {type(e).__name__}: {e}") from e


# --- bhqk embed ---------------------------------------------------------------------------------


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def similarity_table(sentences: list[str], sim: torch.Tensor) -> str:
    """The numbered sentences, then the [S, S] cosine-similarity matrix."""
    n = len(sentences)
    lines = [f"[{i}] {_short(s)}" for i, s in enumerate(sentences)]
    lines.append("")
    lines.append("cosine similarity".ljust(18) + "".join(f"[{j}]".rjust(8) for j in range(n)))
    for i in range(n):
        lines.append(f"[{i}]".ljust(18) + "".join(f"{sim[i, j].item():8.4f}" for j in range(n)))
    return "\n".join(lines)


def read_sentences(a: argparse.Namespace) -> list[str]:
    """The sentences on the command line, then those of ``--file`` (one per line, blank lines skipped)."""
    out = list(a.sentences)
    if a.file is not None:
        text = sys.stdin.read() if a.file == "-" else Path(a.file).read_text(encoding="utf-8")
        out += [line for line in text.splitlines() if line.strip()]
    if not out:
        raise ValueError("no sentences: give them as arguments or with --file FILE (one per line).")
    return out


def write_embeddings(path: Path, sentences: list[str], emb: torch.Tensor, model: str) -> None:
    """``.npy``: the float32 [S, D] array; ``.json``: model, sentences and the [S, D] embeddings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".npy":
        import numpy as np

        np.save(path, emb.float().numpy())  # [S, D]
    else:
        path.write_text(json.dumps({"model": model, "pooling": "mean", "normalized": True, "shape": list(emb.shape),
                                    "sentences": sentences, "embeddings": emb.tolist()}))


def cmd_embed(a: argparse.Namespace) -> str:
    from .bert import SentenceEncoder, cosine_similarity

    sentences = read_sentences(a)
    name = str(a.model) if a.model else "bundled all-MiniLM-L6-v2"
    enc = load_model(lambda: SentenceEncoder.from_pretrained(a.model, backend=a.backend), name, a.model)
    parts = []
    with progress(total=len(sentences), desc="embedding", unit=" sentence") as bar:
        for i in range(0, len(sentences), enc.batch_size):
            chunk = sentences[i : i + enc.batch_size]
            parts.append(enc.encode(chunk))  # [s, D]
            bar.update(len(chunk))
    emb = torch.cat(parts)  # [S, D]
    head = f"model: {name} (D={emb.shape[-1]}, mean pooling, L2-normalised)"
    if a.out is not None:
        write_embeddings(a.out, sentences, emb, name)
        return f"{head}\nwrote embeddings [S={emb.shape[0]}, D={emb.shape[1]}] to {a.out}"
    return head + "\n" + similarity_table(sentences, cosine_similarity(emb))


def add_embed_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("embed", help="sentence embeddings and their cosine-similarity table (BERT / MiniLM)",
                       description="Embed sentences with a BERT encoder (mean pooling, L2-normalised) and print "
                                   "their [S, S] cosine similarities, or write the [S, D] vectors with --out.")
    p.add_argument("sentences", nargs="*", type=sentence, help="one or more sentences (or use --file)")
    p.add_argument("--file", default=None, metavar="FILE",
                   help="read more sentences from FILE, one per line (blank lines skipped; - for stdin)")
    p.add_argument("--out", type=output_file(".npy", ".json"), default=None, metavar="FILE",
                   help="write the [S, D] embeddings to FILE: .npy (float32 array) or .json (with the sentences)")
    p.add_argument("--model", default=None, help="a local Hugging Face BERT folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    p.set_defaults(func=cmd_embed)
    return p


# --- bhqk generate ------------------------------------------------------------------------------


def generate_pretrained(a: argparse.Namespace) -> str:
    """``bhqk generate --model smollm2-135m "prompt"``: transformers' model on bhqk's attention, the
    prompt asked through the chat template (``--ids``: raw token ids, no template), the new tokens
    streamed to stdout as they are decoded."""
    from transformers import TextStreamer

    from .real import context_length, load_for_cli

    model, tok = load_model(lambda: load_for_cli(a.model, a.backend), str(a.model), a.model)
    if a.prompt is not None:
        ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]  # [1, n]
    else:
        ids = torch.tensor([a.ids])  # [1, n]
    vocab = model.config.vocab_size
    if ids.numel() == 0 or not bool(((ids >= 0) & (ids < vocab)).all()):
        raise ValueError(f"token ids must be in [0, {vocab}) for this model, got {ids[0].tolist()}.")
    limit = context_length(model)
    if limit is not None and ids.shape[1] + a.max_new_tokens > limit:
        raise ValueError(f"the prompt is {ids.shape[1]:,} tokens{' (chat template included)' if a.prompt is not None else ''}"
                         f" and --max-new-tokens asks for {a.max_new_tokens:,} more: {a.model} reads at most {limit:,} "
                         f"positions (max_position_embeddings); shorten the prompt or lower --max-new-tokens.")
    if a.seed is not None:
        torch.manual_seed(a.seed)
    sample = a.temperature > 0
    extra = {"temperature": a.temperature, "top_k": a.top_k} if sample else {}
    eos = a.eos_id if a.eos_id is not None else model.generation_config.eos_token_id  # an id or a list (Gemma 3: 1, 106)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else eos if isinstance(eos, int) else eos[0]
    streamer = None if a.show_ids else TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens, do_sample=sample,
                             eos_token_id=eos, pad_token_id=pad, streamer=streamer, **extra)  # [1, n + new]
    return ",".join(map(str, out[0].tolist())) if a.show_ids else ""


def cmd_generate(a: argparse.Namespace) -> str:
    from .bert import load_tokenizer
    from .gpt2 import GPT2
    from .real import is_pretrained, resolve

    if (a.prompt is None) == (a.ids is None):
        raise ValueError("give either a prompt (needs tokenizer.json in the model folder) or --ids, not both.")
    if is_pretrained(resolve(a.model)):
        return generate_pretrained(a)
    model = load_model(lambda: GPT2.from_pretrained(a.model, backend=a.backend), "GPT-2", a.model)
    tok = None
    if a.prompt is not None:
        if not (Path(a.model) / "tokenizer.json").is_file():
            raise LoadError(f"{a.model} has no tokenizer.json; pass token ids with --ids 1,2,3 instead of a prompt.")
        tok = load_tokenizer(a.model)
        prompt = tok.encode(a.prompt).ids
    else:
        prompt = a.ids
    if not prompt:
        raise ValueError("the prompt is empty after tokenization.")
    vocab = model.config.vocab_size
    if any(not 0 <= i < vocab for i in prompt):
        raise ValueError(f"token ids must be in [0, {vocab}) for this model, got {prompt}.")
    with attention_progress("generating", total=a.max_new_tokens, per=len(model.blocks), unit=" token"):
        out = model.generate(torch.tensor([prompt]), a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                             seed=a.seed, eos_token_id=a.eos_id)[0].tolist()
    new = out[len(prompt):]
    if tok is None:
        return ",".join(map(str, out))
    return tok.decode(prompt) + tok.decode(new) if not a.show_ids else ",".join(map(str, out))


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="continue a prompt (GPT-2 folder) or answer it (smollm2-135m, gemma3-270m, a GGUF file)",
                       description="Continue a prompt with a local Hugging Face GPT-2 folder, one token at a time "
                                   "with a KV cache: greedy by default, sampled with --temperature and --top-k. "
                                   "With a pretrained chat model (smollm2-135m, gemma3-270m, a .gguf file, a Llama-family "
                                   "folder: bhqk.models.pretrained) the prompt is asked through its chat template and the "
                                   "answer streams as it is generated.")
    p.add_argument("prompt", nargs="?", default=None, type=text,
                   help="text (tokenized with the folder's tokenizer.json; a chat model: the user's message)")
    p.add_argument("--model", required=True,
                   help="a local Hugging Face GPT-2 folder (config.json + weights), or a pretrained model: "
                        "a model name (smollm2-135m, gemma3-270m), a .gguf file, a Llama-family Hugging Face folder")
    p.add_argument("--ids", type=int_list(0), default=None,
                   help="prompt token ids, comma-separated, when there is no tokenizer.json (e.g. 464,3797)")
    p.add_argument("--max-new-tokens", "-n", type=int_at_least(0), default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=finite_float_at_least(0.0), default=0.0,
                   help="0 = greedy (default); > 0 samples from softmax(logits / temperature)")
    p.add_argument("--top-k", type=int_at_least(1), default=None, help="sample only from the k most likely tokens (k >= 1)")
    p.add_argument("--seed", type=int_at_least(0), default=None, help="random seed for sampling")
    p.add_argument("--eos-id", type=int_at_least(0), default=None, help="stop when this token id is generated")
    p.add_argument("--show-ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    p.set_defaults(func=cmd_generate)
    return p
