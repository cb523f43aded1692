"""The one loader of real models: :func:`load_model` takes what any command's ``--model`` names (and
what ``bhqk.models.pretrained`` takes) and gives one :class:`Loaded` (model, tokenizer, whether it is a
decoder, its name, its folder), on the attention implementation asked for.

``source`` (:func:`resolve`, the same everywhere) is a name of :data:`~bhqk.models.gguf.NAMES`
(``"smollm2-135m"``, ``"gemma3-270m"``), a local ``.gguf`` file or a folder holding exactly one (and no
``config.json``): converted once into the cache (:mod:`bhqk.models.gguf`) and loaded from there; or a
local Hugging Face folder, loaded as it is, offline. A decoder (:func:`is_decoder`) loads as
transformers' ``AutoModelForCausalLM``, any other model as ``AutoModel``; fp32, eval mode;
``model.config.name_or_path`` is the name the user gave, so what records the model (a KV budget plan's
"made for") names it, not a cache path. Every failure to find or read a model is a
:class:`~bhqk.errors.LoadError` that says what to install or delete.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LoadError
from .gguf import NAMES, converted
from .loading import read_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")


@dataclass
class Loaded:
    """A model :func:`load_model` loaded: transformers' ``model`` and ``tokenizer`` (None when the folder
    has no tokenizer files), whether it is a ``decoder`` (a causal LM), the ``name`` the user gave
    (``smollm2-135m``, else the file's or folder's name) and the ``folder`` its files were read from."""

    model: Any  # a transformers PreTrainedModel
    tokenizer: Any | None  # a transformers tokenizer (PreTrainedTokenizerBase)
    decoder: bool
    folder: Path
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or self.folder.name

    def causal(self, what: str, tokenizer: bool = True) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of a causal language model (with its tokenizer, unless ``tokenizer=False``),
        else one LoadError saying that ``what`` needs one."""
        if not self.decoder:
            raise LoadError(f"--model {self.name}: {what} needs a causal language model; {self.folder} is not one "
                            f"(config.json names no …ForCausalLM architecture).")
        if tokenizer and self.tokenizer is None:
            raise LoadError(f"--model {self.name}: {what} needs the model's tokenizer; {self.folder} has no tokenizer "
                            f"files ({', '.join(TOKENIZER_FILES)}).")
        return self.model, self.tokenizer


def resolve(source: str | Path) -> str | Path:
    """What a ``--model`` names, the same in every command: a name of :data:`~bhqk.models.gguf.NAMES`
    (returned as it is), else an existing file or folder (a Path); a LoadError listing the known names
    otherwise."""
    if str(source) in NAMES:
        return str(source)
    p = Path(source)
    if p.exists():
        return p
    import difflib

    close = difflib.get_close_matches(str(source), NAMES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise LoadError(f"no model {str(source)!r}: not a known name ({', '.join(sorted(NAMES))}), nor a file or folder.{hint}")


def model_type(source: str | Path) -> str | None:
    """config.json's ``model_type`` of the folder ``source`` names (:func:`resolve`), None when it has no
    config.json (a name, a GGUF file): which of bhqk's own models (BERT, GPT-2) may run it."""
    found = Path(resolve(source))
    return read_config(found).get("model_type") if (found / "config.json").is_file() else None


def is_decoder(config: dict) -> bool:
    """A causal language model by its config.json: ``is_decoder``, or an architecture ``…ForCausalLM`` /
    ``…LMHeadModel``. The one test every loader and command asks."""
    archs = config.get("architectures") or []
    return bool(config.get("is_decoder")) or any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def model_name(source: str | Path) -> str:
    """The name a model goes by: a name of NAMES as it is, else the name of the file or folder given."""
    if str(source) in NAMES:
        return str(source)
    p = Path(source)
    return p.name or p.resolve().name


def load_model(source: str | Path, attn_implementation: str = "bhqk", *, cache_dir: str | Path | None = None,
               dtype: Any = None) -> Loaded:
    """The model ``source`` names (module doc) on ``attn_implementation`` (``"bhqk"``, ``"bhqk:<backend>"``
    (:func:`bhqk.integrations.transformers.implementation`), or transformers' ``"eager"``/``"sdpa"``),
    ``dtype`` (default float32), in eval mode, with its tokenizer. A bad implementation is a
    BackendError before anything is hashed, converted or loaded."""
    from ..integrations.hf_attention import check_implementation, parse_implementation, register

    check_implementation(attn_implementation)
    found = resolve(source)
    folder = converted(found, cache_dir)
    hint = (f"delete the cache folder (rm -r '{folder}') and load again." if folder is not None else
            "check that it holds config.json, the weights and the tokenizer files.")
    from_gguf = folder is not None  # converted by AutoModelForCausalLM: a decoder (its config may name no architecture)
    if folder is None:
        folder = Path(found)
        if not folder.is_dir():
            raise LoadError(f"{folder}: not a model: give a model name ({', '.join(sorted(NAMES))}), a .gguf file or "
                            "a local Hugging Face folder.")
    decoder = is_decoder(read_config(folder)) or from_gguf
    try:
        import torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise LoadError(f"loading a Hugging Face model needs transformers ({e.name} is missing): "
                        "pip install 'bhqk[real]'.") from None
    if parse_implementation(attn_implementation) is not None:
        register()
    cls = AutoModelForCausalLM if decoder else AutoModel
    try:
        model = cls.from_pretrained(folder, attn_implementation=attn_implementation, local_files_only=True,
                                    dtype=dtype or torch.float32).eval()
        tok = None
        if any((folder / f).is_file() for f in TOKENIZER_FILES):  # else AutoTokenizer may make an empty one
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # safetensors, tokenizers and transformers raise their own types
        raise LoadError(f"cannot load the model in {folder} ({type(e).__name__}: {e}); {hint}") from e
    name = model_name(source)
    model.config.name_or_path = name  # what a plan records as the model it was made for
    return Loaded(model, tok, decoder, folder, name)


def pretrained(source: str | Path = "smollm2-135m", *, cache_dir: str | Path | None = None,
               attn_implementation: str = "bhqk") -> tuple[Any, Any]:
    """``(model, tokenizer)``: the fp32 Hugging Face causal LM named by ``source`` (a name of
    :data:`~bhqk.models.gguf.NAMES`, a ``.gguf`` file, a folder holding one, or a Hugging Face folder) on
    ``attn_implementation``, in eval mode, and its tokenizer with the chat template (:func:`load_model`).
    A GGUF file is converted once into the cache (``cache_dir`` overrides ``$BHQK_CACHE``); a later load
    takes about a second."""
    loaded = load_model(source, attn_implementation, cache_dir=cache_dir)
    if not loaded.decoder:
        raise LoadError(f"{source}: not a causal language model (config.json names no …ForCausalLM architecture); "
                        f"pretrained() gives decoders.")
    return loaded.model, loaded.tokenizer


def encode(loaded: Loaded, text: str, **options: Any) -> tuple[dict, list[str]]:
    """The model inputs for ``text`` (input_ids and attention_mask [1, N]) and its N tokens; ``options``
    go to the tokenizer."""
    if loaded.tokenizer is None:
        raise LoadError(f"{loaded.folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass token ids instead.")
    enc = loaded.tokenizer(text, return_tensors="pt", **options)
    inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    return inputs, loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())


def context_length(model: Any) -> int | None:
    """The positions a transformers model was trained for (``config.max_position_embeddings``), if it says."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


__all__ = ["load_model", "Loaded", "pretrained", "resolve", "model_type", "is_decoder", "model_name", "encode", "context_length",
           "TOKENIZER_FILES"]
