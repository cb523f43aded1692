"""The semantics grid's shortcut axis (issue 25 item 3, issue 28): every path that answers from
something cheaper than the reference — each shortcut declared in :mod:`bhqk.shortcuts` (kept plans
and call masks, kept decisions (claims and checks per call family), checked sizes, the cost memo, extents, a dense mask's grids,
FlexAttention's kernels and block masks, decode-step GQA packing) — is run, in one
test, as a first call, a repeated call (which the shortcut answers: its ``hits`` grow) and a repeated
call after the input changed (new values, new strides, an in-place write into q, k, v, a dense mask,
a bias, or a tensor a mask holds), each against the reference (float64, every shortcut off).

Registration-driven: a case is a builder registered with :func:`case` for the shortcut it exercises;
a new shortcut joins by being declared (``shortcuts.declare``) and registering a case here, and
:func:`test_every_declared_shortcut_has_a_case` fails until it does."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import bhqk
from bhqk import masks, shortcuts
from bhqk.functional import costs, flex, registry
from bhqk.functional.problem import Problem
from conftest import registry_restored
from tolerance import assert_close


@dataclass
class Scenario:
    """Tensors ``inputs`` (q, k, v and any of ``mask_t`` a dense mask's tensor, ``bias_t`` a bias
    tensor, ``held`` a tensor a mask holds or a predicate reads) and ``run(inputs)`` the call through
    the shortcut; ``mask``/``bias`` built once from them (kept plans are per mask object).
    ``hits``: the repeated call is answered by the shortcut (False: it must not be, e.g. a predicate
    without ``key=``). ``changes``: extra changes of this case (name -> function of the inputs)."""

    inputs: dict[str, torch.Tensor]
    run: Callable[[dict], torch.Tensor]
    mask: object = None
    bias: object = None
    softcap: float | None = None
    hits: bool = True
    changes: dict[str, Callable[[dict], None]] = field(default_factory=dict)

    def reference(self) -> torch.Tensor:
        q, k, v = (self.inputs[n].double() for n in "qkv")
        bias = self.bias if "bias_t" not in self.inputs else self.inputs["bias_t"].double()
        mask = self.inputs.get("mask", self.mask)  # a change may put another mask object in the inputs
        with shortcuts.off():
            return bhqk.attention(q, k, v, mask, bias=bias, softcap=self.softcap, backend="reference")


@dataclass(frozen=True)
class Case:
    shortcut: str  # a declared shortcut's name
    name: str
    build: Callable[..., Scenario]  # (monkeypatch, tmp_path) -> Scenario


CASES: list[Case] = []


def case(shortcut: str, name: str):
    def deco(build):
        CASES.append(Case(shortcut, name, build))
        return build
    return deco


def _qkv(B=2, H=4, Hkv=2, Q=40, K=40, d=16, g=None):
    g = g or torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Q, d, generator=g)
    k = torch.randn(B, Hkv, K, d, generator=g)
    v = torch.randn(B, Hkv, K, d, generator=g)
    return {"q": q, "k": k, "v": v}


def _attend(backend: str, mask=None, softcap=None, bias_in=False, bias=None):
    def run(inp):
        b = inp["bias_t"] if bias_in else bias
        return bhqk.attention(inp["q"], inp["k"], inp["v"], inp.get("mask", mask), bias=b, softcap=softcap, backend=backend)
    return run


def _docs(N: int, cuts: list[int]) -> torch.Tensor:
    ids = torch.zeros(N, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    return ids


def _rewrite_docs(inp: dict) -> None:  # two documents become three, in place
    held = inp["held"]
    held.copy_(_docs(held.shape[0], [held.shape[0] // 3, 2 * held.shape[0] // 3]))


# ---- the cases: one or more per declared shortcut ---------------------------------------------------

@case("checked sizes", "reference")
def _(mp, tmp):
    inp = _qkv(Q=9, K=11)
    return Scenario(inp, _attend("reference", masks.causal("bottom_right")), masks.causal("bottom_right"))


def _grow(n: int):
    """A decode step's next call: ``n`` more keys (k and v grown as a KV cache grows)."""
    def change(inp: dict) -> None:
        g = torch.Generator().manual_seed(13)
        for t in "kv":
            more = torch.randn(*inp[t].shape[:2], n, inp[t].shape[3], generator=g)
            inp[t] = torch.cat([inp[t], more], dim=2)  # [B, Hkv, K, x] -> [B, Hkv, K + n, x]
    return change


def _poison(name: str, key: int = 3):
    """NaN in one key of k or v, or in one query row of q: the hand-off to tiled must fire."""
    def change(inp: dict) -> None:
        t = inp[name].clone()
        t[0, 0, key if name != "q" else 0, 0] = float("nan")
        inp[name] = t
    return change


def _retype(dtype: torch.dtype):
    def change(inp: dict) -> None:
        for n in "qkv":
            inp[n] = inp[n].to(dtype)
    return change


def _requires_grad(inp: dict) -> None:
    for n in "qkv":
        inp[n] = inp[n].clone().requires_grad_(True)


def _threads(inp: dict) -> None:  # another thread count (restored by _restore_threads): nothing a claim reads
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)


def _mask_to(mask):
    def change(inp: dict) -> None:
        inp["mask"] = mask
    return change


DECODE_CHANGES = {"one more key": _grow(1), "K past a key tile (512)": _grow(40), "dtype float64": _retype(torch.float64),
                  "requires_grad": _requires_grad, "NaN in q": _poison("q"), "NaN in k": _poison("k"),
                  "NaN in v": _poison("v"), "threads": _threads, "top-left mask": _mask_to(masks.causal("top_left")),
                  "no mask": _mask_to(None), "a window": _mask_to(masks.sliding_window(4, align="bottom_right"))}


@case("decisions", "decode step")
def _(mp, tmp):
    inp = _qkv(Q=1, K=23)
    m = masks.causal("bottom_right")
    return Scenario(inp, _attend("auto", m), m, changes=DECODE_CHANGES)


@case("decisions", "decode step at K=500")
def _(mp, tmp):
    inp = _qkv(B=1, H=9, Hkv=3, Q=1, K=500, d=64)
    m = masks.causal("bottom_right")
    return Scenario(inp, _attend("auto", m), m, changes=DECODE_CHANGES)


@case("decisions", "decode step, no mask, bnhd")
def _(mp, tmp):
    inp = _qkv(Q=1, K=23)
    for n in "qkv":
        inp[n] = inp[n].transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, N, d] views of [B, N, H, d]

    def run(inp):
        return bhqk.attention(*(inp[n].transpose(1, 2) for n in "qkv"), inp.get("mask"), layout="bnhd").transpose(1, 2)
    return Scenario(inp, run, None, changes={"one more key": _grow(1), "NaN in q": _poison("q")})


@case("decisions", "causal")
def _(mp, tmp):
    inp = _qkv(B=1, Q=64, K=64)
    m = masks.causal()
    return Scenario(inp, _attend("auto", m), m, changes={"NaN in k": _poison("k", 40), "NaN in v": _poison("v", 40),
                                                          "requires_grad": _requires_grad, "threads": _threads,
                                                          "no mask": _mask_to(None)})


@case("decisions", "causal with the lse")
def _(mp, tmp):
    inp = _qkv(B=1, Q=64, K=64)
    m = masks.causal()

    def run(inp):
        out, lse = bhqk.attention(inp["q"], inp["k"], inp["v"], inp.get("mask", m), return_lse=True)
        assert lse is not None and lse.shape == out.shape[:3]
        return out
    return Scenario(inp, run, m, changes={"NaN in k": _poison("k", 40), "one more query and key": _grow_both(1)})


def _grow_both(n: int):
    """Q and K grow together (a prefill one token longer): K is in the key of a causal call's family."""
    def change(inp: dict) -> None:
        _grow(n)(inp)
        g = torch.Generator().manual_seed(17)
        q = inp["q"]
        inp["q"] = torch.cat([q, torch.randn(*q.shape[:2], n, q.shape[3], generator=g)], dim=2)  # [B, H, Q + n, d]
    return change


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@case("decode GQA packing", "decode step")
def _(mp, tmp):
    inp = _qkv(Q=1, K=23)
    m = masks.causal("bottom_right")
    return Scenario(inp, _attend("torch", m), m)


def _cost_memo(mp, tmp):
    mp.setenv("BHQK_COSTS", str(tmp / "costs.json"))
    costs.MEMO.clear()
    costs.keep("cpu", torch.float32, costs.REFERENCE[torch.float32])  # the file holds this machine's costs
    costs.MEMO.clear()  # the first call reads the file; the repeated one the memo

    def threads(inp):  # another thread count is another machine key: the file has no costs for it
        n = torch.get_num_threads()
        costs.keep("cpu", torch.float32, costs.REFERENCE[torch.float32])
        mp.setattr(torch, "get_num_threads", lambda: n + 1)
        assert costs.kept("cpu", torch.float32, costs.Costs) is None  # not the memo's entry for n threads
        costs.keep("cpu", torch.float32, costs.REFERENCE[torch.float32])

    inp = _qkv(Q=40, K=40)
    m = masks.causal()
    return Scenario(inp, _attend("auto", m, softcap=5.0), m, softcap=5.0, changes={"thread count": threads})


case("cost memo", "softcap weighed")(_cost_memo)


_MASKS: dict[str, Callable[[dict], tuple]] = {  # (mask, hits) from the inputs; adds the tensors it holds
    "dense": lambda inp: (masks.dense(inp.setdefault("mask_t", torch.rand(40, 40, generator=torch.Generator().manual_seed(3))
                                                     < 0.5)), True),
    "document": lambda inp: (masks.document(inp.setdefault("held", _docs(40, [20]))) & masks.causal(), True),
    "window": lambda inp: (masks.sliding_window(7), True),
    "predicate(key=)": lambda inp: ((lambda ids: masks.predicate(lambda b, h, i, j: ids[i] == ids[j], key=ids))(
        inp.setdefault("held", _docs(40, [20]))) & masks.causal(), True),
    "predicate": lambda inp: ((lambda ids: masks.predicate(lambda b, h, i, j: ids[i] == ids[j]))(
        inp.setdefault("held", _docs(40, [20]))) & masks.causal(), False),  # issue 28: never kept without key=
}


def _planned(backend: str, kind: str, with_bias: bool = False):
    def build(mp, tmp):
        inp = _qkv(Q=40, K=40)
        m, hits = _MASKS[kind](inp)
        if with_bias:
            inp["bias_t"] = torch.randn(1, 4, 40, 40, generator=torch.Generator().manual_seed(4))
        return Scenario(inp, _attend(backend, m, bias_in=with_bias), m, hits=hits)
    return build


for _kind in _MASKS:
    case("tiled plans", _kind)(_planned("tiled", _kind))
    case("span plans", _kind)(_planned("spans", _kind))
case("tiled plans", "window+bias")(_planned("tiled", "window", with_bias=True))
case("span plans", "window+bias")(_planned("spans", "window", with_bias=True))
for _kind in ("dense", "document", "window", "predicate(key=)"):
    case("span call masks", _kind)(_planned("spans", _kind))
case("span plans", "auto window")(_planned("auto", "window"))
case("span plans", "auto document")(_planned("auto", "document"))


@case("extents", "reference")
def _(mp, tmp):
    inp = _qkv(Q=9, K=11)
    return Scenario(inp, _attend("reference", masks.causal("bottom_right")), masks.causal("bottom_right"))


def _grids(backend: str):
    """A dense mask's tile classes, asked again by a repeated call whose plan is not kept."""
    def build(mp, tmp):
        inp = _qkv(Q=40, K=40)
        m, _ = _MASKS["dense"](inp)
        attend = _attend(backend, m)

        def run(inp):
            with shortcuts.off("tiled plans", "span plans"):
                return attend(inp)
        return Scenario(inp, run, m)
    return build


case("dense mask grids", "tiled")(_grids("tiled"))
case("dense mask grids", "spans")(_grids("spans"))


def _flex_block_masks(kind: str):
    def build(mp, tmp):
        inp = _qkv(Q=40, K=40)
        m, hits = _MASKS[kind](inp)
        attend = _attend("flex", m)

        def run(inp):
            with flex.uncompiled(), torch.no_grad():
                return attend(inp)
        return Scenario(inp, run, m, hits=hits)
    return build


for _kind in _MASKS:
    case("flex block masks", _kind)(_flex_block_masks(_kind))


@case("flex kernels", "eager stand-in for the compiler")
def _(mp, tmp):
    """The kept kernel per structure, with ``torch.compile`` standing in as the identity (the key and
    its reuse are what is checked, not the compiler)."""
    fa = flex._flex()
    if fa is None:
        pytest.skip("this torch has no FlexAttention")
    mp.setattr(torch, "compile", lambda fn, **kw: fn)
    if hasattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"):  # the eager path without dynamo tracing it
        mp.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    mp.setattr(flex, "_no_compiler", lambda device_type: None)
    inp = _qkv(Q=40, K=40)
    m = masks.sliding_window(7)
    attend = _attend("flex", m)

    def run(inp):
        with torch.no_grad():
            return attend(inp)
    return Scenario(inp, run, m)


# ---- the changes --------------------------------------------------------------------------------------

def _fresh(inp: dict) -> None:  # new tensors, new values
    g = torch.Generator().manual_seed(7)
    for n in "qkv":
        inp[n] = torch.randn(inp[n].shape, generator=g)


def _strides(inp: dict) -> None:  # the same values in another layout: transposed from [B, N, H, d]
    for n in "qkv":
        inp[n] = inp[n].transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, N, d] with N's stride H·d


def _in_place(name: str):
    def change(inp: dict) -> None:
        t = inp[name]
        g = torch.Generator().manual_seed(11)
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) < 0.3)
        elif name == "held":
            _rewrite_docs(inp)
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return change


CHANGES: dict[str, tuple[str | None, Callable[[dict], None]]] = {  # name -> (the input it needs, the change)
    "new values": (None, _fresh),
    "new strides": (None, _strides),
    "q in place": ("q", _in_place("q")),
    "k in place": ("k", _in_place("k")),
    "v in place": ("v", _in_place("v")),
    "dense mask in place": ("mask_t", _in_place("mask_t")),
    "bias in place": ("bias_t", _in_place("bias_t")),
    "held tensor in place": ("held", _in_place("held")),
}


def _check(sc: Scenario, msg: str, ref: torch.Tensor | None = None) -> torch.Tensor:
    """The call through the shortcut against the reference (``ref``: already computed for these inputs)."""
    ref = sc.reference() if ref is None else ref
    assert_close(sc.run(sc.inputs), ref, dtype=torch.float32, n=sc.inputs["k"].shape[2], msg=msg)
    return ref


@pytest.mark.parametrize("c", CASES, ids=[f"{c.shortcut}-{c.name}" for c in CASES])
def test_first_repeated_and_changed_calls_equal_the_reference(c: Case, monkeypatch, tmp_path):
    """One test per case: every applicable change, each after a first and a repeated call."""
    probe = c.build(monkeypatch, tmp_path)
    changes = {n: f for n, (need, f) in CHANGES.items() if need is None or need in probe.inputs} | probe.changes
    shortcut = shortcuts.declared()[c.shortcut]
    for change_name, change in changes.items():
        shortcuts.clear()
        sc = c.build(monkeypatch, tmp_path)
        ref = _check(sc, f"{c.shortcut} {c.name}: first call")
        before = shortcut.hits
        _check(sc, f"{c.shortcut} {c.name}: repeated call", ref)
        assert (shortcut.hits > before) == sc.hits, (
            f"{c.shortcut} {c.name}: the repeated call was {'not ' if sc.hits else ''}answered by the shortcut")
        change(sc.inputs)
        _check(sc, f"{c.shortcut} {c.name}: repeated after {change_name}")


def test_every_declared_shortcut_has_a_case():
    covered = {c.shortcut for c in CASES}
    missing = set(shortcuts.declared()) - covered
    assert not missing, f"declared shortcuts without a case in the grid: {sorted(missing)}"


def test_off_turns_a_shortcut_off_and_names_are_checked():
    sc = _qkv(Q=1, K=23)
    packing = shortcuts.declared()["decode GQA packing"]
    before = packing.hits
    with shortcuts.off("decode GQA packing"):
        bhqk.attention(sc["q"], sc["k"], sc["v"], backend="torch")
    assert packing.hits == before
    bhqk.attention(sc["q"], sc["k"], sc["v"], backend="torch")
    assert packing.hits == before + 1
    with pytest.raises(ValueError, match="unknown shortcut"):
        with shortcuts.off("no such shortcut"):
            pass


@pytest.mark.parametrize("backend", ["auto", "spans"])
def test_a_call_is_planned_once(backend, monkeypatch):
    """The plan travels in the ``Choice`` (issue 28): share, hands_off and run of one call use the plan
    made once, with the plan caches off (nothing kept between or within calls)."""
    from bhqk.functional import spans_plan

    made = []
    plan = spans_plan._plan
    monkeypatch.setattr(spans_plan, "_plan", lambda p: made.append(p) or plan(p))
    inp = _qkv(Q=40, K=40)
    with shortcuts.off("span plans", "tiled plans"):
        out = bhqk.attention(inp["q"], inp["k"], inp["v"], masks.sliding_window(7), backend=backend)
    assert bhqk.choose_backend(inp["q"], inp["k"], inp["v"], masks.sliding_window(7)).name == "spans"
    assert len(made) == 1 + 1, "one plan for the call, one for choose_backend"
    assert_close(out, bhqk.attention(*(inp[n].double() for n in "qkv"), masks.sliding_window(7), backend="reference"),
                 dtype=torch.float32, n=40)


def test_a_fixed_table_without_float32_falls_back():
    """costs.kept() raised KeyError for fixed({torch.float16: c}) and a float32 call (issue 28)."""
    c = costs.REFERENCE[torch.float16]
    with costs.fixed({torch.float16: c}):
        assert costs.kept("cpu", torch.float16, costs.Costs) is c
        assert costs.kept("cpu", torch.float32, costs.Costs) == costs.REFERENCE[torch.float32]


def test_a_predicate_key_must_be_hashable_or_tensors():
    with pytest.raises(bhqk.errors.MaskError, match="key must be"):
        masks.predicate(lambda b, h, i, j: i >= j, key=[1, 2])
    m = masks.predicate(lambda b, h, i, j: i >= j, key=(torch.zeros(3), "docs"))
    assert m.cache_key() is not None
    with torch.inference_mode():
        ids = torch.zeros(3)
    assert masks.predicate(lambda b, h, i, j: i >= j, key=ids).cache_key() is None  # no version counter: never kept


# ---- a kept decision answers its family only ------------------------------------------------------------

def _step(K: int = 30, **kw):
    """A GQA decode step (q [2, 6, 1, 16], k/v [2, 2, K, 16]) as (q, k, v, mask, keyword arguments)."""
    g = torch.Generator().manual_seed(K)
    q, k, v = torch.randn(2, 6, 1, 16, generator=g), torch.randn(2, 2, K, 16, generator=g), torch.randn(2, 2, K, 16, generator=g)
    return [q, k, v, kw.pop("mask", masks.causal("bottom_right")), kw]


def _nan(i: int):
    def f(call):
        t = call[i].clone()
        t[0, 0, -1, 0] = float("nan")
        call[i] = t
        return call
    return f


def _kw(**extra):
    def f(call):
        call[4] = {**call[4], **extra}
        return call
    return f


def _transposed(call):  # the same values as views of [B, N, H, d] buffers
    call[:3] = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in call[:3]]
    return call


def _grad(call):
    call[:3] = [t.clone().requires_grad_(True) for t in call[:3]]
    return call


VARIANTS: dict[str, Callable[[list], list]] = {
    "one more key": lambda c: _step(31),
    "K past a key tile": lambda c: _step(520),
    "top-left causal": lambda c: _step(mask=masks.causal("top_left")),
    "top-left causal, K = 1": lambda c: _step(1, mask=masks.causal("top_left")),
    "no mask": lambda c: _step(mask=None),
    "a window": lambda c: _step(mask=masks.sliding_window(4, align="bottom_right")),
    "key padding": lambda c: _step(mask=masks.causal("bottom_right") & masks.key_padding((torch.arange(30) > 3).expand(2, 30))),
    "float64": lambda c: [t.double() if isinstance(t, torch.Tensor) else t for t in c],
    "other strides": _transposed,
    "requires_grad": _grad,
    "the lse": _kw(return_lse=True),
    "scale 0": _kw(scale=0.0),
    "another scale": _kw(scale=0.5),
    "softcap": _kw(softcap=5.0),
    "sinks": _kw(sinks=torch.zeros(6)),
    "bias": _kw(bias=torch.zeros(1, 1, 1, 30)),
    "NaN in q": _nan(0),
    "NaN in k": _nan(1),
    "NaN in v": _nan(2),
    "Q = 3": lambda c: [torch.randn(2, 6, 3, 16), *c[1:]],
    "bnhd layout": lambda c: [*(t.transpose(1, 2) for t in c[:3]), c[3], {**c[4], "layout": "bnhd"}],
    "after top-left causal at K = 1, K = 30": lambda c: _step(mask=_TOP_LEFT),  # the same mask object at other sizes
    "after Q = 3 bottom-right, Q = 3 top-left": lambda c: [c[0], c[1], c[2], masks.causal("top_left"), c[4]],
    "after a mask seeing every key at K = 30, the same object at K = 20": lambda c: _step(20, mask=_FROM_30),
}
_TOP_LEFT = masks.causal("top_left")


class _From30(masks.Mask):
    """key ≤ query + c with c = K − 1 for K ≥ 30 (the one query sees every key) and 0 below (key 0 only):
    a causal diagonal that depends on the sizes, for the last-mask read (registry.DECISIONS.last_mask)."""

    head_dependent = False

    def causal_diagonal(self, ext):
        return ext.K - 1 if ext.K >= 30 else 0

    def block(self, ext, q0, q1, k0, k1, device=None):
        qi, ki = torch.arange(q0, q1, device=device)[:, None], torch.arange(k0, k1, device=device)[None, :]
        return ki <= qi + self.causal_diagonal(ext)  # [q, k]


_FROM_30 = _From30()
BASES = {"after top-left causal at K = 1, K = 30": lambda: _step(1, mask=_TOP_LEFT),  # else a bottom-right decode step
         "after Q = 3 bottom-right, Q = 3 top-left": lambda: [torch.randn(2, 6, 3, 16), *_step()[1:]],
         "after a mask seeing every key at K = 30, the same object at K = 20": lambda: _step(mask=_FROM_30)}


def _out(call) -> torch.Tensor:
    q, k, v, mask, kw = call
    out = bhqk.attention(q, k, v, mask, **kw)
    out = out[0] if kw.get("return_lse") else out
    return out.transpose(1, 2) if kw.get("layout") == "bnhd" else out


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_kept_decision_is_not_reused_for_a_call_outside_its_family(variant):
    """After a decode step's decision is kept (and answers a repeated call), each variant of the call
    gets the backend a fresh decision gives it (``shortcuts.off("decisions")``), the reference's
    answer, and — where the variant is its family (one more key, K past a key tile) — the kept
    decision (hits grow, nothing new kept)."""
    shortcuts.clear()
    kept = shortcuts.declared()["decisions"]
    base = BASES.get(variant, _step)
    _out(base())
    before = kept.hits
    _out(base())
    assert kept.hits > before, "the repeated decode step was not answered by its kept decision"
    call = VARIANTS[variant](base())
    q, k, v, mask, kw = call
    choose = {n: x for n, x in kw.items() if n not in ("layout",)}
    if kw.get("layout") == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    chosen = bhqk.choose_backend(q, k, v, mask, **choose).name
    with shortcuts.off("decisions"):
        fresh = bhqk.choose_backend(q, k, v, mask, **choose).name
    assert chosen == fresh, f"{variant}: the kept decision ran {chosen}, a fresh one {fresh}"
    entries, before = len(registry.DECISIONS), kept.hits
    out = _out(call)
    if variant in ("one more key", "K past a key tile"):
        assert kept.hits > before and len(registry.DECISIONS) == entries, f"{variant}: its family's decision was not used"
    ref_kw = {n: x for n, x in kw.items() if n in ("scale", "softcap")}
    for name in ("bias", "sinks"):
        if name in kw:
            ref_kw[name] = kw[name].double()
    with shortcuts.off():
        ref = bhqk.attention(q.double(), k.double(), v.double(), mask, backend="reference", **ref_kw)
    assert_close(out, ref, dtype=q.dtype, n=k.shape[2], msg=variant)


def _bad(call, i: int, t):
    call[i] = t
    return call


ERRORS: dict[str, Callable[[list], list]] = {
    "v one key longer": lambda c: _bad(c, 2, torch.randn(2, 2, 31, 16)),
    "k of another dtype": lambda c: _bad(c, 1, c[1].double()),
    "H not a multiple of Hkv": lambda c: _bad(_bad(c, 1, torch.randn(2, 4, 30, 16)), 2, torch.randn(2, 4, 30, 16)),
    "q 3-D": lambda c: _bad(c, 0, c[0][:, :, 0]),
    "no alignment for Q ≠ K": lambda c: _bad(c, 3, masks.causal()),
    "scale NaN": _kw(scale=float("nan")),
    "scale True": _kw(scale=True),
    "softcap 0": _kw(softcap=0.0),
    "dropout 1.5": _kw(dropout_p=1.5),
    "unknown layout": _kw(layout="bhdn"),
    "a mask that does not broadcast": lambda c: _bad(c, 3, torch.ones(3, 1, 1, 30, dtype=torch.bool)),
}


@pytest.mark.parametrize("error", ERRORS)
def test_every_error_still_fires_after_a_decision_is_kept(error):
    """A decode step's decision is kept; each bad variant of the call raises exactly the error it
    raises with every shortcut off (errors are never kept, and no check is skipped for them)."""
    shortcuts.clear()
    _out(_step())
    _out(_step())
    q, k, v, mask, kw = ERRORS[error](_step())
    with pytest.raises((ValueError, TypeError)) as kept:
        bhqk.attention(q, k, v, mask, **kw)
    with shortcuts.off(), pytest.raises((ValueError, TypeError)) as fresh:
        bhqk.attention(q, k, v, mask, **kw)
    assert type(kept.value) is type(fresh.value) and str(kept.value) == str(fresh.value)


def test_a_new_backend_is_asked_after_a_decision_was_kept():
    """The registry's version is in a decision's key: a backend registered later that claims the call
    with fewer scores runs it, and once unregistered it runs no more."""
    shortcuts.clear()
    _out(_step())
    _out(_step())  # kept, and answered
    ran = []

    def run(p, need_lse, plan=None):
        ran.append(p.ext.K)
        return registry.get("reference").run(p, need_lse)

    with registry_restored():
        registry.register(registry.Backend("claims all", run, lambda p, lse: None, share=lambda p, plan=None: 0.0))
        q, k, v, mask, kw = _step()
        assert bhqk.choose_backend(q, k, v, mask).name == "claims all"
        _out(_step())
        _out(_step())  # its decision kept, and answered
        assert ran == [30, 30]
        registry.unregister("claims all")
        assert bhqk.choose_backend(q, k, v, mask).name == "torch"
        _out(_step())
        assert ran == [30, 30]


def test_a_decisions_key_reads_every_field_of_a_problem():
    """family() is written by hand: every compared field of a Problem must be one it reads
    (registry.FAMILY_READS); a field added to Problem fails here until the key reads it."""
    fields = {f.name for f in dataclasses.fields(Problem) if f.compare}
    assert fields == set(registry.FAMILY_READS)


def test_a_generation_keeps_one_decision():
    """Every decode step of a generation (K = 1 … 40, across the 512-key tile too) is one family."""
    shortcuts.clear()
    for K in (*range(1, 41), 511, 512, 513, 1030):
        _out(_step(K))
    assert len(registry.DECISIONS) == 1
