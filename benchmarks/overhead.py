#!/usr/bin/env python
"""Per-call overhead of ``bhqk.attention``: a GPT-2 decode step's attention (q [1, 12, 1, 64],
k/v [1, 12, 256, 64], ``causal("bottom_right")``, no grad) on ``auto`` and on the ``torch``
backend against ``F.scaled_dot_product_attention`` called directly (issue 19's target: auto ≤ 2×).
The calls are interleaved round by round; quoted: the median of each one's per-round means, and the
median of the per-round ratios (the machine is shared: a burst of load hits one round's calls alike),
with the range of those ratios.

With transformers installed, also the attention function of a Hugging Face Llama layer for one
decode step (q [1, 12, 1, 64], k/v [1, 4, 576, 64], GQA): ``attn_implementation="bhqk"``'s function
with the ``HFMask`` its mask builder makes, against transformers' own ``sdpa_attention_forward``
with the mask its sdpa builder makes for that step (None).

    flock /tmp/bhqk-cpu.lock python benchmarks/overhead.py            # ~20 s
    python benchmarks/overhead.py --rounds 5 --calls 200 --out /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import json
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

CASES = {  # name -> (Q, K, mask): the decode step of the issue, and a prefill-sized step for scale
    "decode Q=1 K=256 causal(bottom_right)": (1, 256, masks.causal("bottom_right")),
    "decode Q=1 K=1024 causal(bottom_right)": (1, 1024, masks.causal("bottom_right")),
    "Q=K=64 causal": (64, 64, masks.causal()),
}


def interleaved(name: str, fns: dict, rounds: int, calls: int) -> dict:
    """Time ``fns`` (the first is the baseline) round by round, interleaved; print and return the row."""
    means: dict[str, list[float]] = {n: [] for n in fns}
    base = next(iter(fns))
    with torch.no_grad():
        for f in fns.values():
            for _ in range(20):
                f()
        for _ in range(rounds):
            for n, f in fns.items():
                t = time.perf_counter()
                for _ in range(calls):
                    f()
                means[n].append((time.perf_counter() - t) / calls)
    us = {n: 1e6 * statistics.median(m) for n, m in means.items()}
    row: dict = {"case": name, "baseline": base, "us": {n: round(t, 2) for n, t in us.items()}}
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
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "local" / "overhead.json"))
    a = ap.parse_args()
    meta = describe()
    print(one_line(meta))
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (Q, K, mask) in CASES.items():
        q = torch.randn(1, 12, Q, 64, generator=g)
        k, v = torch.randn(1, 12, K, 64, generator=g), torch.randn(1, 12, K, 64, generator=g)
        causal = Q == K and mask is not None  # what a caller of SDPA passes for this mask (Q = 1: nothing)
        fns = {
            "sdpa": partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal),
            "auto": partial(bhqk.attention, q, k, v, mask),
            "torch": partial(bhqk.attention, q, k, v, mask, backend="torch"),
        }
        torch.testing.assert_close(fns["auto"](), fns["sdpa"]())  # the same answer
        row = interleaved(name, fns, a.rounds, a.calls)
        row["auto_runs"] = bhqk.choose_backend(q, k, v, mask).name
        rows.append(row)
    hf = hf_functions(g)
    if hf is not None:
        rows.append(interleaved("HF Llama decode step, K=576, GQA 12/4", hf, a.rounds, a.calls))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "command": " ".join(sys.argv), "threads": torch.get_num_threads(),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
