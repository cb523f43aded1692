"""Pieces the model families share: activations by Hugging Face name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from ..errors import LoadError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # erf form (BERT)
    "gelu_new": partial(F.gelu, approximate="tanh"),  # tanh form (GPT-2)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, key: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise LoadError(f"config {key}={name!r} is not supported; bhqk.models knows {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]
