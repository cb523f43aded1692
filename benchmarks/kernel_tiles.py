#!/usr/bin/env python
"""What a block of R query rows costs PyTorch's fused CPU flash kernel on a band: the kernel splits a
call's queries into tiles of 32 rows below 192 query rows, 64 below 768 and 256 above (keys in
tiles of 512; aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), so its cost per score entry
depends on R, while a band of width W costs R + W entries per row. This times one batched masked
call (N/R blocks of R rows over R + W keys each, as the span path makes them) forward and backward
for several R, and prints ns per row and per entry: the data behind the span path's band rule
(spans._band_rows). B = 1, H = 8, d = 64.

    OMP_NUM_THREADS=1 python benchmarks/kernel_tiles.py --rows 16 32 64 128 192 256 --repeat 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 192, 256])
    ap.add_argument("--n", type=int, default=8192, help="query rows in all")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeat", type=int, default=4)
    a = ap.parse_args()
    dt = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    H, d, N, W = 8, 64, a.n, a.window
    g = torch.Generator().manual_seed(0)
    runs = {}
    for R in a.rows:
        n, L = N // R, R + W
        q = torch.randn(n, H, R, d, generator=g).to(dt)  # [blocks, H, R, d]
        k, v = (torch.randn(n, H, L, d, generator=g).to(dt) for _ in range(2))  # [blocks, H, R + W, d]
        mask = torch.zeros(1, 1, R, L, dtype=dt)  # one block's additive mask, broadcast over the blocks
        mask[..., 0] = float("-inf")
        out, lse = FWD(q, k, v, 0.0, False, attn_mask=mask)
        dout = torch.randn(out.shape, generator=g).to(dt)
        runs[(R, L, "fwd")] = lambda q=q, k=k, v=v, m=mask: FWD(q, k, v, 0.0, False, attn_mask=m)
        runs[(R, L, "bwd")] = lambda q=q, k=k, v=v, m=mask, o=out, s=lse, go=dout: BWD(go, q, k, v, o, s, 0.0, False,
                                                                                       attn_mask=m)
    times: dict = {key: [] for key in runs}
    for f in runs.values():
        f()
    for _ in range(a.repeat):
        for key, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[key].append(time.perf_counter() - t0)
    print(f"{torch.get_num_threads()} thread(s), {a.dtype}, N={N}, W={W}, H={H}, d={d}; min and median of {a.repeat}\n")
    print("| pass | rows R | keys R + W | kernel query tile | min ms | median ms | ns per row | ns per entry |")
    print("|---|---|---|---|---|---|---|---|")
    for (R, L, mode), ts in times.items():
        tile = min(R, 256 if R >= 768 else 64 if R >= 192 else 32)
        m = min(ts)
        print(f"| {mode} | {R} | {L} | {tile} | {1e3 * m:.1f} | {1e3 * statistics.median(ts):.1f} | "
              f"{m / (N * H) * 1e9:.0f} | {m / (N * H * L) * 1e9:.2f} |")


if __name__ == "__main__":
    main()
