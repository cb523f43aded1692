"""kvpress (NVIDIA) side by side on bhqk's needle grid: StreamingLLM, SnapKV, AdaKV(SnapKV) and more presses (``PRESSES``).

Runs in kvpress's own environment (``bash benchmarks/kvpress_env.sh``; kvpress 0.5.5 pins
transformers < 5.3), never the project's:

    flock /tmp/bhqk-cpu.lock /tmp/bhqk-kvpress-venv/bin/python benchmarks/kvpress_needle.py \\
        --model ~/.cache/bhqk/SmolLM2-135M-Instruct.Q4_1-<hash> --lengths 1024 2048 4096 \\
        --depths 0 0.25 0.5 0.75 1 --ratios 0.5

The prompts are bhqk's own (``bhqk.corpus.make_trials``) and so is the decoding loop
(``bhqk.integrations.greedy.greedy``): those two files import nothing of bhqk and are loaded by path
(``--corpus-py``, ``--greedy-py``), so neither bhqk's package nor its transformers-5.x integration is
imported here. ``--prompts-only`` prints a digest of every trial's token ids: run it in both
environments to check the prompts are the same.

Each trial prefills the whole prompt (template, haystack, question) under the press, as bhqk's plan
cache does, then decodes greedily at the true positions (N, N+1, ...) like kvpress's pipeline (bhqk's
loop passes ``position_ids``), up to ``--max-new-tokens`` (16, as bhqk's grid) or an end token
(``eos_ids``: the model's and the tokenizer's, as bhqk's grader stops). Per trial: found, the KV bytes the cache stores after
prefill (the sum of its key and value tensors' nbytes) and the bytes that are effectively kept
(AdaKV, KVzip and DuoAttention only mask: they keep every key and overwrite the evicted ones with a
"fake key" at decode, so their stored bytes are the full cache's and their effective bytes count only
the unmasked keys),
prefill and decode time. Each (press, ratio, length) runs in a fresh subprocess, so its peak RSS
(``ru_maxrss``) is that configuration's alone.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src" / "bhqk"
PRESSES = ("none", "streaming_llm", "snapkv", "adakv_snapkv", "tova", "keydiff", "expected_attention", "pyramidkv",
           "duo_attention", "kvzip")
# What each press leaves in the cache after the prefill (a board's "cache" column)
CACHES = {"none": "whole cache, no press", "streaming_llm": "pruned cache (4 sinks + recent window)",
          "snapkv": "pruned cache", "adakv_snapkv": "whole cache, masked (head-wise budgets)",
          "tova": "pruned cache", "keydiff": "pruned cache", "expected_attention": "pruned cache",
          "pyramidkv": "pruned cache (per-layer budgets)",
          "duo_attention": "whole cache, masked (streaming heads keep 128 sinks + 256 recent)",
          "kvzip": "whole cache, masked (budgets across layers and heads)"}


def load_file(path: Path, name: str) -> types.ModuleType:
    """One of bhqk's files that import nothing of bhqk (``corpus.py``, ``integrations/greedy.py``), loaded
    from its path without importing the bhqk package."""
    spec = importlib.util.spec_from_file_location(f"_bhqk_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def make_press(name: str, ratio: float):
    """kvpress's press ``name`` at compression ratio ``ratio`` (the fraction of KV pairs to drop; for
    DuoAttention the fraction of KV heads made streaming heads), its other arguments kvpress's defaults."""
    import kvpress as kp

    if name == "none":
        return None
    if name == "streaming_llm":
        return kp.StreamingLLMPress(compression_ratio=ratio)  # n_sink=4, the rest a recent window
    if name == "snapkv":
        return kp.SnapKVPress(compression_ratio=ratio)  # window 64, kernel 5, scores per KV head
    if name == "adakv_snapkv":
        return kp.AdaKVPress(kp.SnapKVPress(compression_ratio=ratio))  # head-wise budgets, alpha_safeguard 0.2
    if name == "tova":
        return kp.TOVAPress(compression_ratio=ratio)  # the last token's attention, averaged over heads
    if name == "keydiff":
        return kp.KeyDiffPress(compression_ratio=ratio)  # keys least like the mean key kept
    if name == "expected_attention":
        return kp.ExpectedAttentionPress(compression_ratio=ratio)  # 512 future positions, n_sink 4, covariance, ||v||
    if name == "pyramidkv":
        return kp.PyramidKVPress(compression_ratio=ratio)  # SnapKV scores, budgets falling with depth (beta 20)
    if name == "duo_attention":
        # no pattern of DuoAttention's repo for this model: kvpress's on-the-fly head scores (BookSum samples)
        return kp.DuoAttentionPress(head_compression_ratio=ratio, on_the_fly_scoring=True)
    if name == "kvzip":
        return kp.KVzipPress(compression_ratio=ratio)  # context reconstruction; masks (no pruning) after the prefill
    raise ValueError(f"unknown press {name!r}; one of {PRESSES}")


def load_model(folder: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):  # a record of the GGUF it came from; the weights are fp32
        del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    return model, tok


def cache_bytes(cache, model) -> tuple[int, int, int]:
    """(stored bytes, effective bytes, stored tokens summed over layers and KV heads) of a DynamicCache;
    effective leaves out the keys/values AdaKV masked (``masked_key_indices`` on each attention module)."""
    stored = effective = tokens = 0
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values  # [B, Hkv, n, d]
        stored += k.nbytes + v.nbytes
        tokens += k.shape[1] * k.shape[2]
        masked = getattr(model.model.layers[i].self_attn, "masked_key_indices", None)
        n_masked = 0 if masked is None else int(masked[0].numel())
        per_token = (k.shape[-1] * k.element_size()) + (v.shape[-1] * v.element_size())
        effective += k.nbytes + v.nbytes - n_masked * per_token
    return stored, effective, tokens


def answer(model, tok, ids: list[int], press, max_new_tokens: int, greedy_py: Path = SRC / "integrations/greedy.py"
           ) -> dict:
    """Prefill ``ids`` under ``press`` (None: no press), then bhqk's greedy loop at the true positions (N,
    N+1, ...) until an end token or ``max_new_tokens`` new tokens: the new ids (no end token), the cache
    after the prefill (:func:`cache_bytes`) and the seconds of each part."""
    from transformers import DynamicCache

    g = load_file(greedy_py, "greedy")
    after: dict = {}
    r = g.greedy(model, ids, DynamicCache(), max_new_tokens=max_new_tokens, eos=g.eos_ids(model, tok),
                 keyword="past_key_values", prefill=None if press is None else (lambda: press(model)),
                 after_prefill=lambda cache: after.update(zip(("stored", "effective", "tokens"), cache_bytes(cache, model))))
    return {"new": r.tokens, "kv_bytes_stored": after["stored"], "kv_bytes_effective": after["effective"],
            "kv_tokens_stored": after["tokens"], "prefill_s": round(r.prefill_s, 3), "decode_s": round(r.decode_s, 3)}


def run_trial(model, tok, corpus, t, press, max_new_tokens: int, greedy_py: Path) -> dict:
    """One needle trial: :func:`answer` to its prompt, judged by the corpus's rule (``found_in``)."""
    g = answer(model, tok, t.ids, press, max_new_tokens, greedy_py)
    new = g.pop("new")
    text = tok.decode(new, skip_special_tokens=True).strip()
    return {"length": t.length, "depth": t.depth, "trial": t.trial, "key": t.key, "answer": text,
            "found": corpus.found_in(text, t.key), "needle_at": t.needle_at, "prompt_sha": digest(t.ids),
            **g, "new_tokens": len(new)}


def worker(args) -> None:
    """One (press, ratio, length): every depth × trial; prints one JSON line."""
    import torch

    torch.manual_seed(args.seed)
    corpus = load_file(args.corpus_py, "corpus")
    model, tok = load_model(args.model)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trials = corpus.make_trials(tok, [args.length], args.depths, args.trials, args.seed)
    press = make_press(args.press, args.ratio)
    entries = [run_trial(model, tok, corpus, t, press, args.max_new_tokens, args.greedy_py) for t in trials]
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"press": args.press, "ratio": args.ratio, "length": args.length,
                      "rss_after_load_kib": rss_loaded, "rss_peak_kib": rss_peak, "trials": entries}))


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("kvpress", "transformers", "torch", "accelerate", "tokenizers")}


def table(configs: list[dict], full_bytes: dict[int, int]) -> str:
    lines = [f"{'press':<14}{'ratio':>6}{'length':>7}{'found':>7}{'stored MiB':>11}{'eff. MiB':>9}"
             f"{'x full':>7}{'peak RSS MiB':>13}{'prefill s':>10}{'decode s':>9}"]
    for c in configs:
        tr = c["trials"]
        n = len(tr)
        stored = sum(e["kv_bytes_stored"] for e in tr) / n
        eff = sum(e["kv_bytes_effective"] for e in tr) / n
        full = full_bytes.get(c["length"])
        ratio = f"{eff / full:.2f}" if full else "-"
        lines.append(f"{c['press']:<14}{c['ratio']:>6g}{c['length']:>7}{sum(e['found'] for e in tr):>4}/{n:<2}"
                     f"{stored / 2**20:>11.1f}{eff / 2**20:>9.1f}{ratio:>7}{c['rss_peak_kib'] / 1024:>13.0f}"
                     f"{sum(e['prefill_s'] for e in tr) / n:>10.2f}{sum(e['decode_s'] for e in tr) / n:>9.2f}")
    return "\n".join(lines)


def write(args, configs: list[dict]) -> str:
    """The table of the configurations run so far; the JSON (rewritten after each configuration)."""
    from machine import describe  # benchmarks/machine.py: torch and the standard library only

    ok = [c for c in configs if "error" not in c]
    full = {c["length"]: c["trials"][0]["kv_bytes_stored"] for c in ok if c["press"] == "none"}
    text = table(ok, full)
    meta = describe()
    meta.update({"versions": versions(), "model": str(args.model), "corpus_py": str(args.corpus_py),
                 "corpus_py_sha256": hashlib.sha256(args.corpus_py.read_bytes()).hexdigest(),
                 "greedy_py_sha256": hashlib.sha256(args.greedy_py.read_bytes()).hexdigest(),
                 "lengths": args.lengths, "depths": args.depths, "trials": args.trials, "seed": args.seed,
                 "max_new_tokens": args.max_new_tokens, "attn_implementation": "sdpa", "dtype": "float32",
                 "loadavg_end": os.getloadavg(), "note": args.note,
                 "notes": "whole prompt prefilled under the press; greedy decode at true positions; "
                          "adakv stores every key (fake keys at decode): stored = full, effective = unmasked; "
                          "peak RSS per (press, ratio, length) subprocess, model load included"})
    out = args.out or HERE / "results" / f"kvpress-needle-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "table": text, "configs": configs}, indent=1))
    return text + f"\nwrote {out}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="bhqk's converted HF folder of SmolLM2-135M-Instruct")
    p.add_argument("--corpus-py", type=Path, default=SRC / "corpus.py", help="bhqk's corpus module (the prompts)")
    p.add_argument("--greedy-py", type=Path, default=SRC / "integrations/greedy.py",
                   help="bhqk's greedy decoding loop")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    p.add_argument("--presses", nargs="+", default=list(PRESSES), choices=PRESSES)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/kvpress-needle-<date>.json)")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. whether the CPU lock was held)")
    p.add_argument("--prompts-only", action="store_true", help="print each trial's prompt digest and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--press", default="none", help=argparse.SUPPRESS)
    p.add_argument("--ratio", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = args.model.expanduser()

    if args.worker:
        return worker(args)
    corpus = load_file(args.corpus_py, "corpus")
    if args.prompts_only:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        for t in corpus.make_trials(tok, args.lengths, args.depths, args.trials, args.seed):
            print(t.length, t.depth, t.trial, t.key, t.needle_at, len(t.ids), digest(t.ids))
        return

    sys.path.insert(0, str(HERE))

    jobs = [("none", 0.0)] if "none" in args.presses else []
    jobs += [(name, r) for r in args.ratios for name in args.presses if name != "none"]
    configs = []
    for name, r in jobs:
        for length in args.lengths:
            cmd = [sys.executable, __file__, "--worker", "--model", str(args.model), "--corpus-py", str(args.corpus_py),
                   "--greedy-py", str(args.greedy_py),
                   "--press", name, "--ratio", str(r), "--length", str(length), "--depths", *map(str, args.depths),
                   "--trials", str(args.trials), "--seed", str(args.seed), "--max-new-tokens", str(args.max_new_tokens)]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            if done.returncode != 0:
                print(f"{name} ratio={r} length={length}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                configs.append({"press": name, "ratio": r, "length": length, "error": done.stderr[-3000:]})
                continue
            c = json.loads(done.stdout.strip().splitlines()[-1])
            c["wall_s"] = round(time.perf_counter() - t0, 1)
            configs.append(c)
            print(f"{name:<14} ratio={r:<5g} length={length:<5} found {sum(e['found'] for e in c['trials'])}/"
                  f"{len(c['trials'])}  {c['wall_s']} s", flush=True)
            write(args, configs)

    print(write(args, configs))


if __name__ == "__main__":
    main()
