"""``with bhqk.edit(model=m, layers=[...], heads=[...], <what>): m(x)`` changes what the named heads
of the selected attention calls do, and nothing else. Nothing is stored on modules: after the block
the model is what it was.

An edit is a list of steps, each a value or a function at a named point of the call (:mod:`bhqk.edits`
lists the points, the kinds, what each costs and how steps combine), given as ``do=edits.zero()`` (one
step or a list) or as the keyword form, which is the same steps: ``zero=True`` (O_h = 0), ``scale=s``
(O_h · s; a number or a tensor [] | [h] that may require gradients), ``mask=M`` (the heads' mask
becomes ``mask & M``, the softmax renormalizes: knock out), ``bias=T`` (added to the heads' scores),
``weights=P`` (P used as given instead of softmax(S), no renormalization) and ``output=O`` (O_h
replaced, e.g. by a head output captured in another run: activation patching). One ``edit`` may
combine steps as long as no value replaces a point after another step of the same edit (``weights=``
with ``mask=``, ``output=`` with ``bias=``: a ValueError).

How it runs: every call runs as usual, all heads on its fast path; for a selected call the named
heads alone are recomputed and stitched into the output out-of-place, so gradients flow to inputs,
parameters, ``scale``, ``bias``, ``weights``, ``output`` and through user functions. GQA: an edited
query head reads its own K/V head. Edits nest and compose: masks AND, biases add; a given P or O (the
innermost one) replaces its point and makes the points before it moot; then the functions at each
point run, the outer edit's first, each edit's in its order (scales multiply).

Selection: ``layers`` takes call indices and module paths (globs; ``model=``); a call is named by its
module's path, so ``layers="model.layers.1.self_attn"`` selects that layer's prefill and every
decode step of ``generate()`` (each step is one call; ``capture`` records carry the same name).

``capture`` inside an ``edit`` sees the edited call: head outputs as edited; scores, weights and
statistics of mask/bias edits as recomputed with the edited mask and bias; a function's scores
as edited (with their lse); a given or function-edited pattern as given (its scores read log P and
its lse 0, so exp(S − lse) = P).
Outside the block nothing is paid: one integer test per call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterable, Iterator
from functools import reduce

import torch
from torch import nn

from .. import masks, observe
from ..bias import Bias
from ..bias import Dense as DenseBias
from ..errors import BackendError, MaskError, ShapeError
from ..functional import reference
from ..functional.problem import Problem
from ..functional.registry import resolve
from ..masks import Mask, Tile
from ..shapes import all_finite, as_4d, compute_dtype, per_query_head
from .edits import EDITS, Step, as_steps, check_steps, keyword_steps
from .layers import Selection, bias_heads, heads_extent, heads_rows, mask_heads, sub_call, value_heads

Part = tuple[list[int], object, bool]  # (heads, value of an h-head call, replace: True = instead of the base)


class Edit:
    """One ``bhqk.edit`` block: which calls and heads, and the steps to apply to them (see the module
    doc). ``steps`` lists them; ``hits`` the (call index, name) of every call it edited."""

    def __init__(self, layers: int | str | Iterable[int | str] | None = None,
                 heads: int | Iterable[int] | None = None, *, model: nn.Module | None = None, zero: bool = False,
                 scale: float | torch.Tensor | None = None, mask: Mask | torch.Tensor | None = None,
                 bias: Bias | torch.Tensor | None = None, weights: torch.Tensor | None = None,
                 output: torch.Tensor | None = None, do: Step | Iterable[Step] | None = None) -> None:
        self.selection = Selection("edit", layers, heads, model)  # the same selection and errors as capture
        self.layers, self.heads = self.selection.layers, self.selection.heads
        steps = keyword_steps("edit", zero=zero, scale=scale, mask=mask, bias=bias, weights=weights, output=output)
        steps += as_steps(do, "edit")
        if not steps:
            raise ValueError("edit: say what to do: zero=True, scale=, mask=, bias=, weights=, output= or "
                             "do=bhqk.edits.<kind>(...) (a step or a list of them).")
        check_steps(steps, "edit")
        self.steps: list[Step] = steps
        ands = [s.value for s in steps if s.how == "and"]
        self.mask: Mask | None = reduce(operator.and_, ands) if ands else None  # the masks ANDed
        self.dense = any(s.point == "weights" or (s.point == "scores" and s.how == "apply") for s in steps)  # builds P
        self.hits: list[tuple[int, str]] = []  # (call index, name) of the calls edited
        self._inert_calls: list[str] = []  # selected calls the mask's spans change nothing in

    @property
    def calls(self) -> int:
        """Attention calls seen inside the block, edited or not."""
        return self.selection.calls

    # ---- per call -------------------------------------------------------------------------------
    def _inert(self, p: Problem) -> bool:
        """The edit is knock-out spans only (``masks.key_span``/``block_span``) and none of them forbids
        anything in this call (keys beyond K, query positions outside the call): it changes nothing here."""
        if any(s.how != "and" for s in self.steps):
            return False
        spans = _spans(self.mask)
        if not spans:
            return False
        ext = p.ext
        return all(sp.k0 >= ext.K or sp._q(ext)[0] >= sp._q(ext)[1] for sp in spans)

    def _check(self, p: Problem, name: str, n: int) -> None:
        """The edit's values against the call's sizes (n = the heads it names)."""
        if self.dense and p.dropout_p > 0:
            raise ValueError(f"edit: {name!r} runs with dropout (dropout_p={p.dropout_p}), but a given or changed P "
                             f"(weights=, edits.at('scores' | 'weights', fn)) is used as it is, without dropout; "
                             f"edit in eval mode (model.eval()) or without dropout.")
        s = p.sizes
        sub = masks.Extent(s["B"], n, s["Q"], s["K"])
        for st in self.steps:
            kind = EDITS.get(st.kind) if st.kind != "at" else None
            if kind is not None and kind.sizes is not None:
                _fits(st.kind, st.value, kind.sizes, s, n, name)
            if st.kind == "scale" and isinstance(st.value, torch.Tensor) and st.value.dim() == 1 \
                    and st.value.shape[0] not in (1, n):
                raise ShapeError(f"edit: scale has {st.value.shape[0]} entries but {n} heads are edited in {name!r}.")
            if st.how in ("and", "add"):
                try:
                    st.value.check(sub)
                except MaskError as e:
                    raise MaskError(f"edit: {st.kind} for {name!r} (B={s['B']}, h={n}, Q={s['Q']}, K={s['K']}): {e}") \
                        from None

    @staticmethod
    def apply(eds: tuple[Edit, ...], p: Problem, out: torch.Tensor, lse: torch.Tensor | None, backend: str,
              module: object) -> tuple[Problem, torch.Tensor, torch.Tensor | None]:
        """Every active edit on one attention call (the hook ``observe.edit`` calls): out [B, H, Q, dv]
        and lse [B, H, Q] | None with the named heads recomputed; the problem as observers see it."""
        H = p.ext.H
        touch: dict[int, list[tuple[Edit, int]]] = {}  # head -> (edit, position among its heads)
        named: list[tuple[Edit, list[int], str]] = []  # the edits that edit this call, outer first: their heads
        for ed in eds:
            index, name, hit = ed.selection.call(module)
            if not hit:
                continue
            heads = ed.selection.heads_of(H, name)
            if ed._inert(p):
                ed._inert_calls.append(f"{name} (Q={p.ext.Q}, K={p.ext.K})")
                continue  # not edited, not listed in hits
            ed._check(p, name, len(heads))
            ed.hits.append((index, name))
            named.append((ed, heads, name))
            for j, h in enumerate(heads):
                touch.setdefault(h, []).append((ed, j))
        if not touch:
            return p, out, lse
        groups: dict[tuple[int, ...], list[int]] = {}  # heads touched by the same edits run together
        for h in sorted(touch):
            groups.setdefault(tuple(id(ed) for ed, _ in touch[h]), []).append(h)
        observed = bool(observe.active())
        full_lse = lse
        if observed and lse is None and any(ed.dense for ed, _, _ in named):
            with torch.no_grad():  # capture reads a built pattern as exp(S − lse): it needs every head's lse
                full_lse = _run(p, backend, True)[1]
        parts = []
        for hs in groups.values():
            edits = touch[hs[0]]
            pos = [[next(j for e, j in touch[h] if e is ed) for h in hs] for ed, _ in edits]  # per edit: hs' positions
            parts.append(_group(p, out, full_lse, hs, [(ed, ps) for (ed, _), ps in zip(edits, pos)], backend))
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor | None] = []  # used only when the call has an lse (full_lse)
        all_heads: list[int] = []
        mask_parts: list[Part] = [mp for g in parts for mp in g.mask_parts]
        bias_parts: list[Part] = [bp for g in parts for bp in g.bias_parts]
        zero_q: list[int] = []  # heads whose observed scores are S' or log P (q read as 0)
        _at_scores([g for g in parts if g.S is not None], named)
        dense = [g for g in parts if g.P is not None]
        if dense:
            o, dense_lses, zero_q = _at_weights(p, dense, named, mask_parts, bias_parts)
            outs.append(o)
            lses += dense_lses
            all_heads += zero_q
        for g in parts:
            if g.P is None:
                assert g.o is not None
                outs.append(g.o)
                lses.append(g.lse)
                all_heads += g.hs
        o_all = torch.cat(outs, dim=1)  # [B, h, Q, dv], heads all_heads
        o_all = _functions(o_all, "head_outputs", named, all_heads)  # zero, scale, functions: the outer edit's first
        hi = torch.tensor(all_heads, device=out.device)
        out = out.index_copy(1, hi, o_all.to(out.dtype))  # [B, H, Q, dv]: heads hi replaced, out-of-place
        if full_lse is not None:
            got = [t for t in lses if t is not None]
            assert len(got) == len(lses)  # every part has one when the call has one
            full_lse = full_lse.index_copy(1, hi, torch.cat(got, dim=1).to(full_lse.dtype))  # [B, H, Q]
        if not observed:
            return p, out, full_lse
        seen = p
        if mask_parts:
            seen = dataclasses.replace(seen, mask=Edited(p.mask, H, mask_parts))
        if bias_parts:
            seen = dataclasses.replace(seen, bias=EditedBias(p.bias, H, bias_parts))
        if zero_q:  # a built pattern: S = 0 + log P
            qi = torch.tensor(zero_q, device=p.q.device)
            zeros = p.q.new_zeros(p.q.shape[0], len(zero_q), *p.q.shape[2:])  # [B, h, Q, d]
            seen = dataclasses.replace(seen, q=p.q.detach().index_copy(1, qi, zeros))
        return seen, out, full_lse  # observers get the lse even where the caller did not ask for it

    # ---- end of the block -----------------------------------------------------------------------
    def _finish(self) -> None:
        """Every selector must have selected a call, and some call must have run on bhqk (an edit that
        edits nothing says so)."""
        self.selection.finish()
        if not self.hits and self._inert_calls:
            raise MaskError(f"edit: mask {self.mask!r} changed nothing in any selected call (nothing was edited): "
                            f"the keys or query positions it names lie beyond {self._inert_calls[:4]}; key positions "
                            f"run 0 … K − 1.")

    def __repr__(self) -> str:
        kinds = ", ".join(repr(s) for s in self.steps)
        return f"Edit(layers={self.layers}, heads={self.heads}, {kinds}; {len(self.hits)} calls edited)"


def _cat(ts: list, dim: int = 1) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)


def _starts(parts: list) -> list[int]:
    """The first head of each part in their concatenation along the heads (``_cat``)."""
    out, a = [], 0
    for g in parts:
        out.append(a)
        a += len(g.hs)
    return out


def _fits(arg: str, t: torch.Tensor, last: tuple[str, str], s, n: int, name: str) -> None:
    """A value with the call's sizes (``weights`` [Q, K], ``output`` [Q, dv]) fits the call (n heads edited)."""
    t4 = as_4d(t)
    want = (s["B"], n, s[last[0]], s[last[1]])
    if t4.shape[0] in (1, want[0]) and t4.shape[1] in (1, n) and tuple(t4.shape[2:]) == want[2:]:
        return
    step = (f" {name!r} is a decode step (Q=1: one new query against K={s['K']} cached keys): a "
            f"[Q, K] {arg} given for the prompt does not fit it; select the prompt's call by index "
            "(layers=[i]) or edit one step at a time.") if s["Q"] == 1 and t4.shape[2] != 1 else ""
    raise ShapeError(f"edit: {arg} has shape {list(t.shape)} but {name!r} needs [{last[0]}={want[2]}, "
                     f"{last[1]}={want[3]}], broadcastable to [B={want[0]}, h={n}, {last[0]}={want[2]}, "
                     f"{last[1]}={want[3]}] (h = the {n} heads edited).{step}")


def _functions(t: torch.Tensor, point: str, named: list[tuple[Edit, list[int], str]], t_heads: list[int]) -> torch.Tensor:
    """The functions at ``point`` (zero, scale, ``edits.at``) on ``t`` [B, h, Q, ·], which holds the heads
    ``t_heads``: each edit's (outer first, each in its order) on the slice of its own heads, out-of-place."""
    where = {h: i for i, h in enumerate(t_heads)}
    for ed, heads, name in named:
        fns = [s for s in ed.steps if s.point == point and s.how == "apply"]
        if not fns:
            continue
        idx = [where[h] for h in heads]
        whole = idx == list(range(len(t_heads)))
        ix = None if whole else torch.tensor(idx, device=t.device)
        sel = t if ix is None else t.index_select(1, ix)  # [B, h, Q, ·] -> the edit's heads
        for s in fns:
            user = s.kind == "at"  # a user's function: given a copy (it may write in place) and its result checked
            new = s.fn(sel.clone() if user else sel)  # type: ignore[misc]
            if not isinstance(new, torch.Tensor) or new.shape != sel.shape:
                got = list(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                raise ShapeError(f"edit: {s!r} returned {got} for {name!r}'s {point} {list(sel.shape)} (B, "
                                 f"h={len(heads)} heads edited, Q, ·); it must keep the shape.")
            if user:
                _check_result(new, sel, point, f"edit: {s!r} in {name!r}")
            sel = new
        t = sel if ix is None else t.index_copy(1, ix, sel.to(t.dtype))  # [B, h_t, Q, ·]: the edit's heads put back
    return t


def _check_result(new: torch.Tensor, old: torch.Tensor, point: str, who: str) -> None:
    """A user function's result at ``point``: same dtype and device as its input, and values the next
    step can take (scores: no NaN or +inf, -inf = may not attend; weights: finite and >= 0; head
    outputs: finite where the input was)."""
    if new.dtype != old.dtype or new.device != old.device:
        raise ShapeError(f"{who} returned {new.dtype} on {new.device} for {old.dtype} on {old.device}; it must keep "
                         f"the dtype and the device.")
    t = new.detach()
    if point == "scores" and bool((torch.isnan(t) | (t == float("inf"))).any()):
        raise ShapeError(f"{who} returned NaN or +inf scores; a score is finite, or -inf where a key may not be attended.")
    if point == "weights" and (not all_finite(t) or bool((t < 0).any())):
        raise ShapeError(f"{who} returned weights that are not finite and >= 0 (attention weights P, used as given).")
    if point == "head_outputs" and not all_finite(t) and all_finite(old):
        raise ShapeError(f"{who} returned NaN/inf head outputs from finite ones.")


def _spans(m: Mask | None) -> list[masks.Span]:
    """The knock-out spans an edit's mask is made of (ANDed), or [] when it holds anything else."""
    if isinstance(m, masks.Span):
        return [m]
    if isinstance(m, masks.And):
        a, b = _spans(m.a), _spans(m.b)
        return a + b if a and b else []
    return []


def _run(p: Problem, backend: str, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A problem on the registry's backend (not through ``attention``: edits do not see it)."""
    choice = resolve(backend, p, need_lse)
    try:
        return choice.run(p, need_lse)
    except BackendError:
        if backend != "auto":
            raise
        return resolve(backend, p, need_lse).run(p, need_lse)


@dataclasses.dataclass
class _Part:
    """Heads ``hs`` touched by the same edits, up to their head outputs' functions: O [B, h, Q, dv] and
    lse [B, h, Q] | None, or (a dense part) P [B, h, Q, K] and a given O to put in after P·V."""

    hs: list[int]
    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    P: torch.Tensor | None = None
    S: torch.Tensor | None = None  # [B, h, Q, K] when built: a function at scores reads it, P = softmax(S)
    sinks: torch.Tensor | None = None  # [h] with S
    pattern: bool = False  # P given or edited by a function at weights (observers read log P)
    output: torch.Tensor | None = None
    mask_parts: list[Part] = dataclasses.field(default_factory=list)
    bias_parts: list[Part] = dataclasses.field(default_factory=list)


def _group(p: Problem, out: torch.Tensor, lse_in: torch.Tensor | None, hs: list[int],
           edits: list[tuple[Edit, list[int]]], backend: str) -> _Part:
    """Heads ``hs`` touched by the same edits (each with the positions of ``hs`` among its heads) through
    the points mask, scores and (given P) weights; ``lse_in``: the call's [B, H, Q] or None."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    h, dv = len(hs), p.sizes["dv"]
    mask: Mask | None = None
    bias: Bias | None = None
    given: dict[str, torch.Tensor] = {}  # point -> the innermost value given there, on heads hs
    for ed, ps in edits:
        n = len(ed.heads) if ed.heads is not None else H
        for st in ed.steps:
            if st.how == "and":
                m = mask_heads(st.value, ps, n)
                assert m is not None
                mask = m if mask is None else mask & m
            elif st.how == "add":
                b = bias_heads(st.value, ps, n)
                assert b is not None
                bias = b if bias is None else bias + b
            elif st.how == "replace":
                given[st.point] = value_heads(st.value, ps, n)  # [#B, h|1, ·, ·]
    g = _Part(hs)
    if "head_outputs" in given:
        g.output = given["head_outputs"].expand(B, h, Q, dv)  # [B, h, Q, dv]
    if any(ed.dense for ed, _ in edits):  # P for these heads: given, or the softmax of S with the edits' masks and biases
        steps = [st for ed, _ in edits for st in ed.steps]
        g.pattern = any(st.point == "weights" for st in steps)
        if "weights" in given:
            g.P = given["weights"].to(compute_dtype(p.q)).expand(B, h, Q, K)  # [B, h, Q, K]
        if g.P is None or any(st.point == "scores" and st.how == "apply" for st in steps):
            sub = _narrow(p, hs, mask, bias)
            g.S, _ = reference.scores(sub)  # [B, h, Q, K]; P = softmax(S) after the functions at scores
            g.sinks = sub.sinks
    elif g.output is not None:  # O_h given: the pattern is unchanged
        g.o, g.lse = g.output, None if lse_in is None else heads_rows(lse_in, hs)  # [B, H, Q] -> [B, h, Q]
    elif mask is not None or bias is not None:  # the heads again, with the combined mask and bias
        g.o, g.lse = _run(_narrow(p, hs, mask, bias), backend, lse_in is not None)  # [B, h, Q, dv], [B, h, Q] | None
        if mask is not None:
            g.mask_parts.append((hs, mask, False))
        if bias is not None:
            g.bias_parts.append((hs, bias, False))
    else:  # the head outputs' functions only: the fast path's own heads
        g.o = heads_rows(out, hs)  # [B, H, Q, dv] -> [B, h, Q, dv]
        g.lse = None if lse_in is None else heads_rows(lse_in, hs)  # [B, H, Q] -> [B, h, Q]
    return g


def _at_scores(parts: list[_Part], named: list[tuple[Edit, list[int], str]]) -> None:
    """The scores point of the parts whose S was built: the functions there (on S of all those heads),
    then P = softmax(S) and its lse for each part whose P is not given."""
    if not parts:
        return
    S = _functions(_cat([g.S for g in parts]), "scores", named, [h for g in parts for h in g.hs])  # [B, hs, Q, K]
    sinks = [g.sinks for g in parts if g.sinks is not None]
    P, lse = reference.softmax_rows(S, _cat(sinks, 0) if sinks else None)  # sinks [h] per part -> [hs]; [B, hs, Q, K], [B, hs, Q]
    at = 0
    for g in parts:
        a, at = at, at + len(g.hs)
        g.S = S[:, a:at]  # [B, h, Q, K]
        if g.P is None:  # not given: softmax(S)
            g.P, g.lse = P[:, a:at], lse[:, a:at]  # [B, h, Q, K], [B, h, Q]


def _at_weights(p: Problem, parts: list[_Part], named: list[tuple[Edit, list[int], str]], mask_parts: list[Part],
                bias_parts: list[Part]) -> tuple[torch.Tensor, list[torch.Tensor | None], list[int]]:
    """The weights point of the parts with a P: the functions there (on P of all those heads), O = P·V
    (a given O put in after it), and what observers see (appended to ``mask_parts``/``bias_parts``):
    (O [B, hp, Q, dv], each part's lse, the heads hp)."""
    ph = [h for g in parts for h in g.hs]
    P = _cat([g.P for g in parts if g.P is not None])  # [B, hp, Q, K]
    P = _functions(P, "weights", named, ph).to(compute_dtype(p.q))
    v = per_query_head(p.v, p.ext.H, ph).to(P.dtype)  # [B, Hkv, K, dv] -> [B, hp, K, dv]: head h reads K/V head h // G

    def reach() -> torch.Tensor:  # [B, hp, Q, K]: the keys each row may attend (S > -inf where S was built, else P > 0)
        return _cat([g.S > float("-inf") if g.S is not None and not g.pattern else P[:, a:a + len(g.hs)] > 0
                     for g, a in zip(parts, _starts(parts))])

    o = reference.weighted_values(P, v, reach)  # [B, hp, Q, dv]
    lses: list[torch.Tensor | None] = []
    ones = masks.dense(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=P.device))
    at = 0
    for g in parts:
        a, at = at, at + len(g.hs)
        Pg = P[:, a:at]  # [B, h, Q, K]
        if g.output is not None:  # a given O after the pattern
            o = o.index_copy(1, torch.arange(a, at, device=o.device), g.output.to(o.dtype))  # [B, hp, Q, dv]: heads a:at given
        if g.pattern or g.S is None:  # a given or edited P: observers read S = log P, lse 0
            lses.append(torch.where((Pg.detach() > 0).any(dim=-1), 0.0, float("-inf")))  # [B, h, Q]
            bias_parts.append((g.hs, DenseBias(torch.log(Pg.detach())), True))  # [B, h, Q, K]; -inf where P = 0
        else:  # P = softmax(S) of an edited S: observers read S and its lse
            lses.append(g.lse)
            bias_parts.append((g.hs, DenseBias(g.S.detach()), True))  # [B, h, Q, K]; -inf where masked
        mask_parts.append((g.hs, ones, True))
    return o, lses, ph


def _narrow(p: Problem, hs: list[int], extra_mask: Mask | None = None, extra_bias: Bias | None = None) -> Problem:
    """The call on the query heads ``hs`` only (each with its K/V head), the extra mask ANDed and the
    extra bias added: a problem of h heads on the fast path."""
    H = p.ext.H
    mask = mask_heads(p.mask, hs, H)
    if extra_mask is not None:
        mask = extra_mask if mask is None else mask & extra_mask
    bias = bias_heads(p.bias, hs, H)
    if extra_bias is not None:
        bias = extra_bias if bias is None else bias + extra_bias
    return sub_call(p, hs, mask, bias)


# ---- the edited call as observers see it ---------------------------------------------------------------

def _stitch(base: torch.Tensor, tiles: list[torch.Tensor], parts: list[Part], H: int, q: int, k: int,
            combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The call's tile ``base`` [#B, #H, #q, #k] with each part's heads combined (``combine``) with, or
    replaced by, the part's tile [#B, #h, #q, #k]: [B?, H, q, k]."""
    B = max([base.shape[0]] + [t.shape[0] for t in tiles])
    out = base.expand(B, H, q, k).clone()  # [B?, H, q, k]
    for (heads, _, replace), t in zip(parts, tiles):
        idx = torch.tensor(heads, device=out.device)
        new = t.expand(B, len(heads), q, k)  # [B?, h, q, k]
        out[:, idx] = new if replace else combine(out[:, idx], new)
    return out


class _Edited:
    """The call's mask or bias ``base`` (None: none) with each part's heads combined with (``combine``; or,
    ``replace``, replaced by) the part's value, read per tile."""

    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sign = ""

    def __init__(self, base, H: int, parts: list[Part]) -> None:
        self.base, self.H, self.parts = base, H, parts

    def check(self, ext):
        if self.base is not None:
            self.base.check(ext)
        for heads, v, _ in self.parts:
            v.check(heads_extent(ext, len(heads)))  # type: ignore[attr-defined]

    def _block(self, none: torch.Tensor, ext, q0, q1, k0, k1, *args) -> torch.Tensor:
        """The tile [B?, H, q, k]; ``none``: the base's tile when there is no base; ``args``: device (and dtype)."""
        base = none if self.base is None else as_4d(self.base.block(ext, q0, q1, k0, k1, *args))  # [#B, #H, #q, #k]
        tiles = [as_4d(v.block(heads_extent(ext, len(h)), q0, q1, k0, k1, *args)) for h, v, _ in self.parts]  # type: ignore[attr-defined]
        return _stitch(base, tiles, self.parts, self.H, q1 - q0, k1 - k0, self.combine)

    def __repr__(self) -> str:
        parts = ", ".join(f"heads {h}: {'=' if r else self.sign} {v!r}" for h, v, r in self.parts)
        return f"edited({self.base!r}, {parts})"


class Edited(_Edited, Mask):
    """The call's mask with each part's heads ANDed with (or, ``replace``, replaced by) its mask."""

    combine, sign = staticmethod(operator.and_), "&"

    def block(self, ext, q0, q1, k0, k1, device=None):
        return self._block(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device), ext, q0, q1, k0, k1, device)

    def classify(self, ext, q0, q1, k0, k1):
        if self.base is not None and not any(r for _, _, r in self.parts) and \
                self.base.classify(ext, q0, q1, k0, k1) is Tile.EMPTY:
            return Tile.EMPTY
        return Tile.PARTIAL

    def classify_grid(self, ext, block_q, block_k):
        nq, nk = -(-ext.Q // block_q), -(-ext.K // block_k)
        none = torch.zeros(nq, nk, dtype=torch.bool)
        if self.base is None or any(r for _, _, r in self.parts):
            return none, none
        return self.base.classify_grid(ext, block_q, block_k)[0], none


class EditedBias(_Edited, Bias):
    """The call's bias with each part's heads plus (or, ``replace``, replaced by) its bias."""

    combine, sign = staticmethod(operator.add), "+"

    def __init__(self, base: Bias | None, H: int, parts: list[Part]) -> None:
        super().__init__(base, H, parts)
        self.floor = min([0.0 if base is None else base.floor] + [b.floor for _, b, _ in parts])  # type: ignore[attr-defined]

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        return self._block(torch.zeros(1, 1, 1, 1, dtype=dtype, device=device), ext, q0, q1, k0, k1, device, dtype)


@contextlib.contextmanager
def edit(layers: int | str | Iterable[int | str] | None = None, heads: int | Iterable[int] | None = None, *,
         model: nn.Module | None = None, zero: bool = False, scale: float | torch.Tensor | None = None,
         mask: Mask | torch.Tensor | None = None, bias: Bias | torch.Tensor | None = None,
         weights: torch.Tensor | None = None, output: torch.Tensor | None = None,
         do: Step | Iterable[Step] | None = None) -> Iterator[Edit]:
    """Edit the named heads of the selected attention calls inside the block (module doc: kinds,
    cost, composition). ``layers``: call indices and/or module-path globs (names need ``model=``),
    as in ``capture``; ``heads``: query-head indices (None: all). What to do: the keywords, and/or
    ``do=`` one step of :mod:`bhqk.edits` or a list (``edits.zero()``, ``edits.at("head_outputs", fn)``,
    ...; the keywords come first, then ``do``'s steps in order). Yields the :class:`Edit`
    (``.hits``: the calls edited). A selector that selects no call raises ValueError at the end of
    the block (nothing was edited)."""
    ed = Edit(layers, heads, model=model, zero=zero, scale=scale, mask=mask, bias=bias, weights=weights, output=output,
              do=do)
    with observe.editing(ed):
        yield ed
    ed._finish()


def zero_heads(model, heads: Iterable[tuple[int, int]]) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of one context manager that zeroes the outputs of the (layer, query head) pairs
    ``heads`` (``edit("layers.{layer}.attn", zero=True)`` per layer, by canonical address): the needle
    grid's ``edit=``, ``bhqk needle --edit zero:L.H,...``."""
    from ..integrations.model_map import address

    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(int(layer), []).append(int(head))

    @contextlib.contextmanager
    def run() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for layer, hs in sorted(by_layer.items()):
                stack.enter_context(edit(address(layer), heads=sorted(set(hs)), model=model, zero=True))
            yield

    return run


def parse_edit(spec: str) -> list[tuple[int, int]]:
    """``zero:L.H,L.H,...`` (the ``--edit`` option) as (layer, head) pairs."""
    kind, _, rest = spec.partition(":")
    pairs: list[tuple[int, int]] = []
    for part in rest.replace(" ", ",").split(","):
        if not part:
            continue
        layer, dot, head = part.partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            pairs = []
            break
        pairs.append((int(layer), int(head)))
    if kind != "zero" or not pairs:
        raise ValueError(f"edit={spec!r}: expected zero:LAYER.HEAD[,LAYER.HEAD...] such as zero:5.0,12.3 "
                         "(zero the outputs of those query heads).")
    return pairs


__all__ = ["edit", "Edit", "zero_heads", "parse_edit"]
