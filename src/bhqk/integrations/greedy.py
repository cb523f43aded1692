"""The one greedy decoding loop: grading (:func:`bhqk.evaluate.grade.reply`), the needle grid
(:func:`bhqk.evaluate.needle.ask`), retrieval heads (:func:`bhqk.inspect.retrieval.retrieval`) and
``benchmarks/kvpress_needle.py`` all answer with :func:`greedy`, and stop at :func:`eos_ids`.

A Hugging Face causal LM: one prefill of the whole prompt (``logits_to_keep=1``) into ``cache`` (None:
the model's own, ``DynamicCache(config=model.config)``), then one token at a time at its true position
(``position_ids`` N, N + 1, …: right even when the cache holds fewer positions than it has seen, as a
press that evicts keys leaves it). Any other model (bhqk's own, a function of ids returning logits):
one whole forward per new token, no cache. Either way the argmax of the last row's logits, until a
token of ``eos`` (not included) or ``max_new_tokens`` tokens.

This file imports nothing of bhqk at load time (the cache keyword is looked up only when the caller
does not give it), so ``benchmarks/kvpress_needle.py`` loads it by path in kvpress's environment.
"""

from __future__ import annotations

import contextlib
import inspect as _inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Reply:
    """What :func:`greedy` produced: the new ``tokens`` (no end token), the seconds of the prefill and of
    the decoding, and the ``cache`` it ran on (None for a model without one)."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    cache: Any = field(default=None, repr=False)


def eos_ids(model, tok=None) -> set[int]:
    """The tokens that end a reply: the model's ``generation_config.eos_token_id`` (one or a list) and the
    tokenizer's ``eos_token_id`` where given."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])}
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return ids


def _logits(out) -> torch.Tensor:
    """A forward's logits [B, N, V] from a tensor, a tuple (logits first) or an object with ``.logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def forward_logits(model, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    """``model(ids)``'s logits; with ``last_only`` those of the last position only where the model can skip
    the others (Hugging Face's ``logits_to_keep``): [B, N or 1, V]."""
    kw = {}
    if last_only:
        try:
            if "logits_to_keep" in _inspect.signature(model.forward).parameters:
                kw["logits_to_keep"] = 1
        except (TypeError, ValueError, AttributeError):
            pass
    return _logits(model(ids, **kw))


def greedy(model, ids: torch.Tensor | list[int], cache: Any = None, *, max_new_tokens: int, eos: Iterable[int] = (),
           keyword: str | None = None, prefill: Callable[[], Any] | None = None,
           after_prefill: Callable[[Any], Any] | None = None) -> Reply:
    """The greedy continuation of ``ids`` ([N] or [1, N]; module doc). ``cache``: a transformers ``Cache``
    to run on (None: the model's own); ``keyword``: the name ``forward`` takes it by (None:
    :func:`bhqk.integrations.model_map.cache_keyword`); ``prefill``: a context-manager factory entered
    around the prefill only (e.g. a kvpress press); ``after_prefill(cache)``: called once the prompt is
    in the cache (e.g. to measure it)."""
    x = torch.as_tensor(ids, dtype=torch.long)
    x = x[None] if x.dim() == 1 else x  # [1, N]
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"greedy: ids must be [N] or [1, N] token ids (one sequence), got {list(x.shape)}.")
    stop = {int(e) for e in eos}
    new: list[int] = []
    n = x.shape[1]
    with torch.no_grad():
        t0 = time.perf_counter()
        if hasattr(model, "generation_config") and hasattr(model, "config"):  # a Hugging Face causal LM
            if cache is None:
                from transformers import DynamicCache

                cache = DynamicCache(config=model.config)
            if keyword is None:
                from .model_map import cache_keyword

                keyword = cache_keyword(model)
            kw = {keyword: cache}
            with prefill() if prefill is not None else contextlib.nullcontext():
                out = model(input_ids=x, use_cache=True, logits_to_keep=1, **kw)
            nxt = int(out.logits[0, -1].argmax())
            if after_prefill is not None:
                after_prefill(cache)

            def step() -> int:  # the last new token, at its true position, over the cache
                out = model(input_ids=torch.tensor([[new[-1]]], device=x.device), use_cache=True,
                            position_ids=torch.tensor([[n + len(new) - 1]], device=x.device), **kw)  # [1, 1]
                return int(out.logits[0, -1].argmax())
        else:
            if cache is not None:
                raise TypeError(f"greedy: {type(model).__name__} is not a Hugging Face causal LM; it runs without a cache.")
            nxt = int(forward_logits(model, x, True)[0, -1].argmax())

            def step() -> int:  # one whole forward over the prompt and the new tokens
                cur = torch.cat([x, torch.tensor([new], dtype=x.dtype, device=x.device)], 1)  # [1, N + t]
                return int(forward_logits(model, cur, True)[0, -1].argmax())
        t1 = time.perf_counter()
        while nxt not in stop and len(new) < max_new_tokens:
            new.append(nxt)
            if len(new) == max_new_tokens:
                break
            nxt = step()
        return Reply(new, t1 - t0, time.perf_counter() - t1, cache)


__all__ = ["greedy", "eos_ids", "Reply", "forward_logits"]
