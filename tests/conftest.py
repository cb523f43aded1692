"""Shared helpers for the tests: random attention inputs and every mask kind."""

from __future__ import annotations

import os

import torch

# auto's costs: the built-in reference table, not this machine's measurement, so the choices tests
# see do not depend on the machine or its load (tests/test_auto.py measures on its own)
os.environ.setdefault("BHQK_COSTS", "reference")

from bhqk import masks
from bhqk.functional import names


def concrete_backends() -> list[str]:
    """Every registered backend except the ``auto`` policy."""
    return [n for n in names() if n != "auto"]


def qkv(B=2, H=4, Hkv=None, Q=5, K=7, d=8, dv=None, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    dv = d if dv is None else dv
    q = torch.randn(B, H, Q, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, K, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, K, dv, generator=g, dtype=dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def mask_kinds(B: int, H: int, Q: int, K: int, seed: int = 0) -> dict[str, masks.Mask]:
    """One instance of every mask kind (and some combinations) for sizes B, H, Q, K."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, K + 1, (B,), generator=g)
    valid = torch.rand(B, K, generator=g) > 0.3
    valid[:, 0] = True
    q_ids = torch.sort(torch.randint(0, 3, (B, Q), generator=g), dim=1).values
    k_ids = torch.sort(torch.randint(0, 3, (B, K), generator=g), dim=1).values
    dense = torch.rand(B, 1, Q, K, generator=g) > 0.4
    return {
        "causal_tl": masks.causal("top_left"),
        "causal_br": masks.causal("bottom_right"),
        "padding": masks.padding(lengths),
        "key_padding": masks.key_padding(valid),
        "window": masks.sliding_window(2, 1, align="bottom_right"),
        "document": masks.document(q_ids, k_ids),
        "prefix_lm": masks.prefix_lm(2, align="top_left"),
        "predicate": masks.predicate(lambda b, h, q, k: ((q + k + h) % 3) != 0, "mod3"),
        "dense": masks.dense(dense),
        "causal&padding": masks.causal("bottom_right") & masks.padding(lengths),
        "window|document": masks.sliding_window(1, align="top_left") | masks.document(q_ids, k_ids),
        "~causal": ~masks.causal("top_left"),
    }
