"""Shortcuts: every path that answers a call from something cheaper than computing it afresh.

A *cache* keeps what one call worked out (checked sizes, a claim, a plan, call masks, measured
costs) for a later call with the same key; a *fast path* computes a call another way (a decode
step's G query heads packed as G queries of one K/V head). Each is declared here, once, with what
its key holds, its bound and what invalidates it (the table in docs/design.md, "Caches"), and
:func:`off` turns any of them off inside a ``with`` block, so every one is tested against the path
without it (``tests/test_grid_shortcuts.py`` runs each declared shortcut; a new one joins by being
declared here and registering a case there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Shortcut:
    """A declared shortcut: ``name``; ``what`` it saves; ``key``: what its answer is keyed on (for a
    fast path: when it applies); ``bound``: how much it keeps; ``invalidation``: what makes it answer
    afresh."""

    def __init__(self, name: str, what: str, key: str, bound: str, invalidation: str) -> None:
        self.name, self.what, self.key, self.bound, self.invalidation = name, what, key, bound, invalidation
        self.hits = 0  # calls it answered (a cache hit, a fast path taken): what tests check it was exercised by
        self.on = True  # False inside ``off()`` (all, or this one by name); an attribute ``off`` sets: read at every call

    def clear(self) -> None:
        """Forget what is kept (nothing, for a fast path)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Cache(Shortcut, Generic[T]):
    """A keyed store of at most ``size`` entries; when full, the older half is dropped (a long
    generation makes a new key per step: it keeps caching)."""

    def __init__(self, name: str, what: str, key: str, size: int, invalidation: str) -> None:
        super().__init__(name, what, key, f"{size} entries; the older half dropped when full", invalidation)
        self.size = size
        self._store: dict[Hashable, T] = {}

    def lookup(self, key: Hashable) -> T | None:
        """The value kept for ``key`` (None: none, or turned off; an unhashable key keeps nothing)."""
        if not self.on:
            return None
        try:
            hit = self._store.get(key)
        except TypeError:  # a part of the key that is no value (an option holding a list)
            return None
        if hit is not None:
            self.hits += 1
        return hit

    def put(self, key: Hashable, value: T) -> None:
        if not self.on:
            return
        try:
            hash(key)
        except TypeError:  # never kept
            return
        if len(self._store) >= self.size:
            for old in list(self._store)[: max(1, self.size // 2)]:
                del self._store[old]
        self._store[key] = value

    def clear(self) -> None:
        self._store.clear()

    def __len__(self) -> int:
        return len(self._store)


class Store(Shortcut):
    """A store its owner reads and writes itself (a dict, a ``WeakKeyDictionary``), declared here for
    its key, bound and invalidation; its owner checks :attr:`on` and counts :attr:`hits`.
    :meth:`clear` calls ``forget`` (default: empties ``store``)."""

    def __init__(self, name: str, what: str, key: str, bound: str, invalidation: str, store: Any,
                 forget: Callable[[], None] | None = None) -> None:
        super().__init__(name, what, key, bound, invalidation)
        self.store = store
        self._forget = forget

    def clear(self) -> None:
        if self._forget is not None:
            self._forget()
        else:
            self.store.clear()


_DECLARED: dict[str, Shortcut] = {}
_OFF: dict[str | None, int] = {None: 0}  # None: all off; a name: that one off (nesting depth)


def declare(s: Shortcut) -> Shortcut:
    """Add ``s`` to the declared shortcuts (its name must be new)."""
    if s.name in _DECLARED and _DECLARED[s.name] is not s:
        raise ValueError(f"a shortcut named {s.name!r} is already declared.")
    _DECLARED[s.name] = s
    s.on = not (_OFF[None] or _OFF.get(s.name))
    return s


def _set_on() -> None:
    """Every declared shortcut's ``on`` from the ``off()`` blocks open now."""
    for s in _DECLARED.values():
        s.on = not (_OFF[None] or _OFF.get(s.name))


def declared() -> dict[str, Shortcut]:
    """Every declared shortcut by name (the modules that declare them imported)."""
    return dict(_DECLARED)


@contextlib.contextmanager
def off(*names: str) -> Iterator[None]:
    """Inside the block, the named shortcuts (none named: all) answer afresh: caches neither read nor
    keep, fast paths are not taken."""
    bad = [n for n in names if n not in _DECLARED]
    if bad:
        raise ValueError(f"unknown shortcut(s) {bad}; declared: {sorted(_DECLARED)}.")
    keys: tuple[str | None, ...] = names or (None,)
    for k in keys:
        _OFF[k] = _OFF.get(k, 0) + 1
    _set_on()
    try:
        yield
    finally:
        for k in keys:
            _OFF[k] -= 1
        _set_on()


def clear() -> None:
    """Forget what every declared cache keeps."""
    for s in _DECLARED.values():
        s.clear()


__all__ = ["Cache", "Shortcut", "Store", "clear", "declare", "declared", "off"]
