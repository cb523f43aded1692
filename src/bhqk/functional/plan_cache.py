"""Plans kept per mask object, for the backends that plan a call from its mask (tiled, spans)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

from ..masks import Dense, tensor_versions

if TYPE_CHECKING:
    from .problem import Problem

T = TypeVar("T")
KEPT = 16  # plans kept per mask (and without a mask); more: the oldest half is dropped


class PlanCache(Generic[T]):
    """Plans kept per mask object (every layer of a model shares one; a dense mask per tensor, which
    callers hand to every layer and wrap anew at each call) and call key, with the version of every
    tensor the mask holds in the key, so writing into it in place plans anew. A mask that holds an
    inference tensor (no version counter) is planned at every call. ``last``: the plan of the last
    problem planned is kept for that problem object (its ``hands_off``, ``share`` and ``run`` ask in
    turn within one call)."""

    def __init__(self, name: str, last: bool = False) -> None:
        self.name = name  # the key of a dense mask's own store (in its ``_grids``)
        self._masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> {key: plan}
        self._unmasked: dict[Hashable, T] = {}
        self._last: list | None = [None, None] if last else None  # [weakref to the last Problem planned, its plan]

    def for_call(self, p: Problem, key: Hashable, make: Callable[[], T]) -> T:
        """The plan of the call ``p``, kept per its mask and the call key: its sizes (B, H, Q, K),
        K/V heads and block options, and the backend's own ``key``."""
        if self._last is not None:
            ref, plan = self._last
            if ref is not None and ref() is p:
                return plan
        e = p.ext
        call = ((e.B, e.H, e.Q, e.K), p.sizes["Hkv"], p.options.get("block_q"), p.options.get("block_k"), key)
        plan = self.get(p.mask, call, make)
        if self._last is not None:
            self._last[:] = [weakref.ref(p), plan]
        return plan

    def get(self, mask, key: Hashable, make: Callable[[], T]) -> T:
        """The plan kept for (``mask``, ``key``), else ``make()``, kept."""
        versions = tensor_versions(mask)
        if versions is None:
            return make()
        if mask is None:
            store = self._unmasked
        elif isinstance(mask, Dense):
            store = mask._grids.setdefault(self.name, {})
        else:
            store = self._masks.setdefault(mask, {})
        full = (key, versions)
        plan = store.get(full)
        if plan is None:
            plan = make()
            if len(store) >= KEPT:
                for old in list(store)[: KEPT // 2]:
                    del store[old]
            store[full] = plan
        return plan


__all__ = ["KEPT", "PlanCache"]
