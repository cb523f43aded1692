"""Head-wise KV budgets (docs/design.md §2, "Per-head masks and budgets"; §9): a :class:`Plan` says
which K/V heads of each layer keep every key (full) and which keep a sink and a recent window
(streaming); :func:`find` chooses it from bhqk's head statistics or from how much streaming a head
changes the output (:mod:`bhqk.budget.scores`: ``kl``, ``fisher``; :mod:`bhqk.budget.learn`: ``learned``,
through the gates of :mod:`bhqk.budget.gate`); ``plan.cache()`` is a transformers
``Cache`` that holds only what the plan keeps (:mod:`bhqk.budget.cache`, imported on first use:
it imports transformers); ``plan.kv_cache()`` is bhqk's own models' (:mod:`bhqk.budget.ring`)."""

from __future__ import annotations

from typing import Any

from .find import SCORES, Score, find, make_score
from .mask import streaming_mask
from .plan import ModelMap, ModelShape, Plan, model_map


def __getattr__(name: str) -> Any:
    if name in ("BudgetCache", "GroupedKV"):
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'bhqk.budget' has no attribute {name!r}")


# BudgetCache, GroupedKV: bhqk.budget.cache
__all__ = ["Plan", "ModelShape", "ModelMap", "model_map", "find", "make_score", "Score", "SCORES", "streaming_mask"]
