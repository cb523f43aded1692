"""The budget cache follows the installed transformers' cache protocol, read from transformers itself:
every method that ``Cache`` calls on its layers and that transformers' own key/value layers
(``CacheLayerMixin``, ``DynamicLayer``, ``DynamicSlidingWindowLayer``) define, ``BudgetLayer`` defines
too, accepting every call those layers accept and every call ``Cache`` makes; every attribute ``Cache``
reads on its layers is there; and each ``Cache``/``DynamicCache`` method that ``BudgetCache`` redefines
accepts what the original accepts. A release that adds a method or an argument fails here, by name."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import transformers
from transformers import cache_utils

from bhqk.budget.cache import BudgetCache, BudgetLayer

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

REFERENCE = [cache_utils.CacheLayerMixin, cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer]


class _Probe:
    """An argument whose value does not matter: only whether the signature binds it."""


def _probes(sig: inspect.Signature) -> list[tuple[list, dict]]:
    """The calls a signature accepts (``self`` left out): its positional parameters by position, its
    keyword-only ones by name, one more positional for ``*args`` and one more keyword for ``**kwargs``."""
    params = list(sig.parameters.values())[1:]
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kw = {p.name: _Probe() for p in params if p.kind == p.KEYWORD_ONLY}
    required = [_Probe() for p in pos if p.default is p.empty]
    calls = [(required, {k: v for k, v in kw.items() if sig.parameters[k].default is sig.parameters[k].empty}),
             ([_Probe() for _ in pos], kw)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        calls.append(([_Probe() for _ in pos] + [_Probe()], kw))
    if any(p.kind == p.VAR_KEYWORD for p in params):
        calls.append(([_Probe() for _ in pos], {**kw, "an_argument_of_a_later_release": _Probe()}))
    return calls


def _refusals(ours, theirs, where: str) -> list[str]:
    """Each call ``theirs`` (named ``where``) accepts that ``ours`` does not, said with both signatures."""
    mine, other = inspect.signature(ours), inspect.signature(theirs)
    bad = []
    for args, kwargs in _probes(other):
        try:
            mine.bind(_Probe(), *args, **kwargs)
        except TypeError as e:
            bad.append(f"{where}{other} accepts {len(args)} positional and keywords {sorted(kwargs)}, "
                       f"but {ours.__qualname__}{mine} refuses it: {e}")
    return bad


def _layer_uses(cls: type) -> tuple[dict[str, list[tuple[int, list[str]]]], set[str]]:
    """What ``cls``'s own code does with its layers (``self.layers[i]``, or a name bound to one):
    method → its calls (number of positional arguments, keyword names; ``*``/``**`` pass-throughs
    left out), and the attributes it reads."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))

    def is_layers(n):
        return isinstance(n, ast.Attribute) and n.attr == "layers" and isinstance(n.value, ast.Name) and n.value.id == "self"

    names = set()  # names bound to one layer: for layer in self.layers / zip(self.layers, ...), layer = self.layers[i]
    for n in ast.walk(tree):
        if isinstance(n, (ast.For, ast.comprehension)):
            it, target = n.iter, n.target
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and it.args:
                it, target = it.args[0], (target.elts[0] if isinstance(target, ast.Tuple) else None)
            if is_layers(it) and isinstance(target, ast.Name):
                names.add(target.id)
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Subscript) and is_layers(n.value.value):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}

    def is_layer(n):
        return (isinstance(n, ast.Subscript) and is_layers(n.value)) or (isinstance(n, ast.Name) and n.id in names)

    calls: dict[str, list[tuple[int, list[str]]]] = {}
    called = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_layer(n.func.value):
            called.add(id(n.func))
            args = [a for a in n.args if not isinstance(a, ast.Starred)]
            calls.setdefault(n.func.attr, []).append((len(args), [k.arg for k in n.keywords if k.arg is not None]))
    reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_layer(n.value) and id(n) not in called}
    return calls, reads


CALLS, READS = _layer_uses(cache_utils.Cache)


def _kv_layer_methods() -> list[str]:
    """The methods Cache calls on its layers that transformers' own key/value layers define (the rest
    belong to linear-attention and indexer layers, which Cache reaches after an isinstance or hasattr)."""
    return sorted(m for m in CALLS if any(callable(getattr(c, m, None)) for c in REFERENCE))


def test_cache_calls_methods_on_its_layers():
    # the reading above found the protocol (else every check below would pass on nothing)
    assert {"update", "get_seq_length", "get_mask_sizes", "crop", "reset"} <= set(_kv_layer_methods()), CALLS


@pytest.mark.parametrize("method", _kv_layer_methods())
def test_the_budget_layer_answers_each_method_cache_calls(method):
    defined = method in vars(BudgetLayer)
    assert defined, (f"transformers {transformers.__version__}: Cache calls layer.{method}(...) and its own "
                     f"{', '.join(c.__name__ for c in REFERENCE if hasattr(c, method))} define it, but BudgetLayer does not")
    ours = getattr(BudgetLayer, method)
    bad = []
    for ref in REFERENCE:
        if method in vars(ref):
            bad += _refusals(ours, vars(ref)[method], f"{ref.__name__}.{method}")
    sig = inspect.signature(ours)
    for npos, keywords in CALLS[method]:
        try:
            sig.bind(_Probe(), *[_Probe()] * npos, **dict.fromkeys(keywords, _Probe()))
        except TypeError as e:
            bad.append(f"Cache calls layer.{method} with {npos} positional and keywords {keywords}, "
                       f"but BudgetLayer.{method}{sig} refuses it: {e}")
    assert not bad, "\n".join(bad)


def test_the_budget_layer_has_every_attribute_cache_reads():
    layer = BudgetLayer([0], [1], sink=2, window=3, index=0)
    kv_attrs = READS & {a for c in REFERENCE for a in dir(c)} | READS & set(vars(cache_utils.DynamicLayer()))
    missing = sorted(a for a in kv_attrs if not hasattr(layer, a))
    assert not missing, f"transformers {transformers.__version__}: Cache reads {missing} on its layers; a BudgetLayer has none"
    assert kv_attrs, READS  # the reading found some


@pytest.mark.parametrize("method", sorted(m for m in vars(BudgetCache)
                                          if callable(vars(BudgetCache)[m]) and not m.startswith("_")
                                          and any(m in vars(c) for c in (cache_utils.Cache, cache_utils.DynamicCache))))
def test_the_budget_cache_accepts_what_cache_accepts(method):
    bad = []
    for base in (cache_utils.Cache, cache_utils.DynamicCache):
        if method in vars(base):
            bad += _refusals(getattr(BudgetCache, method), vars(base)[method], f"{base.__name__}.{method}")
    assert not bad, "\n".join(bad)


class _Toy:
    def __init__(self):
        self.layers = []

    def one(self, i):
        return self.layers[i].update(1, 2, *self.layers, scale=3, **{})

    def every(self):
        for layer in self.layers:
            layer.reset()
        return [layer.is_sliding for layer in self.layers] + [s.crop(0) for s in (self,)]


def test_the_reading_and_the_binding_see_what_they_should():
    calls, reads = _layer_uses(_Toy)
    assert calls == {"update": [(2, ["scale"])], "reset": [(0, [])]} and reads == {"is_sliding"}, (calls, reads)

    def theirs(self, key_states, value_states, *args, **kwargs): ...

    def renamed(self, k, v, *a, **kw): ...

    def fixed(self, key_states, value_states): ...

    def takes_nothing(self): ...

    def passes_on(self, **kwargs): ...

    assert not _refusals(renamed, theirs, "theirs")
    assert len(_refusals(fixed, theirs, "theirs")) == 2  # the extra positional, the extra keyword
    assert _refusals(takes_nothing, passes_on, "passes_on") and not _refusals(passes_on, passes_on, "passes_on")
