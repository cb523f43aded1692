#!/usr/bin/env python
"""Time and peak memory of attention on the CPU: bhqk (tiled, auto, reference) against
F.scaled_dot_product_attention (math and flash backends, forced with sdpa_kernel) and FlexAttention
(compiled; forward only — it has no CPU backward), for several masks, sizes, dtypes, forward and
forward+backward. B=1, H=8, d=64 unless told otherwise.

One command prints Markdown tables (time: median over repeats, with the spread; peak extra memory,
each measured once in a fresh subprocess) and the ratios the project tracks (tiled and auto
against SDPA, flex against tiled), and writes JSON and PNG plots (time and peak memory vs N) to
benchmarks/results/ (--quick: to the untracked benchmarks/results/local/; --out DIR to choose).

    python benchmarks/attention.py                 # the full grid (long: an hour or more)
    python benchmarks/attention.py --quick         # a smoke run: under a minute on 2 quiet cores
    python benchmarks/attention.py --n 4096 --masks none causal --dtypes fp32 --modes fwd fwdbwd
    python benchmarks/attention.py --impls spans block_loop tiled sdpa_flash --masks none causal window256 document \
        hf_window256 --dtypes fp32 --repeat 5 --repeat-at 8192=2 16384=2 --max-n none=8192 causal=8192 \
        --mem-limit-gib 1 --max-seconds 10 --no-memory   # the span path's grid (docs/benchmarks.md): ~10 min on 2 cores

SDPA gets masks other than causal as the equivalent dense bool mask (built outside the timed call;
its memory counts, since a caller must hold it). Implementations whose estimated memory exceeds
--mem-limit-gib are skipped and marked as such. Timings on a shared machine are noisy: the
implementations of one configuration are timed interleaved, and the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import bhqk
import machine  # benchmarks/machine.py: CPU model and flags for every JSON
import peak_memory  # benchmarks/peak_memory.py: resident-set peaks, measured in a fresh process
from bhqk import masks

RESULTS = Path(__file__).resolve().parent / "results"
LOCAL = RESULTS / "local"  # untracked (.gitignore): quick runs and runs on a developer's machine
MASKS = ["none", "causal", "window256", "window1024", "document", "padding", "hf_causal", "hf_window256", "hf_padding"]
# flex: raw FlexAttention; bhqk_flex: backend="flex"; tiled_sinks: tiled with sinks [H]; tiled_dropout: dropout_p = 0.1
# spans: backend="spans" (the fused CPU kernel over the spans a mask allows); block_loop: the plain loop of
# one fused-kernel call per block of 256 queries over the keys that block may attend (the span path's baseline)
IMPLS = ["tiled", "auto", "torch", "sdpa_flash", "sdpa_math", "reference", "flex", "bhqk_flex", "tiled_sinks", "tiled_dropout",
         "spans", "block_loop"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ["fwd", "fwdbwd"]
NS = [1024, 2048, 4096, 8192, 16384]


# ---- one configuration -------------------------------------------------------------------------

def bhqk_mask(name: str, N: int):
    """The mask of a kind; ``hf_*`` kinds are what Hugging Face hands attention: a dense bool
    tensor [B, 1, Q, K] (B = 1 here) of the same pattern as the structured kind."""
    if name.startswith("hf_"):
        m = bhqk_mask(name[3:], N)
        return m.materialize(1, 1, N, N).contiguous()  # [1, 1, N, N] bool
    if name == "none":
        return None
    if name == "causal":
        return masks.causal()
    if name.startswith("window"):
        return masks.sliding_window(int(name[len("window"):]))  # query i sees keys i-W … i
    if name == "document":
        return masks.document(torch.arange(N) // max(1, N // 8))  # 8 equal documents
    if name == "padding":
        return masks.padding(N // 2)  # half the keys are padding
    raise SystemExit(f"unknown mask {name!r}; choose from {MASKS}")


def flex_mask_mod(name: str, N: int):
    name = name.removeprefix("hf_")  # the same pattern, as FlexAttention would build it
    if name == "causal":
        return lambda b, h, q, k: q >= k
    if name.startswith("window"):
        W = int(name[len("window"):])
        return lambda b, h, q, k: (q >= k) & (q - k <= W)
    if name == "document":
        doc = torch.arange(N) // max(1, N // 8)
        return lambda b, h, q, k: doc[q] == doc[k]
    if name == "padding":
        return lambda b, h, q, k: k < N // 2
    return None


class Case:
    """Inputs of one configuration and a callable per implementation (built lazily)."""

    def __init__(self, mask: str, N: int, dtype: str, mode: str, B: int = 1, H: int = 8, d: int = 64):
        g = torch.Generator().manual_seed(0)
        self.mask, self.N, self.dtype, self.mode = mask, N, dtype, mode
        dt = DTYPES[dtype]
        grad = mode == "fwdbwd"
        self.q, self.k, self.v = (torch.randn(B, H, N, d, generator=g).to(dt).requires_grad_(grad) for _ in range(3))
        self.dout = torch.randn(B, H, N, d, generator=g).to(dt) if grad else None
        self.m = bhqk_mask(mask, N)
        self.B, self.H = B, H

    def fn(self, impl: str):
        q, k, v, m = self.q, self.k, self.v, self.m
        if impl in ("tiled", "auto", "reference", "torch", "spans"):
            return lambda: bhqk.attention(q, k, v, m, backend=impl)
        if impl == "block_loop":
            return block_loop(q, k, v, m, self.B, self.H)
        if impl == "tiled_sinks":
            sinks = torch.linspace(-1.0, 1.0, self.H).to(q.dtype)  # [H]
            return lambda: bhqk.attention(q, k, v, m, backend="tiled", sinks=sinks)
        if impl == "tiled_dropout":
            return lambda: bhqk.attention(q, k, v, m, backend="tiled", dropout_p=0.1)
        if impl in ("sdpa_flash", "sdpa_math"):
            kind = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.MATH
            causal = self.mask == "causal"
            if self.mask in ("none", "causal"):
                dense = None
            else:
                dense = m if isinstance(m, torch.Tensor) else m.materialize(self.B, self.H, self.N, self.N)  # [1, 1, N, N]

            def call():
                with sdpa_kernel(kind):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=causal)
            return call
        if impl == "flex":
            if self.mode == "fwdbwd":
                raise NotImplementedError("FlexAttention has no backward on the CPU")
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            mod = flex_mask_mod(self.mask, self.N)
            bm = None if mod is None else create_block_mask(mod, None, None, self.N, self.N, device="cpu")
            compiled = torch.compile(flex_attention, dynamic=False)
            return lambda: compiled(q, k, v, block_mask=bm)
        if impl == "bhqk_flex":  # bhqk's backend="flex"; its first call (the warm-up) compiles
            if self.mode == "fwdbwd":
                raise NotImplementedError("FlexAttention has no backward on the CPU")
            return lambda: bhqk.attention(q, k, v, m, backend="flex")
        raise SystemExit(f"unknown implementation {impl!r}; choose from {IMPLS}")

    def step(self, f) -> None:
        """One forward (no autograd) or one forward+backward."""
        if self.mode == "fwd":
            with torch.no_grad():
                f()
            return
        for t in (self.q, self.k, self.v):
            t.grad = None
        f().backward(self.dout)


def block_loop(q, k, v, m, B: int, H: int, block: int = 256):
    """The plain per-block loop (issue #19's baseline): for each block of ``block`` queries, one call
    of PyTorch's fused CPU kernel over the keys from the first to the last one any of its rows may
    attend, with that block's additive mask (None where it allows everything); the backward calls
    the fused backward per block and adds dk, dv into their key slices in place. The blocks' spans
    and masks are found once, outside the timed call."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    N, K = q.shape[-2], k.shape[-2]
    calls = []
    for q0 in range(0, N, block):
        q1 = min(N, q0 + block)
        if m is None:
            calls.append((q0, q1, 0, K, None))
            continue
        rows = m[..., q0:q1, :] if isinstance(m, torch.Tensor) else m.block(masks.Extent(B, H, N, K), q0, q1, 0, K)
        cols = rows.reshape(-1, K).any(dim=0).nonzero()  # [#B·#H·rows, K] -> allowed key positions
        lo, hi = int(cols.min()), int(cols.max()) + 1
        sub = rows[..., lo:hi]  # [#B, #H, rows, hi - lo] (or [rows, hi - lo])
        add = None if bool(sub.all()) else torch.zeros(sub.shape, dtype=q.dtype).masked_fill(~sub, float("-inf"))
        calls.append((q0, q1, lo, hi, add))

    class Loop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            res = [fwd(q[:, :, q0:q1], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=add)
                   for q0, q1, lo, hi, add in calls]  # (out [B, H, rows, d], lse [B, H, rows]) per block
            out, lse = torch.cat([o for o, _ in res], dim=2), torch.cat([s for _, s in res], dim=2)  # [B, H, N, d], [B, H, N]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for q0, q1, lo, hi, add in calls:
                gq, gk, gv = bwd(dout[:, :, q0:q1], q[:, :, q0:q1], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, q0:q1],
                                 lse[:, :, q0:q1], 0.0, False, attn_mask=add)
                dq[:, :, q0:q1] = gq
                dk[:, :, lo:hi] += gk
                dv[:, :, lo:hi] += gv
            return dq, dk, dv

    return lambda: Loop.apply(q, k, v)


def estimate_gib(impl: str, mask: str, N: int, mode: str, H: int = 8) -> float:
    """Rough peak memory, to skip what cannot run here: O(N²) for the reference and the math path,
    the dense mask for SDPA with masks other than causal, O(N) for the rest."""
    nn = H * N * N * 4 / 2**30  # one float32 [B, H, Q, K]
    dense = N * N * 5 / 2**30 if mask not in ("none", "causal") else 0.0  # bool mask + its float copy
    if impl == "reference":
        return nn * (3.5 if mode == "fwd" else 7)
    if impl == "sdpa_math":
        return nn * (2.5 if mode == "fwd" else 5) + dense
    if impl in ("sdpa_flash", "torch"):
        return dense + 0.1
    return 0.3


# ---- timing in this process, memory in a fresh one ----------------------------------------------

def time_case(case: Case, impls: list[str], repeat: int, max_s: float) -> dict[str, dict]:
    """Median and spread of ``repeat`` runs per implementation, interleaved run by run."""
    fns, res = {}, {}
    for impl in impls:
        try:
            fns[impl] = case.fn(impl)
            t0 = time.perf_counter()
            case.step(fns[impl])  # warm-up (and compile, for flex)
            res[impl] = {"warmup_s": time.perf_counter() - t0, "times_ms": []}
        except Exception as e:  # noqa: BLE001 — a refusal is a result
            res[impl] = {"note": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            fns.pop(impl, None)
    for _ in range(repeat):
        for impl, f in list(fns.items()):
            t0, c0 = time.perf_counter(), time.process_time()
            case.step(f)
            dt = time.perf_counter() - t0
            res[impl]["times_ms"].append(1e3 * dt)
            res[impl].setdefault("cpu_ms", []).append(1e3 * (time.process_time() - c0))  # all threads' CPU time
            if dt > max_s:
                fns.pop(impl)
    for r in res.values():
        ts = r.get("times_ms")
        if ts:
            r["median_ms"] = statistics.median(ts)
            r["min_ms"], r["max_ms"] = min(ts), max(ts)
            r["median_cpu_ms"] = statistics.median(r["cpu_ms"])
    return res


def child(spec: dict) -> None:
    """Run one call in this (fresh) process and print its peak extra resident memory in MiB."""
    case = Case(spec["mask"], spec["N"], spec["dtype"], spec["mode"])
    small = Case(spec["mask"], 256, spec["dtype"], spec["mode"])
    if spec["impl"] not in ("flex", "bhqk_flex"):
        small.step(small.fn(spec["impl"]))  # threads and allocator warmed up
    base = peak_memory.status_bytes("VmRSS")  # inputs (q, k, v, dout) exist: they are not "extra"
    f = case.fn(spec["impl"])  # SDPA's dense mask is built here, and counts
    if spec["impl"] in ("flex", "bhqk_flex"):
        case.step(f)  # compile first; its memory does not count
        base = peak_memory.status_bytes("VmRSS")
    peak_memory.reset_high_water()
    case.step(f)
    print(json.dumps({"peak_mib": (peak_memory.status_bytes("VmHWM") - base) / 2**20}))


def memory(spec: dict, timeout: float) -> dict:
    return peak_memory.in_fresh_process(__file__, spec, timeout)


# ---- report --------------------------------------------------------------------------------------

def fmt_time(r: dict | None) -> str:
    if not r:
        return "—"
    if "median_ms" not in r:
        return "n/a"
    m = r["median_ms"]
    spread = 100 * (r["max_ms"] - r["min_ms"]) / (2 * m) if m else 0
    return f"{m:.1f} ±{spread:.0f}%" if m < 1000 else f"{m / 1e3:.2f} s ±{spread:.0f}%"


def fmt_mem(r: dict | None) -> str:
    if not r or "peak_mib" not in r:
        return "—"
    return f"{r['peak_mib']:.0f}"


def ratio(a: dict | None, b: dict | None) -> float | None:
    if a and b and "median_ms" in a and "median_ms" in b and b["median_ms"] > 0:
        return a["median_ms"] / b["median_ms"]
    return None


def tables(records: list[dict], impls: list[str]) -> str:
    by = {}
    for r in records:
        by.setdefault((r["mask"], r["N"], r["dtype"], r["mode"]), {})[r["impl"]] = r
    head = "| mask | N | dtype | mode | " + " | ".join(impls) + " | tiled/flash | auto/best | spans/best other |"
    lines = ["Time per call, ms (median ± half the min–max spread):", "", head,
             "|" + "---|" * (len(impls) + 7)]
    for key in sorted(by, key=lambda k: (MASKS.index(k[0]) if k[0] in MASKS else 99, k[2], k[3], k[1])):
        row = by[key]
        tf = ratio(row.get("tiled"), row.get("sdpa_flash"))
        best = [row[i]["median_ms"] for i in ("tiled", "sdpa_flash", "torch") if i in row and "median_ms" in row[i]]
        ab = row["auto"]["median_ms"] / min(best) if best and "auto" in row and "median_ms" in row["auto"] else None
        cells = [fmt_time(row.get(i)) if not (row.get(i) or {}).get("skipped") else "skip" for i in impls]
        others = [r["median_ms"] for i, r in row.items() if i not in ("spans", "auto") and "median_ms" in r]
        sb = row["spans"]["median_ms"] / min(others) if others and "median_ms" in row.get("spans", {}) else None
        cells += [f"{tf:.2f}×" if tf else "—", f"{ab:.2f}×" if ab else "—", f"{sb:.2f}×" if sb else "—"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    lines += ["", "Peak extra resident memory per call, MiB (fresh subprocess; inputs excluded, SDPA's dense mask included):", "",
              "| mask | N | dtype | mode | " + " | ".join(impls) + " |", "|" + "---|" * (len(impls) + 4)]
    for key in sorted(by, key=lambda k: (MASKS.index(k[0]) if k[0] in MASKS else 99, k[2], k[3], k[1])):
        row = by[key]
        cells = [fmt_mem(row.get(i)) if not (row.get(i) or {}).get("skipped") else "skip" for i in impls]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    notes = sorted({f"{r['impl']} ({r['mask']}, {r['dtype']}, {r['mode']}): {r.get('note') or r.get('mem_note')}"
                    for r in records if r.get("note") or r.get("mem_note")})
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines)


def targets(records: list[dict]) -> str:
    """The tracked ratios (each with the bound it is held to), from whatever of them this run measured."""
    get = {(r["impl"], r["mask"], r["N"], r["dtype"], r["mode"]): r for r in records}

    def t(impl, mask, N, mode, dtype="fp32"):
        r = get.get((impl, mask, N, dtype, mode))
        return r.get("median_ms") if r else None

    def mem(impl, mask, N, mode, dtype="fp32"):
        r = get.get((impl, mask, N, dtype, mode))
        return r.get("peak_mib") if r else None

    rows = []

    def add(name, value, ok, unit="×"):
        if value is not None:
            rows.append(f"| {name} | {value:.2f}{unit} | {'met' if ok else 'NOT met'} |")

    for mode, limit in (("fwd", 1.5), ("fwdbwd", 2.0)):
        a, b = t("tiled", "none", 4096, mode), t("sdpa_flash", "none", 4096, mode)
        add(f"no mask, fp32, N=4096, {mode}: tiled / SDPA-flash ≤ {limit}",
            a / b if a and b else None, a and b and a / b <= limit)
    a, b = t("tiled", "causal", 4096, "fwd"), t("sdpa_flash", "causal", 4096, "fwd")
    add("causal, fp32, N=4096, fwd: tiled / SDPA-flash ≤ 1.3", a / b if a and b else None, a and b and a / b <= 1.3)
    for mode in MODES:
        a, b = t("auto", "window256", 16384, mode), t("sdpa_flash", "window256", 16384, mode)
        add(f"window 256, N=16384, {mode}: SDPA-flash / auto ≥ 5", b / a if a and b else None, a and b and b / a >= 5)
        a, b = mem("auto", "window256", 16384, mode), mem("sdpa_flash", "window256", 16384, mode)
        add(f"window 256, N=16384, {mode}: memory SDPA-flash / auto ≥ 10", b / a if a and b else None, a and b and b / a >= 10)
    a, b = t("bhqk_flex", "window256", 16384, "fwd"), t("tiled", "window256", 16384, "fwd")
    if a and b:  # compile time apart: the warm-up call of bhqk_flex
        c = get[("bhqk_flex", "window256", 16384, "fp32", "fwd")].get("warmup_s", float("nan"))
        add(f"window 256, N=16384, fp32, fwd: bhqk flex / tiled < 1 (compile + first call {c:.1f} s, not counted)",
            a / b, a / b < 1)
    worst = None
    for (impl, mask, N, dtype, mode), r in get.items():
        if impl != "auto" or "median_ms" not in r:
            continue
        best = [x for x in (t("tiled", mask, N, mode, dtype), t("sdpa_flash", mask, N, mode, dtype),
                            t("torch", mask, N, mode, dtype)) if x]
        if best:
            q = r["median_ms"] / min(best)
            if worst is None or q > worst[0]:
                worst = (q, f"{mask}, N={N}, {dtype}, {mode}")
    if worst:
        add(f"auto / min(SDPA-flash, torch, tiled) ≤ 1.10 on every configuration (worst: {worst[1]})", worst[0], worst[0] <= 1.10)
    for (impl, mask, N, dtype, mode), r in sorted(get.items()):
        if impl != "auto" or not mask.startswith("hf_") or "median_ms" not in r:
            continue  # a dense HF mask: auto against torch given it and tiled given the structured mask
        best = [x for x in (t("torch", mask, N, mode, dtype), t("tiled", mask[3:], N, mode, dtype)) if x]
        if best:
            q = r["median_ms"] / min(best)
            add(f"{mask} (dense [1, 1, N, N]), N={N}, {dtype}, {mode}: auto / min(torch given it, tiled given "
                f"{mask[3:]}) ≤ 1.10", q, q <= 1.10)
    for mode, limit in (("fwd", 0.90), ("fwdbwd", 1.00)):  # issue #19: the span path against the plain per-block loop
        a, b = t("spans", "window256", 16384, mode), t("block_loop", "window256", 16384, mode)
        add(f"window 256, N=16384, fp32, {mode}: spans / per-256-query-block loop ≤ {limit}",
            a / b if a and b else None, a and b and a / b <= limit)
    for mask in ("none", "causal"):
        for mode in MODES:
            a, b = t("spans", mask, 4096, mode), t("sdpa_flash", mask, 4096, mode)
            add(f"{mask}, N=4096, fp32, {mode}: spans / SDPA-flash ≤ 1.05", a / b if a and b else None, a and b and a / b <= 1.05)
    for mode in MODES:
        m = mem("tiled", "none", 16384, mode)
        add(f"tiled peak extra memory, no mask, N=16384, fp32, {mode} < 256 MiB", m, m is not None and m < 256, unit=" MiB")
    if not rows:
        return ""
    return "\n".join(["Targets (this run):", "", "| target | measured | |", "|---|---|---|", *rows])


def planning(mask: str, N: int, repeat: int, H: int = 8, d: int = 64) -> dict:
    """Median seconds of the tiled backend's tile planning for ``mask`` at [1, H, N, N], each time
    with a fresh mask object (no classification cached from the run before)."""
    from bhqk.functional import prepare
    from bhqk.functional.tiled_plan import plan_for

    q = torch.empty(1, H, N, d)
    times, cpu, plan = [], [], None
    for _ in range(repeat):
        m = bhqk_mask(mask, N)
        m = m.clone() if isinstance(m, torch.Tensor) else m
        p = prepare(q, q, q, m)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_for(p)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"mask": mask, "N": N, "plan_ms": 1e3 * statistics.median(times), "plan_ms_all": [1e3 * x for x in times],
            "plan_cpu_ms": 1e3 * statistics.median(cpu),
            "block_q": plan.block_q, "block_k": plan.block_k, "tiles": plan.tiles, "computed": plan.computed}


def plot(records: list[dict], impls: list[str], stem: str, folder: Path = RESULTS) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for dtype in sorted({r["dtype"] for r in records}):
        for mode in sorted({r["mode"] for r in records}):
            sub = [r for r in records if r["dtype"] == dtype and r["mode"] == mode]
            mks = [m for m in MASKS if any(r["mask"] == m for r in sub)]
            if not mks:
                continue
            fig, axes = plt.subplots(2, len(mks), figsize=(3.6 * len(mks), 6.4), squeeze=False)
            for j, m in enumerate(mks):
                for impl in impls:
                    pts = sorted((r["N"], r.get("median_ms"), r.get("peak_mib"))
                                 for r in sub if r["mask"] == m and r["impl"] == impl)
                    tp = [(n, x) for n, x, _ in pts if x]
                    mp = [(n, y) for n, _, y in pts if y is not None]
                    if tp:
                        axes[0][j].plot(*zip(*tp), marker="o", label=impl)
                    if mp:
                        axes[1][j].plot(*zip(*mp), marker="o", label=impl)
                axes[0][j].set_title(f"{m} ({dtype}, {mode})")
                for i, lab in enumerate(("time per call [ms]", "peak extra memory [MiB]")):
                    ax = axes[i][j]
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_xlabel("N")
                    ax.grid(True, which="both", alpha=0.3)
                    if j == 0:
                        ax.set_ylabel(lab)
            axes[0][0].legend(fontsize=7)
            fig.tight_layout()
            path = folder / f"{stem}-{dtype}-{mode}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(str(path))
    return written


# ---- main ----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="N 1024; none, causal, window256; fp32; fwd; tiled, auto, sdpa_flash, reference; 3 repeats; "
                         "written to benchmarks/results/local/")
    ap.add_argument("--n", type=int, nargs="+", help=f"sequence lengths (default {NS})")
    ap.add_argument("--masks", nargs="+", choices=MASKS, help="masks (default: all)")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="dtypes (default: fp32 bf16)")
    ap.add_argument("--modes", nargs="+", choices=MODES, help="fwd and/or fwdbwd (default: both)")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, help="implementations (default: all)")
    ap.add_argument("--repeat", type=int, help="timed runs per implementation (default 5; --quick 3)")
    ap.add_argument("--repeat-at", nargs="+", default=[], metavar="N=R",
                    help="fewer (or more) timed runs from sequence length N on, e.g. 8192=2")
    ap.add_argument("--max-n", nargs="+", default=[], metavar="MASK=N",
                    help="largest sequence length to run a mask at, e.g. none=8192 (the rest are left out and listed)")
    ap.add_argument("--max-seconds", type=float, default=30.0, help="stop repeating an implementation after a run this long")
    ap.add_argument("--mem-limit-gib", type=float, default=8.0, help="skip implementations estimated to need more")
    ap.add_argument("--no-memory", action="store_true", help="skip the subprocess memory measurements")
    ap.add_argument("--tag", default="attention", help="file stem of the JSON and PNGs")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the JSON and PNGs (default benchmarks/results/; --quick: benchmarks/results/local/)")
    ap.add_argument("--planning", action="store_true", help="only time the tiled backend's tile planning per mask and N")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    ns = a.n or ([1024] if a.quick else NS)
    mks = a.masks or (["none", "causal", "window256"] if a.quick else MASKS)
    dts = a.dtypes or (["fp32"] if a.quick else list(DTYPES))
    modes = a.modes or (["fwd"] if a.quick else MODES)
    impls = a.impls or (["tiled", "auto", "sdpa_flash", "reference"] if a.quick else IMPLS)
    repeat = a.repeat or (3 if a.quick else 5)

    folder = a.out or (LOCAL if a.quick else RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", "benchmarks/attention.py", *sys.argv[1:]]), **machine.describe(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "B": 1, "H": 8, "d": 64}
    if a.planning:
        rows = [planning(mask, N, repeat) for mask in mks for N in ns]
        for r in rows:
            print(f"{r['mask']:>13} N={r['N']:<6} planning {r['plan_ms']:8.1f} ms, CPU time {r['plan_cpu_ms']:.1f} ms "
                  f"(median of {repeat}; all {', '.join(f'{x:.1f}' for x in r['plan_ms_all'])}), "
                  f"grid {r['block_q']}×{r['block_k']}, {r['tiles']} tiles")
        out = folder / f"{a.tag}.json"
        out.write_text(json.dumps({"meta": {**meta, "loadavg_end": os.getloadavg()}, "planning": rows}, indent=1))
        print(f"wrote {out}")
        return
    records = []
    bar = tqdm(total=len(dts) * len(modes) * len(mks) * len(ns) * len(impls), unit=" result", leave=False,
               disable=not (sys.stderr.isatty() and sys.stdout.isatty()))  # a terminal only; quiet when piped
    repeat_at = sorted((int(n), int(r)) for n, r in (x.split("=") for x in a.repeat_at))  # [(N, repeats)]
    max_n = {m: int(n) for m, n in (x.split("=") for x in a.max_n)}
    left_out = sorted({f"{mask} at N={N}" for mask in mks for N in ns if N > max_n.get(mask, N)})
    meta["left_out"] = left_out
    for dtype in dts:
        for mode in modes:
            for mask in mks:
                for N in ns:
                    if N > max_n.get(mask, N):
                        continue
                    reps = ([r for n, r in repeat_at if N >= n] or [repeat])[-1]
                    run = [i for i in impls if estimate_gib(i, mask, N, mode) <= a.mem_limit_gib
                           and not (i in ("flex", "bhqk_flex") and mode == "fwdbwd")]
                    case = Case(mask, N, dtype, mode)
                    res = time_case(case, run, reps, a.max_seconds)
                    del case
                    for impl in impls:
                        r = {"impl": impl, "mask": mask, "N": N, "dtype": dtype, "mode": mode}
                        if impl in ("flex", "bhqk_flex") and mode == "fwdbwd":
                            r["note"] = "FlexAttention has no backward on the CPU"
                        elif impl not in run:
                            r["skipped"] = True
                            r["note"] = f"skipped: needs ~{estimate_gib(impl, mask, N, mode):.0f} GiB (> --mem-limit-gib)"
                        else:
                            r.update(res[impl])
                            if not a.no_memory and "median_ms" in r:
                                r.update(memory({"impl": impl, "mask": mask, "N": N, "dtype": dtype, "mode": mode},
                                                timeout=max(120.0, 20 * r["median_ms"] / 1e3)))
                        records.append(r)
                        shown = fmt_time(r) if "median_ms" in r else (r.get("note") or "")
                        bar.write(f"{mask:>10} N={N:<6} {dtype} {mode:<6} {impl:<10} {shown:>16}  {fmt_mem(r):>6} MiB",
                                  file=sys.stdout)
                        bar.update(1)
    bar.close()
    meta["loadavg_end"] = os.getloadavg()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out = folder / f"{a.tag}.json"
    out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    pngs = plot(records, impls, a.tag, folder)
    print()
    print(tables(records, impls))
    tg = targets(records)
    if tg:
        print()
        print(tg)
    print()
    if left_out:
        print(f"Left out (--max-n): {', '.join(left_out)}")
    print(f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']} (2 cores; > 2 means other work ran)")
    print(f"wrote {out}" + "".join(f", {p}" for p in pngs))


if __name__ == "__main__":
    main()
