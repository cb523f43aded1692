#!/usr/bin/env python
"""Per-call overhead of ``bhqk.attention``: a GPT-2 decode step's attention (q [1, 12, 1, 64],
k/v [1, 12, 256, 64], ``causal("bottom_right")``, no grad), a GQA one (k/v [1, 4, 512, 64]) and a
small causal call, on ``auto`` and on the ``torch`` backend against ``F.scaled_dot_product_attention``
called directly (``enable_gqa=True`` for GQA). The calls are interleaved round by round (the order
reversed every round); quoted: the median of each one's per-round means, and the median of the
per-round ratios (the machine is shared: a burst of load hits one round's calls alike), with the
range of those ratios. With ``--threads 1`` the time is the calling thread's CPU time (what other
jobs on the machine take is wall time, not this); with more, wall time.

With transformers installed, also the attention function of a Hugging Face Llama layer for one
decode step (q [1, 12, 1, 64], k/v [1, 4, 576, 64], GQA): ``attn_implementation="bhqk"``'s function
with the ``HFMask`` its mask builder makes, against transformers' own ``sdpa_attention_forward``
with the mask its sdpa builder makes for that step (None).

    flock /tmp/bhqk-cpu.lock python benchmarks/overhead.py            # ~30 s
    python benchmarks/overhead.py --threads 1 --out benchmarks/results/overhead-1thread.json
    python benchmarks/overhead.py --rounds 5 --calls 200 --out /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bhqk  # noqa: E402
from bhqk import masks  # noqa: E402
from machine import describe, one_line  # noqa: E402

CASES = {  # name -> (Q, K, Hkv, mask): decode steps (MHA, GQA), and a prefill-sized step for scale
    "decode Q=1 K=256 causal(bottom_right)": (1, 256, 12, masks.causal("bottom_right")),
    "decode Q=1 K=1024 causal(bottom_right)": (1, 1024, 12, masks.causal("bottom_right")),
    "decode Q=1 K=512 GQA 12/4 causal(bottom_right)": (1, 512, 4, masks.causal("bottom_right")),
    "Q=K=64 causal": (64, 64, 12, masks.causal()),
}


def interleaved(name: str, fns: dict, rounds: int, calls: int, tick=time.perf_counter) -> dict:
    """Time ``fns`` (the first is the baseline) round by round, interleaved (the order reversed every
    round) on the clock ``tick``; print and return the row (with every round's mean, µs)."""
    means: dict[str, list[float]] = {n: [] for n in fns}
    base = next(iter(fns))
    with torch.no_grad():
        for f in fns.values():
            for _ in range(20):
                f()
        for r in range(rounds):
            for n in (fns if r % 2 else list(fns)[::-1]):
                f = fns[n]
                t = tick()
                for _ in range(calls):
                    f()
                means[n].append((tick() - t) / calls)
    us = {n: 1e6 * statistics.median(m) for n, m in means.items()}
    row: dict = {"case": name, "baseline": base, "us": {n: round(t, 2) for n, t in us.items()},
                 "rounds_us": {n: [round(1e6 * x, 2) for x in m] for n, m in means.items()}}
    text = f"{name:40s} {base} {us[base]:7.1f} µs"
    for n in list(fns)[1:]:
        ratios = [t / s for t, s in zip(means[n], means[base])]  # per round
        row[f"{n}_over_{base}"] = round(statistics.median(ratios), 3)
        row[f"{n}_over_{base}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        text += f"  {n} {us[n]:7.1f} µs ({row[f'{n}_over_{base}']:.2f}×, {min(ratios):.2f}–{max(ratios):.2f})"
    print(text)
    return row


def hf_functions(g: torch.Generator) -> dict | None:
    """transformers' sdpa attention function and bhqk's, on one Llama decode step (None without transformers)."""
    try:
        import transformers
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import causal_mask_function
    except ImportError:
        return None
    from bhqk.integrations import hf_attention as integration

    integration.register()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=768, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=12, num_key_value_heads=4, attn_implementation="bhqk")
    module = transformers.LlamaForCausalLM(config).eval().model.layers[0].self_attn
    K = 576
    q = torch.randn(1, 1, 12, 64, generator=g).transpose(1, 2)  # [B, Q, H, d] -> [B, H, Q, d], as the layer makes it
    k, v = torch.randn(1, 4, K, 64, generator=g), torch.randn(1, 4, K, 64, generator=g)
    mask = integration.build_mask(1, 1, K, q_offset=K - 1, kv_offset=0, mask_function=causal_mask_function)
    ours = integration._attention_for("auto")
    fns = {"hf_sdpa": partial(sdpa_attention_forward, module, q, k, v, None, dropout=0.0, scaling=0.125),
           "bhqk": partial(ours, module, q, k, v, mask, dropout=0.0, scaling=0.125)}
    torch.testing.assert_close(fns["bhqk"]()[0], fns["hf_sdpa"]()[0])  # the same answer
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=300, help="calls per round and function")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1: the thread's CPU time; default: torch's)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "local" / "overhead.json"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tick = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    meta = describe()
    print(one_line(meta), f"{torch.get_num_threads()} thread(s), {'thread CPU' if torch.get_num_threads() == 1 else 'wall'} "
          f"time, load {meta['loadavg_start'][0]:.1f}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (Q, K, Hkv, mask) in CASES.items():
        q = torch.randn(1, 12, Q, 64, generator=g)
        k, v = torch.randn(1, Hkv, K, 64, generator=g), torch.randn(1, Hkv, K, 64, generator=g)
        causal = Q == K and mask is not None  # what a caller of SDPA passes for this mask (Q = 1: nothing)
        fns = {
            "sdpa": partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal, enable_gqa=Hkv != 12),
            "auto": partial(bhqk.attention, q, k, v, mask),
            "torch": partial(bhqk.attention, q, k, v, mask, backend="torch"),
        }
        torch.testing.assert_close(fns["auto"](), fns["sdpa"]())  # the same answer
        row = interleaved(name, fns, a.rounds, a.calls, tick)
        row["auto_runs"] = bhqk.choose_backend(q, k, v, mask).name
        rows.append(row)
    hf = hf_functions(g)
    if hf is not None:
        rows.append(interleaved("HF Llama decode step, K=576, GQA 12/4", hf, a.rounds, a.calls, tick))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta["loadavg_end"] = os.getloadavg()
    print(f"load {meta['loadavg_start'][0]:.1f} → {meta['loadavg_end'][0]:.1f}")
    out.write_text(json.dumps({"meta": meta, "command": " ".join(sys.argv), "threads": torch.get_num_threads(),
                               "clock": "thread CPU" if tick is time.thread_time else "wall", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
