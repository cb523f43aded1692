"""Backends are registry entries, not flags. ``why_not`` says in words why one cannot take a call;
``auto`` picks by what each can do and what each costs, and never falls back silently to a path
whose memory grows with Q·K."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import BackendError
from . import reference, torch_sdpa
from .problem import Problem, prepare

Run = Callable[[Problem, bool], tuple[torch.Tensor, "torch.Tensor | None"]]
WhyNot = Callable[[Problem, bool], "str | None"]

TINY = 64 * 64  # Q·K at or below which the reference is as fast as anything (no tiling overhead)


@dataclass(frozen=True)
class Backend:
    name: str
    run: Run
    why_not: WhyNot
    doc: str
    quadratic_memory: bool = False  # builds [B, H, Q, K]


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


register(Backend("reference", reference.run, lambda p, need_lse: None,
                 "the executable spec: builds S and P [B, H, Q, K]", quadratic_memory=True))
register(Backend("torch", torch_sdpa.run, torch_sdpa.why_not,
                 "F.scaled_dot_product_attention (PyTorch's fused kernels)"))


def choose(p: Problem, need_lse: bool) -> Backend:
    """The ``auto`` policy. Order of preference:
    1. tiny calls (Q·K ≤ TINY): the reference — nothing to gain from tiling;
    2. PyTorch's fused kernel when it can take the call with no dense mask (no mask, or a causal
       mask it aligns the same way), no bias, no softcap and no log-sum-exp wanted;
    3. the tiled backend, which evaluates structured masks and biases tile by tile.
    """
    ext = p.ext
    if ext.Q * ext.K <= TINY:
        return _REGISTRY["reference"]
    if torch_sdpa.structure_free(p) and torch_sdpa.why_not(p, need_lse) is None:
        return _REGISTRY["torch"]
    if "tiled" in _REGISTRY and _REGISTRY["tiled"].why_not(p, need_lse) is None:
        return _REGISTRY["tiled"]
    reasons = "; ".join(f"{b.name}: {b.why_not(p, need_lse)}" for b in _REGISTRY.values() if not b.quadratic_memory)
    raise BackendError(
        "auto found no backend that avoids building [B, H, Q, K] for this call "
        f"({reasons}); pass backend='reference' to accept O(Q·K) memory."
    )


def resolve(backend: str, p: Problem, need_lse: bool) -> Backend:
    """The backend that will run the call, or a BackendError that says why the named one cannot."""
    if backend == "auto":
        return choose(p, need_lse)
    be = get(backend)
    reason = be.why_not(p, need_lse)
    if reason is not None:
        raise BackendError(f"backend {backend!r} cannot take this call: {reason}.")
    return be


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
