"""Retrieval tasks in the style of RULER (Hsieh et al., 2024) for grading a change to a chat model:
one prompt per (task, length, trial), generated from a seed and Python's own documentation.

    from bhqk.evaluate import tasks
    p = tasks.make(tok, "multikey", length=2048, trial=0, seed=0)
    p.ids        # exactly 2,048 token ids, chat template included
    p.score("The special magic number for river is 48213.")  # True when the rule below holds

Every prompt is the user message ``<intro> / <haystack> / <question>`` through the tokenizer's chat
template with a few sentences inserted into the haystack (:func:`bhqk.corpus.chat_prompt`, as the
needle grid's), each at a depth drawn uniformly from ``depth`` (default 0.1 … 0.9 of the filler).
Everything random is drawn from ``random.Random`` seeded by (task, seed, length, trial), so a prompt
does not depend on which others are made with it.

=============  ===========================================================  =======================================
task           inserted sentences                                           correct when (numbers: whole numbers)
=============  ===========================================================  =======================================
``needle``     ``The pass key is 48213. Remember it. 48213 is the pass key.``  the key is among the answer's numbers
               (the grid's sentence and question, :mod:`bhqk.corpus`)
``multikey``   ``The special magic number for river is: 48213.``, one per    the asked key's number is among the
               key (``keys`` keys, one asked)                               answer's numbers and no other key's is
``multivalue`` ``One of the special magic numbers for river is: 48213.``,   every one of the key's numbers is among
               ``values`` of them for one key                               the answer's numbers
``vartrack``   ``VAR QPFCE = 48213.``, ``VAR HJKLA = QPFCE.``, … a chain of   the prompt's variable names in the
               ``hops`` assignments, and a second chain from another        answer are exactly the asked chain's
               value (a distractor), in order                               (a set; order free)
=============  ===========================================================  =======================================

Values are 5-digit numbers, distinct within a prompt; keys are words of :data:`WORDS`; variable names
five random capital letters. The answer is read after the task's answer prefix (``prefix``, the first
words of the assistant's reply, given as part of the prompt as RULER does), so the model only has to
continue it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..corpus import INTRO as NEEDLE_INTRO
from ..corpus import NEEDLE, chat_prompt
from ..corpus import QUESTION as NEEDLE_QUESTION

TASKS = ("needle", "multikey", "multivalue", "vartrack")

WORDS = ("apple", "river", "candle", "garden", "pencil", "window", "button", "rocket", "forest", "mirror", "ladder",
         "island", "violin", "carpet", "bridge", "dragon", "tunnel", "anchor", "blanket", "compass", "harbor", "jacket",
         "lantern", "marble", "needle", "orange", "pepper", "saddle", "tiger", "walnut", "falcon", "meadow", "oyster",
         "pillow", "quartz", "ribbon", "spider", "thunder", "velvet", "wizard")
"""The keys of ``multikey`` and ``multivalue`` (common words, none a Python keyword)."""

MULTI_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
               "I will quiz you about the numbers afterwards.")
VAR_FIRST = "VAR {name} = {value}."
VAR_NEXT = "VAR {name} = {prev}."
VAR_INTRO = "Memorize and track the chains of variable assignments hidden in the following text."


@dataclass(frozen=True)
class Task:
    """How a task's prompts read: ``intro`` and ``question`` around the haystack (``{key}``/``{value}`` filled
    in), the ``prefix`` of the reply, and the reply's length in tokens: ``max_new_tokens`` plus ``per_item``
    for each value or variable to report, enough for a correct answer."""

    name: str
    intro: str
    question: str
    prefix: str
    max_new_tokens: int
    per_item: int = 0


SPECS = {
    "needle": Task("needle", NEEDLE_INTRO, NEEDLE_QUESTION, "", 16),
    "multikey": Task("multikey", MULTI_INTRO,
                     "What is the special magic number for {key} mentioned in the provided text? Answer with the number only.",
                     "The special magic number for {key} mentioned in the provided text is", 10),
    "multivalue": Task("multivalue", MULTI_INTRO,
                       "What are all the special magic numbers for {key} mentioned in the provided text? "
                       "Answer with the numbers only.",
                       "The special magic numbers for {key} mentioned in the provided text are", 8, 8),
    "vartrack": Task("vartrack", VAR_INTRO,
                     "Find all variables that are assigned the value {value} in the text above.",
                     "According to the chain of variable assignments in the text above, the variables that are "
                     "assigned the value {value} are:", 8, 6),
}
"""Each task's wording; ``prefix`` starts the assistant's reply (RULER's answer prefix)."""


@dataclass
class Prompt:
    """One prompt: ``ids`` (``length`` token ids: template, haystack with the inserted sentences, question
    and reply prefix), ``answer`` (what a correct reply reports: the key's number(s) or the chain's
    variable names), ``distractors`` (what it must not report: other keys' numbers, the other chains'
    names), ``inserted`` (the sentences, in prompt order), ``at`` (the token index where each starts) and
    ``prefix`` (the reply's first words, the prompt's last: the model's reply continues them)."""

    task: str
    length: int
    trial: int
    seed: int
    ids: list[int] = field(repr=False)
    answer: tuple[str, ...]
    distractors: tuple[str, ...]
    inserted: tuple[str, ...] = field(repr=False)
    at: tuple[int, ...]
    max_new_tokens: int = 16
    prefix: str = ""

    def score(self, reply: str) -> bool:
        """Whether ``reply`` (the model's continuation after the prefix) is correct (module doc)."""
        return correct(self.task, reply, self.answer, self.distractors)

    def to_json(self) -> dict:
        return {"task": self.task, "length": self.length, "trial": self.trial, "seed": self.seed,
                "answer": list(self.answer), "distractors": list(self.distractors), "at": list(self.at),
                "prefix": self.prefix}


def numbers(text: str) -> list[str]:
    """The whole numbers in ``text`` as written (``48213`` in "is: 48213.", not ``4821`` in it)."""
    return re.findall(r"\d+", text)


def names(text: str) -> set[str]:
    """The words of five capital letters in ``text`` (variable names)."""
    return set(re.findall(r"\b[A-Z]{5}\b", text))


def correct(task: str, reply: str, answer: Sequence[str], distractors: Sequence[str] = ()) -> bool:
    """The scoring rule of ``task`` (module doc) for ``reply`` against the ``answer`` and ``distractors``."""
    if task == "vartrack":
        said = names(reply) & (set(answer) | set(distractors))  # the prompt's names the reply mentions
        return said == set(answer)
    said = set(numbers(reply))
    if task in ("needle", "multikey"):
        return answer[0] in said and not said & set(distractors)
    if task == "multivalue":
        return set(answer) <= said
    raise ValueError(f"tasks: task must be one of {TASKS}, got {task!r}.")


# ---- prompts -----------------------------------------------------------------------------------


def _values(rng: random.Random, k: int) -> list[str]:
    return [str(v) for v in rng.sample(range(10_000, 100_000), k)]


def _varnames(rng: random.Random, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in out:
            out.append(name)
    return out


def make(tok, task: str, length: int, trial: int = 0, seed: int = 0, *, depth: tuple[float, float] = (0.1, 0.9),
         keys: int = 2, values: int = 2, hops: int = 2, chains: int = 2) -> Prompt:
    """The prompt of one trial of ``task`` (module doc), deterministic in (task, seed, length, trial) and
    the sizes: ``keys`` (multikey: keys in the prompt, one asked), ``values`` (multivalue: numbers of the
    one key), ``hops`` (vartrack: variables per chain), ``chains`` (vartrack: chains, one asked)."""
    if task not in SPECS:
        raise ValueError(f"tasks: task must be one of {TASKS}, got {task!r}.")
    lo, hi = depth
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"tasks: depth must be (lo, hi) with 0 <= lo <= hi <= 1, got {depth!r}.")
    for name, v in (("keys", keys), ("values", values), ("hops", hops), ("chains", chains)):
        if v < 1:
            raise ValueError(f"tasks: {name} must be >= 1, got {v}.")
    spec = SPECS[task]
    rng = random.Random(f"{task}:{seed}:{length}:{trial}")
    fill: dict[str, str] = {}
    ordered = False  # the sentences keep their order in the prompt (a chain of assignments)
    answer: tuple[str, ...]
    distractors: tuple[str, ...]
    if task == "needle":
        key = _values(rng, 1)[0]
        sentences, answer, distractors = [NEEDLE.format(key=key)], (key,), ()
    elif task == "multikey":
        words = rng.sample(WORDS, keys)
        nums = _values(rng, keys)
        sentences = [f"The special magic number for {w} is: {v}." for w, v in zip(words, nums)]
        answer, distractors = (nums[0],), tuple(nums[1:])
        fill["key"] = words[0]
    elif task == "multivalue":
        word = rng.choice(WORDS)
        nums = _values(rng, values)
        sentences = [f"One of the special magic numbers for {word} is: {v}." for v in nums]
        answer, distractors = tuple(nums), ()
        fill["key"] = word
    else:  # vartrack: ``chains`` chains, each in order, interleaved at random; the first is asked
        nums = _values(rng, chains)
        var = _varnames(rng, chains * hops)
        chain = [var[c * hops : (c + 1) * hops] for c in range(chains)]
        said = [[VAR_FIRST.format(name=ch[0], value=v)] + [VAR_NEXT.format(name=ch[i], prev=ch[i - 1]) for i in range(1, hops)]
                for ch, v in zip(chain, nums)]
        which = [c for c in range(chains) for _ in range(hops)]
        rng.shuffle(which)
        nxt = [0] * chains
        sentences = []
        for c in which:
            sentences.append(said[c][nxt[c]])
            nxt[c] += 1
        answer, distractors = tuple(chain[0]), tuple(x for ch in chain[1:] for x in ch)
        fill["value"] = nums[0]
        ordered = True
    reply = spec.prefix.format(**fill)
    prompt, at, order = chat_prompt(tok, length, spec.intro, spec.question.format(**fill), sentences,
                                    lambda k: [rng.uniform(lo, hi) for _ in range(k)], rng, reply=reply,
                                    ordered=ordered, who=f"tasks ({task}):",
                                    rest="the template, question, reply prefix and inserted sentences")
    return Prompt(task, length, trial, seed, prompt, answer, distractors, tuple(sentences[i] for i in order),
                  tuple(at), spec.max_new_tokens + spec.per_item * len(answer), reply)


def make_set(tok, tasks: Sequence[str], lengths: Sequence[int], trials: int, seed: int = 0, **sizes) -> list[Prompt]:
    """Every prompt of the set: tasks outermost, then lengths, then trial numbers."""
    if trials < 1 or not tasks or not lengths:
        raise ValueError(f"tasks: the set is empty (tasks={list(tasks)}, lengths={list(lengths)}, trials={trials}).")
    return [make(tok, t, L, i, seed, **sizes) for t in tasks for L in lengths for i in range(trials)]


__all__ = ["TASKS", "SPECS", "WORDS", "Task", "Prompt", "make", "make_set", "correct", "numbers", "names"]
