"""The ``bhqk embed`` and ``bhqk generate`` subcommands. Each ``add_*_parser(sub)`` registers one
subcommand whose ``func(args)`` returns the text to print (the convention of ``bhqk.cli``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


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


def cmd_embed(a: argparse.Namespace) -> str:
    from .bert import SentenceEncoder, cosine_similarity

    enc = SentenceEncoder.from_pretrained(a.model, backend=a.backend)
    emb = enc.encode(a.sentences)  # [S, D]
    head = f"model: {a.model or 'bundled all-MiniLM-L6-v2'} (D={emb.shape[-1]}, mean pooling, L2-normalised)\n"
    return head + similarity_table(a.sentences, cosine_similarity(emb))


def add_embed_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("embed", help="sentence embeddings and their cosine-similarity table (BERT / MiniLM)")
    p.add_argument("sentences", nargs="+", help="one or more sentences")
    p.add_argument("--model", default=None, help="a local Hugging Face BERT folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--backend", default="auto", help="attention backend (default: auto)")
    p.set_defaults(func=cmd_embed)
    return p


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got {text!r}.") from None


def cmd_generate(a: argparse.Namespace) -> str:
    from ..errors import LoadError
    from .bert import load_tokenizer
    from .gpt2 import GPT2

    if (a.prompt is None) == (a.ids is None):
        raise ValueError("give either a prompt (needs tokenizer.json in the model folder) or --ids, not both.")
    model = GPT2.from_pretrained(a.model, backend=a.backend)
    tok = None
    if a.prompt is not None:
        if not (Path(a.model) / "tokenizer.json").is_file():
            raise LoadError(f"{a.model} has no tokenizer.json; pass token ids with --ids 1,2,3 instead of a prompt.")
        tok = load_tokenizer(a.model)
        prompt = tok.encode(a.prompt).ids
    else:
        prompt = _parse_ids(a.ids)
    if not prompt:
        raise ValueError("the prompt is empty after tokenization.")
    vocab = model.config.vocab_size
    if any(not 0 <= i < vocab for i in prompt):
        raise ValueError(f"token ids must be in [0, {vocab}) for this model, got {prompt}.")
    out = model.generate(torch.tensor([prompt]), a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                         seed=a.seed, eos_token_id=a.eos_id)[0].tolist()
    new = out[len(prompt):]
    if tok is None:
        return ",".join(map(str, out))
    return tok.decode(prompt) + tok.decode(new) if not a.show_ids else ",".join(map(str, out))


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="continue a prompt with a local GPT-2 folder (KV-cache decoding)")
    p.add_argument("prompt", nargs="?", default=None, help="text (tokenized with the folder's tokenizer.json)")
    p.add_argument("--model", required=True, help="a local Hugging Face GPT-2 folder (config.json + weights)")
    p.add_argument("--ids", default=None, help="prompt token ids, comma-separated, when there is no tokenizer.json")
    p.add_argument("--max-new-tokens", "-n", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--eos-id", type=int, default=None, help="stop when this token is generated")
    p.add_argument("--show-ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--backend", default="auto", help="attention backend (default: auto)")
    p.set_defaults(func=cmd_generate)
    return p
