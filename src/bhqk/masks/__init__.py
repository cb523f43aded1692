"""Masks as values. ``True`` = may attend, in the [B, H, Q, K] layout.

Combine with ``&``, ``|``, ``~``; ``materialize(B, H, Q, K)`` gives a bool tensor; ``str(mask)``
draws it; ``classify(extent, q0, q1, k0, k1)`` says whether a tile is empty, full or partial.
For FlexAttention: ``mask_mod(B, H, Q, K)`` and ``block_mask(B, H, Q, K, block, device)``.
``per_head([m0, m1, ...])`` / ``choose(heads, a, b)``: a mask per head. What the fast paths ask of
a mask (head dependence, only the past, shift invariance, ...) each mask class declares itself
(``Mask`` in base.py).
"""

from .base import And, Extent, Mask, Not, Or, Tile, and_masks, or_masks, register_tensor_mask, tensor_versions
from .causal import Causal, causal, top_left_count
from .convert import as_mask, from_hf, from_torch_mha, to_sdpa
from .dense import Dense, dense
from .document import Document, document
from .padding import KeyPadding, KeysBelow, key_padding, padding
from .per_head import PerHead, choose, per_head
from .predicate import Predicate, predicate
from .prefix import PrefixLM, prefix_lm
from .span import Span, block_span, key_span  # knock-out spans (bhqk.edit)
from .window import SlidingWindow, sliding_window

register_tensor_mask(dense)  # how ``mask & tensor`` and ``as_mask(tensor)`` read a bool tensor (base cannot import dense)

__all__ = [
    "Mask", "Tile", "Extent", "And", "Or", "Not", "and_masks", "or_masks",
    "causal", "padding", "key_padding", "sliding_window", "document", "prefix_lm", "predicate", "dense",
    "key_span", "block_span", "Span", "per_head", "choose", "PerHead",
    "from_torch_mha", "from_hf", "to_sdpa", "as_mask", "tensor_versions", "top_left_count",
    "Causal", "KeysBelow", "KeyPadding", "SlidingWindow", "Document", "PrefixLM", "Predicate", "Dense",
]
