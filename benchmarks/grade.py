"""Grading KV budget plans on SmolLM2-135M-Instruct with intervals: the RULER-style tasks of
``bhqk.evaluate.tasks`` and the KL divergence / perplexity of ``bhqk.evaluate.grade``.

    python benchmarks/grade.py --part tasks --tasks needle,multikey,multivalue --lengths 1024,2048,4096 \\
        --trials 20 --configs full,streaming,default@0.25,random0@0.25 --tag T
    python benchmarks/grade.py --part kl --lengths 4096 --chunks 8 --configs full,streaming,default@0.25,random0@0.25 --tag T
    python benchmarks/grade.py --part cost --lengths 1024,2048,4096 --repeats 3 --tag T   # one trial's seconds
    python benchmarks/grade.py --part table --tag T                                        # the tables again
    python benchmarks/grade.py --part import --replies benchmarks/results/hf-quantized-T.json --tag T

Configurations (sink ``--sink``, window ``--window``): ``full`` (the model as it is), ``streaming`` (every
K/V head sink + window), ``<score>@<fraction>`` (``bhqk.budget.find(full=fraction, score=...)``;
``default`` is find's default score), ``random<seed>@<fraction>`` (that many K/V heads drawn at random);
any of them but ``full`` with ``+bits8`` or ``+bits4`` (``fisher-stored@0.25+bits4``): that plan's cache with
its full heads' keys and values quantized (``plan.cache(model, bits=b)``: group 32, a float window of 64), and
``bits8`` / ``bits4`` alone: every head full, quantized (the all-full plan with ``bits``).
Every configuration answers the same prompts (seeded: ``--seed``), so differences are paired.

``--part import --replies FILE ...``: graded replies made elsewhere, added to the tag's groups after checking
that they answered the same prompts, so the table pairs them with the rest: another library's caches
(benchmarks/hf_quantized.py's JSON: Hugging Face's ``QuantizedCache``) as configurations ``hf:<name>``, each
reply scored again by ``Prompt.score``; or another tag's run of this script (``grade-<tag>.json``: configurations
graded in parallel processes, or an earlier run such as the curve's), under their own names; ``--only`` picks
configurations. A tag without a run starts from the groups and prompts of the first such file.

Results merge into ``benchmarks/results/grade-<tag>.json`` (CPU model and flags, versions, load average,
the plans' full heads). ``tasks`` writes after each (task, length) group and skips the groups already
there, so an interrupted run resumes; configurations added to a tag's run grade only themselves, on the
same prompts (``tasks``) and chunks (``kl``, merged against the stored reference), so they pair with the rest.
``cost`` times whole trials of full attention (prefill + the
reply's decoding, median of ``--repeats``) with nothing else of this script running.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget as budget_bench  # benchmarks/budget.py: make_plan, default_score  # noqa: E402
import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def path_of(tag: str) -> Path:
    return RESULTS / f"grade-{tag}.json"


def load_results(tag: str) -> dict:
    p = path_of(tag)
    return json.loads(p.read_text()) if p.exists() else {}


def save_results(tag: str, data: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = path_of(tag).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path_of(tag))


def meta() -> dict:
    import transformers

    return {**machine.describe(), "transformers": transformers.__version__,
            "note": "shared 2-core machine (other agents running): timings are noisy"}


def plans_of(model, tok, names: list[str], sink: int, window: int) -> dict:
    """name -> None (full) or a Plan (``…+bits<b>``, ``bits<b>``: quantized; module doc)."""
    out: dict = {}
    for name in names:
        if name == "full":
            out[name] = None
            continue
        base, _, bits = name.partition("+bits")
        if base.startswith("bits") and not bits:  # bits8: every head full, quantized
            base, bits = "full", base[len("bits"):]
        score, _, frac = base.partition("@")
        if score == "default":
            score = budget_bench.default_score()
        plan = budget_bench.make_plan(model, tok, score, float(frac or (1.0 if score == "full" else 0.0)), sink, window)
        out[name] = dataclasses.replace(plan, bits=int(bits)) if bits else plan
    return out


def describe_plans(plans: dict) -> dict:
    return {name: None if p is None else {"full_heads": int(p.full.sum()), "kv_heads": p.full.numel(),
                                          "score": p.score, "plan": p.full.int().tolist(),
                                          "bits": p.bits}
            for name, p in plans.items()}


def part_import(a) -> None:
    """Graded replies from elsewhere into the tag's groups (module doc): another library's (benchmarks/hf_quantized.py's
    JSON, as ``hf:<name>``) or another tag's run of this script on the same prompts (its configurations, as named)."""
    from bhqk.evaluate import tasks
    from bhqk.models import pretrained

    data = load_results(a.tag)
    run = data.get("tasks")
    if not run:  # a new tag: the groups and prompts of the first run of this script among the files, no entries
        first = next((json.loads(p.read_text())["tasks"] for p in a.replies
                      if "groups" in json.loads(p.read_text()).get("tasks", {})), None)
        if first is None:
            raise SystemExit(f"{path_of(a.tag).name} has no graded tasks: grade bhqk's configurations first")
        run = data["tasks"] = {"configs": [], "sink": first["sink"], "window": first["window"], "seed": first["seed"],
                               "plans": {}, "meta": [meta()],
                               "groups": {k: {**{f: g[f] for f in ("task", "length", "trials", "prompts")}, "entries": {}}
                                          for k, g in first["groups"].items()}}
    only = set(a.only.split(",")) if a.only else None
    _, tok = pretrained(a.model)
    made = {key: [tasks.make(tok, g["task"], g["length"], t, run["seed"]) for t in range(g["trials"])]
            for key, g in run["groups"].items()}
    for key, g in run["groups"].items():
        if [p.to_json() for p in made[key]] != g["prompts"]:
            raise SystemExit(f"{key}: the stored prompts are not those the seed makes now")
    for path in a.replies:
        src = json.loads(path.read_text())
        new = []
        if "groups" in src.get("tasks", {}):  # a run of this script
            other = src["tasks"]
            if (other["sink"], other["window"], other["seed"]) != (run["sink"], run["window"], run["seed"]):
                raise SystemExit(f"{path}: graded with another sink, window or seed than {path_of(a.tag).name}")
            for name in other["configs"]:
                if name in run["configs"] or (only is not None and name not in only):
                    continue
                for key, g in run["groups"].items():
                    o = other["groups"].get(key)
                    if o is None or o["prompts"] != g["prompts"] or name not in o["entries"]:
                        raise SystemExit(f"{key}: {path} did not grade {name} on {path_of(a.tag).name}'s prompts")
                    g["entries"][name] = o["entries"][name]
                run["plans"][name] = other["plans"].get(name)
                new.append(name)
        else:  # benchmarks/hf_quantized.py's replies
            got = src["tasks"]
            by_group: dict = {}
            for i, p in enumerate(got["prompts"]):
                by_group.setdefault(f"{p['task']}@{p['length']}", []).append(i)
            if set(by_group) != set(run["groups"]):
                raise SystemExit(f"{path} answers the groups {sorted(by_group)}, {path_of(a.tag).name} {sorted(run['groups'])}")
            for name, entries in got["entries"].items():
                cname = f"hf:{name}"
                if cname in run["configs"] or (only is not None and cname not in only):
                    continue
                if len(entries) != len(got["prompts"]):
                    print(f"{path}: {name} answered {len(entries)} of {len(got['prompts'])} prompts: not imported")
                    continue
                for key, idx in by_group.items():
                    g = run["groups"][key]
                    if [got["prompts"][i] for i in idx] != g["prompts"]:
                        raise SystemExit(f"{key}: the replies in {path} answer other prompts than {path_of(a.tag).name}'s")
                    rows = [dict(entries[i]) for i in idx]
                    for r, p in zip(rows, made[key]):  # bhqk's rule, again, on the reply as decoded there
                        r["correct"] = p.score(r["reply"])
                    g["entries"][cname] = rows
                new.append(cname)
        run["configs"] = list(dict.fromkeys(run["configs"] + new))
        run.setdefault("imported", []).append({"from": str(path), "configs": new, "meta": meta(),
                                               "source_runs": src.get("runs", src.get("tasks", {}).get("meta", []))})
        print(f"imported {', '.join(new) or 'nothing new'} from {path}", flush=True)
    save_results(a.tag, data)
    print(tasks_table(data))


def part_tasks(a) -> None:
    from bhqk.evaluate import grade, tasks
    from bhqk.models import pretrained

    model, tok = pretrained(a.model)
    names = a.configs.split(",")
    plans = plans_of(model, tok, names, a.sink, a.window)
    data = load_results(a.tag)
    run = data.setdefault("tasks", {"groups": {}})
    if run.get("configs") and (run["sink"], run["window"], run["seed"]) != (a.sink, a.window, a.seed):
        raise SystemExit(f"{path_of(a.tag).name} was graded with sink, window, seed {run['sink']}, {run['window']}, "
                         f"{run['seed']}: use another --tag")
    run.update({"configs": list(dict.fromkeys(run.get("configs", []) + names)), "sink": a.sink, "window": a.window,
                "seed": a.seed, "plans": {**run.get("plans", {}), **describe_plans(plans)}})
    run.setdefault("meta", []).append(meta())
    for task in a.tasks.split(","):
        for L in [int(x) for x in a.lengths.split(",")]:
            key = f"{task}@{L}"
            old = run["groups"].get(key)
            new = [n for n in names if old and n not in old["entries"]]
            if new:  # configurations added to a graded group: the same prompts (seeded), these configurations only
                assert old is not None
                prompts = [tasks.make(tok, task, L, i, a.seed) for i in range(old["trials"])]
                if [p.to_json() for p in prompts] != old["prompts"]:
                    raise SystemExit(f"{key}: the stored prompts are not those the seed makes now: use another --tag")
                t0 = time.perf_counter()
                g = grade.grade(model, tok, prompts, {n: plans[n] for n in new}, progress=False)
                old["entries"].update({n: g.entries[n] for n in new})
                old.setdefault("added", []).append({"configs": new, "meta": meta(),
                                                    "seconds": time.perf_counter() - t0})
                save_results(a.tag, data)
                print(f"== {key}: added {', '.join(new)} on its {old['trials']} trials "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            done = old["trials"] if old else 0
            if done >= a.trials:
                print(f"== {key}: already graded ({done} trials)", flush=True)
                continue
            prompts = [tasks.make(tok, task, L, i, a.seed) for i in range(done, a.trials)]  # the trials not yet graded
            t0 = time.perf_counter()
            g = grade.grade(model, tok, prompts, plans, progress=False)
            if old is None:
                old = run["groups"][key] = {"task": task, "length": L, "trials": 0, "seconds": 0.0, "loadavg": [],
                                            "prompts": [], "entries": {n: [] for n in names}}
            old["trials"] = a.trials
            old["seconds"] += time.perf_counter() - t0
            old["loadavg"].append(os.getloadavg())
            old["prompts"] += [p.to_json() for p in prompts]
            for n in names:
                old["entries"][n] = old["entries"][n] + g.entries[n]
            save_results(a.tag, data)
            print(f"== {key}: trials {done}…{a.trials - 1} ({time.perf_counter() - t0:.0f} s, load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
            print(g.table(), flush=True)
    print(tasks_table(data))


def grades_of(data: dict, task: str | None = None) -> object:
    """The Grades of every stored group (of ``task``), prompts in (task, length, trial) order."""
    from bhqk.evaluate import grade, tasks

    run = data["tasks"]
    names = run["configs"]
    prompts, entries = [], {n: [] for n in names}
    for g in run["groups"].values():
        if task is not None and g["task"] != task:
            continue
        if not all(n in g["entries"] for n in names):
            continue
        for i, p in enumerate(g["prompts"]):
            prompts.append(tasks.Prompt(p["task"], p["length"], p["trial"], p["seed"], [], tuple(p["answer"]),
                                        tuple(p["distractors"]), (), tuple(p["at"])))
            for n in names:
                entries[n].append(g["entries"][n][i])
    return grade.Grades(prompts, entries)


def tasks_table(data: dict) -> str:
    """Per task and length: each configuration's accuracy [Wilson 95 %]; per task: the paired difference
    from full [Newcombe 95 %] and McNemar's p (markdown)."""
    g = grades_of(data)
    names = g.names
    lines = ["| task | length | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for t, L in g.groups():
        cells = []
        for n in names:
            k, m, lo, hi = g.accuracy(n, t, L)
            cells.append(f"{k}/{m} = {k / m:.2f} [{lo:.2f}, {hi:.2f}]")
        lines.append(f"| {t or 'all'} | {'all' if L is None else L} | " + " | ".join(cells) + " |")
    ref = names[0]
    lines += ["", "| task | " + " | ".join(f"{n} − {ref}" for n in names[1:]) + " |", "|---|" + "---|" * (len(names) - 1)]
    for t, L in g.groups():
        if L is not None:
            continue
        lines.append(f"| {t or 'all'} | " + " | ".join(
            f"{d.diff:+.2f} [{d.lo:+.2f}, {d.hi:+.2f}], {d.x_only}:{d.y_only}, p={d.p:.2g}"
            for d in (g.difference(n, ref, t) for n in names[1:])) + " |")
    return "\n".join(lines)


def part_kl(a) -> None:
    from bhqk.evaluate import grade
    from bhqk.models import pretrained

    model, tok = pretrained(a.model)
    names = a.configs.split(",")
    plans = plans_of(model, tok, names, a.sink, a.window)
    data = load_results(a.tag)
    chunks = [int(x) for x in a.chunks.split(",")]
    for L, C in zip([int(x) for x in a.lengths.split(",")], chunks * 8):
        t0 = time.perf_counter()
        old = data.get("kl", {}).get(str(L))
        if old and (len(old["reference_nll"]), old["seed"]) == (C, a.seed) and not set(names) <= set(old["kl"]):
            # configurations added to a stored run: only these, on the same chunks, merged against its reference
            new = {n: p for n, p in plans.items() if n not in old["kl"]}
            d = grade.divergence(model, tok, new, L, C, seed=a.seed, progress=False)
            if d.start != old["start"]:
                raise SystemExit(f"KL at {L}: the added plans start at {d.start}, the stored run at {old['start']}")
            d = grade.Divergence(L, old["start"], {**old["kl"], **d.kl}, {**old["nll"], **d.nll},
                                 old["reference_nll"], old["draws"], a.seed)
            added = old.get("added", []) + [{"configs": list(new), "meta": meta(), "seconds": time.perf_counter() - t0}]
            data["kl"][str(L)] = {**old, **d.to_json(), "added": added,
                                  "plans": {**old["plans"], **describe_plans(new)}}
        else:
            d = grade.divergence(model, tok, plans, L, C, seed=a.seed, progress=False)
            data.setdefault("kl", {})[str(L)] = {**d.to_json(), "meta": meta(), "seconds": time.perf_counter() - t0,
                                                 "loadavg_end": os.getloadavg(), "plans": describe_plans(plans)}
        save_results(a.tag, data)
        print(f"== KL at {L} ({time.perf_counter() - t0:.0f} s)\n{d.table()}", flush=True)


def kl_table(data: dict) -> str:
    lines = ["| length | chunks | config | KL (nats/token) | perplexity | × full |", "|---|---|---|---|---|---|"]
    for L, r in data.get("kl", {}).items():
        for name, s in r["summary"].items():
            if not isinstance(s, dict):
                continue
            lines.append(f"| {L} | {len(r['reference_nll'])} | {name} | {s['kl']:.4f} [{s['kl_ci'][0]:.4f}, "
                         f"{s['kl_ci'][1]:.4f}] | {s['ppl']:.3f} [{s['ppl_ci'][0]:.3f}, {s['ppl_ci'][1]:.3f}] | "
                         f"{s['ppl_ratio']:.4f} [{s['ppl_ratio_ci'][0]:.4f}, {s['ppl_ratio_ci'][1]:.4f}] |")
    return "\n".join(lines)


def part_cost(a) -> None:
    """One trial of each task at each length on full attention, ``--repeats`` times: prefill and reply seconds."""
    from bhqk.evaluate import grade, tasks
    from bhqk.models import pretrained

    model, tok = pretrained(a.model)
    data = load_results(a.tag)
    out: dict = {"meta": meta(), "rows": {}}
    for L in [int(x) for x in a.lengths.split(",")]:
        for task in a.tasks.split(","):
            p = tasks.make(tok, task, L, 0, a.seed)
            es = [grade.reply(model, tok, p) for _ in range(a.repeats)]
            row = {"prefill_s": [e["prefill_s"] for e in es], "decode_s": [e["decode_s"] for e in es],
                   "new_tokens": es[0]["new_tokens"], "loadavg": os.getloadavg()}
            out["rows"][f"{task}@{L}"] = row
            print(f"{task} at {L}: prefill {statistics.median(row['prefill_s']):.2f} s, reply "
                  f"{statistics.median(row['decode_s']):.2f} s ({row['new_tokens']} tokens), load {row['loadavg'][0]:.1f}",
                  flush=True)
    out["meta"]["loadavg_end"] = os.getloadavg()
    data.setdefault("cost", []).append(out)
    save_results(a.tag, data)
    print(cost_table(data))


def cost_table(data: dict) -> str:
    lines = ["| trial | prefill s (median, range) | reply s (median, range) | reply tokens | load |", "|---|---|---|---|---|"]
    for run in data.get("cost", []):
        for key, r in run["rows"].items():
            p, d = r["prefill_s"], r["decode_s"]
            lines.append(f"| {key} | {statistics.median(p):.2f} ({min(p):.2f}–{max(p):.2f}) | {statistics.median(d):.2f} "
                         f"({min(d):.2f}–{max(d):.2f}) | {r['new_tokens']} | {r['loadavg'][0]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["tasks", "kl", "cost", "table", "import"], required=True)
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--model", default="smollm2-135m", help="a bhqk.models.pretrained name (default smollm2-135m)")
    p.add_argument("--tasks", default="needle,multikey,multivalue")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--configs", default="full,streaming,default@0.25,random0@0.25")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunks", default="8", help="text chunks per --lengths value (kl), comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replies", type=Path, nargs="+", help="import: benchmarks/hf_quantized.py's JSON, or another "
                   "tag's grade-<tag>.json graded on the same prompts")
    p.add_argument("--only", help="import: only these configurations (comma-separated; hf:<name> for another library's)")
    a = p.parse_args()
    torch.set_grad_enabled(False)
    if a.part == "tasks":
        part_tasks(a)
    elif a.part == "kl":
        part_kl(a)
    elif a.part == "cost":
        part_cost(a)
    elif a.part == "import":
        part_import(a)
    else:
        data = load_results(a.tag)
        for name, f in (("tasks", tasks_table), ("kl", kl_table), ("cost", cost_table)):
            if data.get(name):
                print(f(data), "\n")


if __name__ == "__main__":
    main()
