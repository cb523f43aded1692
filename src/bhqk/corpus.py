"""The one text and the prompts made from it: the filler (Python's own documentation), the text
sequences the causal scores and grading read, the needle grid's pass-key prompts and the pieces the
graded tasks (:mod:`bhqk.evaluate.tasks`) and the learned score's pass-key prompts are made of.

**The text.** ``pydoc_data.topics`` (in every CPython), each topic stripped, in sorted order, joined by
blank lines (:func:`text`); tokenized once per tokenizer without special tokens (:func:`filler`;
:func:`sentence_ends`: per token, whether it ends a sentence).

**The rule for special tokens.** A sequence the model reads from its first position starts as the
model's tokenizer starts a text: with the special tokens ``tok(text)`` puts before it
(:func:`prefix`: Gemma 3's ``<bos>``; nothing for SmolLM2, whose tokenizer adds none — its nominal
BOS ``<|im_start|>`` opens a chat turn, and SmolLM2 was pretrained without one). So every row of
:func:`chunks` (the KL and Fisher scores' text, :func:`bhqk.budget.scores.text_ids`, and grading's
KL and perplexity chunks, :func:`bhqk.evaluate.grade.text_chunks`) and every learned-score prompt
(:func:`passkey_prompt`) is ``prefix + text tokens``, exactly ``length`` tokens long. A chat prompt
(the needle grid's, the graded tasks') is what the tokenizer's chat template writes, which decides
its own first token (Gemma's template writes ``<bos>``, SmolLM2's ``<|im_start|>system``): its text
is tokenized without special tokens, so none is added twice. Nothing else adds or drops one.

**The needle grid's prompts** (:func:`make_trial`) and the graded tasks' (:func:`chat_prompt`): a chat
user message ``intro / haystack / question`` with sentences inserted at depths of the haystack.

This file imports nothing of bhqk (torch and the standard library only), so a benchmark that runs in
another library's environment loads it by path and makes the same prompts
(``benchmarks/kvpress_needle.py``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

INTRO = "Below is some text with a pass key hidden in it. Find the pass key."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
PLACEHOLDER = "\x00HAYSTACK\x00"
SNAP = 64  # tokens a sentence may move back to start a sentence

_MEMO: dict[tuple[str, int], tuple[Any, list]] = {}  # (what, id(tokenizer)) -> (tokenizer, its filler ids or ends)


# ---- the text and the rule -----------------------------------------------------------------------


def text() -> str:
    """The filler text: ``pydoc_data.topics``, each topic stripped, topics in sorted order, joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def _ids(tok, s: str, **kw: Any) -> list[int]:
    ids = tok(s, **kw)["input_ids"]
    return [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]


def encode(tok, s: str) -> list[int]:
    """``s``'s token ids without special tokens (a piece of a sequence, never its start)."""
    return _ids(tok, s, add_special_tokens=False)


def prefix(tok) -> list[int]:
    """The special tokens the tokenizer puts before a text (the rule of the module doc): what ``tok(s)``
    has before ``tok(s, add_special_tokens=False)``. Gemma 3: ``[<bos>]``; SmolLM2: ``[]``."""
    probe = "Hello"
    with_special, plain = _ids(tok, probe), encode(tok, probe)
    for i in range(len(with_special) - len(plain) + 1):
        if with_special[i : i + len(plain)] == plain:
            return with_special[:i]
    return []


def _once(what: str, tok, make: Callable[[], list]) -> list:
    """``make()``, computed once per tokenizer (kept with the tokenizer, so a new one at a reused id is not mistaken)."""
    got = _MEMO.get((what, id(tok)))
    if got is None or got[0] is not tok:
        got = _MEMO[(what, id(tok))] = (tok, make())
    return got[1]


def filler(tok) -> list[int]:
    """The token ids of :func:`text` (no special tokens), tokenized once per tokenizer."""
    return _once("filler", tok, lambda: encode(tok, text()))


def sentence_ends(tok) -> list[bool]:
    """Per token of :func:`filler`, whether it ends a sentence (a period or a line break)."""
    return _once("ends", tok, lambda: [p.rstrip().endswith(".") or "Ċ" in p or "\n" in p or p == "<0x0A>"
                                       for p in tok.convert_ids_to_tokens(filler(tok))])


def chunks(tok, length: int, count: int, texts: Sequence[str] | None = None, who: str = "corpus") -> torch.Tensor:
    """``count`` text sequences of exactly ``length`` tokens: int64 [count, length], each :func:`prefix`
    then the next ``length − len(prefix)`` tokens of the text, consecutive from its start (``texts``:
    other texts, joined by blank lines, instead of :func:`text`). ``who`` begins the error messages."""
    if count < 1 or length < 2:
        raise ValueError(f"{who}: need at least 1 sequence of at least 2 tokens, got {count} of {length}.")
    ids = filler(tok) if texts is None else encode(tok, "\n\n".join(texts))
    head = prefix(tok)
    n = length - len(head)  # text tokens per sequence
    if count * n > len(ids):
        raise ValueError(f"{who}: {count} sequences of {length} tokens need {count * n} tokens of text; it has "
                         f"{len(ids)} (at most {len(ids) // n} sequences of this length).")
    body = torch.tensor(ids[: count * n], dtype=torch.long).reshape(count, n)  # [C, n]
    return torch.cat([torch.tensor([head] * count, dtype=torch.long).reshape(count, len(head)), body], 1)  # [C, N]


# ---- chat prompts: the needle grid, the graded tasks -----------------------------------------------


def template(tok, intro: str = INTRO, question: str = QUESTION) -> tuple[list[int], list[int]]:
    """The chat-template tokens before and after the haystack of the user message ``intro / haystack /
    question`` (``add_generation_prompt``: the prompt ends where the assistant's reply starts)."""
    content = f"{intro}\n\n{PLACEHOLDER}\n\n{question}"
    s = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    before, after = s.split(PLACEHOLDER)
    return encode(tok, before), encode(tok, after)


def snap(i: int, ends: Sequence[bool], start: int, n: int) -> int:
    """``i`` (a count of filler tokens, 0..n) moved back to just after a sentence end, within SNAP tokens."""
    if i in (0, n):
        return i
    for j in range(i, max(0, i - SNAP) - 1, -1):
        if j == 0 or ends[start + j - 1]:
            return j
    return i


def haystack(tok, length: int, n: int, rng: random.Random, who: str, rest: str) -> tuple[list[int], list[bool], int]:
    """``n`` filler tokens of a ``length``-token prompt, from a sentence start drawn by ``rng``: (their ids,
    the whole filler's sentence ends, the start). ``who`` begins the error and ``rest`` names the prompt's
    other parts when ``n`` < 0 (they take more than ``length``) or the filler is too short."""
    ids, ends = filler(tok), sentence_ends(tok)
    if n < 0:
        raise ValueError(f"{who} length={length} is too short: {rest} take {length - n} tokens.")
    if n > len(ids):
        raise ValueError(f"{who} length={length} needs {n} filler tokens; the filler text has {len(ids)}.")
    starts = [j + 1 for j in range(len(ids) - n) if ends[j]] or [0]  # a haystack begins a sentence
    start = rng.choice(starts)
    return ids[start : start + n], ends, start


def chat_prompt(tok, length: int, intro: str, question: str, sentences: Sequence[str],
                depths: Callable[[int], Iterable[float]], rng: random.Random, *, reply: str = "",
                ordered: bool = False, who: str = "corpus:", rest: str = "the template, question and sentences",
                ) -> tuple[list[int], list[int], list[int]]:
    """A chat prompt of exactly ``length`` tokens: ``intro / haystack / question`` through the template
    (:func:`template`), then ``reply`` (the start of the assistant's answer), with each of ``sentences``
    (``" " + s + "\\n"``) inserted into the haystack (:func:`haystack`, drawn by ``rng``) at a depth
    of ``depths(k)`` (k fractions of the filler, read after the haystack is drawn), moved back to a
    sentence end (:func:`snap`); ``ordered`` keeps the sentences in their given order. Returns (ids,
    the token index where each inserted sentence starts, in prompt order, and the order: which of
    ``sentences`` each is)."""
    before, after = template(tok, intro, question)
    tail = encode(tok, reply) if reply else []
    inserts = [encode(tok, " " + s + "\n") for s in sentences]
    n = length - len(before) - len(after) - len(tail) - sum(map(len, inserts))  # filler tokens
    hay, ends, start = haystack(tok, length, n, rng, who, rest)
    cuts = [snap(round(d * n), ends, start, n) for d in depths(len(inserts))]
    if ordered:
        cuts.sort()
    order = sorted(range(len(inserts)), key=lambda i: (cuts[i], i))  # where each sentence goes, in prompt order
    body: list[int] = []
    at: list[int] = []
    prev = 0
    for i in order:
        body += hay[prev : cuts[i]]
        at.append(len(before) + len(body))
        body += inserts[i]
        prev = cuts[i]
    body += hay[prev:]
    return before + body + after + tail, at, order


@dataclass
class Trial:
    """One prompt of the needle grid: ``ids`` (``length`` token ids, chat template included), the ``key``,
    and where the needle starts (``needle_at``, a token index of ``ids``)."""

    length: int
    depth: float
    trial: int
    key: str
    ids: list[int] = field(repr=False)
    needle_at: int


def make_trial(tok, length: int, depth: float, trial: int = 0, seed: int = 0) -> Trial:
    """The needle grid's prompt of one trial (module doc), deterministic in (seed, length, depth, trial)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle: depth must be in [0, 1], got {depth}.")
    rng = random.Random(f"needle:{seed}:{length}:{depth!r}:{trial}")
    key = str(rng.randint(10_000, 999_999))
    ids, at, _ = chat_prompt(tok, length, INTRO, QUESTION, [NEEDLE.format(key=key)], lambda k: [depth] * k, rng,
                             who="needle:", rest="the template, question and needle")
    return Trial(length, depth, trial, key, ids, at[0])


def make_trials(tok, lengths: Iterable[int], depths: Iterable[float], trials: int = 1, seed: int = 0) -> list[Trial]:
    """Every trial of the grid, lengths outermost, then depths, then trial numbers."""
    depths = list(depths)
    return [make_trial(tok, L, d, t, seed) for L in lengths for d in depths for t in range(trials)]


def found_in(answer: str, key: str) -> bool:
    """The key appears in the answer as a whole number (``48213`` in "The pass key is 48213.", not in "148213")."""
    return key in re.findall(r"\d+", answer)


# ---- the learned score's pass-key prompts (raw text, no chat template) ----------------------------

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
         "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
PASSKEYS_INTRO = "Below is a long text with pass keys hidden in it. Remember them.\n\n"
PASSKEYS_NEEDLE = "\n\nThe {nth} pass key is {words}. Remember it.\n\n"
PASSKEYS_QUESTION = "\n\nWhat is the {nth} pass key? The {nth} pass key is {words}."


def passkey_prompt(tok, length: int, seed: int = 0, index: int = 0, keys: int = 2, words: int = 8,
                   ) -> tuple[torch.Tensor, int]:
    """(ids [length], the first answer row): the learned score's prompt of step ``index``, exactly
    ``length`` tokens, drawn from ``random.Random`` seeded by (seed, index): :func:`prefix`,
    ``PASSKEYS_INTRO``, a random stretch of the filler with ``keys`` needles "The {first} pass key is
    {words}. Remember it." (``words`` NATO-alphabet words each) at sorted random depths in [0.05, 0.95],
    then every question with its answer "What is the {first} pass key? The {first} pass key is
    {words}." — the answer rows are every token of that last part (DuoAttention's labels)."""
    if not 1 <= keys <= len(ORDINALS):
        raise ValueError(f"passkey_prompt: keys must be in 1 … {len(ORDINALS)}, got {keys}.")
    rng = random.Random(f"passkey:{seed}:{index}")
    said = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(keys)]
    needles = [encode(tok, PASSKEYS_NEEDLE.format(nth=ORDINALS[i], words=w)) for i, w in enumerate(said)]
    qa = [t for i, w in enumerate(said) for t in encode(tok, PASSKEYS_QUESTION.format(nth=ORDINALS[i], words=w))]
    intro = prefix(tok) + encode(tok, PASSKEYS_INTRO)
    n = length - len(intro) - sum(map(len, needles)) - len(qa)  # filler tokens
    hay = filler(tok)
    if n < keys:
        raise ValueError(f"passkey_prompt: length={length} is too short for {keys} keys of {words} words: the intro, "
                         f"needles and questions take {length - n} tokens.")
    if n > len(hay):
        raise ValueError(f"passkey_prompt: length={length} needs {n} filler tokens; the filler has {len(hay)}.")
    start = rng.randrange(len(hay) - n + 1)
    hay = hay[start:start + n]
    at = sorted(round(rng.uniform(0.05, 0.95) * n) for _ in range(keys))
    ids, last = list(intro), 0
    for a, nd in zip(at, needles):
        ids += hay[last:a] + nd
        last = a
    ids += hay[last:]
    first = len(ids)
    ids += qa
    return torch.tensor(ids), first


__all__ = ["text", "encode", "prefix", "filler", "sentence_ends", "chunks", "template", "snap", "haystack", "chat_prompt",
           "Trial", "make_trial", "make_trials", "found_in", "passkey_prompt", "INTRO", "NEEDLE", "QUESTION", "SNAP",
           "WORDS", "ORDINALS"]
