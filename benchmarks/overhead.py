#!/usr/bin/env python
"""Per-call overhead of ``bhqk.attention``: a GPT-2 decode step's attention (q [1, 12, 1, 64],
k/v [1, 12, 256, 64], ``causal("bottom_right")``, no grad) on ``auto`` and on the ``torch``
backend against ``F.scaled_dot_product_attention`` called directly (issue 19's target: auto ≤ 2×).
The calls are interleaved round by round; quoted: the median of each one's per-round means, and the
median of the per-round ratios (the machine is shared: a burst of load hits one round's calls alike).

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
        means: dict[str, list[float]] = {n: [] for n in fns}
        with torch.no_grad():
            for f in fns.values():
                for _ in range(20):
                    f()
            for _ in range(a.rounds):
                for n, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(a.calls):
                        f()
                    means[n].append((time.perf_counter() - t) / a.calls)
        us = {n: 1e6 * statistics.median(m) for n, m in means.items()}
        ratio = {n: statistics.median(t / s for t, s in zip(means[n], means["sdpa"])) for n in ("auto", "torch")}  # per round
        choice = bhqk.choose_backend(q, k, v, mask).name
        row = {"case": name, "us": {n: round(t, 2) for n, t in us.items()}, "auto_runs": choice,
               "auto_over_sdpa": round(ratio["auto"], 3), "torch_over_sdpa": round(ratio["torch"], 3)}
        rows.append(row)
        print(f"{name:40s} sdpa {us['sdpa']:7.1f} µs  auto {us['auto']:7.1f} µs ({row['auto_over_sdpa']:.2f}×, runs "
              f"{choice})  torch {us['torch']:7.1f} µs ({row['torch_over_sdpa']:.2f}×)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "command": " ".join(sys.argv), "threads": torch.get_num_threads(),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
