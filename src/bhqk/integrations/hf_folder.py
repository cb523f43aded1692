"""Helpers for transformers' causal LMs (the one loader of models is :func:`bhqk.models.real.load_model`)."""

from __future__ import annotations

from typing import Any


def cache_keyword(model: Any) -> str:
    """The keyword a transformers model's ``forward`` and ``generate`` take a ``Cache`` by: ``"cache"``
    where its forward has that parameter (transformers 5.24 renamed ``past_key_values`` to it and warns
    about the old name), else ``"past_key_values"`` (older 5.x)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def decoder_stack(model: Any) -> Any:
    """A causal LM's decoder (the module whose output has ``last_hidden_state`` and which holds
    ``layers``): ``model.get_decoder()``, or ``model.model`` where ``get_decoder()`` gives the causal LM
    itself (transformers 5.x's ``Llama4ForCausalLM``)."""
    dec = model.get_decoder()
    if dec is model:
        dec = getattr(model, "model", None)
        if dec is None or dec is model:
            raise TypeError(f"{type(model).__name__}: its get_decoder() is the model itself and it has no .model: "
                            f"the decoder stack behind the output layer is not found.")
    return dec
