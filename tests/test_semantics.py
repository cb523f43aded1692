"""The decided semantics (docs/design.md §2, "Decided edges"), once, on every registered backend.

Parametrized over ``bhqk.functional.names()`` (``auto`` included): a backend registered later joins
every test here without an edit. FlexAttention runs its unfused eager path (``flex.uncompiled()``,
as tests/test_flex.py does; compiling takes seconds per kernel on the CPU).

Every call is judged by one helper, :func:`check`: outputs, lse and gradients against an fp64
formula written here from the definition (its own masking, softmax and sinks; nothing of the
library but the masks' ``materialize``), with bounds from the arithmetic (tests/tolerance.py), and
on every fully masked row exactly out 0, lse −inf (or the sink) and finite gradients. What a backend
cannot take it must refuse in words: where its ``why_not`` gives a reason, the call must raise a
BackendError saying it (and a built-in backend may refuse only for its documented limits), and the
grid then runs the largest part of the call the backend does take (without gradients, without lse).

Properties: every mask kind (conftest.mask_kinds, and masks that differ by head), fully masked
rows (by the mask, by a −inf bias, by padding 0), sinks, GQA/MQA, both layouts, return_lse,
bias/ALiBi/softcap, float64 and float32 (pairwise, not the full product), fp16/bf16 (within twice
PyTorch's own math path's error), non-finite inputs (NaN/±inf reach exactly the rows that may attend them), a ``finfo.min`` bias,
empty sizes (B, Q or K = 0), dropout's fully masked rows and rescaling, and argument validation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import bhqk
from bhqk import masks
from bhqk.errors import BackendError, MaskError, ShapeError
from bhqk.functional import flex, get, names, prepare, registry
from conftest import mask_kinds, qkv
from tolerance import assert_close, assert_low_precision_close

BACKENDS = names()  # every registered backend and "auto": a backend registered later is tested here too
NAN, INF = float("nan"), float("inf")

# what a built-in backend may refuse, by a phrase of its why_not (a backend not listed may refuse
# anything it explains; reference, tiled and auto must take every call)
LIMITS: dict[str, tuple[str, ...]] = {
    "reference": (),
    "tiled": (),
    "auto": (),
    "torch": ("log-sum-exp", "softcap", "sinks"),
    "flex": ("backward on CPU", "dropout"),
}


@pytest.fixture(autouse=True)
def _flex_eager():
    """FlexAttention's eager path: the same mask_mod, score_mod and BlockMask, no compile."""
    with flex.uncompiled():
        yield


# ---- the fp64 formula, written from the definition ------------------------------------------------

def formula(q, k, v, allowed, *, scale, bias=None, softcap=None, sinks=None):
    """out [B, H, Q, dv] and lse [B, H, Q] in float64 (differentiable), bhnd: softmax over the
    allowed keys of S = softcap·tanh(q·kᵀ·scale / softcap) + bias, plus exp(sink[h]) in each row's
    denominator; a row with nothing in its denominator gives out 0 and lse −inf."""
    G = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)  # [B, H, ·, ·]
    S = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if bias is not None:
        S = S + bias.double()
        allowed = allowed & (bias > -INF)
    allowed = allowed.expand(S.shape)
    m = torch.where(allowed, S, -INF).amax(-1, keepdim=True).detach() if S.shape[-1] else S.new_zeros(S.shape[:-1] + (1,))
    if sinks is not None:
        m = torch.maximum(m, sinks.double().detach()[None, :, None, None])
    m = torch.where(torch.isfinite(m), m, 0.0)  # [B, H, Q, 1]
    E = torch.where(allowed, torch.exp(torch.where(allowed, S, m) - m), 0.0)  # [B, H, Q, K]
    den = E.sum(-1)  # [B, H, Q]
    if sinks is not None:
        den = den + torch.exp(sinks.double()[None, :, None] - m[..., 0])
    some = den > 0
    safe = torch.where(some, den, 1.0)
    out = torch.einsum("bhqk,bhkv->bhqv", E / safe[..., None], v)
    lse = torch.where(some, torch.log(safe) + m[..., 0], -INF)
    return out, lse


class Result(NamedTuple):
    out: torch.Tensor  # [B, H, Q, dv], bhnd
    lse: torch.Tensor | None  # [B, H, Q]
    grads: tuple  # d(q, k, v[, sinks]) of loss(out, lse)


def _loss(out, lse, dout):
    loss = (out.double() * dout).sum()
    if lse is not None:  # lse is differentiable too; -inf rows carry no gradient
        loss = loss + 0.3 * torch.where(torch.isfinite(lse), lse.double(), 0.0).sum()
    return loss


def check(got: Result, want: Result, *, dtype, dead: torch.Tensor, sink_lse: torch.Tensor | None, B, Q, K, G, what=""):
    """The one comparison of the grid: ``got`` (computed in ``dtype``) against the fp64 ``want``
    within the bounds of tests/tolerance.py, and exactly on the fully masked rows ``dead`` [B, H, Q]:
    out 0, lse −inf (``sink_lse`` [B, H, Q]: the sink), finite gradients (0 for q's row)."""
    assert got.out.shape == want.out.shape, what
    assert_close(got.out, want.out, dtype=dtype, n=K, msg=f"{what}: out")
    assert bool((got.out[dead] == 0).all()), f"{what}: a fully masked row is not 0"
    if got.lse is not None:
        assert got.lse.shape == want.lse.shape, what
        assert_close(got.lse, want.lse, dtype=dtype, n=K, msg=f"{what}: lse")
        expect = torch.full_like(got.lse, -INF) if sink_lse is None else sink_lse.to(got.lse.dtype)
        assert torch.equal(got.lse[dead], expect[dead]), f"{what}: lse of a fully masked row is not -inf or its sink"
    n = max(K, Q * G, B * Q)  # the longest sum behind a gradient: over keys (dq), query rows (dk, dv, dsinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got.grads, want.grads):
        assert g is not None and bool(torch.isfinite(g).all()), f"{what}: {name} not finite"
        assert_close(g, w, dtype=dtype, n=n, msg=f"{what}: {name}")
    if got.grads:
        assert bool((got.grads[0][dead] == 0).all()), f"{what}: dq of a fully masked row is not 0"


# ---- one call of the grid -------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    kind: str = "none"  # a key of conftest.mask_kinds, or "none"
    dtype: torch.dtype = torch.float64
    layout: str = "bhnd"
    Hkv: int = 4  # of H = 4: 4 (MHA), 2 (GQA), 1 (MQA)
    sinks: bool = False
    lse: bool = False
    grad: bool = False
    dead: bool = False  # and a dense mask that forbids every key to query row 1
    extra: str = "none"  # "bias" (dense, one row −inf), "alibi", "softcap"
    QK: tuple[int, int] = (5, 7)
    B: int = 2
    H: int = 4
    d: int = 8
    dv: int = 6
    seed: int = 0

    def __str__(self) -> str:
        bits = [self.kind, str(self.dtype).removeprefix("torch."), self.layout, f"Hkv{self.Hkv}", f"Q{self.QK[0]}K{self.QK[1]}"]
        bits += [n for n in ("sinks", "lse", "grad", "dead") if getattr(self, n)] + ([self.extra] if self.extra != "none" else [])
        return "-".join(bits)


def per_head_kinds(B: int, H: int, Q: int, K: int, seed: int = 0) -> dict[str, masks.Mask]:
    """Masks that differ by head (H = 4): the budgets' streaming heads (a sink and a window) beside
    full heads, ANDed with causal, and one part per head of four other kinds (a dense part that
    differs by head itself, None = every key)."""
    kinds = mask_kinds(B, H, Q, K, seed=seed)
    stream = ~masks.key_span(0, 2) | masks.sliding_window(2, align="bottom_right")
    by_head = torch.rand(B, H, Q, K, generator=torch.Generator().manual_seed(seed)) > 0.3  # [B, H, Q, K]
    return {
        "per_head_stream": masks.choose(torch.tensor([False, True, True, False]), None, stream) & masks.causal("bottom_right"),
        "per_head_mixed": masks.per_head([kinds["window"], kinds["document"], None, masks.dense(by_head)]),
    }


def _mask(c: Case):
    Q, K = c.QK
    if c.kind == "padding0":  # batch element 1 has no key: every row of it is fully masked
        m = masks.padding(torch.tensor([K] + [0] * (c.B - 1)))
    elif c.kind.startswith("per_head"):
        m = per_head_kinds(c.B, c.H, Q, K, seed=c.seed)[c.kind]
    else:
        m = None if c.kind == "none" else mask_kinds(c.B, c.H, Q, K, seed=c.seed)[c.kind]
    if c.dead:  # query row 1 may attend nothing, in every batch element and head
        keep = torch.ones(1, 1, Q, K, dtype=torch.bool)
        keep[:, :, min(1, Q - 1)] = False
        m = masks.dense(keep) if m is None else m & masks.dense(keep)
    return m


def _extra(c: Case) -> dict:
    Q, K = c.QK
    if c.extra == "bias":
        g = torch.Generator().manual_seed(c.seed + 7)
        bias = torch.randn(c.B, 1, Q, K, generator=g, dtype=c.dtype)
        bias[:, :, Q - 1] = -INF  # the last row forbidden by the bias alone
        return {"bias": bias}
    if c.extra == "alibi":
        return {"bias": bhqk.bias.alibi(c.H, align="bottom_right")}
    if c.extra == "softcap":
        return {"softcap": 1.5, "scale": 0.6}
    return {}


def _sinks(c: Case):
    return torch.linspace(-1.0, 2.0, c.H, dtype=c.dtype) if c.sinks else None


def refusal(backend: str, p, lse: bool) -> str | None:
    """Why ``backend`` cannot take the prepared call ``p`` (None: it can); auto: why it found none."""
    if backend == "auto":
        try:
            registry.decide(p, lse)
        except BackendError as e:
            return str(e)
        return None
    return get(backend).why_not(p, lse)


def assert_refused(backend: str, reason: str, call) -> None:
    """The call raises a BackendError that says ``reason``, a reason this backend documents."""
    limits = LIMITS.get(backend)
    if limits is not None:
        assert any(s in reason for s in limits), f"{backend} refused for an undocumented reason: {reason}"
    assert reason.strip(), f"{backend} refused without a reason"
    with pytest.raises(BackendError) as e:
        call()
    assert reason in str(e.value)


def run_case(backend: str, c: Case) -> tuple[Result, Case] | None:
    """The call of ``c`` on ``backend`` (bhnd results), with the largest part of it the backend
    takes: every refusal on the way is checked (:func:`assert_refused`). None: it takes none."""
    Q, K = c.QK
    q, k, v = qkv(c.B, c.H, c.Hkv, Q, K, c.d, c.dv, dtype=c.dtype, seed=c.seed)
    m, extra, sinks = _mask(c), _extra(c), _sinks(c)
    to = (lambda t: t.transpose(1, 2).contiguous()) if c.layout == "bnhd" else (lambda t: t)  # [B, H, N, ·] -> [B, N, H, ·]
    tried = []
    for grad, lse in ((c.grad, c.lse), (False, c.lse), (c.grad, False), (False, False)):
        if (grad, lse) in tried:
            continue
        tried.append((grad, lse))
        ins = [to(t).requires_grad_(grad) for t in (q, k, v)]
        s = None if sinks is None else sinks.clone().requires_grad_(grad)
        p = prepare(*ins, m, extra.get("bias"), extra.get("scale"), extra.get("softcap"), 0.0, c.layout, sinks=s)

        def call(ins=ins, lse=lse, s=s):
            return bhqk.attention(*ins, m, backend=backend, layout=c.layout, return_lse=lse, sinks=s, **extra)

        reason = refusal(backend, p, lse)
        if reason is not None:
            assert_refused(backend, reason, call)
            continue
        res = call()
        out, got_lse = res if lse else (res, None)
        assert out.dtype == c.dtype and out.shape == to(q.new_empty(c.B, c.H, Q, c.dv)).shape
        out = out.transpose(1, 2) if c.layout == "bnhd" else out  # [B, Q, H, dv] -> [B, H, Q, dv]
        grads: tuple = ()
        if grad:
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(c.seed + 1), dtype=torch.float64)
            wrt = ins + ([s] if s is not None else [])
            grads = torch.autograd.grad(_loss(out, got_lse, dout), wrt)
            grads = tuple(g.transpose(1, 2) if c.layout == "bnhd" and i < 3 else g for i, g in enumerate(grads))
        return Result(out, got_lse, grads), replace(c, grad=grad, lse=lse)
    return None


def expected(c: Case) -> tuple[Result, torch.Tensor, torch.Tensor | None]:
    """The formula's Result for ``c`` (from the same input values, in float64), its fully masked
    rows [B, H, Q], and the lse those rows must have with sinks [B, H, Q]."""
    Q, K = c.QK
    q, k, v = (t.double().requires_grad_(c.grad) for t in qkv(c.B, c.H, c.Hkv, Q, K, c.d, c.dv, dtype=c.dtype, seed=c.seed))
    m, extra, sinks = _mask(c), _extra(c), _sinks(c)
    allowed = torch.ones(c.B, c.H, Q, K, dtype=torch.bool) if m is None else m.materialize(c.B, c.H, Q, K).expand(c.B, c.H, Q, K)
    bias = extra.get("bias")
    if isinstance(bias, bhqk.bias.Bias):
        bias = bias.materialize(c.B, c.H, Q, K, dtype=torch.float64)
    s = None if sinks is None else sinks.double().requires_grad_(c.grad)
    scale = extra.get("scale", c.d ** -0.5)
    out, lse = formula(q, k, v, allowed, scale=scale, bias=bias, softcap=extra.get("softcap"), sinks=s)
    grads: tuple = ()
    if c.grad:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(c.seed + 1), dtype=torch.float64)
        grads = torch.autograd.grad(_loss(out, lse if c.lse else None, dout), (q, k, v) + ((s,) if s is not None else ()))
    dead = ~(allowed & (bias > -INF) if bias is not None else allowed).any(-1)  # [B, H, Q]
    sink_lse = None if sinks is None else sinks.double()[None, :, None].expand(c.B, c.H, Q)
    return Result(out.detach(), lse.detach() if c.lse else None, grads), dead, sink_lse


def judge(backend: str, c: Case) -> None:
    ran = run_case(backend, c)
    if ran is None:
        return  # refused in words, checked
    got, c = ran
    want, dead, sink_lse = expected(c)
    check(got, want, dtype=c.dtype, dead=dead, sink_lse=sink_lse, B=c.B, Q=c.QK[0], K=c.QK[1], G=c.H // c.Hkv,
          what=f"{backend} {c}")


# ---- the grid: pairwise over the properties -------------------------------------------------------

FACTORS = {
    "kind": ["none", *mask_kinds(1, 1, 4, 4), *per_head_kinds(1, 4, 4, 4)],
    "dtype": [torch.float64, torch.float32],
    "layout": ["bhnd", "bnhd"],
    "Hkv": [4, 2, 1],
    "QK": [(5, 7), (7, 5), (1, 9)],
    "extra": ["none", "bias", "alibi", "softcap"],
    "sinks": [False, True],
    "lse": [False, True],
    "grad": [False, True],
    "dead": [False, True],
}


def pairwise(factors: dict[str, list]) -> list[dict]:
    """Rows that together hold every pair of values of every two factors (greedy; deterministic)."""
    keys = list(factors)
    todo = {(a, i, b, j) for a, b in itertools.combinations(keys, 2)
            for i in range(len(factors[a])) for j in range(len(factors[b]))}
    rows = []
    while todo:
        row: dict[str, int] = {}
        first = min(todo, key=lambda t: (keys.index(t[0]), t[1], keys.index(t[2]), t[3]))
        row[first[0]], row[first[2]] = first[1], first[3]
        for key in keys:
            if key in row:
                continue
            row[key] = max(range(len(factors[key])), key=lambda i: (
                sum((a, row[a], key, i) in todo for a in keys[:keys.index(key)] if a in row)
                + sum((key, i, b, row[b]) in todo for b in keys[keys.index(key) + 1:] if b in row), -i))
        for a, b in itertools.combinations(keys, 2):
            todo.discard((a, row[a], b, row[b]))
        rows.append({key: factors[key][i] for key, i in row.items()})
    return rows


CASES = [Case(**row, seed=i) for i, row in enumerate(pairwise(FACTORS))]


def test_the_grid_holds_every_pair_of_properties():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(str(getattr(c, a)), str(getattr(c, b))) for c in CASES}
        assert len(seen) == len(FACTORS[a]) * len(FACTORS[b]), (a, b)
    assert len(CASES) < 70  # pairwise, not the product (at least |kinds| × |extras| = 60 rows)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_lse_and_gradients_equal_the_formula(backend, case):
    judge(backend, case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_a_plain_call(backend):
    """A backend that refused everything would pass the grid on refusals alone."""
    q, k, v = qkv(2, 4, 4, 8, 8, dtype=torch.float32)  # the plainest call: no mask, float32, Q = K
    assert refusal(backend, prepare(q, k, v), False) is None


# ---- fully masked rows, spelled out ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["dense_row", "padding0", "causal_q_gt_k", "bias_row"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_give_zero_weights_zero_lse_minus_inf_or_the_sink(backend, how):
    c = Case(kind={"padding0": "padding0", "causal_q_gt_k": "causal_br"}.get(how, "none"), dead=how == "dense_row",
             extra="bias" if how == "bias_row" else "none", QK=(9, 5) if how == "causal_q_gt_k" else (5, 7),
             sinks=how in ("padding0", "bias_row"), lse=True, grad=True, Hkv=2)
    judge(backend, c)
    m, extra = _mask(c), _extra(c)
    Q, K = c.QK
    q, k, _ = qkv(c.B, c.H, c.Hkv, Q, K, c.d, c.dv, dtype=c.dtype)
    P = bhqk.attention_weights(q, k, m, bias=extra.get("bias"), sinks=_sinks(c))
    _, dead, _ = expected(c)
    assert dead.any() and bool((P[dead] == 0).all())


# ---- low precision: within twice PyTorch's own math path's error -----------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_is_within_twice_the_math_paths_error(backend, dtype):
    B, H, Hkv, Q, K, d = 1, 4, 2, 17, 40, 16
    q, k, v = qkv(B, H, Hkv, Q, K, d, dtype=torch.float64)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    m = masks.causal("bottom_right")
    allowed = m.materialize(B, H, Q, K)
    dout = torch.randn(B, H, Q, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    exact, _ = formula(q64, k64, v64, allowed, scale=d ** -0.5)
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), dout.double())
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        math_out = F.scaled_dot_product_attention(ts[0], *(t.repeat_interleave(H // Hkv, dim=1) for t in ts[1:]),
                                                  attn_mask=allowed)
    math_grads = torch.autograd.grad(math_out, ts, dout)
    grad = True
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    reason = refusal(backend, prepare(*ins, m), False)
    if reason is not None:
        assert_refused(backend, reason, lambda: bhqk.attention(*ins, m, backend=backend))
        ins, grad = [t.clone() for t in (q, k, v)], False
    out = bhqk.attention(*ins, m, backend=backend)
    assert out.dtype == dtype
    assert_low_precision_close(out, exact, math_out, n=K, msg=f"{backend} out")
    if grad:
        for name, g, e, gm in zip("qkv", torch.autograd.grad(out, ins, dout), exact_grads, math_grads):
            assert g.dtype == dtype
            assert_low_precision_close(g, e, gm, n=max(K, Q), msg=f"{backend} d{name}")


# ---- non-finite inputs ----------------------------------------------------------------------------

def _banded(Q, K):
    """Query row i may attend keys [i-2, i+2] only: each key is attended by some rows and not others."""
    i, j = torch.arange(Q)[:, None], torch.arange(K)[None]
    return (j - i).abs() <= 2  # [Q, K]


@pytest.mark.parametrize("where, poison, K", [("v", NAN, 12), ("v", INF, 12), ("v", -INF, 12), ("k", INF, 12), ("k", -INF, 12),
                                              ("k", NAN, 12), ("q", NAN, 12), ("q", NAN, 300)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_inputs_reach_exactly_the_rows_that_may_attend_them(backend, where, poison, K):
    B, H, Hkv, Q, dv = 2, 4, 2, 12, 8
    q, k, v = qkv(B, H, Hkv, Q, K, 8, dv, dtype=torch.float32)
    allowed = _banded(Q, K)
    allowed[3] = False  # row 3 fully masked: 0 whatever the inputs hold
    j, c = 6, 3
    clean = formula(q, k, v, allowed, scale=8 ** -0.5)[0]
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    reach = torch.zeros(B, H, Q, dv, dtype=torch.bool)  # the entries the formula makes non-finite
    if where == "v":
        v2[0, 1, j, c] = poison  # kv head 1 serves query heads 2, 3
        reach[0, 2:, allowed[:, j], c] = True
    elif where == "k":
        k2[1, 0, j] = poison
        reach[1, :2, allowed[:, j]] = True  # may be anything there: not judged
    else:
        q2[0, 1, 2, 0] = poison
        q2[0, 1, 3] = poison  # in the fully masked row: still 0
        reach[0, 1, 2] = True
    ins = [t.requires_grad_() for t in (q2, k2, v2)]
    grad = refusal(backend, prepare(*ins, allowed), False) is None
    ins = [t.detach().requires_grad_(grad) for t in ins]
    with bhqk.trace() as t:
        out = bhqk.attention(*ins, allowed, backend=backend)
    assert not (where == "v" and torch.isfinite(out[reach]).any()), "a row that attends the poisoned value gets NaN/inf"
    assert not (where == "q" and not torch.isnan(out[reach]).all()), "a NaN query row gives NaN"
    assert bool(torch.isfinite(out[~reach]).all()), "NaN/inf reached a row that may not attend it"
    assert_close(out[~reach], clean[~reach], dtype=torch.float32, n=K)
    assert bool((out[:, :, 3] == 0).all())
    p = prepare(q2, k2, v2, allowed)
    be = registry.decide(p, False).backend if backend == "auto" else get(backend)
    to = be.hands_off(p) if be.hands_off is not None else None
    assert [x.backend for x in t.calls] == [to[0] if to else be.name], "the trace names the backend that computed it"
    if grad:  # rows that cannot reach the poison get finite gradients
        (dq,) = torch.autograd.grad(out[~reach.any(-1, keepdim=True).expand_as(reach)].sum(), ins[0], allow_unused=True)
        rows = ~reach.any(-1)  # [B, H, Q]
        if where == "v":
            assert bool(torch.isfinite(dq[rows]).all())
        if where != "k":  # (NaN in k: the reference's own dq is NaN, 0·NaN in dS·K; tests/test_tiled.py)
            assert bool((dq[:, :, 3] == 0).all())


def test_auto_says_it_hands_a_nonfinite_call_to_tiled():
    """SDPA lets NaN/inf cross the mask: auto's choice says so and names the backend that computes it."""
    q, k, v = qkv(1, 2, None, 12, 12, 8, dtype=torch.float32)
    v[0, 1, 5, 0] = NAN
    choice = bhqk.choose_backend(q, k, v, _banded(12, 12))
    assert choice.name == "tiled"
    assert "hands it to tiled: q, k or v holds NaN/inf, which" in choice.reason and "cross the mask" in choice.reason


@pytest.mark.parametrize("poison", [NAN, INF])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_keys_no_row_attends_change_no_output_or_gradient(backend, poison):
    B, H, Hkv, Q, K = 2, 4, 2, 6, 9
    lengths = torch.tensor([6, 9])
    q, k, v = qkv(B, H, Hkv, Q, K, 8, dtype=torch.float64)
    dout = torch.randn(B, H, Q, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 6:], v2[0, :, 6:] = poison, poison  # the padding of batch element 0
    for m in (masks.padding(lengths), masks.key_padding(torch.arange(K)[None] < lengths[:, None])):
        want = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_grads = torch.autograd.grad((formula(*want, m.materialize(B, H, Q, K), scale=8 ** -0.5)[0] * dout).sum(), want)
        ins = [t.clone().requires_grad_() for t in (q, k2, v2)]
        grad = refusal(backend, prepare(*ins, m), False) is None
        ins = [t.requires_grad_(grad) for t in ins]
        out = bhqk.attention(*ins, m, backend=backend)
        assert_close(out, formula(q, k, v, m.materialize(B, H, Q, K), scale=8 ** -0.5)[0], n=K)
        if grad:
            got = torch.autograd.grad((out * dout).sum(), ins)
            for g, w in zip(got, ref_grads):
                assert bool(torch.isfinite(g).all())
                assert_close(g, w, n=K)
            assert bool((got[1][0, :, 6:] == 0).all() and (got[2][0, :, 6:] == 0).all())  # no query attends them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_finfo_min_bias_on_every_key_gives_the_formula(backend, dtype):
    """A finite bias is never −inf, however negative (Hugging Face pads with the dtype's lowest)."""
    Q, K = 6, 300
    q, k, v = (t.to(dtype) for t in qkv(2, 2, None, Q, K, 8, dtype=torch.float64))
    lowest = torch.finfo(dtype).min
    bias = torch.zeros(2, 1, 1, K, dtype=dtype)
    bias[1] = lowest  # batch element 1: every key "padded": the mean of v
    bias[0, ..., 200:] = lowest  # batch element 0: keys 200… padded
    allowed = torch.ones(1, 1, 1, K, dtype=torch.bool)
    want, _ = formula(q, k, v, allowed, scale=8 ** -0.5, bias=bias.double())
    assert_close(want[1], v[1].double().mean(dim=-2, keepdim=True).expand(2, Q, 8), dtype=torch.float64, n=K)
    for b in (bias, bias.float().masked_fill(bias < 0, torch.finfo(torch.float32).min)):  # the float32 idiom too
        got = bhqk.attention(q, k, v, bias=b, backend=backend)
        assert_close(got, want, n=K, msg=f"{backend}: the lowest {b.dtype} as padding")


# ---- empty sizes ----------------------------------------------------------------------------------

EMPTY = [((2, 5, 0), None, True), ((2, 0, 7), "causal", False), ((0, 5, 7), "padding0", True), ((2, 0, 0), None, False),
         ((2, 5, 0), "padding0", False), ((0, 5, 7), "causal", False), ((2, 0, 7), "padding0", True)]


@pytest.mark.parametrize("size, mask, sinks", EMPTY)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sizes_give_fully_masked_semantics(backend, size, mask, sinks):
    B, Q, K = size
    H = 4
    q, k, v = qkv(B, H, 2, Q, K, 8, 6, dtype=torch.float32)
    m = {None: None, "causal": masks.causal("bottom_right"), "padding0": masks.padding(0)}[mask]
    s = torch.linspace(-1.0, 1.0, H) if sinks else None
    expect_lse = torch.full((B, H, Q), -INF) if s is None else s[None, :, None].expand(B, H, Q)
    for grad, lse in ((True, True), (False, True), (True, False), (False, False)):
        ins = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        reason = refusal(backend, prepare(*ins, m, sinks=s), lse)
        if reason is not None:
            assert_refused(backend, reason, lambda ins=ins, lse=lse: bhqk.attention(*ins, m, backend=backend, return_lse=lse,
                                                                                    sinks=s))
            continue
        res = bhqk.attention(*ins, m, backend=backend, return_lse=lse, sinks=s)
        out = res[0] if lse else res
        assert out.shape == (B, H, Q, 6) and out.dtype == q.dtype and bool((out == 0).all())
        if lse:
            assert res[1].shape == (B, H, Q) and torch.equal(res[1].float(), expect_lse), f"{backend}: lse {res[1]}"
        if grad:
            grads = torch.autograd.grad(out.sum() + (res[1].clamp_min(-1e9).sum() if lse else 0), ins, allow_unused=True)
            assert all(g is None or bool((g == 0).all()) for g in grads)
        break  # the largest part of the call it takes: checked
    assert bhqk.attention_weights(q, k, m, sinks=s).shape == (B, H, Q, K)


# ---- dropout --------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_keeps_fully_masked_rows_zero_and_rescales_the_kept(backend):
    B, H, Q, K = 64, 2, 16, 16
    q = torch.zeros(B, H, Q, 8, dtype=torch.float64, requires_grad=True)  # uniform weights 1/K
    k = torch.randn(B, H, K, 8, dtype=torch.float64, requires_grad=True)
    v = torch.ones(B, H, K, 1, dtype=torch.float64, requires_grad=True)  # out = kept share / (1 - p)
    allowed = torch.ones(1, 1, Q, K, dtype=torch.bool)
    allowed[..., 2, :] = False
    p = 0.5
    reason = refusal(backend, prepare(q, k, v, allowed, dropout_p=p), False)
    if reason is not None:
        assert_refused(backend, reason, lambda: bhqk.attention(q, k, v, allowed, dropout_p=p, backend=backend))
        return
    torch.manual_seed(0)
    out = bhqk.attention(q, k, v, allowed, dropout_p=p, backend=backend)
    assert bool((out[:, :, 2] == 0).all())
    assert all(bool(torch.isfinite(g).all()) for g in torch.autograd.grad(out.sum(), (q, k, v)))
    live = torch.cat([out[:, :, :2], out[:, :, 3:]], dim=2)
    sd = math.sqrt(p / ((1 - p) * K * live.numel()))  # each row: Binomial(K, 1 - p) / (K (1 - p))
    assert abs(live.mean().item() - 1.0) < 5 * sd, (live.mean().item(), sd)
    assert not torch.equal(live, torch.ones_like(live)), "dropout_p > 0 dropped nothing"


# ---- arguments ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, name", [
    ({"scale": NAN}, "scale"), ({"scale": INF}, "scale"), ({"scale": -INF}, "scale"),
    ({"softcap": INF}, "softcap"), ({"softcap": NAN}, "softcap"),
    ({"bias": torch.full((5, 7), INF)}, "bias"), ({"bias": torch.full((5, 7), NAN)}, "bias"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_arguments_are_errors_naming_them(backend, kw, name):
    q, k, v = qkv(1, 2, None, 5, 7, 8, dtype=torch.float32)
    with pytest.raises((ShapeError, MaskError), match=name):
        bhqk.attention(q, k, v, backend=backend, **kw)


# ---- a scale ≤ 0 (or below the kernel's smallest normal) with a causal mask ---------------------

@pytest.mark.parametrize("scale", [0.0, -1.0, 1e-122])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_with_a_non_positive_scale_gives_the_formula(backend, scale):
    """SDPA's ``is_causal`` masks with −inf before the scale: −inf·0 or −inf·(−1) is NaN or +inf
    (a masked key wins). The mask must hold whatever the scale (found in review)."""
    q, k, v = qkv(1, 2, None, 6, 6, 4, dtype=torch.float64)
    allowed = masks.causal().materialize(1, 2, 6, 6)  # [1, 2, Q, K]
    want, _ = formula(q, k, v, allowed, scale=scale)
    bhqk.attention(q.float(), k.float(), v.float(), masks.causal(), backend=backend)  # auto keeps its claim by structure
    got = bhqk.attention(q.float(), k.float(), v.float(), masks.causal(), scale=scale, backend=backend)
    assert_close(got, want, dtype=torch.float32, n=6, msg=f"{backend}, scale {scale}")
