"""Head detectors: run a model on a repeated random sequence and on a non-repeating control, and
score every head for the usual roles (see :mod:`bhqk.inspect.heads` for the columns)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .capture import capture
from .heads import HeadTable, head_table


def detect(forward: Callable[[torch.Tensor], object], vocab: int, *, length: int = 20, batch: int = 4,
           window: int = 4, prefix: Sequence[int] = (), positions: Sequence[int] = (), seed: int = 0,
           model: torch.nn.Module | None = None, low: int = 0) -> HeadTable:
    """Score every head of ``forward(ids [B, N])`` for the roles of the module docstring.

    Runs a repeated random sequence (``prefix`` + L random tokens + the same L again, L = ``length``,
    tokens drawn from [low, vocab)) and a control (``prefix`` + 2L random tokens), ``batch`` of each.
    ``model``: names layers by module path. Columns: entropy, distance, sink, local, prev (control
    sequence), induction (repeated minus control), induction (repeated), induction (control)."""
    g = torch.Generator().manual_seed(seed)
    P0 = len(prefix)
    seg = torch.randint(low, vocab, (batch, length), generator=g)  # [B, L]
    pre = torch.tensor(list(prefix), dtype=torch.long).expand(batch, P0)  # [B, P0]
    rep = torch.cat([pre, seg, seg], 1)  # [B, P0 + 2L]
    ctl = torch.cat([pre, torch.randint(low, vocab, (batch, 2 * length), generator=g)], 1)  # [B, P0 + 2L]
    tables = {}
    for key, ids in (("rep", rep), ("ctl", ctl)):
        with torch.no_grad(), capture(model=model, what=("entropy", "distance", "sink", "received"),
                                      offsets=(1, length - 1) if length > 2 else (1,), window=window) as cap:
            forward(ids)
        tables[key] = (head_table(cap.records, positions), head_table(cap.records, (), rows=slice(P0 + length, None))
                       if length > 2 else None)
    full_ctl, _ = tables["ctl"]
    out = HeadTable(full_ctl.layers, full_ctl.num_heads)
    for col in ("entropy", "distance", "sink", "local", "prev", *(f"received@{p}" for p in positions)):
        if col in full_ctl.values:
            out.values[col] = full_ctl.values[col]
    if length > 2:
        second_rep, second_ctl = tables["rep"][1], tables["ctl"][1]
        assert second_rep is not None and second_ctl is not None
        col = f"offset {length - 1}"
        out.values["induction"] = second_rep[col] - second_ctl[col]
        out.values["induction (repeated)"] = second_rep[col]
        out.values["induction (control)"] = second_ctl[col]
    out.notes = {
        "prev": "P on the previous token (control sequence)",
        "induction": "P on the token after the earlier match, repeated minus control",
        "sink": "P on key 0", "local": f"P within {window} keys", "entropy": "nats",
        "distance": "mean |query position − key|",
    }
    return out


__all__ = ["detect"]
