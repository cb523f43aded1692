"""Pieces the model families share: activations by Hugging Face name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from ..errors import LoadError, ShapeError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # erf form (BERT)
    "gelu_new": partial(F.gelu, approximate="tanh"),  # tanh form (GPT-2)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, key: str = "hidden_act", where: str = "config") -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise LoadError(f"{where}: {key}={name!r} is not supported; bhqk.models knows {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


def check_ids(name: str, ids: torch.Tensor, vocab_size: int, sizes=None, what: str = "token id",
              limit: str | None = None) -> None:
    """Token ids: an integer tensor whose every entry is in [0, vocab_size). An error naming ``name``,
    the first bad id and where it is (never an IndexError from inside the embedding)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer tensor of {what}s, got {type(ids).__name__}.")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        message = f"{name} must be an integer tensor of {what}s (e.g. torch.long), got dtype {ids.dtype}."
        raise sizes.fail(message) if sizes is not None else ShapeError(message)
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        limit = limit or f"this model's vocabulary has V={vocab_size} ids"
        raise ValueError(f"{name} holds {what} {int(ids[where])} at {list(where)}; {limit} (0…{vocab_size - 1}).")
