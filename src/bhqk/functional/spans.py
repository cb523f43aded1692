"""The "spans" backend: PyTorch's fused CPU flash kernel, run only over the key spans a mask allows.

PyTorch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) is close to this
CPU's peak but cannot skip anything: a mask is added on every tile. bhqk's masks know per tile what
is empty, full or partial (``Mask.classify_grid``), so this backend runs the kernel only over the
key spans each block of queries may attend, merges the spans of a row by their log-sum-exp, and
joins sinks once at the end (``merge.with_sinks``; their gradient ``merge.sinks_grad``).

Three modules, like ``tiled`` / ``tiled_plan``: ``spans_plan`` plans (pure), ``spans_kernels`` runs
the fused kernel and its backward over a plan's calls, and this one is the autograd Function
(:class:`_SpanAttention`) and the registry entry.

Refused (``why_not``): softcap, dropout, a bias that needs its gradient, non-CPU tensors, and an
empty head dimension. NaN/inf in q, k or v: handed to the tiled backend (``hands_off``), as the
torch adapter does. dv ≠ d: the narrower of v and (q, k) is padded with zero columns (the kernel
wants one head size; zero columns change neither the scores nor the output). The kernel takes any
strides but the last dimension's, which it reads as 1: q, k or v whose last stride is not 1 (a
slice of a wider buffer) is copied to a contiguous tensor once per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..bias import dense_parts
from . import nonfinite
from . import spans_kernels as kernels
from .merge import sinks_grad, with_sinks
from .problem import Problem
from .spans_plan import Plan, on_heads, plan_for, share

# ---- the registry entry -----------------------------------------------------------------------------

def why_not(p: Problem, need_lse: bool) -> str | None:
    """None when PyTorch's fused CPU kernel can compute the call, else why not."""
    if (why := kernels.fused_refuses(p.q)) is not None:
        return why
    if p.softcap is not None:
        return "the fused CPU kernel has no softcap"
    if p.dropout_p > 0:
        return "the span path has no dropout (the fused kernel would draw a different keep-mask per span)"
    if any(b.tensor.requires_grad for b in dense_parts(p.bias)):
        return "the fused kernel's backward gives no gradient for the bias"
    if p.sizes["d"] == 0 and p.sizes["dv"] == 0:
        return "the fused CPU kernel needs a head dimension above 0"
    return None


def hands_off(p: Problem, plan: Plan | None = None) -> tuple[str, str] | None:
    """("tiled", why) when q, or k or v where a mask applies, holds NaN/inf (the fused kernel lets
    them cross the mask and turns a NaN query row into zeros), else None. A call that is one kernel
    call without a mask (no mask; a decoding step) checks q only: every row attends every key, so
    NaN/inf in k or v reach every row there as in the formula (as the torch adapter does).
    ``plan``: :func:`plan_for` of ``p`` (made here if not given)."""
    plan = plan if plan is not None else plan_for(p)
    unmasked = (g := plan.one_call(p)) is not None and not g.causal
    return nonfinite.hand_off(p, unmasked or not (plan.groups or plan.by_heads), "the fused kernel")


class _SpanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: Problem, plan: Plan, q, k, v, sinks):
        calls = list(kernels.kernel_calls(p, plan))
        out, lse = kernels.forward(p, plan, q, k, v, calls)
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)  # sinks join once, after every span is merged
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.p, ctx.plan, ctx.calls = p, plan, (kernels.kept_for_backward(calls) if plan.backward is None else None)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = kernels.backward(ctx.p, ctx.plan.backward or ctx.plan, q, k, v, out, lse, grad_out, grad_lse, ctx.calls)
        dsinks = sinks_grad(sinks, out, lse, grad_out, grad_lse) if sinks is not None and ctx.needs_input_grad[5] else None
        return None, None, dq, dk, dv, dsinks


def run(p: Problem, need_lse: bool = False, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry: out [B, H, Q, dv] and lse [B, H, Q] (float32; float64 for float64 inputs),
    differentiable in q, k, v, sinks (and through lse)."""
    plan = plan if plan is not None else plan_for(p)
    if plan.by_heads:
        return _run_by_heads(p, plan)
    q, k, v = p.q, p.k, p.v
    d, dv = q.shape[-1], v.shape[-1]
    if d < dv:  # one head size for the kernel: zero columns in q and k change no score
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))  # [.., d] -> [.., dv]
    elif dv < d:
        v = F.pad(v, (0, d - dv))  # [.., dv] -> [.., d]; the extra output columns are 0
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel reads head columns as stride 1
    inputs = (q, k, v) + ((p.sinks,) if p.sinks is not None else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out, lse = _SpanAttention.apply(p, plan, q, k, v, p.sinks)
    else:
        out, lse = kernels.forward(p, plan, q, k, v)
        if p.sinks is not None:
            out, lse = with_sinks(out, lse, p.sinks)
    if dv < d:
        out = out[..., :dv]
    return out, lse


def _run_by_heads(p: Problem, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of heads as a call of its own, the results put back in head order."""
    outs, lses = zip(*(run(on_heads(p, g.heads, g.mask), True, g.plan) for g in plan.by_heads))
    order = torch.tensor([h for g in plan.by_heads for h in g.heads], device=p.q.device)
    back = torch.argsort(order)  # the position of head h among the groups' heads
    out = torch.cat(outs, dim=1).index_select(1, back)  # [B, h0 + h1 + …, Q, dv] -> [B, H, Q, dv]
    lse = torch.cat(lses, dim=1).index_select(1, back)  # [B, H, Q]
    return out, lse


__all__ = ["hands_off", "plan_for", "run", "share", "why_not"]
