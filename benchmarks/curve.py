"""The head-choice curve: accuracy on the graded tasks and perplexity at 4k against the fraction of K/V heads
kept full, one line per score, from one ``benchmarks/grade.py`` run (``--part tasks`` and ``--part kl`` with
configurations ``full``, ``streaming`` and ``<score>@<fraction>``).

    python benchmarks/curve.py --tag curve-2026-12-04 --out docs/curve.png

Accuracy is every task and length pooled, with its Wilson 95 % interval; perplexity is × full attention's
with the run's bootstrap 95 % interval. ``full`` is fraction 1 and ``streaming`` fraction 0 of every score.
Prints the markdown table of the picture, then per fraction each score against each random draw and against
full attention, and each pair of scores (paired difference [Newcombe 95 %], McNemar's p).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade as grade_bench  # benchmarks/grade.py: load_results, grades_of  # noqa: E402

LABELS = {"retrieval": "retrieval", "kl-stored": "kl (exact)", "fisher-stored": "fisher (first-order)",
          "learned-stored": "learned (10 of 20 steps)", "learned20-stored": "learned (20 steps)",
          "random0": "random, draw 0", "random1": "random, draw 1"}
SCORES = ("retrieval", "kl-stored", "fisher-stored", "learned-stored", "learned20-stored")  # the scores, not the controls


def points(data: dict) -> tuple[dict, dict]:
    """score -> [(fraction, k, n, lo, hi)] and score -> [(fraction, ppl ratio, lo, hi)]."""
    g = grade_bench.grades_of(data)
    acc: dict = {}
    for name in g.names:
        k, n, lo, hi = g.accuracy(name, None, None)
        score, _, frac = name.partition("@")
        if name in ("full", "streaming"):
            continue
        acc.setdefault(score, []).append((float(frac), k, n, lo, hi))
    ends = {name: g.accuracy(name, None, None) for name in ("full", "streaming") if name in g.names}
    ppl: dict = {}
    kl = next(iter(data.get("kl", {}).values()), None)
    pends: dict = {}
    if kl is not None:
        for name, s in kl["summary"].items():
            if not isinstance(s, dict):
                continue
            row = (s["ppl_ratio"], *s["ppl_ratio_ci"])
            if name in ("full", "streaming"):
                pends[name] = row
                continue
            score, _, frac = name.partition("@")
            ppl.setdefault(score, []).append((float(frac), *row))
    for score in acc:
        if "streaming" in ends:
            acc[score].append((0.0, *ends["streaming"]))
        if "full" in ends:
            acc[score].append((1.0, *ends["full"]))
        acc[score].sort()
    for score in ppl:
        if "streaming" in pends:
            ppl[score].append((0.0, *pends["streaming"]))
        if "full" in pends:
            ppl[score].append((1.0, *pends["full"]))
        ppl[score].sort()
    return acc, ppl


def table(acc: dict, ppl: dict) -> str:
    fracs = sorted({f for rows in acc.values() for f, *_ in rows})
    lines = ["| score | " + " | ".join(f"{f:g}" for f in fracs) + " |", "|---|" + "---|" * len(fracs)]
    for score, rows in acc.items():
        by = {f: (k, n, lo, hi) for f, k, n, lo, hi in rows}
        lines.append(f"| {LABELS.get(score, score)}: accuracy | " + " | ".join(
            f"{by[f][0]}/{by[f][1]} = {by[f][0] / by[f][1]:.2f} [{by[f][2]:.2f}, {by[f][3]:.2f}]" if f in by else "—"
            for f in fracs) + " |")
    for score, rows in ppl.items():
        byp = {f: (r, lo, hi) for f, r, lo, hi in rows}
        lines.append(f"| {LABELS.get(score, score)}: perplexity × full | " + " | ".join(
            f"{byp[f][0]:.3f} [{byp[f][1]:.3f}, {byp[f][2]:.3f}]" if f in byp else "—" for f in fracs) + " |")
    return "\n".join(lines)


def against_random(data: dict) -> str:
    """Per fraction: each score's paired difference from each random draw (all tasks pooled)."""
    g = grade_bench.grades_of(data)
    lines = ["| fraction | score | − random, draw 0 | − random, draw 1 | − full |", "|---|---|---|---|---|"]
    fracs = sorted({n.partition("@")[2] for n in g.names if "@" in n}, key=float)
    for f in fracs:
        for score in SCORES:
            name = f"{score}@{f}"
            if name not in g.names:
                continue
            cells = []
            for ref in (f"random0@{f}", f"random1@{f}", "full"):
                if ref not in g.names:
                    cells.append("—")
                    continue
                d = g.difference(name, ref, None)
                cells.append(f"{d.diff:+.2f} [{d.lo:+.2f}, {d.hi:+.2f}], p={d.p:.2g}")
            lines.append(f"| {f} | {LABELS[score]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def between_scores(data: dict) -> str:
    """Per fraction: each pair of scores, paired on the same prompts (all tasks pooled)."""
    g = grade_bench.grades_of(data)
    lines = ["| fraction | x | y | x − y [Newcombe 95 %] | only x : only y | McNemar p |", "|---|---|---|---|---|---|"]
    fracs = sorted({n.partition("@")[2] for n in g.names if "@" in n}, key=float)
    for f in fracs:
        here = [s for s in SCORES if f"{s}@{f}" in g.names]
        for i, x in enumerate(here):
            for y in here[i + 1:]:
                d = g.difference(f"{x}@{f}", f"{y}@{f}", None)
                lines.append(f"| {f} | {LABELS[x]} | {LABELS[y]} | {d.diff:+.2f} [{d.lo:+.2f}, {d.hi:+.2f}] | "
                             f"{d.x_only} : {d.y_only} | {d.p:.2g} |")
    return "\n".join(lines)


def draw(acc: dict, ppl: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (score, rows) in enumerate(acc.items()):
        f = [r[0] + 0.006 * (i - len(acc) / 2) for r in rows]  # a small offset per score: the bars stay apart
        y = [r[1] / r[2] for r in rows]
        axes[0].errorbar(f, y, yerr=[[a - r[3] for a, r in zip(y, rows)], [r[4] - a for a, r in zip(y, rows)]],
                         marker="o", capsize=3, label=LABELS.get(score, score),
                         linestyle="--" if score.startswith("random") else "-")
    axes[0].set(xlabel="fraction of K/V heads full", ylabel="accuracy (Wilson 95 %)", ylim=(-0.02, 1.02),
                title="needle + multikey")
    for i, (score, rows) in enumerate(ppl.items()):
        f = [r[0] + 0.006 * (i - len(ppl) / 2) for r in rows]
        y = [r[1] for r in rows]
        axes[1].errorbar(f, y, yerr=[[a - r[2] for a, r in zip(y, rows)], [r[3] - a for a, r in zip(y, rows)]],
                         marker="o", capsize=3, label=LABELS.get(score, score),
                         linestyle="--" if score.startswith("random") else "-")
    axes[1].axhline(1.05, color="grey", linewidth=0.8, linestyle=":")
    axes[1].set(xlabel="fraction of K/V heads full", ylabel="perplexity × full (bootstrap 95 %)",
                title="perplexity beyond sink + window")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", required=True)
    p.add_argument("--out", type=Path, default=None, help="the picture (PNG)")
    p.add_argument("--title", default="SmolLM2-135M-Instruct, S = 64, W = 256")
    a = p.parse_args()
    data = grade_bench.load_results(a.tag)
    acc, ppl = points(data)
    print(table(acc, ppl))
    print()
    print(against_random(data))
    print()
    print(between_scores(data))
    if a.out is not None:
        draw(acc, ppl, a.out, a.title)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
