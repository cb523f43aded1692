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

    backends, N = sys.argv[1].split(","), int(sys.argv[2])
    B, H, d = 1, 1, 16  # one float32 [B, H, Q, K] tensor: 4·N² bytes (1 GiB at N = 16384)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, requires_grad=True) for _ in range(3))
    mask = bhqk.masks.causal()

    small = [t[:, :, :256].detach().requires_grad_(True) for t in (q, k, v)]
    for backend in backends:
        bhqk.attention(*small, mask, backend=backend).sum().backward()  # threads and allocator warmed up

    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    budget = int(sys.argv[3]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + budget, resource.RLIM_INFINITY))
    for backend in backends:  # one after the other under the one cap, each from the same inputs
        q.grad = k.grad = v.grad = None
        try:
            out = bhqk.attention(q, k, v, mask, backend=backend)
            out.sum().backward()
        except (MemoryError, RuntimeError) as e:
            print(backend, "OOM", type(e).__name__, " ".join(str(e)[:200].split()))
            continue
        print(backend, "OK", float(out.float().abs().sum()), bool(torch.isfinite(q.grad).all()))
        del out
    """
)


def _run(backends: list[str], N: int, budget_mib: int) -> dict[str, list[str]]:
    """Each backend's line of the script (its first word dropped): ["OK", sum, finite] or ["OOM", why …]."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(backends), str(N), str(budget_mib)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.strip()}
    assert set(lines) == set(backends), done.stdout + done.stderr
    return lines


@pytest.mark.parametrize("N,budget_mib", [(8192, 128)])  # one [Q, K] float32 tensor: 256 MiB > 128 MiB
def test_forward_and_backward_fit_under_a_cap_smaller_than_one_score_tensor(N, budget_mib):
    """tiled, then reference in the same process under the same cap (one interpreter start, not two)."""
    assert 4 * N * N > budget_mib << 20
    got = _run(["tiled", "reference"], N, budget_mib)
    assert got["tiled"][0] == "OK", got
    assert got["tiled"][2] == "True"  # finite gradients
    assert got["reference"][0] == "OOM", got


@pytest.mark.slow
def test_at_16k_one_score_tensor_would_be_a_gibibyte():
    got = _run(["tiled"], 16384, 256)
    assert got["tiled"][0] == "OK" and got["tiled"][2] == "True", got
