"""Modules: parameters around the pure functions."""

from .attention import MultiHeadAttention
from .cache import KVCache, LayerCache
from .heads import merge_heads, split_heads

__all__ = ["MultiHeadAttention", "KVCache", "LayerCache", "split_heads", "merge_heads"]
