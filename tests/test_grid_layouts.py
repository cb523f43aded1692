"""The layouts-and-strides axis of the semantics grid: every backend, forward and backward, on views.

A backend receives q, k, v as the caller's views (``Problem``: "views of the caller's tensors"), and
the output gradient and a dense mask or bias as autograd and the caller hand them over. Each of those
five tensors takes one of the layouts of :data:`LAYOUTS` (contiguous; transposed from [B, N, H, ·];
a slice of a wider buffer, last-dimension stride 2; a narrowed view with a storage offset; expanded
along B or along the head axis, stride 0), and every backend of ``functional.names()`` must give the
fp64 formula of tests/test_semantics.py from the same values, in the output, the lse and the
gradients of the leaves the views are taken from (dq, dk, dv, and dbias where the bias requires
grad), within the bounds of tests/tolerance.py. A backend may refuse a call only for a documented
limit (``test_semantics.LIMITS``); the grid then runs the largest part of the call it takes.

Registration-driven: a backend joins through ``functional.names()``, a layout by adding a maker to
:data:`LAYOUTS` (the covering design is rebuilt from the table). Pairwise over the factors (every
two layouts of every two roles, with the mask, the bias, GQA, head sizes and dtypes), not the product.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.functional import flex, names, prepare
from test_semantics import assert_refused, formula, pairwise, refusal
from tolerance import assert_close

BACKENDS = names()


@pytest.fixture(autouse=True)
def _flex_eager():
    with flex.uncompiled():
        yield


# ---- the layouts: a leaf tensor and the view of it a backend receives ---------------------------------

class Layout(NamedTuple):
    """``leaf(shape)`` -> the shape of the tensor to allocate; ``view(leaf, shape)`` -> the [B, H, N, x]
    view of it (differentiable: the gradient reaches the leaf)."""

    leaf: Callable[[tuple[int, ...]], tuple[int, ...]]
    view: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


LAYOUTS: dict[str, Layout] = {
    "contiguous": Layout(lambda s: s, lambda t, s: t),
    "transposed": Layout(lambda s: (s[0], s[2], s[1], s[3]),  # [B, N, H, x] -> [B, H, N, x]
                         lambda t, s: t.transpose(1, 2)),
    "slice2": Layout(lambda s: (*s[:3], 2 * s[3]),  # every other column of [B, H, N, 2x]: last-dim stride 2
                     lambda t, s: t[..., ::2]),
    "narrow": Layout(lambda s: (s[0], s[1], s[2] + 2, s[3] + 3),  # rows 1…N, columns 2…x+1 of [B, H, N+2, x+3]
                     lambda t, s: t[:, :, 1:1 + s[2], 2:2 + s[3]]),  # storage offset, row stride x+3
    "expand_B": Layout(lambda s: (1, *s[1:]), lambda t, s: t.expand(s)),  # [1, H, N, x] -> stride 0 along B
    "expand_H": Layout(lambda s: (s[0], 1, *s[2:]), lambda t, s: t.expand(s)),  # [B, 1, N, x] -> stride 0 along H
}


def test_every_layout_makes_the_strides_it_names():
    """The table makes what it says (a maker that returned a contiguous tensor would test nothing)."""
    s = (2, 4, 5, 8)
    got = {name: lay.view(torch.zeros(lay.leaf(s)), s) for name, lay in LAYOUTS.items()}
    assert all(t.shape == s for t in got.values())
    assert got["contiguous"].is_contiguous()
    assert got["transposed"].stride() == (160, 8, 32, 1)  # from [B, N, H, x]
    assert got["slice2"].stride(-1) == 2
    assert got["narrow"].storage_offset() > 0 and got["narrow"].stride(-1) == 1 and not got["narrow"].is_contiguous()
    assert got["expand_B"].stride(0) == 0 and got["expand_H"].stride(1) == 0


# ---- one case ------------------------------------------------------------------------------------------

def _per_head(b, h, q, k):
    return ((q + 2 * k + h) % 3) != 0  # differs per head: the span path's per-head masks


MASKS: dict[str, Callable[[], object]] = {  # "dense": the mask is a bool tensor of the ``mb`` layout
    "none": lambda: None,
    "causal_br": lambda: masks.causal("bottom_right"),
    "predicate": lambda: masks.predicate(_per_head, "per_head"),
    "window": lambda: masks.sliding_window(2, 1, align="bottom_right"),
    "dense": lambda: "dense",
    "band": lambda: masks.sliding_window(192, 0, align="bottom_right"),  # for long calls: the span path's band plan
}


@dataclass(frozen=True)
class Case:
    q: str = "contiguous"
    k: str = "contiguous"
    v: str = "contiguous"
    dout: str = "contiguous"
    mb: str = "contiguous"  # the dense mask or the bias tensor
    mask: str = "none"
    bias: str = "none"  # "none", "bias" (a tensor, no gradient), "bias_grad" (its gradient too)
    Hkv: int = 2  # of H = 4
    heads: tuple[int, int] = (8, 6)  # (d, dv)
    QK: tuple[int, int] = (5, 7)
    dtype: torch.dtype = torch.float64
    lse: bool = False
    sinks: bool = False
    softcap: float | None = None
    blocks: tuple[int, int] | None = None  # (block_q, block_k) for the span path and tiled: many small spans
    seed: int = 0

    def __str__(self) -> str:
        views = [f"{r}={getattr(self, r)}" for r in ("q", "k", "v", "dout", "mb") if getattr(self, r) != "contiguous"]
        bits = views + [self.mask, self.bias, f"Hkv{self.Hkv}", f"d{self.heads[0]}dv{self.heads[1]}",
                        f"Q{self.QK[0]}K{self.QK[1]}", str(self.dtype).removeprefix("torch.")]
        bits += [n for n in ("lse", "sinks") if getattr(self, n)] + ([f"softcap{self.softcap}"] if self.softcap else [])
        bits += [f"blocks{self.blocks[0]}x{self.blocks[1]}"] if self.blocks else []
        return "-".join(b for b in bits if b != "none")


B, H = 2, 4


class Inputs(NamedTuple):
    leaves: dict[str, torch.Tensor]  # q, k, v[, bias][, sinks]: what the gradients are taken of
    views: dict[str, torch.Tensor]  # q, k, v, dout[, bias][, dense]: what the call receives


def inputs(c: Case, grad: bool, exact: bool = False) -> Inputs:
    """The case's tensors in its dtype (``exact``: the same values in float64), each role a view of
    its leaf in its layout. ``grad``: q, k, v (and a bias_grad bias) require grad."""
    Q, K = c.QK
    d, dv = c.heads
    g = torch.Generator().manual_seed(c.seed)
    shapes = {"q": (B, H, Q, d), "k": (B, c.Hkv, K, d), "v": (B, c.Hkv, K, dv), "dout": (B, H, Q, dv)}
    if c.bias != "none":
        shapes["bias"] = (B, H, Q, K)
    if c.mask == "dense":
        shapes["dense"] = (B, H, Q, K)
    leaves, views = {}, {}
    for role, shape in shapes.items():
        lay = LAYOUTS[getattr(c, role) if role in ("q", "k", "v", "dout") else c.mb]
        if role == "dense":
            keep = torch.rand(lay.leaf(shape), generator=g) > 0.35
            keep[..., 0] = True  # every row of every view sees key 0 (a fully masked row: test_semantics)
            views[role] = lay.view(keep, shape)
            continue
        leaf = torch.randn(lay.leaf(shape), generator=g, dtype=torch.float64).to(c.dtype)
        leaf = leaf.double() if exact else leaf
        if role == "bias":
            leaf[..., -1, -1] = float("-inf")  # one entry forbidden by the bias
        if grad and (role in ("q", "k", "v") or (role == "bias" and c.bias == "bias_grad")):
            leaf.requires_grad_(True)
        leaves[role] = leaf
        views[role] = lay.view(leaf, shape)
    if c.sinks:  # [H]: one logit per head in each row's softmax denominator
        leaves["sinks"] = views["sinks"] = torch.linspace(-1.0, 2.0, H, dtype=c.dtype).to(
            torch.float64 if exact else c.dtype).requires_grad_(grad)
    return Inputs(leaves, views)


class Result(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor | None
    grads: dict[str, torch.Tensor]  # of the leaves


def _wrt(ins: Inputs) -> list[str]:
    return [r for r in ("q", "k", "v", "bias", "sinks") if r in ins.leaves and ins.leaves[r].requires_grad]


def _grads(out, lse, ins: Inputs) -> dict[str, torch.Tensor]:
    """Gradients of the leaves for the output gradient ``dout`` (and 0.3 per finite lse entry)."""
    wrt = _wrt(ins)
    if not wrt:
        return {}
    outs, gouts = [out], [ins.views["dout"].to(out.dtype)]
    if lse is not None:
        outs.append(lse)
        gouts.append(torch.where(torch.isfinite(lse), 0.3, 0.0).to(lse.dtype))
    got = torch.autograd.grad(outs, [ins.leaves[r] for r in wrt], gouts)
    return dict(zip(wrt, got))


@functools.lru_cache(maxsize=64)
def expected(c: Case, lse: bool, grad: bool) -> Result:
    """The fp64 formula from the same values, through the same views (so gradients reach the same
    leaves); kept for the next backend of the same case."""
    ins = inputs(c, grad, exact=True)
    v_ = ins.views
    allowed = _allowed(c, v_)
    out, got_lse = formula(v_["q"], v_["k"], v_["v"], allowed, scale=c.heads[0] ** -0.5, bias=v_.get("bias"),
                           softcap=c.softcap, sinks=v_.get("sinks"))
    got_lse = got_lse if lse else None
    return Result(out.detach(), None if got_lse is None else got_lse.detach(), _grads(out, got_lse, ins) if grad else {})


def _allowed(c: Case, views: dict) -> torch.Tensor:
    Q, K = c.QK
    if c.mask == "dense":
        return views["dense"]
    m = MASKS[c.mask]()
    return torch.ones(B, H, Q, K, dtype=torch.bool) if m is None else m.materialize(B, H, Q, K).expand(B, H, Q, K)


def run_case(backend: str, c: Case) -> tuple[Result, bool, bool] | None:
    """The call on ``backend``: (result, lse, grad) of the largest part of it the backend takes (each
    refusal on the way checked by ``test_semantics.assert_refused``); None when it takes none."""
    tried = []
    for grad, lse in ((True, c.lse), (False, c.lse), (True, False), (False, False)):
        if (grad, lse) in tried:
            continue
        tried.append((grad, lse))
        ins = inputs(c, grad)
        v_ = ins.views
        m = v_["dense"] if c.mask == "dense" else MASKS[c.mask]()
        kw = {"bias": v_.get("bias"), "return_lse": lse, "sinks": v_.get("sinks"), "softcap": c.softcap}
        if c.blocks:
            kw.update(block_q=c.blocks[0], block_k=c.blocks[1])

        def call(v_=v_, m=m, kw=kw):
            return bhqk.attention(v_["q"], v_["k"], v_["v"], m, backend=backend, **kw)

        reason = refusal(backend, prepare(v_["q"], v_["k"], v_["v"], m, v_.get("bias"), softcap=c.softcap, sinks=v_.get("sinks"),
                                          options={"block_q": c.blocks[0], "block_k": c.blocks[1]} if c.blocks else None), lse)
        if reason is not None:
            assert_refused(backend, reason, call)
            continue
        res = call()
        out, got_lse = res if lse else (res, None)
        assert out.dtype == c.dtype and out.shape == (B, H, c.QK[0], c.heads[1])
        return Result(out, got_lse, _grads(out, got_lse, ins) if grad else {}), lse, grad
    return None


def judge(backend: str, c: Case) -> None:
    ran = run_case(backend, c)
    if ran is None:
        return
    got, lse, grad = ran
    want = expected(c, lse, grad)
    Q, K = c.QK
    what = f"{backend} {c}"
    assert_close(got.out, want.out, dtype=c.dtype, n=K, msg=f"{what}: out")
    if lse:
        assert_close(got.lse, want.lse, dtype=c.dtype, n=K, msg=f"{what}: lse")
    assert got.grads.keys() == want.grads.keys(), what
    n = B * H * max(Q, K)  # the longest sum behind a leaf's gradient (an expanded leaf sums over B or H too)
    for role, g in got.grads.items():
        w = want.grads[role]
        if role == "bias":  # judged where the bias is finite (its -inf entry is no score: no gradient to speak of)
            finite = torch.isfinite(inputs(c, False).leaves["bias"])
            g, w = g[finite], w[finite]
        assert bool(torch.isfinite(g).all()), f"{what}: d{role} not finite"
        assert_close(g, w, dtype=c.dtype, n=n, msg=f"{what}: d{role}")


# ---- the grid: pairwise over the layouts of every role and the call's other properties ---------------

ROLES = ("q", "k", "v", "dout", "mb")
FACTORS: dict[str, list] = {
    **{role: list(LAYOUTS) for role in ROLES},
    "mask": [m for m in MASKS if m != "band"],
    "bias": ["none", "bias", "bias_grad"],
    "heads": [(8, 6), (8, 8), (6, 8)],  # dv < d, =, > d (the span path pads the narrower to one head size)
    "Hkv": [2, 4],
    "QK": [(5, 7), (7, 5), (1, 9)],  # (1, 9): a decode step
    "dtype": [torch.float64, torch.float32],
    "lse": [False, True],
    "sinks": [False, True],
    "softcap": [None, 1.5],
    "blocks": [None, (2, 3)],
}


def _has_mb(c: Case) -> bool:
    """The call has a dense mask or a bias tensor, so the ``mb`` layout is used."""
    return c.mask == "dense" or c.bias != "none"


def _pairs(cases: list[Case], a: str, b: str) -> set[tuple[str, str]]:
    """The value pairs of factors a and b the cases hold (``mb``'s only where it is a tensor)."""
    return {(str(getattr(c, a)), str(getattr(c, b))) for c in cases if _has_mb(c) or "mb" not in (a, b)}


def covering(factors: dict[str, list]) -> list[Case]:
    """Pairwise rows, plus rows for the pairs of an ``mb`` layout and another factor's value that the
    pairwise rows hold only where no dense mask or bias tensor takes the layout (each added row
    covers as many of them as it can; a row without ``mask="dense"`` gets a bias)."""
    cases = [Case(**row, seed=i) for i, row in enumerate(pairwise(factors))]
    others = [f for f in factors if f != "mb"]
    todo = {b: set(itertools.product(map(str, factors["mb"]), map(str, factors[b]))) - _pairs(cases, "mb", b) for b in others}
    while any(todo.values()):
        x = next(x for x in factors["mb"] if any(p[0] == x for t in todo.values() for p in t))
        pick = {b: [y for y in factors[b] if (x, str(y)) in todo[b]] for b in others}
        row = {b: (pick[b] or factors[b])[0] for b in others}
        row["mask"] = (pick["mask"] or ["dense"])[0]
        if row["mask"] != "dense" and row["bias"] == "none":
            row["bias"] = ([y for y in pick["bias"] if y != "none"] or ["bias"])[0]
        c = Case(mb=x, **row, seed=len(cases))
        cases.append(c)
        for b in others:
            todo[b].discard((x, str(getattr(c, b))))
    return cases


CASES = covering(FACTORS)


def test_the_grid_holds_every_pair_of_layouts_and_properties():
    for a, b in itertools.combinations(FACTORS, 2):
        every = {(str(getattr(Case(**{a: x}), a)), str(getattr(Case(**{b: y}), b))) for x in FACTORS[a] for y in FACTORS[b]}
        assert _pairs(CASES, a, b) == every, (a, b)
    assert len(CASES) < 80  # a covering design, not the product


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_layout_gives_the_formula_forward_and_backward(backend, case):
    judge(backend, case)


# ---- the two reported cases (issue 25 item 1) -----------------------------------------------------

@pytest.mark.parametrize("mask", ["causal_br", "predicate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_q_sliced_from_a_wider_buffer_gives_the_formula(backend, mask):
    """float64, B=2, H=4, Hkv=2, Q=5, K=7, d=8, dv=6, q = buf[..., ::2] of buf [B, H, Q, 2d]: the
    span path gave 1.15 (causal) and 1.47 (per-head predicate) off the reference."""
    judge(backend, Case(q="slice2", mask=mask, heads=(8, 6), Hkv=2, QK=(5, 7)))


# ---- a long call: the span path's own plans (a band's blocks, the ramp, a backward plan of its own) --

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_banded_call_on_views_gives_the_formula(backend):
    """Q = K = 512 under a window of 192: the span path runs its band plan (32-row blocks folded into
    the batch, keys an ``unfold`` view, 192-row blocks for the backward) on views of every kind."""
    judge(backend, Case(q="slice2", k="expand_H", v="transposed", dout="narrow", mask="band", QK=(512, 512),
                        heads=(8, 8), Hkv=2, dtype=torch.float32))


# ---- statistics: the row lse they start from, on views ---------------------------------------------

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mask", [None, "causal"])
def test_the_row_lse_of_statistics_is_the_formula_on_views(layout, mask):
    """``rowstats.row_lse`` (the lse every statistic is computed from) takes PyTorch's fused kernel
    where it can: q and k of every layout give the formula's lse (a q sliced from a wider buffer gave
    lse 2–3 off: the kernel reads the head dimension at stride 1)."""
    from bhqk.inspect import rowstats

    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, N, d = 2, 4, 2, 9, 8
    m = None if mask is None else masks.causal()
    shapes = {"q": (B, H, N, d), "k": (B, Hkv, N, d)}
    lay = LAYOUTS[layout]
    q, k = (lay.view(torch.randn(lay.leaf(s), generator=gen, dtype=torch.float64), s) for s in shapes.values())
    v = torch.randn(B, Hkv, N, d, generator=gen, dtype=torch.float64)
    got = rowstats.row_lse(prepare(q, k, v, m), list(range(H)), None)  # [B, H, N]
    S = q @ k.repeat_interleave(H // Hkv, 1).transpose(-1, -2) * d ** -0.5  # [B, H, N, N]
    if m is not None:
        S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
    assert_close(got, S.logsumexp(-1), n=N)
