#!/usr/bin/env python
"""``auto`` and FlexAttention's compile: a run of calls with one mask structure (a 256 window and a
padding mask, B=1, H=8, d=64, forward, no grad), where ``auto`` rents (runs the backend it
estimates cheapest without a compile) until the savings a compiled kernel would have made pay for
the compile, then compiles and runs ``flex``.

Prints and writes: FlexAttention's measured costs (``calibrate.measure_flex``, in this process),
every call of the run (auto's choice, its time, its estimates), and the run's total against the
two fixed strategies: always ``tiled`` (a tiled call is timed right after each auto call, so load
hits both alike) and ``flex`` from the first call (the compile, as auto's compiling call took it,
plus a flex call timed after each later auto call; while auto has not compiled, flex's calls are
priced at the median of those timed after it did, or at the end if it never did). "Hindsight" is
the cheaper of the two; rent-then-buy promises auto at most about twice it.

    python benchmarks/flex_auto.py                       # N=16384, 40 calls (a few minutes on 2 cores)
    python benchmarks/flex_auto.py --n 4096 --calls 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bhqk  # noqa: E402
from bhqk import masks  # noqa: E402
from bhqk.functional import calibrate, flex, prepare, registry  # noqa: E402
from machine import describe, one_line  # noqa: E402

warnings.filterwarnings("ignore")
__import__("os").environ.setdefault("BHQK_COSTS", "measure")  # this run's own measurements, not a cached file


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="Q = K (default 16384)")
    ap.add_argument("--calls", type=int, default=40, help="calls in the run (default 40)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "local" / "flex_auto.json"))
    a = ap.parse_args()
    meta = describe()
    print(one_line(meta))
    with torch.no_grad():
        fc = calibrate.measure_flex("cpu", torch.float32)
        print(f"FlexAttention measured: compile {fc.compile:.1f} s a kernel (+{fc.first_compile:.1f} s for a process's first, "
              f"paid here), {1e3 * fc.call:.2g} ms per call, "
              f"{1e9 * fc.elem:.3g} ns per visited score entry")
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, a.n, 64, generator=g) for _ in range(3))  # [B, H, N, d]
        m = masks.sliding_window(256) & masks.padding(torch.tensor([a.n - 5]))  # a structure nothing compiled yet
        p = prepare(q, k, v, m)
        key = flex.kernel_key(p)
        flex.forget(key)
        registry._SAVED.clear()
        calls = []
        for i in range(a.calls):
            choice = registry.decide(p, False, record=False)  # what auto will run (the call records it)
            t = timed(lambda: bhqk.attention(q, k, v, m))
            est = dict(choice.estimates, flex=registry.estimate_flex(p, False).seconds)  # flex's even while unpaid
            rec = {"call": i + 1, "backend": choice.name, "seconds": t, "estimates": est, "reason": choice.reason,
                   "saved_so_far_s": registry._SAVED.get(("flex", key), 0.0),
                   "tiled_s": timed(lambda: bhqk.attention(q, k, v, m, backend="tiled"))}
            if flex.compiled(key) and choice.name == "flex" and any(c["backend"] == "flex" for c in calls):
                rec["flex_s"] = t  # auto ran the compiled kernel: that is flex's call
            elif flex.compiled(key) and choice.name != "flex":
                rec["flex_s"] = timed(lambda: bhqk.attention(q, k, v, m, backend="flex"))
            calls.append(rec)
            print(f"call {i + 1:3d}: {choice.name:6s} {t:7.3f} s (tiled alone {rec['tiled_s']:.3f} s)   estimates "
                  + ", ".join(f"{n} {s:.3g} s" for n, s in sorted(est.items()))
                  + f"; saved so far {rec['saved_so_far_s']:.3g} s")
        compiled_at = next((c["call"] for c in calls if c["backend"] == "flex"), None)
        if compiled_at is None:  # auto never compiled: pay the compile here, to price "flex from the first call"
            compile_s = timed(lambda: bhqk.attention(q, k, v, m, backend="flex"))
            flex_calls = [timed(lambda: bhqk.attention(q, k, v, m, backend="flex")) for _ in range(3)]
        else:
            compile_s = calls[compiled_at - 1]["seconds"]
            flex_calls = [c["flex_s"] for c in calls if "flex_s" in c]
        flex_s = statistics.median(flex_calls) if flex_calls else float("nan")
    total = sum(c["seconds"] for c in calls)
    always_tiled = sum(c["tiled_s"] for c in calls)
    flex_first = compile_s + sum(c.get("flex_s", flex_s) for c in calls[1:])
    hindsight = min(always_tiled, flex_first)
    summary = {"n": a.n, "calls": a.calls, "auto_total_s": total, "auto_compiled_at_call": compiled_at,
               "flex_median_s": flex_s, "flex_first_call_s": compile_s, "always_tiled_s": always_tiled,
               "flex_from_first_call_s": flex_first, "auto_over_hindsight": total / hindsight}
    print(f"\nN={a.n}, {a.calls} calls: auto {total:.1f} s (compiled at call {compiled_at}); always tiled {always_tiled:.1f} s; "
          f"flex from the first call {flex_first:.1f} s (first call {compile_s:.1f} s, then {flex_s:.3f} s a call); "
          f"auto / hindsight = {total / hindsight:.2f}")
    meta["loadavg_end"] = list(__import__("os").getloadavg())
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "flex_costs": fc.__dict__, "summary": summary, "calls": calls}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
