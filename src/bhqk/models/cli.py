"""The ``bhqk embed`` and ``bhqk generate`` subcommands. Each ``add_*_parser(sub)`` registers one
subcommand whose ``func(args)`` returns the text to print (the convention of ``bhqk.cli``); the
argument types and progress bars every command shares are :mod:`bhqk.console`'s."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..console import (
    BACKEND_HELP,
    attention_progress,
    backend_name,
    finite_float_at_least,
    int_at_least,
    int_list,
    output_file,
    progress,
    sentence,
    stage,
    text,
)
from ..errors import LoadError


def own_model(load: Callable[[], Any], what: str, folder: str | Path | None) -> Any:
    """``load()`` of one of bhqk's own models (BERT, GPT-2: key tables) with a progress step; a failure that
    is not already a bhqk error (a truncated or corrupted weights file read by a third-party library)
    becomes a LoadError naming the folder. (transformers' models load through :func:`real.load_model`.)"""
    with stage(f"loading {what}"):
        try:
            return load()
        except (ValueError, ImportError, FileNotFoundError):
            raise
        except Exception as e:  # third-party readers (safetensors, torch.load) raise their own types
            raise LoadError(f"cannot load {what} from {folder}: {type(e).__name__}: {e}") from e


# --- bhqk embed ---------------------------------------------------------------------------------


def similarity_table(sentences: list[str], sim: torch.Tensor) -> str:
    """The numbered sentences, then the [S, S] cosine-similarity matrix."""
    n = len(sentences)
    lines = [f"[{i}] {s if len(s) <= 48 else s[:47] + '…'}" for i, s in enumerate(sentences)]
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
    enc = own_model(lambda: SentenceEncoder.from_pretrained(a.model, backend=a.backend), name, a.model)
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


def generate_hf(a: argparse.Namespace, plan: Any = None) -> str:
    """``bhqk generate --model smollm2-135m "prompt"``: transformers' causal LM on bhqk's attention (the one
    loader, :func:`bhqk.models.real.load_model`); the prompt asked through the tokenizer's chat template
    where it has one (``--raw``: the text as it is; ``--ids``: raw token ids), the new tokens streamed to
    stdout as they are decoded; ``plan``: a KV budget plan whose cache the generation runs with."""
    from transformers import TextStreamer

    from ..integrations.hf_attention import implementation
    from ..integrations.model_map import cache_keyword
    from .real import context_length, load_model

    with stage(f"loading {a.model}"):
        loaded = load_model(a.model, implementation(a.backend))
    model, tok = loaded.model, loaded.tokenizer
    if not loaded.decoder:
        raise LoadError(f"--model {a.model}: not a causal language model (config.json names no …ForCausalLM "
                        f"architecture); bhqk generate continues text with a decoder.")
    chat = False
    if a.prompt is not None:
        if tok is None:
            raise LoadError(f"{loaded.folder} has no tokenizer files; pass token ids with --ids 1,2,3 instead of a prompt.")
        chat = not a.raw and bool(getattr(tok, "chat_template", None))
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]  # [1, n]
        else:
            ids = tok(a.prompt, return_tensors="pt")["input_ids"]  # [1, n]
    else:
        ids = torch.tensor([a.ids])  # [1, n]
    vocab = model.config.vocab_size
    if ids.numel() == 0 or not bool(((ids >= 0) & (ids < vocab)).all()):
        raise ValueError(f"token ids must be in [0, {vocab}) for this model, got {ids[0].tolist()}.")
    limit = context_length(model)
    if limit is not None and ids.shape[1] + a.max_new_tokens > limit:
        raise ValueError(f"the prompt is {ids.shape[1]:,} tokens{' (chat template included)' if chat else ''}"
                         f" and --max-new-tokens asks for {a.max_new_tokens:,} more: {a.model} reads at most {limit:,} "
                         f"positions (max_position_embeddings); shorten the prompt or lower --max-new-tokens.")
    cache = {}
    if plan is not None:
        plan.check(model)  # a plan made for another model fails here, before any token
        cache = {cache_keyword(model): plan.cache(model)}
    if a.seed is not None:
        torch.manual_seed(a.seed)
    sample = a.temperature > 0
    extra = {"temperature": a.temperature, "top_k": a.top_k} if sample else {}
    eos = a.eos_id if a.eos_id is not None else model.generation_config.eos_token_id  # an id or a list (Gemma 3: 1, 106)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else eos if isinstance(eos, int) else eos[0]
    streamer = None if a.show_ids or tok is None else TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens, do_sample=sample,
                             eos_token_id=eos, pad_token_id=pad, streamer=streamer, **cache, **extra)  # [1, n + new]
    return ",".join(map(str, out[0].tolist())) if a.show_ids or tok is None else ""


def cmd_generate(a: argparse.Namespace) -> str:
    from .bert import load_tokenizer
    from .gpt2 import GPT2
    from .real import model_type

    if a.prompt is not None and a.ids is not None:
        raise ValueError("give a prompt or --ids, not both.")
    if a.prompt is None and a.ids is None:
        raise ValueError("the prompt is missing: give the text to continue or the question to ask (bhqk generate "
                         "--model M \"What is …?\"), or its token ids with --ids 1,2,3.")
    plan = None if getattr(a, "plan", None) is None else a.load_plan(a.plan)  # before the model: a bad plan fails at once
    if model_type(a.model) != "gpt2":  # a GPT-2 folder runs on bhqk's own GPT2
        return generate_hf(a, plan)
    if plan is not None:
        raise ValueError(f"--plan runs a transformers causal LM with the plan's cache; {a.model} is a GPT-2 folder, "
                         "which bhqk's own GPT-2 runs with its own KV cache.")
    model = own_model(lambda: GPT2.from_pretrained(a.model, backend=a.backend), "GPT-2", a.model)
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
                                   "With any other causal LM (smollm2-135m, gemma3-270m, a .gguf file, a Hugging Face "
                                   "folder: bhqk.models.pretrained) the answer streams as it is generated, the prompt asked "
                                   "through the tokenizer's chat template where it has one (--raw: the text as it is).")
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
    p.add_argument("--raw", action="store_true",
                   help="give the prompt to the model as it is, not through the chat template (a pretrained, not "
                        "instruction-tuned, model such as gemma3-270m continues text)")
    p.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="generate with the KV cache of a head-wise budget plan saved by bhqk budget --save")
    p.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    p.set_defaults(func=cmd_generate)
    return p
