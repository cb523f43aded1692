"""Export captured weights to what bertviz's ``head_view`` / ``model_view`` take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import ShapeError
from .labels import check_tokens

if TYPE_CHECKING:
    from ..inspect.capture import Capture


def to_bertviz(cap: Capture, tokens: Sequence[str], *, b: int = 0) -> tuple[list[torch.Tensor], list[str]]:
    """(attention, tokens) for ``bertviz.head_view(attention, tokens)``: one float32 tensor
    [1, H, L, L] per captured call, in call order. Needs every head and every query row captured."""
    attention = []
    for rec in cap.records:
        s = rec.sizes
        if rec.weights is None or len(rec.heads) != s["H"] or rec.rows is not None:
            raise ValueError(f"bertviz needs the weights of every head and row; call {rec.name!r} has "
                             f"{rec.shape('weights')}. Capture with heads=None, rows=None.")
        if s["Q"] != s["K"]:
            raise ShapeError(f"bertviz's head_view takes self-attention over the tokens: call {rec.name!r} has "
                             f"Q={s['Q']}, K={s['K']}.")
        check_tokens("to_bertviz", tokens, s["K"], axis="K", call=rec.name)
        attention.append(rec.weights[b : b + 1].float().cpu())  # [B, H, Q, K] -> [1, H, L, L]
    return attention, list(tokens)
