"""What looking at a budget-run model costs: decode steps of SmolLM2-135M-Instruct after a prefill of N tokens
of ``pydoc_data.topics``, with a hand-made half plan (the K/V heads of the first 15 of 30 layers full, the rest
streaming, sink 64, window 256; no ``find``), three ways:

- ``budget``: ``plan.cache()``, nobody looking (the groups' calls);
- ``budget + capture``: the same inside ``bhqk.capture(model=..., what=("entropy", "distance", "sink",
  "received"))`` — every layer then runs as one call over every position (the keys copied into
  [B, Hkv, N, d] buffers);
- ``emulated + capture``: ``plan.emulate(model)`` over ``DynamicCache()`` inside the same capture (the run
  whose records the budget run's equal).

Median and range of ``--steps`` decode steps each (after one untimed step), and the bytes the one-call view
copies per observed step (keys and values of every layer with streaming heads, over every position).

    python benchmarks/budget_capture.py --n 2048 --steps 5 --out benchmarks/results/budget-capture.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # benchmarks/machine.py: CPU model and flags for every JSON  # noqa: E402


def steps(model, nxt, kw: dict, n: int, look) -> list[float]:
    """``n`` timed decode steps (after one untimed one), each inside ``look()``."""
    out = []
    for i in range(n + 1):
        with look():
            t0 = time.perf_counter()
            o = model(input_ids=nxt, use_cache=True, **kw)
            dt = time.perf_counter() - t0
        nxt = o.logits[:, -1:].argmax(-1)  # [1, 1]
        if i:
            out.append(dt)
    return out


def main() -> None:
    import contextlib

    import transformers

    import bhqk
    from bhqk import corpus
    from bhqk.budget import Plan
    from bhqk.integrations.transformers import cache_keyword
    from bhqk.models import pretrained

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per way (default 5)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    model, tok = pretrained("smollm2-135m")
    cfg = model.config
    L, Hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    full = torch.zeros(L, Hkv, dtype=torch.bool)
    full[: L // 2] = True
    plan = Plan(full, sink=64, window=256)
    ids = corpus.chunks(tok, a.n, 1)  # [1, N]: the tokenizer's start of a text, then the text (bhqk.corpus)
    what = ("entropy", "distance", "sink", "received")

    def capture():
        return bhqk.capture(model=model, what=what)

    results = {}
    ways = {"budget": (lambda: plan.cache(model), contextlib.nullcontext, contextlib.nullcontext),
            "budget + capture": (lambda: plan.cache(model), contextlib.nullcontext, capture),
            "emulated + capture": (transformers.DynamicCache, lambda: plan.emulate(model), capture)}
    with torch.no_grad():
        for name, (make, around, look) in ways.items():
            cache = make()
            kw = {cache_keyword(model): cache}
            with around():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)  # the prefill, not timed
                ts = steps(model, out.logits[:, -1:].argmax(-1), kw, a.steps, look)
            results[name] = {"steps_s": ts, "median_s": statistics.median(ts)}
            print(f"{name}: decode step median {1e3 * statistics.median(ts):.0f} ms "
                  f"(range {1e3 * min(ts):.0f}–{1e3 * max(ts):.0f} ms over {len(ts)})", flush=True)
    layers = int((~plan.full).any(1).sum())  # layers with streaming heads
    N = a.n + a.steps + 1
    copied = layers * 2 * Hkv * N * d * 4  # keys and values, float32, every position
    print(f"the one-call view copies {copied / 2**20:.1f} MiB per observed decode step at N = {N} "
          f"({layers} layers × keys and values × Hkv = {Hkv} × d = {d} × N, float32)")
    info = machine.describe()
    print(machine.one_line(info))
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": {**info, "note": "shared 2-core machine: timings are noisy"},
                                           "n": a.n, "plan": repr(plan), "copied_bytes_per_step": copied,
                                           "ways": results}, indent=1))


if __name__ == "__main__":
    main()
