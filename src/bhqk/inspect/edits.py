"""Edits as functions at named points of an attention call (``bhqk.edits``; TransformerLens's hook points).

An attention call passes four named points, in this order (:data:`POINTS`; h = the heads an edit names):

================  ==============  =============================================================
point             axes            what is there
================  ==============  =============================================================
``mask``          [B, h, Q, K]    the call's mask (True = may attend), before the softmax
``scores``        [B, h, Q, K]    S = q·kᵀ·scale (soft-capped) plus the call's bias
``weights``       [B, h, Q, K]    P = softmax(S) over K (before dropout)
``head_outputs``  [B, h, Q, dv]   O_h = P·V, before the heads merge
================  ==============  =============================================================

An edit is a list of :class:`Step` s, each a value or a function at one point; ``bhqk.edit(..., do=...)``
applies them to the heads it selects. The ready-made ones are the entries of :data:`EDITS`, made by
``edits.zero()``, ``.scale(s)``, ``.mask(M)``, ``.bias(T)``, ``.weights(P)`` and ``.output(O)`` (the
keyword form ``bhqk.edit(zero=True, scale=, mask=, bias=, weights=, output=)`` is the same steps).
Zeros in a given P are not a knock-out: no renormalization, so the row sums to less than 1.

``edits.at(point, fn)`` is a user function at a point: ``fn(t) -> t'`` of the same shape, t the
point's tensor for the edit's heads in this call. Where it runs and what it costs:

- ``at("head_outputs", fn)``: o [B, h, Q, dv] from the fast path (or from the edit's recomputed
  heads); costs ``fn`` and a few [B, h, Q, dv] copies (the heads taken out, given to ``fn``, put
  back into [B, H, Q, dv]). Exact: o is what the model merges next.
- ``at("scores", fn)``: S [B, h, Q, K] (−inf where masked), built for the edit's heads only by the
  reference with every mask and bias edit on those heads; then P = softmax(fn(S)) (a row with no
  finite score gives 0; the call's sinks count) and O_h = P·V. The lse the call returns (and capture
  reads) is that of fn(S). O(Q·K) time and memory for each edited head.
- ``at("weights", fn)``: P [B, h, Q, K] (built as above, or given by ``edits.weights``), then
  O_h = fn(P)·V, used as given (no renormalization; the lse reads 0, as for a given P). O(Q·K) per
  edited head, as ``edits.weights``.

The other heads stay on the fast path. ``mask`` takes values only (masks ANDed) and ``scores``'s
ready-made edit is a bias added: both stay structured, so the edited heads' sub-call keeps its
fast path and builds no [Q, K]. How steps combine on one head, in one call: masks AND,
biases add; a given P (``weights``) or O (``output``) replaces the point's tensor (the innermost
edit's, when nested edits give one) and makes the points before it moot; then the functions at the
point run, the outer edit's first, each edit's in the order given. A new kind of edit is one entry
of :data:`EDITS` (and its test) at a (point, how) the engine carries out (:data:`ACTIONS`; a
``Kind`` elsewhere is refused). A user function receives a copy (it may write in place) and must
return the same shape, dtype and device, with values the next step takes (scores: no NaN or +inf;
weights: finite, ≥ 0; head outputs: finite where they were); dense edits (a given or changed P) are
refused under dropout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..bias import Bias, as_bias
from ..errors import ShapeError
from ..masks import Mask, as_mask


@dataclass(frozen=True)
class Point:
    """A named point of an attention call: the axes of its tensor (H: the edited heads) and what is there."""

    axes: tuple[str, ...]
    what: str
    functions: bool  # edits.at(point, fn) may act here


# The points an attention call passes, in order.
POINTS: dict[str, Point] = {
    "mask": Point(("B", "H", "Q", "K"), "the call's mask (True = may attend): masks given here are ANDed in", False),
    "scores": Point(("B", "H", "Q", "K"), "S = q·kᵀ·scale (soft-capped) plus the call's bias, -inf where masked: "
                    "biases given here add; functions S -> S' follow", True),
    "weights": Point(("B", "H", "Q", "K"), "P = softmax(S): a given P replaces it; functions P -> P' follow", True),
    "head_outputs": Point(("B", "H", "Q", "dv"), "O_h = P·V before the heads merge: a given O replaces it; "
                          "functions O -> O' follow", True),
}

Fn = Callable[[torch.Tensor], torch.Tensor]

# What the engine (``inspect/edit.py``) does at each point: (point, how) of every Step it carries out.
ACTIONS = frozenset({("mask", "and"), ("scores", "add"), ("scores", "apply"), ("weights", "replace"),
                     ("weights", "apply"), ("head_outputs", "replace"), ("head_outputs", "apply")})


@dataclass(frozen=True, eq=False)
class Step:
    """One thing an edit does at one point: ``kind`` (a name of :data:`EDITS`, or ``"at"``), ``point``
    (of :data:`POINTS`), ``how`` (``"and"`` a mask, ``"add"`` a bias, ``"replace"`` the point's tensor,
    ``"apply"`` ``fn``) and the checked ``value``."""

    kind: str
    point: str
    how: str
    value: Any = None
    fn: Fn | None = None

    def __repr__(self) -> str:
        v = self.value
        if self.kind == "at":
            return f"at({self.point!r}, {getattr(self.fn, '__name__', type(self.fn).__name__)})"
        if self.kind == "zero":
            return "zero"
        if isinstance(v, torch.Tensor):
            return f"{self.kind}={v.item():g}" if v.dim() == 0 else f"{self.kind} {list(v.shape)}"
        if isinstance(v, float):
            return f"{self.kind}={v:g}"
        return f"{self.kind}={v!r}"


@dataclass(frozen=True)
class Kind:
    """A ready-made edit: its point, how it acts there (see :class:`Step`), ``check(value, who)`` (the
    value as used, or a ValueError / ShapeError naming the argument), for ``"apply"`` ``fn(value)`` (the
    function on the point's tensor [B, h, ·, ·]), and for a value with the call's sizes, the last two
    axes it must have (``sizes``; checked at each call)."""

    point: str
    how: str
    check: Callable[[Any, str], Any]
    fn: Callable[[Any], Fn] | None = None
    sizes: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if (self.point, self.how) not in ACTIONS:
            raise ValueError(f"Kind: an edit may {self.how!r} at {self.point!r} only if the engine does it there; "
                             f"it does {sorted(ACTIONS)}.")


def _zero(value, who: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{who}: zero must be True or False, got {value!r}.")
    return value


def _scale(scale, who: str) -> float | torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if not scale.is_floating_point() or scale.dim() > 1:
            raise ShapeError(f"{who}: scale must be a number or a float tensor [] or [h] (one per head), got "
                             f"{scale.dtype} {list(scale.shape)}.")
        if not bool(torch.isfinite(scale.detach()).all()):
            raise ShapeError(f"{who}: scale must be finite, got {scale.detach().tolist()}.")
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{who}: scale must be a number or a float tensor, got {scale!r}.")
    if not math.isfinite(scale):
        raise ShapeError(f"{who}: scale must be finite, got {scale!r}.")
    return float(scale)


def _times(s: float | torch.Tensor) -> Fn:
    """o [B, h, Q, dv] · s, s a number or [] | [h] (one per head of the edit, in its order)."""
    if not isinstance(s, torch.Tensor):
        return lambda o: o * s
    return lambda o: o * s.reshape(-1).to(device=o.device)[None, :, None, None]  # [] | [h] -> [1, h|1, 1, 1]


def _structured(arg: str, kind: type, convert: Callable[[Any], Any], what: str) -> Callable[[Any, str], Any]:
    """The check of a mask or bias value: a bhqk ``kind`` or a tensor, made one by ``convert``."""
    def check(x, who: str):
        if not isinstance(x, (kind, torch.Tensor)):
            raise ValueError(f"{who}: {arg} must be {what}, got {type(x).__name__}.")
        out = convert(x)
        assert out is not None
        return out
    return check


_mask = _structured("mask", Mask, as_mask, "a bhqk mask or a bool tensor broadcastable to [B, h, Q, K]")
_bias = _structured("bias", Bias, as_bias, "a bhqk bias or a float tensor broadcastable to [B, h, Q, K]")


def _tensor(arg: str, shape: str) -> Callable[[Any, str], torch.Tensor]:
    def check(t, who: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not 1 <= t.dim() <= 4:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"{who}: {arg} must be a float tensor {shape}, got {got}.")
        return t
    return check


def _weights(P, who: str) -> torch.Tensor:
    P = _tensor("weights", "[Q, K], broadcastable to [B, h, Q, K]")(P, who)
    w = P.detach()
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ShapeError(f"{who}: weights must be finite and >= 0 (attention weights P, used as given).")
    return P


# The ready-made edits. A new kind of edit is one entry here (and its test).
EDITS: dict[str, Kind] = {
    "zero": Kind("head_outputs", "apply", _zero, lambda _: torch.zeros_like),  # O_h = 0
    "scale": Kind("head_outputs", "apply", _scale, _times),  # O_h · s
    "mask": Kind("mask", "and", _mask),  # mask & M: knock out, the softmax renormalizes
    "bias": Kind("scores", "add", _bias),  # S + T
    "weights": Kind("weights", "replace", _weights, sizes=("Q", "K")),  # P as given
    "output": Kind("head_outputs", "replace", _tensor("output", "[Q, dv], broadcastable to [B, h, Q, dv]"),
                   sizes=("Q", "dv")),  # O_h as given
}


def make(kind: str, value: Any = True, who: str = "edits") -> Step:
    """The ready-made edit ``kind`` (of :data:`EDITS`) with ``value`` checked."""
    k = EDITS[kind]
    v = k.check(value, who)
    return Step(kind, k.point, k.how, v, k.fn(v) if k.fn is not None else None)


def zero() -> Step:
    """O_h = 0: the heads' outputs are removed (ablation)."""
    return make("zero", True, "edits.zero")


def scale(s: float | torch.Tensor) -> Step:
    """O_h · s; ``s`` a number or a float tensor [] or [h] (one per edited head), which may require gradients."""
    return make("scale", s, "edits.scale")


def mask(m: Mask | torch.Tensor) -> Step:
    """The heads' mask becomes ``mask & m`` and the softmax renormalizes over what is left (knock out)."""
    return make("mask", m, "edits.mask")


def bias(t: Bias | torch.Tensor) -> Step:
    """``t`` (float, broadcastable to [B, h, Q, K]) is added to the heads' scores."""
    return make("bias", t, "edits.bias")


def weights(P: torch.Tensor) -> Step:
    """P ([Q, K], broadcastable to [B, h, Q, K], finite, ≥ 0) is used as given instead of softmax(S)."""
    return make("weights", P, "edits.weights")


def output(O: torch.Tensor) -> Step:
    """O ([Q, dv], broadcastable to [B, h, Q, dv]) replaces the heads' outputs (activation patching)."""
    return make("output", O, "edits.output")


def at(point: str, fn: Fn) -> Step:
    """``fn(t) -> t'`` at ``point`` ("scores": S and "weights": P [B, h, Q, K]; "head_outputs": o
    [B, h, Q, dv]), h the edit's heads in this call, in its order; ``t'`` must have t's shape.
    What runs where and its cost: the module doc."""
    if point not in POINTS:
        raise ValueError(f"edits.at: point must be one of {list(POINTS)}, got {point!r}.")
    if not POINTS[point].functions:
        takes = [p for p, pt in POINTS.items() if pt.functions]
        raise ValueError(f"edits.at: point {point!r} takes values only (edits.{point}(...)); a function may act "
                         f"at {takes}.")
    if not callable(fn):
        raise ValueError(f"edits.at: fn must be a function of the tensor at {point!r}, got {type(fn).__name__}.")
    return Step("at", point, "apply", None, fn)


def as_steps(do: Step | Iterable[Step] | None, who: str = "edit") -> list[Step]:
    """``do=`` as a list of steps (one step or an iterable of them); else a ValueError naming ``do``."""
    if do is None:
        return []
    out = [do] if isinstance(do, Step) else list(do) if isinstance(do, Iterable) else [do]
    for s in out:
        if not isinstance(s, Step):
            raise ValueError(f"{who}: do takes edits (bhqk.edits.zero(), .scale(s), .mask(M), .bias(T), .weights(P), "
                             f".output(O), .at(point, fn)) or a list of them, got {type(s).__name__}.")
    return out


def keyword_steps(who: str = "edit", **given: Any) -> list[Step]:
    """The steps of ``bhqk.edit``'s keyword form (``zero=True``, ``scale=``, ...; None and ``zero=False``
    give none), in :data:`EDITS` order."""
    if "zero" in given:
        _zero(given["zero"], who)
    return [make(k, given[k], who) for k in EDITS if given.get(k) is not None and given.get(k) is not False]


def check_steps(steps: list[Step], who: str = "edit") -> None:
    """One edit's steps fit together: a value that replaces a point's tensor makes the steps at the points
    before it moot (a ValueError names them), and one point takes one such value."""
    order = list(POINTS)
    for i, s in enumerate(steps):
        if s.how != "replace":
            continue
        moot = [t.kind for j, t in enumerate(steps) if order.index(t.point) < order.index(s.point)
                or (j != i and t.how == "replace" and t.point == s.point)]
        if moot:
            raise ValueError(f"{who}: {s.kind}= replaces the heads' {s.point}, so {moot} cannot apply with it.")


__all__ = ["POINTS", "EDITS", "ACTIONS", "Point", "Kind", "Step", "zero", "scale", "mask", "bias", "weights", "output", "at"]
