"""Speed at the real model's length: SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 KV heads,
d = 64) at N = 8192 tokens of pydoc prose, side by side in one process:

- prefill (one forward over N tokens, last position's logits) on ``attn_implementation="bhqk"`` and
  on ``"sdpa"``, interleaved run by run (target: bhqk ≤ 1.0× sdpa);
- one decode step after N tokens of context (the bhqk prefill's KV cache, cropped back after each
  step), bhqk vs sdpa;
- every statistic of every layer and head at N (``bhqk.capture(what=("entropy", "distance", "sink",
  "received"), offsets=(1,), window=8)`` and the head table) against the plain bhqk forward
  (targets: ≤ 3× its time, ≤ 512 MiB more peak memory).

Times: best and median wall-clock and the process's CPU time over ``--repeat`` runs. Peak: the
resident-set high-water mark above the start of each run (glibc made to unmap freed blocks;
benchmarks/peak_memory.py). The machine is shared: wall times swing with the others' load; the
ratios of runs interleaved in one process are the figures to quote.

    flock /tmp/bhqk-cpu.lock python benchmarks/real_speed.py --out benchmarks/results/real_speed.json
    python benchmarks/real_speed.py --N 1024 --repeat 1    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import machine  # benchmarks/machine.py: CPU model and flags for every JSON
import peak_memory  # benchmarks/peak_memory.py: resident-set peaks
import real_heads  # benchmarks/real_heads.py: the model and the pydoc text

WHAT = ("entropy", "distance", "sink", "received")


def measure(fn, repeat: int) -> dict:
    """Wall (best, median), CPU seconds (median) and peak bytes (the largest) of ``repeat`` runs."""
    wall, cpu, peak = [], [], 0
    for _ in range(repeat):
        with peak_memory.Peak("cpu") as p:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        peak = max(peak, p.bytes)
    return {"best_s": min(wall), "median_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "peak_bytes": peak, "runs_s": [round(w, 3) for w in wall]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each prefill")
    ap.add_argument("--stats-repeat", type=int, default=1, help="runs of the statistics forward")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per implementation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU time is the work done)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None, help="also write the head table of the statistics run")
    a = ap.parse_args()
    import bhqk

    peak_memory.exact_cpu_peaks()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    info: dict = {"benchmark": "real_speed", "machine": machine.describe(), "N": a.N, "threads": a.threads,
                  "repeat": a.repeat, "note": "shared 2-core machine: other agents were running (noisy)"}
    model, tok = real_heads.load_model()
    ids = real_heads.pydoc_ids(tok, a.N)  # [1, N]
    for impl in ("bhqk", "sdpa"):  # warm-up: kernels, auto's costs
        model.set_attn_implementation(impl)
        real_heads.forward(model, ids[:, :256])
    print(f"{machine.one_line(info['machine'])}, {a.threads} thread(s); SmolLM2-135M at N={a.N}", flush=True)

    # prefill, interleaved (with the KV cache, as generate() runs it; bhqk's last cache serves the decode steps)
    runs: dict[str, list[dict]] = {"bhqk": [], "sdpa": []}
    box: dict = {}

    def prefill():
        box["cache"] = model(ids, use_cache=True, logits_to_keep=1).past_key_values

    for _ in range(a.repeat):
        for impl in ("bhqk", "sdpa"):
            model.set_attn_implementation(impl)
            box.pop("cache", None)
            runs[impl].append(measure(prefill, 1))
            if impl == "bhqk":
                cache = box["cache"]
            print(f"  prefill {impl}: {runs[impl][-1]['best_s']:.1f} s", flush=True)
    box.pop("cache", None)
    for impl, rs in runs.items():
        info[f"prefill_{impl}"] = {"best_s": min(r["best_s"] for r in rs),
                                   "median_s": statistics.median(r["best_s"] for r in rs),
                                   "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                                   "peak_bytes": max(r["peak_bytes"] for r in rs), "runs_s": [r["best_s"] for r in rs]}

    # statistics of every layer and head, on bhqk
    model.set_attn_implementation("bhqk")

    def with_stats():
        with bhqk.capture(model=model, what=WHAT, offsets=(1,), window=8) as cap:
            model(ids, use_cache=True, logits_to_keep=1)  # as the timed prefill runs
        box["table"] = cap.head_table((0,))
        box["backends"] = sorted({r.backend for r in cap.records})

    info["stats"] = measure(with_stats, a.stats_repeat)
    info["stats"]["backends"] = box["backends"]
    print(f"  statistics: {info['stats']['best_s']:.1f} s", flush=True)
    if a.table:
        a.table.parent.mkdir(parents=True, exist_ok=True)
        a.table.write_text(json.dumps({"N": a.N, "machine": info["machine"], **box["table"].to_dict()}))

    # one decode step after N tokens of context (the bhqk prefill's cache, cropped back after each step)
    nxt = ids[:, -1:]  # [1, 1]
    pos = torch.tensor([[a.N]])
    steps: dict[str, list[float]] = {"bhqk": [], "sdpa": []}
    cpus: dict[str, list[float]] = {"bhqk": [], "sdpa": []}
    for i in range(a.steps + 1):
        for impl in ("bhqk", "sdpa"):
            model.set_attn_implementation(impl)
            c0, t0 = time.process_time(), time.perf_counter()
            model(nxt, past_key_values=cache, position_ids=pos, use_cache=True)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            cache.crop(-1)  # back to N tokens
            if i:  # the first step of each warms up
                steps[impl].append(dt)
                cpus[impl].append(dc)
    for impl in ("bhqk", "sdpa"):
        info[f"decode_{impl}"] = {"best_s": min(steps[impl]), "median_s": statistics.median(steps[impl]),
                                  "cpu_s": statistics.median(cpus[impl]), "steps": len(steps[impl])}

    pb, ps, st = info["prefill_bhqk"], info["prefill_sdpa"], info["stats"]
    db, ds = info["decode_bhqk"], info["decode_sdpa"]
    mib = 1 / 2**20
    info["ratios"] = {"prefill_bhqk_over_sdpa": pb["best_s"] / ps["best_s"],
                      "prefill_bhqk_over_sdpa_cpu": pb["cpu_s"] / ps["cpu_s"],
                      "decode_bhqk_over_sdpa": db["median_s"] / ds["median_s"],
                      "stats_over_forward": st["best_s"] / pb["best_s"],
                      "stats_over_forward_cpu": st["cpu_s"] / pb["cpu_s"],
                      "stats_extra_peak_mib": (st["peak_bytes"] - pb["peak_bytes"]) * mib}
    r = info["ratios"]
    rows = [
        (f"prefill N={a.N}", f"{pb['best_s']:.2f} s ({pb['cpu_s']:.1f} cpu)", f"{ps['best_s']:.2f} s ({ps['cpu_s']:.1f} cpu)",
         f"{r['prefill_bhqk_over_sdpa']:.2f}× (cpu {r['prefill_bhqk_over_sdpa_cpu']:.2f}×)"),
        (f"decode step after {a.N}", f"{db['median_s'] * 1e3:.0f} ms", f"{ds['median_s'] * 1e3:.0f} ms",
         f"{r['decode_bhqk_over_sdpa']:.2f}×"),
        ("all statistics, every head", f"{st['best_s']:.2f} s ({st['cpu_s']:.1f} cpu)", "",
         f"{r['stats_over_forward']:.2f}× the bhqk prefill (cpu {r['stats_over_forward_cpu']:.2f}×)"),
        ("peak RSS growth", f"prefill {pb['peak_bytes'] * mib:.0f} MiB, statistics {st['peak_bytes'] * mib:.0f} MiB",
         f"prefill {ps['peak_bytes'] * mib:.0f} MiB", f"statistics +{r['stats_extra_peak_mib']:.0f} MiB"),
    ]
    from bhqk.text import table

    print(table(["", "bhqk", "sdpa", "ratio"], [list(x) for x in rows]))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(info, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
