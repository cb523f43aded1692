"""Head statistics from captured weights: per call and head, how spread out attention is, how far it
looks, and how much of it lands on the first token and on special tokens such as [CLS] and [SEP].

Every number is a mean over the captured query rows that may attend somewhere (fully masked rows,
whose weights are all 0, are left out) of one batch element.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..text import table


class _Record(Protocol):  # what head_stats reads of a capture record (capture.py imports this module, not back)
    index: int
    name: str
    heads: list[int]
    weights: torch.Tensor | None

    @property
    def query_positions(self) -> list[int]: ...


class _Capture(Protocol):
    records: list  # of _Record


@dataclass
class HeadStats:
    """Statistics of one head of one captured call."""

    index: int  # call index
    name: str
    head: int
    entropy: float  # nats: mean of −Σ_k P log P over rows; 0 = one key, log K = uniform
    distance: float  # mean of Σ_k P·|i − k| over rows (query i sits at key position i)
    first: float  # mean weight on key 0
    special: dict[str, float] = field(default_factory=dict)  # token string -> mean weight on keys with that string


def weight_stats(P: torch.Tensor, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy [h], distance [h], first [h], valid rows [r]) for weights P [h, r, K] whose rows are
    queries at ``positions``."""
    P = P.double()
    valid = P.sum(-1) > 0  # [h, r]: rows that may attend somewhere
    ent = -(P * torch.log(torch.where(P > 0, P, 1.0))).sum(-1)  # [h, r]
    qpos = torch.tensor(positions, dtype=P.dtype)[:, None]  # [r, 1]
    kpos = torch.arange(P.shape[-1], dtype=P.dtype)[None, :]  # [1, K]
    dist = (P * (qpos - kpos).abs()).sum(-1)  # [h, r]
    first = P[..., 0]  # [h, r]
    n = valid.sum(-1).clamp(min=1)  # [h]

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, 0.0).sum(-1) / n  # [h]

    return mean(ent), mean(dist), mean(first), valid


def head_stats(cap: _Capture, tokens: Sequence[str] | None = None, *, b: int = 0,
               special: Iterable[str] = ("[CLS]", "[SEP]")) -> list[HeadStats]:
    """One :class:`HeadStats` per captured (call, head) of batch element ``b``. ``tokens``: the key
    tokens as strings (one per key); with them, the share on each ``special`` token is reported."""
    special = tuple(special)
    out: list[HeadStats] = []
    for rec in cap.records:
        if rec.weights is None:
            raise KeyError("head statistics need the weights: capture(what=(..., 'weights')).")
        P = rec.weights[b]  # [h, r, K]
        K = P.shape[-1]
        ent, dist, first, valid = weight_stats(P, rec.query_positions)
        shares: dict[str, torch.Tensor] = {}
        if tokens is not None:
            if len(tokens) != K:
                raise ValueError(f"{len(tokens)} tokens given but call {rec.name!r} has K={K} keys; pass one token per key.")
            for s in special:
                on = torch.tensor([t == s for t in tokens])  # [K]
                share = P.double()[..., on].sum(-1)  # [h, r]
                shares[s] = torch.where(valid, share, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)  # [h]
        for i, h in enumerate(rec.heads):
            out.append(HeadStats(rec.index, rec.name, h, float(ent[i]), float(dist[i]), float(first[i]),
                                 {s: float(v[i]) for s, v in shares.items()}))
    return out


def summary_table(stats: Sequence[HeadStats], special: Sequence[str] = ()) -> str:
    """A Markdown table: one row per (call, head)."""
    if not stats:
        return "capture: no heads recorded"
    header = ["#", "call", "head", "entropy (nats)", "mean distance", "on first"] + [f"on {s}" for s in special]
    rows = [[s.index, s.name, s.head, f"{s.entropy:.3f}", f"{s.distance:.2f}", f"{s.first:.3f}"]
            + [f"{s.special.get(t, 0.0):.3f}" for t in special] for s in stats]
    return table(header, rows)
