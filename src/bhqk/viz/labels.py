"""Token labels of pictures and pages: one per query of a call and one per key, checked before
anything is drawn (``cap.summary`` and ``viz.to_bertviz`` check the same)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ShapeError


def check_tokens(where: str, tokens: Sequence[str] | None, n: int, *, arg: str = "tokens", axis: str = "Q",
                 call: str | None = None, hint: str = "") -> None:
    """Refuse ``tokens`` unless it holds exactly ``n`` labels, one per query (``axis="Q"``) or key
    (``axis="K"``) of ``call``: a ShapeError naming the argument, the expected count and the actual."""
    if tokens is None or len(tokens) == n:
        return
    what, one = ("queries", "query") if axis == "Q" else ("keys", "key")
    of = f"call {call!r} has" if call is not None else "the weights have"
    raise ShapeError(f"{where}: {arg} has {len(tokens)} tokens but {of} {axis}={n} {what}; "
                     f"pass one token per {one}{hint}.")


def check_labels(where: str, tokens: Sequence[str] | None, key_tokens: Sequence[str] | None, Q: int, K: int,
                 call: str | None = None) -> None:
    """One token per query of the call (Q, not only the captured rows) and one per key (``key_tokens``,
    else ``tokens`` labels the keys too)."""
    check_tokens(where, tokens, Q, axis="Q", call=call)
    if key_tokens is not None:
        check_tokens(where, key_tokens, K, arg="key_tokens", axis="K", call=call)
    else:
        check_tokens(where, tokens, K, axis="K", call=call, hint=" (tokens labels the keys too; pass key_tokens= "
                                                                 "when they are not the queries)")
