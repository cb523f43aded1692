"""Ring attention: exact attention over a sequence sharded across processes (context parallelism).

Each of P ranks holds N/P queries and N/P keys/values. K/V travel around the ring (rank r sends to
r+1 and receives from r-1) in pieces of ``kv_chunk`` keys; while one piece is in flight the rank
runs the tiled kernel on the piece it holds and folds the result into its output with ``merge``.
After P steps every query has seen every key. The mask stays in global positions; each step sees it through
a :class:`~bhqk.masks.view.View` and skips the kernel when the (query shard, key piece) pair is empty.

Backward runs the ring again: the K/V pieces travel with their dK/dV accumulators, every rank adds
its share (from the global out and lse saved by forward), and after P steps the accumulated
gradients are back at the rank that owns the keys.

Memory per rank: q, k, v, out (N/P positions each), lse, two K/V pieces in flight, and in backward
two float32 dK/dV pieces. Communication per step: one K/V piece per rank (forward); K/V plus
float32 dK/dV (backward). fp16/bf16 travel as they are and are computed in float32 (a float32 copy
of q per call), so partial results are merged before the one final rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import MaskError, ShapeError
from ..functional import tiled
from ..functional.merge import merge_
from ..functional.problem import Problem, prepare
from ..masks import Extent, Mask, Tile, as_mask
from ..masks.view import IndexMap, view
from ..shapes import LAYOUTS, compute_dtype
from .group import Ring
from .shard import SCHEMES, index_map

PIECES, MIN_CHUNK = 4, 512  # by default a shard's keys travel, and its queries are computed, in quarters (>= 512)
_TAG_KV, _TAG_GRAD = 0, 2  # message tags: k, v = 0, 1; dk, dv = 2, 3
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Plan:
    """Everything a ring call needs besides the tensors; the same on every rank except ``q_map``."""

    ring: Ring
    mask: Mask | None
    ext: Extent  # global [B, H, Q, K]
    q_map: IndexMap  # this rank's queries
    k_maps: list[IndexMap]  # every rank's keys, by rank
    scale: float
    softcap: float | None
    chunks: list[tuple[int, int]]  # local key ranges sent as one message
    qchunks: list[tuple[int, int]]  # local query ranges given to one kernel call

    def problem(self, q, k, v, q0: int, q1: int, src: int, a: int, b: int) -> Problem | None:
        """The kernel call for local queries q0…q1-1 (``q`` is that slice) × keys a…b-1 of rank ``src``
        (``k``, ``v``); None when the mask leaves the pair empty."""
        m = view(self.mask, self.ext, self.q_map.narrow(q0, q1), self.k_maps[src].narrow(a, b))
        if m is not None:
            t = m.classify(Extent(self.ext.B, self.ext.H, q1 - q0, b - a), 0, q1 - q0, 0, b - a)
            if t is Tile.EMPTY:
                return None
            m = None if t is Tile.FULL else m
        return prepare(q, k, v, m, None, self.scale, self.softcap)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 as float32 (the kernel computes in float32 anyway), so each step's partial output and
    gradients reach the accumulators unrounded; other dtypes unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _kv_steps(ring: Ring, k: torch.Tensor, v: torch.Tensor, a: int, b: int):
    """The ring's steps over this rank's keys a…b-1: yields (step, the rank whose keys are held,
    [k, v] held [B, Hkv, c, d], [B, Hkv, c, dv]); each step's K/V are sent on while the caller
    computes with them, and the next ones received once it is done."""
    cur = [k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous()]
    spare: list[torch.Tensor] | None = None  # the receive buffers
    for step in range(ring.size):
        work = None
        if step < ring.size - 1:
            spare = spare or [torch.empty_like(t) for t in cur]
            work = ring.start(cur, spare, _TAG_KV, "K/V", step)
        yield step, (ring.rank - step) % ring.size, cur
        if work is not None:
            assert spare is not None  # work receives into it
            ring.wait(work, "K/V", step)
            cur, spare = spare, (cur if step > 0 else None)  # never receive into the caller's k, v


def _forward(plan: Plan, q, k, v, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, Q/P, dv] (q's dtype) and lse [B, H, Q/P] (float32/64) over all ranks' keys; the
    pieces are merged without sinks and ``sinks`` [H] joins once at the end (lse includes it)."""
    ring = plan.ring
    B, H, Ql, _ = q.shape
    acc = compute_dtype(q)
    qw = _wide(q)  # [B, H, Q/P, d]
    out = torch.zeros(B, H, Ql, v.shape[-1], dtype=acc, device=q.device)  # [B, H, Q/P, dv]
    lse = torch.full((B, H, Ql), float("-inf"), dtype=acc, device=q.device)  # [B, H, Q/P]
    for a, b in plan.chunks:
        for _, src, (kc, vc) in _kv_steps(ring, k, v, a, b):
            kw, vw = _wide(kc), _wide(vc)
            for q0, q1 in plan.qchunks:
                p = plan.problem(qw[:, :, q0:q1], kw, vw, q0, q1, src, a, b)
                if p is not None:
                    o_t, l_t = tiled.forward(p)  # [B, H, q, dv], [B, H, q]
                    merge_(out[:, :, q0:q1], lse[:, :, q0:q1], o_t, l_t)
                    del o_t, l_t
    if sinks is not None:  # the sink is one more key with value 0, counted once
        nothing = torch.zeros((), dtype=acc, device=q.device).expand_as(out)  # [] -> [B, H, Q, dv]
        merge_(out, lse, nothing, sinks.to(acc)[None, :, None].expand_as(lse))  # sinks [H] -> [B, H, Q]
    return out.to(q.dtype), lse


def _backward(plan: Plan, q, k, v, out, lse, dout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (local queries), dk, dv (local keys): each rank's share travels with the keys back to their owner."""
    ring = plan.ring
    acc = compute_dtype(q)
    qw = _wide(q)  # [B, H, Q/P, d]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # [B, H, Q/P, d]
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # [B, Hkv, K/P, d], [B, Hkv, K/P, dv]
    for a, b in plan.chunks:
        # dK, dV of the keys we hold: [B, Hkv, c, d], [B, Hkv, c, dv]
        grad = [torch.zeros(t[:, :, a:b].shape, dtype=acc, device=t.device) for t in (k, v)]
        grad_spare: list[torch.Tensor] | None = None  # the receive buffers of dK, dV
        gwork = None
        for step, src, cur in _kv_steps(ring, k, v, a, b):
            kw, vw = _wide(cur[0]), _wide(cur[1])
            mine = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in cur] if len(plan.qchunks) > 1 else None
            for q0, q1 in plan.qchunks:
                p = plan.problem(qw[:, :, q0:q1], kw, vw, q0, q1, src, a, b)
                if p is None:
                    continue
                dq_t, dk_t, dv_t = tiled.backward(p, out[:, :, q0:q1], lse[:, :, q0:q1], dout[:, :, q0:q1])
                dq[:, :, q0:q1].add_(dq_t)  # [B, H, q, d]
                if mine is None:
                    mine = [dk_t, dv_t]  # [B, Hkv, c, d], [B, Hkv, c, dv]
                else:
                    mine[0].add_(dk_t)
                    mine[1].add_(dv_t)
                del dq_t, dk_t, dv_t
            if gwork is not None:  # the dK/dV of these keys accumulated by the ranks before us
                assert grad_spare is not None  # gwork receives into it
                ring.wait(gwork, "dK/dV", step)
                grad, grad_spare = grad_spare, grad
            if mine is not None:
                grad[0].add_(mine[0])
                grad[1].add_(mine[1])
                del mine
            if ring.size > 1:  # pass them on; after the last step they reach the keys' owner
                grad_spare = grad_spare or [torch.empty_like(t) for t in grad]
                gwork = ring.start(grad, grad_spare, _TAG_GRAD, "dK/dV", step)
        if gwork is not None:
            assert grad_spare is not None  # gwork receives into it
            ring.wait(gwork, "dK/dV", ring.size)
            grad = grad_spare
        dk[:, :, a:b].copy_(grad[0])
        dv[:, :, a:b].copy_(grad[1])
    return dq.to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, sinks):
        out, lse = _forward(plan, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward(ctx.plan, q, k, v, out, lse, dout)  # lse includes the sink: P = exp(S - lse) holds
        grad_sinks = tiled.sinks_grad(sinks, out, lse, dout) if ctx.needs_input_grad[4] else None  # this rank's rows' share
        return dq, dk, dv, None, grad_sinks


def _agree(ring: Ring, q, k, v, layout: str, sharding: str) -> None:
    """Every rank passes the same shapes, dtype, layout and sharding, or every rank raises the same ShapeError."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    dims = [list(t.shape[:4]) + [0] * (4 - min(4, t.dim())) + [t.dim()] for t in (q, k, v)]  # 4 sizes and the rank
    code = lambda t: _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 9  # noqa: E731
    mine = [x for d in dims for x in d] + [code(q), code(k), code(v), list(LAYOUTS).index(layout), SCHEMES.index(sharding)]
    if ring.size == 1:
        return
    mine_t = torch.tensor(mine, dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine_t) for _ in range(ring.size)]
    dist.all_gather(every, mine_t, group=ring.group)
    rows = [e.tolist() for e in every]
    if any(r != rows[0] for r in rows):
        def show(r):
            sh = [r[5 * i: 5 * i + min(4, r[5 * i + 4])] for i in range(3)]
            return (f"q {sh[0]}, k {sh[1]}, v {sh[2]}, dtype {_DTYPES[r[15]] if r[15] < 4 else '?'}, "
                    f"layout {list(LAYOUTS)[r[18]]!r}, sharding {SCHEMES[r[19]]!r}")
        table = "\n".join(f"  rank {i}: {show(r)}" for i, r in enumerate(rows))
        raise ShapeError(
            "ring attention: ranks disagree on their shards; every rank must pass q, k, v of the same shape and dtype "
            f"(its N/P positions), the same layout and the same sharding.\n{table}"
        )


def _chunk(name: str, given: int | None, n: int) -> int:
    if given is None:
        return max(MIN_CHUNK, -(-n // PIECES))
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ValueError(f"{name} must be a positive integer, got {given!r}.")
    return given


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    group=None,
    layout: str = "bhnd",
    sharding: str = "zigzag",
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    kv_chunk: int | None = None,
    q_chunk: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    Each rank passes its shard: q [B, H, Q/P, d], k [B, Hkv, K/P, d], v [B, Hkv, K/P, dv]
    (``layout="bnhd"``: [B, N/P, H, ·]), cut with :func:`bhqk.distributed.shard` using ``sharding``
    (``"zigzag"``, ``"striped"`` or ``"contiguous"``; zig-zag and striped balance causal work).
    ``mask`` is written in GLOBAL positions over [B, H, Q, K] and must be the same on every rank.
    Returns this rank's out [B, H, Q/P, dv] (and lse [B, H, Q/P], not differentiable, if asked).
    Differentiable in q, k, v; every rank must run backward. ``kv_chunk``: keys per message;
    ``q_chunk``: queries per kernel call (both default to a quarter of the shard, at least 512):
    smaller pieces hold less memory at once and take more messages and calls.
    A peer that dies or stalls raises RuntimeError after the process group's timeout.
    ``sinks`` [H] (the same on every rank): per-head logits in each row's softmax denominator, as in
    :func:`bhqk.attention`; applied once after the ring (lse includes them). Its gradient on each rank
    is that rank's rows' share: all-reduce it like the other replicated parameters (DDP does).
    """
    ring = Ring.of(group)
    if layout not in LAYOUTS:
        raise ShapeError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}.")
    if sharding not in SCHEMES:
        raise ValueError(f"sharding must be one of {SCHEMES}, got {sharding!r}.")
    _agree(ring, q, k, v, layout, sharding)
    local = prepare(q, k, v, scale=scale, softcap=softcap, layout=layout, sinks=sinks)  # this rank's shard: Q and K are N/P here
    backend = str(dist.get_backend(ring.group))
    if q.device.type == "cpu" and "nccl" in backend and "cpu" not in backend:
        raise RuntimeError(f"the process group uses {backend}, which needs CUDA tensors; q, k, v are on the CPU "
                           f"(use gloo on CPUs, or move them to cuda:LOCAL_RANK).")
    q, k, v, sizes = local.q, local.k, local.v, local.sizes  # [B, H, N/P, d], [B, Hkv, N/P, ·]
    P = ring.size
    Qg, Kg = sizes["Q"] * P, sizes["K"] * P
    ext = Extent(sizes["B"], sizes["H"], Qg, Kg)
    mask = as_mask(mask)
    if mask is not None:
        try:
            mask.check(ext)
        except MaskError as e:
            raise MaskError(f"{e}\n(ring attention: the mask lives in global positions, [B={ext.B}, H={ext.H}, "
                            f"Q={Qg}, K={Kg}] = P={P} ranks × the local shards.)") from None
    Ql, Kl = sizes["Q"], sizes["K"]
    ck, cq = _chunk("kv_chunk", kv_chunk, Kl), _chunk("q_chunk", q_chunk, Ql)
    plan = Plan(
        ring, mask, ext,
        index_map(Qg, ring.rank, P, sharding, what="query"),
        [index_map(Kg, r, P, sharding, what="key") for r in range(P)],
        local.scale, local.softcap,
        [(a, min(a + ck, Kl)) for a in range(0, Kl, ck)],
        [(a, min(a + cq, Ql)) for a in range(0, Ql, cq)],
    )
    out, lse = _RingAttention.apply(q, k, v, plan, local.sinks)  # [B, H, Q/P, dv], [B, H, Q/P]
    if layout == "bnhd":
        out = out.transpose(1, 2)  # [B, H, Q/P, dv] -> [B, Q/P, H, dv]
    return (out, lse) if return_lse else out
