"""Backends are registry entries, not flags: each says why it cannot take a call (``why_not``), and
may claim it by structure (``share``) or estimate its cost (its own model, in its own file).
``auto`` (:func:`decide`) names no backend and says why it chose (:func:`choose_backend`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..errors import BackendError
from ..masks import Mask
from ..shortcuts import Cache, declare
from . import calibrate, flex, reference, spans, tiled, tiled_plan, torch_sdpa
from .costs import Costs, Estimate
from .problem import Problem, prepare

Run = Callable[[Problem, bool, Any], tuple[torch.Tensor, "torch.Tensor | None"]]  # (problem, need_lse, plan) -> (out, lse)
WhyNot = Callable[[Problem, bool], "str | None"]  # (problem, need_lse) -> why it cannot take the call


@dataclass(frozen=True)
class Backend:
    """A registry entry: one callable shape for every backend (as transformers' AttentionInterface).

    ``run(problem, need_lse, plan)``: out [B, H, Q, dv] and lse [B, H, Q] or None; ``plan`` is the one
    ``plan_for`` made for this call (None: planless, or planned by ``run`` itself).
    ``plan_for(problem)``: its plan of the call (kept by its plan cache under the mask, the sizes and
    ``plan_key(problem)``: what else the plan depends on); both None for a backend without a plan.
    ``share(problem, plan)``: the fraction of the B·H·Q·K scores it computes where PyTorch's fused
    kernel computes the call exactly through it (1.0: nothing skipped), else None.
    ``estimate(problem, grad, costs)``: seconds (its ``Estimate.plan``: the plan it weighed).
    ``traceable``: ``torch.compile`` can trace its run. ``hands_off(problem, plan)``: (the backend
    that computes a call it takes but cannot compute right, why)."""

    name: str
    run: Run
    why_not: WhyNot
    estimate: Callable[[Problem, bool, Costs], Estimate] | None = None
    traceable: bool = True
    hands_off: Callable[[Problem, Any], tuple[str, str] | None] | None = None
    share: Callable[[Problem, Any], float | None] | None = None
    plan_for: Callable[[Problem], Any] | None = None
    plan_key: Callable[[Problem], Hashable] | None = None

    def plan(self, p: Problem, plan: Any = None) -> Any:
        """``plan``, else this backend's plan of ``p`` (None: it has none)."""
        return plan if plan is not None or self.plan_for is None else self.plan_for(p)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; ``auto`` considers it from the next call on."""
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    return sorted(_REGISTRY) + ["auto"]


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}; choose one of {names()}.")
    return _REGISTRY[name]


register(Backend("reference", reference.run, reference.why_not))  # builds [B, H, Q, K]
register(Backend("torch", torch_sdpa.run, torch_sdpa.why_not, torch_sdpa.estimate, hands_off=torch_sdpa.hands_off,
                 share=torch_sdpa.share))  # F.scaled_dot_product_attention
# the fused kernel over the key spans a mask allows; after torch, so a tie of shares (nothing to skip) goes to plain SDPA
register(Backend("spans", spans.run, spans.why_not, traceable=False, hands_off=spans.hands_off, share=spans.share,
                 plan_for=spans.plan_for, plan_key=spans.plan_key))
register(Backend("tiled", tiled.run, tiled.why_not, tiled_plan.estimate, traceable=False, plan_for=tiled_plan.plan_for,
                 plan_key=tiled_plan.plan_key))
register(Backend("flex", flex.run, flex.why_not, flex.estimate, hands_off=flex.hands_off))


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


def _leave_graph(run: Run, p: Problem, need_lse: bool, plan: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where ``torch.compile``d code leaves its graph (it breaks; ``fullgraph=True`` fails): the tiled
    backend (worker threads, decisions read from the data) and ``auto`` (its choice reads the data
    and the measured costs). ``backend="torch"`` compiles to one graph."""
    return run(p, need_lse, plan)


_LEFT: list[Callable[..., Any]] = []  # _leave_graph wrapped by torch.compiler.disable, made at first need


def _outside_graph() -> Callable[..., Any]:
    """``_leave_graph`` under ``torch.compiler.disable``, wrapped the first time a compiled call needs it:
    ``disable`` imports ``torch._dynamo`` (about 1 s), which ``import bhqk`` should not pay."""
    if not _LEFT:
        _LEFT.append(torch.compiler.disable(_leave_graph))
    return _LEFT[0]


def _decided_run(p: Problem, need_lse: bool, plan: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``auto`` under ``torch.compile``: decided at run time, outside the graph."""
    return decide(p, need_lse).run(p, need_lse)


_AT_RUN_TIME = Backend("auto", _decided_run, lambda p, lse: None, traceable=False)


def decide(p: Problem, need_lse: bool) -> Choice:
    """``auto``, by structure first: of the backends that can take the call, the claimant (``share``:
    PyTorch's fused kernel computes it exactly) computing the fewest scores runs (a tie: the first
    registered, so plain SDPA when nothing can be skipped); unclaimed calls (softcap, dropout, a mask
    SDPA needs dense) go to the cheapest ``estimate``; a backend with neither (the reference) never."""
    key = _structure(p, need_lse)
    try:
        hit = None if key is None else CLAIMS.lookup(key)
    except TypeError:  # an option that is no value: not kept
        key = hit = None
    if hit is not None:
        return _handed_off(hit, p)
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
        if key is not None:  # handed out again: read-only, and without the plan (its plan cache keeps that)
            CLAIMS.put(key, Choice(be, why, _NOTHING_WEIGHED, by_auto=True))
        return _handed_off(Choice(be, why, {}, plan, by_auto=True), p)
    grad, found = p.needs_grad, {}
    c = calibrate.costs(p.q.device, p.q.dtype, grad) if weighed else None
    for be in weighed:
        est = be.estimate(p, grad, c)  # type: ignore[misc,arg-type]  # weighed: it has one; c: measured for them
        found[be.name] = est
        if math.isinf(est.seconds):
            refused[be.name] = found.pop(be.name).note
    if not found:
        raise BackendError(f"auto found no backend that avoids building [B, H, Q, K] for this call ({_nots(refused)[2:]}); "
                           "pass backend='reference' to accept O(Q·K) memory.")
    ranked = sorted(found, key=lambda n: found[n].seconds)
    said = {n: f"{1e3 * e.seconds:.3g} ms" + (f" ({e.note})" if e.note else "") for n, e in found.items()}
    why = f"{ranked[0]}: estimated {said[ranked[0]]}" + "".join(f" vs {n} {said[n]}" for n in ranked[1:])
    why += (" (forward+backward)" if grad else "") + "; no fused kernel claims this call" + _nots(refused)
    estimates = {n: e.seconds for n, e in found.items()}
    return _handed_off(Choice(_REGISTRY[ranked[0]], why, estimates, found[ranked[0]].plan, True), p)


CLAIMS: Cache[Choice] = Cache(  # claims where they read no data (a model's decode steps)
    "claims", "asking every backend's why_not and share again", "the registry's entries, need_lse, grad mode, and "
    "every compared field of the Problem (tensors by shape, dtype, device, requires_grad; the mask by type and "
    "attributes): derived from the dataclass, not written by hand", 1024,
    "a new registry entry or any field of the call; never kept with a bias, sinks or a mask but causal (they read data)")
declare(CLAIMS)
_NOTHING_WEIGHED: Mapping[str, float] = MappingProxyType({})


def _structure(p: Problem, need_lse: bool) -> tuple | None:
    """All a claim depends on, for a call without a bias, sinks or a mask but causal: the registry,
    need_lse, grad mode and every compared field of ``p`` (:func:`_part`; ``sizes`` is derived from
    q, k, v's shapes); None where not kept (and where the key turns out unhashable: see :func:`decide`)."""
    diagonal = None if p.mask is None else p.mask.causal_diagonal(p.ext)  # the mask is exactly key ≤ query + diagonal
    if p.bias is not None or p.sinks is not None or (p.mask is not None and diagonal is None):
        return None
    key = [tuple(map(id, _REGISTRY.values())), need_lse, p.needs_grad]
    for name in _FIELDS:
        x = getattr(p, name)
        key.append(x if type(x) in _VALUES else _part(x))
    return tuple(key)


_DERIVED = {"sizes"}  # bound from q, k, v's shapes and the layout, which the key holds
_FIELDS = tuple(f.name for f in dataclasses.fields(Problem) if f.compare and f.name not in _DERIVED)  # what a claim reads
_VALUES = frozenset({float, int, bool, str, type(None)})  # fields that are their own key


def _part(x: Any) -> Any:
    """What a claim reads of one field of a call: a tensor's shape, dtype, device and requires_grad
    (not its values), a mask's type and attributes, a dict's items (in their order: another order is
    only a miss), else the value (an unhashable one: not kept)."""
    if type(x) in _VALUES:
        return x
    if isinstance(x, torch.Tensor):
        return ("tensor", x.shape, x.dtype, x.device, x.requires_grad)
    if isinstance(x, dict):
        return ("dict", *[(k, _part(v)) for k, v in x.items()])
    if isinstance(x, Mask):
        return (type(x), *[(k, _part(v)) for k, v in vars(x).items()])
    return x


def _nots(refused: dict[str, str]) -> str:
    return "".join(f"; not {n}: {r}" for n, r in refused.items())


def _handed_off(choice: Choice, p: Problem) -> Choice:
    """``choice`` with its backend's plan of ``p``, or the backend its backend hands this call to
    (``Backend.hands_off``). The plan travels in the ``Choice``: planned once per call (under
    ``torch.compile`` a backend that leaves the graph plans in its run, outside it)."""
    be = choice.backend
    plan = choice.plan if not be.traceable and torch.compiler.is_compiling() else be.plan(p, choice.plan)
    to = be.hands_off(p, plan) if be.hands_off is not None else None
    if to is not None:
        why = f"{choice.reason}; {choice.name} hands it to {to[0]}: {to[1]}"
        return Choice(get(to[0]), why, choice.estimates, by_auto=choice.by_auto)
    return choice if plan is choice.plan else dataclasses.replace(choice, plan=plan)


def choose(p: Problem, need_lse: bool) -> Backend:
    return decide(p, need_lse).backend  # what auto would run


def choose_backend(q, k, v, mask=None, *, bias=None, scale=None, softcap=None, dropout_p=0.0, layout="bhnd",
                   return_lse=False, block_q=None, block_k=None, sinks=None) -> Choice:
    """What ``attention(q, k, v, mask, ...)`` with ``backend="auto"`` would run: the :class:`Choice`
    (``.name``, ``.reason``: the winner and why, ``.estimates``). Gradients count when q, k or v
    require them and grad mode is on."""
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
