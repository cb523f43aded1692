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

``--board PROMPTS.json --out OUT.json`` (kvpress's environment) gives kvpress's rows of a KV-compression
board: a board's dumped prompts (with ``ids``) under every press of ``kvpress_needle.PRESSES`` (or
``--presses``) at each of ``--ratios``, ``none`` first at ratio 0 (the reference bytes). Resumable: run
it again and the replies already in OUT.json are skipped; OUT.json is rewritten after every reply:

    OMP_NUM_THREADS=1 /tmp/bhqk-kvpress-venv/bin/python benchmarks/kvpress_tasks.py \
        --board /tmp/board-prompts-smollm2.json --model ~/.cache/bhqk/SmolLM2-135M-Instruct.Q4_1-<hash> \
        --ratios 0.75 0.875 --out /tmp/kvpress-board-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
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


def board(src: Path, model_dir: Path, presses: list[str], ratios: list[float], out: Path,
          retry_errors: bool = False, none_first: int | None = None) -> None:
    """kvpress's rows of a KV-compression board: every press × ratio over a board's prompts
    (``bhqk``'s dumped board prompts: their json and ``ids``), greedy replies as :func:`run`'s. ``none``
    (no press, ratio 0, key ``none@0``) runs first (only its first ``none_first`` prompts when given; a run
    without it adds the rest): its mean stored bytes are the reference of every
    cell's ``held_fraction`` (stored) and ``kept_fraction`` (effective, i.e. less what a press masks).
    Resumable: replies already in ``out`` are skipped (a cell that failed is skipped too unless
    ``retry_errors``); ``out`` is rewritten (tmp + rename) after every reply."""
    import torch

    from kvpress_needle import CACHES, answer, load_model, make_press, versions
    from machine import describe  # benchmarks/machine.py: torch and the standard library only

    data = json.loads(src.read_text())
    prompts = data["prompts"]
    state = json.loads(out.read_text()) if out.exists() else {"runs": [], "prompts": [], "cells": {}}
    state["prompts"] = [{k: v for k, v in p.items() if k != "ids"} for p in prompts]
    state["runs"].append({"versions": versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          "threads": torch.get_num_threads(), "model": str(model_dir), "prompts_file": str(src),
                          "board_model": data.get("model"), "length": data.get("length"),
                          "presses": presses, "ratios": ratios, "machine": describe(),
                          "notes": "whole prompt prefilled under the press; greedy decode at true positions "
                                   "(bhqk's greedy loop, loaded by path); bytes after the prefill; "
                                   "fp32 weights, sdpa attention"})
    cells = state["cells"]

    def save() -> None:
        ref = cells.get("none@0", {}).get("entries") or []
        for c in cells.values():
            e = c["entries"]
            for key, field in (("held_fraction", "kv_bytes_stored"), ("kept_fraction", "kv_bytes_effective")):
                c[key] = (sum(r[field] for r in e) / len(e)) / (sum(r["kv_bytes_stored"] for r in ref) / len(ref)) \
                    if e and ref else None
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, out)

    model, tok = load_model(model_dir)
    # none's first `none_first` prompts give the reference bytes (every prompt has the board's length); the rest
    # of its replies (the check that kvpress's path answers as bhqk's full attention) come with a run without it
    jobs = [("none", 0.0, none_first)] + [(name, r, None) for name in presses if name != "none" for r in ratios]
    for name, ratio, limit in jobs:
        key = f"{name}@{ratio:g}"
        c = cells.setdefault(key, {"press": name, "ratio": ratio, "held_fraction": None, "kept_fraction": None,
                                   "cache": CACHES[name], "seconds": 0.0, "entries": []})
        if "error" in c:
            if not retry_errors:
                print(f"{key}: failed before, skipped ({c['error'].strip().splitlines()[-1]})", flush=True)
                continue
            del c["error"]
        done = {(e["task"], e["trial"]) for e in c["entries"]}
        todo = [p for p in prompts[:limit] if (p["task"], p["trial"]) not in done]
        if not todo:
            continue
        try:
            press = make_press(name, ratio)
        except Exception:
            c["error"] = traceback.format_exc()[-3000:]
            save()
            print(f"{key}: failed\n{c['error']}", flush=True)
            continue
        for p in todo:
            t0 = time.perf_counter()
            try:
                g = answer(model, tok, p["ids"], press, p["max_new_tokens"])  # stops as bhqk's grader does
            except Exception:
                c["error"] = traceback.format_exc()[-3000:]
                save()
                print(f"{key}: failed on {p['task']} {p['trial']}\n{c['error']}", flush=True)
                break
            c["entries"].append({"task": p["task"], "trial": p["trial"],
                                 "reply": tok.decode(g["new"], skip_special_tokens=True).strip(),
                                 "new_tokens": len(g["new"]), "kv_bytes_stored": g["kv_bytes_stored"],
                                 "kv_bytes_effective": g["kv_bytes_effective"],
                                 "prefill_s": g["prefill_s"], "decode_s": g["decode_s"]})
            c["seconds"] = round(c["seconds"] + time.perf_counter() - t0, 3)
            save()
            e = c["entries"][-1]
            print(f"{key} {p['task']} {p['trial']}: {e['reply']!r} {e['kv_bytes_effective'] / 2**20:.1f} MiB "
                  f"{e['prefill_s']:.2f}+{e['decode_s']:.2f} s", flush=True)
    save()
    print("wrote", out, flush=True)


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
    p.add_argument("--board", type=Path, help="kvpress's rows of a board: its dumped prompts (JSON with ids)")
    p.add_argument("--retry-errors", action="store_true", help="--board: run again the cells that failed before")
    p.add_argument("--none-first", type=int, default=None,
                   help="--board: run only this many of none's prompts (the reference bytes: the board's prompts share "
                        "one length); a run without it adds the rest")
    p.add_argument("--model", type=Path, help="--run: bhqk's converted HF folder of SmolLM2-135M-Instruct")
    p.add_argument("--presses", nargs="+", default=None,
                   help="default: none streaming_llm snapkv adakv_snapkv (--run); every press (--board)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.75])
    p.add_argument("--out", type=Path, default=None, help="default /tmp/kvpress-replies.json (--run), "
                   "/tmp/kvpress-board.json (--board)")
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    if a.dump:
        dump(a.dump)
    elif a.run:
        run(a.run, a.model, a.presses or ["none", "streaming_llm", "snapkv", "adakv_snapkv"], a.ratios,
            a.out or Path("/tmp/kvpress-replies.json"))
    elif a.board:
        from kvpress_needle import PRESSES

        board(a.board, a.model.expanduser(), a.presses or list(PRESSES), a.ratios,
              a.out or Path("/tmp/kvpress-board.json"), a.retry_errors, a.none_first)
    elif a.score:
        score(a.score, a.tag)
    else:
        p.error("one of --dump, --run, --score, --board")


if __name__ == "__main__":
    main()
