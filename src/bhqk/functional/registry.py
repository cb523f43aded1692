"""Backends are registry entries, not flags: each says why it cannot take a call (``why_not``), and may claim it by
structure (``share``) or estimate its cost; ``auto`` (:func:`decide`) names no backend and says why it chose."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from ..errors import BackendError
from ..masks import Mask
from ..shapes import Sizes
from ..shortcuts import Cache, declare
from . import calibrate, flex, reference, spans, tiled, tiled_plan, torch_sdpa
from .costs import Costs, Estimate
from .problem import Problem, default_scale, extent_of, prepare


@dataclass(frozen=True)
class Backend:
    """A registry entry: one callable shape for every backend (as transformers' AttentionInterface)."""

    name: str
    run: Callable[[Problem, bool, Any], tuple[torch.Tensor, torch.Tensor | None]]  # (problem, need_lse, plan_for's) -> (out, lse)
    why_not: Callable[[Problem, bool], str | None]  # (problem, need_lse) -> why it cannot take the call, or None
    estimate: Callable[[Problem, bool, Costs], Estimate] | None = None  # (problem, grad, costs) -> seconds, the plan weighed
    traceable: bool = True  # torch.compile can trace its run
    hands_off: Callable[[Problem, Any], tuple[str, str] | None] | None = None  # (problem, plan) -> (who computes it right, why)
    share: Callable[[Problem, Any], float | None] | None = None  # (p, plan) -> fraction of scores its exact fused call computes
    plan_for: Callable[[Problem], Any] | None = None  # its plan of the call (kept by its own plan cache)
    fast: Callable[[Problem], Callable[..., torch.Tensor | None] | None] | None = None  # (q, k, v) -> out of the family, or None

    def plan(self, p: Problem, plan: Any = None) -> Any:
        """``plan``, else this backend's plan of ``p`` (None: it has none)."""
        return plan if plan is not None or self.plan_for is None else self.plan_for(p)


@dataclass(frozen=True)
class Choice:
    """The backend that runs a call, why, the seconds of each backend weighed, the ``plan`` it reuses."""

    backend: Backend
    reason: str
    estimates: Mapping[str, float]  # read-only for a kept claim (nothing weighed)
    plan: Any = None
    by_auto: bool = False  # auto chose it: if its run raises a BackendError, auto may choose again

    @property
    def name(self) -> str:
        return self.backend.name

    def run(self, p: Problem, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out [B, H, Q, dv] and lse [B, H, Q] or None, from the chosen backend with its plan."""
        if not self.backend.traceable and torch.compiler.is_compiling():
            return _outside_graph()(self.backend.run, p, need_lse, self.plan)
        return self.backend.run(p, need_lse, self.plan)


@dataclass(frozen=True)
class Kept:
    """A claim kept for a family of calls: what ``prepare`` checked and bound, the ``Choice`` without a
    plan (its backend's plan cache keeps that), the backend's ``fast`` for the family; no tensor."""

    sizes: Sizes
    scale: float
    softcap: float | None
    dropout_p: float
    options: dict
    choice: Choice
    fast: Callable[..., torch.Tensor | None] | None


class Decisions(Cache[Kept]):
    """The claims ``auto`` keeps per call family (:func:`family`), the registry's ``version`` (in every
    key) and ``last_mask``: what :func:`family` last read of a mask (a model's layers share one)."""

    version = 0  # bumped by register() and unregister()
    last_mask: tuple | None = None  # (mask, (B, H, Q, K), its part of a key, its causal diagonal)

    def clear(self) -> None:
        super().clear()
        self.last_mask = None


DECISIONS = Decisions(  # a model's decode steps: one family for every layer and every step
    "decisions", "prepare's checks, every backend's why_not and share, the chosen backend's per-call decisions (fast)",
    "family(): the version, need_lse, grad mode, q, k, v's shapes, dtypes, devices and requires_grad, the mask's type and "
    "attributes, scale, softcap, dropout_p, options; K but where the one query sees every key", 1024, "a new key (register, "
    "unregister: a new version); never kept with a bias, sinks, a mask but causal, under torch.compile, or for a call that "
    "raised")
declare(DECISIONS)
_REGISTRY: dict[str, Backend] = {}
_PLAIN = frozenset({float, int, type(None)})  # scale, softcap, dropout_p kept as their own key
# what family() reads: every compared field of a Problem (tests/test_grid_shortcuts.py checks the list against the dataclass)
FAMILY_READS = ("q", "k", "v", "sizes", "mask", "bias", "scale", "softcap", "dropout_p", "options", "sinks")
_LEFT: list[Callable[..., Any]] = []  # what _outside_graph() returns, made at first need
_AT_RUN_TIME = Backend("auto", lambda p, need_lse, plan: decide(p, need_lse).run(p, need_lse),  # type: ignore[misc]
                       lambda p, lse: None, traceable=False)  # auto under torch.compile: decided at run time, outside the graph


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; ``auto`` considers it from the next call on."""
    _REGISTRY[backend.name] = backend
    DECISIONS.version += 1
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    DECISIONS.version += 1


def names() -> list[str]:
    return sorted(_REGISTRY) + ["auto"]


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}; choose one of {names()}.")
    return _REGISTRY[name]


register(Backend("reference", reference.run, reference.why_not))  # builds [B, H, Q, K]
register(Backend("torch", torch_sdpa.run, torch_sdpa.why_not, torch_sdpa.estimate, hands_off=torch_sdpa.hands_off,
                 share=torch_sdpa.share, fast=torch_sdpa.fast))  # F.scaled_dot_product_attention
register(Backend("spans", spans.run, spans.why_not, traceable=False, hands_off=spans.hands_off, share=spans.share,
                 plan_for=spans.plan_for))  # the fused kernel over the key spans a mask allows; after torch: a tie goes to SDPA
register(Backend("tiled", tiled.run, tiled.why_not, tiled_plan.estimate, traceable=False, plan_for=tiled_plan.plan_for))
register(Backend("flex", flex.run, flex.why_not, flex.estimate, hands_off=flex.hands_off))


def _outside_graph() -> Callable[..., Any]:
    """Where compiled code leaves its graph (tiled, ``auto``): ``run(p, need_lse, plan)`` under ``torch.compiler.disable``."""
    if not _LEFT:  # wrapped at first need: disable imports torch._dynamo, which import bhqk should not pay
        _LEFT.append(torch.compiler.disable(lambda run, p, need_lse, plan: run(p, need_lse, plan)))
    return _LEFT[0]


def decide(p: Problem, need_lse: bool) -> Choice:
    """``auto``: of the backends that can take the call, the claimant computing the fewest scores (a tie: the first
    registered), else the cheapest ``estimate``; never the reference (neither). Claims are kept per family."""
    fam = None if p.bias is not None or p.sinks is not None or torch.compiler.is_compiling() else \
        family(p.q, p.k, p.v, p.mask, p.scale, p.softcap, p.dropout_p, "bhnd", p.options, need_lse)
    if fam is not None and (hit := DECISIONS.lookup(fam[0])) is not None:
        return _handed_off(hit.choice, p)
    refused: dict[str, str] = {}
    claims: list[tuple[float, int, Backend, Any]] = []
    weighed: list[Backend] = []
    for order, be in enumerate(sorted(_REGISTRY.values(), key=lambda b: b.share is None)):  # claimants first
        if be.share is None and (claims or be.estimate is None):  # a claim wins: the others need not be asked
            continue
        if (reason := be.why_not(p, need_lse)) is not None:
            refused[be.name] = reason
        elif be.share is not None and (share := be.share(p, plan := be.plan(p))) is not None:
            claims.append((share, order, be, plan))
        elif be.estimate is not None:
            weighed.append(be)
    if claims:
        (share, _, be, plan), *others = sorted(claims, key=lambda c: c[:2])
        why = f"{be.name}: PyTorch's fused kernel computes this call exactly, {share:.0%} of the scores"
        why += "".join(f"; {o.name} would compute {s:.0%}" for s, _, o, _ in others) + _nots(refused)
        if fam is not None:  # handed out again: read-only, and without the plan (its plan cache keeps that)
            DECISIONS.put(fam[0], Kept(p.sizes.copy(), p.scale, p.softcap, p.dropout_p, dict(p.options),
                                       Choice(be, why, MappingProxyType({}), by_auto=True), be.fast and be.fast(p)))
        return _handed_off(Choice(be, why, {}, plan, by_auto=True), p)
    grad = p.needs_grad
    c = calibrate.costs(p.q.device, p.q.dtype, grad) if weighed else None
    found = {be.name: be.estimate(p, grad, c) for be in weighed}  # type: ignore[misc,arg-type]  # weighed: it has one
    refused.update({n: found.pop(n).note for n in [n for n, e in found.items() if math.isinf(e.seconds)]})
    if not found:
        raise BackendError(f"auto found no backend that avoids building [B, H, Q, K] for this call ({_nots(refused)[2:]}); "
                           "pass backend='reference' to accept O(Q·K) memory.")
    best, *rest = sorted(found, key=lambda n: found[n].seconds)
    said = {n: f"{1e3 * e.seconds:.3g} ms" + (f" ({e.note})" if e.note else "") for n, e in found.items()}
    why = f"{best}: estimated {said[best]}" + "".join(f" vs {n} {said[n]}" for n in rest)
    why += (" (forward+backward)" if grad else "") + "; no fused kernel claims this call" + _nots(refused)
    return _handed_off(Choice(_REGISTRY[best], why, {n: e.seconds for n, e in found.items()}, found[best].plan, True), p)


def family(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale, softcap, dropout_p, layout: str,
           options: dict | None, need_lse: bool) -> tuple[tuple, tuple[int, int, int, int], bool] | None:
    """(The key of the decision kept for a call without a bias or sinks: all ``prepare``'s checks and every claim read,
    K left out where the one query sees every key; (B, H, Q, K); whether it does), or None: not kept."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor \
            or type(scale) not in _PLAIN or type(softcap) not in _PLAIN or type(dropout_p) not in _PLAIN:
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    if layout == "bnhd":
        qs, ks, vs = ((s[0], s[2], s[1], s[3]) for s in (qs, ks, vs))  # type: ignore[assignment]  # [B, N, H, x] -> bhnd
    elif layout != "bhnd":
        return None
    B, H, Q, d = qs
    K = ks[2]
    every = Q == 1 and K >= 1 and vs[2] == K
    part = None
    if mask is not None:
        read = DECISIONS.last_mask
        if read is None or read[0] is not mask or read[1] != (B, H, Q, K):  # the layers of a model share a mask
            if not isinstance(mask, Mask):
                return None
            try:
                if (diagonal := mask.causal_diagonal(extent_of(B, H, Q, K))) is None:  # else it is key ≤ query + diagonal
                    return None
            except ValueError:  # e.g. causal without an alignment for Q ≠ K: prepare says so
                return None
            read = (mask, (B, H, Q, K), _part(mask), diagonal)  # a mask is a value: what it holds does not change
            if DECISIONS.on:
                DECISIONS.last_mask = read
        part, diagonal = read[2], read[3]
        every = every and diagonal >= K - 1
    key = (DECISIONS.version, need_lse, torch.is_grad_enabled(), qs, ks[:2], ks[3], vs[:2], vs[3],
           None if every else (K, vs[2]), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
           q.requires_grad, k.requires_grad, v.requires_grad, part, default_scale(d) if scale is None else scale,
           softcap, dropout_p, tuple(options.items()) if options else ())
    return key, (B, H, Q, K), every


def prepared(backend: str, need_lse: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, bias=None,
             scale=None, softcap=None, dropout_p=0.0, layout: str = "bhnd", options: dict | None = None,
             sinks=None) -> tuple[Problem, Choice]:
    """The checked call (``prepare``) and what runs it (:func:`resolve`); a call on ``auto`` of a family
    whose claim is kept skips both (its checks passed for the family) but for the NaN/inf hand-off."""
    if backend == "auto" and bias is None and sinks is None and DECISIONS.on and not torch.compiler.is_compiling():
        fam = family(q, k, v, mask, scale, softcap, dropout_p, layout, options, need_lse)
        if fam is not None and (hit := DECISIONS.lookup(fam[0])) is not None:  # only K may differ in a family
            sizes = hit.sizes.again(layout, q, k, v)
            if layout == "bnhd":
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N, H, d] -> [B, H, N, d] (views)
            p = Problem.kept(q, k, v, sizes, extent_of(*fam[1]), mask, hit.scale, hit.softcap, hit.dropout_p,
                             dict(hit.options) if hit.options else {}, fam[2])
            return p, _handed_off(hit.choice, p)
    p = prepare(q, k, v, mask, bias, scale, softcap, dropout_p, layout, options, sinks=sinks)
    return p, resolve(backend, p, need_lse)


def fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale, softcap, dropout_p, layout: str,
         options: dict | None) -> torch.Tensor | None:
    """out of an ``auto`` call without a bias, sinks or the lse, by the ``fast`` of the decision kept for its family
    (no ``Problem`` built), or None: none kept, or its hand-off applies. Callers check ``observe.quiet()``."""
    fam = family(q, k, v, mask, scale, softcap, dropout_p, layout, options, False)
    hit = None if fam is None else DECISIONS.lookup(fam[0])
    if hit is None or hit.fast is None:
        return None
    if layout == "bnhd":  # [B, N, H, x] -> [B, H, N, x] and the output back (views)
        out = hit.fast(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return None if out is None else out.transpose(1, 2)
    return hit.fast(q, k, v)


def _part(x: Any) -> Any:
    """What a claim reads of a mask: its type and attributes, a tensor's shape, dtype, device and
    requires_grad (not its values), a dict's items in order, else the value (unhashable: not kept)."""
    if isinstance(x, Mask):
        return (type(x), *[(k, _part(v)) for k, v in vars(x).items()])
    if isinstance(x, torch.Tensor):
        return ("tensor", x.shape, x.dtype, x.device, x.requires_grad)
    if isinstance(x, dict):
        return ("dict", *[(k, _part(v)) for k, v in x.items()])
    return x


def _nots(refused: dict[str, str]) -> str:
    return "".join(f"; not {n}: {r}" for n, r in refused.items())


def _handed_off(choice: Choice, p: Problem) -> Choice:
    """``choice`` with its backend's plan of ``p`` (planned once per call), or the backend it hands this call to."""
    be = choice.backend
    plan = choice.plan if not be.traceable and torch.compiler.is_compiling() else be.plan(p, choice.plan)
    to = be.hands_off(p, plan) if be.hands_off is not None else None
    if to is not None:
        why = f"{choice.reason}; {choice.name} hands it to {to[0]}: {to[1]}"
        return Choice(get(to[0]), why, choice.estimates, by_auto=choice.by_auto)
    return choice if plan is choice.plan else replace(choice, plan=plan)


def choose_backend(q, k, v, mask=None, *, bias=None, scale=None, softcap=None, dropout_p=0.0, layout="bhnd",
                   return_lse=False, block_q=None, block_k=None, sinks=None) -> Choice:
    """The :class:`Choice` (``.name``, ``.reason``, ``.estimates``) ``attention(q, k, v, mask, ...)`` on
    ``auto`` would run; gradients count when q, k or v require them and grad mode is on."""
    options = {k_: v_ for k_, v_ in (("block_q", block_q), ("block_k", block_k)) if v_ is not None}
    return decide(prepare(q, k, v, mask, bias, scale, softcap, dropout_p, layout, options, sinks=sinks), return_lse)


def resolve(backend: str, p: Problem, need_lse: bool) -> Choice:
    """What will run the call, or a BackendError that says why the named backend cannot."""
    if backend == "auto":  # under torch.compile: decided at run time, outside the graph
        return Choice(_AT_RUN_TIME, "auto under torch.compile", {}) if torch.compiler.is_compiling() else decide(p, need_lse)
    be = get(backend)
    if (reason := be.why_not(p, need_lse)) is not None:
        raise BackendError(f"backend {backend!r} cannot take this call: {reason}.")
    return _handed_off(Choice(be, f"{backend}: requested", {}), p)


def why_not(backend: str, q, k, v, mask=None, *, bias=None, scale=None, softcap=None, dropout_p=0.0,
            layout="bhnd", return_lse=False) -> str | None:
    """``None`` if ``backend`` can take this call, else the reason in words (shape errors still raise)."""
    p = prepare(q, k, v, mask, bias, scale, softcap, dropout_p, layout)
    if backend == "auto":
        try:
            decide(p, return_lse)
        except BackendError as e:
            return str(e)
        return None
    return get(backend).why_not(p, return_lse)
