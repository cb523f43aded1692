#!/usr/bin/env python
"""Where a decode step's time goes, on ``auto`` against SDPA called directly.

1. One decode-step call (q [1, 12, 1, 64], k/v [1, 4, 512, 64]: GQA 12/4, ``causal("bottom_right")``,
   no grad) on 1 and 2 threads: ``F.scaled_dot_product_attention`` as a caller writes it
   (``enable_gqa=True``), the same computation as bhqk runs it (each K/V head's 3 query heads as 3
   queries of one call: ``sdpa packed``), ``bhqk.attention`` on ``auto`` and on ``backend="torch"``;
   the functions interleaved round by round, medians of the per-round ratios with their range.
   Then the Python frames of ``auto`` (``cProfile``: calls per attention call, their share of the
   profiled time) and the torch ops of each function (``torch.profiler``: ops per call, self CPU µs).
2. One decode step of SmolLM2-135M (``bhqk.models.pretrained("smollm2-135m")``: 30 layers, H = 9,
   Hkv = 3, d = 64) after N tokens of pydoc prose (N = 512 and 4096): the model on one token with its
   KV cache, ``attn_implementation="bhqk"`` against ``"sdpa"`` and two floors no Python can beat by
   much: ``packed`` (an attention function that only runs the packed SDPA call) and ``packed+check``
   (the same after bhqk's one data check, NaN/inf in q). Every implementation steps its own copy of
   one prefilled cache, in turn (the order reversed every step), so step i of each sees the same
   length; the per-step ratio to ``"sdpa"`` (median, interquartile range) and the difference per
   layer. Then the torch ops per step (``torch.profiler``) and the Python calls per step of bhqk's
   attention function and mask builder (``cProfile``).

Time: CPU time of the calling thread with 1 torch thread (other jobs on a shared machine take wall
time, not this), wall time with 2. Every figure names its command; the JSON records the CPU model
and flags, the load average at start and end, and every sample.

    python benchmarks/decode_profile.py --out benchmarks/results/decode-profile.json   # ~6 min on 2 cores
    python benchmarks/decode_profile.py --parts call --threads 1 2                     # the call alone (~1 min)
    python benchmarks/decode_profile.py --parts model --lengths 512 --steps 16        # a smoke run of part 2
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import math
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bhqk  # noqa: E402
import machine  # noqa: E402  # benchmarks/machine.py: CPU model and flags for every JSON
import overhead  # noqa: E402  # benchmarks/overhead.py: the interleaved timing of per-call figures
from bhqk import masks  # noqa: E402

HERE = Path(__file__).resolve().parent


def clock(threads: int):
    """The clock of a figure: the calling thread's CPU time on 1 thread, wall time on more."""
    return time.thread_time if threads == 1 else time.perf_counter


def spread(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median": statistics.median(s), "q1": s[len(s) // 4], "q3": s[(3 * len(s)) // 4], "min": s[0], "max": s[-1]}


# ---- 1. one decode-step call ------------------------------------------------------------------------


def call_functions(K: int = 512) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 12, 64, generator=g).transpose(1, 2)  # [B, Q, H, d] -> [B, H, Q, d], as a layer makes it
    k, v = torch.randn(1, 4, K, 64, generator=g), torch.randn(1, 4, K, 64, generator=g)
    m = masks.causal("bottom_right")
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),  # [1, 12, 1, 64]
        "sdpa packed": lambda: F.scaled_dot_product_attention(q.reshape(1, 4, 3, 64), k, v).reshape(1, 12, 1, 64),
        "auto": lambda: bhqk.attention(q, k, v, m),
        "torch": lambda: bhqk.attention(q, k, v, m, backend="torch"),
    }
    torch.testing.assert_close(fns["auto"](), fns["sdpa"]())  # the same answer
    return fns


def time_call(fns: dict, threads: int, rounds: int, calls: int) -> dict:
    torch.set_num_threads(threads)
    row = overhead.interleaved(f"decode step, {threads} thread(s)", fns, rounds, calls, clock(threads))
    per = row["rounds_us"]
    row.update(threads=threads, clock="thread CPU" if threads == 1 else "wall",
               over_sdpa={n: spread([a / b for a, b in zip(per[n], per["sdpa"])]) for n in fns},
               over_sdpa_packed={n: spread([a / b for a, b in zip(per[n], per["sdpa packed"])]) for n in fns})
    return row


def frames(fn, calls: int) -> list[dict]:
    """cProfile of ``calls`` calls: each function's calls per call of ``fn`` and share of the profiled time."""
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    rows = [{"function": f"{Path(f).name}:{line}({name})" if f != "~" else name, "per_call": v[1] / calls,
             "share": v[2] / total} for (f, line, name), v in stats.items()]
    return sorted(rows, key=lambda r: -r["share"])


def ops(fn, calls: int) -> list[dict]:
    """torch.profiler of ``calls`` calls: each op's count and self CPU µs per call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    rows = [{"op": e.key, "per_call": e.count / calls, "self_us": e.self_cpu_time_total / calls}
            for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r["self_us"])


def part_call(a) -> dict:
    fns = call_functions()
    out: dict = {"shape": "q [1, 12, 1, 64], k/v [1, 4, 512, 64], causal(bottom_right), fp32, no grad", "rows": []}
    for threads in a.threads:
        row = time_call(fns, threads, a.rounds, a.calls)
        out["rows"].append(row)
        print(f"  ({row['clock']} time, median of {a.rounds} rounds of {a.calls} calls; ratios to sdpa packed:)")
        for n in fns:
            p = row["over_sdpa_packed"][n]
            print(f"  {n:12s} {row['us'][n]:7.1f} µs  / sdpa packed {p['median']:.2f} ({p['min']:.2f}–{p['max']:.2f})")
    torch.set_num_threads(a.threads[0])
    out["frames_auto"] = frames(fns["auto"], 2000)
    print("\nPython frames of one auto call (cProfile; calls per call, share of the profiled time):")
    for r in out["frames_auto"][:16]:
        print(f"  {r['per_call']:4.1f}  {100 * r['share']:5.1f} %  {r['function']}")
    out["ops"] = {n: ops(f, 500) for n, f in fns.items()}
    print("\ntorch ops per call (count, self CPU µs under the profiler):")
    for n, rows in out["ops"].items():
        print(f"  {n:12s} " + "; ".join(f"{r['op']} ×{r['per_call']:.0f} {r['self_us']:.1f}" for r in rows[:6]))
    return out


# ---- 2. one decode step of SmolLM2 ---------------------------------------------------------------------


def floors() -> list[str]:
    """Register two attention functions that are only the kernel: ``packed`` (SDPA on each K/V
    head's query heads as queries of one call) and ``packed+check`` (after bhqk's NaN/inf test of q)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def packed(module, query, key, value, attention_mask, scaling=None, **kw):
        B, H, _, d = query.shape
        Hkv = key.shape[1]
        out = F.scaled_dot_product_attention(query.reshape(B, Hkv, H // Hkv, d), key, value, scale=scaling)
        return out.reshape(B, H, 1, d).transpose(1, 2).contiguous(), None  # [B, Hkv, G, d] -> [B, 1, H, d]

    def checked(module, query, *args, **kw):
        math.isfinite(float(query.sum()))  # bhqk's one data check of a decode step (shapes.finite)
        return packed(module, query, *args, **kw)

    for name, fn in (("packed", packed), ("packed+check", checked)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)  # a decode step: no mask
    return ["packed", "packed+check"]


def step_fn(model, cache, nxt: torch.Tensor):
    def step() -> None:
        L = cache.get_seq_length()
        model(nxt, cache=cache, attention_mask=torch.ones(1, L + 1, dtype=torch.long), position_ids=torch.tensor([[L]]),
              use_cache=True)
    return step


def part_model(a) -> dict:
    from transformers import DynamicCache

    import real_heads  # benchmarks/real_heads.py: the model and the pydoc text

    torch.set_num_threads(a.model_threads)
    model, tok = real_heads.load_model()
    impls = ["sdpa", "bhqk", *floors()]
    tick = clock(a.model_threads)
    out: dict = {"threads": a.model_threads, "clock": "thread CPU" if a.model_threads == 1 else "wall", "lengths": []}
    for N in a.lengths:
        ids = real_heads.pydoc_ids(tok, N)  # [1, N]
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            prefilled = DynamicCache(config=model.config)
            model(ids, cache=prefilled, use_cache=True, logits_to_keep=1)
        caches = {i: copy.deepcopy(prefilled) for i in impls}
        per: dict[str, list[float]] = {i: [] for i in impls}
        with torch.no_grad():
            for s in range(a.steps + 4):
                for impl in (impls if s % 2 else impls[::-1]):
                    model.set_attn_implementation(impl)
                    step = step_fn(model, caches[impl], ids[:, -1:])
                    t = tick()
                    step()
                    if s >= 4:  # four warm-up steps
                        per[impl].append(1e3 * (tick() - t))
        row: dict = {"N": N, "steps": a.steps, "ms": {}, "over_sdpa": {}, "per_layer_us_over_sdpa": {}, "samples_ms": per}
        layers = model.config.num_hidden_layers
        for i in impls:
            row["ms"][i] = statistics.median(per[i])
            row["over_sdpa"][i] = spread([x / y for x, y in zip(per[i], per["sdpa"])])
            row["per_layer_us_over_sdpa"][i] = statistics.median(1e3 * (x - y) / layers for x, y in zip(per[i], per["sdpa"]))
        # torch ops and Python calls of one step (a fresh copy of the cache: the same length for each)
        row["ops_per_step"], row["python_calls_per_layer"] = {}, {}
        from torch.profiler import ProfilerActivity, profile

        for impl in ("sdpa", "bhqk"):
            model.set_attn_implementation(impl)
            cache = copy.deepcopy(prefilled)
            step = step_fn(model, cache, ids[:, -1:])
            with torch.no_grad():
                step()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        step()
                row["ops_per_step"][impl] = sorted(({"op": e.key, "per_step": e.count / 3, "self_ms": e.self_cpu_time_total / 3e3}
                                                    for e in prof.key_averages()), key=lambda r: -r["self_ms"])[:25]
                prof2 = cProfile.Profile()
                prof2.enable()
                step()
                prof2.disable()
            st = pstats.Stats(prof2).stats  # type: ignore[attr-defined]
            mine = {"bhqk": ("/bhqk/",), "sdpa": ("sdpa_attention", "masking_utils")}[impl]
            row["python_calls_per_layer"][impl] = sum(v[1] for (f, _, n), v in st.items()
                                                      if any(x in f or x in n for x in mine)) / layers
        out["lengths"].append(row)
        print(f"\nSmolLM2-135M, one decode step after {N} tokens, {a.model_threads} thread(s), {out['clock']} time "
              f"(median of {a.steps} steps, implementations in turn):")
        for i in impls:
            o = row["over_sdpa"][i]
            print(f"  {i:13s} {row['ms'][i]:7.2f} ms  / sdpa {o['median']:.3f} (IQR {o['q1']:.3f}–{o['q3']:.3f})"
                  f"  {row['per_layer_us_over_sdpa'][i]:+7.1f} µs per layer")
        print(f"  Python calls per layer: bhqk {row['python_calls_per_layer']['bhqk']:.1f} (attention function, mask "
              f"builder), sdpa {row['python_calls_per_layer']['sdpa']:.1f} (transformers' sdpa function and masks)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["call", "model"], choices=["call", "model"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="threads of part 1")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=300, help="calls per round and function (part 1)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 4096], help="context lengths of part 2")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per implementation (part 2)")
    ap.add_argument("--model-threads", type=int, default=1, help="threads of part 2")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "local" / "decode-profile.json")
    a = ap.parse_args()
    meta = {**machine.describe(), "transformers": __import__("transformers").__version__}
    print(machine.one_line(meta), f"load {meta['loadavg_start'][0]:.1f}", flush=True)
    result: dict = {"meta": meta}
    if "call" in a.parts:
        result["call"] = part_call(a)
    if "model" in a.parts:
        result["model"] = part_model(a)
    meta["loadavg_end"] = os.getloadavg()
    print(f"\nload {meta['loadavg_start'][0]:.1f} → {meta['loadavg_end'][0]:.1f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
