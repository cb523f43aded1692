"""Merge two partial attentions over disjoint key sets: the step that makes tiling and ring attention exact.

If ``(out_a, lse_a)`` is attention of some queries over keys A and ``(out_b, lse_b)`` over keys B
(A ∩ B = ∅), attention over A ∪ B is::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

A row with lse = -inf on one side saw no key there (fully masked) and takes the other side; a row
with -inf on both sides gives out 0 and lse -inf, with finite gradients.

Sinks are counted once: a sink is one more key whose value is 0, so merge partials computed
WITHOUT sinks, then apply them once with :func:`with_sinks` (which is ``merge(out, lse, 0, sink)``).
Merging two partials that both include the sink would count it twice; nothing in (out, lse) can
tell, so keep sinks out of the partials.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..shapes import compute_dtype


def _check(out_a, lse_a, out_b, lse_b) -> None:
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"merge: {name} must be a floating-point tensor, got {got}.")
    if out_a.shape != out_b.shape:
        raise ShapeError(f"merge: out_a has shape {list(out_a.shape)} but out_b has {list(out_b.shape)}; "
                         f"both are [B, H, Q, dv] for the same queries.")
    if out_a.dim() < 1 or lse_a.shape != out_a.shape[:-1] or lse_b.shape != out_a.shape[:-1]:
        raise ShapeError(f"merge: lse_a {list(lse_a.shape)} and lse_b {list(lse_b.shape)} must be out's shape "
                         f"without its last axis, {list(out_a.shape[:-1])} ([B, H, Q] for out [B, H, Q, dv]).")


def lse_of(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp [B, H, Q] of an online softmax's running max ``m`` and sum ``s`` = Σ exp(x − m)
    (m taken as 0 where it is not finite): log s + m, -inf where the sum is 0 (nothing seen), with
    NaN-free gradients. The one finish of the online lse passes (``merge``, ``rowstats.row_lse``;
    the tiled kernel's is in base 2, inside its loop)."""
    seen = s > 0
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.where(seen, torch.log(torch.where(seen, s, torch.ones_like(s))) + m, torch.full_like(s, float("-inf")))


def _combine(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, a finite stand-in for it): log(e^a + e^b), -inf where both are -inf, NaN-free gradients."""
    m = torch.maximum(lse_a, lse_b).detach()  # [B, H, Q]; the result does not depend on it
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(lse_a - m) + torch.exp(lse_b - m)  # [B, H, Q], 0 where both sides are empty
    lse = lse_of(m, s)
    return lse, torch.where(s > 0, lse, torch.zeros_like(lse))


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the attention over each.

    out_a, out_b [B, H, Q, dv] (any leading axes), lse_a, lse_b [B, H, Q] (as from
    ``attention(..., return_lse=True)``) → (out [B, H, Q, dv], lse [B, H, Q]). Weights are computed
    in float32 (float64 if an input is float64); out has the promoted dtype of out_a and out_b.
    Differentiable in all four inputs.
    """
    _check(out_a, lse_a, out_b, lse_b)
    dt = compute_dtype(lse_a, lse_b, out_a, out_b)
    la, lb = lse_a.to(dt), lse_b.to(dt)
    lse, safe = _combine(la, lb)
    wa = torch.exp(la - safe)[..., None]  # [B, H, Q, 1]; 0 where side a saw no key
    wb = torch.exp(lb - safe)[..., None]
    oa = torch.where(wa > 0, out_a.to(dt), torch.zeros((), dtype=dt, device=out_a.device))  # ignore whatever an empty side holds
    ob = torch.where(wb > 0, out_b.to(dt), torch.zeros((), dtype=dt, device=out_b.device))
    out = wa * oa + wb * ob  # [B, H, Q, dv]
    return out.to(torch.promote_types(out_a.dtype, out_b.dtype)), lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the per-head sinks [H] to an attention computed without them: out [B, H, Q, dv], lse
    [B, H, Q] → (out·sigmoid(lse − sink), log(exp(lse) + exp(sink))), i.e. the merge with a key
    that scores ``sink[h]`` and carries the value 0. A fully masked row (lse = -inf) gives out 0
    and lse = sink. Differentiable in all three."""
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or out.dim() < 3 or sinks.shape[0] != out.shape[-3]:
        got = list(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ShapeError(f"with_sinks: sinks must be [H={out.shape[-3] if out.dim() >= 3 else '?'}] for out "
                         f"{list(out.shape)} ([B, H, Q, dv]), got {got}.")
    sink = sinks[:, None].expand_as(lse)  # [H] -> [B, H, Q]
    nothing = torch.zeros((), dtype=out.dtype, device=out.device).expand_as(out)  # [] -> [B, H, Q, dv]: the sink's value, 0
    return merge(out, lse, nothing, sink.to(lse.dtype))


def add_sinks(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """An lse [B, H, Q] computed without sinks, with the per-head sinks [H] joined:
    log(exp(lse) + exp(sink)) (a row that saw no key: the sink). The lse part of :func:`with_sinks`
    for a caller that has no output to scale (the statistics' lse)."""
    return torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])  # [B, H, Q] with [1, H, 1]


def sinks_grad(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
               grad_lse: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of the sink logits [H] from a sink-inclusive ``lse`` [B, H, Q] and ``out``
    [B, H, Q, dv]: the sink is a key without a value, so its dS is P_sink·(0 - delta), summed over
    the rows of its head: ``d sink_h = -Σ_{b,q} exp(sink_h - lse)·delta`` with ``delta =
    rowsum(dO ∘ O) - dlse``. The one backward of :func:`with_sinks` for the kernels that apply sinks
    once at the end (tiled, spans, ring attention)."""
    dt = lse.dtype
    delta = torch.einsum("bhqv,bhqv->bhq", out.to(dt), grad_out.to(dt))  # [B, H, Q]
    if grad_lse is not None:
        delta = delta - grad_lse.to(dt)
    p_sink = torch.exp(sinks.to(dt)[None, :, None] - lse)  # [B, H, Q]: the sink's weight in each row
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)  # [H]


@torch.no_grad()
def merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place, without autograd: ``acc_out, acc_lse = merge(acc_out, acc_lse, out_b, lse_b)``.

    For accumulators (acc_out float32/64 [B, H, Q, dv], acc_lse [B, H, Q]) that start at 0 and -inf;
    out_b must be finite (as every bhqk backend returns it). Allocates only [B, H, Q] temporaries.
    """
    lb = lse_b.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lb)  # [B, H, Q]; -inf where both are -inf
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    wa = torch.exp(acc_lse - safe)[..., None]  # [B, H, Q, 1]
    wb = torch.exp(lb - safe)[..., None]
    acc_out.mul_(wa).addcmul_(out_b, wb)
    acc_lse.copy_(new)
