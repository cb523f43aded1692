"""The span path's kernel wrappers: PyTorch's fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) and its backward, run over the calls of a
plan (``spans_plan``), with the call masks they take and the merge of their results.

Each span gives (out, lse) over its keys; the spans of a row are merged by their log-sum-exp
(``merge.merge_``, the ring-attention merge). The kernel gives lse 0 (not -inf) for a row that sees
no key of its span, so the mask's rows say which rows saw nothing. The backward calls the fused
backward per span with the MERGED output and lse (what makes per-span gradients exact: P = exp(S -
lse) is then each entry's share of the whole row) and adds up dq per row and dk, dv per key. A
gradient of the returned lse (its users, or nothing) adds ``g·P`` to dS: two more kernel calls per
span, only when it is nonzero. A band's mask (causal and window masks depend on k − q only) is built
for one block and broadcast; without a bias the call masks are kept in the plan (:data:`MASKS`).

:func:`fused_refuses` is the one rule of which calls the fused kernel takes (the span path's, and
the statistics' lse in ``inspect.rowstats``).
"""

from __future__ import annotations

import torch

from ..bias import Bias, in_dtype
from ..shapes import as_4d, compute_dtype
from ..shortcuts import Shortcut, declare
from .merge import merge_
from .problem import Problem
from .spans_plan import Group, Plan, chunks, sub_group

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

KEEP_ELEMS = 1 << 22  # the forward's masks are kept for the backward up to this many entries in all
GRAD_ELEMS = 1 << 22  # a backward call's dk (and dv) per block stay below this many entries (calls are split)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # what the fused CPU kernel takes
# where its lse is as exact as a float32 pass over the upcast inputs: for bf16/fp16 inputs its lse is
# about 10x further from an fp64 lse (6e-5 vs 3e-6 to 7e-6 at d = 64, N = 300, measured for issue 28)
_EXACT_LSE_DTYPES = (torch.float32, torch.float64)


def fused_refuses(q: torch.Tensor, exact_lse: bool = False) -> str | None:
    """Why PyTorch's fused CPU flash kernel cannot take q's device and dtype, else None: the one
    eligibility rule of the span path (``exact_lse=False``: any dtype the kernel takes; it computes
    the call in the input dtype, as SDPA does) and of the statistics' lse (``exact_lse=True``: only
    where the kernel's lse is float32-exact; bf16/fp16 take the float32 online pass instead)."""
    if q.device.type != "cpu":
        return f"PyTorch's fused flash kernel for the CPU takes CPU tensors (these are on {q.device.type})"
    if q.dtype not in (_EXACT_LSE_DTYPES if exact_lse else _DTYPES):
        if exact_lse:
            return f"the fused CPU kernel's lse for {q.dtype} is not float32-exact"
        return f"the fused CPU kernel takes float32/64, bfloat16 and float16, not {q.dtype}"
    return None


def fused_lse(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """The fused kernel's lse [B, H, Q] of q [B, H, Q, d] against k [B, H, K, d] (``causal``: its
    top-left ``is_causal``); v = k, only the lse is kept (the statistics' lse, ``inspect.rowstats``)."""
    return _FWD(q, k, k, 0.0, causal, scale=scale)[1]


MASKS = declare(Shortcut(
    "span call masks", "building a masked span's additive mask again at the next call", "kept in its plan: "
    "q's dtype and device, the group and its blocks (the plan's key holds the mask and sizes); not with a bias",
    f"{KEEP_ELEMS} entries per plan", "with the plan"))


# ---- one group's tensors ----------------------------------------------------------------------------

def _q_view(t: torch.Tensor, g: Group) -> torch.Tensor:
    """[B, H, Q, x] -> [B·n, H, rows, x]: the group's query blocks in the batch axis (a view when B = 1)."""
    return _rows(t, g).transpose(1, 2).flatten(0, 1)  # [B, H, n, rows, x] -> [B, n, H, rows, x] -> [B·n, H, rows, x]


def _k_view(t: torch.Tensor, g: Group) -> torch.Tensor:
    """[B, Hkv, K, x] -> [B·n, Hkv, L, x]: block j's keys k0 + j·kstep … + L (a strided view when B = 1)."""
    B, Hkv = t.shape[0], t.shape[1]
    if g.n == 1:
        return t[:, :, g.k0:g.k0 + g.L]  # [B, Hkv, L, x]
    if g.kstep == 0:
        x = t[:, :, None, g.k0:g.k0 + g.L].expand(B, Hkv, g.n, g.L, t.shape[-1])  # [B, Hkv, n, L, x]
    else:
        end = g.k0 + (g.n - 1) * g.kstep + g.L
        x = t[:, :, g.k0:end].unfold(2, g.L, g.kstep).transpose(-1, -2)  # [B, Hkv, n, x, L] -> [B, Hkv, n, L, x]
    return x.transpose(1, 2).reshape(B * g.n, Hkv, g.L, t.shape[-1])  # [B, n, Hkv, L, x] -> [B·n, Hkv, L, x]


def _rows(t: torch.Tensor, g: Group) -> torch.Tensor:
    """[B, H, Q, ...] -> the group's rows [B, H, n, rows, ...] (a view)."""
    return t[:, :, g.r0:g.r0 + g.n * g.rows].unflatten(2, (g.n, g.rows))  # [B, H, n·rows, ·] -> [B, H, n, rows, ·]


def _from_batch(t: torch.Tensor, B: int, n: int) -> torch.Tensor:
    """[B·n, H, rows, ...] -> [B, H, n, rows, ...] (a view)."""
    return t.unflatten(0, (B, n)).transpose(1, 2)  # [B·n, H, rows, ·] -> [B, n, H, rows, ·] -> [B, H, n, rows, ·]


def _mask(p: Problem, g: Group, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Blocks j0:j1 of the group: the additive mask [B·(j1-j0) or 1, H or 1, rows, L] in q's dtype
    (-inf: may not attend; the bias added) and the rows that see some key there, bool
    [B·(j1-j0) or 1, H or 1, rows] (None: all of them)."""
    ext, dev, n = p.ext, p.q.device, j1 - j0
    B = ext.B
    if n > 1 and g.kstep == g.rows and p.bias is None and p.mask is not None and p.mask.shift_invariant:  # a band: one mask
        j1, n = j0 + 1, 1
    qi = (g.r0 + g.rows * torch.arange(j0, j1, device=dev)[:, None] + torch.arange(g.rows, device=dev)[None, :])  # [n, rows]
    ki = (g.k0 + g.kstep * torch.arange(j0, j1, device=dev)[:, None] + torch.arange(g.L, device=dev)[None, :])  # [n, L]
    allowed = None
    if p.mask is not None:
        mod = p.mask.mask_mod(ext.B, ext.H, ext.Q, ext.K, dev)
        b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)  # [B] -> [B, 1, 1, 1, 1] (axes B, n, H, rows, L)
        h = torch.arange(ext.H, device=dev).view(1, 1, ext.H, 1, 1)  # [H] -> [1, 1, H, 1, 1]
        allowed = mod(b, h, qi.view(1, n, 1, g.rows, 1), ki.view(1, n, 1, 1, g.L))  # [#B, n, #H, rows, L]
        allowed = torch.as_tensor(allowed, device=dev).expand(-1, n, -1, g.rows, g.L)  # -> [#B, n, #H, rows, L]
    add = None
    if p.bias is not None:
        tiles = [_bias_tile(p, p.bias, int(qi[j, 0]), int(ki[j, 0]), g) for j in range(n)]  # [#B, #H, rows, L] each
        Bb = max(t.shape[0] for t in tiles)
        Hb = max(t.shape[1] for t in tiles)
        add = torch.stack([t.expand(Bb, Hb, g.rows, g.L) for t in tiles], dim=1)  # [#B, n, #H, rows, L]
        finite = add > float("-inf")
        allowed = finite if allowed is None else allowed & finite
    assert allowed is not None
    if add is None:
        add = torch.zeros((), dtype=p.q.dtype, device=dev)
    add = torch.where(allowed, add, float("-inf"))  # [#B, n, #H, rows, L]
    seen = allowed.any(dim=-1)  # [#B, n, #H, rows]
    if n > 1 and add.shape[0] == 1 and bool((add == add[:, :1]).all()):  # every block alike (a band): one mask
        add, seen = add[:, :1], seen[:, :1]
    Bm = B if add.shape[1] > 1 or add.shape[0] > 1 else 1  # the call's batch is [B, n] flattened
    nm, Hm = add.shape[1], add.shape[2]
    add = add.expand(Bm, nm, Hm, g.rows, g.L).reshape(Bm * nm, Hm, g.rows, g.L)  # [Bm·n, Hm, rows, L]
    seen = seen.expand(Bm, nm, Hm, g.rows).reshape(Bm * nm, Hm, g.rows)  # [Bm·n, Hm, rows]
    return add, seen


def _bias_tile(p: Problem, bias: Bias, q0: int, k0: int, g: Group) -> torch.Tensor:
    """The bias on one span [#B, #H, rows, L] in q's dtype; finite values below that dtype's lowest
    become its lowest, not -inf (as the torch adapter does)."""
    t = in_dtype(bias, p.q.dtype, lambda dt: as_4d(bias.block(p.ext, q0, q0 + g.rows, k0, k0 + g.L, p.q.device, dt)))
    return t.expand(t.shape[0], t.shape[1], g.rows, g.L)  # [#B, #H, #rows, #L] -> [#B, #H, rows, L]

Call = tuple[Group, "torch.Tensor | None", "torch.Tensor | None"]


def kernel_calls(p: Problem, plan: Plan):
    """Every kernel call: (group, attn_mask or None, rows that see a key or None)."""
    for i, g in enumerate(plan.groups):
        for j0, j1 in chunks(p, g):
            s = sub_group(g, j0, j1)
            if s.masked:
                add, seen = _kept_mask(p, plan, i, j0, j1)
                yield s, add, seen
            else:
                yield s, None, None


def _kept_mask(p: Problem, plan: Plan, i: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_mask` of blocks j0:j1 of group i, kept in the plan while the plan's masks stay under
    ``KEEP_ELEMS`` entries: without a bias it depends only on the mask and the sizes, which key the
    plan (a dense mask's band, gathered from its tensor, collapses to one block's mask)."""
    if p.bias is not None or not MASKS.on:
        return _mask(p, plan.groups[i], j0, j1)
    key = (p.q.dtype, p.q.device, i, j0, j1)
    got = plan.masks.get(key)
    if got is not None:
        MASKS.hits += 1
    else:
        got = _mask(p, plan.groups[i], j0, j1)
        if got[0].numel() + sum(a.numel() for a, _ in plan.masks.values()) <= KEEP_ELEMS:
            plan.masks[key] = got
    return got


def kept_for_backward(calls: list[Call]) -> list[Call] | None:
    """The forward's calls, masks and all, if their masks are small enough to keep for the backward."""
    return calls if sum(a.numel() for _, a, _ in calls if a is not None) <= KEEP_ELEMS else None


def forward(p: Problem, plan: Plan, q, k, v, calls: list[Call] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Q, dv] in q's dtype, lse [B, H, Q] float32/64) without sinks."""
    B, H, Q = p.ext.B, p.ext.H, p.ext.Q
    dv = v.shape[-1]
    ldt = compute_dtype(q)
    if (g := plan.one_call(p)) is not None:
        out, lse = _FWD(q, _k_view(k, g), _k_view(v, g), 0.0, g.causal, scale=p.scale)  # [B, H, Q, dv], [B, H, Q]
        return out, lse
    if plan.single:  # each row in at most one span: written in place, in q's dtype; rows in no span are 0, -inf
        acc = torch.empty(B, Q, H, dv, dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, Q, dv], the kernel's layout
        acc_lse = torch.empty(B, H, Q, dtype=ldt, device=q.device)
        unseen = torch.ones(Q, dtype=torch.bool)
        for g in plan.groups:
            unseen[g.r0:g.r0 + g.n * g.rows] = False
        if bool(unseen.any()):
            acc[:, :, unseen] = 0.0
            acc_lse[:, :, unseen] = float("-inf")
    else:
        acc = torch.zeros(B, H, Q, dv, dtype=ldt, device=q.device)
        acc_lse = torch.full((B, H, Q), float("-inf"), dtype=ldt, device=q.device)
    for g, add, seen in calls if calls is not None else kernel_calls(p, plan):
        out, lse = _FWD(_q_view(q, g), _k_view(k, g), _k_view(v, g), 0.0, g.causal, attn_mask=add, scale=p.scale)
        if seen is not None and not bool(seen.all()):  # the kernel gives lse 0 to a row that saw no key of the span
            lse = lse.masked_fill(~seen, float("-inf"))
        out, lse = _from_batch(out, B, g.n), _from_batch(lse, B, g.n)  # [B, H, n, rows, dv], [B, H, n, rows]
        if plan.single:
            _rows(acc, g).copy_(out)
            _rows(acc_lse, g).copy_(lse)
        else:
            merge_(_rows(acc, g), _rows(acc_lse, g), out, lse)
    return acc.to(q.dtype), acc_lse


def backward(p: Problem, plan: Plan, q, k, v, out, lse, grad_out, grad_lse, calls: list[Call] | None = None):
    """dq, dk, dv from the fused backward per span with the final out and lse (sinks included)."""
    B = p.ext.B
    g_lse = grad_lse if grad_lse is not None and bool((grad_lse != 0).any()) else None
    if g_lse is None and (g := plan.one_call(p)) is not None:  # one kernel call without a mask did it all
        return _BWD(grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, g.causal, scale=p.scale)
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=lse.dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=lse.dtype, device=q.device)
    lse_b = torch.where(torch.isfinite(lse), lse, float("inf")).to(lse.dtype)  # a row that saw nothing: P = 0
    out = out.to(q.dtype)
    grad_out = grad_out.to(q.dtype)
    if g_lse is not None:  # dS gains g·P: dq += scale·g·(P·K), dk += scale·Pᵀ·(g·q)
        gq = (q.to(lse.dtype) * (g_lse.to(lse.dtype) * p.scale)[..., None]).to(q.dtype)  # [B, H, Q, d]
    pieces = (piece for call in (calls if calls is not None else kernel_calls(p, plan))
              for piece in _split(call, B, max(1, GRAD_ELEMS // (call[0].L * k.shape[1] * k.shape[-1]))))
    for g, add in pieces:
        qg, kg, vg = _q_view(q, g), _k_view(k, g), _k_view(v, g)
        og, gog = _q_view(out, g), _q_view(grad_out, g)  # [B, H, Q, dv] -> the group's [B·n, H, rows, dv]
        lg = _q_view(lse_b[..., None], g)[..., 0]  # [B, H, Q] -> [B, H, Q, 1] -> [B·n, H, rows]
        gq_, gk_, gv_ = _BWD(gog, qg, kg, vg, og, lg, 0.0, g.causal, attn_mask=add, scale=p.scale)
        if g_lse is not None:
            pk, lk = _FWD(qg, kg, kg, 0.0, g.causal, attn_mask=add, scale=p.scale)  # P_span·K / its own sum
            w = torch.exp(lk - lg).nan_to_num(0.0)  # [B·n, H, rows]: the span's share of the row
            gs = _q_view(g_lse[..., None].to(lse.dtype) * p.scale, g)  # [B·n, H, rows, 1]
            gq_ = gq_ + pk.to(lse.dtype) * (w[..., None] * gs)
            _, _, extra = _BWD(_q_view(gq, g), qg, kg, kg, torch.zeros_like(og), lg, 0.0, g.causal,
                               attn_mask=add, scale=p.scale)  # its dV: Pᵀ·(g·q·scale)
            gk_ = gk_ + extra
        _rows(dq, g).add_(_from_batch(gq_, B, g.n))  # [B, H, n, rows, d]
        _add_keys(dk, gk_, g, B)
        _add_keys(dv, gv_, g, B)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _split(call: Call, B: int, most: int):
    """A call as calls of at most ``most`` query blocks each: (group, attn_mask) (the backward's
    dk, dv per block are [B·n, Hkv, L, x]: this bounds their memory)."""
    g, add, _ = call
    for j0 in range(0, g.n, most):
        j1 = min(g.n, j0 + most)
        part = add
        if add is not None and add.shape[0] > 1 and (j0, j1) != (0, g.n):  # one mask per block: [Bm·n, ...]
            part = add.unflatten(0, (add.shape[0] // g.n, g.n))[:, j0:j1].flatten(0, 1)  # [Bm, n, ...] -> [Bm·(j1-j0), ...]
        yield sub_group(g, j0, j1), part


def _add_keys(acc: torch.Tensor, part: torch.Tensor, g: Group, B: int) -> None:
    """acc [B, Hkv, K, x] += the gradients of the group's key spans, part [B·n, Hkv, L, x]."""
    part = part.unflatten(0, (B, g.n)).transpose(1, 2)  # [B, Hkv, n, L, x] (a view)
    if g.n == 1 or g.kstep == 0:  # every block's span is the same keys
        acc[:, :, g.k0:g.k0 + g.L] += part.sum(dim=2)
    elif g.L % g.kstep == 0:  # blocks r, r + L/kstep, … cover disjoint, adjacent spans: added as one view each
        every = g.L // g.kstep
        for r in range(min(every, g.n)):
            blocks = part[:, :, r::every]  # [B, Hkv, m, L, x]
            m = blocks.shape[2]
            start = g.k0 + r * g.kstep
            acc[:, :, start:start + m * g.L] += blocks.flatten(2, 3)  # [B, Hkv, m·L, x]
    else:
        keys = g.k0 + g.kstep * torch.arange(g.n)[:, None] + torch.arange(g.L)[None, :]  # [n, L]: each span's positions
        acc.index_add_(2, keys.reshape(-1).to(acc.device), part.flatten(2, 3).to(acc.dtype))  # [B, Hkv, n·L, x]


__all__ = ["GRAD_ELEMS", "KEEP_ELEMS", "MASKS", "backward", "forward", "fused_refuses", "kept_for_backward",
           "kernel_calls", "fused_lse"]
