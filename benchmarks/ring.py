"""Ring attention: per-rank peak memory and time over 1, 2 and 4 processes (gloo on 127.0.0.1).

For each N, a fresh process runs single-process ``bhqk.attention`` (the tiled backend) forward and
backward, and fresh groups of P processes run ``bhqk.distributed.ring_attention`` on their shards.
Peak memory is what the process holds above its starting point while it creates its inputs (q, k,
v, dout: the whole sequence for one process, N/P positions for a rank) and runs forward and
backward, after a warm-up call at a smaller size: the resident-set high-water mark (VmHWM, reset via
/proc/self/clear_refs, glibc's mmap threshold fixed so freed tensors go back to the system; see
``benchmarks/peak_memory.py``). All processes share this machine's cores, so memory scaling is the
headline and time is indicative only.

    python benchmarks/ring.py                          # N = 8192 … 65536, P = 1, 2, 4
    python benchmarks/ring.py --n 8192 16384 --procs 2 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import machine  # benchmarks/machine.py: CPU model and flags for every JSON

CORES = os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(B, H, n, d, dtype):
    q = torch.randn(B, H, n, d, dtype=dtype, requires_grad=True)  # [B, H, n, d]
    k = torch.randn(B, H, n, d, dtype=dtype, requires_grad=True)  # [B, Hkv, n, d]
    v = torch.randn(B, H, n, d, dtype=dtype, requires_grad=True)  # [B, Hkv, n, dv]
    dout = torch.randn(B, H, n, d, dtype=dtype)  # [B, H, n, dv]
    return q, k, v, dout


def _worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    torch.set_num_threads(cfg["threads"] or max(1, CORES // world))
    import bhqk
    from bhqk import masks
    from bhqk.distributed import ring_attention
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (a spawned process may not have it)
    from peak_memory import Peak, exact_cpu_peaks

    exact_cpu_peaks()  # before any tensor: freed tensors go back to the system, so peaks count everything

    dtype = getattr(torch, cfg["dtype"])
    B, H, N, d = cfg["batch"], cfg["heads"], cfg["n"], cfg["dim"]
    mask = masks.causal() if cfg["mask"] == "causal" else None
    if cfg["mode"] == "single":
        backend = cfg["single_backend"]
        run = lambda q, k, v: bhqk.attention(q, k, v, mask, backend=backend)  # noqa: E731
        sync = lambda: None  # noqa: E731
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30))
        run = lambda q, k, v: ring_attention(q, k, v, mask, sharding=cfg["sharding"], kv_chunk=cfg["kv_chunk"])  # noqa: E731
        sync = dist.barrier
    q, k, v, dout = _inputs(B, H, min(N // world, 2048), d, dtype)  # warm up: thread pools, first-call allocations
    run(q, k, v).backward(dout)
    del q, k, v, dout
    peaks, times = [], []
    for _ in range(cfg["repeats"]):
        sync()
        with Peak() as peak:
            t0 = time.perf_counter()
            q, k, v, dout = _inputs(B, H, N // world, d, dtype)  # this rank's N/P positions
            o = run(q, k, v)
            o.backward(dout)
            sync()
            times.append(time.perf_counter() - t0)
            del q, k, v, dout, o
        peaks.append(peak.bytes)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"peak": max(peaks), "seconds": sorted(times)[len(times) // 2]}, f)
    if cfg["mode"] != "single":
        dist.destroy_process_group()


def measure(cfg: dict, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, _free_port(), cfg, tmp), nprocs=world, start_method="spawn", join=True)
        res = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    return {"peak_mib": max(r["peak"] for r in res) / 2**20, "peak_mib_ranks": [r["peak"] / 2**20 for r in res],
            "seconds": max(r["seconds"] for r in res)}


def sent_mib(cfg: dict, world: int) -> float:
    """Bytes each rank sends per forward+backward: P-1 K/V shards forward, then P-1 K/V and P dK/dV (float32)."""
    if world == 1:
        return 0.0
    n = cfg["n"] // world
    elt = torch.finfo(getattr(torch, cfg["dtype"])).bits // 8
    kv = cfg["batch"] * cfg["heads"] * n * 2 * cfg["dim"]  # k and v elements of one shard (Hkv = H here)
    return ((world - 1) * kv * elt * 2 + world * kv * 4) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768, 65536], help="sequence lengths")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], help="process counts (1 = single-process tiled)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mask", default="causal", choices=["causal", "none"])
    ap.add_argument("--sharding", default="zigzag", choices=["zigzag", "striped", "contiguous"])
    ap.add_argument("--kv-chunk", type=int, default=None, help="keys per ring message (default: the library's)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration: the largest peak, the median time")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / processes)")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/ring.json)")
    args = ap.parse_args(argv)

    from bhqk.functional import names

    single_backend = "tiled" if "tiled" in names() else "auto"
    base = {k: getattr(args, k) for k in ("batch", "heads", "dim", "dtype", "mask", "sharding", "kv_chunk", "repeats", "threads")}
    rows = []
    for n in args.n:
        single = None
        for world in args.procs:
            cfg = {**base, "n": n, "mode": "single" if world == 1 else "ring", "single_backend": single_backend}
            r = {"n": n, "procs": world, "impl": f"bhqk.attention ({single_backend})" if world == 1 else "ring_attention",
                 **measure(cfg, world), "sent_mib_per_rank": sent_mib(cfg, world)}
            if world == 1:
                single = r["peak_mib"]
            r["vs_single"] = r["peak_mib"] / single if single else None
            rows.append(r)
            print(f"N={n} P={world}: peak {r['peak_mib']:.0f} MiB"
                  + (f" ({r['vs_single']:.2f}× single)" if r["vs_single"] else "") + f", {r['seconds']:.1f} s", flush=True)

    head = "| N | processes | path | per-rank peak (MiB) | × single-process | fwd+bwd (s) | sent per rank (MiB) |"
    lines = [head, "|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['vs_single']:.2f}" if r["vs_single"] is not None else "–"
        lines.append(f"| {r['n']} | {r['procs']} | {r['impl']} | {r['peak_mib']:.0f} | {ratio} | {r['seconds']:.1f} | "
                     f"{r['sent_mib_per_rank']:.0f} |")
    table = "\n".join(lines)
    print()
    print(table)
    meta = {**machine.describe(), "python": platform.python_version(), "cores": CORES, "kernel": "tiled",
            "machine": platform.machine(), "note": "processes share the cores: time is indicative only"}
    path = Path(args.json) if args.json else Path(__file__).parent / "results" / "ring.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": vars(args), "meta": meta, "rows": rows, "markdown": table}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
