"""Backends are registry entries, not flags. Each says in words why it cannot take a call
(``why_not``) and what a call would cost it (``estimate``, from costs measured on this machine:
``calibrate``). ``auto`` (:func:`decide`) weighs every registered backend that can take the call,
runs the cheapest with the plan its estimate made, and says why (:func:`choose_backend`). A backend
without an estimate (the reference, whose memory grows with Q·K) is never picked: auto never falls
back silently to an O(Q·K)-memory path."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..bias import Dense as DenseBias
from ..errors import BackendError, PerformanceHint, warn_user
from ..masks import Dense
from . import calibrate, flex, reference, spans, tiled, tiled_plan, torch_sdpa
from .problem import Problem, prepare

Run = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]  # (problem, need_lse, plan=None) -> (out, lse)
WhyNot = Callable[[Problem, bool], "str | None"]  # (problem, need_lse) -> why it cannot take the call


class Estimate(NamedTuple):
    """What a backend expects a call to cost: ``seconds`` (inf: auto must not pick it, ``note`` says
    why), a ``note`` on what the figure rests on, the ``plan`` its run reuses (the tile plan), and
    ``upfront`` seconds its first run pays once for every later call with the same ``upfront_key``
    (a compile; 0 when already paid). See :func:`decide` for how auto weighs it."""

    seconds: float
    note: str = ""
    plan: object = None  # opaque to auto, handed back to its run (object, not Any: pdoc evaluates it out of this module)
    upfront: float = 0.0
    upfront_key: object = None


@dataclass(frozen=True)
class Backend:
    """A registry entry. ``estimate(problem, grad)`` is what ``auto`` weighs (None: auto never
    picks it, e.g. the reference, whose memory grows with Q·K); ``floor(problem, grad)`` is an
    optional cheap lower bound of the estimate, so auto skips estimating a backend (planning its
    tiles) that cannot win. ``traceable``: ``torch.compile`` can trace its run (else the run
    happens outside the compiled graph, see :meth:`Choice.run`). ``hands_off(problem)``: the
    backend that computes a call it takes but cannot compute right, and why (None: it computes
    it); the Choice then names that backend, so traces say what ran."""

    name: str
    run: Run
    why_not: WhyNot
    estimate: Callable[[Problem, bool], Estimate] | None = None
    floor: Callable[[Problem, bool], float] | None = None
    traceable: bool = True
    hands_off: Callable[[Problem], tuple[str, str] | None] | None = None


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; ``auto`` weighs it from the next call on."""
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


# ---- the cost models of the built-in backends (costs measured on this machine: calibrate) -------

DENSE_LIMIT = 1 << 24  # entries of a dense mask/bias above which auto never hands one to SDPA


def _width(p: Problem) -> float:
    return (p.sizes["d"] + p.sizes["dv"]) / 128  # the costs were measured at d = dv = 64


def _dense_entries(p: Problem) -> int:
    """Entries of the dense mask / bias the torch adapter would build (an upper bound)."""
    e = p.ext
    return e.Q * e.K * e.B * (e.H if p.bias is not None else 1)


def estimate_torch(p: Problem, grad: bool) -> Estimate:
    """SDPA: per score entry (its causal kernel skips part), plus per entry of a dense mask/bias
    it must be handed, plus building that mask when it is structured."""
    c = calibrate.costs(p.q.device, p.q.dtype, grad)
    e = p.ext
    entries = e.B * e.H * e.Q * e.K
    t, note = entries * c.sdpa_elem * _width(p), ""
    measured_mask = grad and c.sdpa_mask_elem_backward is not None  # its forward+backward with a mask, measured
    if torch_sdpa.structure_free(p):
        if p.mask is not None:  # is_causal: its share of the time, forward or forward+backward
            t *= c.sdpa_causal_backward if grad and c.sdpa_causal_backward is not None else c.sdpa_causal
        t *= _grad_factor(c.sdpa_backward, grad)
    else:
        dense = _dense_entries(p)
        if dense > DENSE_LIMIT:
            return Estimate(math.inf, f"it would need a dense mask/bias of {dense} entries (> {DENSE_LIMIT}); "
                            "auto does not build O(Q·K) tensors for it")
        if measured_mask:  # the mask's extra per entry, forward+backward
            t = t * _grad_factor(c.sdpa_backward, grad) + entries * (c.sdpa_mask_elem_backward or 0.0)
        else:
            t = (t + entries * c.sdpa_mask_elem) * _grad_factor(c.sdpa_backward, grad)
        built = isinstance(p.mask, (Dense, type(None))) and (p.bias is None or isinstance(p.bias, DenseBias))
        t += 0.0 if built else dense * c.sdpa_build_elem  # built once, forward or not
        note = f"dense mask {dense / 1e6:.3g} M entries" + ("" if built else ", built for it")
    return Estimate(t + c.sdpa_call, note)


def estimate_tiled(p: Problem, grad: bool) -> Estimate:
    """The tiled backend: its tile plan's cost model (fixed and per-entry parts scaled to this
    machine), plus the time it took to plan (classifying a dense mask is part of the call)."""
    c = calibrate.costs(p.q.device, p.q.dtype, grad)
    t0 = time.perf_counter()
    plan = tiled_plan.plan_for(p)
    planning = time.perf_counter() - t0 if c.source != "fixed" else 0.0  # fixed costs: deterministic estimates
    fixed, entries, partial = calibrate.tiled_parts(p, plan)
    entries += partial * (1.0 if c.tiled_partial is None else c.tiled_partial / c.tiled_elem)  # the mask's extra, in entries
    t = _tiled_seconds(c, grad, fixed, entries * _width(p))
    note = f"{plan.fraction(p.ext):.0%} of the scores in {plan.tiles} tiles, planned in {1e3 * planning:.2g} ms"
    return Estimate(t + planning, note, plan)


def estimate_flex(p: Problem, grad: bool) -> Estimate:
    """Compiled FlexAttention: per call plus per entry of the blocks its BlockMask visits, from
    costs measured on this machine (none: auto does not weigh it), and the compile as ``upfront``
    while its kernel is not compiled yet."""
    dev, dt = p.q.device, p.q.dtype
    c = calibrate.flex_costs(dev, dt)
    if c is None:
        where = f"{dev.type}, {str(dt).removeprefix('torch.')}"
        return Estimate(math.inf, f"its costs were never measured on this machine ({where}); "
                                  "`bhqk calibrate --flex` measures them once (it compiles kernels)")
    if grad and c.backward is None:
        return Estimate(math.inf, "its forward+backward was never measured on this machine")
    entries = flex.visited(p)
    t = (c.call + entries * c.elem * _width(p)) * _grad_factor(c.backward, grad)
    note = f"{entries / max(1, p.ext.B * p.ext.H * p.ext.Q * p.ext.K):.0%} of the scores in the blocks it visits"
    key = flex.kernel_key(p)
    forward_paid = not flex.uses_compile() or flex.compiled(key)
    backward_paid = not grad or not flex.uses_compile() or flex.compiled(key, backward=True)
    if forward_paid and backward_paid:
        return Estimate(t, note + ", compiled")
    upfront = 0.0 if forward_paid else c.compile + (0.0 if flex.compiled_any(dev.type) else c.first_compile)
    upfront += 0.0 if backward_paid else (c.compile if c.backward_compile is None else c.backward_compile)
    return Estimate(t, note, upfront=upfront, upfront_key=("flex", key, grad))


def tiled_floor(p: Problem, grad: bool) -> float:
    """A lower bound of ``estimate_tiled`` without a tile plan: per call and per query row."""
    c = calibrate.costs(p.q.device, p.q.dtype, grad)
    ext = p.ext
    n = len(tiled_plan.split(ext.B, p.sizes["Hkv"], tiled_plan.workers(p.q.device)))
    m = tiled_plan.model(p.q.device)
    return _tiled_seconds(c, grad, m.call, m.row * ext.Q * ext.B * ext.H / n * _width(p))


def _tiled_seconds(c: calibrate.Costs, grad: bool, fixed: float, entries: float) -> float:
    """The tile model's fixed and per-entry parts (model seconds) in this machine's seconds: by the
    measured forward+backward scales when ``grad`` (a table without them: the forward's × ratio)."""
    if grad and c.tiled_elem_backward is not None and c.tiled_fixed_backward is not None:
        return fixed * c.tiled_fixed_backward + entries * c.tiled_elem_backward
    return (fixed * c.tiled_fixed + entries * c.tiled_elem) * _grad_factor(c.tiled_backward, grad)


def _grad_factor(ratio: float | None, grad: bool) -> float:
    """Forward+backward / forward time when ``grad`` (``calibrate.costs(..., grad=True)`` always
    measures it), else 1."""
    if not grad:
        return 1.0
    if ratio is None:  # never: costs(..., grad=True) fills both ratios
        raise RuntimeError("bhqk internal error: calibrated costs lack a backward ratio")
    return ratio


def _plan_free(run: Callable[[Problem, bool], tuple]) -> Run:
    def run_(p: Problem, need_lse: bool, plan: Any = None) -> tuple:
        return run(p, need_lse)

    run_.__doc__ = run.__doc__
    return run_


register(Backend("reference", _plan_free(reference.run), lambda p, need_lse: None))  # the spec: builds [B, H, Q, K]
register(Backend("torch", _plan_free(torch_sdpa.run), torch_sdpa.why_not, estimate_torch, hands_off=torch_sdpa.hands_off))
register(Backend("tiled", tiled.run, tiled.why_not, estimate_tiled, tiled_floor, traceable=False))
register(Backend("flex", _plan_free(flex.run), flex.why_not, estimate_flex, hands_off=flex.hands_off))  # compiled FlexAttention
register(Backend("spans", spans.run, spans.why_not, traceable=False, hands_off=spans.hands_off))  # fused kernel, mask spans


# ---- the policy -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """The backend that runs a call, why, and the estimated seconds of every backend ``auto``
    weighed; ``plan`` is the work the run reuses (the tiled backend's tile plan)."""

    backend: Backend
    reason: str
    estimates: dict[str, float]
    plan: Any = None
    by_auto: bool = False  # auto chose it: if its run raises a BackendError, auto may choose again

    @property
    def name(self) -> str:
        return self.backend.name

    def run(self, p: Problem, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out [B, H, Q, dv] and lse [B, H, Q] or None, from the chosen backend with its plan."""
        if not self.backend.traceable and torch.compiler.is_compiling():
            return _outside_graph(self.backend.run, p, need_lse, self.plan)
        return self.backend.run(p, need_lse, self.plan)


@torch.compiler.disable
def _outside_graph(run: Run, p: Problem, need_lse: bool, plan: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one place where ``torch.compile``d code leaves its graph: a backend run that dynamo
    cannot trace runs here eagerly (the graph breaks; with ``fullgraph=True`` compiling fails).
    That is the tiled backend — worker threads; per-tile decisions read from the data, ``bool(t)``
    = ``t.item()``: lazy rescaling, the redo of a tile whose max grew, the finiteness checks; a
    padding mask's classification reads its lengths — and ``auto`` under compile (its choice
    times a tile plan and reads this machine's measured costs, so it is made at run time, here).
    Compile with ``backend="torch"`` for one graph (``fullgraph=True`` works)."""
    return run(p, need_lse, plan)


def _decide_and_run(p: Problem, need_lse: bool, plan: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    choice = decide(p, need_lse)
    return choice.backend.run(p, need_lse, choice.plan)


_AT_RUN_TIME = Backend("auto", _decide_and_run, lambda p, need_lse: None, traceable=False)  # auto under compile


def _ms(t: float) -> str:
    return f"{1e3 * t:.3g} ms"


_SAVED: dict[object, float] = {}  # upfront_key -> seconds its backend would have saved on earlier calls


def decide(p: Problem, need_lse: bool, record: bool = True) -> Choice:
    """The ``auto`` policy: every registered backend with an ``estimate`` that can take the call
    (``why_not`` is None) is weighed, and the cheapest by its estimate runs. Backends are
    estimated in order of their ``floor``; one whose floor already exceeds the best estimate is
    not estimated. Backends without an estimate (the reference: O(Q·K) memory) are never picked:
    auto never falls back to a path whose memory grows with Q·K silently.

    An estimate with an ``upfront`` cost (a compile) competes only once it is paid for, like
    renting before buying: calls with its ``upfront_key`` add up what it would have saved over the
    best of the others (``record``: this call counts; :func:`choose_backend` does not record), and
    it is weighed when the savings of earlier calls and this one reach the upfront cost. A first
    call never pays it, nor does a call it would not make faster (a tiny one); in all, auto spends
    at most about twice what knowing the future would have let it spend."""
    grad = p.needs_grad
    refused: dict[str, str] = {}
    floors: dict[str, float] = {}
    estimates: dict[str, Callable[[Problem, bool], Estimate]] = {}
    for be in _REGISTRY.values():
        if be.estimate is None:
            continue
        reason = be.why_not(p, need_lse)
        if reason is not None:
            refused[be.name] = reason
        else:
            floors[be.name] = be.floor(p, grad) if be.floor is not None else 0.0
            estimates[be.name] = be.estimate
    found: dict[str, Estimate] = {}
    for name in sorted(floors, key=floors.__getitem__):
        best = min((e.seconds for e in found.values() if e.upfront_key is None), default=math.inf)  # upfront: maybe not weighed
        if floors[name] >= best:
            refused[name] = f"its fixed costs alone (≈ {_ms(floors[name])}) exceed that"
            continue
        est = estimates[name](p, grad)
        if math.isinf(est.seconds):
            refused[name] = est.note
        else:
            found[name] = est
    paying = _weigh_upfront(found, refused, record)
    if not found:
        reasons = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise BackendError(
            "auto found no backend that avoids building [B, H, Q, K] for this call "
            f"({reasons}); pass backend='reference' to accept O(Q·K) memory."
        )
    ranked = sorted(found, key=lambda n: found[n].seconds)
    win = ranked[0]
    if record and found[win].upfront_key is not None:
        _SAVED.pop(found[win].upfront_key, None)  # paid: its later calls start from nothing

    def said(n: str) -> str:
        return f"{_ms(found[n].seconds)}" + (f" ({found[n].note})" if found[n].note else "")

    why = f"{win}: estimated {said(win)}" + "".join(f" vs {n} {said(n)}" for n in ranked[1:])
    why += " (forward+backward)" if grad else ""
    why += f"; {paying[win]}" if win in paying else ""
    why += "".join(f"; not {n}: {r}" for n, r in refused.items())
    if record:
        flex_hint(p.q.device, p.q.dtype, win, "flex" in estimates)
    return _handed_off(Choice(_REGISTRY[win], why, {n: e.seconds for n, e in found.items()}, found[win].plan, True), p)


_HINTED: set[tuple[str, torch.dtype]] = set()


def flex_hint(device: torch.device, dtype: torch.dtype, winner: str, flex_could_run: bool) -> None:
    """Once per (device type, dtype): a PerformanceHint when auto runs the tiled backend off the
    CPU on a call FlexAttention could take (its ``why_not`` is None) but its costs were never
    measured there, so auto could not weigh it (tiled is the fallback on a GPU)."""
    device_type = device.type
    if device_type == "cpu" or winner != "tiled" or not flex_could_run or calibrate.flex_costs(device, dtype) is not None:
        return
    if (device_type, dtype) not in _HINTED:
        _HINTED.add((device_type, dtype))
        warn_user(f"bhqk: auto ran the tiled backend on {device_type} ({str(dtype).removeprefix('torch.')}) because "
                  "FlexAttention's costs were never measured on this machine; on a GPU FlexAttention is usually much "
                  f"faster for masks: run `bhqk calibrate --device {device_type} --flex` once (it is kept for this "
                  "machine), or pass backend='flex'.", PerformanceHint)


def _handed_off(choice: Choice, p: Problem) -> Choice:
    """``choice``, or the backend its backend hands this call to (``Backend.hands_off``)."""
    to = choice.backend.hands_off(p) if choice.backend.hands_off is not None else None
    if to is None:
        return choice
    name, why = to
    return Choice(get(name), f"{choice.reason}; {choice.name} hands it to {name}: {why}", choice.estimates,
                  by_auto=choice.by_auto)


def _weigh_upfront(found: dict[str, Estimate], refused: dict[str, str], record: bool) -> dict[str, str]:
    """Drop from ``found`` (into ``refused``, with the reason) every estimate whose upfront cost is
    not paid for yet (see :func:`decide`), recording what it would have saved; return a note for
    each that stays ("compiles now")."""
    paid = [e.seconds for e in found.values() if e.upfront_key is None]
    best = min(paid, default=math.inf)
    paying = {}
    for name, est in list(found.items()):
        if est.upfront_key is None:
            continue
        saved, gain = _SAVED.get(est.upfront_key, 0.0), max(0.0, best - est.seconds)
        if saved > 0 and saved + gain >= est.upfront:
            paying[name] = (f"{name} pays its compile now ({est.upfront:.3g} s), saved by calls with this structure "
                            f"({saved + gain:.3g} s so far)")
            continue
        del found[name]
        refused[name] = (f"it would first compile ({est.upfront:.3g} s), which calls with this structure have not paid for "
                         f"yet ({saved + gain:.3g} s saved so far{'' if saved else '; never on a first call'})")
        if record and gain > 0:
            _SAVED[est.upfront_key] = saved + gain
    return paying


def choose(p: Problem, need_lse: bool) -> Backend:
    """The backend ``auto`` would run for this call (see :func:`decide`), without recording it."""
    return decide(p, need_lse, record=False).backend


def choose_backend(q, k, v, mask=None, *, bias=None, scale=None, softcap=None, dropout_p=0.0, layout="bhnd",
                   return_lse=False, block_q=None, block_k=None) -> Choice:
    """What ``attention(q, k, v, mask, ...)`` with ``backend="auto"`` would run, without running it:
    the :class:`Choice` (``.name``, ``.estimates`` in seconds per backend weighed, ``.reason``
    naming the winner). Gradients count when q, k or v require them and grad mode is on."""
    options = {k_: v_ for k_, v_ in (("block_q", block_q), ("block_k", block_k)) if v_ is not None}
    return decide(prepare(q, k, v, mask, bias, scale, softcap, dropout_p, layout, options), return_lse, record=False)


def resolve(backend: str, p: Problem, need_lse: bool) -> Choice:
    """What will run the call (``.name``, ``.run(p, need_lse)``), or a BackendError that says why
    the named backend cannot."""
    if backend == "auto":
        if torch.compiler.is_compiling():
            return Choice(_AT_RUN_TIME, "auto under torch.compile: decided at run time, outside the graph", {})
        return decide(p, need_lse)
    be = get(backend)
    reason = be.why_not(p, need_lse)
    if reason is not None:
        raise BackendError(f"backend {backend!r} cannot take this call: {reason}.")
    return _handed_off(Choice(be, f"{backend}: requested", {}), p)


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
