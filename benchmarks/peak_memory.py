"""Peak memory of this process, for the benchmarks (benchmarks/ring.py): CUDA allocator stats on GPUs, the
kernel's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) on CPUs.

On the CPU, glibc keeps freed blocks below its (adaptive) mmap threshold in its heap and hands them
out again without the resident set growing, which hides allocations from VmHWM. Call
:func:`exact_cpu_peaks` before the first large allocation (the benchmark does): it fixes
the threshold at 128 KiB (``mallopt``), so every tensor of that size or more is mapped when
allocated and unmapped when freed, and the high-water mark counts what was really held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import torch

_M_MMAP_THRESHOLD = -3


def exact_cpu_peaks() -> None:
    """Make glibc map and unmap every allocation of 128 KiB or more (process-wide; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (``VmRSS``: resident now; ``VmHWM``: its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB -> bytes
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_high_water() -> None:
    """Set VmHWM to the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def in_fresh_process(script: str, spec: dict, timeout: float) -> dict:
    """Run ``script --child SPEC`` in a new interpreter and return the JSON object it prints last
    (a benchmark's peak-memory child), or ``{"mem_note": why}`` when it fails or times out."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    try:
        r = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True,
                           text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"mem_note": f"memory run timed out after {timeout:.0f} s"}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"mem_note": f"memory run failed: {tail[:160]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


class Peak:
    """``with Peak(device) as p: ...`` then ``p.bytes``: the most memory held above the start."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0

    def __enter__(self) -> Peak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            exact_cpu_peaks()
            reset_high_water()
            self.start = status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.bytes = status_bytes("VmHWM") - self.start
