"""Real models on bhqk: a BERT encoder (all-MiniLM-L6-v2 bundled) and GPT-2, loaded from local
Hugging Face folders through key tables. ``tokenizers``/``safetensors`` are the ``models`` extra.
``pretrained("smollm2-135m")``, ``pretrained("gemma3-270m")``: real pretrained decoders (transformers'
models on bhqk's attention; the ``real`` extra); ``load_model(source)``: any model a command's ``--model``
names, as a :class:`Loaded` (:mod:`bhqk.models.real`; GGUF supply and conversion: :mod:`bhqk.models.gguf`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import LoadError
from .bert import BertConfig, BertEncoder, SentenceEncoder, bundled_model_dir, cosine_similarity, mean_pool
from .gpt2 import GPT2, GPT2Config, sample
from .loading import load_checked, read_config, read_weights, remap_bert, remap_gpt2
from .real import Loaded, load_model, pretrained

ARCHITECTURES: dict[str, type[BertEncoder] | type[GPT2]] = {"bert": BertEncoder, "gpt2": GPT2}


def load(folder: str | Path, *, backend: str = "auto"):
    """The bhqk model for a local Hugging Face folder, chosen by config.json's model_type."""
    kind = read_config(folder).get("model_type")
    if kind not in ARCHITECTURES:
        raise LoadError(f"unknown architecture: {Path(folder) / 'config.json'} has model_type={kind!r}; "
                        f"bhqk.models loads {sorted(ARCHITECTURES)}.")
    return ARCHITECTURES[kind].from_pretrained(folder, backend=backend)


__all__ = [
    "load", "ARCHITECTURES", "BertConfig", "BertEncoder", "SentenceEncoder", "mean_pool", "cosine_similarity",
    "bundled_model_dir", "GPT2", "GPT2Config", "sample", "remap_bert", "remap_gpt2", "read_config", "read_weights",
    "load_checked", "pretrained", "load_model", "Loaded",
]
