"""Plans kept per mask object, for the backends that plan a call from its mask (tiled, spans)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

from ..masks import Dense, tensor_versions
from ..shortcuts import Shortcut, declare

if TYPE_CHECKING:
    from .problem import Problem

T = TypeVar("T")
KEPT = 16  # plans kept per mask (and without a mask); more: the oldest half is dropped


class PlanCache(Shortcut, Generic[T]):
    """Plans kept per mask object (every layer of a model shares one; a dense mask's per tensor, which
    callers hand to every layer and wrap anew at each call) and call key; its key, bound and
    invalidation are declared in :mod:`bhqk.shortcuts` (below)."""

    def __init__(self, name: str, what: str, plan_key: Callable[[Problem], Hashable]) -> None:
        super().__init__(
            name, what, "the mask object; the version of every tensor it holds and a predicate's key= "
            "(masks.tensor_versions); the call's sizes and options and the backend's plan_key(p)",
            f"{KEPT} plans per mask object, the older "
            "half dropped when full; kept while the mask object lives",
            "an in-place write into a tensor the mask holds (a new version); never kept for a predicate without "
            "key= or a mask holding an inference tensor")
        self._masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> {key: plan}
        self._unmasked: dict[Hashable, T] = {}
        self._epoch = 0  # clear(): a dense mask's own store is forgotten by a new epoch in the key
        self.plan_key = plan_key  # what the backend's plan depends on besides the mask and the call's sizes
        declare(self)

    def for_call(self, p: Problem, make: Callable[[], T]) -> T:
        """The plan of the call ``p``, kept per its mask and the call key: its sizes (B, H, Q, K),
        K/V heads and block options, and the backend's ``plan_key(p)``."""
        e = p.ext
        call = ((e.B, e.H, e.Q, e.K), p.sizes["Hkv"], p.options.get("block_q"), p.options.get("block_k"), self.plan_key(p))
        return self.get(p.mask, call, make)

    def get(self, mask, key: Hashable, make: Callable[[], T]) -> T:
        """The plan kept for (``mask``, ``key``), else ``make()``, kept."""
        versions = tensor_versions(mask) if self.on else None
        if versions is None:
            return make()
        if mask is None:
            store = self._unmasked
        elif isinstance(mask, Dense):
            store = mask._grids.setdefault(self.name, {})
        else:
            store = self._masks.setdefault(mask, {})
        full = (key, versions, self._epoch)
        plan = store.get(full)
        if plan is not None:
            self.hits += 1
        else:
            plan = make()
            if len(store) >= KEPT:
                for old in list(store)[: KEPT // 2]:
                    del store[old]
            store[full] = plan
        return plan

    def clear(self) -> None:
        self._masks = weakref.WeakKeyDictionary()
        self._unmasked.clear()
        self._epoch += 1


__all__ = ["KEPT", "PlanCache"]
