"""The tiled backend never allocates a tensor whose size grows with Q·K: its forward and backward
run in a subprocess whose address space is capped below the size of one float32 [B, H, Q, K]
tensor. The reference backend, run under the same cap, fails: the cap is real."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    import bhqk

    backend, N = sys.argv[1], int(sys.argv[2])
    B, H, d = 1, 1, 16  # one float32 [B, H, Q, K] tensor: 4·N² bytes (1 GiB at N = 16384)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, requires_grad=True) for _ in range(3))
    mask = bhqk.masks.causal()

    small = [t[:, :, :256].detach().requires_grad_(True) for t in (q, k, v)]
    bhqk.attention(*small, mask, backend=backend).sum().backward()  # threads and allocator warmed up

    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    budget = int(sys.argv[3]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + budget, resource.RLIM_INFINITY))
    try:
        out = bhqk.attention(q, k, v, mask, backend=backend)
        out.sum().backward()
    except (MemoryError, RuntimeError) as e:
        print("OOM", type(e).__name__, str(e)[:200])
        sys.exit(3)
    print("OK", float(out.float().abs().sum()), bool(torch.isfinite(q.grad).all()))
    """
)


def _run(backend: str, N: int, budget_mib: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.run([sys.executable, "-c", SCRIPT, backend, str(N), str(budget_mib)],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("N,budget_mib", [(8192, 128)])  # one [Q, K] float32 tensor: 256 MiB > 128 MiB
def test_forward_and_backward_fit_under_a_cap_smaller_than_one_score_tensor(N, budget_mib):
    assert 4 * N * N > budget_mib << 20
    tiled = _run("tiled", N, budget_mib)
    assert tiled.returncode == 0 and tiled.stdout.startswith("OK"), tiled.stdout + tiled.stderr
    assert tiled.stdout.split()[2] == "True"  # finite gradients
    ref = _run("reference", N, budget_mib)
    assert ref.returncode == 3 and ref.stdout.startswith("OOM"), ref.stdout + ref.stderr


@pytest.mark.slow
def test_at_16k_one_score_tensor_would_be_a_gibibyte():
    tiled = _run("tiled", 16384, 256)
    assert tiled.returncode == 0 and tiled.stdout.startswith("OK"), tiled.stdout + tiled.stderr
