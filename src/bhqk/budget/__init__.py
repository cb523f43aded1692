"""Head-wise KV budgets (docs/design.md §2, "Per-head masks and budgets"): a :class:`Plan` says which
K/V heads of each layer keep every key (full) and which keep a sink and a recent window
(streaming); :func:`find` chooses it from bhqk's head statistics; ``plan.cache()`` is a transformers
``Cache`` that holds only what the plan keeps."""

from .cache import BudgetCache, GroupedKV
from .find import SCORES, find, score_heads
from .plan import Plan, streaming_mask

__all__ = ["Plan", "find", "score_heads", "SCORES", "BudgetCache", "GroupedKV", "streaming_mask"]
