"""The KV-compression table (docs/leaderboard.md): methods compared at the same bytes, on the same seeded
prompts, with intervals.

    from bhqk.evaluate import board
    b = board.Board(model, tok, length=2048, trials=30, path="board.json")   # resumes from board.json
    b.run(["fisher", "fisher+bits4", "bits4", "best"], ratios=(0.75, 0.875))
    print(b.table())

**Ratio.** A method's compression ratio is 1 − the bytes its cache holds after the prompt ÷ the bytes the
model's own cache (``DynamicCache``, the model's dtype, a sliding layer its window) holds after it:
:func:`ratio`, counted by :meth:`bhqk.budget.Plan.nbytes` (integers, scales, zero points and the float
window of recent positions included; a streaming head's sink and window). A method is graded at a
requested ratio with the largest cache that reaches it (:func:`fit`); the cell reports the ratio reached.

**Methods** (:func:`parse`): ``full`` (the model as it is; the reference), ``bits8`` / ``bits4`` (every
head full, quantized: one ratio, reached or not), ``streaming`` (every K/V head sink + window),
``<score>`` (:func:`bhqk.budget.find`'s plan by that score, as many full heads as the ratio allows; its
streaming heads keep ``sink`` + ``window``, or a quarter of each where that cannot reach the ratio),
``<score>+bits8`` / ``+bits4`` (the same with the full heads quantized), and ``best``: per ratio, the
candidate — each of ``scores`` × bits (none, 8, 4) × streaming sizes (``sink``/``window`` and a quarter
of each) fitted to the ratio — with the lowest KL divergence from the model on ``kl_chunks`` pieces of
real text (:func:`bhqk.evaluate.grade.divergence`), never on the table's tasks.

**Prompts.** ``tasks`` × ``trials`` prompts of ``length`` tokens (:func:`bhqk.evaluate.tasks.make_set`,
seeded), every method the same ones, scored by :meth:`Prompt.score`. A cell's accuracy carries Wilson's
95 % interval and its difference from ``full`` Newcombe's paired interval (:mod:`bhqk.evaluate.grade`).
With ``path`` every reply is written as it comes and a new run skips what is there: the table is a queue.
A cell whose cache is one already graded (the same heads, streaming size and bits: ``fisher+bits4`` that
keeps every head is ``bits4``) takes that cell's replies: greedy decoding on the same cache is the same.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..budget import Plan, find
from ..budget.quant import BITS
from ..integrations.model_map import model_map
from . import grade
from .tasks import make_set

RATIOS = (0.5, 0.75, 0.875, 0.9375)
TASKS = ("needle", "multikey")  # SmolLM2-135M with full attention: 52 of 60 at 2,048 tokens (docs/leaderboard.md)
FORMAT = "bhqk.evaluate.board/1"


def own_nbytes(model, length: int) -> int:
    """Bytes of keys and values the model's own cache holds after ``length`` tokens (one sequence)."""
    shape = model_map(model).shape
    return Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), model=shape).nbytes(length, model)[1]


def held(plan: Plan | None, model, length: int) -> int:
    """Bytes ``plan``'s cache holds after ``length`` tokens (None: the model's own cache)."""
    return own_nbytes(model, length) if plan is None else plan.nbytes(length, model)[0]


def ratio(plan: Plan | None, model, length: int) -> float:
    """1 − the bytes ``plan``'s cache holds ÷ the model's own cache's, after ``length`` tokens."""
    return 1 - held(plan, model, length) / own_nbytes(model, length)


def fit(plan: Plan, model, length: int, target: float) -> Plan | None:
    """``plan`` (with scores; its sink, window and bits) with the most full heads (:meth:`Plan.top`) whose
    cache reaches compression ratio ``target`` after ``length`` tokens; None where no count does. Every
    count is tried: with bits a full head can hold less than a streaming one (a short prompt), so the
    bytes need not grow with the count."""
    if not 0 <= target < 1:
        raise ValueError(f"fit: the ratio must be in [0, 1), got {target!r}.")
    budget = (1 - target) * own_nbytes(model, length)
    choosable = int((~plan.free(model_map(model).shape)).sum())  # the heads whose choice matters
    within = [n for n in range(choosable + 1) if plan.top(n).nbytes(length, model)[0] <= budget]
    return plan.top(within[-1]) if within else None


@dataclass(frozen=True)
class Method:
    """A row of the table: ``score`` (None: every head full; ``"streaming"``; ``"best"``; else a score of
    :func:`bhqk.budget.find`) and ``bits`` (None: floats)."""

    name: str
    score: str | None
    bits: int | None

    @property
    def fixed(self) -> bool:
        """One cache whatever the ratio (``full``, ``bits8``, ``streaming``): reached or not."""
        return self.score in (None, "streaming")


def parse(name: str) -> Method:
    """The method a row name (module doc) means, or a ``ValueError`` naming what is wrong."""
    from ..budget import SCORES

    base, plus, b = name.partition("+bits")
    bits = None
    if plus:
        if b not in [str(x) for x in BITS]:
            raise ValueError(f"method {name!r}: +bits takes 8 or 4, got {b!r}.")
        bits = int(b)
    if base == "full":
        return Method(name, None, None)
    if base.startswith("bits") and not plus:
        if base[4:] not in [str(x) for x in BITS]:
            raise ValueError(f"method {name!r}: bits8 or bits4 (every head full, quantized).")
        return Method(name, None, int(base[4:]))
    if base in ("streaming", "best") or base in SCORES:
        if base == "best" and plus:
            raise ValueError(f"method {name!r}: best chooses its own bits; write best.")
        return Method(name, base, bits)
    raise ValueError(f"method {name!r}: expected full, bits8, bits4, streaming, best or a score of bhqk.budget.find "
                     f"({', '.join(SCORES)}), each score optionally +bits8 or +bits4.")


def same_cache(plan: Plan) -> tuple:
    """What decides ``plan``'s cache: its full heads and bits, and its streaming size where a head streams
    (every head full at 4 bits is one cache, whatever sink and window it names)."""
    full = tuple(plan.full.flatten().tolist())
    return (full, plan.bits) + (() if all(full) else (plan.sink, plan.window))


def check_scores(scores: Sequence[str]) -> None:
    """``best``'s candidate scores: names of :data:`bhqk.budget.SCORES`, at least one."""
    from ..budget import SCORES

    if not scores or any(s not in SCORES for s in scores):
        raise ValueError(f"Board: scores are among {', '.join(SCORES)}, got {list(scores)}.")


def _key(ratio: float) -> str:
    return f"{ratio:g}"


class Board:
    """The table on one model (module doc): its prompts, the plans of each cell, the replies, the picks of
    ``best``; ``path`` (a JSON file) keeps them all, and a Board opened on it again resumes."""

    def __init__(self, model, tok, *, length: int = 2048, tasks: Sequence[str] = TASKS, trials: int = 30,
                 seed: int = 0, sink: int = 64, window: int = 256, scores: Sequence[str] = ("fisher", "retrieval"),
                 kl_chunks: int = 2, path: str | Path | None = None, log=print):
        check_scores(scores)
        self.model, self.tok, self.length, self.log = model, tok, length, log
        self.shape = model_map(model).shape
        self.settings: dict[str, Any] = {"format": FORMAT, "model": self.shape.to_dict(), "length": length, "tasks": list(tasks),
                         "trials": trials, "seed": seed, "sink": sink, "window": window, "scores": list(scores),
                         "kl_chunks": kl_chunks}
        self.prompts = make_set(tok, tasks, [length], trials, seed)
        self.path = None if path is None else Path(path)
        self.data: dict[str, Any] = {**self.settings, "prompts": [p.to_json() for p in self.prompts],
                                     "own_bytes": own_nbytes(model, length), "cells": {}, "best": {}, "log": []}
        if self.path is not None and self.path.exists():
            old = json.loads(self.path.read_text())
            same = {k: old.get(k) for k in self.settings} == self.settings and old.get("prompts") == self.data["prompts"]
            if not same:
                diff = [k for k in self.settings if old.get(k) != self.settings[k]] or ["prompts"]
                raise ValueError(f"Board: {self.path} was run with other {', '.join(diff)}; give another path.")
            self.data = old
        self._scored: dict[str, Plan] = {}

    # ---- plans ----------------------------------------------------------------------------------
    def scored(self, score: str) -> Plan:
        """``find``'s plan by ``score`` (its scores rank the heads; computed once per board)."""
        if score not in self._scored:
            t0 = time.perf_counter()
            self._scored[score] = find(self.model, 0.0, self.settings["sink"], self.settings["window"], score,
                                       tokenizer=self.tok, seed=self.settings["seed"])
            self.log(f"scored the heads by {score} ({time.perf_counter() - t0:.0f} s)")
        return self._scored[score]

    def plan(self, method: Method, target: float) -> Plan | None | str:
        """The cache ``method`` grades at ratio ``target``: None (the model's own), a plan, or why it
        cannot reach the ratio (a str)."""
        sh = self.shape
        if method.score is None and method.bits is None:
            return None if target == 0 else "keeps every key (ratio 0)"
        if method.fixed:
            full = torch.full((sh.layers, sh.kv_heads), method.score is None)
            p = Plan(full, self.settings["sink"], self.settings["window"], model=sh, bits=method.bits)
            r = ratio(p, self.model, self.length)
            return p if r >= target - 1e-12 else f"holds {1 - r:.3f} of the bytes (ratio {r:.3f})"
        if method.score == "best":
            return self.best(target)
        assert method.score is not None  # not fixed: a score's plan
        scored = self.scored(method.score)
        for sink, window in self.sizes():  # the board's streaming size, else a quarter of it
            got = fit(replace(scored, sink=sink, window=window, bits=method.bits), self.model, self.length, target)
            if got is not None:
                return got
        stream = replace(scored.top(0), sink=sink, window=window, bits=method.bits)
        share = 1 - ratio(stream, self.model, self.length)
        return f"every head streaming (sink {sink}, window {window}) holds {share:.3f} of the bytes"

    def sizes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The streaming heads' (sink, window): the board's, and a quarter of each."""
        s, w = self.settings["sink"], self.settings["window"]
        return (s, w), (s // 4, w // 4)

    def candidates(self, target: float) -> dict[str, Plan]:
        """``best``'s candidates at ratio ``target``: each score × bits × streaming size, fitted (module doc; the
        heads ranked by the scores computed at the board's sink and window), each cache once (every head
        full at 4 bits is one candidate, whatever score ranked it)."""
        out: dict[str, Plan] = {}
        seen = set()
        for score in self.settings["scores"]:
            for sink, window in self.sizes():
                base = replace(self.scored(score), sink=sink, window=window)
                for bits in (None, *BITS):
                    p = fit(replace(base, bits=bits), self.model, self.length, target)
                    if p is not None and same_cache(p) not in seen:
                        seen.add(same_cache(p))
                        out[f"{score} s{sink}w{window}" + ("" if bits is None else f" bits{bits}")] = p
        return out

    def best(self, target: float) -> Plan | str:
        """The candidate with the lowest KL from the model on real text (stored: the pick, every
        candidate's KL and the seconds it took)."""
        k = _key(target)
        got = self.data["best"].get(k)
        if got is not None:
            return Plan.from_dict(got["plan"], f"{self.path}: best at {k}")
        t0 = time.perf_counter()
        cands = self.candidates(target)
        if not cands:
            return "no candidate reaches this ratio"
        d = grade.divergence(self.model, self.tok, cands, self.length, self.settings["kl_chunks"], progress=False)
        s = d.summary()
        pick = min(cands, key=lambda n: s[n]["kl"])
        self.data["best"][k] = {"pick": pick, "plan": cands[pick].to_dict(), "seconds": time.perf_counter() - t0,
                                "kl": {n: s[n]["kl"] for n in cands}, "start": d.start}
        self._save()
        self.log(f"best at {k}: {pick} (KL {s[pick]['kl']:.3g} of {len(cands)} candidates, "
                 f"{time.perf_counter() - t0:.0f} s)")
        return cands[pick]

    # ---- grading --------------------------------------------------------------------------------
    def cell(self, name: str, target: float) -> dict:
        """Grade method ``name`` at ratio ``target`` on every prompt not yet answered (stored as it goes)."""
        m = parse(name)
        key = f"{name}@{_key(target)}"
        c = self.data["cells"].get(key)
        if c is None:
            p = self.plan(m, target)
            c = {"method": name, "ratio": target, "entries": []}
            if isinstance(p, str):
                c["reached"], c["why"] = False, p
            else:
                c.update({"reached": True, "held": held(p, self.model, self.length),
                          "plan": None if p is None else p.to_dict(), "cache": describe(p)})
                c["ratio_reached"] = 1 - c["held"] / self.data["own_bytes"]
            self.data["cells"][key] = c
            self._save()
        if not c["reached"]:
            return c
        plan = None if c["plan"] is None else Plan.from_dict(c["plan"], f"{self.path}: {key}")
        twin = self._twin(key, c)
        if twin is not None and len(c["entries"]) < len(self.prompts):  # the same cache: the same greedy replies
            c["entries"], c["same_as"] = [dict(e) for e in self.data["cells"][twin]["entries"]], twin
            self._save()
            self.log(f"{key}: the cache of {twin}, its replies")
        todo = self.prompts[len(c["entries"]):]
        t0 = time.perf_counter()
        for prompt in todo:
            c["entries"].append(grade.reply(self.model, self.tok, prompt, plan))
            self._save()
        if todo:
            k = sum(e["correct"] for e in c["entries"])
            self.log(f"{key}: {k}/{len(c['entries'])} ({time.perf_counter() - t0:.0f} s)")
            self.data["log"].append({"cell": key, "replies": len(todo), "seconds": time.perf_counter() - t0})
            self._save()
        return c

    def _twin(self, key: str, c: dict) -> str | None:
        """A fully answered cell whose cache is this one's (the same heads, streaming size and bits)."""
        def cache_of(name: str, cell: dict):
            p = cell.get("plan")
            return None if p is None else same_cache(Plan.from_dict(p, f"{self.path}: {name}"))

        mine = cache_of(key, c)
        for other, o in self.data["cells"].items():
            if (other != key and o.get("reached") and len(o["entries"]) == len(self.prompts) and mine is not None
                    and cache_of(other, o) == mine):
                return other
        return None

    def run(self, methods: Sequence[str], ratios: Sequence[float] = RATIOS) -> None:
        """``full`` first (the reference), then every method at every ratio (fixed methods once)."""
        ms = [parse(n) for n in methods]  # every name checked before any forward
        self.cell("full", 0.0)
        for r in ratios:
            for m in ms:
                if m.name != "full":
                    self.cell(m.name, r)

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    # ---- the table ------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """Every graded cell with all its prompts answered: accuracy, Wilson interval, the paired difference
        from ``full`` and the ratio reached (or why not reached)."""
        return rows(self.data)

    def table(self) -> str:
        return table(self.data)


def describe(plan: Plan | None) -> str:
    """A cell's cache in a few words: ``"12/90 full, sink 16 + window 64, 4 bits"``."""
    if plan is None:
        return "the model's own"
    bits = "floats" if plan.bits is None else f"{plan.bits} bits"
    return f"{int(plan.full.sum())}/{plan.full.numel()} full, sink {plan.sink} + window {plan.window}, {bits}"


def rows(data: dict) -> list[dict]:
    """:meth:`Board.rows` of a board's stored JSON."""
    n = len(data["prompts"])
    full = data["cells"].get("full@0", {}).get("entries", [])
    ref = [e["correct"] for e in full] if len(full) == n else None
    out = []
    for key, c in data["cells"].items():
        row: dict[str, Any] = {"cell": key, "method": c["method"], "ratio": c["ratio"], "reached": c["reached"]}
        if not c["reached"]:
            row["why"], row["failed"] = c["why"], c.get("failed", False)  # failed: the method itself did not run
        elif len(c["entries"]) == n:
            got = [e["correct"] for e in c["entries"]]
            k = sum(got)
            lo, hi = grade.wilson(k, n)
            row.update({"correct": k, "n": n, "acc": k / n, "lo": lo, "hi": hi, "ratio_reached": c["ratio_reached"],
                        "held": c["held"], "cache": c.get("cache")})
            if ref is not None and key != "full@0":
                d = grade.paired(got, ref)
                row["diff"] = {"diff": d.diff, "lo": d.lo, "hi": d.hi, "p": d.p}
        else:
            row["partial"] = len(c["entries"])
        out.append(row)
    return out


def table(data: dict) -> str:
    """Methods × ratios (markdown): accuracy [Wilson 95 %], the ratio reached, − full [Newcombe 95 %]."""
    rs = rows(data)
    ratios = sorted({r["ratio"] for r in rs if r["ratio"] > 0})
    methods = list(dict.fromkeys(r["method"] for r in rs))
    at = {(r["method"], r["ratio"]): r for r in rs}

    def cell(r: dict | None) -> str:
        if r is None:
            return "–"
        if not r["reached"]:
            return f"{'fails' if r['failed'] else 'cannot reach'}: {r['why']}"
        if "partial" in r:
            return f"running ({r['partial']}/{len(data['prompts'])})"
        s = f"{r['correct']}/{r['n']} [{r['lo']:.2f}, {r['hi']:.2f}] at {r['ratio_reached']:.3f}"
        if "diff" in r:
            d = r["diff"]
            s += f"; {d['diff']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"
        return s

    head = f"{len(data['prompts'])} prompts ({', '.join(data['tasks'])}) of {data['length']} tokens, seed {data['seed']}"
    full = at.get(("full", 0.0))
    lines = [head, "", f"full attention: {cell(full)}", "",
             "| method | " + " | ".join(f"ratio {x:g}" for x in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for m in methods:
        if m == "full":
            continue
        lines.append(f"| {m} | " + " | ".join(cell(at.get((m, x))) for x in ratios) + " |")
    if data.get("best"):
        lines += ["", "best's picks (lowest KL on real text): " + ", ".join(
            f"{k}: {b['pick']} (KL {b['kl'][b['pick']]:.3g}, {len(b['kl'])} candidates, {b['seconds']:.0f} s)"
            for k, b in data["best"].items())]
    return "\n".join(lines)


__all__ = ["Board", "Method", "RATIOS", "TASKS", "describe", "fit", "held", "own_nbytes", "parse", "ratio", "rows",
           "same_cache", "table"]
