"""bhqk.edit on a Llama-shaped model (random weights, ``attn_implementation="bhqk"``): one head of one
layer edited (zero, scale, knock out key 0, a dense bias, a replaced pattern, a replaced output)
against the unedited forward at N=4096. The issue's target: ≤ 1.3× the unedited forward's time;
a replaced pattern or a dense bias adds memory for that one head only ([N, N] fp32 = 64 MiB at
N=4096).

Times: wall-clock median and best, and the process's CPU time (median), over repeats, modes
interleaved run by run. On a shared machine wall times swing 2-3× with the others' load; with
``--threads 1`` the CPU time is the work the forward did (no thread spinning) and the ratio to the
unedited forward's is the figure to quote. Peak extra
resident memory of one forward in a fresh process (model and inputs excluded; the edit's own
tensors, e.g. P, are made before the measurement and not counted).

    python benchmarks/edit.py                 # N=4096 (a few minutes on 2 cores)
    python benchmarks/edit.py --quick         # small widths and N, no memory runs: a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import machine  # benchmarks/machine.py: CPU model and flags for every JSON
import peak_memory  # benchmarks/peak_memory.py: resident-set peaks, measured in a fresh process

HERE = Path(__file__).resolve().parent
MODES = ("plain", "zero", "scale", "knockout", "bias", "weights", "output")
LAYER, HEAD = "model.layers.1.self_attn", 5

FULL = {"hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128, "intermediate": 2048, "layers": 2,
        "vocab": 1000, "N": 4096, "repeat": 7}
QUICK = {"hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 512, "layers": 2,
         "vocab": 1000, "N": 512, "repeat": 2}


def build(c: dict):
    import transformers

    from bhqk.integrations.transformers import register

    register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                                   num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                   num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                                   max_position_embeddings=c["N"], attn_implementation="bhqk")
    return transformers.LlamaForCausalLM(cfg).eval()


def inputs(c: dict, N: int) -> torch.Tensor:
    return torch.randint(0, c["vocab"], (1, N), generator=torch.Generator().manual_seed(1))  # [B=1, N]


def edit_args(mode: str, N: int, dv: int) -> dict:
    """The edit of one mode, its tensors made here (outside any measurement)."""
    from bhqk import masks

    g = torch.Generator().manual_seed(2)
    return {
        "zero": dict(zero=True),
        "scale": dict(scale=0.5),
        "knockout": dict(mask=masks.key_span(0, 1)),
        "bias": dict(bias=torch.randn(N, N, generator=g)),  # [Q, K]
        "weights": dict(weights=torch.softmax(torch.randn(N, N, generator=g), -1)),  # [Q, K]
        "output": dict(output=torch.randn(N, dv, generator=g)),  # [Q, dv]
    }.get(mode, {})


def step(model, ids, mode: str, args: dict) -> None:
    import bhqk

    with torch.no_grad():
        ctx = bhqk.edit(model=model, layers=LAYER, heads=[HEAD], **args) if mode != "plain" else contextlib.nullcontext()
        with ctx:
            model(ids)


def child(spec: dict) -> None:
    """Build, warm up, then print the peak extra resident MiB of one forward."""
    c = spec["config"]
    model = build(c)
    step(model, inputs(c, 64), "plain", {})
    ids = inputs(c, c["N"])
    args = edit_args(spec["mode"], c["N"], c["head_dim"])
    base = peak_memory.status_bytes("VmRSS")
    peak_memory.reset_high_water()
    step(model, ids, spec["mode"], args)
    print(json.dumps({"peak_mib": (peak_memory.status_bytes("VmHWM") - base) / 2**20}))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small widths and N, no memory runs")
    ap.add_argument("--out", type=Path, help="JSON output (default results/edit.json; --quick: results/edit-quick.json)")
    ap.add_argument("--n", type=int)
    ap.add_argument("--repeat", type=int)
    ap.add_argument("--threads", type=int, help="torch threads (1: process CPU time is the work done, no spinning)")
    ap.add_argument("--memory", choices=["on", "off"], help="fresh-process memory runs (default on; off with --quick)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per memory run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        peak_memory.exact_cpu_peaks()
        child(json.loads(a.child))
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    c = dict(QUICK if a.quick else FULL)
    for key, val in (("N", a.n), ("repeat", a.repeat)):
        if val is not None:
            c[key] = val
    meta = {"command": " ".join(["python", "benchmarks/edit.py", *(sys.argv[1:] if argv is None else argv)]),
            **machine.describe(), "transformers": __import__("transformers").__version__, "config": c,
            "layer": LAYER, "head": HEAD, "dtype": "float32", "B": 1}
    model = build(c)
    ids = inputs(c, c["N"])
    args = {m: edit_args(m, c["N"], c["head_dim"]) for m in MODES}
    res: dict[str, dict] = {m: {"times_s": [], "cpu_s": []} for m in MODES}
    log(f"timing {list(MODES)} at N={c['N']} ({c['repeat']} repeats)")
    for m in MODES:  # warm-up
        step(model, ids, m, args[m])
    for _ in range(c["repeat"]):
        for m in MODES:
            t0, c0 = time.perf_counter(), time.process_time()
            step(model, ids, m, args[m])
            res[m]["times_s"].append(time.perf_counter() - t0)
            res[m]["cpu_s"].append(time.process_time() - c0)
    for m in MODES:
        r = res[m]
        r["median_s"] = statistics.median(r["times_s"])
        r["vs_plain"] = statistics.median(t / p for t, p in zip(r["times_s"], res["plain"]["times_s"]))  # paired
        r["min_s"] = min(r["times_s"])
        r["min_vs_plain"] = r["min_s"] / min(res["plain"]["times_s"])  # best against best
        r["cpu_median_s"] = statistics.median(r["cpu_s"])
        r["cpu_vs_plain"] = r["cpu_median_s"] / statistics.median(res["plain"]["cpu_s"])  # the work, least bent by load
    if (a.memory or ("off" if a.quick else "on")) == "on":
        for m in MODES:
            log(f"memory {m}")
            res[m].update(peak_memory.in_fresh_process(__file__, {"config": c, "mode": m}, a.timeout))
    meta["loadavg_end"] = os.getloadavg()
    lines = [f"# {meta['command']}", "",
             f"CPU: {machine.one_line(meta)}, {meta['threads']} threads, transformers {meta['transformers']}, load "
             f"{meta['loadavg_start'][0]:.1f} → {meta['loadavg_end'][0]:.1f}. Llama-shaped: D={c['hidden']}, "
             f"H={c['heads']}, Hkv={c['kv_heads']}, d={c['head_dim']}, MLP {c['intermediate']}, {c['layers']} layers, "
             f"fp32, B=1, N={c['N']}; head {HEAD} of {LAYER} edited.", "",
             "| edit | median forward (wall) | best / unedited best (wall) | median CPU time | CPU time / unedited "
             "| peak extra MiB |", "|---|---|---|---|---|---|"]
    for m in MODES:
        r = res[m]
        mem = f"{r['peak_mib']:.0f}" if "peak_mib" in r else r.get("mem_note", "—")
        lines.append(f"| {m} | {r['median_s']:.2f} s | {r['min_vs_plain']:.2f}× | {r['cpu_median_s']:.2f} s | "
                     f"{r['cpu_vs_plain']:.2f}× | {mem} |")
    print("\n".join(lines))
    out = a.out or HERE / "results" / ("edit-quick.json" if a.quick else "edit.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": res}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
