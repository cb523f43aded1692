"""The one place that measures what differs per machine: ``costs.Costs`` for SDPA and the tiled backend the first time
``auto`` weighs a call on a device type and dtype (the backward when a call needs it), FlexAttention's
``costs.FlexCosts`` only when asked (``bhqk calibrate --flex``: it compiles)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from .. import masks
from ..errors import BackendError
from . import flex, tiled, tiled_plan, torch_sdpa
from .costs import Costs, FlexCosts, keep, kept
from .problem import prepare

N, H, D = 2048, 4, 64  # the measured calls: [1, H, N, D] (per-entry costs dominate, as in the calls that matter)
SMALL = 128  # an overhead-bound call: [1, 1, SMALL, D], causal
FLEX_N = (1024, 2048)  # FlexAttention is timed with a window of 256 at these lengths
SAMPLE_S = 4e-3  # each timed sample repeats a call until it lasts about this long


def costs(device: torch.device, dtype: torch.dtype, grad: bool = False) -> Costs:
    """The kept costs of ``device``'s type in ``dtype``, measured now where missing (``grad``: forward+backward too)."""
    c = kept(device, dtype, Costs)
    if c is None or (grad and c.sdpa_backward is None):
        keep(device, dtype, c := measure(device, dtype, grad, c))
    return c


def remeasure(device: torch.device | str, dtype: torch.dtype) -> Costs:
    """Measure SDPA's and the tiled backend's costs again, forward and forward+backward, and keep them."""
    keep(device, dtype, c := measure(torch.device(device), dtype, True))
    return c


def _fastest(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5) -> dict[str, float]:
    """Seconds per call of each function: the fastest of ``rounds`` samples of about ``SAMPLE_S`` each,
    the functions interleaved after a warm-up (a burst of load hits every function alike)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, reps = dict.fromkeys(fns, float("inf")), dict.fromkeys(fns, 1)
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            sync()
            took = (time.perf_counter() - t) / reps[name]
            best[name] = min(best[name], took) if r or not rounds else best[name]  # rounds=0: the warm-up
            reps[name] = reps[name] if r else max(1, min(50, round(SAMPLE_S / max(took, 1e-6))))
    return best


def _inputs(device, dtype, n: int, h: int = H, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, n, D, generator=g).to(device=device, dtype=dtype).requires_grad_(grad) for _ in range(3))  # type: ignore[return-value]


def _both(run: Callable[..., tuple], *args) -> Callable[[], None]:
    return lambda: run(*args)[0].sum().backward()  # forward+backward of out


def measure(device: torch.device, dtype: torch.dtype, grad: bool = False, old: Costs | None = None) -> Costs:
    """Time SDPA (a tiny call, no mask, a window mask handed dense) and the tiled backend (no mask, a window, a small
    causal call) at N = ``N``, forward; with ``grad`` forward+backward too (``old``: forward costs measured before)."""
    big, small = _inputs(device, dtype, N, grad=grad), _inputs(device, dtype, SMALL, 1, grad=grad)
    calls = [prepare(*big), prepare(*big, masks.sliding_window(N // 8)), prepare(*small, masks.causal())]
    plans = [tiled_plan.plan_for(p) for p in calls]
    model = sum(pl.cost(p.ext.H, tiled_plan.shares(p)) for p, pl in zip(calls, plans))
    fns: dict[str, Callable[[], object]] = {f"tiled{i}": partial(tiled.forward, *c) for i, c in enumerate(zip(calls, plans))}
    entries, sdpa = H * N * N, torch_sdpa.run
    if old is None:
        tiny = prepare(*_inputs(device, dtype, 16, 1))
        fns.update(call=partial(sdpa, tiny), plain=partial(sdpa, calls[0]), mask=partial(sdpa, calls[1]))
        with torch.no_grad():
            t = _fastest(fns, device)
        old = Costs(t["call"], max(t["plain"] - t["call"], 0.1 * t["plain"]) / entries,
                    max(0.0, t["mask"] - t["plain"]) / entries, sum(t[f"tiled{i}"] for i in range(3)) / model)
    if not grad:
        return old
    fns = {f"tiled{i}": _both(tiled.run, p, False, pl) for i, (p, pl) in enumerate(zip(calls, plans))}
    b = _fastest({"plain": _both(sdpa, calls[0]), **fns}, device)
    sdpa_backward = max(1.5, b["plain"] / (old.sdpa_call + old.sdpa_elem * entries))
    return replace(old, sdpa_backward=sdpa_backward, tiled_backward=sum(b[f"tiled{i}"] for i in range(3)) / model)


def measure_flex(device: torch.device | str, dtype: torch.dtype) -> FlexCosts:
    """Compile FlexAttention for a window afresh (on-disk caches off), time it at the ``FLEX_N`` lengths (one kernel),
    on CUDA forward+backward too; kept for this machine, so ``auto`` weighs ``flex`` from then on."""
    device = torch.device(device)
    calls = [prepare(*_inputs(device, dtype, n, grad=device.type != "cpu"), masks.sliding_window(256)) for n in FLEX_N]
    if (reason := flex.why_not(calls[0], False)) is not None:
        raise BackendError(f"cannot measure FlexAttention on {device.type} in {dtype}: {reason}.")
    with torch.no_grad():
        flex.forget(flex.kernel_key(calls[0]))
        with torch._inductor.config.patch(force_disable_caches=True):
            compile_s = _fastest({"first": partial(flex.run, calls[0])}, device, rounds=0)["first"]  # the warm-up compiles
        t = _fastest({"short": partial(flex.run, calls[0]), "long": partial(flex.run, calls[1])}, device, rounds=3)
    elem = max(t["long"] - t["short"], 1e-9) / (flex.visited(calls[1]) - flex.visited(calls[0]))
    c = FlexCosts(max(compile_s - t["short"], 0.0), max(t["short"] - elem * flex.visited(calls[0]), 0.0), elem)
    if device.type != "cpu":  # FlexAttention has a backward here
        c = replace(c, backward=max(1.5, _fastest({"both": _both(flex.run, calls[1])}, device, rounds=3)["both"] / t["long"]))
    keep(device, dtype, c)
    return c
