"""GPT-2 on bhqk.MultiHeadAttention, with KV-cache generation.

Mirrors Hugging Face ``GPT2LMHeadModel``: token + learned position embeddings → L pre-LayerNorm
blocks (causal self-attention, GELU-tanh feed-forward) → final LayerNorm → LM head tied to the
token embedding. Left-padded batches take an ``attention_mask`` (1 = real token); positions then
count real tokens only, as transformers' ``generate`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoadError
from ..masks import Mask, causal, key_padding
from ..nn import KVCache, MultiHeadAttention
from ..shapes import Sizes
from .common import activation, check_ids
from .loading import config_float, config_heads, config_int, config_str, load_gpt2, read_config


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
    def from_hf(cls, config: dict, where: str = "GPT-2 config.json") -> GPT2Config:
        """From a Hugging Face ``config.json`` dict; a LoadError naming ``where`` (the file) and the
        field for a missing or impossible value, or an option bhqk's GPT-2 does not do."""
        if not isinstance(config, dict):
            raise LoadError(f"{where} must be a JSON object, got {type(config).__name__}.")
        unsupported = {"scale_attn_by_inverse_layer_idx": True, "add_cross_attention": True, "scale_attn_weights": False}
        for key, bad in unsupported.items():
            if config.get(key, not bad) == bad:
                raise LoadError(f"{where}: {key}={bad} is not supported by bhqk.models.gpt2.")
        if not config.get("tie_word_embeddings", True):
            raise LoadError(f"{where}: tie_word_embeddings=false is not supported: bhqk's LM head is the token embedding.")
        D, H = config_heads(config, "n_embd", "n_head", where)
        inner = config.get("n_inner")
        c = cls(vocab_size=config_int(config, "vocab_size", where), n_positions=config_int(config, "n_positions", where),
                n_embd=D, n_layer=config_int(config, "n_layer", where, minimum=0), n_head=H,
                n_inner=4 * D if inner is None else config_int(config, "n_inner", where),
                layer_norm_epsilon=config_float(config, "layer_norm_epsilon", where, 1e-5),
                activation_function=config_str(config, "activation_function", where, "gelu_new"))
        activation(c.activation_function, "activation_function", where)
        return c


def input_major(w: torch.Tensor) -> nn.Parameter:
    """The weight ``w`` [out, in] of a matrix-vector product stored input-major: [in, out] in memory,
    the parameter a transposed view of it (Hugging Face's Conv1D layout). Values and shape unchanged; a
    decode step's one-token products stream it faster (docs/benchmarks.md, "Decoding")."""
    if w.dim() != 2 or w.stride() != (w.shape[1], 1):
        return w if isinstance(w, nn.Parameter) else nn.Parameter(w)
    return nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)  # [out, in] view of [in, out]


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
        for m in (*self.blocks.modules(), self.tokens):  # the head is tied to the token embedding [V, D]
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight = input_major(m.weight)

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, backend: str = "auto") -> GPT2:
        """A local Hugging Face GPT-2 folder (config.json + model.safetensors or pytorch_model.bin).
        Strict: every key, every shape; Conv1D weights are transposed by the key table."""
        model = cls(GPT2Config.from_hf(read_config(folder, expect="gpt2"), str(Path(folder) / "config.json")), backend=backend)
        load_gpt2(model, folder)
        return model.eval()

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache with one layer per block, room for ``capacity`` positions (a head-wise KV
        budget's: ``plan.kv_cache(model)``)."""
        return KVCache(len(self.blocks), capacity=capacity)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [B, N] → logits [B, N, V] ([B, 1, V] with ``last_only``). With ``cache``, the N
        tokens follow the cached ones (keys are appended in place). ``attention_mask`` [B, K] covers
        cached + new tokens (1 = real token). Positions default to the count of real tokens before
        each one."""
        sizes = Sizes()
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be an integer tensor [B, N], got {type(input_ids).__name__}.")
        sizes.bind("input_ids", input_ids.shape, ("B", "N"))
        check_ids("input_ids", input_ids, self.config.vocab_size, sizes)
        B, N = input_ids.shape
        if N == 0:
            raise sizes.fail("input_ids has N=0 tokens; give at least one token per row.")
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache= has {len(cache)} layers but this GPT-2 has {len(self.blocks)}; "
                             f"make it with model.new_cache() (or plan.kv_cache(model)).")
        past = 0 if cache is None else cache.length
        K = past + N
        mask: Mask | None = None if N == 1 else causal("bottom_right")  # one new query sees every key
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
        else:
            sizes.bind("position_ids", position_ids.shape, ("#B", "N"))
            check_ids("position_ids", position_ids, self.config.n_positions, sizes, "position",
                      f"this GPT-2 has {self.config.n_positions} positions")
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
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
                 temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
                 eos_token_id: int | None = None, use_cache: bool = True,
                 cache: KVCache | None = None) -> torch.Tensor:
        """prompt_ids [B, N] (left-padded with ``attention_mask`` [B, N] for ragged prompts) →
        [B, N + max_new_tokens]. ``temperature=0``: greedy; otherwise sample from
        softmax(logits / temperature), restricted to the ``top_k`` best when given, with
        ``seed`` for repeatability. A row that emitted ``eos_token_id`` repeats it; generation
        stops once every row has. ``use_cache=False`` recomputes the whole sequence each step.
        ``cache``: an empty cache to fill instead of a new one (e.g. ``plan.kv_cache(model)``, a head-wise
        KV budget); it holds the sequence afterwards."""
        if not isinstance(prompt_ids, torch.Tensor):
            raise TypeError(f"prompt_ids must be an integer tensor [B, N] or [N], got {type(prompt_ids).__name__}.")
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]  # [N] -> [1, N]
        sizes = Sizes()
        sizes.bind("prompt_ids", prompt_ids.shape, ("B", "N"))
        check_ids("prompt_ids", prompt_ids, self.config.vocab_size, sizes)
        B, N = prompt_ids.shape
        if N == 0 or B == 0:
            raise sizes.fail(f"prompt_ids is empty ({list(prompt_ids.shape)}); "
                             "generation needs at least one prompt token per row.")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
        check_sampling(temperature, top_k)
        for name, value in (("seed", seed), ("eos_token_id", eos_token_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an integer or None, got {value!r}.")
        if eos_token_id is not None and not 0 <= eos_token_id < self.config.vocab_size:
            raise ValueError(f"eos_token_id={eos_token_id} is not a token id of this model (0…{self.config.vocab_size - 1}).")
        if attention_mask is not None:
            sizes.bind("attention_mask", attention_mask.shape, ("B", "N"))
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
        if cache is not None and (not use_cache or cache.length != 0):
            raise ValueError(f"generate: cache= must be an empty cache and use_cache=True (got length {cache.length}, "
                             f"use_cache={use_cache}).")
        if cache is None and use_cache:
            cache = self.new_cache(total)
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


def check_sampling(temperature: float, top_k: int | None) -> None:
    """``temperature``: a finite number >= 0 (0 = greedy); ``top_k``: None or an integer >= 1."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 (or None for no restriction), got {top_k!r}.")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, generator=None) -> torch.Tensor:
    """logits [B, V] → next ids [B]: argmax at temperature 0, else a draw from the tempered top-k."""
    check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(-1)  # [B]
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]


__all__ = ["GPT2", "GPT2Config", "GPT2Block", "sample", "check_sampling"]
