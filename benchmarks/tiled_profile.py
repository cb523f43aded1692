"""Where the tiled backend's causal forward spends its time, beside PyTorch's fused flash kernel.

One thread, CPU time (``time.process_time``), so that other work on the machine moves the figures
less than wall-clock time would; B=1, H=8, d=64, fp32, causal, N=4096 by default. Three parts:

1. the whole call: tiled and SDPA-flash, interleaved, medians;
2. the tiled call under ``torch.profiler``, its self CPU time per kind of op (the two matmuls,
   exp2, the row sums, copies, fills, the rest), per call;
3. the same matmul shapes alone (the largest rectangles' Q·Kᵀ with the folded column, d+1, and P̃·V;
   and P̃·[V, 1], the row sums riding in the matmul as one more column): what MKL gives them here.

It answers "how far can an online softmax written in PyTorch ops get": the matmuls at their
isolated rate are the floor, every other op is a pass over a score tile that the fused kernel keeps
in registers.

    python benchmarks/tiled_profile.py                 # N=4096, writes results/tiled-profile.json
    python benchmarks/tiled_profile.py --n 8192 --tag tiled-profile-8k
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import machine  # benchmarks/machine.py: CPU model and flags for every JSON

HERE = Path(__file__).resolve().parent
KINDS = {"bmm": "matmul", "baddbmm_": "matmul", "exp2_": "exp2", "sum": "row sums", "copy_": "copies",
         "fill_": "fills"}


def _clock(f, repeat: int) -> float:
    f()
    ts = []
    for _ in range(repeat):
        t0 = time.process_time()
        f()
        ts.append(time.process_time() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tag", default="tiled-profile")
    a = ap.parse_args()
    torch.set_num_threads(1)
    import bhqk
    from bhqk import masks

    torch.manual_seed(0)
    N, H, d = a.n, 8, 64
    q, k, v = (torch.randn(1, H, N, d) for _ in range(3))  # [B, H, N, d]
    mask = masks.causal()

    def tiled() -> None:
        bhqk.attention(q, k, v, mask, backend="tiled")

    def flash() -> None:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        t_tiled, t_flash = [], []
        tiled(), flash()
        for _ in range(a.repeat):  # interleaved
            t_tiled.append(_clock(tiled, 1))
            t_flash.append(_clock(flash, 1))
        whole = {"tiled_s": statistics.median(t_tiled), "flash_s": statistics.median(t_flash)}
        whole["ratio"] = whole["tiled_s"] / whole["flash_s"]

        calls = 3
        with torch.profiler.profile(record_shapes=True) as prof:
            for _ in range(calls):
                tiled()
        by_kind: dict[str, float] = {}
        shapes: dict[str, float] = {}
        for ev in prof.key_averages(group_by_input_shape=True):
            name = ev.key.removeprefix("aten::")
            kind = KINDS.get(name, "rest")
            by_kind[kind] = by_kind.get(kind, 0.0) + ev.self_cpu_time_total / 1e6 / calls
            if kind == "matmul":
                shapes[f"{name} {ev.input_shapes[:2]}"] = ev.self_cpu_time_total / 1e6 / calls

        from bhqk.functional import tiled_plan
        plan = tiled_plan.plan_for(bhqk.functional.prepare(q, k, v, mask))
        wide = max((r for g in plan.rows for r in g.rects), key=lambda r: r.elems)
        R, kw = wide.r1 - wide.r0, wide.k1 - wide.k0
        qf, kf = torch.randn(H, R, d + 1), torch.randn(H, kw, d + 1)  # [n, rows, d+1], [n, kw, d+1]
        S, P = torch.empty(H, R, kw), torch.rand(H, R, kw)  # [n, rows, kw]
        V, V1, O, O1 = torch.randn(H, kw, d), torch.randn(H, kw, d + 1), torch.zeros(H, R, d), torch.zeros(H, R, d + 1)
        reps = 20
        t_qk = _clock(lambda: torch.bmm(qf, kf.transpose(1, 2), out=S), reps)
        t_pv = _clock(lambda: O.baddbmm_(P, V), reps)
        t_pv1 = _clock(lambda: O1.baddbmm_(P, V1), reps)
        t_exp = _clock(lambda: torch.exp2(P, out=S), reps)
        t_sum = _clock(lambda: P.sum(-1), reps)
        flops = 2 * H * R * kw
        gemm = {"shape": [H, R, kw], "qk_s": t_qk, "qk_gflops": flops * (d + 1) / t_qk / 1e9, "pv_s": t_pv,
                "pv_gflops": flops * d / t_pv / 1e9, "pv_ones_column_s": t_pv1, "exp2_s": t_exp, "rowsum_s": t_sum}
        entries = H * sum(r.elems for g in plan.rows for r in g.rects)  # score entries the plan computes
        floor = entries * 2 * (2 * d + 1) / (0.5 * (gemm["qk_gflops"] + gemm["pv_gflops"]) * 1e9)  # both matmuls at that rate

    info = machine.describe()
    print(f"{machine.one_line(info)}; 1 thread, CPU time; causal, fp32, B=1, H={H}, d={d}, N={N}\n")
    print(f"whole call: tiled {whole['tiled_s'] * 1e3:.1f} ms, SDPA-flash {whole['flash_s'] * 1e3:.1f} ms, "
          f"tiled / flash {whole['ratio']:.2f}x\n")
    print("| tiled, per call | ms | share |\n|---|---|---|")
    total = sum(by_kind.values())
    for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {t * 1e3:.1f} | {t / total:.0%} |")
    print(f"| all ops (profiled) | {total * 1e3:.1f} | |")
    print(f"\nthe plan computes {entries / 1e6:.1f} M score entries; both matmuls at their isolated rate: "
          f"{floor * 1e3:.1f} ms = {floor / whole['flash_s']:.2f}x SDPA-flash's whole call")
    print(f"largest rectangle [n, rows, kw] = {gemm['shape']}: Q·Kᵀ (d+1) {gemm['qk_gflops']:.0f} GFLOP/s, "
          f"P̃·V {gemm['pv_gflops']:.0f} GFLOP/s; P̃·[V, 1] {gemm['pv_ones_column_s'] / gemm['pv_s']:.2f}x P̃·V's time "
          f"(the row sums in the matmul) against a separate row-sum pass of {gemm['rowsum_s'] / gemm['pv_s']:.2f}x; "
          f"exp2 pass {gemm['exp2_s'] / gemm['pv_s']:.2f}x")
    out = HERE / "results" / f"{a.tag}.json"
    out.write_text(json.dumps({"machine": info, "n": N, "whole": whole, "profile_s": by_kind, "matmul_shapes_s": shapes,
                               "gemm": gemm, "entries": entries, "matmul_floor_s": floor}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
