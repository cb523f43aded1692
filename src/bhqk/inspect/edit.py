"""``with bhqk.edit(model=m, layers=[...], heads=[...], <kind>): m(x)`` changes what the named heads
of the selected attention calls do, and nothing else. Nothing is stored on modules: after the block
the model is what it was.

Kinds (one ``edit`` may combine ``zero``/``scale`` with ``mask`` and/or ``bias``, or ``weights``, or ``output``):

- ``zero=True``: the heads' outputs O_h are 0 (ablation).
- ``scale=s``: O_h · s; ``s`` a number or a tensor (0-d, or [h] one per named head) that may require
  gradients (attribution patching: d loss / d s).
- ``mask=M``: the heads' mask becomes ``mask & M`` and the softmax renormalizes over what is left
  ("knock out", e.g. ``masks.key_span(0, 1)``: the weight the sink key had goes to the other keys).
- ``bias=T``: T (float, broadcastable to [B, h, Q, K]) is added to the heads' scores.
- ``weights=P``: the heads use P ([Q, K], broadcastable to [B, h, Q, K], ≥ 0) as given instead of
  softmax(S): O_h = P·V, no renormalization. Zeros in P are not a knock-out: the row then sums
  to less than 1 and nothing is given to the other keys.
- ``output=O``: O_h is replaced by O ([Q, dv], broadcastable to [B, h, Q, dv]), e.g. a head's
  output recorded by ``capture(what="head_outputs")`` in another run (activation patching).

How it runs: every call runs as usual, all heads on its fast path; for a selected call the named
heads alone are recomputed (mask and bias edits: a sub-call of those heads on the registry's
backend, the mask kept structured; ``weights``: one P·V per head) and stitched into the output
out-of-place, so gradients flow to inputs, parameters, ``scale``, ``bias`` and ``weights``. GQA:
an edited query head reads its own K/V head. Edits nest and compose: masks AND, biases add, scales
multiply; a given pattern or output (the innermost one) overrides the masks and biases of others.
``capture`` inside an ``edit`` sees the edited call: head outputs as edited; scores, weights and
statistics of mask/bias edits as recomputed with the edited mask and bias; a replaced pattern as
given (its scores read log P and its lse 0, so exp(S − lse) = P). Outside the block nothing is paid: one integer test per call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .. import masks, observe
from ..bias import Bias, as_bias
from ..bias import Dense as DenseBias
from ..errors import BackendError, MaskError, ShapeError
from ..functional.problem import Problem
from ..functional.registry import resolve
from ..masks import Mask, as_mask
from ..shapes import as_4d, compute_dtype, per_query_head
from .edit_heads import Edited, EditedBias, Part, bias_heads, mask_heads
from .layers import Selection, heads_rows, sub_call, value_heads


class Edit:
    """One ``bhqk.edit`` block: which calls and heads, and what to do to them (see the module doc).
    ``hits`` lists the (call index, name) of every call it edited."""

    def __init__(
        self,
        layers: int | str | Iterable[int | str] | None = None,
        heads: int | Iterable[int] | None = None,
        *,
        model: nn.Module | None = None,
        zero: bool = False,
        scale: float | torch.Tensor | None = None,
        mask: Mask | torch.Tensor | None = None,
        bias: Bias | torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
    ) -> None:
        self.selection = Selection("edit", layers, heads, model)  # the same selection and errors as capture
        self.layers, self.heads = self.selection.layers, self.selection.heads
        if not isinstance(zero, bool):
            raise ValueError(f"edit: zero must be True or False, got {zero!r}.")
        given = [k for k, v in (("mask", mask), ("bias", bias), ("weights", weights), ("output", output)) if v is not None]
        if not given and not zero and scale is None:
            raise ValueError("edit: say what to do: zero=True, scale=, mask=, bias=, weights= or output=.")
        if "weights" in given and ({"mask", "bias"} & set(given)):
            raise ValueError("edit: weights= replaces softmax(S), so mask= and bias= cannot apply with it.")
        if "output" in given and len(given) > 1:
            others = [g for g in given if g != "output"]
            raise ValueError(f"edit: output= replaces the heads' outputs, so {others} cannot apply with it.")
        self.zero = zero
        self.scale = self._scale(scale)
        self.mask = as_mask(mask) if mask is not None else None
        self.bias = as_bias(bias) if bias is not None else None
        self.weights = self._tensor("weights", weights, "[Q, K], broadcastable to [B, h, Q, K]")
        if self.weights is not None:
            w = self.weights.detach()
            if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise ShapeError("edit: weights must be finite and >= 0 (attention weights P, used as given).")
        self.output = self._tensor("output", output, "[Q, dv], broadcastable to [B, h, Q, dv]")
        self.hits: list[tuple[int, str]] = []  # (call index, name) of the calls edited
        self._inert_calls: list[str] = []  # selected calls the mask's spans change nothing in

    @property
    def calls(self) -> int:
        """Attention calls seen inside the block, edited or not."""
        return self.selection.calls

    @staticmethod
    def _scale(scale):
        if scale is None:
            return None
        if isinstance(scale, torch.Tensor):
            if not scale.is_floating_point() or scale.dim() > 1:
                raise ShapeError(f"edit: scale must be a number or a float tensor [] or [h] (one per head), got "
                                 f"{scale.dtype} {list(scale.shape)}.")
            if not bool(torch.isfinite(scale.detach()).all()):
                raise ShapeError(f"edit: scale must be finite, got {scale.detach().tolist()}.")
            return scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"edit: scale must be a number or a float tensor, got {scale!r}.")
        if not math.isfinite(scale):
            raise ShapeError(f"edit: scale must be finite, got {scale!r}.")
        return float(scale)

    @staticmethod
    def _tensor(arg: str, t, shape: str) -> torch.Tensor | None:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not 1 <= t.dim() <= 4:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"edit: {arg} must be a float tensor {shape}, got {got}.")
        return t

    # ---- per call -------------------------------------------------------------------------------
    def _inert(self, p: Problem) -> bool:
        """The edit is knock-out spans only (``masks.key_span``/``block_span``) and none of them forbids
        anything in this call (keys beyond K, query positions outside the call): it changes nothing here."""
        spans = _spans(self.mask)
        if not spans or self.zero or self.scale is not None or self.bias is not None:
            return False
        ext = p.ext
        return all(sp.k0 >= ext.K or sp._q(ext)[0] >= sp._q(ext)[1] for sp in spans)

    def _check(self, p: Problem, name: str, n: int) -> None:
        """The edit's tensors against the call's sizes (n = the heads it names)."""
        s = p.sizes
        for arg, t, last in (("weights", self.weights, ("Q", "K")), ("output", self.output, ("Q", "dv"))):
            if t is None:
                continue
            t4 = as_4d(t)
            want = (s["B"], n, s[last[0]], s[last[1]])
            ok = t4.shape[0] in (1, want[0]) and t4.shape[1] in (1, n) and tuple(t4.shape[2:]) == want[2:]
            if not ok:
                step = (f" {name!r} is a decode step (Q=1: one new query against K={s['K']} cached keys): a "
                        f"[Q, K] {arg} given for the prompt does not fit it; select the prompt's call by index "
                        "(layers=[i]) or edit one step at a time.") if s["Q"] == 1 and t4.shape[2] != 1 else ""
                raise ShapeError(f"edit: {arg} has shape {list(t.shape)} but {name!r} needs [{last[0]}={want[2]}, "
                                 f"{last[1]}={want[3]}], broadcastable to [B={want[0]}, h={n}, {last[0]}={want[2]}, "
                                 f"{last[1]}={want[3]}] (h = the {n} heads edited).{step}")
        if isinstance(self.scale, torch.Tensor) and self.scale.dim() == 1 and self.scale.shape[0] not in (1, n):
            raise ShapeError(f"edit: scale has {self.scale.shape[0]} entries but {n} heads are edited in {name!r}.")
        sub = masks.Extent(s["B"], n, s["Q"], s["K"])
        for arg, v in (("mask", self.mask), ("bias", self.bias)):
            if v is not None:
                try:
                    v.check(sub)
                except MaskError as e:
                    raise MaskError(f"edit: {arg} for {name!r} (B={s['B']}, h={n}, Q={s['Q']}, K={s['K']}): {e}") from None

    @staticmethod
    def apply(eds: tuple[Edit, ...], p: Problem, out: torch.Tensor, lse: torch.Tensor | None, backend: str,
              module: object) -> tuple[Problem, torch.Tensor, torch.Tensor | None]:
        """Every active edit on one attention call (the hook ``observe.edit`` calls): out [B, H, Q, dv]
        and lse [B, H, Q] | None with the named heads recomputed; the problem as observers see it."""
        H = p.ext.H
        touch: dict[int, list[tuple[Edit, int]]] = {}  # head -> (edit, position among its heads)
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
            for j, h in enumerate(heads):
                touch.setdefault(h, []).append((ed, j))
        if not touch:
            return p, out, lse
        groups: dict[tuple[int, ...], list[int]] = {}  # heads touched by the same edits run together
        for h in sorted(touch):
            groups.setdefault(tuple(id(ed) for ed, _ in touch[h]), []).append(h)
        observed = bool(observe.active())
        full_lse = lse
        if observed and lse is None and any(ed.weights is not None for t in touch.values() for ed, _ in t):
            full_lse = _lse(p, backend)  # capture reads a given pattern as exp(S − lse): it needs every head's lse
        outs, lses, all_heads = [], [], []
        mask_parts: list[Part] = []
        bias_parts: list[Part] = []
        zero_q: list[int] = []
        for hs in groups.values():
            edits = touch[hs[0]]
            pos = [[next(j for e, j in touch[h] if e is ed) for h in hs] for ed, _ in edits]  # per edit: hs' positions
            o, l, parts = _group(p, out, full_lse, hs, [(ed, ps) for (ed, _), ps in zip(edits, pos)], backend)
            outs.append(o)
            lses.append(l)
            all_heads += hs
            mp, bp, zq = parts
            mask_parts += mp
            bias_parts += bp
            zero_q += zq
        hi = torch.tensor(all_heads, device=out.device)
        out = out.index_copy(1, hi, torch.cat(outs, dim=1).to(out.dtype))  # [B, H, Q, dv]: heads hi replaced, out-of-place
        if full_lse is not None:
            full_lse = full_lse.index_copy(1, hi, torch.cat(lses, dim=1).to(full_lse.dtype))  # [B, H, Q]
        if not observed:
            return p, out, full_lse
        seen = p
        if mask_parts:
            seen = dataclasses.replace(seen, mask=Edited(p.mask, H, mask_parts))
        if bias_parts:
            seen = dataclasses.replace(seen, bias=EditedBias(p.bias, H, bias_parts))
        if zero_q:  # a given pattern: S = 0 + log P
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
        kinds = []
        for k in ("zero", "scale", "mask", "bias", "weights", "output"):
            v = getattr(self, k)
            if v is None or v is False:
                continue
            if isinstance(v, torch.Tensor):
                kinds.append(f"{k}={v.item():g}" if v.dim() == 0 else f"{k} {list(v.shape)}")
            elif k == "scale":
                kinds.append(f"scale={v:g}")
            elif k in ("mask", "bias"):
                kinds.append(f"{k}={v!r}")
            else:
                kinds.append(k)
        return f"Edit(layers={self.layers}, heads={self.heads}, {', '.join(kinds)}; {len(self.hits)} calls edited)"


def _spans(m: Mask | None) -> list[masks.Span]:
    """The knock-out spans an edit's mask is made of (ANDed), or [] when it holds anything else."""
    if isinstance(m, masks.Span):
        return [m]
    if isinstance(m, masks.And):
        a, b = _spans(m.a), _spans(m.b)
        return a + b if a and b else []
    return []


def _lse(p: Problem, backend: str) -> torch.Tensor:
    with torch.no_grad():
        return _run(p, backend, True)[1]  # type: ignore[return-value]


def _run(p: Problem, backend: str, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A problem on the registry's backend (not through ``attention``: edits do not see it)."""
    choice = resolve(backend, p, need_lse)
    try:
        return choice.run(p, need_lse)
    except BackendError:
        if backend != "auto":
            raise
        return resolve(backend, p, need_lse).run(p, need_lse)


def _group(p: Problem, out: torch.Tensor, lse_in: torch.Tensor | None, hs: list[int],
           edits: list[tuple[Edit, list[int]]], backend: str):
    """Heads ``hs`` touched by the same edits: (O [B, h, Q, dv], lse [B, h, Q] | None (when ``lse_in``,
    the call's [B, H, Q], is given), the parts observers see)."""
    B, H, Q, K = p.ext.B, p.ext.H, p.ext.Q, p.ext.K
    h, dv = len(hs), p.sizes["dv"]
    dt = compute_dtype(p.q)
    weights = next((ed for ed, _ in reversed(edits) if ed.weights is not None or ed.output is not None), None)
    mask: Mask | None = None
    bias: Bias | None = None
    for ed, ps in edits:
        n = len(ed.heads) if ed.heads is not None else H
        if ed.mask is not None:
            m = mask_heads(ed.mask, ps, n)
            assert m is not None
            mask = m if mask is None else mask & m
        if ed.bias is not None:
            b = bias_heads(ed.bias, ps, n)
            assert b is not None
            bias = b if bias is None else bias + b
    mask_parts: list[Part] = []
    bias_parts: list[Part] = []
    zero_q: list[int] = []
    lse = None
    if weights is not None and weights.output is not None:  # O_h given
        n = len(weights.heads) if weights.heads is not None else H
        o = value_heads(weights.output, next(ps for ed, ps in edits if ed is weights), n).expand(B, h, Q, dv)  # [B, h, Q, dv]
        lse = None if lse_in is None else heads_rows(lse_in, hs)  # the pattern is unchanged: [B, H, Q] -> [B, h, Q]
    elif weights is not None:  # P given: O = P·V, no softmax
        n = len(weights.heads) if weights.heads is not None else H
        P = value_heads(weights.weights, next(ps for ed, ps in edits if ed is weights), n).to(dt)  # type: ignore[arg-type]
        P = P.expand(B, h, Q, K)  # [B, h, Q, K]
        v = per_query_head(p.v, H, hs).to(dt)  # [B, Hkv, K, dv] -> [B, h, K, dv]: head h reads K/V head h // G
        o = torch.einsum("bhqk,bhkd->bhqd", P, v)  # [B, h, Q, dv]
        logP = torch.log(P.detach())  # [B, h, Q, K]; -inf where P = 0
        lse = torch.where((P.detach() > 0).any(dim=-1), 0.0, float("-inf"))  # [B, h, Q]: P = exp(S − lse) with S = log P
        mask_parts.append((hs, masks.dense(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=P.device)), True))
        bias_parts.append((hs, DenseBias(logP), True))
        zero_q += hs
    elif mask is not None or bias is not None:  # the heads again, with the combined mask and bias
        sub = _narrow(p, hs, mask, bias)
        o, lse = _run(sub, backend, lse_in is not None)  # [B, h, Q, dv], [B, h, Q] | None
        if mask is not None:
            mask_parts.append((hs, mask, False))
        if bias is not None:
            bias_parts.append((hs, bias, False))
    else:  # zero / scale only: the fast path's own heads
        o = heads_rows(out, hs)  # [B, H, Q, dv] -> [B, h, Q, dv]
        lse = None if lse_in is None else heads_rows(lse_in, hs)  # [B, H, Q] -> [B, h, Q]
    for ed, ps in edits:
        if ed.zero:
            o = torch.zeros_like(o)
        if ed.scale is not None:
            s = ed.scale
            if isinstance(s, torch.Tensor):
                n = len(ed.heads) if ed.heads is not None else H
                s = s.reshape(-1)  # [] | [n] -> [1] | [n]
                s = (s.index_select(0, torch.tensor(ps, device=s.device))  # [n] -> [h]: this call's edited heads
                     if s.numel() == n and n != 1 else s.expand(h))  # [1] -> [h]
                s = s.to(device=o.device)[None, :, None, None]  # [h] -> [1, h, 1, 1]
            o = o * s
    return o, lse, (mask_parts, bias_parts, zero_q)


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


@contextlib.contextmanager
def edit(
    layers: int | str | Iterable[int | str] | None = None,
    heads: int | Iterable[int] | None = None,
    *,
    model: nn.Module | None = None,
    zero: bool = False,
    scale: float | torch.Tensor | None = None,
    mask: Mask | torch.Tensor | None = None,
    bias: Bias | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> Iterator[Edit]:
    """Edit the named heads of the selected attention calls inside the block (module doc: kinds,
    cost, composition). ``layers``: call indices and/or module-path globs (names need ``model=``),
    as in ``capture``; ``heads``: query-head indices (None: all). Yields the :class:`Edit`
    (``.hits``: the calls edited). A selector that selects no call raises ValueError at the end of
    the block (nothing was edited)."""
    ed = Edit(layers, heads, model=model, zero=zero, scale=scale, mask=mask, bias=bias, weights=weights, output=output)
    with observe.editing(ed):
        yield ed
    ed._finish()


__all__ = ["edit", "Edit"]
