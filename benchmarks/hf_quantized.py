"""Hugging Face's quantized KV cache (transformers' ``QuantizedCache``, backends optimum-quanto and HQQ) side by
side with bhqk's (``plan.cache(model, bits=8 | 4)``, benchmarks/quant.py): bytes at 8k, chunked perplexity at
4k, the graded set and a decode step at 8k, on SmolLM2-135M-Instruct and Gemma 3 270M.

Runs in its own environment (``bash benchmarks/quanto_env.sh``), never the project's; it imports nothing of
bhqk: ``corpus.py``, ``evaluate/tasks.py`` and ``integrations/greedy.py`` are loaded by path (tasks.py under a
stand-in package, so its ``from ..corpus import`` finds the corpus loaded by path), so the text, the prompts,
the scoring rule and the greedy loop are bhqk's own::

    V=/tmp/bhqk-quanto-venv/bin/python; M=~/.cache/bhqk/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f
    $V benchmarks/hf_quantized.py --model $M --parts bytes,ppl,tasks --tag smollm2-2026-12-07
    flock /tmp/bhqk-cpu.lock $V benchmarks/hf_quantized.py --model $M --parts step --tag smollm2-2026-12-07
    python benchmarks/grade.py --part import --replies benchmarks/results/hf-quantized-smollm2-2026-12-07.json \\
        --tag quant-smollm2-2026-12-07          # bhqk's env: the paired intervals, in grade.py's table

Configurations (``--configs``): ``full`` (the model's own ``DynamicCache``), ``quanto-int4``, ``quanto-int2``,
``hqq-int4``, ``hqq-int2``: ``QuantizedCache(backend, config, nbits, axis_key=axis_value=AXIS, q_group_size=32,
residual_length=64)`` — bhqk's group and float window (transformers' defaults are 64 and 128). Axis: quanto 0
(its groups are 32 consecutive channels of one position: per token, as bhqk's), HQQ 1 (transformers' advice
for HQQ; its axis 0 groups 32 elements strided across heads and positions). Both keep scales and zero points
in the model's dtype (fp32 here; bhqk: fp16). What transformers does: the first update (the prefill) quantizes
every position and returns them in float; later updates dequantize the whole layer, append the new positions
in float and, once ``residual_length`` float positions have gathered, quantize the whole layer again.

Models with sliding-window layers (Gemma 3): ``QuantizedCache`` refuses them (``ValueError``: only full
attention). The error is recorded; with ``--force-sliding`` the cache is built from the same quantized layers
for every layer (``Cache(layers=[...])``), which then quantizes the sliding layers too and keeps all of their
positions (the mask hides the old ones); its configurations are named ``…-forced``.

Parts (``--parts``):

- ``bytes``: after a prefill of ``--n`` tokens of the text (one sequence; one forward, whose keys and values
  fill each configuration's cache through its ``update``: :func:`prefilled`), the bytes the cache holds: the
  storage of every tensor it keeps (quantized integers, scales, zero points, float residual keys and values;
  a tensor subclass counted through its inner tensors, each storage once), and the logical ``nbytes`` of the
  same tensors; the full cache's storage includes what a sliding layer's view keeps of the prefill.
- ``ppl``: the perplexity of the first ``--ppl`` tokens of the text fed ``--chunk`` tokens at a time through
  the cache (benchmarks/quant.py's text: ``corpus.prefix + corpus.filler``, and its loop).
- ``tasks``: the graded set (``needle`` and ``multikey`` at 1,024 tokens, trials 0–29, seed 0: the curve's 60
  prompts, ``bhqk.evaluate.tasks.make``), replies greedy on each cache as ``bhqk.evaluate.grade.reply`` gives
  them (bhqk's loop, stopped at the same end tokens), scored by ``Prompt.score``; ``grade.py --part import``
  adds them to a grade.py run on the same prompts for the paired intervals.
- ``step``: the median of ``--steps`` decode steps after a prefill of ``--n`` tokens (filled as for ``bytes``),
  each at its true position, and ``uptime``'s load
  (run it alone, under ``flock /tmp/bhqk-cpu.lock``).

Writes ``benchmarks/results/hf-quantized-<tag>.json`` (merged part by part; CPU model and flags from
benchmarks/machine.py, versions, every reply).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src" / "bhqk"
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
GROUP, RESIDUAL = 32, 64  # bhqk's (budget/quant.py GROUP, RESIDUAL)
BACKENDS = {"quanto-int4": ("quanto", 4, 0), "quanto-int2": ("quanto", 2, 0),
            "hqq-int4": ("hqq", 4, 1), "hqq-int2": ("hqq", 2, 1)}  # name -> (backend, nbits, axis)
TASKS, LENGTH, TRIALS, SEED = ("needle", "multikey"), 1024, 30, 0


def load_file(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def bhqk_files() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """(corpus, tasks, greedy): bhqk's files loaded by path under a stand-in package ``_bhqk`` (no bhqk import)."""
    for name in ("_bhqk", "_bhqk.evaluate", "_bhqk.integrations"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []  # a package: relative imports resolve against it
        sys.modules[name] = pkg
    corpus = load_file(SRC / "corpus.py", "_bhqk.corpus")
    tasks = load_file(SRC / "evaluate" / "tasks.py", "_bhqk.evaluate.tasks")
    greedy = load_file(SRC / "integrations" / "greedy.py", "_bhqk.integrations.greedy")
    return corpus, tasks, greedy


def load_model(folder: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):  # a record of the GGUF it came from; the weights are fp32
        del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def make_cache(model, name: str):
    """A fresh cache of configuration ``name`` (module doc); ``…-forced``: every layer a quantized one."""
    from transformers import Cache, DynamicCache, QuantizedCache
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    if name == "full":
        return DynamicCache(config=model.config)
    forced = name.endswith("-forced")
    backend, nbits, axis = BACKENDS[name.removesuffix("-forced")]
    kw = {"nbits": nbits, "axis_key": axis, "axis_value": axis, "q_group_size": GROUP, "residual_length": RESIDUAL}
    if not forced:
        return QuantizedCache(backend, model.config, **kw)
    layer = QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer
    return Cache(layers=[layer(**kw) for _ in range(model.config.get_text_config(decoder=True).num_hidden_layers)])


def refusal(model, name: str) -> str | None:
    """The error ``QuantizedCache`` raises for this model (None: it builds)."""
    try:
        make_cache(model, name)
    except Exception as e:  # transformers raises ValueError; an ImportError where a backend is missing
        return f"{type(e).__name__}: {e}"
    return None


def _tensors(obj):
    """The plain tensors an object of the cache holds: a tensor subclass (quanto) through its inner
    tensors, HQQ's (W_q, meta) through its scale and zero."""
    import torch

    if obj is None:
        return
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict):  # HQQ: (W_q, meta)
        yield from _tensors(obj[0])
        for k in ("scale", "zero"):
            if torch.is_tensor(obj[1].get(k)):
                yield from _tensors(obj[1][k])
        return
    if torch.is_tensor(obj) and type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        for inner in obj.__tensor_flatten__()[0]:
            yield from _tensors(getattr(obj, inner))
        return
    if torch.is_tensor(obj):
        yield obj


def cache_bytes(cache) -> dict:
    """Bytes the cache holds (module doc): ``storage`` (each storage once) and ``logical`` (tensor nbytes),
    split into quantized (integers + scales + zero points) and float (residual, or a full cache's keys)."""
    seen: set[int] = set()
    out = {"storage": 0, "logical": 0, "quantized_storage": 0, "float_storage": 0}
    for layer in cache.layers:
        for part, objs in (("quantized", (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None))),
                           ("float", (layer.keys, layer.values))):
            for o in objs:
                for t in _tensors(o):
                    out["logical"] += t.nbytes
                    st = t.untyped_storage()
                    if st.data_ptr() in seen or st.nbytes() == 0:
                        continue
                    seen.add(st.data_ptr())
                    out["storage"] += st.nbytes()
                    out[f"{part}_storage"] += st.nbytes()
    return out


def text_ids(corpus, tok, n: int):
    import torch

    ids = corpus.prefix(tok) + corpus.filler(tok)  # benchmarks/quant.py's text
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n}")
    return torch.tensor([ids[:n]])


def prefilled(model, ids):
    """One prefill of ``ids`` [1, n] into a cache that keeps every position of every layer: per layer (keys,
    values), and the next token [1, 1]. Every configuration's cache is then filled from these (:func:`filled`)
    instead of running the model again: the prefill's attention never reads the cache, so a cache's state
    after the model's prefill is what its ``update`` makes of the same keys and values."""
    import torch
    from transformers import Cache
    from transformers.cache_utils import DynamicLayer

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = Cache(layers=[DynamicLayer() for _ in range(layers)])
    with torch.no_grad():
        o = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return [(la.keys, la.values) for la in cache.layers], o.logits[:, -1:].argmax(-1)


def filled(model, name: str, kv):
    """A fresh cache of ``name`` after :func:`prefilled`'s keys and values (one ``update`` per layer)."""
    cache = make_cache(model, name)
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def part_bytes(model, corpus, tok, names: list[str], n: int) -> dict:
    t0 = time.perf_counter()
    kv, _ = prefilled(model, text_ids(corpus, tok, n))
    print(f"prefill {n}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = {}
    for name in names:
        t0 = time.perf_counter()
        cache = filled(model, name, kv)
        rows[name] = {**cache_bytes(cache), "layers": [type(la).__name__ for la in cache.layers][:1] +
                      sorted({type(la).__name__ for la in cache.layers}), "seconds": time.perf_counter() - t0}
        print(f"bytes {name}: {rows[name]['storage']} storage, {rows[name]['logical']} logical", flush=True)
    if "full" in rows:
        for r in rows.values():
            r["ratio_storage"] = r["storage"] / rows["full"]["storage"]
            r["ratio_logical"] = r["logical"] / rows["full"]["logical"]
    return {"n": n, "rows": rows}


def part_ppl(model, corpus, tok, names: list[str], n: int, chunk: int) -> dict:
    from chunked import perplexity  # benchmarks/chunked.py: benchmarks/quant.py's rule (torch only)

    ids = text_ids(corpus, tok, n)
    rows = {}
    for name in names:
        t0 = time.perf_counter()
        rows[name] = perplexity(model, ids, make_cache(model, name), chunk)
        print(f"ppl {n} {name}: {rows[name]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"n": n, "chunk": chunk, "ppl": rows,
            "ratio": {k: v / rows["full"] for k, v in rows.items()} if "full" in rows else {}}


def part_tasks(model, tasks, greedy, tok, names: list[str], old: dict | None, save=None) -> dict:
    prompts = [tasks.make(tok, t, LENGTH, i, SEED) for t in TASKS for i in range(TRIALS)]
    eos = greedy.eos_ids(model, tok)
    out = old or {"length": LENGTH, "seed": SEED, "prompts": [p.to_json() for p in prompts], "entries": {}}
    if out["prompts"] != [p.to_json() for p in prompts]:
        raise SystemExit("tasks: the stored prompts are not those made now: use another --tag")
    for name in names:
        if len(out["entries"].get(name, [])) == len(prompts):
            continue
        t0, entries = time.perf_counter(), out["entries"].get(name, [])  # a partial run resumes
        for p in prompts[len(entries):]:
            r = greedy.greedy(model, p.ids, make_cache(model, name), max_new_tokens=p.max_new_tokens, eos=eos,
                              keyword="cache")
            text = tok.decode(r.tokens, skip_special_tokens=True).strip()
            entries.append({"task": p.task, "length": p.length, "trial": p.trial, "reply": text,
                            "correct": p.score(text), "new_tokens": len(r.tokens), "prefill_s": round(r.prefill_s, 4),
                            "decode_s": round(r.decode_s, 4)})
            if save is not None and len(entries) % 10 == 0:  # every 10 replies: an interrupted run keeps them
                out["entries"][name] = entries
                save(out)
        out["entries"][name] = entries
        k = {t: sum(e["correct"] for e in entries if e["task"] == t) for t in TASKS}
        print(f"tasks {name}: " + ", ".join(f"{t} {k[t]}/{TRIALS}" for t in TASKS) +
              f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def part_step(model, corpus, tok, names: list[str], n: int, steps: int) -> dict:
    import torch

    kv, first = prefilled(model, text_ids(corpus, tok, n))
    rows = {}
    for name in names:
        cache = filled(model, name, kv)
        times = []
        nxt = first
        with torch.no_grad():
            for i in range(steps):
                t0 = time.perf_counter()
                o = model(input_ids=nxt, cache=cache, use_cache=True,
                          position_ids=torch.tensor([[n + i]]))
                times.append(time.perf_counter() - t0)
                nxt = o.logits[:, -1:].argmax(-1)
        rows[name] = {"median_s": statistics.median(times), "steps_s": times, "uptime": uptime()}
        print(f"step {name}: {1e3 * rows[name]['median_s']:.0f} ms ({rows[name]['uptime']})", flush=True)
    return {"n": n, "steps": steps, "rows": rows}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return f"loadavg {os.getloadavg()}"


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for p in ("optimum-quanto", "hqq", "transformers", "torch", "accelerate", "tokenizers"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="bhqk's converted HF folder (~/.cache/bhqk/...)")
    p.add_argument("--parts", default="bytes,ppl,tasks", help="bytes, ppl, tasks, step (comma-separated)")
    p.add_argument("--configs", default="full,quanto-int4,quanto-int2,hqq-int4,hqq-int2")
    p.add_argument("--force-sliding", action="store_true", help="a model with sliding layers: quantize every layer "
                   "(…-forced configurations) where QuantizedCache refuses")
    p.add_argument("--n", type=int, default=8192, help="prompt tokens for bytes and step")
    p.add_argument("--ppl", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    import torch

    import machine  # benchmarks/machine.py: torch and the standard library only

    torch.set_grad_enabled(False)
    corpus, tasks, greedy = bhqk_files()
    model, tok = load_model(a.model)
    path = RESULTS / f"hf-quantized-{a.tag}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    names = a.configs.split(",")
    refused = {n: refusal(model, n) for n in names if n != "full"}
    run_names = []
    for n in names:
        if n == "full" or refused[n] is None:
            run_names.append(n)
        elif a.force_sliding and refused[n].startswith("ValueError") and "full attention" in refused[n]:
            run_names.append(f"{n}-forced")
        else:
            print(f"{n}: refused: {refused[n]}", flush=True)
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    data.setdefault("runs", []).append({**machine.describe(), "versions": versions(), "model": str(a.model),
                                        "layer_types": layer_types, "refused": refused, "configs": run_names,
                                        "group": GROUP, "residual": RESIDUAL, "axes": {k: v[2] for k, v in BACKENDS.items()},
                                        "corpus_py_sha256": hashlib.sha256((SRC / "corpus.py").read_bytes()).hexdigest(),
                                        "tasks_py_sha256": hashlib.sha256((SRC / "evaluate/tasks.py").read_bytes()).hexdigest(),
                                        "attn_implementation": "sdpa", "dtype": "float32"})
    RESULTS.mkdir(exist_ok=True)

    def save(key: str) -> None:  # merged into the file as it is now: runs of other parts may write it meanwhile
        now = json.loads(path.read_text()) if path.exists() else {}
        now["runs"] = now.get("runs", []) + [r for r in data["runs"] if r not in now.get("runs", [])]
        now[key] = {**now.get(key, {}), **data[key]} if isinstance(data[key], dict) else data[key]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(now, indent=1))
        tmp.replace(path)

    for part in a.parts.split(","):
        if part == "bytes":
            data["bytes"] = {**data.get("bytes", {}), str(a.n): part_bytes(model, corpus, tok, run_names, a.n)}
        elif part == "ppl":
            data["ppl"] = {**data.get("ppl", {}), str(a.ppl): part_ppl(model, corpus, tok, run_names, a.ppl, a.chunk)}
        elif part == "tasks":
            def save_tasks(out: dict) -> None:
                data["tasks"] = out
                save("tasks")

            data["tasks"] = part_tasks(model, tasks, greedy, tok, run_names, data.get("tasks"), save_tasks)
        elif part == "step":
            data.setdefault("step", []).append({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                                **part_step(model, corpus, tok, run_names, a.n, a.steps)})
        else:
            p.error(f"unknown part {part!r}")
        save({"bytes": "bytes", "ppl": "ppl", "tasks": "tasks", "step": "step"}[part])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
