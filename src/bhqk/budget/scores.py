"""Causal head scores: how much streaming a K/V head changes the model's next-token distributions, on
text ``ids`` [B, N] (:func:`text_ids`), over the rows streaming can change: i ≥ S + W + 1
(:func:`first_row`), n = N − S − W − 1 rows per sequence.

``kl`` (:func:`kl_scores`): D_h = mean over those rows of KL(p_full ‖ p_h), p_h with K/V head h alone
streamed (``Plan.emulate``), one forward per K/V head from its layer on (:func:`reference`).

``fisher`` (:func:`fisher_scores`): the same divergence to second order, from one forward and one
backward. Gates mix each head's full and streaming outputs (:func:`bhqk.budget.gate.gated`), one per
K/V head h and query row t; D(g) = mean_t KL(p_full ‖ p_g). At g = 1 (full attention) D = 0 and
∇D = 0 — the KL is at its minimum — so attribution patching's first-order term is 0 for every head
and cannot rank them. The curvature can: at g = 1 the Hessian of D is exactly (1/n)·F, with F the
Fisher information E_{y∼p_full}[∇ log p_g(y) ∇ log p_g(y)ᵀ] (the Gauss-Newton term is the whole
Hessian where p_g = p_full), and streaming head h at row t is a step Δg_{h,t} = −1, so
D ≈ ½ Σ_t F_{(h,t),(h,t)} / n. One backward of ℓ = Σ_t log p_g(y_t), y_t drawn from p_full(·|t) (the
forward's own distribution: g = 1 is full attention), gives ∂ℓ/∂g_{h,t}, whose square has expectation
F_{(h,t),(h,t)} (the rows' draws are independent and each score has mean 0). The score is
½ · mean_t (∂ℓ/∂g_{h,t})², in nats like ``kl``. Per-row gates matter: the square of one gate per
head is unbiased too, but it is one draw (its relative spread is √2); per row, n draws average.
What per-row gates leave out: the cross terms between rows (streaming h at row t changes row t' > t
through later layers' attention).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..corpus import chunks
from ..errors import ShapeError
from ..integrations.model_map import ModelMap, model_map
from .gate import gated
from .plan import Plan

CHUNK = 256  # rows of logits at a time: [B, 256, V] (SmolLM2: 48 MiB in fp32 per sequence)


def first_row(sink: int, window: int) -> int:
    """The first query row whose streaming mask hides a key (row i sees keys 0 … S−1 and i − W … i):
    i = S + W + 1. The rows before it are the same under full and streaming attention."""
    return sink + window + 1


def text_ids(tokenizer, texts: Sequence[str] | None, length: int, batch: int) -> torch.Tensor:
    """[batch, length] token ids: :func:`bhqk.corpus.chunks` — each row starts as the tokenizer starts a
    text (Gemma's ``<bos>``; nothing for SmolLM2), then the next tokens of ``texts`` joined by blank lines
    (default: ``pydoc_data.topics``, the corpus's text), consecutive from the start."""
    try:
        return chunks(tokenizer, length, batch, texts, who="find")
    except ValueError as e:
        raise ShapeError(f"{e} Pass longer texts or a smaller length.") from None


@dataclass
class Reference:
    """Full attention on ``ids`` [B, N]: the next-token log-probs at rows ``start`` … N−1 (``logp``
    [B, n, V], computed once), the final hidden states [B, N, d] and each decoder layer's input
    (``inputs[l]`` [B, N, d]; None where a run cannot start from a layer's input)."""

    ids: torch.Tensor
    start: int
    logp: torch.Tensor
    hidden: torch.Tensor
    inputs: list[torch.Tensor] | None


def _same(a: torch.Tensor, b: torch.Tensor, n: int) -> bool:
    """``a`` is ``b`` computed again up to rounding: within 8 · eps · √n · max(1, max |b|), n the length
    of the sums behind a value (the bound of tests/tolerance.py)."""
    eps = torch.finfo(b.dtype).eps
    return bool(((a - b).abs() <= 8 * eps * n**0.5 * max(1.0, float(b.abs().max()))).all())


def final_hidden(m: ModelMap, ids: torch.Tensor, ref: Reference | None = None, layer: int = 0) -> torch.Tensor:
    """The decoder's final hidden states [B, N, d] of ``ids`` [B, N]; from ``ref.inputs[layer]`` through
    the layers ``layer`` … L−1 only when ``ref`` holds the inputs (the layers before are unchanged)."""
    if ref is None or ref.inputs is None or layer == 0:
        return m.hidden(ids)
    dec = m.stack()
    layers = dec.layers
    dec.layers = nn.ModuleList(list(layers)[layer:])  # the decoder with its layers `layer` … L−1 only
    try:
        return dec(inputs_embeds=ref.inputs[layer], use_cache=False).last_hidden_state
    finally:
        dec.layers = layers


def reference(model: Any, ids: torch.Tensor, start: int, chunk: int = CHUNK) -> Reference:
    """Full attention's run on ``ids`` (no gradients): :class:`Reference`. Checks that the logits are
    the output embedding of the final hidden states (else a ShapeError: the scores cannot read them)
    and whether a run from a layer's input gives the same final states (else ``inputs`` is None)."""
    m = model_map(model)
    L = m.shape.layers
    N = ids.shape[1]
    if not 0 < start < N:
        raise ShapeError(f"kl scores: the text has N={N} tokens but the rows that streaming changes start at "
                         f"{start} (sink + window + 1); pass a longer length or a smaller sink + window.")
    dec = m.stack()
    inputs: list[torch.Tensor] = []
    seen: dict[str, torch.Tensor] = {}

    def layer_input(_m, args, kw) -> None:
        inputs.append((args[0] if args else kw["hidden_states"]).detach())  # [B, N, d]

    def last(_m, _a, out) -> None:
        seen["h"] = out.last_hidden_state.detach()  # [B, N, d]

    hooks = [layer.register_forward_pre_hook(layer_input, with_kwargs=True) for layer in dec.layers]
    hooks.append(dec.register_forward_hook(last))
    try:
        with torch.no_grad():
            end = m.model(input_ids=ids, logits_to_keep=1, use_cache=False).logits[:, -1]  # [B, V]
    finally:
        for h in hooks:
            h.remove()
    hidden = seen["h"]  # [B, N, d]
    with torch.no_grad():
        mine = m.logits(hidden[:, -1])  # [B, V]
    if not _same(mine, end, hidden.shape[-1]):
        raise ShapeError(f"kl scores read the logits as the output embedding of the final hidden states (and Gemma's "
                         f"soft cap); {type(m.model).__name__} computes them otherwise (max difference "
                         f"{float((mine - end).abs().max()):.3g}).")
    logp = torch.cat([m.log_probs(hidden[:, a:a + chunk])  # [B, c, V]
                      for a in range(start, N, chunk)], dim=1)  # [B, n, V]
    ref = Reference(ids, start, logp, hidden, inputs if len(inputs) == L else None)
    if ref.inputs is not None:  # a run from the middle must give the full run's states, else run whole
        with torch.no_grad():
            again = final_hidden(m, ids, ref, L // 2)
        if not _same(again, hidden, hidden.shape[-1] * L):
            ref.inputs = None
    return ref


def next_token_kl(m: ModelMap, hidden: torch.Tensor, ref: Reference, chunk: int = CHUNK) -> torch.Tensor:
    """KL(full ‖ this run) of the next-token distributions, per sequence and row: [B, n] at rows
    ``ref.start`` … N−1, from this run's final hidden states [B, N, d], ``chunk`` rows of logits at a time."""
    out = []
    for a in range(ref.start, hidden.shape[1], chunk):
        logp = m.log_probs(hidden[:, a:a + chunk])  # [B, c, V]
        r = ref.logp[:, a - ref.start:a - ref.start + logp.shape[1]]  # [B, c, V]
        out.append((r.exp() * (r - logp)).sum(-1))  # [B, c]
    return torch.cat(out, dim=1)  # [B, n]


def kl_scores(model: Any, ids: torch.Tensor, sink: int, window: int, chunk: int = CHUNK,
              progress: Callable[[str], None] | None = None) -> torch.Tensor:
    """Per K/V head [L, Hkv]: the mean KL(full ‖ that head streamed) over the rows streaming changes
    (of every sequence of ``ids`` [B, N]), one forward per K/V head, from its layer on.
    ``progress``: a line after each head."""
    m = model_map(model)
    shape = m.shape
    L, Hkv = shape.layers, shape.kv_heads
    ref = reference(m, ids, first_row(sink, window), chunk)
    out = torch.zeros(L, Hkv, dtype=torch.float64)
    for li in range(L):
        for j in range(Hkv):
            t0 = time.perf_counter()
            full = torch.ones(L, Hkv, dtype=torch.bool)
            full[li, j] = False
            with Plan(full, sink, window, model=shape).emulate(m), torch.no_grad():
                h = final_hidden(m, ids, ref, li)
                out[li, j] = next_token_kl(m, h, ref, chunk).double().mean()
            if progress is not None:
                progress(f"kl: layer {li} kv head {j}: {float(out[li, j]):.4g} ({time.perf_counter() - t0:.1f} s)")
    return out


def fisher_scores(model: Any, ids: torch.Tensor, sink: int, window: int, seed: int = 0,
                  chunk: int = CHUNK) -> torch.Tensor:
    """Per K/V head [L, Hkv]: ½ · the mean over the rows streaming changes of (d log p(y_t) / d g_{h,t})²
    at g = 1 (one gate per K/V head and query row, :func:`~bhqk.budget.gate.gated`; y_t drawn from the
    forward's own next-token distribution, ``seed``): the KL of streaming each head to second order
    (module doc). One forward and one backward per sequence of ``ids`` [B, N]."""
    m = model_map(model)
    L, Hkv = m.shape.layers, m.shape.kv_heads
    B, N = ids.shape
    start = first_row(sink, window)
    if not 0 < start < N:
        raise ShapeError(f"fisher score: the text has N={N} tokens but the rows that streaming changes start at "
                         f"{start} (sink + window + 1); pass a longer length or a smaller sink + window.")
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(L, Hkv, dtype=torch.float64)
    for b in range(B):  # one sequence at a time: its rows' gates are its own
        g = torch.ones(L, Hkv, N, device=ids.device, requires_grad=True)
        with gated(m, g, sink, window):
            hidden = m.hidden(ids[b:b + 1])  # [1, N, d]
        grad = torch.zeros_like(hidden)  # d log-likelihood / d hidden, [1, N, d]
        for a in range(start, N, chunk):
            h = hidden[:, a:a + chunk].detach().requires_grad_(True)  # [1, c, d]
            logp = m.log_probs(h)  # [1, c, V]
            y = torch.multinomial(logp.detach()[0].exp().cpu(), 1, generator=gen).to(logp.device)  # [c, 1]
            grad[:, a:a + chunk] = torch.autograd.grad(logp[0].gather(-1, y).sum(), h)[0]
        hidden.backward(grad)
        assert g.grad is not None
        total += g.grad[..., start:].double().pow(2).sum(-1).cpu()  # [L, Hkv]
    return total / (2 * B * (N - start))


__all__ = ["text_ids", "kl_scores", "fisher_scores", "next_token_kl", "reference", "Reference",
           "first_row"]
