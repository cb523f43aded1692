"""Head-wise KV budgets on SmolLM2-135M-Instruct: which heads to keep full, what it saves, what it costs.

    python benchmarks/budget.py --part scores [--lengths 1024,2048,4096] [--configs ...] --tag T
    flock /tmp/bhqk-cpu.lock python benchmarks/budget.py --part cost --tag T   # also gives ppl
    python benchmarks/budget.py --part ppl --tag T

Parts (each merges its results into ``benchmarks/results/budget-<tag>.json``, with the CPU model and
flags, torch/transformers versions, date and load average):

- ``scores``: plans with half the K/V heads full (sink 64, window 256) chosen by each score of
  ``bhqk.budget.find`` (induction, retrieval, distant), by chance (the same number of full heads,
  seeds 0 and 1), every head streaming, and full attention; each graded on the needle grid
  (``bhqk.evaluate.needle.grid(..., plan=plan)``: generation on ``plan.cache()``), one trial per cell,
  seed 0. ``--configs`` picks some; ``default@0.25`` adds the default score at a quarter full.
- ``cost`` / ``ppl``: at N = 8192 tokens of ``pydoc_data.topics``, one fresh subprocess per
  configuration (full cache, the plan at 0.5 and at 0.25 full, and a full cache at 512 tokens: the
  non-attention floor of a decode step): keys and values held after the prefill
  (``cache.nbytes()``), the prefill's time, the median of ``--steps`` decode steps, the process's
  peak RSS (``ru_maxrss``) over prefill and decode, and the perplexity of the text (teacher-forced:
  the prefill's own logits; streaming heads see sink + window in the prefill). ``hwm_after_load_kib``
  (VmHWM, reset after loading) is the peak to quote: a child's ``ru_maxrss`` starts at its parent's
  RSS at fork. ``--mmap-threshold BYTES`` runs the children with ``MALLOC_MMAP_THRESHOLD_`` (glibc):
  blocks above it are unmapped when freed, so the peak is what was held, not what the allocator
  kept of freed blocks (by default glibc raises the threshold up to 32 MiB as blocks are freed, and
  the heap then keeps freed memory: the peak depends on the order of allocations, ±20 % here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # benchmarks/machine.py: CPU model and flags for every JSON  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCORE_CONFIGS = ["full", "induction", "retrieval", "retrieval-copy", "distant", "random0", "random1", "streaming"]


def load(name: str = "smollm2-135m"):
    from bhqk.models import pretrained

    return pretrained(name)


def default_score() -> str:
    """The score ``bhqk.budget.find`` uses when none is given."""
    import inspect

    from bhqk.budget import find

    return inspect.signature(find).parameters["score"].default


def meta() -> dict:
    import transformers

    return {**machine.describe(), "transformers": transformers.__version__,
            "note": "shared 2-core machine (other agents running): timings are noisy"}


def merge(tag: str, part: str, data: dict) -> Path:
    """Merge ``data`` under ``part`` into budget-<tag>.json (runs of different parts share the file)."""
    path = RESULTS / f"budget-{tag}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old.setdefault("runs", {})[part] = {"meta": meta(), **data}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=1))
    return path


STORED = RESULTS / "budget-scores-2026-12-04.json"  # benchmarks/budget_scores.py's run: kl, fisher, learned per head
# learned20: the same gates trained on to the end of their 20-step schedule (--part learn --resume, another tag)
LEARNED = {"learned": STORED, "learned20": RESULTS / "budget-scores-learn20-2026-12-05.json"}


def stored_scores(name: str, sink: int, window: int) -> torch.Tensor:
    """Per K/V head [L, Hkv] scores of SmolLM2-135M-Instruct kept by benchmarks/budget_scores.py (``STORED``):
    ``kl`` (exact), ``fisher`` (seed 0), ``learned`` (the gates of its run, 10 steps of a 20-step schedule),
    ``learned20`` (the same run to step 20): for the curve, without computing them again (kl alone is 90
    forwards)."""
    if name in LEARNED:
        runs = json.loads(LEARNED[name].read_text())["runs"]  # "learn", or "learn from step N" for a resumed run
        learn = max((r for k, r in runs.items() if k.startswith("learn")), key=lambda r: r["step"])
        if (sink, window) != (64, 256):  # benchmarks/budget_scores.py trains with S = 64, W = 256
            raise SystemExit(f"{LEARNED[name].name} trained sink 64, window 256; asked {sink}, {window}")
        return torch.tensor(learn["gates"])
    runs = json.loads(STORED.read_text())["runs"]
    rank = runs["rank"]
    if (rank["sink"], rank["window"]) != (sink, window):
        raise SystemExit(f"{STORED.name} scored sink {rank['sink']}, window {rank['window']}; asked {sink}, {window}")
    if name == "kl":
        return torch.tensor(rank["kl"])
    if name == "fisher":
        return torch.tensor(rank["scores"]["fisher seed 0"])
    raise SystemExit(f"no stored score {name!r}: kl, fisher, {', '.join(LEARNED)}")


def make_plan(model, tok, name: str, full: float, sink: int, window: int):
    """The plan of configuration ``name`` (``full`` and ``streaming`` are all-True / all-False; ``random<seed>``
    a draw of the heads whose choice matters; ``kl-stored``, ``fisher-stored``, ``learned-stored``: the top
    heads by :func:`stored_scores`)."""
    from bhqk.budget import Plan, find
    from bhqk.budget.plan import model_map

    shape = model_map(model).shape
    L, Hkv = shape.layers, shape.kv_heads
    if name == "full":
        return Plan(torch.ones(L, Hkv, dtype=torch.bool), sink, window, model=shape)
    if name == "streaming":
        return Plan(torch.zeros(L, Hkv, dtype=torch.bool), sink, window, model=shape)
    none = Plan(torch.zeros(L, Hkv, dtype=torch.bool), sink, window, model=shape)
    n = round(full * int((~none.free()).sum()))
    if name.startswith("random") or name.endswith("-stored"):
        if name.startswith("random"):  # a drawn order as scores: the first drawn highest
            g = torch.Generator().manual_seed(int(name[len("random"):]))
            scores = torch.empty(L * Hkv, dtype=torch.float64)  # [L·Hkv]
            scores[torch.randperm(L * Hkv, generator=g)] = -torch.arange(L * Hkv, dtype=torch.float64)
            scores = scores.reshape(L, Hkv)  # [L·Hkv] -> [L, Hkv]
        else:
            scores = stored_scores(name[: -len("-stored")], sink, window).double()  # [L, Hkv]
        return dataclasses.replace(none, scores=scores, score=name).top(n)
    if name == "retrieval-copy":  # retrieval, its ties by copy mass (find's default: by index, earlier layers first)
        return find(model, full=full, sink=sink, window=window, score="retrieval", tokenizer=tok, ties="copy mass")
    return find(model, full=full, sink=sink, window=window, score=name, tokenizer=tok)


# ---- scores: the needle grid per plan ----------------------------------------------------------


def part_scores(a) -> None:
    from bhqk.evaluate import needle

    model, tok = load(a.model)
    lengths = [int(x) for x in a.lengths.split(",")]
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    out: dict = {"lengths": lengths, "depths": depths, "sink": a.sink, "window": a.window, "full": a.full,
                 "configs": {}}
    path = RESULTS / f"budget-{a.tag}.json"
    if path.exists():  # keep configs graded by an earlier run of this part
        out["configs"] = json.loads(path.read_text()).get("runs", {}).get("scores", {}).get("configs", {})
    for name in a.configs.split(","):
        score, _, frac = name.partition("@")
        if score == "default":
            score = default_score()
        full = float(frac) if frac else a.full
        t0 = time.perf_counter()
        plan = make_plan(model, tok, score, full, a.sink, a.window)
        t1 = time.perf_counter()
        res = needle.grid(model, tok, lengths, depths, trials=1, seed=0, plan=plan, progress=False)
        t2 = time.perf_counter()
        per_len = {str(L): sum(e["found"] for e in res.entries if e["length"] == L) for L in lengths}
        out["configs"][name] = {
            "full_heads": int(plan.full.sum()), "kv_heads": plan.full.numel(), "plan": plan.full.int().tolist(),
            "scores": None if plan.scores is None else plan.scores.tolist(),
            "found": sum(e["found"] for e in res.entries), "trials": len(res.entries), "per_length": per_len,
            "missed": [[e["length"], e["depth"], e["answer"]] for e in res.entries if not e["found"]],
            "entries": res.entries, "score_s": round(t1 - t0, 1), "grid_s": round(t2 - t1, 1)}
        print(f"== {name}: {int(plan.full.sum())}/{plan.full.numel()} K/V heads full, scored in {t1 - t0:.1f} s, "
              f"graded in {t2 - t1:.0f} s", flush=True)
        print(res.table(), flush=True)
        merge(a.tag, "scores", out)
    print(scores_table(out))


def scores_table(out: dict) -> str:
    lengths = out["lengths"]
    full = out["configs"].get("full", {}).get("found")
    head = " | ".join(f"N={L}" for L in lengths)
    lines = [f"| plan | full K/V heads | {head} | found | of full | missed (length, depth) |",
             "|---" * (len(lengths) + 5) + "|"]
    for name, c in out["configs"].items():
        n = len(out["depths"])
        cells = " | ".join(f"{c['per_length'][str(L)]}/{n}" for L in lengths)
        rel = f"{c['found'] / full:.2f}" if full else "-"
        missed = ", ".join(f"({m[0]}, {m[1]:g})" for m in c["missed"]) or "none"
        lines.append(f"| {name} | {c['full_heads']}/{c['kv_heads']} | {cells} | {c['found']}/{c['trials']} | {rel} | {missed} |")
    return "\n".join(lines)


# ---- cost and perplexity: one subprocess per configuration -------------------------------------


def child(a) -> None:
    """One configuration in this (fresh) process; prints one JSON line."""
    from transformers import DynamicCache

    from bhqk import corpus
    from bhqk.budget import Plan

    model, tok = load(a.model)
    ids = corpus.chunks(tok, a.n, 1)  # [1, N]: the tokenizer's start of a text, then the text (bhqk.corpus)
    plan = Plan.load(a.plan_file) if a.plan_file else None
    cache = plan.cache(model) if plan is not None else DynamicCache(config=model.config)
    hidden: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda m, i, o: hidden.append(o) if not hidden else None)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:  # reset the peak (VmHWM) so that loading the model does not count (Linux)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    from bhqk.integrations.transformers import cache_keyword

    kw = {cache_keyword(model): cache}  # "cache" from transformers 5.24 on, else "past_key_values"
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
        prefill = time.perf_counter() - t0
        if plan is not None:
            held = cache.nbytes()
        else:
            held = sum(lay.keys.nbytes + lay.values.nbytes for lay in cache.layers)
        nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]
        steps = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            o = model(input_ids=nxt, use_cache=True, **kw)
            steps.append(time.perf_counter() - t0)
            nxt = o.logits[:, -1:].argmax(-1)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
        hwm = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), None)
        hook.remove()
        h = hidden[0][0]  # [N, D]
        nll, count = 0.0, 0
        for s in range(0, h.shape[0] - 1, 1024):
            logits = model.lm_head(h[s : min(s + 1024, h.shape[0] - 1)]).float()  # [c, V]
            target = ids[0, s + 1 : s + 1 + logits.shape[0]]
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += logits.shape[0]
    print(json.dumps({"n": a.n, "prefill_s": prefill, "steps_s": steps, "step_median_s": statistics.median(steps),
                      "kv_bytes": held, "rss_before_kib": rss0, "rss_peak_kib": rss,
                      "hwm_after_load_kib": hwm, "ppl": math.exp(nll / count),
                      "threads": torch.get_num_threads()}))


def part_cost(a) -> None:
    model, tok = load(a.model)
    configs = {"full": None, "plan@0.5": a.full, "plan@0.25": 0.25, "full@512": None}
    default = a.score or default_score()
    out: dict = {"n": a.n, "steps": a.steps, "score": default, "sink": a.sink, "window": a.window, "configs": {}}
    tmp = Path(tempfile.mkdtemp(prefix="budget-bench-"))
    for name in a.configs.split(",") if a.configs != ",".join(SCORE_CONFIGS) else configs:
        frac = configs[name]
        cmd = [sys.executable, __file__, "--child", "--model", a.model, "--n", str(512 if name == "full@512" else a.n),
               "--steps", str(a.steps)]
        if frac is not None:
            plan = make_plan(model, tok, default, frac, a.sink, a.window)
            f = tmp / f"{name}.json"
            plan.save(f)
            cmd += ["--plan-file", str(f)]
            bytes_plan, bytes_full = plan.nbytes(a.n, model)
        env = dict(os.environ)
        if a.mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name}: the child failed")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        if frac is not None:
            res["predicted_bytes"] = [bytes_plan, bytes_full]
        res["loadavg"] = os.getloadavg()
        res["malloc_mmap_threshold"] = a.mmap_threshold
        out["configs"][name] = res
        print(f"{name}: prefill {res['prefill_s']:.2f} s, decode step {1e3 * res['step_median_s']:.1f} ms, "
              f"KV {res['kv_bytes'] / 2**20:.1f} MiB, peak (VmHWM) {res['hwm_after_load_kib'] / 1024:.0f} MiB, "
              f"ppl {res['ppl']:.3f}", flush=True)
        merge(a.tag, "cost", out)
    print(cost_table(out))


def cost_table(out: dict) -> str:
    c = out["configs"]
    full = c.get("full")
    floor = c.get("full@512")
    lines = ["| cache | KV bytes | × full | prefill s | × full | decode step ms | × full | peak (VmHWM) MiB | × full | ppl |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in c.items():
        rel = lambda k, r=r: f"{r[k] / full[k]:.2f}" if full else "-"  # noqa: E731
        lines.append(f"| {name} | {r['kv_bytes'] / 2**20:.1f} MiB | {rel('kv_bytes')} | {r['prefill_s']:.1f} | "
                     f"{rel('prefill_s')} | {1e3 * r['step_median_s']:.0f} | {rel('step_median_s')} | "
                     f"{r['hwm_after_load_kib'] / 1024:.0f} | {rel('hwm_after_load_kib')} | {r['ppl']:.3f} |")
    if full and floor:
        att = full["step_median_s"] - floor["step_median_s"]
        lines.append(f"\nfull decode step {1e3 * full['step_median_s']:.0f} ms = floor at 512 tokens "
                     f"{1e3 * floor['step_median_s']:.0f} ms + {1e3 * att:.0f} ms growing with the context")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["scores", "cost", "ppl"])
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--model", default="smollm2-135m", help="a bhqk.models.pretrained name (default smollm2-135m)")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--configs", default=",".join(SCORE_CONFIGS))
    p.add_argument("--full", type=float, default=0.5)
    p.add_argument("--score", default=None, help="cost: the score of the plan@ rows (default: find's default)")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                   help="run the children with MALLOC_MMAP_THRESHOLD_=BYTES (glibc; e.g. 131072): peaks of what is held")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan-file", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
    elif a.part == "scores":
        part_scores(a)
    elif a.part in ("cost", "ppl"):
        part_cost(a)  # one pass gives both: the perplexity is the prefill's
    else:
        p.error("give --part scores, cost or ppl")


if __name__ == "__main__":
    main()
