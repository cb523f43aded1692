"""A needle in a haystack: can a chat model find a pass key hidden at a given depth of a long prompt?

    from bhqk.inspect import needle
    result = needle.grid(model, tok, lengths=[1024, 2048], depths=[0, 0.5, 1], trials=2, seed=0)
    print(result.table()); result.save("out")  # out/needle.json, out/needle.png

Each trial's prompt (exactly ``length`` tokens, chat template included) is the user message

    Below is some text with a pass key hidden in it. Find it. / <haystack> / What is the pass key? ...

where the haystack is Python's own documentation (``pydoc_data.topics``, in every CPython) from a
random sentence on, with ``The pass key is 48213. Remember it. 48213 is the pass key.`` inserted
after ``depth`` × its filler tokens (moved back to the nearest sentence end within 64 tokens, so the
needle starts a sentence). The key (5–6 digits) and the start are drawn from ``random.Random`` seeded
by (seed, length, depth, trial): a cell's prompts do not depend on which other cells the grid has.
The answer is ``max_new_tokens`` greedy tokens; ``found``: the key appears in it as a whole number.

Hooks for grading a change to the model on the same grid: ``edit`` (a factory of context managers
entered around each generation, e.g. :func:`zero_heads`, or a dict of :func:`bhqk.edit` keywords),
``past_key_values`` (a factory of a transformers ``Cache`` per generation, handed to ``generate`` by
the keyword the model takes: ``cache=`` from transformers 5.24 on) and ``plan`` (an object with
``.cache()``, e.g. a KV budget plan: ``past_key_values=plan.cache``).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..integrations.model_map import address
from .edit import edit as bhqk_edit

INTRO = "Below is some text with a pass key hidden in it. Find the pass key."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
PLACEHOLDER = "\x00HAYSTACK\x00"
SNAP = 64  # tokens the needle may move back to start a sentence

_FILLER: dict[int, tuple[Any, list[int], list[bool]]] = {}  # id(tokenizer) -> (tokenizer, ids, ends a sentence)


def filler(tok) -> tuple[list[int], list[bool]]:
    """The token ids of the filler text (pydoc_data.topics, topics in sorted order) and, per token,
    whether it ends a sentence (a period or a line break); tokenized once per tokenizer."""
    got = _FILLER.get(id(tok))
    if got is None or got[0] is not tok:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k].strip() for k in sorted(topics))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        pieces = tok.convert_ids_to_tokens(ids)
        ends = [p.rstrip().endswith(".") or "Ċ" in p or "\n" in p or p == "<0x0A>" for p in pieces]
        got = _FILLER[id(tok)] = (tok, ids, ends)
    return got[1], got[2]


@dataclass
class Trial:
    """One prompt of the grid: ``ids`` (``length`` token ids, chat template included), the ``key``,
    and where the needle starts (``needle_at``, a token index of ``ids``)."""

    length: int
    depth: float
    trial: int
    key: str
    ids: list[int] = field(repr=False)
    needle_at: int


def _template(tok, intro: str = INTRO, question: str = QUESTION) -> tuple[list[int], list[int]]:
    """The chat-template tokens before and after the haystack of the user message ``intro / haystack / question``."""
    content = f"{intro}\n\n{PLACEHOLDER}\n\n{question}"
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    before, after = text.split(PLACEHOLDER)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(before), enc(after)


def _snap(i: int, ends: Sequence[bool], start: int, n: int) -> int:
    """``i`` (a count of filler tokens, 0..n) moved back to just after a sentence end, within SNAP tokens."""
    if i in (0, n):
        return i
    for j in range(i, max(0, i - SNAP) - 1, -1):
        if j == 0 or ends[start + j - 1]:
            return j
    return i


def make_trial(tok, length: int, depth: float, trial: int = 0, seed: int = 0) -> Trial:
    """The prompt of one trial (module doc), deterministic in (seed, length, depth, trial)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle: depth must be in [0, 1], got {depth}.")
    rng = random.Random(f"needle:{seed}:{length}:{depth!r}:{trial}")
    key = str(rng.randint(10_000, 999_999))
    before, after = _template(tok)
    needle = tok(" " + NEEDLE.format(key=key) + "\n", add_special_tokens=False)["input_ids"]
    n = length - len(before) - len(after) - len(needle)  # filler tokens
    hay, ends, start = haystack(tok, length, n, rng, "needle:", "the template, question and needle")
    at = _snap(round(depth * n), ends, start, n)
    prompt = before + hay[:at] + needle + hay[at:] + after
    return Trial(length, depth, trial, key, prompt, len(before) + at)


def haystack(tok, length: int, n: int, rng: random.Random, who: str, rest: str) -> tuple[list[int], list[bool], int]:
    """``n`` filler tokens of a ``length``-token prompt, from a sentence start drawn by ``rng``: (their ids,
    the whole filler's sentence ends, the start). ``who`` begins the error and ``rest`` names the prompt's
    other parts when ``n`` < 0 (they take more than ``length``) or the filler is too short."""
    ids, ends = filler(tok)
    if n < 0:
        raise ValueError(f"{who} length={length} is too short: {rest} take {length - n} tokens.")
    if n > len(ids):
        raise ValueError(f"{who} length={length} needs {n} filler tokens; the filler text has {len(ids)}.")
    starts = [j + 1 for j in range(len(ids) - n) if ends[j]] or [0]  # a haystack begins a sentence
    start = rng.choice(starts)
    return ids[start : start + n], ends, start


def make_trials(tok, lengths: Iterable[int], depths: Iterable[float], trials: int = 1, seed: int = 0) -> list[Trial]:
    """Every trial of the grid, lengths outermost, then depths, then trial numbers."""
    return [make_trial(tok, L, d, t, seed) for L in lengths for d in depths for t in range(trials)]


def found_in(answer: str, key: str) -> bool:
    """The key appears in the answer as a whole number (``48213`` in "The pass key is 48213.", not in "148213")."""
    return key in re.findall(r"\d+", answer)


# ---- edits -------------------------------------------------------------------------------------


def zero_heads(model, heads: Iterable[tuple[int, int]]):
    """A factory of one context manager that zeroes the outputs of the (layer, query head) pairs
    ``heads`` (``bhqk.edit("layers.{layer}.attn", zero=True)`` per layer, by canonical address)."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(int(layer), []).append(int(head))

    @contextlib.contextmanager
    def run():
        with contextlib.ExitStack() as stack:
            for layer, hs in sorted(by_layer.items()):
                stack.enter_context(bhqk_edit(address(layer), heads=sorted(set(hs)), model=model, zero=True))
            yield

    return run


def parse_edit(spec: str) -> list[tuple[int, int]]:
    """``zero:L.H,L.H,...`` (the ``--edit`` option) as (layer, head) pairs."""
    kind, _, rest = spec.partition(":")
    pairs: list[tuple[int, int]] = []
    for part in rest.replace(" ", ",").split(","):
        if not part:
            continue
        layer, dot, head = part.partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            pairs = []
            break
        pairs.append((int(layer), int(head)))
    if kind != "zero" or not pairs:
        raise ValueError(f"needle: edit={spec!r}: expected zero:LAYER.HEAD[,LAYER.HEAD...] such as zero:5.0,12.3 "
                         "(zero the outputs of those query heads).")
    return pairs


def _editor(model, edit: Callable[[], Any] | dict | None) -> Callable[[], Any]:
    if edit is None:
        return contextlib.nullcontext
    if isinstance(edit, dict):
        spec = dict(edit)
        return lambda: bhqk_edit(model=model, **spec)
    if callable(edit):
        return edit
    raise TypeError(f"needle: edit must be a context-manager factory or a dict of bhqk.edit keywords, got {type(edit).__name__}.")


# ---- the grid ----------------------------------------------------------------------------------


@dataclass
class NeedleResult:
    """The entries of a grid (one dict per trial: length, depth, trial, key, answer, found, needle_at)."""

    entries: list[dict]
    seed: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return sorted({e["length"] for e in self.entries})

    @property
    def depths(self) -> list[float]:
        return sorted({e["depth"] for e in self.entries})

    def accuracy(self) -> torch.Tensor:
        """The fraction found per cell: [lengths, depths] (NaN for a cell without trials)."""
        acc = torch.full((len(self.lengths), len(self.depths)), float("nan"), dtype=torch.float64)  # [L, D]
        li = {L: i for i, L in enumerate(self.lengths)}
        di = {d: j for j, d in enumerate(self.depths)}
        hits: dict[tuple[int, int], list[bool]] = {}
        for e in self.entries:
            hits.setdefault((li[e["length"]], di[e["depth"]]), []).append(bool(e["found"]))
        for (i, j), f in hits.items():
            acc[i, j] = sum(f) / len(f)
        return acc

    def mean(self) -> float:
        """The fraction of all trials that found the key."""
        return sum(bool(e["found"]) for e in self.entries) / max(1, len(self.entries))

    def table(self) -> str:
        """Lengths down, depths across, the percentage found in each cell, and the mean."""
        acc = self.accuracy()
        lines = ["length \\ depth".ljust(15) + "".join(f"{d:>6g}" for d in self.depths)]
        for i, L in enumerate(self.lengths):
            lines.append(f"{L:<15d}" + "".join(f"{100 * a:>5.0f}%" if a == a else "     -" for a in acc[i].tolist()))
        n = len(self.entries)
        lines.append(f"found {sum(bool(e['found']) for e in self.entries)} of {n} ({100 * self.mean():.0f}%)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"seed": self.seed, **self.meta, "lengths": self.lengths, "depths": self.depths, "trials": self.entries}

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """The heatmap: depth across, length down, colour = fraction found (matplotlib, the viz extra)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        acc = self.accuracy().numpy()  # [L, D]
        fig, ax = plt.subplots(figsize=(1.0 + 0.6 * len(self.depths), 1.2 + 0.5 * len(self.lengths)))
        im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(self.depths)), [f"{d:g}" for d in self.depths])
        ax.set_yticks(range(len(self.lengths)), [str(L) for L in self.lengths])
        ax.set_xlabel("needle depth (fraction of the filler before it)")
        ax.set_ylabel("prompt length (tokens)")
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                if acc[i, j] == acc[i, j]:
                    ax.text(j, i, f"{100 * acc[i, j]:.0f}", ha="center", va="center", fontsize=8)
        ax.set_title(title or f"pass key found (%), {100 * self.mean():.0f}% overall")
        fig.colorbar(im, ax=ax, fraction=0.04, label="fraction found")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def save(self, out: str | Path, title: str | None = None) -> tuple[Path, Path]:
        """``out/needle.json`` and ``out/needle.png``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "needle.json").write_text(json.dumps(self.to_json(), indent=1))
        return out / "needle.json", self.plot(out / "needle.png", title)


def ask(model, tok, t: Trial, *, max_new_tokens: int = 16, edit: Callable[[], Any] | dict | None = None,
        past_key_values: Callable[[], Any] | None = None) -> dict:
    """Greedy-decode the answer to one trial: its entry of the grid."""
    ids = torch.tensor([t.ids])  # [1, N]
    kwargs: dict[str, Any] = {}
    if past_key_values is not None:
        from ..integrations.transformers import cache_keyword

        kwargs[cache_keyword(model)] = past_key_values()  # "cache" from transformers 5.24 on
    pad = model.generation_config.pad_token_id
    pad = model.generation_config.eos_token_id if pad is None else pad
    with torch.no_grad(), _editor(model, edit)():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, **kwargs)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return {"length": t.length, "depth": t.depth, "trial": t.trial, "key": t.key, "answer": answer,
            "found": found_in(answer, t.key), "needle_at": t.needle_at}


def grid(model, tok, lengths: Iterable[int], depths: Iterable[float], trials: int = 1, seed: int = 0, *,
         edit: Callable[[], Any] | dict | None = None, plan: Any = None, past_key_values: Callable[[], Any] | None = None,
         max_new_tokens: int = 16, progress: bool = True, log: Callable[[str], Any] | None = None) -> NeedleResult:
    """The needle grid (module doc): every length × depth × trial, a tqdm bar over them when
    ``progress``, and ``log(line)`` after each prompt when given (length, depth, trial, found or not,
    seconds). ``plan``: an object whose ``.cache()`` makes each generation's cache (the same as
    ``past_key_values=plan.cache``); a KV budget plan (``.check(model)``) is checked against the model
    before any forward, and makes its caches with ``plan.cache(model)``. A length beyond the model's
    context (``max_position_embeddings``) is refused before any prompt runs."""
    import functools
    import time

    from tqdm import tqdm  # type: ignore[import-untyped]

    from ..models.real import context_length

    if plan is not None:
        if past_key_values is not None:
            raise ValueError("needle: give plan= or past_key_values=, not both.")
        past_key_values = plan.cache
        if hasattr(plan, "check"):  # a plan made for another model fails here, not as "found 0 of N"
            plan.check(model)
            past_key_values = functools.partial(plan.cache, model)
    lengths, depths = list(lengths), list(depths)
    if trials < 1 or not lengths or not depths:
        raise ValueError(f"needle: the grid is empty (lengths={lengths}, depths={depths}, trials={trials}).")
    limit = context_length(model)
    beyond = [L for L in lengths if limit is not None and L > limit]
    if beyond:
        raise ValueError(f"needle: lengths {beyond} are longer than the model's context of {limit:,} tokens "
                         f"(max_position_embeddings); give lengths up to {limit:,}.")
    todo = make_trials(tok, lengths, depths, trials, seed)  # the prompts first: a bad length fails at once
    entries = []
    for i, t in enumerate(tqdm(todo, desc="needle", unit=" prompt", disable=not progress, leave=False,
                               dynamic_ncols=True)):
        t0 = time.perf_counter()
        entries.append(ask(model, tok, t, max_new_tokens=max_new_tokens, edit=edit, past_key_values=past_key_values))
        if log is not None:
            log(f"needle {i + 1}/{len(todo)}: length {t.length}, depth {t.depth:g}, trial {t.trial}: "
                f"{'found' if entries[-1]['found'] else 'not found'} ({time.perf_counter() - t0:.1f} s)")
    return NeedleResult(entries, seed, {"max_new_tokens": max_new_tokens, "needle": NEEDLE, "question": QUESTION})


__all__ = ["grid", "ask", "make_trials", "make_trial", "Trial", "NeedleResult", "zero_heads", "parse_edit", "found_in", "filler"]
