"""What a ``capture`` or an ``edit`` block selects: which attention calls (call indices, their order
inside the block, and/or module-path globs matched against ``model.named_modules()``, or canonical
addresses ``"layers.3.attn"`` of the model's map), and the selected query heads and rows of a call's
tensors, of its mask and bias (structured values stay structured where they can: nothing here builds
a [B, H, Q, K] tensor) and of the call itself."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from ..bias import Bias
from ..bias import Dense as DenseBias
from ..bias import Sum as BiasSum
from ..errors import ShapeError
from ..functional.problem import Problem
from ..integrations.model_map import ModelMap, model_map
from ..masks import Extent, Mask
from ..shapes import Sizes, as_4d, per_query_head

REGISTER_HINT = ("the model's attention does not run on bhqk: call bhqk.integrations.transformers.register() and "
                 "set_attn_implementation(\"bhqk\") (or load it with attn_implementation=\"bhqk\")")


def selectors(layers: int | str | Iterable[int | str] | None, who: str) -> list[int | str] | None:
    """``layers`` as a list (None: every call), each a call index ≥ 0 or a module-path glob; else a
    ValueError naming ``who`` ("capture", "edit")."""
    if layers is None:
        return None
    out = [layers] if isinstance(layers, (int, str)) else list(layers)
    for sel in out:
        if isinstance(sel, bool) or not isinstance(sel, (int, str)) or (isinstance(sel, int) and sel < 0):
            raise ValueError(f"{who}: layers takes call indices >= 0 and module-path names, got {sel!r}.")
    return out


def selected(layers: list[int | str] | None, index: int, name: str) -> bool:
    """The call ``index`` of module path ``name`` is one of ``layers`` (None: every call)."""
    if layers is None:
        return True
    return any(sel == index if isinstance(sel, int) else fnmatch.fnmatchcase(name, sel) for sel in layers)


def indices(values: int | Iterable[int] | None, arg: str, who: str) -> list[int] | None:
    """``heads`` or ``rows``: None (all), one index or a non-empty list of indices >= 0, sorted and
    unique; anything else (a negative index, a bool, a string, a float) is a ValueError naming ``arg``."""
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, (int, Iterable)):
        raise ValueError(f"{who}: {arg} takes an index >= 0 or a list of them, got {values!r}.")
    vs = [values] if isinstance(values, int) else list(values)
    if isinstance(values, torch.Tensor):
        vs = values.reshape(-1).tolist()  # any shape -> a flat list of heads
    if not vs or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vs):
        raise ValueError(f"{who}: {arg} takes an index >= 0 or a non-empty list of them, got {values!r}.")
    return sorted(set(vs))


def attention_names(model: nn.Module, limit: int = 6) -> list[str]:
    """Module paths of ``model`` that look like attention modules (for error messages)."""
    return [n for n, m in model.named_modules() if n and ("attention" in type(m).__name__.lower()
                                                          or type(m).__name__.endswith(("Attention", "Attn")))][:limit]


class Selection:
    """What one ``capture`` or ``edit`` block selects (``who`` names it in errors): the calls (``layers``:
    call indices and module-path globs, names matched against ``model.named_modules()``; a canonical
    address or glob of them, ``"layers.3.attn"``, ``"layers.*.attn"``, stands for its module paths),
    the query heads and (capture only) the query rows. One set of checks for both: when built (a name without
    ``model=``, a name that matches no module, a bad index), at each call (a head out of range) and at
    the end of the block (:meth:`finish`: a selector that selected no call, or no call on bhqk at all)."""

    def __init__(self, who: str, layers, heads, model: nn.Module | None, rows=None) -> None:
        self.who = who
        self.layers = selectors(layers, who)
        self.heads = indices(heads, "heads", who)
        self.rows = indices(rows, "rows", who)
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self.map = _map_of(model)
        self.addresses = {} if self.map is None else {p: self.map.address_of(p) for p in self.map.paths}
        if self.layers is not None and self.map is not None:  # canonical addresses -> the model's module paths
            self.layers = [p for sel in self.layers for p in (
                self.map.paths_matching(sel) or [sel] if isinstance(sel, str) and not self._names(sel) else [sel])]
        for sel in self.layers or []:
            if not isinstance(sel, str):
                continue
            if model is None:
                raise ValueError(f"{who}: layer {sel!r} is a module path; pass model= so names can be matched.")
            if not self._names(sel):
                by = "" if self.map is None else f" or by address layers.0.attn … layers.{len(self.map.paths) - 1}.attn"
                raise ValueError(f"{who}: layer {sel!r} matches no module of the model; attention modules are named "
                                 f"like {attention_names(model)}{by}.")
        self.calls = 0  # attention calls seen inside the block, selected or not
        self.seen: dict[str, None] = {}  # the names of the calls seen, in order
        self.hits = 0  # calls selected

    def _names(self, glob: str) -> bool:
        """Some module of the model is named by ``glob``."""
        return any(fnmatch.fnmatchcase(n, glob) for n in self.names.values())

    def call(self, module: object) -> tuple[int, str, bool]:
        """Count one attention call: (its index in the block, its name, whether it is selected)."""
        index = self.calls
        self.calls += 1
        name = self.names.get(id(module), f"attention.{index}")
        self.seen[name] = None
        hit = selected(self.layers, index, name)
        self.hits += hit
        return index, name, hit

    def heads_of(self, H: int, name: str) -> list[int]:
        """The selected query heads of a call with H heads (a ShapeError when one is out of range)."""
        if self.heads is None:
            return list(range(H))
        if self.heads[-1] >= H:
            raise ShapeError(f"{self.who}: heads {self.heads} out of range for {name!r}, which has H={H} query heads "
                             f"(indices 0 … {H - 1}).")
        return self.heads

    def rows_of(self, Q: int, name: str) -> list[int] | None:
        """The selected query rows of a call with Q rows (None: all)."""
        if self.rows is None:
            return None
        if self.rows[-1] >= Q:
            step = " (a decode step: one query row)" if Q == 1 else ""
            raise ShapeError(f"{self.who}: rows {self.rows} out of range for {name!r}, which has Q={Q} query rows"
                             f"{step}.")
        return None if len(self.rows) == Q else self.rows

    def finish(self) -> None:
        """At the end of the block: every selector selected a call, and some attention call ran on bhqk."""
        seen = list(self.seen)[:8]
        done = "edited" if self.who == "edit" else "recorded"
        if self.calls == 0:
            model = f" ({type(self.model).__name__})" if self.model is not None else ""
            given = f" (given layers={self.layers})" if self.layers is not None else ""
            raise ValueError(f"{self.who}: no attention call ran on bhqk inside the block{given}, so nothing was {done}; "
                             f"if the block ran a model{model}, {REGISTER_HINT}.")
        for sel in self.layers or []:
            if isinstance(sel, int) and sel >= self.calls:
                raise ValueError(f"{self.who}: layer index {sel} but only {self.calls} attention calls ran in the block.")
            if isinstance(sel, str) and not any(fnmatch.fnmatchcase(n, sel) for n in self.seen):
                near = [n for n in self.seen if fnmatch.fnmatchcase(n, sel + ".*")][:2]
                hint = f"; {sel!r} holds the attention module {near[0]!r}: select that" if near else ""
                if self.model is not None and not any(n in self.names.values() for n in self.seen):
                    hint += f"; none of them is a module of the model given as model= ({REGISTER_HINT})"
                raise ValueError(f"{self.who}: layer {sel!r} matched no attention call (nothing was {done}); "
                                 f"the attention calls ran under "
                                 f"{seen}{hint}.")


def _map_of(model: nn.Module | None) -> ModelMap | None:
    """The model's map where it has one (a causal LM, a bhqk model), else None: canonical addresses
    then match nothing."""
    if model is None:
        return None
    try:
        return model_map(model)
    except (ShapeError, TypeError, AttributeError, ValueError, ImportError):
        return None


def heads_rows(t: torch.Tensor, heads: list[int], rows: list[int] | None = None) -> torch.Tensor:
    """A tensor of every query head and row (q, out, lse): [B, H, Q, ·] -> [B, h, r, ·], the query
    heads ``heads`` and the rows ``rows`` (None: all)."""
    t = t.index_select(1, torch.tensor(heads, device=t.device))  # [B, H, Q, ·] -> [B, h, Q, ·]
    return t if rows is None else t.index_select(2, torch.tensor(rows, device=t.device))  # [B, h, Q, ·] -> [B, h, r, ·]


def value_heads(t: torch.Tensor, heads: list[int], H: int) -> torch.Tensor:
    """A value broadcastable to [B, H, ·, ·] (a mask or bias tile, an edit's tensor) on the query heads
    ``heads``: [#B, #h, ·, ·] (a head axis of size 1 is kept: it broadcasts)."""
    t = as_4d(t)  # [#B, #H, ·, ·]
    if t.shape[1] == H and H != 1:
        t = t.index_select(1, torch.tensor(heads, device=t.device))  # [#B, H, ·, ·] -> [#B, h, ·, ·]
    return t


def heads_extent(ext: Extent, H: int) -> Extent:
    """``ext`` with H heads."""
    return Extent(ext.B, H, ext.Q, ext.K)


class _Subset:
    """``base`` (a mask or bias of an H-head call) read on the heads ``heads`` only: a value of an h-head call."""

    def __init__(self, base, heads: list[int], H: int) -> None:
        self.base, self.heads, self.H = base, list(heads), H

    def check(self, ext):
        self.base.check(heads_extent(ext, self.H))

    def block(self, ext, q0, q1, k0, k1, *args, **kw):  # device (and a bias's dtype): [#B, #h, q, k]
        return value_heads(self.base.block(heads_extent(ext, self.H), q0, q1, k0, k1, *args, **kw), self.heads, self.H)

    def __repr__(self) -> str:
        return f"{self.base!r}[heads {self.heads}]"


class HeadSubset(_Subset, Mask):  # a mask of an H-head call read on some heads: a mask of an h-head call
    def classify(self, ext, q0, q1, k0, k1):  # over every head of the call: never wrong for a subset
        return self.base.classify(heads_extent(ext, self.H), q0, q1, k0, k1)

    def classify_grid(self, ext, block_q, block_k):
        return self.base.classify_grid(heads_extent(ext, self.H), block_q, block_k)

    def mask_mod(self, B, H, Q, K, device=None):
        f = self.base.mask_mod(B, self.H, Q, K, device)
        idx = torch.tensor(self.heads, dtype=torch.long, device=device)
        return lambda b, h, q_idx, kv_idx: f(b, idx[h], q_idx, kv_idx)


def mask_heads(m: Mask | None, heads: list[int], H: int) -> Mask | None:
    """The mask of the sub-call on ``heads``: ``m`` itself when it is the same for every head, the
    mask's own selection where it can make one (``Mask.select_heads``), else ``m`` read per tile."""
    if m is None or (len(heads) == H and heads == list(range(H))):
        return m
    return m.select_heads(heads, H) or HeadSubset(m, heads, H)


class _BiasSubset(_Subset, Bias):
    def __init__(self, base: Bias, heads: list[int], H: int) -> None:
        super().__init__(base, heads, H)
        self.floor = base.floor


def bias_heads(b: Bias | None, heads: list[int], H: int) -> Bias | None:
    """The bias of the sub-call on ``heads``; dense parts stay dense (the tiled backend's bias
    gradients see them)."""
    if b is None or (len(heads) == H and heads == list(range(H))):
        return b
    if isinstance(b, DenseBias):
        return DenseBias(value_heads(b.tensor, heads, H))  # [#B, #h, #Q, #K]
    if isinstance(b, BiasSum):
        a, c = bias_heads(b.a, heads, H), bias_heads(b.b, heads, H)
        assert a is not None and c is not None
        return BiasSum(a, c)
    return _BiasSubset(b, heads, H)


def sub_call(p: Problem, heads: list[int], mask: Mask | None, bias: Bias | None, rows: list[int] | None = None) -> Problem:
    """The call on the query heads ``heads`` and the query rows ``rows`` (None: all): q [B, h, r, d],
    k and v [B, h, K, ·] (head h reads K/V head h // G), sinks [h], with ``mask`` and ``bias`` (values
    of that h-head, r-row call)."""
    q = heads_rows(p.q, heads, rows)  # [B, H, Q, d] -> [B, h, r, d]
    k, v = (per_query_head(t, p.ext.H, heads) for t in (p.k, p.v))  # [B, Hkv, K, ·] -> [B, h, K, ·]
    s = p.sizes
    sizes = Sizes(B=s["B"], H=len(heads), Hkv=len(heads), Q=q.shape[2], K=s["K"], d=s["d"], dv=s["dv"])
    sinks = None if p.sinks is None else p.sinks.index_select(0, torch.tensor(heads, device=p.sinks.device))  # [H] -> [h]
    return Problem(q, k, v, sizes, mask, bias, p.scale, p.softcap, p.dropout_p, dict(p.options), sinks)
