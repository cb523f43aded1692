"""``bhqk show "The cat sat on the mat." [--out DIR]``: one text through a BERT (the bundled
all-MiniLM-L6-v2 by default), its attention captured from whatever backend ran, written as PNGs and
one interactive HTML page (default folder: ``bhqk-show``). Text longer than ``--max-tokens`` (default:
the model's limit, 256 for MiniLM) is cut, and the report and the page say so. :func:`show` is the
same as a function (``bhqk demo`` calls it)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from ..console import BACKEND_HELP, attention_progress, backend_name
from ..console import text as text_arg
from ..inspect.capture import Capture, capture
from ..inspect.stats import HeadStats

DEFAULT_OUT = "bhqk-show"
MODEL_HELP = ("a model name (smollm2-135m, gemma3-270m), a .gguf file or a local Hugging Face folder, encoder or decoder, loaded "
              "offline (default: the bundled all-MiniLM-L6-v2)")


def pick_head(stats: Sequence[HeadStats]) -> HeadStats:
    """The most focused head (lowest entropy) among those that put under half their attention on
    special tokens ([CLS]/[SEP], where the tokenizer has them): a head that looks at words, so the
    picture has something to say."""
    wordy = [s for s in stats if sum(s.special.values()) < 0.5] or list(stats)
    return min(wordy, key=lambda s: (s.entropy, s.index, s.head))


def run_sentence(sentence: str, model: str | Path | None = None, backend: str = "auto", *,
                 max_tokens: int | None = None, cut: list[int] | None = None,
                 specials: list[str] | None = None) -> tuple[Capture, list[str]]:
    """Capture every layer and head of ``sentence``, cut to ``max_tokens`` tokens (special tokens
    included; default and upper bound: the model's limit, 256 at most). ``model``: None (the bundled
    MiniLM) or a BERT folder on bhqk's own encoder, else any ``--model`` through transformers on bhqk.
    When ``cut`` is given, [tokens before the cut, tokens kept] is appended to it; when ``specials`` is
    given, the tokenizer's special tokens among the kept tokens. Blank text is refused (a ValueError)
    before any model is loaded."""
    check_text(sentence)
    if model is not None and not _is_bert_folder(model):
        return _run_hf(sentence, model, backend, max_tokens=max_tokens, cut=cut, specials=specials)
    from ..models.bert import SentenceEncoder

    enc = SentenceEncoder.from_pretrained(model, backend=backend)
    limit = enc.tokenizer.truncation["max_length"] if enc.tokenizer.truncation else enc.model.config.max_positions
    limit = _limit(max_tokens, limit)
    enc.tokenizer.no_truncation()
    whole = len(enc.tokenizer.encode(sentence).ids)
    enc.tokenizer.enable_truncation(limit)
    encoding = enc.tokenizer.encode(sentence)
    tokens = encoding.tokens
    if cut is not None:
        cut += [whole, len(tokens)]
    if specials is not None:
        specials += dict.fromkeys(t for t, m in zip(tokens, encoding.special_tokens_mask) if m)
    ids, attention_mask = enc.tokenize([sentence])  # [1, N], [1, N]
    with torch.no_grad(), capture(model=enc.model, what=("weights",)) as cap:
        enc.model(ids, attention_mask)
    return cap, list(tokens)


def check_text(text: str) -> None:
    """Refuse text with nothing to read ("" or only spaces): the model would see only its special tokens."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"the text is empty ({text!r}); give some words to read.")


def _limit(max_tokens: int | None, limit: int) -> int:
    if max_tokens is None:
        return limit
    if not 3 <= max_tokens <= limit:
        raise ValueError(f"--max-tokens {max_tokens} is out of range: this model takes 3 … {limit} tokens "
                         f"(special tokens included).")
    return max_tokens


def _is_bert_folder(model: str | Path) -> bool:
    """A BERT folder is read by bhqk's own encoder; a model name, a GGUF file or any other folder goes through transformers."""
    from ..models.real import model_type

    return model_type(model) == "bert"


def _run_hf(sentence: str, folder: str | Path, backend: str, *, max_tokens: int | None,
            cut: list[int] | None, specials: list[str] | None) -> tuple[Capture, list[str]]:
    """``run_sentence`` for a model name, a GGUF file or any local Hugging Face folder: transformers' model on bhqk."""
    from ..integrations.hf_attention import implementation
    from ..models.real import encode, load_model

    loaded = load_model(folder, implementation(backend))
    inputs, tokens = encode(loaded, sentence)  # input_ids [1, N], ...
    limit = min(HF_MAX_TOKENS, int(getattr(loaded.model.config, "max_position_embeddings", HF_MAX_TOKENS) or HF_MAX_TOKENS))
    limit = _limit(max_tokens, limit)
    if cut is not None:
        cut += [len(tokens), min(len(tokens), limit)]
    if specials is not None:
        known = set(getattr(loaded.tokenizer, "all_special_tokens", None) or ())
        specials += dict.fromkeys(t for t in tokens[:limit] if t in known)
    inputs = {k: v[:, :limit] for k, v in inputs.items()}  # [1, N] -> [1, ≤ limit]
    with torch.no_grad(), capture(model=loaded.model, what=("weights",)) as cap:
        loaded.model(**inputs)
    return cap, tokens[:limit]


HF_MAX_TOKENS = 256  # the page and the PNGs stay readable and small up to here


def cut_notice(whole: int, kept: int, max_tokens: int | None) -> str | None:
    """The line that says the input was cut, or None when it was not."""
    if whole <= kept:
        return None
    why = f"--max-tokens {max_tokens}" if max_tokens is not None else "the model's limit; --max-tokens sets a lower one"
    return f"input cut: {whole} tokens, the first {kept} are shown ([SEP] kept at the end; {why})."


def show(sentence: str, out_dir: str | Path = DEFAULT_OUT, *, model: str | Path | None = None, layer: int | None = None,
         head: int | None = None, backend: str = "auto", max_tokens: int | None = None,
         report: list[str] | None = None) -> list[Path]:
    """Write ``attention.png`` (one head, tokens on both axes), ``attention_grid.png`` (layers ×
    heads) and ``attention.html`` (interactive) for ``sentence`` into ``out_dir``; return the paths.
    ``layer``/``head`` default to the most focused head that is not parked on special tokens; the text
    is cut to ``max_tokens`` (see :func:`run_sentence`). Lines describing what was drawn (first, a
    notice when the text was cut) are appended to ``report`` when given."""
    from .heatmap import grid, heatmap
    from .html import html

    cut: list[int] = []
    specials: list[str] = []  # the tokenizer's special tokens in this text: their shares are reported
    cap, tokens = run_sentence(sentence, model, backend, max_tokens=max_tokens, cut=cut, specials=specials)
    notice = cut_notice(cut[0], cut[1], max_tokens)
    H = cap.records[0].sizes["H"]
    if layer is not None and not 0 <= layer < len(cap):
        raise ValueError(f"--layer {layer} is out of range: the model has {len(cap)} layers (0 … {len(cap) - 1}).")
    if head is not None and not 0 <= head < H:
        raise ValueError(f"--head {head} is out of range: the model has H={H} heads (0 … {H - 1}).")
    stats = cap.stats(tokens, special=specials)
    if layer is None or head is None:
        best = pick_head([s for s in stats if (layer is None or s.index == layer) and (head is None or s.head == head)])
        layer, head = best.index, best.head
    rec = cap[layer]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "attention.png", out / "attention_grid.png", out / "attention.html"]
    heatmap(cap, tokens, layer=layer, head=head, path=paths[0])
    grid(cap, path=paths[1])
    title = sentence if len(sentence) <= 80 else sentence[:79] + "…"
    html(cap, tokens, paths[2], layer=layer, head=head, title=f"bhqk · attention · {title}", notice=notice,
         special=specials)
    if report is not None:
        if notice is not None:
            report.append(notice)
        st = next(s for s in stats if s.index == layer and s.head == head)
        s = rec.sizes
        on = f", on {'/'.join(specials)} {sum(st.special.values()):.2f}" if specials else ""
        report += [
            f"{len(cap)} attention calls captured from backend {rec.backend!r}: weights [B={s['B']}, H={s['H']}, "
            f"Q={s['Q']}, K={s['K']}] each",
            f"tokens: {' '.join(tokens)}",
            f"attention.png shows layer {layer} ({rec.name}), head {head}:",
            f"  entropy {st.entropy:.2f} nats, mean distance {st.distance:.2f} tokens{on}",
        ]
    return paths


def cmd_show(a: argparse.Namespace) -> str:
    report: list[str] = []
    with attention_progress("show"):  # a bar that counts the attention calls (a layer each)
        paths = show(a.sentence, a.out, model=a.model, layer=a.layer, head=a.head, backend=a.backend,
                     max_tokens=a.max_tokens, report=report)
    return "\n".join(report + ["wrote:"] + [f"  {p}" for p in paths])


def add_show_parser(sub) -> argparse.ArgumentParser:
    """Register ``bhqk show`` on an argparse subparsers object."""
    s = sub.add_parser("show", help="pictures and an interactive page of a text's attention (bundled MiniLM or any local model)",
                       description="Run one text through a model (the bundled MiniLM, or --model: a model name, a GGUF "
                                   "file or any local Hugging Face folder, encoder or decoder), capture every layer's attention "
                                   "weights [B, H, Q, K] and write attention.png, attention_grid.png and "
                                   "attention.html (rows = queries, columns = keys) into --out.")
    s.add_argument("sentence", type=text_arg,
                   help='the text, e.g. "The cat sat on the mat." (longer than --max-tokens: cut, with a notice)')
    s.add_argument("--model", default=None, help=MODEL_HELP)
    s.add_argument("--layer", type=int, default=None, help="layer (attention call index) for attention.png; default: picked")
    s.add_argument("--head", type=int, default=None, help="head for attention.png; default: the most focused word-to-word head")
    s.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    s.add_argument("--max-tokens", type=int, default=None,
                   help="cut the text to this many tokens, [CLS] and [SEP] included (default: the model's limit, 256 for MiniLM)")
    s.add_argument("--out", default=DEFAULT_OUT, help=f"folder to write the PNGs and the HTML page into (default: {DEFAULT_OUT})")
    s.set_defaults(func=cmd_show)
    return s


def trace_text(text: str, model: str | Path | None = None, backend: str = "auto") -> str:
    """The named shapes of every attention call while ``model`` reads ``text`` (``bhqk trace``): the
    bundled MiniLM by default, a BERT folder on bhqk's encoder, a model name, a GGUF file or any other
    local folder through transformers on bhqk."""
    from ..inspect.trace import trace

    check_text(text)

    if model is None or _is_bert_folder(model):
        from ..models.bert import SentenceEncoder

        enc = SentenceEncoder.from_pretrained(model, backend=backend)
        ids, attention_mask = enc.tokenize([text])  # [1, N], [1, N]
        with torch.no_grad(), trace(enc.model) as t:
            enc.model(ids, attention_mask)
        tokens = list(enc.tokenizer.encode(text).tokens)
    else:
        from ..integrations.hf_attention import implementation
        from ..models.real import encode, load_model

        loaded = load_model(model, implementation(backend))
        inputs, tokens = encode(loaded, text)  # input_ids [1, N], ...
        with torch.no_grad(), trace(loaded.model) as t:
            loaded.model(**inputs)
    return f"{len(tokens)} tokens: {' '.join(tokens)}\n{t}"


def add_trace_parser(sub) -> argparse.ArgumentParser:
    """Register ``bhqk trace`` on an argparse subparsers object."""
    t = sub.add_parser("trace", help="the named shapes of every attention call of a model reading a text",
                       description="Run one text through a model (the bundled MiniLM, or --model: a model name, a GGUF "
                                   "file or any local Hugging Face folder) and print, per attention call, its module path, "
                                   "backend and the named "
                                   "shapes of q, k, v, S/P and the output.")
    t.add_argument("text", type=text_arg, help='the text, e.g. "The cat sat on the mat."')
    t.add_argument("--model", default=None, help=MODEL_HELP)
    t.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    t.set_defaults(func=lambda a: trace_text(a.text, a.model, a.backend))
    return t
