"""The "tiled" backend: FlashAttention-2's online softmax in plain PyTorch, forward and backward,
never building a tensor whose size grows with Q·K.

The forward is Algorithm 1 of FlashAttention-2 (Dao, 2023; the comment before :func:`forward`), the
backward its Algorithm 2 (P recomputed per tile from the saved out and lse; before :func:`backward`),
in PyTorch ops batched over B and H. Query heads are grouped by the key/value head they share
(G = H / Hkv): the rows of a query block ("row group") are (query, group) pairs,
``"b (hkv g) q d -> (b hkv) (q g) d"``, so one ``bmm`` per tile serves all G heads of a K/V head
(GQA without copying K and V). ``tiled_plan`` chooses the rectangles ``[r0:r1, k0:k1]`` of the
score grid that are computed (tall where the mask is full, single blocks where it is partial).

Deltas from Algorithm 1, each marked "Δ from Alg. 1" next to the code: on the CPU a pass over a
score tile costs about as much as a matmul, so they save passes. Base 2 (log2 e and the scale
folded into Q_i, ``exp2``; ``torch.exp`` on the CPU is up to 90× slower on -inf and underflow);
-m folded into the Q·Kᵀ matmul as an extra column, with m starting at a stand-in 0; lazy
rescaling (``_max_pass``, threshold ``TAU``); the optimistic exponent (CPU path); the plan's
skipped, joined and partial-row rectangles. Fully masked rows give out 0 and lse -inf; sinks join
each row's denominator at the end (lse includes them; gradient :func:`sinks_grad`); dropout
zeroes P̃'s entries after its row sums by a keep-mask regenerated per tile (``tiled_dropout``).

Every buffer is allocated once per call and filled with ``out=`` / in-place ops (fresh allocations
cost page faults). On the CPU the (batch, key/value head) slices, or the row groups of a single
slice, are shared out among worker threads running single-threaded ops (``tiled_threads``).
fp16/bf16 are computed in float32 and rounded once at the end; float64 stays float64. NaN/inf in
k or v (found by a check over them) take slow paths: the mask applied with masked_fill, key rows
no row of a tile may attend zeroed, NaN/inf in v replaced by 0 and counted per row that may attend
them (``nonfinite``). A bias's huge finite negative values (``finfo.min``) stay finite in base 2.

Axes: q [B, H, Q, d], k [B, Hkv, K, d], v [B, Hkv, K, dv] (docs/design.md §1). A worker's slice:
``Bw``, ``Hkvw`` its batch elements and key/value heads (Hw = Hkvw·G query heads), ``n = Bw·Hkvw``
the batch axis of every bmm; ``(q g)`` a row group's rows, R = (q1 - q0)·G of them (a rectangle's
rows r0:r1 are a:b = G·(r0 - q0) : G·(r1 - q0)); ``kw`` a rectangle's keys k0:k1. Score tiles are
[n, rows, kw]; queries carry a folded column, [n, rows, d+1]; keys a column of ones, [n, kw, d+1].

The device path (any non-CPU device; CPU tensors too inside ``tiled_plan.device_mode()``, a test
tool) makes no host sync inside the tile loops: one worker, its one job run inline; no optimistic
exponent; the lazy rescaling decided with ``torch.where`` (``_exponent_device``); unreachable key
rows always masked; the mask's and bias's tensors moved to the device once per pass (``staged``).
Its plan comes from ``tiled_plan.CUDA_MODEL`` (a guess, not measured). Host syncs that remain, per
call: one bool per finiteness check of k, v and q (``all_finite``: a sum each; q only when k and v
are finite; on the non-finite slow path a full check of each tensor whose sum is not finite,
``finite_part``'s check of v, and the checks again on the per-query-head copies under GQA), in the
forward and again in the backward. Planning reads a mask's device-held tensors where its
classification needs them (a document mask's ids: the min and max of each range visited; a dense
mask's tile classes per candidate grid; both cached on the mask; a predicate is classified on the
CPU). Padding lengths and key-padding validity are read when the mask is built, a dense bias's
finite floor when the bias is built (``bias.Dense``: per call when a tensor is passed); the dropout
seed is drawn on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from ..bias import Dense as DenseBias
from ..bias import clamp_finite, dense_parts
from ..shapes import Sizes, all_finite, as_4d, compute_dtype, per_query_head, tile_of
from .merge import sinks_grad  # the sinks' gradient, beside merge.with_sinks (tiled.sinks_grad for ring attention)
from .nonfinite import finite_part, poison
from .problem import Problem
from .tiled_dropout import KeepBits, drop_, dropout_keep, dropout_seed, seeded
from .tiled_plan import Plan, Rect, RowGroup, device_mode, on_device, plan_for, split, workers
from .tiled_threads import balance, in_parallel

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
TAU = 12.0  # rescale only when a row's max grows by more than this, in base 2 (2^12 = 4096)
_SUM_LIMIT = 2.0**24  # a tile's row sum above this sends the tile back through the max pass
_BIG = 1e30  # stands in for lse = -inf in the folded column: 2^(S - BIG) = 0
_NEG_INF = float("-inf")

__all__ = ["TAU", "backward", "device_mode", "dropout_keep", "dropout_seed", "forward", "run", "sinks_grad", "why_not"]


# ---- the pieces of one call ------------------------------------------------------------------------


class _Buffer:
    """One allocation reused for contiguous tensors of varying shape (at most ``numel`` elements)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.flat = torch.empty(max(1, numel), dtype=dtype, device=device)

    def take(self, *shape: int) -> torch.Tensor:
        return self.flat[: math.prod(shape)].view(shape)


@dataclass(frozen=True)
class _Kernel:
    """What every rectangle of one worker's slice needs: the call, the slice and the settings."""

    p: Problem
    b: slice  # the slice's batch elements
    hkv: slice  # its key/value heads
    hq: slice  # the query heads they serve
    Bw: int
    Hkvw: int
    G: int
    finite: bool  # every score is finite: the mask may be added as 0 / -inf
    floor_bias: bool  # the bias holds finite values that overflow in base 2: keep them finite
    dt: torch.dtype
    device: torch.device
    on_device: bool  # the device path: every per-rectangle decision made with tensor ops, no host sync

    @classmethod
    def of(cls, p: Problem, part: tuple[slice, slice], finite: bool) -> _Kernel:
        G = p.groups
        hq = _query_heads(part[1], G)
        Bw, Hkvw = p.k[part].shape[:2]
        dt = compute_dtype(p.q)
        floor_bias = p.bias is not None and p.bias.floor * LOG2E < -torch.finfo(dt).max
        return cls(p, part[0], part[1], hq, Bw, Hkvw, G, finite, floor_bias, dt, p.q.device, on_device(p.q.device))

    @property
    def n(self) -> int:
        return self.Bw * self.Hkvw

    @property
    def fold(self) -> bool:
        """The row offset rides in the Q·Kᵀ matmul (without softcap; with it, it is subtracted after tanh)."""
        return self.p.softcap is None

    @property
    def cap(self) -> float:
        """The softcap c (only read when there is one)."""
        assert self.p.softcap is not None
        return self.p.softcap

    @property
    def qscale(self) -> float:
        """What q is multiplied by: scores in base 2 (with softcap: tanh's argument)."""
        return self.p.scale * LOG2E if self.fold else self.p.scale / self.cap


def _query_heads(hs: slice, G: int) -> slice:
    """The query heads served by the key/value heads ``hs``."""
    return hs if hs.start is None and hs.stop is None else slice(hs.start * G, hs.stop * G)


def _grouped(t: torch.Tensor, kn: _Kernel) -> torch.Tensor:
    """A worker's slice of a per-query-head tensor, its heads grouped by the K/V head they share."""
    return t[kn.b, kn.hq].unflatten(1, (kn.Hkvw, kn.G))  # [B, H, Q, ·] -> [Bw, Hkvw, G, Q, ·]


def _as5(t: torch.Tensor, kn: _Kernel) -> torch.Tensor:
    """A mask or bias tile [#B, #H, #q, #k] (or fewer leading axes) of the whole call -> the rows
    of the worker's slice, broadcastable to its score view [Bw, Hkvw, q, G, k]."""
    t = as_4d(t)  # [#B, #H, #q, #k]
    if t.shape[0] != 1:
        t = t[kn.b]
    if t.shape[1] == 1:
        return t.unsqueeze(3)  # [#Bw, 1, #q, 1, #k]
    return t[:, kn.hq].unflatten(1, (kn.Hkvw, kn.G)).transpose(2, 3)  # [#Bw, (Hkvw G), #q, #k] -> [#Bw, Hkvw, #q, G, #k]


def _row_block(kn: _Kernel, buf: _Buffer, x5: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Queries r0:r1 of a grouped [Bw, Hkvw, G, Q, x] tensor as rows (q g) [n, (q G), x+1] in ``buf``;
    the last column is the caller's (a folded column)."""
    x = x5.shape[-1]
    t = buf.take(kn.n, kn.G * (r1 - r0), x + 1)
    # [Bw, Hkvw, G, q, x] -> [Bw, Hkvw, q, G, x], a view of [n, (q G), x+1]
    t.view(kn.Bw, kn.Hkvw, r1 - r0, kn.G, x + 1)[..., :x].copy_(x5[:, :, :, r0:r1].transpose(2, 3))
    return t


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scratch: _Buffer) -> None:
    """``acc += a @ b`` (batched). ``baddbmm_`` into a non-contiguous ``acc`` (a row slice) falls
    back to one ``addmm_`` per batch entry; then the product goes through a scratch buffer."""
    if acc.is_contiguous():
        acc.baddbmm_(a, b)
    else:
        acc.add_(torch.bmm(a, b, out=scratch.take(*acc.shape)))


def _bias_and_mask_(s: torch.Tensor, kn: _Kernel, rect: Rect) -> None:
    """Add the bias (scaled to base 2) and, on a partial rectangle, the mask to its score tile ``s``
    [n, (q G), kw] in place."""
    p, (r0, r1, k0, k1, partial_) = kn.p, rect
    s5 = s.view(kn.Bw, kn.Hkvw, r1 - r0, kn.G, k1 - k0)  # [n, (q G), kw] -> [Bw, Hkvw, q, G, kw]
    if p.bias is not None:
        bias = p.bias.block(p.ext, r0, r1, k0, k1, s.device, s.dtype)  # [#B, #H, #q, #k]
        if kn.floor_bias:  # finite values below -max/log2(e) would become -inf (masked) in base 2
            bias = clamp_finite(bias, -torch.finfo(s.dtype).max * LN2)
        s5.add_(_as5(bias, kn), alpha=LOG2E)
    if partial_ and p.mask is not None:
        allowed = _as5(p.mask.block(p.ext, r0, r1, k0, k1, s.device), kn)  # bool, True = may attend
        if kn.finite:  # adding 0 / -inf is cheaper than masked_fill over every row, but keeps NaN scores NaN
            s5.add_(torch.zeros(allowed.shape, dtype=s.dtype, device=s.device).masked_fill_(~allowed, _NEG_INF))
        else:
            s5.masked_fill_(~allowed, _NEG_INF)


def _key_span(kn: _Kernel, k: torch.Tensor, v: torch.Tensor, k0: int, k1: int, KB: _Buffer, VB: _Buffer,
              ones_v: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``k0:k1`` of the slice's k [Bw, Hkvw, K, d] as ``[n, kw, d+1]`` with a column of ones
    (copied into ``KB``), and the values as ``[n, kw, dv]`` (``dv+1`` with ones when ``ones_v``):
    a view of v where its dtype and strides allow, else copied into ``VB``."""
    d, dv, kw = k.shape[-1], v.shape[-1], k1 - k0
    kt = KB.take(kn.n, kw, d + 1)
    kt.view(kn.Bw, kn.Hkvw, kw, d + 1)[..., :d].copy_(k[:, :, k0:k1])  # [Bw, Hkvw, kw, d] -> [n, kw, d]
    kt[..., d] = 1.0
    if not ones_v and v.dtype == kn.dt and (kn.Bw == 1 or kn.Hkvw == 1 or v.stride(0) == kn.Hkvw * v.stride(1)):
        return kt, v[:, :, k0:k1].flatten(0, 1)  # [Bw, Hkvw, kw, dv] -> [n, kw, dv], a view
    vt = VB.take(kn.n, kw, dv + int(ones_v))
    vt.view(kn.Bw, kn.Hkvw, kw, -1)[..., :dv].copy_(v[:, :, k0:k1])  # [Bw, Hkvw, kw, dv] -> [n, kw, dv(+1)]
    if ones_v:
        vt[..., dv] = 1.0
    return kt, vt


def _reachable_rows(s: torch.Tensor, *blocks: torch.Tensor, device_path: bool = False) -> tuple[torch.Tensor, ...]:
    """Zero the key rows of ``blocks`` [n, kw, x] that no row of the score tile ``s`` [n, rows, kw]
    may attend (all -inf), so that NaN/inf held there cannot reach the result through 0·NaN. On the
    CPU path a tile every key row of which is reachable is returned as it is (a host check); on the
    device path the rows are always masked."""
    reach = (s > _NEG_INF).any(dim=1)  # [n, kw]
    if not device_path and bool(reach.all()):
        return blocks
    return tuple(b.masked_fill(~reach[..., None], 0.0) for b in blocks)  # [n, kw, x]


def _staged_problem(p: Problem) -> Problem:
    """The call with its mask's and bias's tensors on q's device, copied once per pass (the device
    path only): a CPU-held tensor (ALiBi's slopes, padding lengths, document ids) would otherwise be
    copied to the device per tile, a host sync each."""
    mask = None if p.mask is None else p.mask.staged(p.q.device)
    bias = None if p.bias is None else p.bias.staged(p.q.device)
    return p if mask is p.mask and bias is p.bias else dataclasses.replace(p, mask=mask, bias=bias)


def _per_query_head(p: Problem) -> Problem:
    """The same call with K and V repeated per query head (Hkv = H): the slow path taken only when
    K or V hold NaN/inf, so that each query head can zero the rows it may not attend."""
    k, v = per_query_head(p.k, p.ext.H), per_query_head(p.v, p.ext.H)  # [B, Hkv, K, ·] -> [B, H, K, ·]
    sizes = Sizes(**{**p.sizes.size, "Hkv": p.q.shape[1]})
    return dataclasses.replace(p, k=k, v=v, sizes=sizes)


# ---- forward: FlashAttention-2, Algorithm 1 ----------------------------------------------------------
#
# Algorithm 1 (Dao 2023), per query block Q_i (here a row group of the plan), for each key block K_j, V_j:
#     5   O = 0, l = 0, m = -inf
#     6-7 for each key block j = 1 … T_c: load K_j, V_j
#     8   S = Q_i K_jᵀ
#     9   m_new = max(m, rowmax S);  P̃ = exp(S - m_new);  l = exp(m - m_new)·l + rowsum P̃
#     10  O = diag(exp(m - m_new))·O + P̃ V_j;  m = m_new
#     12  O_i = diag(l)⁻¹ O
#     13  L_i = m + log l
# ``_start_group`` is line 5, ``_step`` lines 7-10 for one rectangle of the plan, ``_finish_group``
# lines 12-15. The deltas from Alg. 1 are marked "Δ from Alg. 1" where the code makes them.


def forward(p: Problem, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, Q, dv] in the input dtype and lse [B, H, Q] (float32; float64 for float64
    input; -inf for fully masked rows, whose output is 0). No autograd graph is built."""
    with torch.no_grad():
        return _forward(seeded(p), plan if plan is not None else plan_for(p))


def _forward(p: Problem, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Q, _ = p.q.shape
    Hkv, dv = p.k.shape[1], p.v.shape[-1]
    out = torch.zeros(B, H, Q, dv, dtype=p.q.dtype, device=p.q.device)
    lse = torch.full((B, H, Q), _NEG_INF, dtype=compute_dtype(p.q), device=p.q.device)
    if p.sinks is not None:  # rows that see no key keep out 0, and their denominator is the sink alone
        lse.copy_(p.sinks.to(lse.dtype)[None, :, None].expand_as(lse))  # [H] -> [B, H, Q]
    if lse.numel() == 0 or plan.tiles == 0:
        return out, lse
    if on_device(p.q.device):
        p = _staged_problem(p)
    finite = all_finite(p.k, p.v)
    if not finite and H > Hkv:
        return _forward(_per_query_head(p), plan)
    v, flags = (p.v, None) if finite else finite_part(p.v, compute_dtype(p.q))  # v with NaN/inf as 0; flags [B, Hkv, K, 3·dv]
    finite = finite and all_finite(p.q)  # scores are finite: masks may be added as 0 / -inf
    n_workers = workers(p.q.device)  # 1 on the device path: one job, run inline
    parts = split(B, Hkv, n_workers)
    if len(parts) > 1 or n_workers == 1 or len(plan.rows) == 1:
        shares = [(part, plan.rows) for part in parts]
    else:  # one batch element and one K/V head: the workers share out the row groups instead
        shares = [(parts[0], rows) for rows in balance(plan.rows, n_workers)]
    in_parallel([partial(_forward_part, _Kernel.of(p, part, finite), rows, v, flags, out, lse) for part, rows in shares])
    return out, lse


class _ForwardWork:
    """Every buffer of one worker's forward, allocated once per call and reused by each row group."""

    def __init__(self, kn: _Kernel, rows: list[RowGroup], d: int, dv: int, nonfinite_v: bool) -> None:
        n, G, dt, dev = kn.n, kn.G, kn.dt, kn.device
        rects = [rect for group in rows for rect in group.rects]
        span = max(rect.k1 - rect.k0 for rect in rects)
        R = G * max(group.q1 - group.q0 for group in rows if group.rects)  # most rows (q g) of a group
        self.keys = _Buffer(n * span * (d + 1), dt, dev)  # [n, kw, d+1]: k and a column of ones
        self.values = _Buffer(n * span * dv, dt, dev)  # [n, kw, dv] where v cannot be viewed
        self.scores = _Buffer(n * G * max(rect.elems for rect in rects), dt, dev)  # S, then P̃, [n, rows, kw]
        self.queries = _Buffer(n * R * (d + 1), dt, dev)  # [n, R, d+1]: q·scale and the folded column -m
        self.O = _Buffer(n * R * dv, dt, dev)  # [n, R, dv]
        self.l, self.m = _Buffer(n * R, dt, dev), _Buffer(n * R, dt, dev)  # [n, R]
        self.tile_max, self.rowsum = _Buffer(n * R, dt, dev), _Buffer(n * R, dt, dev)  # one rectangle's, [n, R]
        self.rescale, self.has_max = _Buffer(n * R, torch.bool, dev), _Buffer(n * R, torch.bool, dev)  # [n, R]
        self.pv = _Buffer(n * R * dv, dt, dev)  # scratch for P̃·V of a rectangle that covers part of a group
        self.hits = _Buffer(n * R * 3 * dv, dt, dev) if nonfinite_v else None  # [n, R, 3·dv]: NaN/inf values reached
        self.dropout = KeepBits.of(kn.p, kn.b, kn.hq, kn.Hkvw, G, n * G * max(rect.elems for rect in rects))


@dataclass
class _Running:
    """Algorithm 1's running state of one row group Q_i: m, l and O as the paper names them, in
    base 2, [n, R, ·] views into the workspace (R = the group's rows (q g)); and what the deltas keep."""

    m: torch.Tensor  # [n, R]: the running max. Δ: a stand-in 0 until the row has seen a finite score
    l: torch.Tensor  # [n, R]: the running sum Σ rowsum P̃, relative to m
    O: torch.Tensor  # [n, R, dv]: Σ P̃ V, relative to m, not yet divided by l
    queries: torch.Tensor  # [n, R, d+1]: Q_i·scale·log2(e) and the folded column -m
    has_max: torch.Tensor  # [n, R]: the row has seen a finite score (m is real)
    hits: torch.Tensor | None  # [n, R, 3·dv]: NaN/inf values the row attends (non-finite v only)
    settled: bool = False  # every row's m is real (CPU path only): the group's later steps take the optimistic exponent


class _Tile(NamedTuple):
    """One step's score tile and what line 9 may need of it: S [n, rows, kw] (held as S - m, base 2),
    the row sums ``rowsum`` [n, rows] line 9 fills, its rows a:b of the group, and K_j and the
    rectangle, to recompute S (the optimistic exponent's redo)."""

    S: torch.Tensor
    rowsum: torch.Tensor
    a: int
    b: int
    K_j: torch.Tensor
    rect: Rect


# Alg. 1, line 9 (m_new, the rescale of l and O by exp(m - m_new), P̃ = exp(S - m_new) and its row
# sums) for one step: ``(kn, work, st, tile) -> P̃``, one of ``_exponent_exact``, ``_exponent_optimistic``
# and ``_exponent_device``, chosen outside the step loop (``_forward_part``), never inside a step.
_Exponent = Callable[[_Kernel, _ForwardWork, _Running, _Tile], torch.Tensor]


def _forward_part(kn: _Kernel, rows: list[RowGroup], v: torch.Tensor, flags: torch.Tensor | None,
                  out: torch.Tensor, lse: torch.Tensor) -> None:
    """The row groups ``rows`` of one worker's slice (Alg. 1's outer loop, line 3), written into out and lse.
    The variant of line 9 is chosen here, outside the step loop (as Triton's ``_attn_fwd_inner``): the
    device path's for every rectangle; on the CPU the exact one until the group is ``settled``, then
    the optimistic one."""
    if not any(group.rects for group in rows):
        return  # every query of these groups is fully masked: out stays 0, lse -inf
    p = kn.p
    q5 = _grouped(p.q, kn)  # [Bw, Hkvw, G, Q, d]
    k, v = p.k[kn.b, kn.hkv], v[kn.b, kn.hkv]  # [Bw, Hkvw, K, d], [Bw, Hkvw, K, dv]
    flags = flags[kn.b, kn.hkv] if flags is not None else None  # [Bw, Hkvw, K, 3·dv]
    out5, lse5 = _grouped(out, kn), _grouped(lse, kn)  # [Bw, Hkvw, G, Q, dv], [Bw, Hkvw, G, Q]
    work = _ForwardWork(kn, rows, k.shape[-1], v.shape[-1], flags is not None)
    unsettled: _Exponent = _exponent_device if kn.on_device else _exponent_exact
    settled: _Exponent = _exponent_optimistic  # only after the CPU's exact exponent settles a group
    for group in rows:
        # Δ from Alg. 1: the plan skips the key blocks a mask leaves empty (a group with none keeps out 0, lse -inf)
        # and joins full ones into tall rectangles (tiled_plan)
        if group.rects:
            st = _start_group(kn, work, group, q5)
            rects = iter(group.rects)
            for rect in rects:  # line 6, until every row's m is real (on the device path: every rectangle)
                _step(kn, work, st, group.q0, rect, k, v, flags, unsettled)
                if st.settled:
                    break
            for rect in rects:  # line 6, the group's remaining rectangles
                _step(kn, work, st, group.q0, rect, k, v, flags, settled)
            _finish_group(kn, st, group, out5, lse5)


def _start_group(kn: _Kernel, work: _ForwardWork, group: RowGroup, q5: torch.Tensor) -> _Running:
    """Alg. 1, lines 4-5: load Q_i (as q·scale·log2(e) and the folded column -m) and set O = 0, l = 0, m = 0.
    Δ from Alg. 1: m starts at a stand-in 0, not -inf, so that the folded column -m stays finite; a
    row's m becomes real at its first finite score (``has_max``; the max pass raises it then)."""
    n, d, dv = kn.n, q5.shape[-1], kn.p.v.shape[-1]
    R = (group.q1 - group.q0) * kn.G
    queries = _row_block(kn, work.queries, q5, group.q0, group.q1)  # [n, R, d+1]
    queries[..., :d].mul_(kn.qscale)  # Δ from Alg. 1: the softmax scale and log2(e) folded into Q_i once: base 2, exp2
    queries[..., d] = 0.0
    hits = work.hits.take(n, R, 3 * dv).zero_() if work.hits is not None else None
    return _Running(work.m.take(n, R).zero_(), work.l.take(n, R).zero_(), work.O.take(n, R, dv).zero_(),
                    queries, work.has_max.take(n, R).zero_(), hits)


def _scores(kn: _Kernel, S: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, m: torch.Tensor, rect: Rect) -> None:
    """Alg. 1, line 8, held as S - m in base 2 (the rows' current m), biased and masked, into ``S`` [n, rows, kw].
    Δ from Alg. 1: -m rides in the matmul as an extra column, [Q·scale, -m]·[K, 1]ᵀ = S - m, which
    saves a pass over the tile (with softcap m is subtracted after c·tanh(S/c) instead)."""
    torch.bmm(queries, keys.transpose(1, 2), out=S)  # [n, rows, kw]  (S - m; S/c with softcap)
    if not kn.fold:
        S.tanh_().mul_(kn.cap * LOG2E).sub_(m[..., None])  # m [n, rows] -> [n, rows, 1]
    _bias_and_mask_(S, kn, rect)


def _step(kn: _Kernel, work: _ForwardWork, st: _Running, q0: int, rect: Rect,
          k: torch.Tensor, v: torch.Tensor, flags: torch.Tensor | None, exponent: _Exponent) -> None:
    """One online-softmax step, Alg. 1 lines 7-10, for one rectangle of the group (its rows a:b, keys k0:k1):
    S = Q_i K_jᵀ; m_new = max(m, rowmax S); P̃ = exp(S - m_new); l = exp(m - m_new)·l + rowsum P̃;
    O = exp(m - m_new)·O + P̃ V_j. Base 2 throughout (exp2, log2(e) folded into Q_i). Line 9 is
    ``exponent``, the variant the caller chose for this kind of step."""
    a, b, kw = kn.G * (rect.r0 - q0), kn.G * (rect.r1 - q0), rect.k1 - rect.k0  # its rows (q g) of the group
    R = st.O.shape[1]
    # Δ from Alg. 1: a rectangle may cover only some of the group's rows (the diagonal blocks of a
    # causal mask, say), so the step updates the rows a:b of m, l and O
    m, l, O, queries = st.m[:, a:b], st.l[:, a:b], st.O[:, a:b], st.queries[:, a:b]
    K_j, V_j = _key_span(kn, k, v, rect.k0, rect.k1, work.keys, work.values, ones_v=False)  # line 7: [n, kw, d+1], [n, kw, dv]
    S = work.scores.take(kn.n, b - a, kw)
    _scores(kn, S, queries, K_j, m, rect)  # line 8, as S - m (the m before this step)
    if flags is not None and st.hits is not None:
        # Δ from Alg. 1: NaN/inf in v (replaced by 0 in V_j) are counted per row that may attend
        # their key, and put back into O at the end (nonfinite.poison), so they reach exactly those rows
        reach = (S > _NEG_INF).to(S.dtype)  # [n, rows, kw]
        st.hits[:, a:b] += torch.bmm(reach, flags[:, :, rect.k0:rect.k1].reshape(kn.n, kw, -1))  # [n, rows, 3·dv]
    rowsum = work.rowsum.take(kn.n, R)[:, a:b]
    # line 9: m_new = max(m, rowmax S), l and O rescaled by exp(m - m_new), P̃ = exp(S - m_new), rowsum P̃
    P = exponent(kn, work, st, _Tile(S, rowsum, a, b, K_j, rect))
    l.add_(rowsum)  # line 9: l += rowsum P̃ (l was rescaled with m_new)
    # line 10: O += P̃ V_j (O was rescaled with m_new). Δ from Alg. 1: with dropout, P̃'s dropped
    # entries are zeroed here, after its row sum: l, and so lse, has no dropout
    _add_mm(O, _dropped(work, P, q0, rect), V_j, work.pv)  # [n, rows, kw] x [n, kw, dv] -> [n, rows, dv]


def _dropped(work: _ForwardWork, P: torch.Tensor, q0: int, rect: Rect) -> torch.Tensor:
    """P̃ with dropout's entries zeroed in place (the 1/(1 - p) is applied once, in ``_finish_group``)."""
    if work.dropout is None:
        return P
    G = P.shape[1] // (rect.r1 - rect.r0)
    return drop_(P, work.dropout.bits(G * rect.r0, G * rect.r1, rect.k0, rect.k1))


# ---- line 9, three variants: each a straight sequence of the pieces below ------------------------------


def _exponent_exact(kn: _Kernel, work: _ForwardWork, st: _Running, t: _Tile) -> torch.Tensor:
    """Line 9 on the CPU path while some row of the group has no real m: the max pass, noting each
    row's first finite score (``settled`` once every row has one), the rescale where some row is
    raised (two host reads), then P̃."""
    tile_max, rescale = _max_pass(kn, work, st, t.S, t.a, t.b)
    _first_scores(st, tile_max, rescale, t.a, t.b)
    st.settled = bool(st.has_max.all())  # a host read
    if bool(rescale.any()):  # a host read: most tiles raise no row, and skip the rescale
        _rescale(kn, st, t.S, tile_max, rescale, t.a, t.b)
    return _exp2_rowsum(t)


def _exponent_optimistic(kn: _Kernel, work: _ForwardWork, st: _Running, t: _Tile) -> torch.Tensor:
    """Line 9 on the CPU path once the group is settled.

    Δ from Alg. 1, the optimistic exponent (CPU path): once every row's m is real, skip the max
    pass and exponentiate with the old m (m_new = m), because the max pass costs about as much
    as the exp2 pass and the max rarely grows much. Accepted while every row sum stays <= 2^24:
    then no entry 2^(S - m) exceeded 2^24, far from overflow, and the result is exact to rounding."""
    P = _exp2_rowsum(t)
    if not bool((t.rowsum > _SUM_LIMIT).any()):  # a host read
        return P
    # some row's max grew by more than 24: recompute S (P overwrote it), take the max pass
    _scores(kn, t.S, st.queries[:, t.a:t.b], t.K_j, st.m[:, t.a:t.b], t.rect)
    tile_max, rescale = _max_pass(kn, work, st, t.S, t.a, t.b)
    if bool(rescale.any()):  # a host read
        _rescale(kn, st, t.S, tile_max, rescale, t.a, t.b)
    return _exp2_rowsum(t)


def _exponent_device(kn: _Kernel, work: _ForwardWork, st: _Running, t: _Tile) -> torch.Tensor:
    """Line 9 on the device path, every rectangle: the max pass with no host read; rows not raised
    get raise_by = 0, alpha = 1, so the rescale always runs and leaves them as they were."""
    tile_max, rescale = _max_pass(kn, work, st, t.S, t.a, t.b)
    _first_scores(st, tile_max, rescale, t.a, t.b)
    _rescale(kn, st, t.S, tile_max, rescale, t.a, t.b)
    return _exp2_rowsum(t)


def _max_pass(kn: _Kernel, work: _ForwardWork, st: _Running, S: torch.Tensor, a: int,
              b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 1, line 9's m_new = max(m, rowmax S) for the rows a:b, as which rows are raised
    (``rescale`` [n, rows]) and the tile's row max relative to m (``tile_max`` [n, rows], from S held as S - m).

    Δ from Alg. 1, lazy rescaling: a row's m is raised only when the tile's row max exceeds it by
    more than TAU (2^12), or at the row's first finite score (``_first_scores``); otherwise m_new = m,
    and entries of P̃ may reach 2^TAU, far from overflow. It saves the rescale of O, which costs a
    pass over [rows, dv]."""
    R = st.O.shape[1]
    tile_max = torch.amax(S, dim=-1, out=work.tile_max.take(kn.n, R)[:, a:b])  # [n, rows]: rowmax(S) - m
    rescale = torch.gt(tile_max, TAU, out=work.rescale.take(kn.n, R)[:, a:b])  # [n, rows]
    return tile_max, rescale


def _first_scores(st: _Running, tile_max: torch.Tensor, rescale: torch.Tensor, a: int, b: int) -> None:
    """Raise the rows a:b at their first finite score (their stand-in m becomes real) and note them
    in ``has_max``: the CPU path until the group is settled, the device path always."""
    seen = tile_max > _NEG_INF  # NaN and -inf rows have not seen a finite score
    has_max = st.has_max[:, a:b]
    rescale |= seen & ~has_max
    has_max |= seen


def _rescale(kn: _Kernel, st: _Running, S: torch.Tensor, tile_max: torch.Tensor, rescale: torch.Tensor, a: int, b: int) -> None:
    """Lines 9-10's rescale for the rows a:b: m = m_new, l and O multiplied by exp(m - m_new), and
    ``S`` (held as S - m) shifted to S - m_new to match; rows not in ``rescale`` keep their m."""
    raise_by = torch.where(rescale, tile_max, 0.0)  # [n, rows]: m_new - m
    S.sub_(raise_by[..., None])  # S - m_new; raise_by [n, rows] -> [n, rows, 1]
    alpha = torch.exp2(-raise_by).clamp_(max=1.0)  # exp(m - m_new); rows with nothing accumulated may get any value
    st.O[:, a:b].mul_(alpha[..., None])  # alpha [n, rows] -> [n, rows, 1]; O [n, rows, dv]
    st.l[:, a:b].mul_(alpha)
    st.m[:, a:b].add_(raise_by)
    if kn.fold:
        st.queries[:, a:b, -1].sub_(raise_by)  # the folded column: -m_new


def _exp2_rowsum(t: _Tile) -> torch.Tensor:
    """Line 9's P̃ = exp(S - m_new), in place of S, and its row sums into ``t.rowsum``."""
    P = t.S.exp2_()
    torch.sum(P, dim=-1, out=t.rowsum)
    return P


def _finish_group(kn: _Kernel, st: _Running, group: RowGroup, out5: torch.Tensor, lse5: torch.Tensor) -> None:
    """Alg. 1, lines 12-15: O_i = diag(l)⁻¹ O and L_i = m + log l for the group's rows, written into the
    [Bw, Hkvw, G, Q, ·] views of out and lse (L in natural log: (m + log2 l)·ln 2).
    Δ from Alg. 1: a row that saw no key (l = 0) gets out 0 and lse -inf; with sinks the denominator is
    l + 2^(sink - m) (lse includes the sink: lse2 = log2(2^(m + log2 l) + 2^sink)); with dropout the
    kept entries count 1/(1 - p)."""
    bq, dv = group.q1 - group.q0, st.O.shape[-1]
    lse2 = st.m + torch.log2(st.l)  # [n, R], base 2, over the keys: line 13
    if kn.p.sinks is not None:
        sink2 = (kn.p.sinks[kn.hq].to(kn.dt) * LOG2E).view(1, kn.Hkvw, 1, kn.G)  # [Hw] -> [1, Hkvw, 1, G]
        # [n, (q G)] -> [Bw, Hkvw, q, G] (+ sink2) -> [n, (q G)]
        lse2 = torch.logaddexp2(lse2.view(kn.Bw, kn.Hkvw, bq, kn.G), sink2).view(kn.n, -1)
        l_safe = torch.where(st.l > 0, torch.exp2(lse2 - st.m), 1.0)  # the whole denominator relative to m
    else:
        l_safe = torch.where(st.l > 0, st.l, 1.0)  # fully masked rows: O = 0, out = 0
    if kn.p.dropout_p > 0:
        l_safe = l_safe * (1.0 - kn.p.dropout_p)  # kept entries count 1/(1 - p)
    # rows (q g) -> [Bw, Hkvw, G, q]
    lse5[:, :, :, group.q0:group.q1] = (lse2 * LN2).view(kn.Bw, kn.Hkvw, bq, kn.G).transpose(2, 3)
    dest = out5[:, :, :, group.q0:group.q1].transpose(2, 3)  # [Bw, Hkvw, G, q, dv] as [Bw, Hkvw, q, G, dv]
    # line 12, O / l; rows (q g) -> [Bw, Hkvw, q, G, ·]
    torch.div(st.O.view(kn.Bw, kn.Hkvw, bq, kn.G, dv), l_safe.view(kn.Bw, kn.Hkvw, bq, kn.G, 1), out=dest)
    if st.hits is not None:
        # [n, (q G), 3·dv] -> [Bw, Hkvw, q, G, 3·dv]: NaN/inf where the row attends them
        dest += poison(st.hits.view(kn.Bw, kn.Hkvw, bq, kn.G, 3 * dv))


# ---- backward: FlashAttention-2, Algorithm 2 ---------------------------------------------------------
#
# Algorithm 2 (Dao 2023): D = rowsum(dO ∘ O) once (here ``delta``, minus lse's own gradient); for each
# key block K_j, V_j (here a key span of the plan, ``_backward_part``), dK_j = dV_j = 0, and for each
# query block Q_i that meets it (a rectangle, ``_backward_rect``):
#     S = Q_i K_jᵀ;  P = exp(S - L_i);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP - D_i)
#     dQ_i += dS K_j;  dK_j += dSᵀ Q_i
# The deltas are the forward's: base 2 and -L folded into the Q·Kᵀ matmul (``[q·scale, -lse2]``), -D
# folded likewise into dO·Vᵀ (``[dO, -delta] · [v, 1]ᵀ = dP - D``, without dropout); with dropout Z =
# keep/(1 - p), dV_j += (Z ∘ P)ᵀ dO_i and dS = P ∘ (Z ∘ dP - D); softcap's tanh' applied to dS; the
# dense bias gradients are dS itself, summed over its broadcast axes.


def backward(p: Problem, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
             grad_lse: torch.Tensor | None = None, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 2 (above) from the given ``out`` [B, H, Q, dv] and ``lse`` [B, H, Q], which may be
    global ones when ``p`` covers only part of the keys (ring attention). Returns (grad_q [B, H, Q, d],
    grad_k [B, Hkv, K, d], grad_v [B, Hkv, K, dv]) in the input dtypes."""
    if p.dropout_p > 0 and "dropout_seed" not in p.options:
        raise ValueError("tiled.backward with dropout needs the forward's seed in p.options['dropout_seed'].")
    grad_q, grad_k, grad_v, _ = _backward(p, out, lse, grad_out, grad_lse, plan if plan is not None else plan_for(p), ())
    return grad_q, grad_k, grad_v


@torch.no_grad()
def _backward(p: Problem, out, lse, grad_out, grad_lse, plan: Plan, biases: tuple[DenseBias, ...]):
    """(grad_q, grad_k, grad_v, [grad of each dense bias in ``biases``])."""
    B, H, Q, _ = p.q.shape
    Hkv = p.k.shape[1]
    G, dt = H // Hkv, compute_dtype(p.q)
    grads = [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (p.q, p.k, p.v)]
    grad_bias = [torch.zeros(b.tensor.shape, dtype=dt, device=p.q.device) for b in biases]  # [#B, #H, #Q, #K]
    if B == 0 or Q == 0 or plan.tiles == 0:  # nothing to attend, or no one asks
        return (*grads, [g.to(b.tensor.dtype) for g, b in zip(grad_bias, biases)])
    if on_device(p.q.device):
        p = _staged_problem(p)
    finite = all_finite(p.k, p.v)
    if not finite and G > 1:
        gq, gk, gv, gb = _backward(_per_query_head(p), out, lse, grad_out, grad_lse, plan, biases)
        return gq, gk.unflatten(1, (Hkv, G)).sum(2), gv.unflatten(1, (Hkv, G)).sum(2), gb  # [B, (Hkv G), K, ·] -> [B, Hkv, K, ·]
    finite_v = finite
    finite = finite and all_finite(p.q)  # scores are finite: masks may be added as 0 / -inf
    parts = split(B, Hkv, workers(p.q.device))  # one part on the device path: run inline
    shares = in_parallel([partial(_backward_part, _Kernel.of(p, part, finite), plan, out, lse, grad_out, grad_lse,
                                   grads, biases, finite_v) for part in parts])
    for (bs, hs), share in zip(parts, shares):
        hq = _query_heads(hs, G)
        for g, gp in zip(grad_bias, share):
            g[bs if g.shape[0] != 1 else slice(None), hq if g.shape[1] != 1 else slice(None)] += gp
    return (*grads, [g.to(b.tensor.dtype) for g, b in zip(grad_bias, biases)])


@dataclass
class _RowTerms:
    """Per row (q g) of the whole slice, [n, Q·G]: kept whole, they are small."""

    delta: torch.Tensor  # rowsum(dO ∘ O) - dlse
    lse2: torch.Tensor  # lse in base 2 (_BIG for fully masked rows: 2^(S - BIG) = 0)


def _row_terms(kn: _Kernel, plan: Plan, out, lse, grad_out, grad_lse) -> _RowTerms:
    Bw, Hkvw, G, dt = kn.Bw, kn.Hkvw, kn.G, kn.dt
    Q = kn.p.q.shape[2]
    o5, do5 = _grouped(out, kn), _grouped(grad_out, kn)  # [Bw, Hkvw, G, Q, dv] each
    delta = torch.empty(Bw, Hkvw, Q, G, dtype=dt, device=kn.device)
    for group in plan.rows:
        sl = slice(group.q0, group.q1)
        # [Bw, Hkvw, G, q, dv] x2 -> [Bw, Hkvw, q, G]
        delta[:, :, sl] = torch.einsum("bhgqv,bhgqv->bhqg", o5[:, :, :, sl].to(dt), do5[:, :, :, sl].to(dt))
    if grad_lse is not None:
        # lse's own gradient: dS += P·dlse; [Bw, Hkvw, G, Q] -> [Bw, Hkvw, Q, G]
        delta -= _grouped(grad_lse, kn).transpose(2, 3).to(dt)
    lse2 = _grouped(lse, kn).transpose(2, 3).to(dt)  # [Bw, Hkvw, G, Q] -> [Bw, Hkvw, Q, G]
    lse2 = torch.where(lse2 > _NEG_INF, lse2 * LOG2E, _BIG)
    return _RowTerms(delta.view(kn.n, Q * G), lse2.reshape(kn.n, Q * G))  # [n, (Q G)]


class _BackwardWork:
    """Every buffer of one worker's backward, allocated once per call."""

    def __init__(self, kn: _Kernel, plan: Plan, d: int, dv: int) -> None:
        n, G, dt, dev = kn.n, kn.G, kn.dt, kn.device
        rects = plan.rects
        span = max(ks.k1 - ks.k0 for ks in plan.cols)
        rows = G * max(rect.r1 - rect.r0 for rect in rects)
        rect_elems = G * max(rect.elems for rect in rects)
        self.scores, self.grad_scores = _Buffer(n * rect_elems, dt, dev), _Buffer(n * rect_elems, dt, dev)  # P, dS [n, rows, kw]
        self.tanh = _Buffer(n * rect_elems, dt, dev) if not kn.fold else None  # softcap's tanh, [n, rows, kw]
        self.queries = _Buffer(n * rows * (d + 1), dt, dev)  # [n, rows, d+1]: q·scale and -lse
        self.grad_out = _Buffer(n * rows * (dv + 1), dt, dev)  # [n, rows, dv+1]: dO and -delta
        self.keys, self.values = _Buffer(n * span * (d + 1), dt, dev), _Buffer(n * span * (dv + 1), dt, dev)
        self.grad_k, self.grad_v = _Buffer(n * span * d, dt, dev), _Buffer(n * span * dv, dt, dev)  # one key span's
        self.grad_q = _Buffer(n * rows * d, dt, dev)  # scratch for dS·K into a row slice of grad_q
        self.dropout = KeepBits.of(kn.p, kn.b, kn.hq, kn.Hkvw, G, n * rect_elems)  # the keep bits of a rectangle
        self.kept = _Buffer(n * rect_elems, dt, dev) if self.dropout is not None else None  # P with dropout's zeros


def _backward_part(kn: _Kernel, plan: Plan, out, lse, grad_out, grad_lse, grads, biases, finite_v: bool) -> list:
    """One worker's slice: writes its rows of grad_q, grad_k, grad_v; returns its share of the
    dense bias gradients (shaped as the bias, restricted to the slice)."""
    p, n, G, dt = kn.p, kn.n, kn.G, kn.dt
    q, k, v = p.q[kn.b, kn.hq], p.k[kn.b, kn.hkv], p.v[kn.b, kn.hkv]  # [Bw, Hw, Q, d], [Bw, Hkvw, K, ·]
    Q, d, dv = q.shape[2], q.shape[3], v.shape[-1]
    terms = _row_terms(kn, plan, out, lse, grad_out, grad_lse)
    q5, do5 = _grouped(p.q, kn), _grouped(grad_out, kn)  # [Bw, Hkvw, G, Q, ·]
    grad_q = grads[0][kn.b, kn.hq]  # [Bw, Hw, Q, d]
    batch_contiguous = kn.Bw == 1 or grad_q.shape[1] == 1 or grad_q.stride(0) == grad_q.shape[1] * grad_q.stride(1)
    direct = G == 1 and grad_q.dtype == dt and batch_contiguous
    # [Bw, Hw, Q, d] -> [n, Q, d] (G = 1: rows (q g) are q)
    grad_q3 = grad_q.flatten(0, 1) if direct else torch.zeros(n, Q * G, d, dtype=dt, device=kn.device)
    work = _BackwardWork(kn, plan, d, dv)
    grad_bias = [torch.zeros(_sliced_shape(b.tensor.shape, kn.Bw, grad_q.shape[1]), dtype=dt, device=kn.device) for b in biases]
    grad_k_w, grad_v_w = grads[1][kn.b, kn.hkv], grads[2][kn.b, kn.hkv]  # [Bw, Hkvw, K, ·]
    for span in plan.cols:
        kw = span.k1 - span.k0
        keys, values = _key_span(kn, k, v, span.k0, span.k1, work.keys, work.values, ones_v=True)  # [n, kw, d+1], [n, kw, dv+1]
        grad_k, grad_v = work.grad_k.take(n, kw, d).zero_(), work.grad_v.take(n, kw, dv).zero_()
        for rect in span.rects:
            _backward_rect(kn, work, rect, q5, do5, terms, keys, values, grad_q3, grad_k, grad_v, grad_bias, finite_v)
        grad_k.mul_(kn.cap if not kn.fold else LN2)  # the queries held q·scale/c, or q·scale·log2(e)
        # [n, kw, d] -> [Bw, Hkvw, kw, d]; spans may overlap
        grad_k_w[:, :, span.k0:span.k1] += grad_k.view(kn.Bw, kn.Hkvw, kw, d)
        grad_v_w[:, :, span.k0:span.k1] += grad_v.view(kn.Bw, kn.Hkvw, kw, dv)  # [n, kw, dv] -> [Bw, Hkvw, kw, dv]
    if direct:
        grad_q3.mul_(p.scale)
    else:  # rows (q g) -> [Bw, Hkvw, G, Q, d]
        grad_q.unflatten(1, (kn.Hkvw, G)).copy_(grad_q3.view(kn.Bw, kn.Hkvw, Q, G, d).transpose(2, 3).mul_(p.scale))
    return grad_bias


def _backward_rect(kn: _Kernel, work: _BackwardWork, rect: Rect, q5, do5, terms: _RowTerms, keys, values,
                   grad_q3, grad_k, grad_v, grad_bias, finite_v: bool) -> None:
    """One rectangle: P recomputed from lse; dV, dS, dQ, dK and the dense bias gradients accumulated."""
    n, G, p = kn.n, kn.G, kn.p
    r0, r1, k0, k1, _ = rect
    a, b, kw, d, dv = G * r0, G * r1, k1 - k0, q5.shape[-1], do5.shape[-1]  # rows (q g) a:b of the slice
    queries = _row_block(kn, work.queries, q5, r0, r1)  # [n, rows, d+1]: q·scale and -lse
    queries[..., :d].mul_(kn.qscale)
    if kn.fold:
        torch.neg(terms.lse2[:, a:b], out=queries[..., d])
    else:
        queries[..., d] = 0.0
    gout = _row_block(kn, work.grad_out, do5, r0, r1)  # [n, rows, dv+1]: dO and -delta
    drop = work.dropout
    if drop is None:
        torch.neg(terms.delta[:, a:b], out=gout[..., dv])
    else:  # dP is masked before delta is subtracted: the column stays 0; dO/(1 - p) serves dV and dP
        gout[..., dv] = 0.0
        gout[..., :dv].mul_(1.0 / (1.0 - p.dropout_p))
    s = work.scores.take(n, b - a, kw)
    torch.bmm(queries, keys.transpose(1, 2), out=s)  # [n, rows, kw] = (S - lse) in base 2  (S/c with softcap)
    th = None
    if work.tanh is not None:  # softcap: S = c·tanh(S/c)
        th = work.tanh.take(n, b - a, kw)
        th.copy_(s.tanh_())
        s.mul_(kn.cap * LOG2E).sub_(terms.lse2[:, a:b, None])  # lse2 [n, rows] -> [n, rows, 1]
    _bias_and_mask_(s, kn, rect)
    kt, vt = (keys, values) if kn.finite else _reachable_rows(s, keys, values, device_path=kn.on_device)
    s.exp2_()  # P
    ds = work.grad_scores.take(n, b - a, kw)
    if drop is None or work.kept is None:
        grad_v.baddbmm_(s.transpose(1, 2), gout[..., :dv])  # dV += Pᵀ·dO   [n, kw, dv]
        torch.bmm(gout, vt.transpose(1, 2), out=ds)  # dP - delta  [n, rows, kw]
        ds.mul_(s)  # dS = P ∘ (dP - delta)
    else:  # with Z = keep/(1 - p): dV += (Z ∘ P)ᵀ·dO, dS = P ∘ (Z ∘ dP - delta)
        kept = drop_(s, drop.bits(a, b, k0, k1), out=work.kept.take(n, b - a, kw))  # P with the dropped entries 0
        grad_v.baddbmm_(kept.transpose(1, 2), gout[..., :dv])  # dV += (Z ∘ P)ᵀ·dO   [n, kw, dv]
        torch.bmm(gout, vt.transpose(1, 2), out=ds)  # dP/(1 - p)  [n, rows, kw]
        # (P ∘ keep) ∘ dP/(1 - p) - P ∘ delta; delta [n, rows] -> [n, rows, 1]
        ds.mul_(kept).addcmul_(s, terms.delta[:, a:b, None], value=-1.0)
    if not finite_v:
        ds.masked_fill_(s == 0, 0.0)  # a row that may not attend a NaN/inf value gets no gradient from it
    for g in grad_bias:
        _add_bias_grad(g, ds, kn, rect)
    if th is not None:
        th.mul_(th)
        ds.addcmul_(ds, th, value=-1.0)  # through softcap: dS ∘ (1 - tanh²)
    _add_mm(grad_q3[:, a:b], ds, kt[..., :d], work.grad_q)  # dQ += dS·K   [n, rows, d]
    grad_k.baddbmm_(ds.transpose(1, 2), queries[..., :d])  # dK += dSᵀ·(Q·scale)   [n, kw, d]


def _sliced_shape(shape, Bw: int, Hw: int) -> tuple[int, ...]:
    """A bias shape [#B, #H, #Q, #K] restricted to a worker's Bw batch elements and Hw query heads."""
    return (Bw if shape[0] != 1 else 1, Hw if shape[1] != 1 else 1, shape[2], shape[3])


def _add_bias_grad(g: torch.Tensor, ds: torch.Tensor, kn: _Kernel, rect: Rect) -> None:
    """Add the tile dS [n, (q G), kw] into a dense bias gradient g [#B, #H, #Q, #K] (the slice's)."""
    r0, r1, k0, k1, _ = rect
    t = ds.view(kn.Bw, kn.Hkvw, r1 - r0, kn.G, k1 - k0).transpose(2, 3)  # rows (q g) -> [Bw, Hkvw, G, q, kw]
    t = t.reshape(kn.Bw, kn.Hkvw * kn.G, r1 - r0, k1 - k0)  # -> [Bw, Hw, q, kw]
    axes = [a for a in range(4) if g.shape[a] == 1 and t.shape[a] != 1]
    if axes:
        t = t.sum(dim=axes, keepdim=True)  # broadcast axes of the bias get the sum
    tile_of(g, r0, r1, k0, k1).add_(t)  # a view of g: the tile, or its broadcast axis whole


class _TiledAttention(torch.autograd.Function):
    """Saves q, k, v, sinks, out and lse (never P); the backward recomputes each tile's P. With sinks
    lse includes the sink, so P = exp(S - lse) and delta = rowsum(dO ∘ O) hold as without them."""

    @staticmethod
    def forward(ctx, p: Problem, plan: Plan, dense: tuple, q, k, v, sinks, *bias_tensors):
        out, lse = _forward(p, plan)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.p = dataclasses.replace(p, q=None, k=None, v=None, sinks=None)  # type: ignore[arg-type]  # saved by save_for_backward
        ctx.plan, ctx.dense = plan, dense
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        p = dataclasses.replace(ctx.p, q=q, k=k, v=v, sinks=sinks)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dense = tuple(b for b, need in zip(ctx.dense, ctx.needs_input_grad[7:]) if need)
        grad_q, grad_k, grad_v, grad_bias = _backward(p, out, lse, grad_out, grad_lse, ctx.plan, dense)
        grad_sinks = sinks_grad(sinks, out, lse, grad_out, grad_lse) if ctx.needs_input_grad[6] else None
        it = iter(grad_bias)
        grads = [next(it) if need else None for need in ctx.needs_input_grad[7:]]
        return None, None, None, grad_q, grad_k, grad_v, grad_sinks, *grads


def why_not(p: Problem, need_lse: bool) -> str | None:
    return None


def run(p: Problem, need_lse: bool = False, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry: out [B, H, Q, dv] and lse [B, H, Q] (computed anyway, so returned even
    when not asked: observers get it); differentiable in q, k, v, a dense bias, and lse itself when
    the inputs require grad. ``plan``: one made for this call already (``auto`` makes one to
    estimate the cost), else planned here."""
    plan = plan if plan is not None else plan_for(p)
    p = seeded(p)  # dropout: one seed per call, saved with p for the backward
    dense = tuple(b for b in dense_parts(p.bias) if b.tensor.requires_grad)
    inputs = (p.q, p.k, p.v) + ((p.sinks,) if p.sinks is not None else ())
    if torch.is_grad_enabled() and (dense or any(t.requires_grad for t in inputs)):
        out, lse = _TiledAttention.apply(p, plan, dense, p.q, p.k, p.v, p.sinks, *(b.tensor for b in dense))
    else:
        out, lse = forward(p, plan)
    return out, lse
