"""Modules: parameters around the pure functions."""

from .attention import MultiHeadAttention
from .heads import merge_heads, split_heads

__all__ = ["MultiHeadAttention", "split_heads", "merge_heads"]
