"""Argument checks shared by every mask constructor: one place per kind of value.

Each check names the constructor and the argument and raises ``MaskError`` (a ``ValueError``).
"""

from __future__ import annotations

import numbers

import torch

from ..errors import MaskError


def _what(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{value!r} ({type(value).__name__})"


def count(who: str, name: str, value: object, *, minimum: int = 0) -> int:
    """A whole number >= ``minimum``: a Python/NumPy int or a 0-d integer tensor; never a bool,
    a float (2.5 or 2.0), a string."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool and not value.is_complex():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MaskError(f"{who}: {name} must be an integer with {name} >= {minimum}, got {_what(value)}.")
    if value < minimum:
        raise MaskError(f"{who}: {name} must be an integer with {name} >= {minimum}, got {int(value)}.")
    return int(value)


def lengths(who: str, name: str, value: object) -> int | torch.Tensor:
    """One length for the whole batch (an int) or one per batch element: a 1-D integer tensor or a
    list/tuple of ints, returned as an int64 tensor [B]. Every length >= 0."""
    if isinstance(value, (list, tuple)):
        out = [count(who, f"{name}[{i}]", x) for i, x in enumerate(value)]
        if not out:
            raise MaskError(f"{who}: {name} is an empty list; give one length per batch element.")
        return torch.tensor(out, dtype=torch.long)  # [B]
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise MaskError(f"{who}: {name} must be an int, a list of ints or a 1-D integer tensor [B], got {_what(value)}.")
        if value.numel() == 0:
            raise MaskError(f"{who}: {name} is empty; give one length per batch element.")
        if bool((value < 0).any()):
            raise MaskError(f"{who}: {name} must be >= 0, got {value.tolist()}.")
        return value
    return count(who, name, value)


def alignment(who: str, align: object) -> str | None:
    """None (only valid when Q == K), ``"top_left"`` or ``"bottom_right"``."""
    if align is None or align in ("top_left", "bottom_right"):
        return align  # type: ignore[return-value]
    raise MaskError(f"{who}: align must be 'top_left' or 'bottom_right' (or None when Q == K), got {_what(align)}.")


def extent(who: str, B: object, H: object, Q: object, K: object) -> tuple[int, int, int, int]:
    """The sizes a mask is materialized or drawn at: H >= 1 and B, Q, K >= 0 (empty sizes are
    allowed everywhere: they give fully-masked semantics, docs/design.md §2)."""
    return (count(who, "B", B), count(who, "H", H, minimum=1),
            count(who, "Q", Q), count(who, "K", K))
