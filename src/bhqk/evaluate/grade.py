"""Grading a change to a chat model (a head-wise KV budget plan) with intervals: accuracy on the
retrieval tasks of :mod:`bhqk.evaluate.tasks`, and the KL divergence from the model's own next-token
distribution and the perplexity on real text.

    from bhqk.evaluate import grade, tasks
    prompts = tasks.make_set(tok, ["needle", "multikey"], [1024, 2048], trials=40, seed=0)
    g = grade.grade(model, tok, prompts, {"full": None, "half": plan})
    print(g.table())                       # every accuracy with its 95 % interval, and the paired differences
    d = grade.divergence(model, tok, {"full": None, "half": plan}, length=4096, chunks=8)
    print(d.table())

A configuration is ``None`` (the model as it is, on its own cache) or a :class:`bhqk.budget.Plan`
(checked against the model before any forward; each reply and each text chunk runs on a fresh
``plan.cache(model)``, so its streaming heads see their sink and window in the prefill too). Replies
are greedy (:func:`bhqk.integrations.greedy.greedy`); the text chunks are :func:`bhqk.corpus.chunks`
(each starts as the tokenizer starts a text: Gemma's ``<bos>``, nothing for SmolLM2).

Intervals (95 %):

- an accuracy k/n: Wilson's score interval (:func:`wilson`);
- the difference of two configurations' accuracies on the same prompts: Newcombe's interval for
  paired proportions (his method 10: Wilson's intervals of each, combined with the correlation of the
  pairs; :func:`paired`), and the exact two-sided McNemar p-value from the discordant prompts.
  Below ``MIN_PAIRS`` prompts the interval is not given (:class:`Paired` says the count is too small):
  with a handful of pairs Newcombe's interval collapses to a point whenever they agree (2 prompts
  both right: "+0.000 [+0.000, +0.000]"), which reads as certainty;
- KL, perplexity and the perplexity ratio: a percentile bootstrap over the text chunks, the same
  resampled chunks for every configuration (paired).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..budget import Plan
from ..budget.scores import first_row
from ..integrations.greedy import eos_ids, greedy
from ..integrations.model_map import cache_keyword, model_map
from .tasks import Prompt

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile
MIN_PAIRS = 10  # fewer paired prompts than this: no interval for a difference (module doc)
LENGTHS = (1024, 2048, 4096)  # where SmolLM2-135M itself retrieves well (docs/benchmarks.md)


# ---- intervals ---------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a proportion k/n (0 ≤ k ≤ n, n ≥ 1)."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n and n >= 1, got k={k}, n={n}.")
    p = k / n
    z2 = z * z
    mid = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, mid - half), min(1.0, mid + half)


def mcnemar(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value for ``b`` and ``c`` discordant pairs (a binomial test of b
    among b + c at one half; 1 when there are none)."""
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2**m
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    """Two configurations on the same n prompts: ``diff`` = accuracy of x − accuracy of y with its 95 %
    interval (``lo``, ``hi``), the counts ``both`` right, ``x_only``, ``y_only``, ``neither``, and the
    McNemar ``p``. With fewer than ``MIN_PAIRS`` prompts (``enough`` False) the interval is computed
    but not shown: the text says the count is too small for one, and :meth:`Grades.summary` gives none."""

    diff: float
    lo: float
    hi: float
    both: int
    x_only: int
    y_only: int
    neither: int
    p: float

    @property
    def n(self) -> int:
        return self.both + self.x_only + self.y_only + self.neither

    @property
    def enough(self) -> bool:
        """Whether there are enough prompts (``MIN_PAIRS``) for the interval to mean anything."""
        return self.n >= MIN_PAIRS

    def __str__(self) -> str:
        if not self.enough:
            return (f"{self.diff:+.3f} (no interval: {self.n} prompts are too few, need {MIN_PAIRS}; {self.x_only} vs "
                    f"{self.y_only} discordant, McNemar p={self.p:.2g})")
        return (f"{self.diff:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] ({self.x_only} vs {self.y_only} discordant of "
                f"{self.n}, McNemar p={self.p:.2g})")


def paired(x: Sequence[bool], y: Sequence[bool], z: float = Z95) -> Paired:
    """Newcombe's interval (1998, method 10) of accuracy(x) − accuracy(y) for results on the same prompts
    (x[i], y[i] on prompt i), and the exact McNemar p-value."""
    if len(x) != len(y) or not x:
        raise ValueError(f"paired: need two equally long, non-empty lists of results, got {len(x)} and {len(y)}.")
    a = sum(1 for u, v in zip(x, y) if u and v)
    b = sum(1 for u, v in zip(x, y) if u and not v)
    c = sum(1 for u, v in zip(x, y) if v and not u)
    d = len(x) - a - b - c
    n = len(x)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(den) if den else 0.0  # the correlation of the pairs
    dl = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    du = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    diff = p1 - p2
    return Paired(diff, max(-1.0, diff - dl), min(1.0, diff + du), a, b, c, d, mcnemar(b, c))


def bootstrap(values: torch.Tensor, stat: Callable[[torch.Tensor], torch.Tensor], draws: int = 2000, seed: int = 0,
              level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of ``stat`` over the first axis of ``values`` [n, ...]: ``stat``
    takes resampled values [draws, n, ...] and returns [draws]."""
    n = values.shape[0]
    if n < 1:
        raise ValueError("bootstrap: no values.")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (draws, n), generator=g)  # [draws, n]
    s = stat(values[idx]).double()  # [draws, n, ...] -> [draws]
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(s, q).tolist()
    return lo, hi


# ---- answers -----------------------------------------------------------------------------------


def _cache(model, plan: Plan | None):
    """A fresh cache for one forward pass of ``plan`` (None: the model's own, keeping every position)."""
    if plan is None:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    return plan.cache(model)


def reply(model, tok, prompt: Prompt, plan: Plan | None = None) -> dict:
    """Greedy-decode the reply to ``prompt`` (at most ``prompt.max_new_tokens``, up to an end token) on
    ``plan``'s cache: its entry (reply, correct, new tokens, prefill and decode seconds)."""
    r = greedy(model, prompt.ids, _cache(model, plan), max_new_tokens=prompt.max_new_tokens, eos=eos_ids(model, tok))
    text = tok.decode(r.tokens, skip_special_tokens=True).strip()
    return {"task": prompt.task, "length": prompt.length, "trial": prompt.trial, "reply": text,
            "correct": prompt.score(text), "new_tokens": len(r.tokens), "prefill_s": round(r.prefill_s, 4),
            "decode_s": round(r.decode_s, 4)}


def _check(model, plans: Mapping[str, Plan | None]) -> None:
    if not plans:
        raise ValueError("grade: no configurations to grade (give {'full': None, ...}).")
    for name, plan in plans.items():
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"grade: configuration {name!r} must be None (the model as it is) or a bhqk.budget.Plan, "
                            f"got {type(plan).__name__}.")
        if plan is not None:
            plan.check(model)  # a plan made for another model fails before any forward


@dataclass
class Grades:
    """Replies of every configuration to the same prompts: ``entries[name][i]`` answers ``prompts[i]``."""

    prompts: list[Prompt]
    entries: dict[str, list[dict]]
    meta: dict = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def _pick(self, task: str | None = None, length: int | None = None) -> list[int]:
        return [i for i, p in enumerate(self.prompts)
                if (task is None or p.task == task) and (length is None or p.length == length)]

    def results(self, name: str, task: str | None = None, length: int | None = None) -> list[bool]:
        """Whether each prompt (of ``task`` and ``length`` where given) was answered correctly."""
        return [bool(self.entries[name][i]["correct"]) for i in self._pick(task, length)]

    def accuracy(self, name: str, task: str | None = None, length: int | None = None) -> tuple[int, int, float, float]:
        """(correct, prompts, Wilson 95 % low, high)."""
        r = self.results(name, task, length)
        k = sum(r)
        return (k, len(r), *wilson(k, len(r)))

    def difference(self, x: str, y: str, task: str | None = None, length: int | None = None) -> Paired:
        """accuracy(x) − accuracy(y) on the same prompts, Newcombe's interval and McNemar's p."""
        return paired(self.results(x, task, length), self.results(y, task, length))

    def groups(self) -> list[tuple[str | None, int | None]]:
        """(task, length) of every cell, then (task, None) per task, then (None, None): all prompts."""
        tasks = list(dict.fromkeys(p.task for p in self.prompts))
        lengths = sorted({p.length for p in self.prompts})
        cells: list[tuple[str | None, int | None]] = [(t, L) for t in tasks for L in lengths if self._pick(t, L)]
        return cells + [(t, None) for t in tasks] + ([(None, None)] if len(tasks) > 1 else [])

    def table(self, reference: str | None = None) -> str:
        """Accuracy per task × length, per task and overall, each as "k/n = acc [low, high]" (Wilson);
        then each configuration's paired difference from ``reference`` (default: the first)."""
        from ..text import table

        ref = reference or self.names[0]
        others = [n for n in self.names if n != ref]
        accuracy, difference = [], []
        for t, L in self.groups():
            where = [t or "all", "all" if L is None else str(L)]
            accuracy.append(where + [f"{k}/{n} = {k / n:.2f} [{lo:.2f}, {hi:.2f}]"
                                     for k, n, lo, hi in (self.accuracy(name, t, L) for name in self.names)])
            difference.append(where + [str(self.difference(name, ref, t, L)) for name in others])
        out = ["accuracy (95 % Wilson interval)", table(["task", "length", *self.names], accuracy)]
        if others:
            out += ["", f"difference from {ref} on the same prompts (95 % Newcombe interval; discordant prompts: "
                        f"right only here vs only in {ref})", table(["task", "length", *others], difference)]
        return "\n".join(out)

    def cost(self) -> dict[int, dict[str, float]]:
        """Per length, the median seconds of a prefill and of a reply's decoding, over every entry."""
        import statistics

        out: dict[int, dict[str, float]] = {}
        for L in sorted({p.length for p in self.prompts}):
            es = [e for name in self.names for e in self.entries[name] if e["length"] == L]
            out[L] = {"prefill_s": statistics.median(e["prefill_s"] for e in es),
                      "decode_s": statistics.median(e["decode_s"] for e in es),
                      "new_tokens": statistics.median(e["new_tokens"] for e in es), "replies": len(es)}
        return out

    def summary(self, reference: str | None = None) -> dict:
        """Every figure of :meth:`table` as data."""
        ref = reference or self.names[0]
        out = []
        for t, L in self.groups():
            row: dict[str, Any] = {"task": t, "length": L, "accuracy": {}, "difference": {}}
            for name in self.names:
                k, n, lo, hi = self.accuracy(name, t, L)
                row["accuracy"][name] = {"correct": k, "n": n, "acc": k / n, "lo": lo, "hi": hi}
                if name != ref:
                    d = self.difference(name, ref, t, L)
                    row["difference"][name] = {"diff": d.diff, "lo": d.lo if d.enough else None,
                                               "hi": d.hi if d.enough else None, "both": d.both,
                                               "only_this": d.x_only, "only_reference": d.y_only,
                                               "neither": d.neither, "mcnemar_p": d.p}
            out.append(row)
        return {"reference": ref, "groups": out}

    def to_json(self) -> dict:
        return {**self.meta, "configs": self.names, "summary": self.summary(), "cost": self.cost(),
                "prompts": [p.to_json() for p in self.prompts], "entries": self.entries}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


def grade(model, tok, prompts: Sequence[Prompt], plans: dict[str, Plan | None], *, progress: bool = True) -> Grades:
    """Every configuration of ``plans`` (name → None or a plan) replies to every prompt, prompt by
    prompt (so an interrupted run leaves complete pairs): a :class:`Grades`."""
    from ..console import progress_bar as tqdm  # tqdm, or a line per step off a terminal (bhqk grade)

    _check(model, plans)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("grade: no prompts.")
    entries: dict[str, list[dict]] = {name: [] for name in plans}
    with tqdm(total=len(prompts) * len(plans), desc="grade", unit=" reply", disable=not progress, leave=False,
              dynamic_ncols=True) as bar:
        for p in prompts:
            for name, plan in plans.items():
                entries[name].append(reply(model, tok, p, plan))
                bar.update()
    return Grades(prompts, entries)


# ---- divergence and perplexity on real text ------------------------------------------------------


def text_chunks(tok, length: int, chunks: int) -> torch.Tensor:
    """``chunks`` sequences of ``length`` tokens of Python's documentation, consecutive from its start, each
    starting as the tokenizer starts a text: int64 [chunks, length] (:func:`bhqk.corpus.chunks`)."""
    from ..corpus import chunks as text

    return text(tok, length, chunks, who="divergence")


PIECE = 16  # tokens a call when a quantized plan reads text (:func:`_hidden`)


def _hidden(model, ids: torch.Tensor, plan: Plan | None, step: int | None = None) -> torch.Tensor:
    """The decoder's final hidden states [N, D] for ``ids`` [1, N] on ``plan``'s cache (None: no cache),
    ``step`` tokens a call at their true positions (default: one call; ``PIECE`` for a plan with bits: the
    positions a call writes stay float until the next, so in one call every query would see floats only;
    in pieces each sees the integers a decode step reads, all but the last ``residual`` + < ``PIECE``)."""
    dec = model_map(model).stack()
    if plan is None:
        return dec(input_ids=ids, use_cache=False).last_hidden_state[0]  # [1, N, D] -> [N, D]
    cache, n = _cache(model, plan), ids.shape[1]
    step = step or (n if plan.bits is None else PIECE)
    return torch.cat([dec(input_ids=ids[:, i : i + step], position_ids=torch.arange(i, min(i + step, n))[None],
                          use_cache=True, **{cache_keyword(dec): cache}).last_hidden_state[0]  # [1, step, D] -> [step, D]
                      for i in range(0, n, step)])  # [N, D]


def start_of(plans: Iterable[Plan | None]) -> int:
    """The first position where a plan's streaming heads see less than every key
    (:func:`bhqk.budget.scores.first_row`: sink + window + 1), the largest over the plans (0 when there
    is no plan)."""
    return max((first_row(p.sink, p.window) for p in plans if p is not None), default=0)


@dataclass
class Divergence:
    """Per configuration, per text chunk: ``kl`` (mean KL(model ‖ configuration) in nats over the positions
    ``start`` … length − 2) and ``nll`` (mean negative log-likelihood of the next token there)."""

    length: int
    start: int
    kl: dict[str, list[float]]
    nll: dict[str, list[float]]
    reference_nll: list[float]
    draws: int = 2000
    seed: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.kl)

    def summary(self) -> dict:
        """Per configuration: KL, perplexity and perplexity ÷ the model's, each with its bootstrap interval."""
        ref = torch.tensor(self.reference_nll, dtype=torch.float64)  # [C]

        def ci(v: torch.Tensor, stat=lambda s: s.mean(1)) -> tuple[float, float]:  # stat: [draws, C] -> [draws]
            return bootstrap(v, stat, self.draws, self.seed)

        out: dict[str, Any] = {"reference_ppl": math.exp(float(ref.mean())),
                               "reference_ppl_ci": [math.exp(v) for v in ci(ref)]}
        for name in self.names:
            kl = torch.tensor(self.kl[name], dtype=torch.float64)  # [C]
            nll = torch.tensor(self.nll[name], dtype=torch.float64)  # [C]
            pair = torch.stack([nll, ref], 1)  # [C, 2]: the same chunks resampled for both
            out[name] = {"kl": float(kl.mean()), "kl_ci": list(ci(kl)),
                         "ppl": math.exp(float(nll.mean())), "ppl_ci": [math.exp(v) for v in ci(nll)],
                         "ppl_ratio": math.exp(float(nll.mean() - ref.mean())),
                         "ppl_ratio_ci": list(ci(pair, lambda s: (s[..., 0].mean(1) - s[..., 1].mean(1)).exp()))}
        return out

    def table(self) -> str:
        from ..text import table

        s = self.summary()
        rows = []
        for name in self.names:
            r = s[name]
            rows.append([name, f"{r['kl']:.4f} [{r['kl_ci'][0]:.4f}, {r['kl_ci'][1]:.4f}]",
                         f"{r['ppl']:.3f} [{r['ppl_ci'][0]:.3f}, {r['ppl_ci'][1]:.3f}]",
                         f"{r['ppl_ratio']:.4f} [{r['ppl_ratio_ci'][0]:.4f}, {r['ppl_ratio_ci'][1]:.4f}]"])
        head = (f"{len(self.reference_nll)} chunks of {self.length} tokens, positions {self.start}…{self.length - 2} "
                f"(95 % bootstrap over chunks, {self.draws} draws)")
        return head + "\n" + table(["config", "KL from the model (nats/token)", "perplexity", "× the model's"], rows)

    def to_json(self) -> dict:
        return {**self.meta, "length": self.length, "start": self.start, "draws": self.draws, "seed": self.seed,
                "summary": self.summary(), "kl": self.kl, "nll": self.nll, "reference_nll": self.reference_nll}


BLOCK = 512  # positions of log-probabilities at a time: [512, V]


def divergence(model, tok, plans: Mapping[str, Plan | None], length: int = 4096, chunks: int = 4, *, draws: int = 2000,
               seed: int = 0, progress: bool = True) -> Divergence:
    """KL(the model's next-token distribution ‖ each configuration's) and each configuration's perplexity on
    ``chunks`` pieces of ``length`` tokens of real text (:func:`text_chunks`), at the positions
    :func:`start_of` the plans (where streaming changes anything) … length − 2. One forward per chunk
    and configuration (a quantized plan's in pieces, as decoding reads it: :func:`_hidden`), the model's
    own (no plan) first; the log-probabilities are taken from the final
    hidden states ``BLOCK`` positions at a time (never [length, vocabulary] at once)."""
    from ..console import progress_bar as tqdm  # tqdm, or a line per step off a terminal (bhqk grade)

    _check(model, plans)
    m = model_map(model)
    x = text_chunks(tok, length, chunks)  # [C, N]
    s = start_of(plans.values())
    if not 0 <= s <= length - 2:
        raise ValueError(f"divergence: the plans' first changed row {s} leaves no position of a {length}-token chunk "
                         f"to measure (sink + window must be below length − 1).")
    kl: dict[str, list[float]] = {name: [] for name in plans}
    nll: dict[str, list[float]] = {name: [] for name in plans}
    ref_nll: list[float] = []
    with torch.no_grad(), tqdm(total=chunks * (1 + len(plans)), desc="divergence", unit=" forward",
                               disable=not progress, leave=False, dynamic_ncols=True) as bar:
        for c in range(chunks):
            ids = x[c : c + 1]  # [1, N]
            target = x[c, s + 1 :]  # [n] the next token of each measured position
            h_ref = _hidden(model, ids, None)[s:-1]  # [n, D]
            bar.update()
            hs = {}
            for name, plan in plans.items():
                hs[name] = h_ref if plan is None else _hidden(model, ids, plan)[s:-1]  # [n, D]
                bar.update()
            sums = {name: [0.0, 0.0] for name in plans}  # KL, NLL
            r_nll = 0.0
            for i in range(0, h_ref.shape[0], BLOCK):
                t = target[i : i + BLOCK, None]  # [b, 1]
                lp = m.log_probs(h_ref[i : i + BLOCK])  # [b, V]
                r_nll -= float(lp.gather(1, t).sum())
                for name, plan in plans.items():
                    lq = lp if plan is None else m.log_probs(hs[name][i : i + BLOCK])  # [b, V]
                    sums[name][0] += float((lp.exp() * (lp - lq)).sum())
                    sums[name][1] -= float(lq.gather(1, t).sum())
            n = h_ref.shape[0]
            ref_nll.append(r_nll / n)
            for name in plans:
                kl[name].append(sums[name][0] / n)
                nll[name].append(sums[name][1] / n)
    return Divergence(length, s, kl, nll, ref_nll, draws, seed)


__all__ = ["wilson", "mcnemar", "paired", "Paired", "MIN_PAIRS", "bootstrap", "reply", "grade", "Grades", "divergence",
           "Divergence", "text_chunks", "start_of", "Z95"]
