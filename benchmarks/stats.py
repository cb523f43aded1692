"""Attention statistics of every layer and head against a plain forward (and against ``eager`` with
``output_attentions`` where it fits), on a Llama-shaped model with random weights (transformers'
LlamaConfig built here, ``attn_implementation="bhqk"``, causal, GQA).

Per N: the plain forward (bhqk, backend auto); the same forward inside ``bhqk.capture(model=...,
what=("entropy", "distance", "sink", "received"), offsets=(1,), window=8)`` (every statistic of
every layer and head, the head table included); PyTorch's ``sdpa`` forward; ``eager`` +
``output_attentions`` up to ``--eager-max``. Time: the best of ``--repeat`` runs; peak: the
resident-set high-water mark above the start of the call (glibc made to unmap freed blocks, see
peak_memory.py). Each N runs in a fresh process.

    flock /tmp/bhqk-cpu.lock python benchmarks/stats.py --N 4096 8192 --out benchmarks/results/stats.json
    python benchmarks/stats.py --quick       # small widths, N = 512 and 1024: a smoke run
    python benchmarks/stats.py --N 8192 --repeat 3 --threads 1   # times: the thread's CPU time (a shared machine)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import hf  # benchmarks/hf.py: the random Hugging Face models
import machine  # benchmarks/machine.py: CPU model and flags for every JSON
import peak_memory  # benchmarks/peak_memory.py: resident-set peaks

HERE = Path(__file__).resolve().parent
SHAPE = {"hidden": 512, "heads": 8, "kv_heads": 2, "head_dim": 64, "intermediate": 1376, "layers": 2, "vocab": 1000}
QUICK = {"hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32, "intermediate": 256, "layers": 2, "vocab": 1000}
WHAT = ("entropy", "distance", "sink", "received")


def build(c: dict, N: int):
    """The Llama-shaped model with random weights on ``attn_implementation="bhqk"`` (hf.py builds it)."""
    return hf.build("dense", "bhqk", {**c, "N": N, "capture_N": 0}).eval()


def timed(fn, repeat: int, clock=time.perf_counter) -> tuple[float, int]:
    """(best seconds on ``clock``, peak bytes above the start of the first run)."""
    best, peak = float("inf"), 0
    for i in range(repeat):
        with peak_memory.Peak("cpu") as p:
            t0 = clock()
            fn()
            dt = clock() - t0
        best = min(best, dt)
        if i == 0:
            peak = p.bytes
    return best, peak


def child(spec: dict) -> dict:
    import bhqk

    peak_memory.exact_cpu_peaks()
    torch.set_grad_enabled(False)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter  # 1 thread: its CPU time
    c, N, repeat = spec["shape"], spec["N"], spec["repeat"]
    model = build(c, N)
    ids = torch.randint(0, c["vocab"], (1, N), generator=torch.Generator().manual_seed(0))
    model(ids[:, :256])  # warm-up (auto's costs, kernels)
    out: dict = {"N": N}
    stats_box: dict = {}

    def with_stats():
        with bhqk.capture(model=model, what=WHAT, offsets=(1,), window=8) as cap:
            model(ids)
        stats_box["table"] = cap.head_table((0,))
        stats_box["backends"] = sorted({r.backend for r in cap.records})
        stats_box["records"] = len(cap.records)

    out["forward_s"], out["forward_peak"] = timed(lambda: model(ids), repeat, clock)
    out["stats_s"], out["stats_peak"] = timed(with_stats, repeat, clock)
    out["clock"] = "thread CPU" if clock is time.thread_time else "wall"
    out["backends"], out["records"] = stats_box["backends"], stats_box["records"]
    t = stats_box["table"]
    out["mean_entropy"] = float(t["entropy"].nanmean())
    if N <= spec["sdpa_max"]:
        model.set_attn_implementation("sdpa")
        out["sdpa_s"], out["sdpa_peak"] = timed(lambda: model(ids), repeat, clock)
    if N <= spec["eager_max"]:
        model.set_attn_implementation("eager")
        out["eager_s"], out["eager_peak"] = timed(lambda: model(ids, output_attentions=True), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--eager-max", type=int, default=4096, help="largest N for eager + output_attentions")
    ap.add_argument("--sdpa-max", type=int, default=8192)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1: times are the thread's CPU time)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    shape = QUICK if a.quick else SHAPE
    Ns = [512, 1024] if a.quick else a.N
    rows = []
    for N in Ns:
        spec = {"shape": shape, "N": N, "repeat": 1 if N > 8192 else a.repeat, "eager_max": a.eager_max,
                "sdpa_max": a.sdpa_max, "threads": a.threads}
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        if r.returncode != 0:
            rows.append({"N": N, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]})
        else:
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(line(rows[-1]), flush=True)
    info = {"benchmark": "stats", "command": " ".join(sys.argv), "machine": machine.describe(), "shape": shape,
            "what": list(WHAT) + ["offset 1", "local (window 8)"], "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(info, indent=1))
        print(f"wrote {a.out}")


def line(r: dict) -> str:
    if "error" in r:
        return f"N={r['N']}: failed: {r['error']}"
    mib = 1 / 2**20
    s = (f"N={r['N']:6d}  forward {r['forward_s']:7.2f} s {r['forward_peak'] * mib:7.0f} MiB | statistics "
         f"{r['stats_s']:7.2f} s {r['stats_peak'] * mib:7.0f} MiB  ({r['stats_s'] / r['forward_s']:.2f}x, "
         f"+{(r['stats_peak'] - r['forward_peak']) * mib:.0f} MiB; {','.join(r['backends'])})")
    if "sdpa_s" in r:
        s += f" | sdpa {r['sdpa_s']:.2f} s {r['sdpa_peak'] * mib:.0f} MiB"
    if "eager_s" in r:
        s += f" | eager+output_attentions {r['eager_s']:.2f} s {r['eager_peak'] * mib:.0f} MiB"
    return s


if __name__ == "__main__":
    main()
