"""The public functions: ``attention`` and ``attention_weights``. Pure: no state, no side effects
beyond handing data to active observers (trace, capture)."""

from __future__ import annotations

import torch

from .. import observe
from ..errors import BackendError
from . import reference
from .problem import prepare
from .registry import fast, prepared, resolve


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    bias=None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    layout: str = "bhnd",
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Multi-head attention ``softmax(Q·Kᵀ·scale + bias, masked) · V``.

    q [B, H, Q, d], k [B, Hkv, K, d], v [B, Hkv, K, dv] → out [B, H, Q, dv] (``layout="bnhd"``:
    [B, N, H, ·] in and out). ``H % Hkv == 0`` (GQA/MQA). ``mask``: bool broadcastable to
    [B, H, Q, K], True = may attend, or a ``bhqk.masks`` mask. ``bias``: float, added to the scores.
    ``softcap``: scores become ``softcap·tanh(S/softcap)`` before the bias. ``scale`` defaults to
    1/√d. Fully masked rows give 0. ``return_lse=True`` returns ``(out, lse [B, H, Q])``.
    ``sinks`` [H] (GPT-OSS's ``s_aux``): a per-head logit that joins each row's softmax denominator
    and carries no value, so the weights sum to 1 − sigmoid(sink − lse_keys); lse then includes it,
    lse = log(Σ_k exp(S) + exp(sink)) (a fully masked row: out 0, lse = sink). ``dropout_p``: dropout
    on P after the softmax (lse is computed without it); the tiled backend draws its seed from
    torch's default generator, so ``torch.manual_seed`` makes a call reproducible.

    Edges, the same on every backend: NaN/inf in v (or k) at a key reach only the query rows that may
    attend it; a query row holding NaN gives NaN (0 if fully masked); a finite bias is never -inf,
    however negative; scale, softcap and bias must be finite (bias may hold -inf) or a ShapeError /
    MaskError names them; B, Q or K = 0 gives out of shape [B, H, Q, dv] filled with 0 (lse -inf).
    """
    options = None if block_q is None and block_k is None else \
        {k_: v_ for k_, v_ in (("block_q", block_q), ("block_k", block_k)) if v_ is not None}
    if backend == "auto" and bias is None and sinks is None and not return_lse and observe.quiet() \
            and not torch.compiler.is_compiling():  # a decision kept for the call's family computes it (decode steps)
        out = fast(q, k, v, mask, scale, softcap, dropout_p, layout, options)
        if out is not None:
            return out
    # statistics being captured start from each row's lse: on the CPU auto runs a call that returns it
    need_lse = return_lse or (backend == "auto" and not observe.quiet() and isinstance(q, torch.Tensor)
                              and q.device.type == "cpu" and observe.wants_lse())
    p, choice = prepared(backend, need_lse, q, k, v, mask, bias, scale, softcap, dropout_p, layout, options, sinks)
    try:
        out, lse = choice.run(p, need_lse)  # out [B, H, Q, dv]
    except BackendError:  # FlexAttention failed to compile a kernel (it refuses it from now on): auto chooses again
        if not choice.by_auto or (retry := resolve(backend, p, need_lse)).backend is choice.backend:
            raise
        choice = retry
        out, lse = choice.run(p, need_lse)
    if not observe.quiet():
        if observe.editors():  # bhqk.edit: the heads it names are recomputed and stitched in (out-of-place)
            p, out, lse = observe.edit(p, out, lse, backend)
        if observe.active():
            observe.emit("attention", problem=p, backend=choice.backend.name, out=out, lse=lse)
    if layout == "bnhd":
        out = out.transpose(1, 2)  # [B, H, Q, dv] -> [B, Q, H, dv]
    return (out, lse) if return_lse else out


def attention_weights(q, k, mask=None, *, bias=None, scale=None, softcap=None, layout="bhnd", sinks=None) -> torch.Tensor:
    """P [B, H, Q, K] (rows sum to 1, or 1 − the sink's share with ``sinks`` [H]; 0 for fully
    masked rows), in q's dtype."""
    v = k.new_empty(k.shape[:-1] + (0,))  # binds shapes only: k's layout with dv = 0
    p = prepare(q, k, v, mask, bias, scale, softcap, 0.0, layout, sinks=sinks)
    P, _ = reference.weights(p)
    return P.to(q.dtype)
