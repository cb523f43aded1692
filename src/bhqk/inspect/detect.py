"""Head detectors: run a model on a repeated random sequence and on a non-repeating control, and
score every head for the usual roles (see :mod:`bhqk.inspect.heads` for the columns and
:data:`bhqk.inspect.heads.ROLE_THRESHOLDS` for what :meth:`HeadTable.roles` asks of each)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from .. import observe
from ..console import Ticker, attention_progress
from .capture import Capture
from .heads import HeadTable, head_table

STATS = ("entropy", "distance", "sink", "received")


def _embedding_rows(model: torch.nn.Module) -> int | None:
    """The rows of the model's input embedding (its vocabulary), where it has one."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, torch.nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if emb is None else int(emb.num_embeddings)


def _whole(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"detect: {name} must be a whole number >= {low}, got {value!r}.")
    return value


def detect(forward: Callable[[torch.Tensor], object], vocab: int, *, length: int = 20, batch: int = 4,
           window: int = 4, prefix: Sequence[int] = (), positions: Sequence[int] = (), seed: int = 0,
           model: torch.nn.Module | None = None, low: int = 0, progress: bool | None = None) -> HeadTable:
    """Score every head of ``forward(ids [B, N])`` for the roles of the module docstring.

    Runs a repeated random sequence (``prefix`` + L random tokens + the same L again, L = ``length`` ≥ 2,
    tokens drawn from [low, vocab)) and a control (``prefix`` + 2L random tokens), ``batch`` of each.
    ``model``: names layers by module path (a ``forward`` that is itself an ``nn.Module`` is used when
    ``model`` is None) and checks ``vocab`` against its input embedding. The model's attention must run
    on bhqk (a ValueError says how otherwise). Columns: entropy, distance, sink, local, prev (control
    sequence), induction (repeated minus control), induction (repeated), induction (control).
    ``progress``: a bar per attention call on a terminal (None: when stderr and stdout are terminals)."""
    if model is None and isinstance(forward, torch.nn.Module):
        model = forward
    length, batch, window = _whole("length", length, 2), _whole("batch", batch, 1), _whole("window", window, 1)
    vocab, low = _whole("vocab", vocab, 1), _whole("low", low, 0)
    if low >= vocab:
        raise ValueError(f"detect: tokens are drawn from [low, vocab) = [{low}, {vocab}), which is empty.")
    rows = None if model is None else _embedding_rows(model)
    bad_prefix = [t for t in prefix if not 0 <= int(t) < (rows or vocab)]
    if rows is not None and vocab > rows:
        raise ValueError(f"detect: vocab={vocab} but the model's input embedding has {rows} rows (token ids 0 … "
                         f"{rows - 1}); pass vocab={rows} or less.")
    if bad_prefix:
        raise ValueError(f"detect: prefix holds token ids {bad_prefix[:4]} outside 0 … {(rows or vocab) - 1}.")
    g = torch.Generator().manual_seed(seed)
    P0 = len(prefix)
    seg = torch.randint(low, vocab, (batch, length), generator=g)  # [B, L]
    pre = torch.tensor(list(prefix), dtype=torch.long).expand(batch, P0)  # [B, P0]
    rep = torch.cat([pre, seg, seg], 1)  # [B, P0 + 2L]
    ctl = torch.cat([pre, torch.randint(low, vocab, (batch, 2 * length), generator=g)], 1)  # [B, P0 + 2L]
    tables = {}
    for key, ids in (("rep", rep), ("ctl", ctl)):
        cap = Capture(what=STATS, model=model, offsets=(1, length - 1), window=window, who="detect")
        with torch.no_grad(), _bar(progress, f"detect ({'repeated' if key == 'rep' else 'control'})"), \
                observe.observing(cap):
            forward(ids)
        cap.selection.finish()  # a model whose attention does not run on bhqk: say so
        tables[key] = (head_table(cap.records, positions), head_table(cap.records, (), rows=slice(P0 + length, None)))
    full_ctl, _ = tables["ctl"]
    out = HeadTable(full_ctl.layers, full_ctl.num_heads)
    for col in ("entropy", "distance", "sink", "local", "prev", *(f"received@{p}" for p in positions)):
        if col in full_ctl.values:
            out.values[col] = full_ctl.values[col]
    second_rep, second_ctl = tables["rep"][1], tables["ctl"][1]
    col = "prev" if length == 2 else f"offset {length - 1}"
    out.values["induction"] = second_rep[col] - second_ctl[col]
    out.values["induction (repeated)"] = second_rep[col]
    out.values["induction (control)"] = second_ctl[col]
    out.notes = {"prev": "P on the previous token (control sequence)",
                 "induction": "P on the token after the earlier match, repeated minus control",
                 "sink": "P on the first key each row may attend", "local": f"P within {window} keys", "entropy": "nats",
                 "distance": "mean |query position − key|"}
    return out


@contextlib.contextmanager
def _bar(progress: bool | None, desc: str) -> Iterator[None]:
    """A bar that advances per attention call: on a terminal (None), always (True: a tqdm bar on stderr,
    a notebook's too) or never (False)."""
    if progress is None:
        with attention_progress(desc):
            yield
    elif progress:
        from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs in the venv)

        with tqdm(desc=desc, unit=" attention call", leave=False, dynamic_ncols=True) as bar, observe.observing(Ticker(bar)):
            yield
    else:
        yield


__all__ = ["detect"]
