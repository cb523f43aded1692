"""bhqk: multi-head attention in which every dimension has a name and every step can be seen.

Scores live in [B, H, Q, K]; masks use True = may attend; errors name the dimension that is wrong.
"""

from . import bias, budget, distributed, masks
from .errors import BackendError, LoadError, MaskError, ShapeError
from .explain import explain
from .functional import Problem, attention, attention_weights, choose_backend, why_not
from .functional.merge import merge
from .inspect import capture, edit, edits, trace
from .nn import KVCache, MultiHeadAttention, merge_heads, split_heads

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_weights", "why_not", "choose_backend", "merge", "Problem",
    "MultiHeadAttention", "KVCache", "split_heads", "merge_heads",
    "masks", "bias", "budget", "distributed", "explain", "trace", "capture", "edit", "edits",
    "ShapeError", "MaskError", "BackendError", "LoadError",
]
