"""The tiled backend's worker threads (CPU path only): a persistent pool running single-threaded ops.

On the CPU the (batch, key/value head) slices of a call, or the row groups of a single slice, are
shared out among ``torch.get_num_threads()`` worker threads, each running single-threaded ops, so
that no op waits at an OpenMP barrier for a thread the OS has descheduled (on a shared machine that
wait made the many small ops of a tile loop up to ten times slower). The device path never uses
the pool: its one job runs inline on the calling thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .tiled_plan import RowGroup

__all__ = ["balance", "in_parallel", "pool"]

_POOL: tuple[ThreadPoolExecutor, int] | None = None  # (pool, its number of threads)
_POOL_LOCK = threading.Lock()


def pool(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least ``n`` worker threads, kept between calls: a fresh thread
    pays for its first matmuls (MKL sets up per thread), about 10 ms per call here."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[1] < n:
            old, _POOL = _POOL, (ThreadPoolExecutor(max_workers=n, thread_name_prefix="bhqk-tiled"), n)
            if old is not None:
                old[0].shutdown(wait=False)
        return _POOL[0]


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def in_parallel(jobs: list[Callable[[], object]]) -> list:
    """Run ``jobs`` and return their results in order: inline when there is one (always on the
    device path; on the CPU, PyTorch's intra-op threads then split each op); otherwise on the
    pool's threads, each running single-threaded ops, with the caller's grad/inference mode."""
    if len(jobs) == 1:
        return [jobs[0]()]
    threads = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()  # thread-local, like grad mode: carried over by hand

    def work(job):
        torch.set_num_threads(1)  # this thread's OpenMP and MKL setting (and the default for new threads)
        try:
            with torch.inference_mode() if inference else torch.no_grad():
                return job()
        finally:
            torch.set_num_threads(threads)

    executor = pool(len(jobs))
    futures = [executor.submit(work, job) for job in jobs]
    return [f.result() for f in futures]


def balance(rows: list[RowGroup], n: int) -> list[list[RowGroup]]:
    """Row groups dealt to ``n`` workers, each getting about the same number of rectangles."""
    load = [0] * n
    groups: list[list[RowGroup]] = [[] for _ in range(n)]
    for group in sorted((g for g in rows if g.rects), key=lambda g: -len(g.rects)):
        w = load.index(min(load))
        groups[w].append(group)
        load[w] += len(group.rects) + 1
    return [g for g in groups if g]
