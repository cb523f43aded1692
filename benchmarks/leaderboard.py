"""The KV-compression table on a small model (docs/leaderboard.md): bhqk's methods through
``bhqk.evaluate.board`` (the queue resumes where it stopped), kvpress's presses imported from
benchmarks/kvpress_tasks.py's replies (its own environment), the table and the picture.

    python benchmarks/leaderboard.py --model smollm2-135m --ratios 0.75,0.875 \\
        --methods full,fisher,fisher+bits4,bits4,best                  # grade (resumes)
    python benchmarks/leaderboard.py --model smollm2-135m --dump /tmp/board-prompts.json   # for kvpress_tasks.py
    python benchmarks/leaderboard.py --model smollm2-135m --kvpress /tmp/kvpress-board.json  # import its replies
    python benchmarks/leaderboard.py --model smollm2-135m --table --plot docs/leaderboard_smollm2.png

Results: ``benchmarks/results/leaderboard-<model>.json`` (the board's JSON, plus ``runs``: CPU model and flags,
versions, threads, load, seconds of every run). kvpress's cells are ``kvpress:<press>@<ratio>``; their bytes are
counted as kvpress's cache holds them (``held`` in its replies: the pruned cache, or the whole cache for a
press that only masks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def path_of(model: str) -> Path:
    return RESULTS / f"leaderboard-{Path(model).name}.json"


def meta() -> dict:
    import transformers

    return {**machine.describe(), "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "loadavg": os.getloadavg()}


def open_board(a):
    from bhqk.evaluate import board
    from bhqk.models import pretrained

    model, tok = pretrained(a.model)
    return board.Board(model, tok, length=a.length, tasks=a.tasks.split(","), trials=a.trials, seed=a.seed,
                       scores=a.scores.split(","), kl_chunks=a.kl_chunks, path=path_of(a.model),
                       log=lambda line: print(line, flush=True))


def grade(a) -> None:
    b = open_board(a)
    t0 = time.perf_counter()
    run = {"meta": meta(), "methods": a.methods, "ratios": a.ratios}
    b.data.setdefault("runs", []).append(run)
    b.run(a.methods.split(","), [float(x) for x in a.ratios.split(",")])
    run.update({"seconds": time.perf_counter() - t0, "loadavg_end": os.getloadavg()})
    b._save()
    print(b.table())


def reach(a) -> None:
    """Per method and ratio, the cache the board would grade (full heads, streaming size, bits) and the ratio
    it reaches, from the bytes alone (no forward; the heads ranked by index, as only their count matters)."""
    from dataclasses import replace

    from bhqk.budget import Plan
    from bhqk.evaluate import board
    from bhqk.models import pretrained

    model, _ = pretrained(a.model)
    shape = board.model_map(model).shape
    ranked = Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), 64, 256, model=shape,
                  scores=-torch.arange(shape.layers * shape.kv_heads).double().reshape(shape.layers, shape.kv_heads))
    ratios = [float(x) for x in a.ratios.split(",")]
    lines = [f"{Path(a.model).name} at {a.length} tokens: own cache {board.own_nbytes(model, a.length) / 2**20:.2f} MiB",
             "| method | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for bits in (None, 8, 4):
        name = "plan" + ("" if bits is None else f"+bits{bits}")
        cells = []
        for r in ratios:
            got = None
            for sink, window in ((64, 256), (16, 64)):
                got = board.fit(replace(ranked, sink=sink, window=window, bits=bits), model, a.length, r)
                if got is not None:
                    break
            cells.append("cannot" if got is None else f"{board.describe(got)}: {board.ratio(got, model, a.length):.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for bits in (8, 4):
        p = Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), model=shape, bits=bits)
        lines.append(f"| bits{bits} | reaches {board.ratio(p, model, a.length):.3f} |" + " |" * (len(ratios) - 1))
    print("\n".join(lines))


def dump(a) -> None:
    """The board's prompts with their token ids, for benchmarks/kvpress_tasks.py --run."""
    b = open_board(a)
    out = {"model": a.model, "length": a.length, "own_bytes": b.data["own_bytes"],
           "prompts": [{**p.to_json(), "ids": p.ids, "max_new_tokens": p.max_new_tokens} for p in b.prompts]}
    Path(a.dump).write_text(json.dumps(out))
    print(f"wrote {len(b.prompts)} prompts to {a.dump}")


def import_kvpress(a) -> None:
    """kvpress_tasks.py's replies (``{"prompts": ..., "cells": {"<press>@<ratio>": {"entries": [...]}}}``) into
    the board as ``kvpress:<press>@<ratio>``, each reply scored again by bhqk's rule; bytes held = the mean of
    what kvpress's cache stored after each prefill (its ``none`` must store the board's own bytes). A press
    that failed (DuoAttention offline) becomes a cell that says why."""
    b = open_board(a)
    src = json.loads(Path(a.kvpress).read_text())
    if [p["trial"] for p in src["prompts"]] != [p.trial for p in b.prompts] or \
            [p["answer"] for p in src["prompts"]] != [list(p.answer) for p in b.prompts]:
        raise SystemExit(f"{a.kvpress} answers other prompts than the board's")
    own = b.data["own_bytes"]
    for key, c in src["cells"].items():
        press, _, r = key.rpartition("@")
        entries = c["entries"]
        stored = {e["kv_bytes_stored"] for e in entries} if press == "none" else {own}
        if stored != {own}:
            raise SystemExit(f"kvpress's own cache stored {sorted(stored)} bytes, the board counts {own}")
        cell = {"method": f"kvpress:{press}", "ratio": float(r), "plan": None, "cache": c.get("cache", "kvpress"),
                "source": {"file": a.kvpress, "runs": src.get("runs")}}
        if "error" in c:
            why = c["error"].strip().splitlines()[-1]
            b.data["cells"][f"kvpress:{press}@{float(r):g}"] = {**cell, "reached": False, "failed": True, "why": why,
                                                               "entries": []}
            print(f"{key}: fails ({why})")
            continue
        if press == "none" or len(entries) != len(b.prompts):
            print(f"{key}: {len(entries)} of {len(b.prompts)} replies" + ("" if press == "none" else ": not imported yet"))
            continue
        for e, p in zip(entries, b.prompts):
            assert (e["task"], e["trial"]) == (p.task, p.trial)
            e["correct"] = p.score(e["reply"])
        held = sum(e["kv_bytes_stored"] for e in entries) / len(entries)
        b.data["cells"][f"kvpress:{press}@{float(r):g}"] = {**cell, "entries": entries, "reached": True, "held": held,
                                                           "ratio_reached": 1 - held / own}
        print(f"imported kvpress:{press} at {r}: {sum(e['correct'] for e in entries)}/{len(entries)}")
    b._save()
    print(b.table())


def plot(a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bhqk.evaluate import board

    data = json.loads(path_of(a.model).read_text())
    rows = [r for r in board.rows(data) if r.get("n")]
    full = next(r for r in rows if r["cell"] == "full@0")
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.axhspan(full["lo"], full["hi"], color="0.85", label=f"full attention {full['correct']}/{full['n']} (95 %)")
    by: dict = {}
    for r in rows:
        if r["cell"] != "full@0":
            by.setdefault(r["method"], []).append(r)
    for i, (name, rs) in enumerate(by.items()):
        rs.sort(key=lambda r: r["ratio_reached"])
        nudge = 1.015 ** (i - len(by) / 2)  # methods at the same bytes side by side (log axis)
        x = [(1 - r["ratio_reached"]) * nudge for r in rs]  # bytes held ÷ the model's own
        y = [r["acc"] for r in rs]
        err = [[r["acc"] - r["lo"] for r in rs], [r["hi"] - r["acc"] for r in rs]]
        kv = name.startswith("kvpress")
        ax.errorbar(x, y, yerr=err, marker="s" if kv else "o", capsize=3, linestyle="--" if kv else "-", label=name)
    ticks = [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1]
    ax.set_xscale("log")
    ax.set_xticks(ticks, ["1/16", "1/8", "1/4", "1/2", "1"])
    ax.minorticks_off()
    ax.set_xlim(1 / 20, 1.2)
    ax.set_xlabel("bytes of keys and values held ÷ the model's own cache (log)")
    ax.set_ylabel(f"accuracy on {full['n']} prompts (Wilson 95 %)")
    ax.set_title(f"{Path(a.model).name}: {', '.join(data['tasks'])} at {data['length']} tokens")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)
    print(f"wrote {a.plot}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--tasks", default="needle,multikey")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scores", default="fisher,retrieval", help="best's candidates")
    p.add_argument("--kl-chunks", type=int, default=2)
    p.add_argument("--methods", default="full,bits8,bits4,streaming,fisher,fisher+bits4,best")
    p.add_argument("--ratios", default="0.5,0.75,0.875,0.9375")
    p.add_argument("--dump", help="write the prompts (with ids) for benchmarks/kvpress_tasks.py")
    p.add_argument("--kvpress", help="import kvpress_tasks.py's replies")
    p.add_argument("--table", action="store_true", help="print the stored table")
    p.add_argument("--reach", action="store_true", help="print the caches each ratio allows (bytes only, no forward)")
    p.add_argument("--plot", help="draw the stored table to this PNG")
    a = p.parse_args()
    torch.set_grad_enabled(False)
    if a.reach:
        reach(a)
    elif a.dump:
        dump(a)
    elif a.kvpress:
        import_kvpress(a)
    elif a.table or a.plot:
        if a.table:
            from bhqk.evaluate import board

            print(board.table(json.loads(path_of(a.model).read_text())))
        if a.plot:
            plot(a)
    else:
        grade(a)


if __name__ == "__main__":
    main()
