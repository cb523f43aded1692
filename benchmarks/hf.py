"""Hugging Face models on bhqk: ``attn_implementation="bhqk"`` against ``"sdpa"`` and ``"eager"``.

1. A Mistral-shaped model (real attention widths: D=4096, H=32, Hkv=8, d=128; a few layers; random
   weights) with sliding window 256 at N=4096: forward and forward+backward, time and peak memory.
2. A Llama-shaped dense-causal model, the same.
3. The Mistral-shaped window layer (``--parts layer``: one layer, MLP 1024, N=4096,
   forward+backward): ``"bhqk:spans"`` (the span path) against ``"sdpa"`` and ``free`` (an attention
   function that returns q and costs nothing, with k and v kept in the graph by a zero term so that
   their projections' backward runs: the floor no attention backend can beat; ``free_q``, q alone,
   skips that backward too).
4. Capture of one head of one layer (``bhqk.capture(model=..., layers=[...], heads=[5])``) at
   N=16384 against a plain forward, and against ``eager`` with ``output_attentions``.
5. ``generate()`` (``--parts generate``): a Llama-shaped model (12 layers, D=768, H=12, Hkv=4, MLP
   2048, vocab 32000; random weights, built from its config) generating 64 tokens greedily after a
   512-token prompt on ``"sdpa"``, ``"bhqk"`` and ``"eager"``, and the prompt's prefill alone; the
   implementations interleaved repeat by repeat; the per-token decode time is (generate − prefill) / 63.
   Then single decode steps (the model called on one token with its cache), the implementations in
   turn step by step, paired at equal cache length: the per-step ratio with its interquartile range.

Times: median over repeats, implementations interleaved run by run (the machine is shared); peak
extra resident memory of one call in a fresh process (model and inputs excluded). ``eager`` is
skipped where its [B, H, N, N] tensors would exceed ``--mem-limit-gib``; the table says so.

    python benchmarks/hf.py                 # the full configuration (long on 2 cores)
    python benchmarks/hf.py --quick         # small widths and N, no memory runs: a smoke run (about a minute)
    python benchmarks/hf.py --out results/x.json
    python benchmarks/hf.py --parts layer   # the Mistral-shaped layer: bhqk:spans vs sdpa vs free attention
    python benchmarks/hf.py --parts generate --repeat 5   # generate(): bhqk vs sdpa vs eager (~3 min)
    python benchmarks/hf.py --parts generate --repeat 5 --threads 1   # the same, times in the thread's CPU time
"""

from __future__ import annotations

import argparse
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
CLOCK = [time.perf_counter]  # the clock of every time here: wall, or with --threads 1 the calling thread's CPU time
IMPLS = ("bhqk", "sdpa", "eager", "bhqk_spans", "free", "free_q")  # bhqk_spans: "bhqk:spans"; free(_q): see register_free
LAYER = {"layers": 1, "intermediate": 1024}  # the layer part's model: one Mistral-shaped layer, MLP 1024

FULL = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 4096, "layers": 2,
        "vocab": 1000, "window": 256, "N": 4096, "capture_N": 16384, "capture_layers": 1, "repeat": 3}
GENERATE = {"hidden": 768, "heads": 12, "kv_heads": 4, "head_dim": 64, "intermediate": 2048, "layers": 12,
            "vocab": 32000, "prompt": 512, "new_tokens": 64, "repeat": 5}  # part 5: generate()
GENERATE_QUICK = {**GENERATE, "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 512, "layers": 2,
                  "vocab": 1000, "prompt": 128, "new_tokens": 16, "repeat": 2}
QUICK = {"hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 512, "layers": 2,
         "vocab": 1000, "window": 64, "N": 512, "capture_N": 1024, "capture_layers": 1, "repeat": 2}


def build(kind: str, impl: str, c: dict, layers: int | None = None):
    """A random model: ``kind`` "window" (Mistral-shaped) or "dense" (Llama-shaped)."""
    import transformers

    from bhqk.integrations.transformers import register

    register()
    named = {"bhqk_spans": register_spans, "free": register_free, "free_q": lambda: register_free(False)}
    impl = named[impl]() if impl in named else impl  # registered only when asked for
    torch.manual_seed(0)
    width = c.get("layer_intermediate", c["intermediate"]) if kind == "layer" else c["intermediate"]
    common = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=width,
                  num_hidden_layers=layers or c["layers"], num_attention_heads=c["heads"],
                  num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                  max_position_embeddings=max(c["N"], c["capture_N"]), attn_implementation=impl)
    if kind in ("window", "layer"):
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=c["window"], **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model


def register_spans() -> str:
    """``"bhqk:spans"``: bhqk's attention function and mask builder with backend="spans"."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from bhqk.integrations import hf_attention as integration

    AttentionInterface.register("bhqk:spans", integration._attention_for("spans"))
    AttentionMaskInterface.register("bhqk:spans", integration.build_mask)
    return "bhqk:spans"


def register_free(keys: bool = True) -> str:
    """``"free"``: attention that costs nothing (returns q as the output; no mask is built), the floor.
    Its output also depends on k and v through a zero term, so their projections' backward runs as
    with any attention; ``"free_q"`` (``keys=False``) returns q alone, whose backward skips k_proj's
    and v_proj's (2·2·N·D·Hkv·d FLOPs: about 1 s of the Mistral-shaped layer on a 2-core EPYC)."""
    from transformers import AttentionInterface

    def free_attention(module, query, key, value, attention_mask, **kwargs):
        out = query.transpose(1, 2)  # [B, H, N, d] -> [B, N, H, d]
        return (out + 0 * (key.sum() + value.sum()) if keys else out), None

    name = "free" if keys else "free_q"
    AttentionInterface.register(name, free_attention)
    return name


def inputs(c: dict, N: int) -> torch.Tensor:
    return torch.randint(0, c["vocab"], (1, N), generator=torch.Generator().manual_seed(1))  # [B=1, N]


def step(model, ids, mode: str, capture: bool = False) -> None:
    """One forward (``fwd``), forward+backward (``fwdbwd``), or forward with one head captured."""
    import bhqk

    if mode == "fwdbwd":
        model.train()
        model.zero_grad(set_to_none=True)
        model(ids).logits.float().square().mean().backward()
        return
    model.eval()
    with torch.no_grad():
        if mode == "capture":
            with bhqk.capture(model=model, layers=["model.layers.0.self_attn"], heads=[5]) as cap:
                model(ids)
            assert len(cap) == 1 and cap[0].weights.shape[1] == 1  # one head of one layer
        elif mode == "attentions":
            out = model(ids, output_attentions=True)
            assert out.attentions[0].shape[-1] == ids.shape[1]
        else:
            model(ids)


def eager_gib(c: dict, N: int, mode: str, layers: int) -> float:
    """Rough peak of eager's [B, H, N, N] fp32 tensors: scores, mask add and weights per call; with
    a backward the weights of every layer are kept, and output_attentions keeps them all too."""
    one = c["heads"] * N * N * 4 / 2**30
    return one * (3 if mode == "fwd" else 3 + layers)


# ---- memory in a fresh process -------------------------------------------------------------------


def child(spec: dict) -> None:
    """Build the model, warm up on a short input, then print the peak extra resident MiB of one step."""
    c = spec["config"]
    model = build(spec["kind"], spec["impl"], c, spec.get("layers"))
    step(model, inputs(c, 64), spec["mode"])  # threads and allocator warmed up
    ids = inputs(c, spec["N"])
    base = peak_memory.status_bytes("VmRSS")
    peak_memory.reset_high_water()
    step(model, ids, spec["mode"])
    print(json.dumps({"peak_mib": (peak_memory.status_bytes("VmHWM") - base) / 2**20}))


def memory(spec: dict, timeout: float) -> dict:
    log(f"memory {spec['kind']} {spec['impl']} {spec['mode']} N={spec['N']}")
    return peak_memory.in_fresh_process(__file__, spec, timeout)


# ---- timing --------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timing(runs: dict[str, tuple], repeat: int) -> dict[str, dict]:
    """runs: name -> (model, ids, mode). Interleaved, one warm-up each, medians."""
    log(f"timing {list(runs)} ({repeat} repeats)")
    res: dict[str, dict] = {}
    for name, (model, ids, mode) in runs.items():
        t0 = CLOCK[0]()
        step(model, ids, mode)
        res[name] = {"warmup_s": CLOCK[0]() - t0, "times_s": []}
    for _ in range(repeat):
        for name, (model, ids, mode) in runs.items():
            t0 = CLOCK[0]()
            step(model, ids, mode)
            res[name]["times_s"].append(CLOCK[0]() - t0)
    for r in res.values():
        r["median_s"] = statistics.median(r["times_s"])
    return res


def paired(res: dict, a: str, b: str) -> float | None:
    """Median over repeats of t_b / t_a (how many times faster ``a`` is than ``b``), pairs back to back."""
    if a not in res or b not in res:
        return None
    return statistics.median(tb / ta for ta, tb in zip(res[a]["times_s"], res[b]["times_s"]))


def bench_model(kind: str, c: dict, impls, modes, limit: float, mem: bool, timeout: float) -> list[dict]:
    N = c["N"]
    rows = []
    for mode in modes:
        run, skipped = {}, {}
        for impl in impls:
            if impl == "eager" and eager_gib(c, N, mode, c["layers"]) > limit:
                skipped[impl] = f"skipped: eager needs ≈ {eager_gib(c, N, mode, c['layers']):.0f} GiB > {limit:g} GiB"
                continue
            run[impl] = (build(kind, impl, c), inputs(c, N), mode)
        res = timing(run, c["repeat"])
        for impl in impls:
            row = {"model": kind, "mode": mode, "impl": impl, "N": N}
            if impl in skipped:
                row["note"] = skipped[impl]
            else:
                row.update(res[impl])
                row["sdpa_over_this"] = paired(res, impl, "sdpa")
                row["this_over_free"] = paired(res, "free", impl)  # median of t_this / t_free
                if mem:
                    row.update(memory({"kind": kind, "impl": impl, "mode": mode, "N": N, "config": c}, timeout))
            rows.append(row)
        del run
    return rows


def bench_capture(c: dict, limit: float, mem: bool, timeout: float) -> list[dict]:
    """One head of one layer captured at capture_N, vs a plain forward and eager + output_attentions."""
    N, L = c["capture_N"], c["capture_layers"]
    cases = {"plain forward (bhqk)": ("bhqk", "fwd"), "capture 1 head, 1 layer (bhqk)": ("bhqk", "capture"),
             "eager + output_attentions": ("eager", "attentions")}
    run, rows, skipped = {}, [], {}
    models = {}
    for name, (impl, mode) in cases.items():
        if impl == "eager" and eager_gib(c, N, mode, L) > limit:
            skipped[name] = f"skipped: eager needs ≈ {eager_gib(c, N, mode, L):.0f} GiB > {limit:g} GiB"
            continue
        models.setdefault(impl, build("dense", impl, c, L))
        run[name] = (models[impl], inputs(c, N), mode)
    res = timing(run, c["repeat"])
    for name, (impl, mode) in cases.items():
        row = {"model": "dense", "mode": name, "impl": impl, "N": N, "layers": L}
        if name in skipped:
            row["note"] = skipped[name]
        else:
            row.update(res[name])
            row["vs_plain"] = paired(res, "plain forward (bhqk)", name)  # median of t_this / t_plain
            if mem:
                row.update(memory({"kind": "dense", "impl": impl, "mode": mode, "N": N, "config": c, "layers": L}, timeout))
        rows.append(row)
    return rows


# ---- generate(): a Llama-shaped model decoding ----------------------------------------------------


def build_generate(impl: str, g: dict):
    """The generate part's Llama-shaped model with random weights (the same for every ``impl``)."""
    return build("dense", impl, {**g, "N": g["prompt"] + g["new_tokens"], "capture_N": 0}).eval()


def generate_once(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens after ``ids`` [1, N] → [1, N + new_tokens]."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def prefill_once(model, ids: torch.Tensor) -> None:
    """The prompt's forward as ``generate`` runs it: a fresh cache, the last position's logits."""
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)


def decode_steps(models: dict, ids: torch.Tensor, g: dict) -> dict[str, list[float]]:
    """Seconds of each decode step (one token through the model with its cache), the implementations
    stepped in turn so that step i of each sees the same cache length: ``repeat`` prompts × new_tokens steps."""
    from transformers import DynamicCache

    out: dict[str, list[float]] = {impl: [] for impl in models}
    with torch.no_grad():
        for _ in range(g["repeat"]):
            caches, nxt = {}, {}
            for impl, m in models.items():
                caches[impl] = DynamicCache(config=m.config)
                logits = m(ids, attention_mask=torch.ones_like(ids), cache=caches[impl], use_cache=True,
                           logits_to_keep=1).logits  # [1, 1, V]
                nxt[impl] = logits[:, -1:].argmax(-1)  # [1, 1]
            seen = torch.ones_like(ids)  # [1, K]: every token real
            for _ in range(g["new_tokens"]):
                seen = torch.cat([seen, seen[:, :1]], dim=1)  # [1, K + 1]
                for impl, m in models.items():
                    t0 = CLOCK[0]()
                    logits = m(nxt[impl], attention_mask=seen, cache=caches[impl], use_cache=True).logits
                    out[impl].append(CLOCK[0]() - t0)
                    nxt[impl] = logits[:, -1:].argmax(-1)  # [1, 1]
    return out


def bench_generate(g: dict, impls: list[str]) -> list[dict]:
    """generate() and its prefill per implementation, interleaved repeat by repeat; ratios paired to sdpa."""
    ids = torch.randint(0, g["vocab"], (1, g["prompt"]), generator=torch.Generator().manual_seed(1))  # [B=1, N]
    models = {impl: build_generate(impl, g) for impl in impls}
    log(f"generate: {impls}, prompt {g['prompt']}, {g['new_tokens']} new tokens, {g['repeat']} repeats")
    tokens = {impl: generate_once(m, ids, 4) for impl, m in models.items()}  # warm-up: threads, allocator, caches
    res = {impl: {"generate_s": [], "prefill_s": []} for impl in impls}
    for _ in range(g["repeat"]):
        for impl, m in models.items():
            t0 = CLOCK[0]()
            prefill_once(m, ids)
            t1 = CLOCK[0]()
            tokens[impl] = generate_once(m, ids, g["new_tokens"])
            t2 = CLOCK[0]()
            res[impl]["prefill_s"].append(t1 - t0)
            res[impl]["generate_s"].append(t2 - t1)
    step_s = decode_steps(models, ids, g)
    rows = []
    steps = max(1, g["new_tokens"] - 1)  # the first new token comes from the prefill
    for impl in impls:
        r = res[impl]
        r["decode_ms_per_token"] = [1e3 * (a - b) / steps for a, b in zip(r["generate_s"], r["prefill_s"])]
        row: dict = {"model": "llama-generate", "impl": impl, "prompt": g["prompt"], "new_tokens": g["new_tokens"], **r}
        for key in ("generate_s", "prefill_s", "decode_ms_per_token"):
            row[f"{key}_median"] = statistics.median(r[key])
            row[f"{key}_range"] = [min(r[key]), max(r[key])]
            if "sdpa" in res:  # paired: this repeat's time over sdpa's in the same repeat
                row[f"{key}_over_sdpa"] = statistics.median(a / b for a, b in zip(r[key], res["sdpa"][key]))
                row[f"{key}_over_sdpa_range"] = [min(a / b for a, b in zip(r[key], res["sdpa"][key])),
                                                 max(a / b for a, b in zip(r[key], res["sdpa"][key]))]
        row["step_ms"] = [1e3 * t for t in step_s[impl]]
        row["step_ms_median"] = statistics.median(row["step_ms"])
        if "sdpa" in step_s:  # paired step by step: the same cache length, back to back
            pairs = sorted(a / b for a, b in zip(step_s[impl], step_s["sdpa"]))
            row["step_over_sdpa"] = statistics.median(pairs)
            row["step_over_sdpa_iqr"] = [pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]]
        if "sdpa" in tokens:
            row["tokens_equal_sdpa"] = float((tokens[impl] == tokens["sdpa"]).float().mean())
        rows.append(row)
    return rows


def generate_table(rows: list[dict]) -> str:
    out = ["| impl | generate (median, range) | this / sdpa (paired: median, range) | prefill | prefill / sdpa "
           "| decode ms/token | decode / sdpa | one decode step | step / sdpa (paired: median, IQR) | tokens = sdpa's |",
           "|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r, key):
        if f"{key}_over_sdpa" not in r:
            return "—"
        lo, hi = r[f"{key}_over_sdpa_range"]
        return f"{r[f'{key}_over_sdpa']:.3f}× ({lo:.3f}–{hi:.3f})"

    def step(r):
        if "step_over_sdpa" not in r:
            return "—"
        lo, hi = r["step_over_sdpa_iqr"]
        return f"{r['step_over_sdpa']:.3f}× ({lo:.3f}–{hi:.3f})"

    for r in rows:
        lo, hi = r["generate_s_range"]
        out.append(f"| {r['impl']} | {r['generate_s_median']:.2f} s ({lo:.2f}–{hi:.2f}) | {ratio(r, 'generate_s')} "
                   f"| {r['prefill_s_median']:.3f} s | {ratio(r, 'prefill_s')} | {r['decode_ms_per_token_median']:.1f} "
                   f"| {ratio(r, 'decode_ms_per_token')} | {r['step_ms_median']:.1f} ms | {step(r)} "
                   f"| {r.get('tokens_equal_sdpa', float('nan')):.0%} |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = ["| model | N | mode | impl | median time | sdpa time / this (paired) | this / free (paired) | peak extra MiB | note |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{r['median_s']:.2f} s" if "median_s" in r else "—"
        ratio = r.get("sdpa_over_this")
        ratio_s = f"{ratio:.2f}×" if ratio else "—"
        if r.get("vs_plain"):  # capture rows: this time / the plain forward's
            ratio_s = f"time {r['vs_plain']:.2f}× plain"
        mem = f"{r['peak_mib']:.0f}" if "peak_mib" in r else r.get("mem_note", "—")
        free = f"{r['this_over_free']:.2f}×" if r.get("this_over_free") else "—"
        out.append(f"| {r['model']} | {r['N']} | {r['mode']} | {r['impl']} | {t} | {ratio_s} | {free} | {mem} "
                   f"| {r.get('note', '')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small widths and N: a smoke run")
    ap.add_argument("--out", type=Path, help="JSON output path (default results/hf.json; --quick: results/hf-quick.json)")
    ap.add_argument("--n", type=int, help="sequence length of parts 1 and 2")
    ap.add_argument("--capture-n", type=int, help="sequence length of part 3")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--intermediate", type=int, help="MLP width (the attention widths stay real)")
    ap.add_argument("--repeat", type=int)
    ap.add_argument("--parts", nargs="+", default=["window", "dense", "capture"],
                    choices=["window", "dense", "capture", "layer", "generate"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS),
                    help="default: bhqk, sdpa, eager; the layer part: bhqk_spans, sdpa, free, free_q;"
                         " generate: sdpa, bhqk, eager")
    ap.add_argument("--mem-limit-gib", type=float, default=6.0, help="skip eager above this estimated peak")
    ap.add_argument("--memory", choices=["on", "off"], help="fresh-process memory runs (default: on; off with --quick)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per memory run")
    ap.add_argument("--threads", type=int, help="torch threads (1: times are the calling thread's CPU time; default: torch's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return
    c = dict(QUICK if a.quick else FULL)
    for key, val in (("N", a.n), ("capture_N", a.capture_n), ("layers", a.layers), ("intermediate", a.intermediate),
                     ("repeat", a.repeat)):
        if val is not None:
            c[key] = val
    if a.threads:
        torch.set_num_threads(a.threads)
    if torch.get_num_threads() == 1:  # what other jobs on a shared machine take is wall time, not this thread's CPU time
        CLOCK[0] = time.thread_time
    meta = {"command": " ".join(["python", "benchmarks/hf.py", *(sys.argv[1:] if argv is None else argv)]),
            **machine.describe(), "transformers": __import__("transformers").__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "config": c, "dtype": "float32", "B": 1,
            "clock": "thread CPU" if CLOCK[0] is time.thread_time else "wall"}
    rows: list[dict] = []
    mem = (a.memory or ("off" if a.quick else "on")) == "on"
    out = a.out or HERE / "results" / ("hf-quick.json" if a.quick else "hf.json")
    impls = a.impls or ["bhqk", "sdpa", "eager"]
    if "window" in a.parts:
        rows += bench_model("window", c, impls, a.modes, a.mem_limit_gib, mem, a.timeout)
    if "dense" in a.parts:
        rows += bench_model("dense", c, impls, a.modes, a.mem_limit_gib, mem, a.timeout)
    if "layer" in a.parts:
        lc = {**c, "layers": a.layers or LAYER["layers"], "layer_intermediate": a.intermediate or LAYER["intermediate"]}
        layer_impls = a.impls or ["bhqk_spans", "sdpa", "free", "free_q"]
        rows += bench_model("layer", lc, layer_impls, a.modes, a.mem_limit_gib, mem, a.timeout)
    if "capture" in a.parts:
        rows += bench_capture(c, a.mem_limit_gib, mem, a.timeout)
    gen_rows: list[dict] = []
    if "generate" in a.parts:
        g = dict(GENERATE_QUICK if a.quick else GENERATE)
        g.update({key: val for key, val in (("layers", a.layers), ("repeat", a.repeat)) if val is not None})
        meta["generate_config"] = g
        gen_rows = bench_generate(g, [i for i in (a.impls or ["sdpa", "bhqk", "eager"]) if i in ("sdpa", "bhqk", "eager")])
    meta["loadavg_end"] = os.getloadavg()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"# {meta['command']}\n\nCPU: {machine.one_line(meta)}, {meta['threads']} threads ({meta['clock']} time), "
          f"transformers {meta['transformers']}, load {meta['loadavg_start'][0]:.1f} → "
          f"{meta['loadavg_end'][0]:.1f}. Widths: D={c['hidden']}, H={c['heads']}, Hkv={c['kv_heads']}, "
          f"d={c['head_dim']}, MLP {c['intermediate']}, {c['layers']} layers (capture: {c['capture_layers']}; "
          f"layer: {a.layers or LAYER['layers']} layer, MLP {a.intermediate or LAYER['intermediate']}), "
          f"window {c['window']}, fp32, B=1.\n")
    if rows:
        print(table(rows))
    if gen_rows:
        g = meta["generate_config"]
        print(f"\ngenerate(): Llama-shaped, {g['layers']} layers, D={g['hidden']}, H={g['heads']}, Hkv={g['kv_heads']}, "
              f"d={g['head_dim']}, MLP {g['intermediate']}, vocab {g['vocab']}; prompt {g['prompt']}, "
              f"{g['new_tokens']} new tokens (greedy), fp32, B=1, {g['repeat']} repeats.\n")
        print(generate_table(gen_rows))
    if not mem and rows:
        print("\nPeak memory not measured (--memory off; --quick turns it off).")
    out.parent.mkdir(parents=True, exist_ok=True)
    if gen_rows and not a.out and a.parts == ["generate"]:
        out = HERE / "results" / ("hf-generate-quick.json" if a.quick else "hf-generate.json")
    out.write_text(json.dumps({"meta": meta, "rows": rows, "generate": gen_rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
