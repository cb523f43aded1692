"""The "tiled" backend: FlashAttention-2's online softmax in plain PyTorch, forward and backward,
never building a tensor whose size grows with Q·K.

Mirrors FlashAttention-2 (Dao, 2023) and the Triton fused-attention tutorial, in PyTorch ops that
are batched over B and H. Inside, query heads are grouped by the key/value head they share
(G = H / Hkv) and the rows of a row group are (query, group) pairs, ``"b (hkv g) q d -> (b hkv)
(q g) d"``, so one ``bmm`` per tile serves all G heads of a K/V head: GQA without copying K and V.
``tiled_plan`` decides which rectangles ``[r0:r1, k0:k1]`` of the score grid are computed: tall
ones where the mask is full, single blocks where it is partial, none where it is empty.

What keeps it close to PyTorch's fused kernel (on the CPU every pass over the score tile costs
about as much as a pass of the matmuls; fresh allocations cost page faults):

- every buffer is allocated once per call and filled with ``out=`` / in-place ops;
- the scale is folded into the queries once, and the row offset (the running max m in the
  forward, lse in the backward) is folded into the Q·Kᵀ matmul as one extra column:
  ``[q·scale, -m] · [k, 1]ᵀ = S - m``; in the backward ``[dO, -D] · [v, 1]ᵀ = dP - D``;
- scores are kept in base 2 (log2(e) folded into the scale) and exponentiated with ``exp2``, as
  FlashAttention does; here it also matters because ``torch.exp`` on the CPU takes a slow path
  for -inf (masked) and underflowing inputs, up to 90× slower than ``exp2``;
- the running max is raised only when a tile's row max exceeds it by more than ``TAU`` ("lazy
  rescaling"), and once every row of a row group has a real max, tiles skip the max pass: exp2
  runs first, and a tile whose row sums exceed 2^24 (a max that grew) is redone with it. Entries
  of 2^(S - m) stay below 2^24 and m never exceeds the true max, so the result is exact to
  rounding (the max only keeps exp2 from overflowing);
- empty tiles of a structured mask are skipped, full tiles never evaluate the mask (``tiled_plan``);
- the (batch, key/value head) slices are shared out among ``torch.get_num_threads()`` worker
  threads running single-threaded ops (see ``_in_parallel``).

Low precision (fp16/bf16) is computed in float32 and rounded once at the end, like PyTorch's math
path; float64 stays float64.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from ..bias import Bias, Dense as DenseBias, Sum as BiasSum
from ..shapes import Sizes, tile_of
from .problem import Problem
from .tiled_plan import Plan, plan_for, split, workers

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
TAU = 12.0  # rescale only when a row's max grows by more than this, in base 2 (2^12 = 4096)
_SUM_LIMIT = 2.0**24  # a tile's row sum above this sends the tile back through the max pass
_BIG = 1e30  # stands in for lse = -inf in the folded column: 2^(S - BIG) = 0
_NEG_INF = float("-inf")

__all__ = ["forward", "backward", "run", "why_not", "TAU"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in ``t``: a finite sum proves it without a bool copy of ``t``."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=_compute_dtype(t)))):
        return True
    return bool(torch.isfinite(t).all())


class _Buffer:
    """One allocation reused for contiguous tensors of varying shape (at most ``numel`` elements)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.flat = torch.empty(max(1, numel), dtype=dtype, device=device)

    def take(self, *shape: int) -> torch.Tensor:
        return self.flat[: math.prod(shape)].view(shape)


def _as5(t: torch.Tensor, part: tuple[slice, slice], Hkv: int, G: int) -> torch.Tensor:
    """A mask or bias tile [#B, #H, #q, #k] (or fewer leading axes) of the whole call -> the rows
    of this worker's (batch, head) slice, broadcastable to its score view [B, Hkv, q, G, k]."""
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # [#B, #H, #q, #k]
    if t.shape[0] != 1:
        t = t[part[0]]
    if t.shape[1] == 1:
        return t.unsqueeze(3)  # [#B, 1, #q, 1, #k]
    return t[:, part[1]].unflatten(1, (Hkv, G)).transpose(2, 3)  # [#B, (Hkv G), #q, #k] -> [#B, Hkv, #q, G, #k]


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scratch: "_Buffer") -> None:
    """``acc += a @ b`` (batched). ``baddbmm_`` into a non-contiguous ``acc`` (a row slice) falls
    back to one ``addmm_`` per batch entry; then the product goes through a scratch buffer."""
    if acc.is_contiguous():
        acc.baddbmm_(a, b)
    else:
        acc.add_(torch.bmm(a, b, out=scratch.take(*acc.shape)))


def _bias_and_mask_(s: torch.Tensor, p: Problem, part: tuple[slice, slice], shape: tuple[int, int, int, int, int],
                    r0: int, r1: int, k0: int, k1: int, partial: bool, finite: bool) -> None:
    """Add the bias (scaled to base 2) and, on a partial tile, the mask to the score tile ``s``
    [(B Hkv), (q G), k] in place; ``shape`` = (B, Hkv, q, G, k) is the same tile's grouped view."""
    B, Hkv, _, G, _ = shape
    s5 = s.view(shape)  # [(B Hkv), (q G), k] -> [B, Hkv, q, G, k]
    ext, dev, dt = p.ext, s.device, s.dtype
    if p.bias is not None:
        s5.add_(_as5(p.bias.block(ext, r0, r1, k0, k1, dev, dt), part, Hkv, G), alpha=LOG2E)
    if partial:
        mask5 = _as5(_mask_tile(p, r0, r1, k0, k1, dev, dt, finite), part, Hkv, G)
        if finite:
            s5.add_(mask5)  # 0 / -inf
        else:
            s5.masked_fill_(~mask5, _NEG_INF)


def _mask_tile(p: Problem, q0: int, q1: int, k0: int, k1: int, dev, dt, additive: bool) -> torch.Tensor:
    """The mask on one tile: a bool tile (True = may attend) or, when ``additive``, a float tile of
    0 / -inf (adding it is cheaper than masked_fill over every row, but keeps NaN scores NaN)."""
    allowed = p.mask.block(p.ext, q0, q1, k0, k1, dev)  # [#B, #H, q, k] (or fewer leading axes)
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=dt, device=dev).masked_fill_(~allowed, _NEG_INF)


_POOL: tuple[ThreadPoolExecutor, int] | None = None  # (pool, its number of threads)
_POOL_LOCK = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least ``n`` worker threads, kept between calls: a fresh thread
    pays for its first matmuls (MKL sets up per thread), about 10 ms per call here."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[1] < n:
            old, _POOL = _POOL, (ThreadPoolExecutor(max_workers=n, thread_name_prefix="bhqk-tiled"), n)
            if old is not None:
                old[0].shutdown(wait=False)
        return _POOL[0]


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _in_parallel(jobs: list[Callable[[], object]]) -> list:
    """Run ``jobs``: inline when there is one (PyTorch's intra-op threads then split each op);
    otherwise on worker threads, each running single-threaded ops, so that no op waits at an
    OpenMP barrier for a thread the OS has descheduled (on a shared machine that wait made the
    many small ops of a tile loop up to ten times slower)."""
    if len(jobs) == 1:
        return [jobs[0]()]
    threads = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()  # thread-local, like grad mode: carried over by hand

    def work(job):
        torch.set_num_threads(1)  # this thread's OpenMP and MKL setting (and the default for new threads)
        try:
            with torch.inference_mode() if inference else torch.no_grad():
                return job()
        finally:
            torch.set_num_threads(threads)

    pool = _pool(len(jobs))
    futures = [pool.submit(work, job) for job in jobs]
    return [f.result() for f in futures]


def _query_heads(hs: slice, G: int) -> slice:
    """The query heads served by the key/value heads ``hs``."""
    return hs if hs.start is None and hs.stop is None else slice(hs.start * G, hs.stop * G)


def _balance(rows: list, n: int) -> list[list]:
    """Row groups dealt to ``n`` workers, each getting about the same number of rectangles."""
    load, groups = [0] * n, [[] for _ in range(n)]
    for row in sorted((r for r in rows if r[2]), key=lambda r: -len(r[2])):
        w = load.index(min(load))
        groups[w].append(row)
        load[w] += len(row[2]) + 1
    return [g for g in groups if g]


def _per_query_head(p: Problem) -> Problem:
    """The same call with K and V repeated per query head (Hkv = H): the slow path taken only when
    K or V hold NaN/inf, so that each query head can zero the rows it may not attend."""
    G = p.q.shape[1] // p.k.shape[1]
    k = p.k.repeat_interleave(G, dim=1)  # [B, Hkv, K, d] -> [B, H, K, d]
    v = p.v.repeat_interleave(G, dim=1)  # [B, Hkv, K, dv] -> [B, H, K, dv]
    sizes = Sizes(**{**p.sizes.size, "Hkv": p.q.shape[1]})
    return dataclasses.replace(p, k=k, v=v, sizes=sizes)


def _reachable_rows(s: torch.Tensor, *blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero the key rows of ``blocks`` [n, k, x] that no row of the score tile ``s`` [n, r, k]
    may attend (all -inf), so that NaN/inf held there cannot reach the result through 0·NaN."""
    reach = (s > _NEG_INF).any(dim=1)  # [n, k]
    if bool(reach.all()):
        return blocks
    return tuple(b.masked_fill(~reach[..., None], 0.0) for b in blocks)  # [n, k, x]


def _key_span(k: torch.Tensor, v: torch.Tensor, k0: int, k1: int, KB: "_Buffer", VB: "_Buffer", ones_v: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``k0:k1`` as ``[B·Hkv, k1-k0, d+1]`` with a column of ones (copied into ``KB``), and the
    values as ``[B·Hkv, k1-k0, dv]`` (``dv+1`` with ones when ``ones_v``): a view of v where its
    dtype and strides allow, else copied into ``VB``."""
    B, Hkv, _, d = k.shape
    dv, w, dt = v.shape[-1], k1 - k0, KB.flat.dtype
    kt = KB.take(B * Hkv, w, d + 1)
    kt.view(B, Hkv, w, d + 1)[..., :d].copy_(k[:, :, k0:k1])  # [B, Hkv, w, d] -> [(B Hkv), w, d]
    kt[..., d] = 1.0
    if not ones_v and v.dtype == dt and (B == 1 or Hkv == 1 or v.stride(0) == Hkv * v.stride(1)):
        return kt, v[:, :, k0:k1].flatten(0, 1)  # [B, Hkv, w, dv] -> [(B Hkv), w, dv], a view
    vt = VB.take(B * Hkv, w, dv + int(ones_v))
    vt.view(B, Hkv, w, -1)[..., :dv].copy_(v[:, :, k0:k1])  # [B, Hkv, w, dv] -> [(B Hkv), w, dv(+1)]
    if ones_v:
        vt[..., dv] = 1.0
    return kt, vt


def forward(p: Problem, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, Q, dv] in the input dtype and lse [B, H, Q] (float32; float64 for float64
    input; -inf for fully masked rows, whose output is 0). No autograd graph is built."""
    with torch.no_grad():
        return _forward(p, plan if plan is not None else plan_for(p))


def _forward(p: Problem, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Q, _ = p.q.shape
    Hkv, dv = p.k.shape[1], p.v.shape[-1]
    out = torch.zeros(B, H, Q, dv, dtype=p.q.dtype, device=p.q.device)
    lse = torch.full((B, H, Q), _NEG_INF, dtype=_compute_dtype(p.q), device=p.q.device)
    if Q == 0 or plan.tiles == 0:
        return out, lse
    finite = _all_finite(p.k) and _all_finite(p.v)
    if not finite and H > Hkv:
        return _forward(_per_query_head(p), plan)
    finite = finite and _all_finite(p.q)  # scores are finite: masks may be added as 0 / -inf
    parts = split(B, Hkv, workers())
    if len(parts) > 1 or workers() == 1 or len(plan.rows) == 1:
        jobs = [partial(_forward_part, p, plan.rows, out, lse, part, finite) for part in parts]
    else:  # one batch element and one K/V head: the workers share out the row groups instead
        jobs = [partial(_forward_part, p, rows, out, lse, parts[0], finite) for rows in _balance(plan.rows, workers())]
    _in_parallel(jobs)
    return out, lse


def _forward_part(p: Problem, rows: list, out: torch.Tensor, lse: torch.Tensor, part: tuple[slice, slice], finite: bool) -> None:
    """The row groups ``rows`` of one (batch, key/value-head) slice, written into out and lse."""
    G = p.groups
    bs, hq = part[0], _query_heads(part[1], p.groups)
    q, k, v = p.q[bs, hq], p.k[part], p.v[part]  # this worker's slice: [B, H, Q, d], [B, Hkv, K, ·]
    B, H, Q, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    n, dt, dev = B * Hkv, _compute_dtype(q), q.device
    tiles_all = [t for _, _, tiles in rows for t in tiles]
    if not tiles_all:
        return  # every query of these groups is fully masked: out stays 0, lse -inf
    fold = p.softcap is None  # with softcap the offset is subtracted after tanh instead
    qscale = p.scale * LOG2E if fold else p.scale / p.softcap  # scores in base 2 (softcap: tanh's argument)
    span = max(k1 - k0 for _, _, k0, k1, _ in tiles_all)
    KB, VB = _Buffer(n * span * (d + 1), dt, dev), _Buffer(n * span * dv, dt, dev)  # one key span at a time
    R = G * max(q1 - q0 for q0, q1, tiles in rows if tiles)  # most rows of a group
    S = _Buffer(n * G * max((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _ in tiles_all), dt, dev)
    Qb, A = _Buffer(n * R * (d + 1), dt, dev), _Buffer(n * R * dv, dt, dev)
    L, M, MT, T = (_Buffer(n * R, dt, dev) for _ in range(4))
    NEED, HAS = _Buffer(n * R, torch.bool, dev), _Buffer(n * R, torch.bool, dev)
    PV = _Buffer(n * R * dv, dt, dev)  # scratch for P·V of a rectangle that covers part of a group
    q5 = q.unflatten(1, (Hkv, G))  # [B, Hkv, G, Q, d]
    out5, lse5 = out[bs, hq].unflatten(1, (Hkv, G)), lse[bs, hq].unflatten(1, (Hkv, G))  # [B, Hkv, G, Q, ·]

    for q0, q1, tiles in rows:
        if not tiles:
            continue  # every key masked: out stays 0, lse -inf
        bq = q1 - q0
        r = bq * G
        qi = Qb.take(n, r, d + 1)  # rows (q, g) of this group: [q·scale, -m]
        qv = qi.view(B, Hkv, bq, G, d + 1)[..., :d]  # [(B Hkv), (bq G), d+1] as [B, Hkv, bq, G, d]
        qv.copy_(q5[:, :, :, q0:q1].transpose(2, 3))  # [B, Hkv, G, bq, d] -> [B, Hkv, bq, G, d]
        qv.mul_(qscale)
        qi[..., d] = 0.0
        acc, l, m, has = A.take(n, r, dv).zero_(), L.take(n, r).zero_(), M.take(n, r).zero_(), HAS.take(n, r).zero_()
        all_have = False  # m is a stand-in 0 until a row has seen a finite score (has)
        for r0, r1, k0, k1, partial_tile in tiles:
            a, b, kw = G * (r0 - q0), G * (r1 - q0), k1 - k0  # this rectangle's rows (q, g) of the group
            qt, acct, lt, mt_, hast = qi[:, a:b], acc[:, a:b], l[:, a:b], m[:, a:b], has[:, a:b]
            s = S.take(n, b - a, kw)
            kt, vt = _key_span(k, v, k0, k1, KB, VB, ones_v=False)  # [n, kw, d+1], [n, kw, dv]

            def scores() -> torch.Tensor:  # (S - m) in base 2 for this rectangle, masked, in s [n, rows, kw]
                torch.bmm(qt, kt.transpose(1, 2), out=s)  # [n, rows, kw]  (S/c with softcap)
                if not fold:
                    s.tanh_().mul_(p.softcap * LOG2E).sub_(mt_[..., None])
                _bias_and_mask_(s, p, (bs, hq), (B, Hkv, r1 - r0, G, kw), r0, r1, k0, k1, partial_tile, finite)
                return s

            scores()
            if not finite:
                vt = _reachable_rows(s, vt)[0]  # [n, kw, dv]
            tmp = T.take(n, r)[:, a:b]
            if all_have:  # optimistic: every row has a real offset m; exp2 without a max pass
                s.exp2_()
                torch.sum(s, dim=-1, out=tmp)
                if not bool((tmp > _SUM_LIMIT).any()):  # no row grew by more than 2^24: accept
                    lt.add_(tmp)
                    _add_mm(acct, s, vt, PV)
                    continue
                scores()  # some row's max grew: redo this rectangle with the max pass
            mx = MT.take(n, r)[:, a:b]
            torch.amax(s, dim=-1, out=mx)  # [n, rows]
            need = torch.gt(mx, TAU, out=NEED.take(n, r)[:, a:b])
            if not all_have:
                seen = mx > _NEG_INF  # NaN and -inf rows have not seen a finite score
                need |= seen & ~hast
                hast |= seen
                all_have = bool(has.all())
            if bool(need.any()):
                delta = torch.where(need, mx, 0.0)  # [n, rows]: raise m by the excess
                s.sub_(delta[..., None])
                alpha = torch.exp2(-delta).clamp_(max=1.0)  # rows with nothing accumulated may get any value
                acct.mul_(alpha[..., None])
                lt.mul_(alpha)
                mt_.add_(delta)
                if fold:
                    qt[..., d].sub_(delta)
            s.exp2_()  # P·l (unnormalized)
            torch.sum(s, dim=-1, out=tmp)
            lt.add_(tmp)
            _add_mm(acct, s, vt, PV)  # [n, rows, dv]
        lse5[:, :, :, q0:q1] = ((m + torch.log2(l)) * LN2).view(B, Hkv, bq, G).transpose(2, 3)  # rows (q, g) -> [B, Hkv, G, q]
        l_safe = torch.where(l > 0, l, 1.0)  # fully masked rows: acc = 0, out = 0
        torch.div(acc.view(B, Hkv, bq, G, dv), l_safe.view(B, Hkv, bq, G, 1),
                  out=out5[:, :, :, q0:q1].transpose(2, 3))  # [B, Hkv, q, G, dv] -> [B, Hkv, G, q, dv]


def backward(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             dlse: torch.Tensor | None = None, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward from the given ``out`` [B, H, Q, dv] and ``lse`` [B, H, Q] (which
    may be global ones when ``p`` covers only part of the keys): ``D = rowsum(dout ∘ out) - dlse``;
    per tile ``P = exp(S - lse)``, ``dV += Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ - D)``, ``dQ += dS·K·scale``,
    ``dK += dSᵀ·Q·scale`` (softcap's tanh' applied to dS; GQA heads summed into Hkv).
    Returns (dq [B, H, Q, d], dk [B, Hkv, K, d], dv [B, Hkv, K, dv]) in the input dtypes."""
    dq, dk, dv, _ = _backward(p, out, lse, dout, dlse, plan if plan is not None else plan_for(p), ())
    return dq, dk, dv


def _backward(p: Problem, out, lse, dout, dlse, plan: Plan, biases: tuple[DenseBias, ...]):
    """(dq, dk, dv, [grad of each dense bias in ``biases``])."""
    with torch.no_grad():
        return _backward_ng(p, out, lse, dout, dlse, plan, biases)


def _backward_ng(p: Problem, out, lse, dout, dlse, plan: Plan, biases):
    B, H, Q, _ = p.q.shape
    Hkv = p.k.shape[1]
    G, dt = H // Hkv, _compute_dtype(p.q)
    dq = torch.zeros_like(p.q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(p.k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(p.v, memory_format=torch.contiguous_format)
    gbias = [torch.zeros(b.tensor.shape, dtype=dt, device=p.q.device) for b in biases]  # [#B, #H, #Q, #K]
    if Q == 0 or plan.tiles == 0:
        return dq, dk, dv, [g.to(b.tensor.dtype) for g, b in zip(gbias, biases)]
    finite = _all_finite(p.k) and _all_finite(p.v)
    if not finite and G > 1:
        dq, dk, dv, gb = _backward_ng(_per_query_head(p), out, lse, dout, dlse, plan, biases)
        return dq, dk.unflatten(1, (Hkv, G)).sum(2), dv.unflatten(1, (Hkv, G)).sum(2), gb  # [B, (Hkv G), K, ·] -> [B, Hkv, K, ·]
    finite = finite and _all_finite(p.q)  # scores are finite: masks may be added as 0 / -inf
    parts = split(B, Hkv, workers())
    grads = _in_parallel([partial(_backward_part, p, plan, out, lse, dout, dlse, dq, dk, dv, biases, part, finite)
                          for part in parts])
    for (bs, hs), part_grads in zip(parts, grads):
        hq = _query_heads(hs, G)
        for g, gp in zip(gbias, part_grads):
            g[bs if g.shape[0] != 1 else slice(None), hq if g.shape[1] != 1 else slice(None)] += gp
    return dq, dk, dv, [g.to(b.tensor.dtype) for g, b in zip(gbias, biases)]


def _backward_part(p: Problem, plan: Plan, out, lse, dout, dlse, dq_all, dk_all, dv_all, biases, part, finite: bool) -> list:
    """One (batch, key/value-head) slice: writes its rows of dq, dk, dv; returns its share of the
    dense bias gradients (shaped as the bias, restricted to the slice)."""
    G = p.groups
    bs, hs = part
    hq = _query_heads(hs, G)
    q, k, v = p.q[bs, hq], p.k[part], p.v[part]  # this worker's slice
    B, H, Q, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    n, dt, dev = B * Hkv, _compute_dtype(q), q.device
    fold = p.softcap is None
    qscale = p.scale * LOG2E if fold else p.scale / p.softcap  # scores in base 2 (softcap: tanh's argument)
    q5, do5 = q.unflatten(1, (Hkv, G)), dout[bs, hq].unflatten(1, (Hkv, G))  # [B, Hkv, G, Q, ·]

    # per row (q, g): D = rowsum(dO∘O) - dlse and lse in base 2, [n, Q·G]; small, so kept whole
    D = torch.empty(B, Hkv, Q, G, dtype=dt, device=dev)
    o5 = out[bs, hq].unflatten(1, (Hkv, G))  # [B, Hkv, G, Q, dv]
    for q0, q1, _ in plan.rows:
        D[:, :, q0:q1] = torch.einsum("bhgqv,bhgqv->bhqg", o5[:, :, :, q0:q1].to(dt), do5[:, :, :, q0:q1].to(dt))
    if dlse is not None:
        D -= dlse[bs, hq].unflatten(1, (Hkv, G)).transpose(2, 3).to(dt)  # lse's own gradient: dS += P·dlse
    D = D.view(n, Q * G)  # [(B Hkv), (Q G)]
    lse2 = lse[bs, hq].unflatten(1, (Hkv, G)).transpose(2, 3).to(dt)  # [B, Hkv, Q, G]
    lse2 = torch.where(lse2 > _NEG_INF, lse2 * LOG2E, _BIG).reshape(n, Q * G)  # base 2; fully masked: 2^(S - BIG) = 0
    dq_w = dq_all[bs, hq]  # [B, H, Q, d]
    direct = G == 1 and dq_w.dtype == dt and (B == 1 or H == 1 or dq_w.stride(0) == H * dq_w.stride(1))
    dq3 = dq_w.flatten(0, 1) if direct else torch.zeros(n, Q * G, d, dtype=dt, device=dev)  # rows (q, g)

    spans = [k1 - k0 for k0, k1, _ in plan.cols]
    rect = max(G * (r1 - r0) * (k1 - k0) for k0, k1, tiles in plan.cols for _, r0, r1, _ in tiles)
    rows_max = G * max(r1 - r0 for _, _, tiles in plan.cols for _, r0, r1, _ in tiles)
    S, DP = _Buffer(n * rect, dt, dev), _Buffer(n * rect, dt, dev)
    TH = _Buffer(n * rect, dt, dev) if not fold else None
    QT, OT = _Buffer(n * rows_max * (d + 1), dt, dev), _Buffer(n * rows_max * (dv + 1), dt, dev)
    KB, VB = _Buffer(n * max(spans) * (d + 1), dt, dev), _Buffer(n * max(spans) * (dv + 1), dt, dev)
    DK, DV = _Buffer(n * max(spans) * d, dt, dev), _Buffer(n * max(spans) * dv, dt, dev)
    DQ = _Buffer(n * rows_max * d, dt, dev)  # scratch for dS·K into a row slice of dq
    gbias = [torch.zeros(_sliced_shape(b.tensor.shape, B, H), dtype=dt, device=dev) for b in biases]
    dk_w, dv_w = dk_all[part], dv_all[part]  # [B, Hkv, K, ·]

    for k0, k1, tiles in plan.cols:
        kw = k1 - k0
        kj, vj = _key_span(k, v, k0, k1, KB, VB, ones_v=True)  # [n, kw, d+1], [n, kw, dv+1]
        dkj, dvj = DK.take(n, kw, d).zero_(), DV.take(n, kw, dv).zero_()
        for _, r0, r1, partial_tile in tiles:
            a, b = G * r0, G * r1  # rows (q, g) of this rectangle
            qt, ot = QT.take(n, b - a, d + 1), OT.take(n, b - a, dv + 1)  # [q·scale, -lse], [dO, -D]
            qv = qt.view(B, Hkv, r1 - r0, G, d + 1)[..., :d]  # [(B Hkv), (q G), d+1] as [B, Hkv, q, G, d]
            qv.copy_(q5[:, :, :, r0:r1].transpose(2, 3))  # [B, Hkv, G, q, d] -> [B, Hkv, q, G, d]
            qv.mul_(qscale)
            if fold:
                torch.neg(lse2[:, a:b], out=qt[..., d])
            else:
                qt[..., d] = 0.0
            ot.view(B, Hkv, r1 - r0, G, dv + 1)[..., :dv].copy_(do5[:, :, :, r0:r1].transpose(2, 3))  # dO, rows (q, g)
            torch.neg(D[:, a:b], out=ot[..., dv])
            s = S.take(n, b - a, kw)
            torch.bmm(qt, kj.transpose(1, 2), out=s)  # [n, rows, kw] = (S - lse) in base 2  (S/c with softcap)
            if not fold:
                th = TH.take(n, b - a, kw)
                th.copy_(s.tanh_())
                s.mul_(p.softcap * LOG2E).sub_(lse2[:, a:b, None])
            _bias_and_mask_(s, p, (bs, hq), (B, Hkv, r1 - r0, G, kw), r0, r1, k0, k1, partial_tile, finite)
            kt, vt = (kj, vj) if finite else _reachable_rows(s, kj, vj)
            s.exp2_()  # P
            dvj.baddbmm_(s.transpose(1, 2), ot[..., :dv])  # dV += Pᵀ·dO   [n, kw, dv]
            dp = DP.take(n, b - a, kw)
            torch.bmm(ot, vt.transpose(1, 2), out=dp)  # dP - D  [n, rows, kw]
            dp.mul_(s)  # dS = P ∘ (dP - D)
            for g in gbias:
                _add_bias_grad(g, dp, B, Hkv, G, r0, r1, k0, k1)
            if not fold:
                th.mul_(th)
                dp.addcmul_(dp, th, value=-1.0)  # through softcap: dS ∘ (1 - tanh²)
            _add_mm(dq3[:, a:b], dp, kt[..., :d], DQ)  # dQ += dS·K   [n, rows, d]
            dkj.baddbmm_(dp.transpose(1, 2), qt[..., :d])  # dK += dSᵀ·(Q·scale)   [n, kw, d]
        dkj.mul_(p.softcap if not fold else LN2)  # qt held q·scale/c, or q·scale·log2(e)
        dk_w[:, :, k0:k1] += dkj.view(B, Hkv, kw, d)  # [(B Hkv), kw, d] -> [B, Hkv, kw, d]; spans may overlap
        dv_w[:, :, k0:k1] += dvj.view(B, Hkv, kw, dv)  # [(B Hkv), kw, dv] -> [B, Hkv, kw, dv]

    if direct:
        dq3.mul_(p.scale)
    else:
        dq_w.unflatten(1, (Hkv, G)).copy_(dq3.view(B, Hkv, Q, G, d).transpose(2, 3).mul_(p.scale))  # rows (q, g) -> [B, Hkv, G, Q, d]
    return gbias


def _sliced_shape(shape, B: int, H: int) -> tuple[int, ...]:
    """A bias shape [#B, #H, #Q, #K] restricted to a worker's B batch elements and H heads."""
    return (B if shape[0] != 1 else 1, H if shape[1] != 1 else 1, shape[2], shape[3])


def _add_bias_grad(g: torch.Tensor, ds: torch.Tensor, B: int, Hkv: int, G: int, q0: int, q1: int, k0: int, k1: int) -> None:
    """Add the tile dS [(B Hkv), (q G), k] into a dense bias gradient g [#B, #H, #Q, #K]."""
    t = ds.view(B, Hkv, q1 - q0, G, k1 - k0).transpose(2, 3).reshape(B, Hkv * G, q1 - q0, k1 - k0)  # -> [B, H, q, k]
    axes = [a for a in range(4) if g.shape[a] == 1 and t.shape[a] != 1]
    if axes:
        t = t.sum(dim=axes, keepdim=True)  # broadcast axes of the bias get the sum
    tile_of(g, q0, q1, k0, k1).add_(t)  # a view of g: the tile, or its broadcast axis whole


def _dense_parts(bias: Bias | None) -> list[DenseBias]:
    if isinstance(bias, DenseBias):
        return [bias]
    if isinstance(bias, BiasSum):
        return _dense_parts(bias.a) + _dense_parts(bias.b)
    return []


class _TiledAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse (never P); the backward recomputes each tile's P."""

    @staticmethod
    def forward(ctx, p: Problem, plan: Plan, dense: tuple, q, k, v, *bias_tensors):
        out, lse = _forward(p, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.p = dataclasses.replace(p, q=None, k=None, v=None)
        ctx.plan, ctx.dense = plan, dense
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        p = dataclasses.replace(ctx.p, q=q, k=k, v=v)
        if dout is None:
            dout = torch.zeros_like(out)
        dense = tuple(b for b, need in zip(ctx.dense, ctx.needs_input_grad[6:]) if need)
        dq, dk, dv, gb = _backward(p, out, lse, dout, dlse, ctx.plan, dense)
        it = iter(gb)
        grads = [next(it) if need else None for need in ctx.needs_input_grad[6:]]
        return None, None, None, dq, dk, dv, *grads


def why_not(p: Problem, need_lse: bool) -> str | None:
    if p.dropout_p > 0:
        return "the tiled backend has no dropout (use backend='torch' or 'reference' for dropout_p > 0)"
    return None


def run(p: Problem, need_lse: bool = False, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry: out [B, H, Q, dv] and, when asked, lse [B, H, Q]; differentiable in
    q, k, v, a dense bias, and lse itself when the inputs require grad. ``plan``: the tile plan
    ``auto`` made while estimating (default: plan now)."""
    plan = plan_for(p) if plan is None else plan
    dense = tuple(b for b in _dense_parts(p.bias) if b.tensor.requires_grad)
    if torch.is_grad_enabled() and (dense or any(t.requires_grad for t in (p.q, p.k, p.v))):
        out, lse = _TiledAttention.apply(p, plan, dense, p.q, p.k, p.v, *(b.tensor for b in dense))
    else:
        out, lse = forward(p, plan)
    return out, (lse if need_lse else None)
