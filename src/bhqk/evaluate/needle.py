"""The needle grid: can a chat model find a pass key hidden at a given depth of a long prompt?

    from bhqk.evaluate import needle
    result = needle.grid(model, tok, lengths=[1024, 2048], depths=[0, 0.5, 1], trials=2, seed=0)
    print(result.table()); result.save("out")  # out/needle.json, out/needle.png

Each trial's prompt is exactly ``length`` tokens, chat template included, with the pass key hidden
after ``depth`` × its filler (:mod:`bhqk.corpus`: :func:`~bhqk.corpus.make_trial`); a cell's prompts do
not depend on which other cells the grid has. The answer is at most ``max_new_tokens`` greedy tokens
(:func:`bhqk.integrations.greedy.greedy`); ``found``: the key appears in it as a whole number.

Hooks for grading a change to the model on the same grid: ``edit`` (a factory of context managers
entered around each generation, e.g. :func:`bhqk.inspect.edit.zero_heads`, or a dict of
:func:`bhqk.edit` keywords), ``plan`` (a :class:`bhqk.budget.Plan`: each generation runs on
``plan.cache(model)``) and ``past_key_values`` (any other factory of a transformers ``Cache`` per
generation).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..budget import Plan
from ..corpus import NEEDLE, QUESTION, Trial, found_in, make_trials
from ..inspect.edit import edit as bhqk_edit
from ..integrations.greedy import eos_ids, greedy


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
    """Greedy-decode the answer to one trial (:func:`bhqk.integrations.greedy.greedy`, inside ``edit``, on a
    cache from ``past_key_values()`` or the model's own): its entry of the grid."""
    cache = past_key_values() if past_key_values is not None else None
    with _editor(model, edit)():
        reply = greedy(model, t.ids, cache, max_new_tokens=max_new_tokens, eos=eos_ids(model, tok))
    answer = tok.decode(reply.tokens, skip_special_tokens=True).strip()
    return {"length": t.length, "depth": t.depth, "trial": t.trial, "key": t.key, "answer": answer,
            "found": found_in(answer, t.key), "needle_at": t.needle_at}


def grid(model, tok, lengths: Iterable[int], depths: Iterable[float], trials: int = 1, seed: int = 0, *,
         edit: Callable[[], Any] | dict | None = None, plan: Plan | None = None, past_key_values: Callable[[], Any] | None = None,
         max_new_tokens: int = 16, progress: bool = True, log: Callable[[str], Any] | None = None) -> NeedleResult:
    """The needle grid (module doc): every length × depth × trial, a tqdm bar over them when
    ``progress``, and ``log(line)`` after each prompt when given (length, depth, trial, found or not,
    seconds). ``plan``: a KV budget plan, checked against the model before any forward; each generation
    runs on ``plan.cache(model)``. ``past_key_values``: any other factory of a cache per generation. A length beyond the model's
    context (``max_position_embeddings``) is refused before any prompt runs."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    from ..models.real import context_length

    if plan is not None:
        if past_key_values is not None:
            raise ValueError("needle: give plan= or past_key_values=, not both.")
        if not isinstance(plan, Plan):
            raise TypeError(f"needle: plan must be a bhqk.budget.Plan, got {type(plan).__name__}.")
        plan.check(model)  # a plan made for another model fails here, not as "found 0 of N"
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


__all__ = ["grid", "ask", "NeedleResult"]
