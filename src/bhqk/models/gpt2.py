"""GPT-2 on bhqk.MultiHeadAttention, with KV-cache generation.

Mirrors Hugging Face ``GPT2LMHeadModel``: token + learned position embeddings → L pre-LayerNorm
blocks (causal self-attention, GELU-tanh feed-forward) → final LayerNorm → LM head tied to the
token embedding. Left-padded batches take an ``attention_mask`` (1 = real token); positions then
count real tokens only, as transformers' ``generate`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoadError
from ..masks import causal, key_padding
from ..nn import KVCache, MultiHeadAttention
from ..shapes import Sizes
from .common import activation
from .loading import load_gpt2, read_config


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"

    @classmethod
    def from_hf(cls, config: dict) -> GPT2Config:
        """From a Hugging Face ``config.json`` dict; a LoadError for options bhqk's GPT-2 does not do."""
        unsupported = {
            "scale_attn_by_inverse_layer_idx": True, "add_cross_attention": True, "scale_attn_weights": False,
        }
        for key, bad in unsupported.items():
            if config.get(key, not bad) == bad:
                raise LoadError(f"GPT-2 config {key}={bad} is not supported by bhqk.models.gpt2.")
        if not config.get("tie_word_embeddings", True):
            raise LoadError("GPT-2 config tie_word_embeddings=false is not supported: bhqk's LM head is the token embedding.")
        try:
            D = config["n_embd"]
            c = cls(
                vocab_size=config["vocab_size"], n_positions=config["n_positions"], n_embd=D,
                n_layer=config["n_layer"], n_head=config["n_head"], n_inner=config.get("n_inner") or 4 * D,
                layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
                activation_function=config.get("activation_function", "gelu_new"),
            )
        except KeyError as e:
            raise LoadError(f"GPT-2 config.json lacks {e.args[0]!r}.") from None
        activation(c.activation_function, "activation_function")
        return c


class GPT2Block(nn.Module):
    """Pre-LayerNorm: x = x + attn(LN(x)); x = x + W2·act(W1·LN(x))."""

    def __init__(self, c: GPT2Config, backend: str = "auto") -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.attn = MultiHeadAttention(c.n_embd, c.n_head, backend=backend)
        self.ff_norm = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.ff_in = nn.Linear(c.n_embd, c.n_inner)  # D -> I
        self.ff_out = nn.Linear(c.n_inner, c.n_embd)  # I -> D
        self.act = activation(c.activation_function, "activation_function")

    def forward(self, x: torch.Tensor, mask=None, cache=None, backend: str | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask=mask, cache=cache, backend=backend)  # [B, N, D]
        return x + self.ff_out(self.act(self.ff_in(self.ff_norm(x))))  # [B, N, D]


class GPT2(nn.Module):
    """GPT-2 language model: ids [B, N] → logits [B, N, V]."""

    def __init__(self, config: GPT2Config, *, backend: str = "auto") -> None:
        super().__init__()
        self.config, self.backend = config, backend
        self.tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(GPT2Block(config, backend) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, backend: str = "auto") -> GPT2:
        """A local Hugging Face GPT-2 folder (config.json + model.safetensors or pytorch_model.bin).
        Strict: every key, every shape; Conv1D weights are transposed by the key table."""
        model = cls(GPT2Config.from_hf(read_config(folder, expect="gpt2")), backend=backend)
        load_gpt2(model, folder)
        return model.eval()

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache with one layer per block, room for ``capacity`` positions."""
        return KVCache(len(self.blocks), capacity=capacity)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, N] → logits [B, N, V] ([B, 1, V] with ``last_only``). With ``cache``, the N
        tokens follow the cached ones (keys are appended in place). ``attention_mask`` [B, K] covers
        cached + new tokens (1 = real token). Positions default to the count of real tokens before
        each one."""
        sizes = Sizes()
        sizes.bind("input_ids", input_ids.shape, ("B", "N"))
        B, N = input_ids.shape
        past = 0 if cache is None else cache.length
        K = past + N
        mask = None if N == 1 else causal("bottom_right")  # one new query sees every key
        if attention_mask is not None:
            sizes.bind("attention_mask", attention_mask.shape, ("B", "K"), what=f" (K = cached {past} + new {N})")
            if sizes["K"] != K:
                raise sizes.fail(f"attention_mask has K={sizes['K']} but cached {past} + new {N} = {K} tokens; it covers both.")
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # [B, N] real tokens before
            if not bool(attention_mask.bool().all()):
                pad = key_padding(attention_mask.bool())  # [B, K], True = real key
                mask = pad if mask is None else mask & pad
        if position_ids is None:
            position_ids = torch.arange(past, K, device=input_ids.device)[None]  # [1, N]
        if K > self.config.n_positions:
            raise sizes.fail(f"{K} tokens exceed this GPT-2's {self.config.n_positions} positions.")
        backend = self.backend
        x = self.tokens(input_ids) + self.positions(position_ids)  # [B, N, D]
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if cache is None else cache[i], backend)  # [B, N, D]
        if last_only:
            x = x[:, -1:]  # [B, 1, D]
        return F.linear(self.final_norm(x), self.tokens.weight)  # [B, N, V], the head tied to the embedding

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        attention_mask: torch.Tensor | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """prompt_ids [B, N] (left-padded with ``attention_mask`` [B, N] for ragged prompts) →
        [B, N + max_new_tokens]. ``temperature=0``: greedy; otherwise sample from
        softmax(logits / temperature), restricted to the ``top_k`` best when given, with
        ``seed`` for repeatability. A row that emitted ``eos_token_id`` repeats it; generation
        stops once every row has. ``use_cache=False`` recomputes the whole sequence each step."""
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]  # [N] -> [1, N]
        B, N = prompt_ids.shape
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
        total = N + max_new_tokens
        if total > self.config.n_positions:
            raise ValueError(f"prompt {N} + {max_new_tokens} new tokens exceed this GPT-2's {self.config.n_positions} positions.")
        gen = None if seed is None else torch.Generator(device=prompt_ids.device).manual_seed(seed)
        ids = prompt_ids.new_zeros(B, total)  # [B, N + new], filled as we go
        ids[:, :N] = prompt_ids
        mask = None
        if attention_mask is not None:
            mask = attention_mask.new_ones(B, total)  # [B, N + new]: generated tokens are real
            mask[:, :N] = attention_mask
        cache = self.new_cache(total) if use_cache else None
        done = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
        end = N
        for step in range(max_new_tokens):
            start = end - 1 if (use_cache and step > 0) else 0
            am = None if mask is None else mask[:, :end]  # [B, K]
            logits = self(ids[:, start:end], am, cache=cache, last_only=True)[:, -1]  # [B, V]
            nxt = sample(logits, temperature, top_k, gen)  # [B]
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            ids[:, end] = nxt
            end += 1
            if eos_token_id is not None and bool(done.all()):
                break
        return ids[:, :end]


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, generator=None) -> torch.Tensor:
    """logits [B, V] → next ids [B]: argmax at temperature 0, else a draw from the tempered top-k."""
    if temperature == 0:
        return logits.argmax(-1)  # [B]
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]


__all__ = ["GPT2", "GPT2Config", "GPT2Block", "sample"]
