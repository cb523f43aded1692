"""bhqk: multi-head attention in which every dimension has a name and every step can be seen.

Scores live in [B, H, Q, K]; masks use True = may attend; errors name the dimension that is wrong.
"""

from . import bias, masks
from .errors import BackendError, LoadError, MaskError, ShapeError
from .explain import explain
from .functional import Problem, attention, attention_weights, why_not
from .inspect import trace
from .nn import MultiHeadAttention, merge_heads, split_heads

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_weights", "why_not", "Problem",
    "MultiHeadAttention", "split_heads", "merge_heads",
    "masks", "bias", "explain", "trace",
    "ShapeError", "MaskError", "BackendError", "LoadError",
]
