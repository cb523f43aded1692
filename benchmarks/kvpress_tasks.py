"""kvpress (NVIDIA) on bhqk's graded tasks: the 60 prompts of the head-choice curve (``needle`` and
``multikey`` at 1,024 tokens, trials 0–29, seed 0; docs/benchmarks.md) under StreamingLLM, SnapKV and
AdaKV(SnapKV) at a compression ratio, scored by bhqk's own rule. Three steps, two environments:

    python benchmarks/kvpress_tasks.py --dump /tmp/kvpress-prompts.json                   # bhqk's env
    /tmp/bhqk-kvpress-venv/bin/python benchmarks/kvpress_tasks.py --run /tmp/kvpress-prompts.json \\
        --model ~/.cache/bhqk/SmolLM2-135M-Instruct.Q4_1-<hash> --ratios 0.75 --out /tmp/kvpress-replies.json
    python benchmarks/kvpress_tasks.py --score /tmp/kvpress-replies.json --tag 2026-12-05  # bhqk's env

``--dump`` writes every prompt's token ids (``bhqk.evaluate.tasks.make``) after checking them against the
prompts stored with the curve (``benchmarks/results/grade-curve-2026-12-04.json``). ``--run`` (kvpress's
own environment, ``bash benchmarks/kvpress_env.sh``; it never imports bhqk) greedy-decodes each prompt's
reply as ``bhqk.evaluate.grade.reply`` does (the whole prompt prefilled under the press, then one token at
a time at the true positions, up to the prompt's ``max_new_tokens`` or an end token) with
``benchmarks/kvpress_needle.py``'s presses, model loading and decoding (bhqk's one greedy loop,
``bhqk.integrations.greedy.greedy``, loaded by path). ``--score``
scores the replies with ``Prompt.score`` and writes ``benchmarks/results/kvpress-tasks-<tag>.json``
(CPU, versions, every reply) and a table with Wilson 95 % intervals.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TASKS, LENGTH, TRIALS, SEED = ("needle", "multikey"), 1024, 30, 0
CURVE = HERE / "results" / "grade-curve-2026-12-04.json"


def dump(out: Path) -> None:
    from bhqk.evaluate import tasks
    from bhqk.models import pretrained

    _, tok = pretrained("smollm2-135m")
    stored = json.loads(CURVE.read_text())["tasks"]["groups"]
    prompts = []
    for task in TASKS:
        made = [tasks.make(tok, task, LENGTH, i, SEED) for i in range(TRIALS)]
        if [p.to_json() for p in made] != stored[f"{task}@{LENGTH}"]["prompts"]:
            raise SystemExit(f"{task}: the prompts made now are not the curve's")
        prompts += [{"task": p.task, "trial": p.trial, "ids": p.ids, "max_new_tokens": p.max_new_tokens} for p in made]
    out.write_text(json.dumps({"length": LENGTH, "seed": SEED, "prompts": prompts}))
    print(f"wrote {len(prompts)} prompts to {out}")


def run(src: Path, model_dir: Path, presses: list[str], ratios: list[float], out: Path) -> None:
    from kvpress_needle import answer, load_model, make_press, versions

    prompts = json.loads(src.read_text())["prompts"]
    model, tok = load_model(model_dir)
    configs = []
    for name in presses:
        for ratio in ([0.0] if name == "none" else ratios):
            press, t0, replies = make_press(name, ratio), time.perf_counter(), []
            for p in prompts:
                g = answer(model, tok, p["ids"], press, p["max_new_tokens"])  # stops as bhqk's grader does
                replies.append({"task": p["task"], "trial": p["trial"],
                                "reply": tok.decode(g["new"], skip_special_tokens=True).strip(),
                                "kv_bytes_stored": g["kv_bytes_stored"], "kv_bytes_effective": g["kv_bytes_effective"]})
            configs.append({"press": name, "ratio": ratio, "seconds": time.perf_counter() - t0, "replies": replies})
            print(f"{name} {ratio}: {time.perf_counter() - t0:.0f} s", flush=True)
            out.write_text(json.dumps({"versions": versions(), "model": str(model_dir), "configs": configs}))


def score(src: Path, tag: str) -> None:
    import machine  # benchmarks/machine.py
    from bhqk.evaluate import tasks
    from bhqk.evaluate.grade import wilson
    from bhqk.models import pretrained

    data = json.loads(src.read_text())
    _, tok = pretrained("smollm2-135m")
    made = {(t, i): tasks.make(tok, t, LENGTH, i, SEED) for t in TASKS for i in range(TRIALS)}
    lines = ["| press | compression | needle | multikey | all (Wilson 95 %) | KV stored / full, after prefill |",
             "|---|---|---|---|---|---|"]
    full = None
    for c in data["configs"]:
        for r in c["replies"]:
            r["correct"] = made[(r["task"], r["trial"])].score(r["reply"])
        k = {t: sum(r["correct"] for r in c["replies"] if r["task"] == t) for t in TASKS}
        n, kall = len(c["replies"]), sum(k.values())
        lo, hi = wilson(kall, n)
        stored = sum(r["kv_bytes_stored"] for r in c["replies"])
        eff = sum(r["kv_bytes_effective"] for r in c["replies"])
        full = stored if c["press"] == "none" else full
        share = "" if full is None else f"{stored / full:.2f} (kept {eff / full:.2f})"
        lines.append(f"| {c['press']} | {c['ratio']:g} | {k['needle']}/{TRIALS} | {k['multikey']}/{TRIALS} | "
                     f"{kall}/{n} = {kall / n:.2f} [{lo:.2f}, {hi:.2f}] | {share} |")
    table = "\n".join(lines)
    out = HERE / "results" / f"kvpress-tasks-{tag}.json"
    out.write_text(json.dumps({"meta": machine.describe(), "command": " ".join(sys.argv), "table": table, **data},
                              indent=1))
    print(table)
    print("wrote", out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", type=Path)
    p.add_argument("--run", type=Path)
    p.add_argument("--score", type=Path)
    p.add_argument("--model", type=Path, help="--run: bhqk's converted HF folder of SmolLM2-135M-Instruct")
    p.add_argument("--presses", nargs="+", default=["none", "streaming_llm", "snapkv", "adakv_snapkv"])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.75])
    p.add_argument("--out", type=Path, default=Path("/tmp/kvpress-replies.json"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    if a.dump:
        dump(a.dump)
    elif a.run:
        run(a.run, a.model, a.presses, a.ratios, a.out)
    elif a.score:
        score(a.score, a.tag)
    else:
        p.error("one of --dump, --run, --score")


if __name__ == "__main__":
    main()
