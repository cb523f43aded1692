#!/usr/bin/env python
"""bhqk on one CUDA GPU: correctness of every backend and timings against SDPA and raw FlexAttention.

One prepared run (≤ 8 minutes on one H200; a time budget skips what does not fit and says so):

1. block masks: ``mask.block_mask`` (from bhqk's tile classes) vs ``create_block_mask`` (evaluates
   every pair) at N = 4096 … 32768 for causal, window 256 and document masks;
2. correctness: every backend (reference, torch, tiled, flex, auto) on CUDA in fp32 / bf16 / fp16,
   forward and backward (dq, dk, dv), against the fp64 reference on the CPU; the yardstick is the
   error of the same formula computed naively in that dtype on the GPU (DESIGN §5: within about
   twice PyTorch's own math path); for the tiled backend, the host syncs of one forward and one
   backward (``torch.cuda.set_sync_debug_mode("warn")``), in all and inside its tile loops (0
   expected there; the per-call ones are listed in tiled.py's docstring);
3. costs: what ``auto`` weighs on this device (SDPA's and tiled's costs, FlexAttention's, which
   compiles) and the backend it chooses for every timing mask and N, forward and with gradients;
4. timings, bf16 forward, B=1, H=16, d=64, N = 4096 … 32768, masks none / causal / window 256 /
   document (8 documents): SDPA (flash, cuDNN, or mem-efficient with a dense mask), raw FlexAttention
   (``torch.compile(flex_attention)`` with a hand-written mask_mod and ``create_block_mask``), bhqk
   ``flex``, ``auto`` and ``tiled`` (these two only up to 8192); compile times apart from run times.

Writes JSON (GPU name, torch / CUDA / Triton versions, every record) after each section:

    python benchmarks/gpu.py                       # -> benchmarks/results/gpu.json
    python benchmarks/gpu.py --out $OUT/gpu.json --budget-s 360
    python benchmarks/gpu.py --smoke --device cpu  # the script's logic on the CPU, tiny sizes, flex eager

Without CUDA it exits with status 2 and says so, measuring nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RESULTS = ROOT / "benchmarks" / "results"
os.environ.setdefault("BHQK_COSTS", "measure")  # this run's own measurements: auto weighs what the costs section measured
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Run:
    """The run's device, clock, budget and results (written after every section)."""

    def __init__(self, a) -> None:
        self.dev = torch.device(a.device)
        self.smoke, self.out, self.budget = a.smoke, Path(a.out), a.budget_s
        self.t0 = time.perf_counter()
        self.data: dict = {"meta": meta(self.dev, a), "block_masks": [], "correctness": [], "timings": [], "skipped": []}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, f, repeat: int, max_s: float = 2.0) -> tuple[float, list[float]]:
        """(first call's seconds — compile included —, later calls' milliseconds); repeats stop
        after a call longer than ``max_s`` (at least one timed call)."""
        self.sync()
        t = time.perf_counter()
        f()
        self.sync()
        first = time.perf_counter() - t
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            f()
            self.sync()
            times.append(1e3 * (time.perf_counter() - t))
            if times[-1] > 1e3 * max_s:
                break
        return first, times

    def skip(self, what: str) -> None:
        self.data["skipped"].append(what)
        print(f"  skipped (time budget): {what}", flush=True)

    def save(self) -> None:
        self.data["meta"]["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        if str(self.out) != "/dev/null":
            self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=1, default=str))


def meta(dev: torch.device, a) -> dict:
    m = {"command": " ".join(["python", "benchmarks/gpu.py", *sys.argv[1:]]), "torch": torch.__version__,
         "cuda": torch.version.cuda, "device": str(dev), "cpu": platform.processor() or platform.machine(),
         "started": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": a.smoke}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        m.update(gpu=torch.cuda.get_device_name(dev), capability=f"{p.major}.{p.minor}",
                 gpu_memory_gib=round(p.total_memory / 2**30, 1))
        try:
            import triton

            m["triton"] = triton.__version__
        except ImportError:
            m["triton"] = None
    return m


def err(note: Exception) -> str:
    return f"{type(note).__name__}: {str(note).splitlines()[0][:200] if str(note) else ''}"


# ---- 1. block masks ------------------------------------------------------------------------------

def doc_ids(N: int, device) -> torch.Tensor:
    return torch.arange(N, device=device) // max(1, N // 8)  # 8 equal documents


def mask_cases(ids: torch.Tensor) -> dict:
    """name -> (bhqk mask, the same mask as a hand-written mask_mod for ``create_block_mask``)."""
    from bhqk import masks

    return {
        "causal": (masks.causal(), lambda b, h, q, k: q >= k),
        "window256": (masks.sliding_window(256), lambda b, h, q, k: (q >= k) & (q - k <= 256)),
        "document": (masks.document(ids), lambda b, h, q, k: ids[q] == ids[k]),
    }


def compare_block_masks(r: Run, m, mod, N: int) -> dict:
    """Time ``m.block_mask`` against ``create_block_mask(mod)`` at [1, 1, N, N]; same tiles?"""
    from torch.nn.attention.flex_attention import create_block_mask

    _, ours = r.timed(lambda: m.block_mask(1, 1, N, N, device=r.dev), 5)
    _, ref = r.timed(lambda: create_block_mask(mod, 1, 1, N, N, device=r.dev), 3)
    a, b = m.block_mask(1, 1, N, N, device=r.dev), create_block_mask(mod, 1, 1, N, N, device=r.dev)
    return dict(bhqk_ms=statistics.median(ours), create_block_mask_ms=statistics.median(ref),
                speedup=statistics.median(ref) / statistics.median(ours),
                same_tiles=bool(torch.equal(a.to_dense(), b.to_dense())))


def block_mask_section(r: Run, Ns: list[int]) -> None:
    print("block masks: bhqk mask.block_mask vs create_block_mask", flush=True)
    for N in Ns:
        for name, (m, mod) in mask_cases(doc_ids(N, r.dev)).items():
            if r.left() < 30:
                r.skip(f"block mask {name} N={N}")
                continue
            rec = {"mask": name, "N": N}
            try:
                rec.update(compare_block_masks(r, m, mod, N))
            except Exception as e:  # noqa: BLE001 — a failure is a result
                rec["error"] = err(e)
            r.data["block_masks"].append(rec)
            shown = rec["error"] if "speedup" not in rec else (
                f"bhqk {rec['bhqk_ms']:.2f} ms, create_block_mask {rec['create_block_mask_ms']:.2f} ms "
                f"({rec['speedup']:.1f}×), same tiles: {rec['same_tiles']}")
            print(f"  {name:>10} N={N:<6} {shown}", flush=True)
        r.save()


# ---- 2. correctness --------------------------------------------------------------------------------

def configs(smoke: bool) -> dict[str, dict]:
    from bhqk import bias as biases
    from bhqk import masks

    B, H, Hkv, Q, K, d = (2, 4, 2, 37, 50, 16) if smoke else (2, 8, 2, 777, 1000, 64)
    lengths = torch.tensor([K, K * 2 // 3])
    ids_q = torch.arange(Q) * 3 // Q
    ids_k = torch.arange(K) * 3 // K
    return {
        "none": dict(mask=None),
        "causal_br": dict(mask=masks.causal("bottom_right")),
        "window256&padding": dict(mask=masks.sliding_window(min(256, K // 4), align="bottom_right") & masks.padding(lengths)),
        "document": dict(mask=masks.document(ids_q, ids_k)),
        "causal+alibi+softcap": dict(mask=masks.causal("bottom_right"), bias=biases.alibi(H, "bottom_right"), softcap=20.0),
    }, (B, H, Hkv, Q, K, d)


def naive(q, k, v, p) -> torch.Tensor:
    """The formula in the inputs' dtype on their device: the low-precision yardstick."""
    from bhqk.shapes import per_query_head

    H = q.shape[1]
    S = (q @ per_query_head(k, H).transpose(-1, -2)) * p.scale  # [B, H, Q, K]
    if p.softcap is not None:
        S = p.softcap * torch.tanh(S / p.softcap)
    B, _, Q, K = S.shape
    if p.bias is not None:
        S = S + p.bias.materialize(B, H, Q, K, device=S.device, dtype=S.dtype)
    if p.mask is not None:
        S = S.masked_fill(~p.mask.materialize(B, H, Q, K, device=S.device), float("-inf"))
    P = torch.softmax(S, dim=-1).nan_to_num(0.0)
    return P @ per_query_head(v, H)  # [B, H, Q, dv]


def correctness_section(r: Run) -> None:
    import bhqk
    from bhqk.functional import flex, names
    from bhqk.functional.problem import prepare

    print("correctness on", r.dev, "against the fp64 reference on the CPU", flush=True)
    cases, (B, H, Hkv, Q, K, d) = configs(r.smoke)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, h, n, d, generator=g, dtype=torch.float64) for h, n in ((H, Q), (Hkv, K), (Hkv, K))]
    dout64 = torch.randn(B, H, Q, d, generator=g, dtype=torch.float64)
    backends = [n for n in names() if n != "auto"] + ["auto"]
    want = {}
    for name, kw in cases.items():  # fp64 on the CPU: output and gradients
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out = bhqk.attention(q, k, v, backend="reference", **kw)
        want[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout64))
    flex_compiles = {("bf16", n) for n in cases} | {(dt, "causal+alibi+softcap") for dt in DTYPES}
    for dt_name, dt in DTYPES.items():
        for name, kw in cases.items():
            q, k, v = (t.to(r.dev, dt).requires_grad_(True) for t in base)
            dout = dout64.to(r.dev, dt)
            yard = naive(q, k, v, prepare(q, k, v, **kw))
            ygrads = torch.autograd.grad(yard, (q, k, v), dout)
            yerr = [float((a.double().cpu() - b).abs().max()) for a, b in zip((yard, *ygrads), want[name])]
            for be in backends:
                rec = {"dtype": dt_name, "case": name, "backend": be, "yardstick_err": dict(zip(("out", "dq", "dk", "dv"), yerr))}
                if be == "flex" and (dt_name, name) not in flex_compiles and not r.smoke:
                    rec["note"] = "not run: each flex structure and dtype compiles (forward+backward); bf16 covers every case"
                elif be == "flex" and r.left() < 90:
                    r.skip(f"correctness flex {dt_name} {name}")
                    continue
                elif r.left() < 20:
                    r.skip(f"correctness {be} {dt_name} {name}")
                    continue
                else:
                    try:
                        for t in (q, k, v):
                            t.grad = None
                        ctx = flex.uncompiled() if (be == "flex" and r.dev.type == "cpu") else contextlib.nullcontext()
                        t0 = time.perf_counter()
                        with ctx:
                            out = bhqk.attention(q, k, v, backend=be, **kw)
                            rec["fwd_err"] = float((out.double().cpu() - want[name][0]).abs().max())
                            try:
                                grads = torch.autograd.grad(out, (q, k, v), dout)
                                rec.update({f"{n}_err": float((gr.double().cpu() - w).abs().max())
                                            for n, gr, w in zip(("dq", "dk", "dv"), grads, want[name][1:])})
                            except Exception as e:  # noqa: BLE001
                                rec["backward"] = err(e)
                        r.sync()
                        rec["first_call_s"] = round(time.perf_counter() - t0, 3)
                        errs = {n: rec.get(f"{n}_err") for n in ("fwd", "dq", "dk", "dv")}
                        bound = {n: 2 * y + (1e-5 if dt == torch.float32 else 1e-3)
                                 for n, y in zip(("fwd", "dq", "dk", "dv"), yerr)}
                        rec["within_bound"] = all(e is not None and e <= bound[n] for n, e in errs.items())
                    except Exception as e:  # noqa: BLE001 — a refusal (why_not) is a result
                        rec["error"] = err(e)
                    if be == "tiled" and r.dev.type == "cuda":
                        try:
                            rec["host_syncs"] = tiled_syncs(q, k, v, dout, kw)
                        except Exception as e:  # noqa: BLE001 — the count failed, not the backend
                            rec["host_syncs_error"] = err(e)
                r.data["correctness"].append(rec)
                shown = rec.get("error") or rec.get("note") or (
                    f"out {rec['fwd_err']:.2e}  "
                    + "  ".join(f"{n} {rec.get(n + '_err', float('nan')):.2e}" for n in ("dq", "dk", "dv"))
                    + f"  (yardstick out {yerr[0]:.2e})  {'ok' if rec.get('within_bound') else 'OUT OF BOUND'}"
                    + (f"  syncs {rec['host_syncs']}" if "host_syncs" in rec else ""))
                print(f"  {dt_name} {name:>20} {be:>9}: {shown}", flush=True)
            r.save()


def tiled_syncs(q, k, v, dout, kw) -> dict[str, int]:
    """Host syncs (``torch.cuda.set_sync_debug_mode("warn")``'s warnings) of one tiled forward and
    one backward, called directly (not through autograd, whose CUDA backward runs on another thread),
    in all and while the tile loops (``_forward_part``, ``_backward_part``) run."""
    import warnings

    from bhqk.functional import tiled
    from bhqk.functional.problem import prepare

    p = prepare(q.detach(), k.detach(), v.detach(), **kw)
    counts = {"forward": 0, "forward_in_tile_loops": 0, "backward": 0, "backward_in_tile_loops": 0}
    saved = tiled._forward_part, tiled._backward_part
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def syncs(ws) -> int:
            return sum(1 for w in ws if "synchroniz" in str(w.message))

        def counted(part, key):
            def run(*a, **kw_):
                n0 = len(caught)
                try:
                    return part(*a, **kw_)
                finally:
                    counts[key] += syncs(caught[n0:])
            return run

        tiled._forward_part = counted(saved[0], "forward_in_tile_loops")
        tiled._backward_part = counted(saved[1], "backward_in_tile_loops")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            n0 = len(caught)
            out, lse = tiled.forward(p)
            counts["forward"] = syncs(caught[n0:])
            n0 = len(caught)
            tiled.backward(p, out, lse, dout)
            counts["backward"] = syncs(caught[n0:])
        finally:
            torch.cuda.set_sync_debug_mode(0)
            tiled._forward_part, tiled._backward_part = saved
    return counts


# ---- costs: what auto weighs on this device, and what it chooses ------------------------------------

def costs_section(r: Run, Ns: list[int]) -> None:
    """SDPA's and the tiled backend's costs (``calibrate.remeasure``) and FlexAttention's
    (``calibrate.measure_flex``, which compiles) on this device in the timing dtype, then ``auto``'s
    choice (``choose_backend``, nothing run) for every timing mask and N, forward and with gradients."""
    from dataclasses import asdict

    import bhqk
    from bhqk.functional import calibrate, flex

    dt = torch.bfloat16 if r.dev.type == "cuda" else torch.float32
    print(f"costs on {r.dev} ({dt}): what auto weighs", flush=True)
    rec: dict = {"dtype": str(dt).replace("torch.", "")}
    t0 = time.perf_counter()
    rec["costs"] = asdict(calibrate.remeasure(r.dev, dt))
    rec["costs_s"] = round(time.perf_counter() - t0, 2)
    if r.left() < 120:
        r.skip("measure_flex (it compiles)")
    else:
        t0 = time.perf_counter()
        with flex.uncompiled() if r.dev.type == "cpu" else contextlib.nullcontext():
            rec["flex_costs"] = asdict(calibrate.measure_flex(r.dev, dt))
        rec["flex_costs_s"] = round(time.perf_counter() - t0, 2)
    print(f"  {json.dumps(rec)}", flush=True)
    B, H, d = 1, (2 if r.smoke else 16), (16 if r.smoke else 64)
    rec["choices"] = []
    for N in Ns:
        q, k, v = (torch.randn(B, H, N, d, device=r.dev, dtype=dt) for _ in range(3))
        for mname, (m, _) in {"none": (None, None), **mask_cases(doc_ids(N, r.dev))}.items():
            for grad in (False, True):
                with torch.enable_grad():
                    args = [t.requires_grad_(grad) for t in (q, k, v)]
                    c = bhqk.choose_backend(*args, m)
                rec["choices"].append({"N": N, "mask": mname, "grad": grad, "backend": c.name, "estimates": c.estimates,
                                       "reason": c.reason})
                print(f"  auto {mname:>10} N={N:<6} {'fwd+bwd' if grad else 'fwd':>7}: {c.name}", flush=True)
    r.data["costs"] = rec


# ---- 3. timings ------------------------------------------------------------------------------------

def timing_impls(r: Run, raw, q, k, v, mname: str, m, mod) -> dict:
    """impl name -> a call of it on (q, k, v) [B, H, N, d] with mask ``m`` (bhqk) / ``mod`` (mask_mod)."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import create_block_mask

    import bhqk
    from bhqk.functional import flex

    N = q.shape[2]
    impls = {}
    if mname in ("none", "causal"):
        for kind, label in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
            impls[label] = lambda kind=kind: _sdpa(q, k, v, None, mname == "causal", kind)
    else:  # the dense mask is built once, outside the timed calls (a caller would hold it)
        dense = m.materialize(1, 1, N, N, device=r.dev)  # [1, 1, N, N] bool
        impls["sdpa_efficient_dense"] = lambda: _sdpa(q, k, v, dense, False, SDPBackend.EFFICIENT_ATTENTION)
    bm = None if mod is None else create_block_mask(mod, None, None, N, N, device=r.dev)
    impls["flex_raw"] = lambda: raw(q, k, v, block_mask=bm)
    ctx = flex.uncompiled if r.dev.type == "cpu" else contextlib.nullcontext
    impls["bhqk_flex"] = lambda: _in(ctx(), lambda: bhqk.attention(q, k, v, m, backend="flex"))
    if N <= (1024 if r.smoke else 8192):  # auto may pick tiled: both slow on a GPU at large N
        impls["bhqk_auto"] = lambda: bhqk.attention(q, k, v, m)
        impls["bhqk_tiled"] = lambda: bhqk.attention(q, k, v, m, backend="tiled")
    return impls


def timing_section(r: Run, Ns: list[int], repeat: int) -> None:
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    print("timings: bf16 forward, B=1, H=16, d=64", flush=True)
    raw = flex_attention if r.dev.type == "cpu" else torch.compile(flex_attention, dynamic=True)  # --smoke: eager
    B, H, d = 1, (2 if r.smoke else 16), (16 if r.smoke else 64)
    dt = torch.bfloat16 if r.dev.type == "cuda" else torch.float32
    for N in Ns:
        g = torch.Generator(device=r.dev).manual_seed(0)
        q, k, v = (torch.randn(B, H, N, d, generator=g, device=r.dev, dtype=dt) for _ in range(3))
        specs = {"none": (None, None), **mask_cases(doc_ids(N, r.dev))}
        for mname, (m, mod) in specs.items():
            impls = timing_impls(r, raw, q, k, v, mname, m, mod)
            for impl, f in impls.items():
                if r.left() < (60 if "flex" in impl else 15):
                    r.skip(f"timing {impl} {mname} N={N}")
                    continue
                rec = {"mask": mname, "N": N, "impl": impl, "dtype": str(dt).replace("torch.", "")}
                graphs = counters["stats"]["unique_graphs"]
                try:
                    if r.dev.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                        base_mem = torch.cuda.memory_allocated()
                    with torch.no_grad():
                        first, times = r.timed(f, repeat)
                    rec.update(first_call_s=round(first, 3), median_ms=statistics.median(times), min_ms=min(times),
                               new_graphs=counters["stats"]["unique_graphs"] - graphs)
                    if r.dev.type == "cuda":
                        rec["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base_mem) / 2**20, 1)
                except Exception as e:  # noqa: BLE001 — a refusal is a result
                    rec["error"] = err(e)
                r.data["timings"].append(rec)
                shown = rec.get("error") or (f"{rec['median_ms']:.3f} ms "
                                             f"(first call {rec['first_call_s']:.2f} s, {rec['new_graphs']} new graphs)")
                print(f"  {mname:>10} N={N:<6} {impl:>20}: {shown}", flush=True)
            r.save()


def _sdpa(q, k, v, mask, causal, kind):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(kind):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _in(ctx, f):
    with ctx:
        return f()


def summary(r: Run) -> None:
    """The issue's GPU targets, from what this run measured."""
    t = {(x["impl"], x["mask"], x["N"]): x.get("median_ms") for x in r.data["timings"]}
    lines = []
    for (impl, mname, N), ms in sorted(t.items(), key=lambda x: (x[0][1], x[0][2])):
        if impl == "bhqk_flex" and ms and t.get(("flex_raw", mname, N)):
            ratio = ms / t[("flex_raw", mname, N)]
            lines.append(f"bhqk flex / raw FlexAttention, {mname}, N={N}: {ratio:.3f} "
                         f"({'met' if ratio <= 1.05 else 'NOT met'}: ≤ 1.05)")
    for x in r.data["block_masks"]:
        if x.get("N") == max((y["N"] for y in r.data["block_masks"]), default=0) and "speedup" in x:
            lines.append(f"block_mask vs create_block_mask, {x['mask']}, N={x['N']}: {x['speedup']:.1f}× "
                         f"({'met' if x['speedup'] >= 10 else 'NOT met'}: ≥ 10×)")
    synced = [x for x in r.data["correctness"] if "host_syncs" in x]
    if synced:
        inside = sum(x["host_syncs"]["forward_in_tile_loops"] + x["host_syncs"]["backward_in_tile_loops"] for x in synced)
        most = max(x["host_syncs"]["forward"] + x["host_syncs"]["backward"] for x in synced)
        lines.append(f"tiled on CUDA: {inside} host syncs inside the tile loops over {len(synced)} runs "
                     f"({'met' if inside == 0 else 'NOT met'}: 0); at most {most} per forward+backward in all")
    chosen = r.data.get("costs", {}).get("choices", [])
    if chosen:  # the issue: SDPA for none and causal, flex for structured masks, tiled as the fallback
        n = max(x["N"] for x in chosen)
        lines.append(f"auto's choices at N={n}: " + ", ".join(f"{x['mask']} {'fwd+bwd' if x['grad'] else 'fwd'} -> {x['backend']}"
                                                          for x in chosen if x["N"] == n))
    judged = [x for x in r.data["correctness"] if "within_bound" in x]
    bad = [f"{x['dtype']} {x['case']} {x['backend']}" for x in judged if not x["within_bound"]]
    ran = len(judged)
    lines.append(f"correctness: {ran - len(bad)} of {ran} runs within bound"
                 + (f"; out of bound: {', '.join(bad)}" if bad else ""))
    r.data["summary"] = lines
    print("\n".join(["", "Targets (this run):", *lines]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "gpu.json"), help="JSON path (default benchmarks/results/gpu.json)")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu with --smoke to check the script")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script's logic quickly")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="stop starting new work after this many seconds (a started compile may run past it)")
    ap.add_argument("--n", type=int, nargs="+", help="sequence lengths for timings and block masks (default 4096 … 32768)")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per implementation")
    ap.add_argument("--sections", nargs="+", default=["block_masks", "correctness", "costs", "timings"],
                    choices=["block_masks", "correctness", "costs", "timings"])
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False). "
              "Run it on a machine with an NVIDIA GPU, or pass --smoke --device cpu to check the script. Nothing was measured.",
              file=sys.stderr)
        raise SystemExit(2)
    if a.device == "cpu" and not a.smoke:
        raise SystemExit("benchmarks/gpu.py: --device cpu is only for --smoke (CPU timings live in benchmarks/attention.py)")
    Ns = a.n or ([256, 512] if a.smoke else [4096, 8192, 16384, 32768])
    r = Run(a)
    print(json.dumps(r.data["meta"]), flush=True)
    for section in a.sections:
        try:
            if section == "block_masks":
                block_mask_section(r, Ns)
            elif section == "correctness":
                correctness_section(r)
            elif section == "costs":
                costs_section(r, Ns)
            else:
                timing_section(r, Ns, 3 if a.smoke else a.repeat)
        except Exception:  # noqa: BLE001 — keep what the other sections measured
            r.data.setdefault("errors", []).append(f"{section}: {traceback.format_exc()[-2000:]}")
            traceback.print_exc()
        r.save()
    summary(r)
    r.save()
    print(f"wrote {a.out} in {time.perf_counter() - r.t0:.0f} s")


if __name__ == "__main__":
    main()
