"""Backends are registry entries, not flags. ``why_not`` says in words why one cannot take a call;
``auto`` picks by what each can do and what each costs, and never falls back silently to a path
whose memory grows with Q·K."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import BackendError
from . import flex, reference, tiled, tiled_plan, torch_sdpa
from .problem import Problem, prepare

Run = Callable[[Problem, bool], tuple[torch.Tensor, "torch.Tensor | None"]]  # (out, lse): lse when asked, or when computed anyway
WhyNot = Callable[[Problem, bool], "str | None"]

TINY = 64 * 64  # Q·K at or below which the reference is as fast as anything (no tiling overhead)


@dataclass(frozen=True)
class Backend:
    name: str
    run: Run
    why_not: WhyNot


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def names() -> list[str]:
    return sorted(_REGISTRY) + ["auto"]


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}; choose one of {names()}.")
    return _REGISTRY[name]


register(Backend("reference", reference.run, lambda p, need_lse: None))  # the executable spec: builds [B, H, Q, K]
register(Backend("torch", torch_sdpa.run, torch_sdpa.why_not))  # F.scaled_dot_product_attention
register(Backend("tiled", tiled.run, tiled.why_not))  # online softmax over tiles: O(Q + K) memory, skips masked tiles
register(Backend("flex", flex.run, flex.why_not))  # FlexAttention, compiled, block-sparse from the tile classes; explicit only


# auto's cost model, measured on the 2-core reference machine (DESIGN.md §7; torch 2.13, B=1, H=8,
# d = dv = 64, benchmarks/attention.py); only the ratios between backends matter. SDPA: seconds per
# score entry (one query-key pair of one head) of its flash kernel; its causal kernel does not halve
# the time; a dense mask / bias costs per [Q, K] entry. The tiled backend's model (per tile, per
# row group, per entry, per partial tile) is in tiled_plan; it computes fp16/bf16 in float32.
SDPA_ELEM = {torch.float32: 1.08e-9, torch.bfloat16: 0.45e-9, torch.float16: 1.1e-9, torch.float64: 2.4e-9}
SDPA_CAUSAL = {torch.bfloat16: 0.75}  # time with is_causal / without; 0.6 for the other dtypes
SDPA_DENSE_ELEM = 2.5e-9  # per entry of a dense [Q, K] mask or bias handed to SDPA
TILED_DTYPE = {torch.float64: 2.2, torch.bfloat16: 1.1, torch.float16: 1.1}  # tiled time relative to float32
BACKWARD = {"torch": 3.6, "tiled": 3.1}  # forward+backward time / forward time
SDPA_BACKWARD = {torch.bfloat16: 6.0}  # SDPA's bf16 backward gains less from bf16 than its forward
DENSE_GRAD = 1.8  # the dense mask's cost with a backward / without
DENSE_LIMIT = 1 << 24  # entries of a dense mask/bias above which auto never hands one to SDPA


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked, why, and the estimated seconds of every backend it weighed; ``plan``:
    the tiled backend's tile plan when it was made to estimate the call (the run reuses it)."""

    backend: Backend
    reason: str
    estimates: dict[str, float]
    plan: tiled_plan.Plan | None = None

    def run(self, p: Problem, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the chosen backend on ``p`` (the call this choice was made for)."""
        if self.plan is not None:
            return tiled.run(p, need_lse, self.plan)
        return self.backend.run(p, need_lse)


def _grad(p: Problem) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v))


def _sdpa_time(p: Problem) -> float:
    """Seconds of SDPA's score work for a forward, without the dense-mask part."""
    ext = p.ext
    t = ext.B * ext.H * ext.Q * ext.K * SDPA_ELEM.get(p.q.dtype, SDPA_ELEM[torch.float32])
    if p.mask is not None and torch_sdpa.structure_free(p):  # causal, aligned as PyTorch's is_causal
        t *= SDPA_CAUSAL.get(p.q.dtype, 0.6)
    return t


def _dense_entries(p: Problem) -> int:
    """Entries of the dense mask / bias the torch adapter would build (an upper bound)."""
    e = p.ext
    return e.Q * e.K * e.B * (e.H if p.bias is not None else 1)


def estimate_torch(p: Problem, grad: bool) -> float:
    """Estimated seconds of the torch (SDPA) backend for this call (forward, or forward+backward)."""
    width = (p.sizes["d"] + p.sizes["dv"]) / 128
    t = _sdpa_time(p) * width * (SDPA_BACKWARD.get(p.q.dtype, BACKWARD["torch"]) if grad else 1.0)
    if not torch_sdpa.structure_free(p):
        t += _dense_entries(p) * SDPA_DENSE_ELEM * (DENSE_GRAD if grad else 1.0)
    return t


def estimate_tiled(p: Problem, grad: bool, plan: tiled_plan.Plan | None = None) -> float:
    """Estimated seconds of the tiled backend for this call, from its tile plan (made here if not given)."""
    width = (p.sizes["d"] + p.sizes["dv"]) / 128
    plan = plan if plan is not None else tiled_plan.plan_for(p)
    n = len(tiled_plan.split(p.ext.B, p.sizes["Hkv"], tiled_plan.workers()))
    t = plan.cost(p.ext.B * p.ext.H, n) * width * TILED_DTYPE.get(p.q.dtype, 1.0)
    return t * (BACKWARD["tiled"] if grad else 1.0)


def _tiled_floor(p: Problem, grad: bool) -> float:
    """A lower bound of ``estimate_tiled`` that needs no tile plan (per call and per query row)."""
    ext = p.ext
    n = len(tiled_plan.split(ext.B, p.sizes["Hkv"], tiled_plan.workers()))
    t = tiled_plan.COST_CALL + tiled_plan.COST_ROW * ext.Q * ext.B * ext.H / n
    return t * TILED_DTYPE.get(p.q.dtype, 1.0) * (BACKWARD["tiled"] if grad else 1.0)


def decide(p: Problem, need_lse: bool) -> Choice:
    """The ``auto`` policy, with its reasons:

    1. tiny calls (Q·K ≤ TINY, e.g. a decode step): PyTorch's fused kernel when it can take the
       call without a dense mask (one fused op beats the reference's several), else the reference —
       nothing to gain from tiling;
    2. PyTorch's fused kernel when it takes the call as is (no mask or a causal mask it aligns the
       same way, no bias, softcap, lse or dropout it cannot do): it skips what the tiled backend
       would skip, and is faster per score;
    3. otherwise the cheaper, by the cost model above, of the tiled backend (which skips masked
       tiles, returns lse, takes softcap) and SDPA handed a dense mask / bias of at most
       ``DENSE_LIMIT`` entries (never silently O(Q·K) memory beyond that). The reference is never
       picked for non-tiny calls.
    """
    ext = p.ext
    if ext.Q * ext.K <= TINY:
        if torch_sdpa.structure_free(p) and torch_sdpa.why_not(p, need_lse) is None:
            return Choice(_REGISTRY["torch"], f"tiny call (Q·K = {ext.Q * ext.K} ≤ {TINY}) SDPA takes as one fused op", {})
        return Choice(_REGISTRY["reference"], f"tiny call (Q·K = {ext.Q * ext.K} ≤ {TINY}): the reference has no tiling overhead", {})
    grad = _grad(p)
    if torch_sdpa.structure_free(p) and torch_sdpa.why_not(p, need_lse) is None:
        return Choice(_REGISTRY["torch"], "PyTorch's fused kernel takes this call as is (no mask, or a causal mask it aligns the "
                      "same way): the tiled backend cannot skip more, and is slower per score", {})
    estimates: dict[str, float] = {}
    refused: dict[str, str] = {}
    reason = torch_sdpa.why_not(p, need_lse)
    if reason is None and not torch_sdpa.structure_free(p) and _dense_entries(p) > DENSE_LIMIT:
        reason = (f"it would need a dense mask/bias of {_dense_entries(p)} entries (> {DENSE_LIMIT}); "
                  "auto does not build O(Q·K) tensors for it")
    if reason is None:
        estimates["torch"] = estimate_torch(p, grad)
    else:
        refused["torch"] = reason
    plan: tiled_plan.Plan | None = None
    reason = _REGISTRY["tiled"].why_not(p, need_lse)
    if reason is not None:
        refused["tiled"] = reason
    elif "torch" in estimates and _tiled_floor(p, grad) >= estimates["torch"]:
        refused["tiled"] = f"its fixed costs alone (≈ {1e3 * _tiled_floor(p, grad):.3g} ms) exceed that"
    else:
        plan = tiled_plan.plan_for(p)
        estimates["tiled"] = estimate_tiled(p, grad, plan)
    if not estimates:
        reasons = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise BackendError(
            "auto found no backend that avoids building [B, H, Q, K] for this call "
            f"({reasons}); pass backend='reference' to accept O(Q·K) memory."
        )
    name = min(estimates, key=estimates.__getitem__)
    costs = ", ".join(f"{n} ≈ {1e3 * t:.3g} ms" for n, t in sorted(estimates.items(), key=lambda x: x[1]))
    why = f"estimated {costs}" + "".join(f"; not {n}: {r}" for n, r in refused.items())
    return Choice(_REGISTRY[name], why, estimates, plan if name == "tiled" else None)


def choose(p: Problem, need_lse: bool) -> Backend:
    """The backend ``auto`` runs for this call (see :func:`decide` for the policy and its reasons)."""
    return decide(p, need_lse).backend


def select(backend: str, p: Problem, need_lse: bool) -> Choice:
    """How the call will run (``Choice.run``), or a BackendError that says why the named backend cannot."""
    if backend == "auto":
        return decide(p, need_lse)
    be = get(backend)
    reason = be.why_not(p, need_lse)
    if reason is not None:
        raise BackendError(f"backend {backend!r} cannot take this call: {reason}.")
    return Choice(be, f"backend={backend!r} was asked for", {})


def resolve(backend: str, p: Problem, need_lse: bool) -> Backend:
    """The backend that will run the call, or a BackendError that says why the named one cannot."""
    return select(backend, p, need_lse).backend


def why_not(backend: str, q, k, v, mask=None, *, bias=None, scale=None, softcap=None, dropout_p=0.0,
            layout="bhnd", return_lse=False) -> str | None:
    """``None`` if ``backend`` can take this call, else the reason in words (shape errors still raise)."""
    p = prepare(q, k, v, mask, bias, scale, softcap, dropout_p, layout)
    if backend == "auto":
        try:
            choose(p, return_lse)
        except BackendError as e:
            return str(e)
        return None
    return get(backend).why_not(p, return_lse)
