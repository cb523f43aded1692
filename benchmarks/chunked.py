"""Chunked perplexity, the one rule of benchmarks/quant.py and benchmarks/hf_quantized.py (imports only torch,
so the comparison's own environment, without bhqk, runs it too)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, cache, chunk: int) -> float:
    """exp(mean NLL) of ids [1, N] given the earlier tokens, fed ``chunk`` tokens at a time through ``cache``
    (each chunk reads the earlier ones from the cache, as a decode step reads them)."""
    nll, count = 0.0, 0
    for s in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, s:s + chunk], cache=cache, use_cache=True).logits.float()  # [1, c, V]
        nxt = ids[:, s + 1:s + chunk + 1]  # [1, c'] the tokens these logits predict
        lp = torch.log_softmax(logits[:, :nxt.shape[1]], -1).gather(-1, nxt[..., None])  # [1, c', 1]
        nll -= float(lp.sum())
        count += nxt.shape[1]
    return math.exp(nll / count)
