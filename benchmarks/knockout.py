"""Causal evidence for retrieval heads on SmolLM2-135M-Instruct: zero the outputs of the k heads with the
highest retrieval score (``bhqk.edit(zero=True)``, every prefill and decode step) and measure pass-key
accuracy on a needle grid, against k random heads (several draws, from the heads outside that top k)
and against no edit.

The retrieval scores come from ``benchmarks/real_heads.py`` (its JSON, column ``retrieval``: pass-key
questions with other keys, seed 0); this grid draws its keys from another seed, so the heads are not
chosen on the questions they are graded on. Exact match: the key is one of the numbers in the answer.

    python benchmarks/knockout.py --scores benchmarks/results/real_heads.json --k 10 \\
        --out benchmarks/results/knockout.json
    python benchmarks/knockout.py --report benchmarks/results/knockout.json    # the table again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

import machine  # benchmarks/machine.py: CPU model and flags for every JSON
import real_heads  # benchmarks/real_heads.py: the model, the prompts, exact match


def knocked(model, layers: list[str], heads: list[tuple[int, int]]):
    """A context in which the outputs of ``heads`` [(layer index, head)] are zero."""
    import bhqk

    stack = contextlib.ExitStack()
    by_layer: dict[int, list[int]] = {}
    for li, h in heads:
        by_layer.setdefault(li, []).append(h)
    for li, hs in sorted(by_layer.items()):
        stack.enter_context(bhqk.edit(model=model, layers=layers[li], heads=hs, zero=True))
    return stack


def grid(model, tok, prompts: list[tuple], layers: list[str], heads: list[tuple[int, int]], label: str,
         max_new_tokens: int = 16) -> dict:
    """Pass-key accuracy with ``heads`` knocked out, over ``prompts`` [(length, depth, key, ids)]."""
    trials = []
    t0 = time.perf_counter()
    for L, d, key, ids in prompts:
        with knocked(model, layers, heads), torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        ans = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        trials.append({"length": L, "depth": d, "key": key, "answer": ans, "found": real_heads.found(ans, key)})
    acc = sum(t["found"] for t in trials) / len(trials)
    print(f"  {label:28s} accuracy {acc:.2f} ({sum(t['found'] for t in trials)}/{len(trials)}), "
          f"{time.perf_counter() - t0:.0f} s; e.g. {trials[0]['answer']!r}", flush=True)
    return {"label": label, "heads": [list(h) for h in heads], "accuracy": acc, "trials": trials}


def report(info: dict) -> str:
    """The knockout table (Markdown): accuracy per condition, the heads, their retrieval scores."""
    lines = ["| heads zeroed | pass-key accuracy | heads (layer.head) | their retrieval scores (mean) |",
             "|---|---|---|---|"]
    for r in info["runs"]:
        n = len(r["trials"])
        heads = ", ".join(f"{li}.{h}" for li, h in r["heads"]) or "-"
        sc = f"{sum(r['scores']) / len(r['scores']):.3f}" if r.get("scores") else "-"
        lines.append(f"| {r['label']} | {r['accuracy']:.2f} ({sum(t['found'] for t in r['trials'])}/{n}) | {heads} | {sc} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scores", type=Path, default=Path("benchmarks/results/real_heads.json"))
    ap.add_argument("--k", type=int, nargs="+", default=[10])
    ap.add_argument("--draws", type=int, nargs="+", default=[0, 1, 2], help="seeds of the random draws of k heads")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--only-random", action="store_true", help="skip the unedited and the top-k runs")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--keys", type=int, default=2, help="keys per (length, depth)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, help="print the table of a JSON written before")
    a = ap.parse_args()
    if a.report:
        print(report(json.loads(a.report.read_text())))
        return
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    scores = json.loads(a.scores.read_text())
    layers = scores["layers"]
    ret = torch.tensor(scores["columns"]["retrieval"])  # [L, H]
    L, H = ret.shape
    order = [(int(i) // H, int(i) % H) for i in ret.flatten().argsort(descending=True, stable=True)]
    model, tok = real_heads.load_model()
    filler = real_heads.pydoc_ids(tok, max(int(x) for x in a.lengths.split(","))).flatten().tolist()
    prompts = []
    for n in (int(x) for x in a.lengths.split(",")):
        for i, d in enumerate(float(x) for x in a.depths.split(",")):
            for key in real_heads.keys(a.keys, a.seed + 1000 * n + i):
                prompts.append((n, d, key, real_heads.needle_prompt(tok, n, d, key, filler)[0]))
    info: dict = {"benchmark": "knockout", "machine": machine.describe(), "settings": vars(a) | {
        "scores": str(a.scores), "out": str(a.out)}, "layers": layers, "runs": []}
    print(f"{len(prompts)} needle prompts; {machine.one_line(info['machine'])}", flush=True)

    def save(run: dict) -> None:
        info["runs"].append(run)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(info, indent=1))

    m = a.max_new_tokens
    if not a.only_random:
        save(grid(model, tok, prompts, layers, [], "no edit", m) | {"k": 0, "kind": "none"})
    for k in a.k:
        top = order[:k]
        if not a.only_random:
            run = grid(model, tok, prompts, layers, top, f"top-{k} retrieval", m)
            run["scores"] = [float(ret[li, h]) for li, h in top]
            save(run | {"k": k, "kind": "retrieval"})
        rest = order[k:]
        for s in a.draws:
            g = torch.Generator().manual_seed(s)
            pick = sorted(rest[int(i)] for i in torch.randperm(len(rest), generator=g)[:k])
            run = grid(model, tok, prompts, layers, pick, f"{k} random heads (draw {s})", m)
            run["scores"] = [float(ret[li, h]) for li, h in pick]
            save(run | {"k": k, "kind": "random", "draw": s})
    print(report(info))
    if a.out:
        print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
