"""Choose a plan from bhqk's head statistics: score every layer × K/V head, keep the top fraction full.

Scores (each per query head from ``bhqk.capture`` on the fast path, then the max over a K/V head's
query heads — a K/V head's cache serves all of them, so it must stay full if any one of them reaches
far):

- ``induction``: on repeated random tokens (L tokens, then the same L; L = 64 by default), the
  attention mass from a token of the second copy on the token after its match in the first copy
  (offset L − 1): the ``induction (repeated)`` column of :func:`bhqk.inspect.detect`, with only the
  second copy's rows captured and no control run.
- ``retrieval`` (Wu et al., "Retrieval Head Mechanistically Explains Long-Context Factuality"): a
  needle of random tokens is placed at several depths of a random-token haystack and repeated at the
  end; over the repeated needle's steps where the model predicts the next needle token, the fraction
  in which the head's most-attended key is that token in the first needle (the token being copied).
- ``distant``: on real text (``pydoc_data.topics``, or ``texts``), the attention mass outside the
  window and off key 0: ``1 − local − sink`` (needs a tokenizer).

Causal scores (:mod:`bhqk.budget.scores`, :mod:`bhqk.budget.learn`), per K/V head directly (its query
heads share the K/V head's value): ``kl``, the divergence of the next-token distributions when that
head alone streams (one forward per K/V head); ``fisher``, its second-order estimate from one forward
and one backward through gates mixing each head's full and streaming outputs; ``learned``,
DuoAttention's gates trained on pass-key prompts (``steps=``, ``checkpoint=``, ``resume=``).

Ties. ``find`` ranks K/V heads by a list of keys (:func:`score_keys`), first to last, then by index
(layer · Hkv + head, lower first: earlier layers stay full). ``retrieval`` ties often: its top-1 key
lands on the needle for few heads (on SmolLM2-135M, 7 of its 90 K/V heads), so the tie order decides
most of a half plan. ``ties="index"`` (the default) keeps earlier layers full; ``ties="copy mass"``
adds a second key from the same forward, the attention weight on the token being copied, averaged
over every step of the repeated needle (copied correctly or not: the soft form of the top-1 hit).
On SmolLM2-135M's needle grid (1,024 … 8,192 tokens × 5 depths, docs/benchmarks.md) index ties found
12 of the 20 needles full attention's 13, copy-mass ties 10 (and a perplexity of 11.09 against 10.78
at 8k): earlier layers matter more to retrieval there than the heads that come close to copying.
``induction`` and ``distant`` are continuous masses and have no second key. ``Plan.decided()`` says
which key placed each head on its side of the cut.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..inspect.capture import capture
from ..inspect.heads import head_table
from ..integrations.hf_attention import parse_implementation
from ..integrations.model_map import ModelMap, model_map
from .plan import Plan
from .scores import CAUSAL, text_ids

SCORES = ("induction", "retrieval", "distant", *CAUSAL)


@contextlib.contextmanager
def _on_bhqk(model: Any) -> Iterator[None]:
    """The model runs bhqk's attention inside the block (statistics are captured from it)."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"find: scores a Hugging Face causal LM (it switches the model to bhqk's attention to capture "
                        f"its heads); got {type(model).__name__}. For bhqk's own models build the plan by hand: "
                        f"Plan(full=bool tensor [layers, Hkv], sink=, window=).")
    impl = getattr(model.config, "_attn_implementation", None)
    if parse_implementation(impl) is not None:
        yield
        return
    from ..integrations.transformers import register

    register()
    model.set_attn_implementation("bhqk")  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_attn_implementation(impl)  # type: ignore[operator]


def _induction(m: ModelMap, length: int, batch: int, seed: int) -> torch.Tensor:
    """Per query head [L, H]: P from each token of the second copy on the token after its match in the
    first copy (offset length − 1), on ``batch`` repeated random sequences (only those rows captured)."""
    dev, vocab = m.device, m.vocab_size
    low = min(100, vocab // 2)  # skip the first ids (special and byte tokens of real tokenizers)
    g = torch.Generator().manual_seed(seed)
    seg = torch.randint(low, vocab, (batch, length), generator=g)  # [B, L]
    x = torch.cat([seg, seg], 1)  # [B, 2L]
    with torch.no_grad(), capture(what=("sink",), offsets=(length - 1,), rows=range(length, 2 * length),
                                  model=m.model) as cap:
        m.model(input_ids=x.to(dev))
    return head_table(cap.records)[f"offset {length - 1}"]  # [L, H]


def _retrieval(m: ModelMap, length: int, batch: int, seed: int, needle: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head ([L, H] retrieval, [L, H] copy mass): the fraction of correctly copied needle
    tokens whose top-1 key is the token copied, and the mean weight on the token being copied over
    every step of the repeated needle (one forward)."""
    dev, vocab = m.device, m.vocab_size
    low = min(100, vocab // 2)
    g = torch.Generator().manual_seed(seed)
    hay = torch.randint(low, vocab, (batch, length), generator=g)  # [B, N]
    ndl = torch.randint(low, vocab, (batch, needle), generator=g)  # [B, m]
    depth = torch.linspace(0.1, 0.9, batch)  # one depth per sequence
    ids, src = [], []
    for b in range(batch):
        a = int(depth[b] * (length - needle))
        ids.append(torch.cat([hay[b, :a], ndl[b], hay[b, a:], ndl[b]]))  # [N + 2m]
        src.append(a)
    x = torch.stack(ids)  # [B, N + 2m]
    start = length + needle  # first row of the repeated needle
    rows = list(range(start, start + needle - 1))  # row start + j predicts needle token j + 1
    # row start + j copies the token at src + 1 + j: an offset of start − src − 1, one per sequence
    offsets = [start - a - 1 for a in src]
    with torch.no_grad(), capture(what=("topk",), topk=1, rows=rows, offsets=sorted(set(offsets)),
                                  model=m.model) as cap:
        logits = m.model(input_ids=x.to(dev)).logits  # [B, N + 2m, V]
    pred = logits[:, rows].argmax(-1).cpu()  # [B, m − 1]
    target = ndl[:, 1:]  # [B, m − 1]
    ok = (pred == target).double()  # [B, m − 1]: the steps where the model copies
    want = torch.tensor(src)[:, None] + torch.arange(1, needle)  # [B, m − 1] position of the token being copied
    L, H = len({r.name for r in cap.records}), None
    hits, mass = [], []
    for r in cap.records:
        assert r.topk_keys is not None
        top = r.topk_keys[..., 0].cpu()  # [B, h, m − 1]
        hit = (top == want[:, None]).double() * ok[:, None]  # [B, h, m − 1]
        H = r.sizes["H"]
        hits.append(hit.sum((0, 2)) / ok.sum().clamp(min=1))  # [h]
        on_copied = torch.stack([r.offset(o)[b].cpu() for b, o in enumerate(offsets)])  # [B, h, m − 1]
        mass.append(on_copied.double().mean((0, 2)))  # [h]
    assert H is not None and len(hits) == L
    return torch.stack(hits).float(), torch.stack(mass).float()  # [L, H], [L, H]


def _distant(m: ModelMap, tokenizer, texts, length: int, batch: int, window: int) -> torch.Tensor:
    if tokenizer is None:
        raise ValueError("find(score='distant') reads real text: pass tokenizer= (and optionally texts=).")
    x = text_ids(tokenizer, texts, length, batch)
    with torch.no_grad(), capture(what=("sink",), window=window, model=m.model) as cap:
        m.model(input_ids=x.to(m.device))
    table = cap.head_table()
    return (1 - table["local"] - table["sink"]).clamp(min=0).float()  # [L, H]


TIES = {"retrieval": "copy mass"}  # a score's optional second key (ties="copy mass"), from the same forward
TIE_ORDERS = ("index", "copy mass")


def score_keys(model: nn.Module | ModelMap, score: str = "induction", *, window: int = 256, tokenizer=None,
               texts: Sequence[str] | None = None, seed: int = 0, length: int | None = None,
               batch: int | None = None, ties: str = "index", sink: int = 64,
               **options: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The keys ``find`` ranks by, first to last: (name, per K/V head [L, Hkv] = max over its query
    heads, per query head [L, H]) — ``score``, then, with ``ties="copy mass"``, its second key
    (:data:`TIES`) where it has one. A causal score (:data:`CAUSAL`) is per K/V head; its per query
    head table repeats it. ``options``: the causal scores' own (:func:`bhqk.budget.scores.causal_scores`)."""
    if score not in SCORES:
        raise ValueError(f"find: score must be one of {SCORES}, got {score!r}.")
    if ties not in TIE_ORDERS:
        raise ValueError(f"find: ties must be one of {TIE_ORDERS}, got {ties!r}.")
    if ties == "copy mass" and score not in TIES:
        raise ValueError(f"find: ties='copy mass' orders the ties of score='retrieval'; score={score!r} has no "
                         f"second key (use ties='index').")
    if options and score not in CAUSAL:
        raise ValueError(f"find: {sorted(options)} are options of the causal scores {CAUSAL}, not of score={score!r}.")
    m = model_map(model)
    model = m.model
    L, H, Hkv = m.shape.layers, m.shape.heads, m.shape.kv_heads
    was = model.training
    model.eval()
    try:
        with _on_bhqk(model):
            if score == "induction":
                per_q = [_induction(m, length or 64, batch or 4, seed)]
            elif score == "retrieval":
                per_q = list(_retrieval(m, length or max(256, 4 * window), batch or 4, seed))
            elif score == "distant":
                per_q = [_distant(m, tokenizer, texts, length or max(512, 4 * window), batch or 4, window)]
            else:
                from .scores import causal_scores

                kv = causal_scores(m, score, sink=sink, window=window, tokenizer=tokenizer, texts=texts, seed=seed,
                                   length=length, batch=batch, **options)  # [L, Hkv]
                per_q = [kv.float().repeat_interleave(H // Hkv, dim=1)]  # [L, Hkv] -> [L, H]
    finally:
        model.train(was)
    out = []
    names = [score, TIES.get(score)] if ties == "copy mass" else [score]
    for name, t in zip(names, per_q):
        assert name is not None
        if tuple(t.shape) != (L, H):
            from ..errors import ShapeError

            raise ShapeError(f"find: captured {list(t.shape)} layer × head scores but the model has layers={L}, H={H}.")
        t = torch.nan_to_num(t, nan=0.0)
        out.append((name, t.reshape(L, Hkv, H // Hkv).amax(-1), t))  # [L, H] -> [L, Hkv, G] -> [L, Hkv]
    return out


def score_heads(model: nn.Module, score: str = "induction", **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(per K/V head [L, Hkv] = max over its query heads, per query head [L, H]) of ``score`` (the
    first key of :func:`score_keys`, which takes the same arguments)."""
    _, kv, per_q = score_keys(model, score, **kw)[0]
    return kv, per_q


def rank(keys: Sequence[torch.Tensor]) -> torch.Tensor:
    """The order of K/V heads, best first: by ``keys[0]`` [L, Hkv] descending, ties by ``keys[1]``
    and so on, then by index (layer · Hkv + head) ascending → int64 [L·Hkv] flat indices."""
    order = torch.arange(keys[0].numel())  # [L·Hkv]
    for k in reversed(keys):  # a stable sort per key, last key first: the first key decides, then the next
        flat = k.flatten()[order]  # [L·Hkv] in the current order
        order = order[torch.argsort(flat, descending=True, stable=True)]
    return order


def find(model: nn.Module | ModelMap, full: float = 0.5, sink: int = 64, window: int = 256, score: str = "fisher", *,
         tokenizer=None, texts: Sequence[str] | None = None, seed: int = 0, length: int | None = None,
         batch: int | None = None, ties: str = "index", **options: Any) -> Plan:
    """A plan for ``model`` (a Hugging Face causal LM) that keeps the top ``full`` fraction of the K/V
    heads whose choice matters by ``score`` full and streams the rest with ``sink`` + ``window``.
    The choice matters for a head whose layer lets a query see more than ``window`` + 1 keys (every
    head of a full-attention layer; a sliding or chunked layer's heads when its window is wider): a
    head whose layer's own window fits the streaming window keeps and sees the same keys either way,
    so it is kept full outside the fraction (``Plan.free``). ``score``: the default, ``fisher`` (one
    forward and one backward on real text: needs ``tokenizer``), chose best over SmolLM2-135M and Gemma 3
    270M together; ``learned`` (DuoAttention's gates, 20 steps) was best on SmolLM2 alone and worst on
    Gemma (docs/benchmarks.md, "The head-choice curve"); ``retrieval`` needs no tokenizer. ``ties``: ``"index"`` (earlier layers
    first) or ``"copy mass"`` (retrieval's second key, then index; module doc). ``length``, ``batch``:
    the probe sequences (defaults per score); ``tokenizer``/``texts``: for ``distant``, ``kl``,
    ``fisher`` and ``learned``; ``options``: the causal scores' own (``steps=``, ``checkpoint=``,
    ``resume=`` of ``learned``; :func:`bhqk.budget.scores.causal_scores`)."""
    if isinstance(full, bool) or not isinstance(full, (int, float)) or not 0 <= full <= 1:
        raise ValueError(f"find: full must be a fraction of the K/V heads in [0, 1], got {full!r}.")
    m = model_map(model)
    shape = m.shape
    L, Hkv = shape.layers, shape.kv_heads
    free = Plan(torch.zeros(L, Hkv, dtype=torch.bool), sink, window, model=shape).free().flatten()  # [L·Hkv]
    keys = score_keys(m, score, window=window, tokenizer=tokenizer, texts=texts, seed=seed,
                      length=length, batch=batch, ties=ties, sink=sink, **options)
    n = round(full * int((~free).sum()))
    order = rank([kv for _, kv, _ in keys])  # [L·Hkv] flat indices = layer·Hkv + head, best first
    mask = free.clone()  # [L·Hkv]
    mask[order[~free[order]][:n]] = True  # the best n of the heads whose choice matters
    tie = keys[1] if len(keys) > 1 else None
    return Plan(mask.reshape(L, Hkv), sink, window, keys[0][1], score, list(m.paths),  # [L·Hkv] -> [L, Hkv]
                {"fraction": full, "seed": seed, "ties": ties}, None if tie is None else tie[1],
                None if tie is None else tie[0], shape)


__all__ = ["find", "score_heads", "score_keys", "rank", "SCORES", "TIES", "TIE_ORDERS"]
