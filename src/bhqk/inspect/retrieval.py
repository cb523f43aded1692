"""Retrieval heads: which heads copy a needle out of the context (Wu et al. 2024, "Retrieval Head
Mechanistically Explains Long-Context Factuality").

While the model copies a needle (a span of the prompt), take each generated token w that is one of
the needle's tokens, and the query row that produced it (the position just before w). A head *hits*
when its most-attended key j (the argmax of its row of P) lies inside the needle and holds w
(``ids[j] == w``; a token that occurs twice in the needle may be copied from either place, as in the
paper). A head's retrieval score is hits / needle tokens copied, over every trial.

The answer is either teacher-forced (``answer=``) or the model's own greedy continuation; either way
the score is read from one forward over prompt + answer inside ``bhqk.capture(rows=..., topk=1)``:
only the copying rows' argmax keys are computed, tile by tile (never an eager [Q, K] matrix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..integrations.greedy import eos_ids, forward_logits, greedy
from .capture import capture
from .heads import HeadTable


def _one(x: torch.Tensor) -> torch.Tensor:
    """Token ids as [1, N]."""
    if x.dim() == 1:
        return x[None]
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"retrieval: ids must be [N] or [1, N] token ids (one trial), got {list(x.shape)}.")
    return x


def retrieval(model: nn.Module | Callable[[torch.Tensor], object], ids: torch.Tensor | Sequence[torch.Tensor],
              needle: tuple[int, int] | Sequence[tuple[int, int]], *,
              answer: torch.Tensor | Sequence[torch.Tensor] | None = None, max_new_tokens: int = 16,
              eos: Iterable[int] = (), names: nn.Module | None = None) -> HeadTable:
    """Every head's retrieval score (module docstring) while ``model`` copies a needle.

    ``ids``: a prompt [N] or [1, N] (or a list of prompts, one trial each); ``needle``: the needle's
    span ``(start, end)`` in the prompt (one per prompt). ``answer``: the tokens to teacher-force
    ([T], one per prompt); None: the model's greedy continuation (:func:`bhqk.integrations.greedy.greedy`:
    ``max_new_tokens``, cut at ``eos`` and the model's own end-of-sequence tokens). ``model(ids)`` must
    return logits (a tensor, a tuple or an output with ``.logits``) and run its attention through bhqk.
    ``names``: the module whose paths name the layers (default ``model``).

    Returns a :class:`HeadTable` [layers, heads] with column ``retrieval`` (hits / copied) and
    ``retrieval hits`` (the hit counts); ``notes`` say how many needle tokens were copied. A ValueError
    if no trial copied any needle token (the score is then undefined).
    """
    prompts: list[torch.Tensor]
    spans: list[tuple[int, int]]
    answers: list[torch.Tensor] | None
    if isinstance(ids, torch.Tensor):
        prompts, spans = [_one(ids)], [needle]  # type: ignore[list-item]
        answers = None if answer is None else [answer]  # type: ignore[list-item]
    else:
        prompts, spans = [_one(x) for x in ids], list(needle)  # type: ignore[arg-type]
        answers = None if answer is None else list(answer)
    if len(spans) != len(prompts) or (answers is not None and len(answers) != len(prompts)):
        raise ValueError(f"retrieval: {len(prompts)} prompts need as many needle spans (got {len(spans)})"
                         + ("" if answers is None else f" and answers (got {len(answers)})") + ".")
    if names is None and isinstance(model, nn.Module):
        names = model
    order: dict[str, int] = {}
    hits: dict[int, torch.Tensor] = {}  # layer index -> [H] hit counts
    H = 0
    copied = answered = 0
    for n, (x, span) in enumerate(zip(prompts, spans)):
        N = x.shape[1]
        s, e = int(span[0]), int(span[1])
        if not 0 <= s < e <= N:
            raise ValueError(f"retrieval: needle span ({s}, {e}) of trial {n} is not inside its prompt of N={N} tokens.")
        if answers is None:
            stop = {int(e) for e in eos} | eos_ids(model)
            gen = torch.tensor(greedy(model, x, max_new_tokens=max_new_tokens, eos=stop).tokens, device=x.device)
        else:
            gen = torch.as_tensor(answers[n]).reshape(-1).to(x.device)  # any shape -> [T]
        gen = gen.to(x.dtype)  # [T]
        T = gen.numel()
        answered += T
        need = x[0, s:e]  # [n_needle]
        copy = torch.isin(gen, need)  # [T]: generated tokens that are needle tokens
        if T == 0 or not bool(copy.any()):
            continue
        full = torch.cat([x, gen[None, :-1]], 1)  # [1, N + T − 1]: row N − 1 + t produces gen[t]
        steps = copy.nonzero().flatten()  # [c]
        rows = (steps + N - 1).tolist()
        copied += len(rows)
        with torch.no_grad(), capture(model=names, what=(), rows=rows, topk=1) as cap:
            forward_logits(model, full, True)  # a model whose attention does not run on bhqk: capture says so
        target = gen[steps]  # [c] the token each row copied
        for rec in cap.records:
            if rec.sizes["Q"] != full.shape[1]:
                continue  # not a self-attention call over the sequence (e.g. cross-attention)
            li = order.setdefault(rec.name, len(order))
            H = max(H, rec.sizes["H"])
            assert rec.topk_keys is not None and rec.real is not None  # capture(topk=1) computes both
            j = rec.topk_keys[0, :, :, 0]  # [h, c]: each row's most-attended key
            inside = (j >= s) & (j < e)  # [h, c]
            same = full[0, j.clamp(0, full.shape[1] - 1)] == target[None, :]  # [h, c]
            hit = (inside & same & rec.real[0].bool()).sum(1).double()  # [h]
            acc = hits.setdefault(li, torch.zeros(rec.sizes["H"], dtype=torch.float64))
            acc[rec.heads] += hit
    if copied == 0:
        raise ValueError(f"retrieval: no trial copied a needle token ({len(prompts)} trials, {answered} answer tokens); "
                         "the retrieval score is undefined. Check the needle spans, or teacher-force answer=.")
    counts = torch.full((len(order), H), float("nan"), dtype=torch.float64)  # [L, H]
    for li, v in hits.items():
        counts[li, : v.numel()] = v
    table = HeadTable(list(order), H, {"retrieval": counts / copied, "retrieval hits": counts})
    table.notes = {"retrieval": f"share of the {copied} copied needle tokens ({len(prompts)} trials) whose row's "
                                "most-attended key is that token inside the needle",
                   "retrieval hits": "copying rows whose argmax key is the copied needle token"}
    return table


__all__ = ["retrieval"]
