"""What machine a benchmark ran on: every JSON result records this, every quoted figure names it.

The machines these benchmarks run on differ (an Intel Xeon with AVX-512/AMX, an AMD EPYC with AVX2
only, a GPU): a figure without its CPU model and flags cannot be compared with anything.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

# SIMD flags that change how fast PyTorch's CPU kernels are (fp32 width, bf16/int8 matrix units)
ENV_OF_INTEREST = ("BHQK_COSTS", "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "OMP_NUM_THREADS")  # settings that change a figure
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                     "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (or the platform's best guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD flags of interest that this CPU reports."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[1].split())
            break
    return [f for f in FLAGS_OF_INTEREST if f in flags]


def describe() -> dict:
    """Plain data about this machine and run, for a benchmark's JSON ``meta``."""
    info = {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_start": os.getloadavg(),
        "command": " ".join(["python", *sys.argv]),
        "env": {k: os.environ[k] for k in ENV_OF_INTEREST if k in os.environ},  # prefixes the command
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def one_line(info: dict) -> str:
    """``Intel(R) Xeon(R) Processor (avx2, avx512f, amx_bf16), 2 cores, torch 2.13.0+cpu``."""
    flags = ", ".join(info.get("cpu_flags", [])) or "no SIMD flags read"
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    return f"{info['cpu_model']} ({flags}), {info['cores']} cores{gpu}, torch {info['torch']}"


if __name__ == "__main__":
    print(one_line(describe()))
