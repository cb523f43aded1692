#!/usr/bin/env python
"""Compile time and compile count of bhqk's ``backend="flex"`` on this machine: the first call of a
mask/bias structure compiles; later calls with new lengths (Q ≠ K, both above one 128 tile), new
windows and new padding must not (0 new graphs). B=1, H=8, Hkv=2, d=64, fp32, forward.

    python benchmarks/flex_compile.py [OUT.json]      # default benchmarks/results/local/flex_compile.json
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/flex_compile.py   # cold: no on-disk cache
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch._dynamo.utils import counters  # noqa: E402

import bhqk  # noqa: E402
from bhqk import bias as biases  # noqa: E402
from bhqk import masks  # noqa: E402
from bhqk.functional import flex  # noqa: E402
from machine import describe, one_line  # noqa: E402

warnings.filterwarnings("ignore")
g = torch.Generator().manual_seed(0)


def call(Q: int, K: int, w: int, structure: str) -> float:
    q = torch.randn(1, 8, Q, 64, generator=g)  # [B, H, Q, d]
    k, v = (torch.randn(1, 2, K, 64, generator=g) for _ in range(2))  # [B, Hkv, K, d]
    m, kw = masks.sliding_window(w, align="bottom_right"), {}
    if structure != "window":
        m = m & masks.padding(torch.tensor([K - 3]))
        kw = dict(bias=biases.alibi(8, "bottom_right"), softcap=30.0)
    t = time.perf_counter()
    with torch.no_grad():
        bhqk.attention(q, k, v, m, backend="flex", **kw)
    return time.perf_counter() - t


def main() -> None:
    meta = describe()
    meta["inductor_caches"] = "off" if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") else "on"
    print(one_line(meta) + f", inductor caches {meta['inductor_caches']}")
    rows = []
    for structure in ("window", "window&padding+alibi+softcap"):
        for Q, K, w in ((1000, 1500, 256), (2048, 2125, 100), (4096, 4000, 256), (777, 3001, 31)):
            before = counters["stats"]["unique_graphs"]
            dt = call(Q, K, w, structure)
            rows.append({"structure": structure, "Q": Q, "K": K, "window": w, "seconds": dt,
                         "new_graphs": counters["stats"]["unique_graphs"] - before})
            print(f"{structure:>30} Q={Q} K={K} window={w}: {dt:.2f} s, new graphs {rows[-1]['new_graphs']}", flush=True)
    meta["loadavg_end"] = os.getloadavg()
    print(f"kernels: {len(flex.kernels())}")
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "local" / "flex_compile.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "kernels": len(flex.kernels()), "calls": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
