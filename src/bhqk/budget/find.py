"""Choose a plan: score every layer × K/V head, keep the top fraction full (:func:`find`).

A score is a small frozen dataclass (:class:`Score`): its fields are its options with their defaults,
its class says what it reads, and its one hook, :meth:`Score.tables`, returns its tables from the model
map — per query head [L, H] (statistics: ``find`` takes the max over a K/V head's query heads, since
the K/V head's cache serves all of them) or per K/V head [L, Hkv] (the causal scores of
:mod:`bhqk.budget.scores` and :mod:`bhqk.budget.learn`). :data:`SCORES` names them.

Ties: ``find`` ranks K/V heads by the score, then (``ties="copy mass"``) by the score's second key,
then by index (layer · Hkv + head, lower first: earlier layers stay full); ``Plan.decided()`` says
which key placed each head on its side of the cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ShapeError
from ..inspect.capture import capture
from ..inspect.heads import head_table
from ..integrations.hf_attention import parse_implementation
from ..integrations.model_map import ModelMap, model_map
from .plan import Plan, rank
from .scores import fisher_scores, kl_scores, text_ids


@contextlib.contextmanager
def _on_bhqk(model: Any) -> Iterator[None]:
    """The model runs bhqk's attention inside the block (statistics are captured from it)."""
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


@dataclass(frozen=True)
class Probe:
    """What every score may read besides its own options: the streaming heads' ``sink`` and ``window``,
    the ``tokenizer`` and ``texts`` (None: ``pydoc_data.topics``), the ``seed``, and ``progress`` (a line
    after each head or step of the long scores)."""

    sink: int
    window: int
    tokenizer: Any = None
    texts: Sequence[str] | None = None
    seed: int = 0
    progress: Callable[[str], None] | None = None


def option(default: Any, doc: str) -> Any:
    """A score's option: a dataclass field with its default and what it means (the command line's help)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Score:
    """A way to rank K/V heads. Subclasses set ``name``, ``reads`` (what needs a tokenizer: ``"real
    text"``, ``"pass-key prompts"``; None: no tokenizer), ``per_kv`` (tables per K/V head, not per query
    head), ``second`` (the name of a second key, for ``ties="copy mass"``) and ``gradients`` (takes
    gradients of gates: refused under ``torch.inference_mode()``), and implement :meth:`tables`."""

    name: ClassVar[str]
    reads: ClassVar[str | None] = None
    per_kv: ClassVar[bool] = False
    second: ClassVar[str | None] = None
    gradients: ClassVar[bool] = False

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        """The score's table and then its second key's where it has one: [L, H] each, or [L, Hkv] where
        ``per_kv``."""
        raise NotImplementedError

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    def check(self, probe: Probe) -> None:
        """A ``ValueError`` before any forward where the score cannot run as asked."""
        if self.reads is not None and probe.tokenizer is None:
            raise ValueError(f"find(score={self.name!r}) reads {self.reads}: pass tokenizer= (and optionally texts=); "
                             f"score='retrieval' reads none.")
        if self.gradients and torch.is_inference_mode_enabled():
            raise ValueError(f"find(score={self.name!r}) takes gradients of gates: call it outside "
                             f"torch.inference_mode() (torch.no_grad() is fine).")
        for f in self.options():
            v, low = getattr(self, f.name), 0 if f.name in ("steps", "until") else 1
            if "int" in str(f.type) and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"find(score={self.name!r}): {f.name} must be a whole number >= {low}, got {v!r}.")


def _low(vocab: int) -> int:
    """The lowest random token id: skip the first ids (special and byte tokens of real tokenizers)."""
    return min(100, vocab // 2)


@dataclass(frozen=True)
class Induction(Score):
    """Attention from the second copy of ``length`` repeated random tokens to the token after its match
    (offset ``length`` − 1): the ``induction (repeated)`` column of :func:`bhqk.inspect.detect`."""

    name: ClassVar[str] = "induction"
    length: int = option(64, "tokens of each copy")
    batch: int = option(4, "sequences")

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        length = self.length
        vocab = m.vocab_size
        g = torch.Generator().manual_seed(probe.seed)
        seg = torch.randint(_low(vocab), vocab, (self.batch, length), generator=g)  # [B, L]
        x = torch.cat([seg, seg], 1)  # [B, 2L]
        with torch.no_grad(), capture(what=("sink",), offsets=(length - 1,), rows=range(length, 2 * length),
                                      model=m.model) as cap:  # only the second copy's rows
            m.model(input_ids=x.to(m.device))
        return [head_table(cap.records)[f"offset {length - 1}"]]  # [L, H]


@dataclass(frozen=True)
class Retrieval(Score):
    """Wu et al., "Retrieval Head Mechanistically Explains Long-Context Factuality": random-token needles at
    several depths of a random-token haystack, repeated at the end; over the steps where the model copies
    the next needle token, how often the head's most-attended key is that token. Its second key, ``copy
    mass``, is the attention weight on the token being copied over every step."""

    name: ClassVar[str] = "retrieval"
    second: ClassVar[str | None] = "copy mass"
    length: int | None = option(None, "haystack tokens (None: max(256, 4 · window))")
    batch: int = option(4, "sequences")
    needle: int = option(16, "needle tokens")

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        length, batch, needle = self.length or max(256, 4 * probe.window), self.batch, self.needle
        dev, vocab = m.device, m.vocab_size
        low = _low(vocab)
        g = torch.Generator().manual_seed(probe.seed)
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
        return [torch.stack(hits).float(), torch.stack(mass).float()]  # [L, H] retrieval, [L, H] copy mass


@dataclass(frozen=True)
class Distant(Score):
    """Attention mass outside the window and off key 0, on real text."""

    name: ClassVar[str] = "distant"
    reads: ClassVar[str | None] = "real text"
    length: int | None = option(None, "tokens of text per sequence (None: max(512, 4 · window))")
    batch: int = option(4, "sequences")

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        x = text_ids(probe.tokenizer, probe.texts, self.length or max(512, 4 * probe.window), self.batch)  # [B, N]
        with torch.no_grad(), capture(what=("sink",), window=probe.window, model=m.model) as cap:
            m.model(input_ids=x.to(m.device))
        table = cap.head_table()
        return [(1 - table["local"] - table["sink"]).clamp(min=0).float()]  # [L, H]


@dataclass(frozen=True)
class KL(Score):
    """The next-token KL of streaming each K/V head alone (one forward per head; :func:`kl_scores`)."""

    name: ClassVar[str] = "kl"
    reads: ClassVar[str | None] = "real text"
    per_kv: ClassVar[bool] = True
    length: int = option(2048, "tokens of text per sequence")
    batch: int = option(1, "sequences")

    def ids(self, m: ModelMap, probe: Probe) -> torch.Tensor:
        return text_ids(probe.tokenizer, probe.texts, self.length, self.batch).to(m.device)  # [B, N]

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        return [kl_scores(m, self.ids(m, probe), probe.sink, probe.window, progress=probe.progress)]


@dataclass(frozen=True)
class Fisher(KL):
    """The KL of streaming each K/V head to second order: one forward and one backward (:func:`fisher_scores`)."""

    name: ClassVar[str] = "fisher"
    gradients: ClassVar[bool] = True

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        ids = self.ids(m, probe)
        with torch.enable_grad():  # one backward, whatever the caller's grad mode
            return [fisher_scores(m, ids, probe.sink, probe.window, probe.seed)]


@dataclass(frozen=True)
class Learned(Score):
    """DuoAttention's gates after ``steps`` steps on pass-key prompts (:func:`bhqk.budget.learn.train_gates`;
    ``checkpoint``: written as it trains; ``resume``: a run to continue)."""

    name: ClassVar[str] = "learned"
    reads: ClassVar[str | None] = "pass-key prompts"
    per_kv: ClassVar[bool] = True
    gradients: ClassVar[bool] = True
    length: int = option(1024, "tokens of each pass-key prompt")
    steps: int = option(20, "training steps")
    checkpoint: str | Path | None = option(None, "a file the gates and optimizer are written to as it trains")
    resume: str | Path | None = option(None, "a checkpoint to continue from (same settings)")
    keys: int = option(2, "pass keys per prompt")
    words: int = option(8, "words per pass key")
    lr: float = option(0.02, "learning rate")
    reg: float = option(0.05, "weight of the gates' L1 pull towards streaming")
    every: int = option(10, "steps between checkpoints")
    until: int | None = option(None, "stop after this step (the schedule still spans steps)")

    def tables(self, m: ModelMap, probe: Probe) -> list[torch.Tensor]:
        from .learn import train_gates

        say = probe.progress
        with torch.enable_grad():  # the gates train whatever the caller's grad mode (a torch.no_grad() around find)
            run = train_gates(m, probe.tokenizer, probe.sink, probe.window, self.steps, length=self.length,
                              keys=self.keys, words=self.words, seed=probe.seed, lr=self.lr, reg=self.reg,
                              checkpoint=self.checkpoint, resume=self.resume, every=self.every, until=self.until,
                              progress=None if say is None else lambda i, r: say(
                                  f"learned: step {i}/{self.steps}: distillation {r['distill']:.4g}, mean gate "
                                  f"{r['mean gate']:.3f} ({r['seconds']:.1f} s)"))
        return [run.gates.double()]


SCORES: dict[str, type[Score]] = {c.name: c for c in (Induction, Retrieval, Distant, KL, Fisher, Learned)}
TIE_ORDERS = ("index", "copy mass")


def make_score(score: str | Score, **options: Any) -> Score:
    """``score`` as a :class:`Score`: a name of :data:`SCORES` with ``options`` (its fields; None: the
    default), or a Score as it is (then no options)."""
    if isinstance(score, Score):
        if options:
            raise ValueError(f"find: {sorted(options)} are given twice: set them on the score ({score!r}).")
        return score
    if score not in SCORES:
        raise ValueError(f"find: score must be one of {tuple(SCORES)}, got {score!r}.")
    cls = SCORES[score]
    known = {f.name for f in cls.options()}
    bad = sorted(k for k, v in options.items() if k not in known and v is not None)
    if bad:
        owners = {k: [n for n, c in SCORES.items() if k in {f.name for f in c.options()}] for k in bad}
        raise ValueError(f"find(score={score!r}): {bad} are not its options ({', '.join(sorted(known)) or 'none'}); "
                         + "; ".join(f"{k} belongs to {' and '.join(repr(o) for o in v) or 'no score'}"
                                     for k, v in owners.items()) + ".")
    return cls(**{k: v for k, v in options.items() if v is not None})


def score_keys(model: nn.Module | ModelMap, score: str | Score = "fisher", *, sink: int = 64, window: int = 256,
               tokenizer=None, texts: Sequence[str] | None = None, seed: int = 0, ties: str = "index",
               progress: Callable[[str], None] | None = None,
               **options: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The keys ``find`` ranks by, first to last: (name, per K/V head [L, Hkv], per query head [L, H]) —
    the score, then, with ``ties="copy mass"``, its second key. A per-query-head table's K/V head value
    is the max over its query heads; a per-K/V-head table's query heads repeat it. ``options``: the
    score's fields (:func:`make_score`)."""
    sc = make_score(score, **options)
    if ties not in TIE_ORDERS:
        raise ValueError(f"find: ties must be one of {TIE_ORDERS}, got {ties!r}.")
    if ties == "copy mass" and sc.second is None:
        raise ValueError(f"find: ties='copy mass' orders the ties of score='retrieval'; score={sc.name!r} has no "
                         f"second key (use ties='index').")
    m = model_map(model)
    if not hasattr(m.model, "set_attn_implementation"):
        raise TypeError(f"find: scores a Hugging Face causal LM (it switches the model to bhqk's attention to capture "
                        f"its heads); got {type(m.model).__name__}. For bhqk's own models build the plan by hand: "
                        f"Plan(full=bool tensor [layers, Hkv], sink=, window=).")
    probe = Probe(sink, window, tokenizer, texts, seed, progress)
    sc.check(probe)
    L, H, Hkv = m.shape.layers, m.shape.heads, m.shape.kv_heads
    was = m.model.training
    m.model.eval()
    try:
        with _on_bhqk(m.model):
            tables = sc.tables(m, probe)
    finally:
        m.model.train(was)
    out = []
    names = [sc.name, sc.second] if ties == "copy mass" else [sc.name]
    for name, t in zip(names, tables):
        assert name is not None
        if sc.per_kv:
            t = t.float().repeat_interleave(H // Hkv, dim=1)  # [L, Hkv] -> [L, H]
        if tuple(t.shape) != (L, H):
            raise ShapeError(f"find: captured {list(t.shape)} layer × head scores but the model has layers={L}, H={H}.")
        t = torch.nan_to_num(t, nan=0.0)
        out.append((name, t.reshape(L, Hkv, H // Hkv).amax(-1), t))  # [L, H] -> [L, Hkv, G] -> [L, Hkv]
    return out


def find(model: nn.Module | ModelMap, full: float = 0.5, sink: int = 64, window: int = 256,
         score: str | Score = "fisher", *, tokenizer=None, texts: Sequence[str] | None = None, seed: int = 0,
         ties: str = "index", progress: Callable[[str], None] | None = None, **options: Any) -> Plan:
    """A plan for ``model`` (a Hugging Face causal LM) that keeps the top ``full`` fraction of the K/V
    heads whose choice matters by ``score`` full and streams the rest with ``sink`` + ``window``.
    The choice matters for a head whose layer lets a query see more than ``window`` + 1 keys (every
    head of a full-attention layer; a sliding or chunked layer's heads when its window is wider): a
    head whose layer's own window fits the streaming window keeps and sees the same keys either way,
    so it is kept full outside the fraction (``Plan.free``). ``score``: a name of :data:`SCORES` (default
    ``fisher``: one forward and one backward on real text, needs ``tokenizer``; ``retrieval`` needs
    none) or a :class:`Score`; ``options``: its fields (``length=``, ``batch=``, ``steps=`` …);
    ``ties``: ``"index"`` or ``"copy mass"`` (module doc); ``texts``: the text the scores that read real
    text read (default ``pydoc_data.topics``); ``progress``: a line after each head or step."""
    if isinstance(full, bool) or not isinstance(full, (int, float)) or not 0 <= full <= 1:
        raise ValueError(f"find: full must be a fraction of the K/V heads in [0, 1], got {full!r}.")
    m = model_map(model)
    shape = m.shape
    L, Hkv = shape.layers, shape.kv_heads
    free = Plan(torch.zeros(L, Hkv, dtype=torch.bool), sink, window, model=shape).free().flatten()  # [L·Hkv]
    keys = score_keys(m, score, sink=sink, window=window, tokenizer=tokenizer, texts=texts, seed=seed, ties=ties,
                      progress=progress, **options)
    tie = keys[1] if len(keys) > 1 else None
    return Plan(free.reshape(L, Hkv), sink, window, keys[0][1], keys[0][0], list(m.paths),  # [L·Hkv] -> [L, Hkv]
                {"fraction": full, "seed": seed, "ties": ties}, None if tie is None else tie[1],
                None if tie is None else tie[0], shape).top(round(full * int((~free).sum())))


__all__ = ["find", "score_keys", "rank", "make_score", "Score", "Probe", "SCORES", "TIE_ORDERS", "Induction",
           "Retrieval", "Distant", "KL", "Fisher", "Learned"]
