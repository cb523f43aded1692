"""Local Hugging Face model folders on bhqk, for the command line: :func:`load_folder`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError
from ..models.loading import read_config
from .hf_attention import check_implementation, register

# ---- local model folders (for the command line) ---------------------------------------------------


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")


@dataclass
class Loaded:
    """A Hugging Face model from a local folder on bhqk: ``decoder`` models are causal LMs; ``name``: what
    the user called it (a model name such as ``smollm2-135m``, else the folder's name)."""

    model: torch.nn.Module
    tokenizer: Any | None  # a transformers tokenizer (PreTrainedTokenizerBase)
    decoder: bool
    folder: Path
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or self.folder.name


def is_decoder_config(config: dict) -> bool:
    """A causal language model by its config.json (architectures or is_decoder)."""
    archs = config.get("architectures") or []
    return bool(config.get("is_decoder")) or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def load_folder(folder: str | Path, name: str = "bhqk", dtype: torch.dtype = torch.float32) -> Loaded:
    """Model and tokenizer from a local folder, offline, with ``attn_implementation=name`` (bhqk's
    names registered first; a name that is no implementation is a BackendError before anything loads).
    Decoders load as ``AutoModelForCausalLM``, others as ``AutoModel``."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    check_implementation(name)
    decoder = is_decoder_config(read_config(folder))
    if name.split(":")[0] == "bhqk":
        register()
    cls = AutoModelForCausalLM if decoder else AutoModel
    model = cls.from_pretrained(folder, attn_implementation=name, local_files_only=True, dtype=dtype).eval()
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):  # else AutoTokenizer may make an empty one
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Loaded(model, tokenizer, decoder, folder)


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


def encode(loaded: Loaded, text: str) -> tuple[dict, list[str]]:
    """The model inputs for ``text`` (input_ids and attention_mask [1, N]) and its N tokens."""
    if loaded.tokenizer is None:
        raise LoadError(f"{loaded.folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass token ids instead.")
    enc = loaded.tokenizer(text, return_tensors="pt")
    inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    return inputs, loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
