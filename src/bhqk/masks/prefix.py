"""Prefix-LM: the first ``prefix_len`` keys are visible to every query, the rest causally.

``prefix_lm(2)`` at Q = K = 4::

    ■ ■ · ·
    ■ ■ · ·
    ■ ■ ■ ·
    ■ ■ ■ ■
"""

from __future__ import annotations

import torch

from . import args
from .base import Or
from .causal import Causal
from .padding import KeysBelow


class PrefixLM(Or):
    def __init__(self, prefix_len: int | list[int] | torch.Tensor, align: str | None = None) -> None:
        prefix = KeysBelow(prefix_len, "prefix_lm", "prefix_len")
        super().__init__(prefix, Causal(args.alignment("prefix_lm", align)))
        self.prefix_len, self.align = prefix.limit, align

    def natural_size(self):
        return None

    def __repr__(self) -> str:
        p = self.prefix_len.tolist() if isinstance(self.prefix_len, torch.Tensor) else self.prefix_len
        a = "" if self.align is None else f", align={self.align!r}"
        return f"prefix_lm({p}{a})"


def prefix_lm(prefix_len: int | list[int] | torch.Tensor, align: str | None = None) -> PrefixLM:
    """Bidirectional over a prefix (an int or per-batch ``[B]``), causal after it."""
    return PrefixLM(prefix_len, align)
