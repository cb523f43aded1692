"""Quantized keys and values in the budget cache on SmolLM2-135M-Instruct (or ``--model gemma3-270m``): bytes
and chunked perplexity.

    flock /tmp/bhqk-cpu.lock python benchmarks/quant.py [--model M] [--n 8192] [--ppl 2048,4096] [--chunk 128] --tag T

- bytes after ``--n`` tokens (one sequence), against the model's own fp32 cache (``DynamicCache``): the
  full plan and the quarter plan (``--quarter`` at 0.25, sink 64, window 256: benchmarks/budget.py's; by
  default ``fisher-stored`` for SmolLM2, the curve's stored scores, and ``fisher``, computed by ``find``,
  for any other model),
  ``bits`` None / 8 / 4 (group 32, a float window of 64): ``Plan.nbytes`` predicted, and for ``--measure``
  configurations the cache's ``nbytes()`` after a prefill of ``--n`` tokens (they must agree).
- perplexity of the first N tokens of ``pydoc_data.topics`` (``bhqk.corpus``) for each N of ``--ppl``,
  fed in chunks of ``--chunk`` tokens through the cache (each chunk reads the earlier ones from the cache,
  so the quantized positions are read as a decode step reads them), per configuration, and its ratio to
  the full cache's.

Writes ``benchmarks/results/quant-<tag>.json`` with the CPU model and flags (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  # CPU model and flags for every JSON
from budget import load, make_plan  # noqa: E402  # the model; the quarter plan of benchmarks/budget.py
from chunked import perplexity  # noqa: E402  # the one chunked perplexity

RESULTS = Path(__file__).resolve().parent / "results"
SINK, WINDOW = 64, 256


def plans(model, tok, quarter: str = "fisher-stored") -> dict:
    return {"full": make_plan(model, tok, "full", 1.0, SINK, WINDOW),
            "quarter": make_plan(model, tok, quarter, 0.25, SINK, WINDOW)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="tokens for the bytes")
    ap.add_argument("--ppl", default="2048,4096", help="text lengths for the chunked perplexity (empty: none)")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--measure", default="full:4,quarter:4", help="plan:bits whose nbytes is measured at --n "
                    "(own:0: the model's own cache)")
    ap.add_argument("--steps", type=int, default=0, help="decode steps timed after each measured prefill (median)")
    ap.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--model", default="smollm2-135m", help="a bhqk.models.pretrained name")
    ap.add_argument("--quarter", default=None, help="the quarter plan's score (default: fisher-stored for "
                    "smollm2-135m, whose scores are stored; fisher otherwise)")
    a = ap.parse_args()
    quarter = a.quarter or ("fisher-stored" if a.model == "smollm2-135m" else "fisher")
    from transformers import DynamicCache

    from bhqk import corpus

    model, tok = load(a.model)
    text = corpus.prefix(tok) + corpus.filler(tok)  # the corpus's one rule: a text starts as its tokenizer starts one
    ps = plans(model, tok, quarter)
    own = ps["full"].nbytes(a.n, model)[1]
    out: dict = {"meta": {**machine.describe(), "model": f"{a.model} (fp32)", "quarter": quarter, "n": a.n, "chunk": a.chunk,
                          "sink": SINK, "window": WINDOW, "group": 32, "residual": 64}, "bytes": {}, "ppl": {}}
    for pname, plan in ps.items():
        for bits in (None, 8, 4):
            got = plan.nbytes(a.n, model, bits=bits)[0]
            out["bytes"][f"{pname} bits={bits}"] = {"predicted": got, "ratio": got / own}
    out["bytes"]["own cache"] = {"predicted": own, "ratio": 1.0}
    ids = torch.tensor([text[:a.n]])  # [1, n]
    for spec in filter(None, a.measure.split(",")):
        pname, b = spec.split(":")
        own_cache = pname == "own"
        cache = DynamicCache(config=model.config) if own_cache else ps[pname].cache(model, bits=int(b))
        key = "own cache" if own_cache else f"{pname} bits={b}"
        with torch.no_grad():
            o = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            steps = []
            nxt = o.logits[:, -1:].argmax(-1)  # [1, 1]
            for _ in range(a.steps):
                t0 = time.perf_counter()
                o = model(input_ids=nxt, cache=cache, use_cache=True)
                steps.append(time.perf_counter() - t0)
                nxt = o.logits[:, -1:].argmax(-1)
        if steps:
            out["bytes"][key]["step_median_s"] = sorted(steps)[len(steps) // 2]
        held = sum(la.keys.nbytes + la.values.nbytes for la in cache.layers) if own_cache else cache.nbytes()
        out["bytes"][key]["measured"] = held
        print(f"measured {spec}: {held} bytes" + (f", decode step {1e3 * out['bytes'][key]['step_median_s']:.0f} ms"
                                                  if steps else ""), flush=True)
    for n in [int(x) for x in a.ppl.split(",") if x]:
        ids = torch.tensor([text[:n]])
        row = {"own cache": perplexity(model, ids, DynamicCache(config=model.config), a.chunk)}
        for pname, plan in ps.items():
            for bits in (None, 8, 4):
                if pname == "full" and bits is None:
                    continue
                t0 = time.perf_counter()
                row[f"{pname} bits={bits}"] = perplexity(model, ids, plan.cache(model, bits=bits), a.chunk)
                print(f"ppl n={n} {pname} bits={bits}: {row[f'{pname} bits={bits}']:.4f} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
        out["ppl"][str(n)] = row
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"quant-{a.tag}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\n{a.model}, {out['meta']['cpu_model']}; bytes after {a.n} tokens (fp32 own cache {own / 2**20:.1f} MiB):")
    print(f"{'configuration':<22}{'bytes':>14}{'× own':>8}{'measured':>14}{'step ms':>10}")
    for k, v in out["bytes"].items():
        step = f"{1e3 * v['step_median_s']:.0f}" if "step_median_s" in v else ""
        print(f"{k:<22}{v['predicted']:>14}{v['ratio']:>8.3f}{v.get('measured', ''):>14}{step:>10}")
    for n, row in out["ppl"].items():
        base = row["own cache"]
        print(f"\nperplexity, {n} tokens in chunks of {a.chunk}:")
        for k, v in row.items():
            print(f"{k:<22}{v:>10.4f}{v / base:>10.4f}×")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
