"""The semantics grid's shortcut axis (issue 25 item 3, issue 28): every path that answers from
something cheaper than the reference — each shortcut declared in :mod:`bhqk.shortcuts` (kept plans
and call masks, kept claims, checked sizes, the cost memo, extents, a dense mask's grids,
FlexAttention's kernels and block masks, decode-step GQA packing) — is run, in one
test, as a first call, a repeated call (which the shortcut answers: its ``hits`` grow) and a repeated
call after the input changed (new values, new strides, an in-place write into q, k, v, a dense mask,
a bias, or a tensor a mask holds), each against the reference (float64, every shortcut off).

Registration-driven: a case is a builder registered with :func:`case` for the shortcut it exercises;
a new shortcut joins by being declared (``shortcuts.declare``) and registering a case here, and
:func:`test_every_declared_shortcut_has_a_case` fails until it does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import bhqk
from bhqk import masks, shortcuts
from bhqk.functional import costs, flex
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
        with shortcuts.off():
            return bhqk.attention(q, k, v, self.mask, bias=bias, softcap=self.softcap, backend="reference")


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
        return bhqk.attention(inp["q"], inp["k"], inp["v"], mask, bias=b, softcap=softcap, backend=backend)
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


@case("decisions", "decode step")
def _(mp, tmp):
    inp = _qkv(Q=1, K=23)
    m = masks.causal("bottom_right")
    return Scenario(inp, _attend("auto", m), m)


@case("decisions", "causal")
def _(mp, tmp):
    inp = _qkv(B=1, Q=64, K=64)
    m = masks.causal()
    return Scenario(inp, _attend("auto", m), m)


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
