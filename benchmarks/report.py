"""Markdown tables from a ``benchmarks/attention.py`` JSON result: one row per (mask, N, dtype, mode),
one column per implementation (median ms, peak extra MiB when measured), and auto / best.

    python benchmarks/report.py benchmarks/results/session-4096.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def describe(meta: dict) -> str:
    """The machine line every quoted figure carries."""
    flags = ", ".join(meta.get("cpu_flags", [])) or "flags not recorded"
    cpu = meta.get("cpu_model") or meta.get("cpu") or "CPU model not recorded"
    return (f"{cpu} ({flags}), {meta.get('cores', '?')} cores, {meta.get('threads', '?')} threads, "
            f"torch {meta.get('torch', '?')}, {meta.get('date') or meta.get('started', '?')}, "
            f"load {fmt_load(meta.get('loadavg_start'))} → {fmt_load(meta.get('loadavg_end'))}")


def fmt_load(load) -> str:
    return "?" if not load else f"{load[0]:.1f}"


def table(records: list[dict]) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in records))
    keys = list(dict.fromkeys((r["mask"], r["N"], r["dtype"], r["mode"]) for r in records))
    by = {(r["mask"], r["N"], r["dtype"], r["mode"], r["impl"]): r for r in records}
    head = ["mask", "N", "dtype", "mode", *impls]
    if "auto" in impls:
        head.append("auto / best other")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        cells = [str(k) for k in key]
        times = {}
        for impl in impls:
            r = by.get((*key, impl))
            if r is None or "median_ms" not in r:
                cells.append("—" if r is None else r.get("skipped", "—"))
                continue
            times[impl] = r["median_ms"]
            mem = f" ({r['peak_mib']:.0f} MiB)" if r.get("peak_mib") is not None else ""
            cells.append(f"{r['median_ms']:.0f} ms{mem}")
        if "auto" in impls:
            others = [t for i, t in times.items() if i != "auto"]
            cells.append(f"{times['auto'] / min(others):.2f}×" if "auto" in times and others else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="a JSON file written by benchmarks/attention.py (its timing runs)")
    a = ap.parse_args()
    d = json.loads(a.json.read_text())
    if "records" not in d:
        raise SystemExit(f"{a.json}: not a timing result of benchmarks/attention.py (no 'records'; keys: "
                         f"{', '.join(sorted(d))}); read it as JSON")
    print(f"`{d['meta'].get('command', '?')}`\n\n{describe(d['meta'])}\n")
    print(table(d["records"]))


if __name__ == "__main__":
    main()
