"""Attention statistics of every row and every key, tile by tile: no [Q, K] matrix beyond one tile.

For one attention call (a checked :class:`Problem`), the selected query heads ``heads`` and rows
``rows``, this computes from q, k and the row log-sum-exp (the backend's; when it saved none, e.g.
SDPA, PyTorch's fused CPU kernel's where it computes the call, else one online-softmax pass here),
per row i and key j of P = exp(S − lse):

- ``entropy``  [B, h, r]  −Σ_j P log P (nats; over the keys, a sink's share not counted)
- ``distance`` [B, h, r]  Σ_j P·|pos(i) − j|, pos(i) = i + K − Q (the decoding convention)
- ``sink``     [B, h, r]  P on the first key the row may attend: key 0 unless the mask forbids it (the
  first real key of a left-padded row); 0 for a row that may attend nothing
- ``offset``   {o: [B, h, r]}  P on key pos(i) − o (0 where there is none)
- ``local``    [B, h, r]  Σ P over the keys with |pos(i) − j| < window
- ``topk``     [B, h, r, t]  the t largest P of each row and their keys
- ``received`` [B, h, K]  Σ over the real rows of P: the attention each key receives
- ``mass``     [B, h, r]  Σ_j P (1 − the sink logit's share; 0 for a row that may attend nothing)
- ``real``     [B, h, r]  rows that count: they may attend some key, and (when pos(i) is a key) their
  own position is a key some row may attend, so padding rows (left or right) are left out.

Cost: one Q·Kᵀ matmul, one exp and one P·[k, 1, j] matmul per tile (the entropy is
lse·ΣP − q·(Σ_j P k_j)·scale, linear in k, when there is no softcap or bias); the row sums and the
diagonals (offsets, window, distance on tiles that straddle pos(i)) are cheap. Tiles the mask rules
out are skipped. Memory: O(B·h·(r + K)) besides one [B, h, bq, bk] tile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..functional.merge import add_sinks, lse_of
from ..functional.problem import Problem
from ..masks import Tile
from ..shapes import as_4d, compute_dtype, per_query_head
from .layers import heads_rows, value_heads

TILE_ENTRIES = 1 << 22  # entries of one [B, h, bq, bk] score tile (16 MiB in float32)
NARROW = 32  # a window up to this wide is summed from its diagonals, not from a [bq, bk] band mask


@dataclass(frozen=True)
class Want:
    """Which statistics to compute: the names in ``what`` (of :data:`STATISTICS`) that take no option,
    and each statistic whose option is given (``offsets``, ``window``, ``topk``)."""

    what: tuple[str, ...] = ("entropy", "distance", "sink", "received")
    offsets: tuple[int, ...] = ()
    window: int | None = None  # local: mass on keys with |pos(i) − j| < window
    topk: int = 0

    def names(self) -> list[str]:
        """The statistics of :data:`STATISTICS` this asks for (``mass`` and ``real`` always), in table order."""
        return [n for n, s in STATISTICS.items()
                if s.always or (getattr(self, s.option) if s.option else n in self.what)]


def _blocks(B: int, h: int, r: int, K: int, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    bk = block_k or max(1, min(K, 1024))
    bq = block_q or max(16, min(512, TILE_ENTRIES // max(1, B * h * bk)))
    return max(1, min(bq, max(r, 1))), bk


class _Call:
    """The call narrowed to the selected heads (q and k as the statistics need them, in the compute
    dtype); rows are selected tile by tile."""

    def __init__(self, p: Problem, heads: list[int]) -> None:
        self.p, self.ext = p, p.ext
        H, Q, K = self.ext.H, self.ext.Q, self.ext.K
        self.dt = compute_dtype(p.q)
        self.dev = p.q.device
        self.heads, self.h = heads, len(heads)
        self.c = K - Q  # query i sits at key position i + c
        self.all_heads = heads == list(range(H))
        self.q = p.q if self.all_heads else heads_rows(p.q, heads)  # [B, H, Q, d] -> [B, h, Q, d]
        if self.all_heads:
            self.G, self.k = p.groups, p.k  # grouped: the G query heads of a K/V head share its k tile
        else:
            self.G, self.k = 1, per_query_head(p.k, H, heads)  # [B, Hkv, K, d] -> [B, h, K, d]
        self.sinks = None if p.sinks is None else p.sinks[heads].to(self.dt)  # [h]
        self.fast = p.softcap is None and p.bias is None  # entropy linear in k: through a matmul
        self.buffers: dict = {}
        self.kts: dict[tuple[int, int], torch.Tensor] = {}  # key tiles, built once per call
        self.causal = p.mask is not None and p.mask.only_past(self.ext)  # no key after pos(i): |pos − j| = pos − j
        self.plain_causal = p.mask is not None and p.mask.causal_diagonal(self.ext) == self.c and p.bias is None

    def sel(self, t: torch.Tensor) -> torch.Tensor:
        """A mask or bias tile [#B, #H, q, k] with the selected heads: [#B, #h, q, k]."""
        return t if self.all_heads else value_heads(t, self.heads, self.ext.H)

    def q_blocks(self, rows: list[int] | None, bq: int):
        """(i0, i1, a, b): blocks [i0, i1) of at most ``bq`` consecutive selected rows, and the output
        rows [a, b) they fill."""
        for s0, s1, o in _spans(rows, self.ext.Q):
            for i0 in range(s0, s1, bq):
                i1 = min(s1, i0 + bq)
                yield i0, i1, o + i0 - s0, o + i1 - s0

    def k_tiles(self, bk: int):
        """(k0, k1, :meth:`k_tile` [B, h/G, bk, d + 2]) of each key block of ``bk`` keys, each tile built once."""
        for k0 in range(0, self.ext.K, bk):
            k1 = min(self.ext.K, k0 + bk)
            if (k0, k1) not in self.kts:
                self.kts[k0, k1] = self.k_tile(k0, k1)
            yield k0, k1, self.kts[k0, k1]

    def q_tile(self, i0: int, i1: int, lse: torch.Tensor | None) -> torch.Tensor:
        """[B, h, bq, d + 2]: q·scale, then −lse (0 where not folded) and 0; pairs with :meth:`k_tile`."""
        qs = self.q[:, :, i0:i1].to(self.dt) * self.p.scale  # [B, h, bq, d]
        extra = torch.zeros(*qs.shape[:-1], 2, dtype=self.dt, device=self.dev)  # [B, h, bq, 2]
        if lse is not None:
            extra[..., 0] = -lse
        return torch.cat([qs, extra], dim=-1)  # [B, h, bq, d + 2]

    def k_tile(self, k0: int, k1: int) -> torch.Tensor:
        """[B, h/G, bk, d + 2]: k, a column of ones and the key offset j − k0."""
        kt = self.k[:, :, k0:k1].to(self.dt)  # [B, h/G, bk, d]
        extra = torch.empty(*kt.shape[:-1], 2, dtype=self.dt, device=self.dev)  # [B, h/G, bk, 2]
        extra[..., 0] = 1.0
        extra[..., 1] = torch.arange(k1 - k0, dtype=self.dt, device=self.dev)
        return torch.cat([kt, extra], dim=-1)  # [B, h/G, bk, d + 2]

    def matmul(self, a: torch.Tensor, b: torch.Tensor, slot: str) -> torch.Tensor:
        """a [B, h, x, n] @ b [B, h/G, n, y] -> [B, h, x, y], the G query heads of a K/V head as one matmul,
        written into a buffer kept per ``slot`` and shape (fresh memory is what costs here: docs/design.md)."""
        B, h, x, n = a.shape
        shape = (B, h // self.G, self.G * x, b.shape[-1])
        buf = self.buffers.get((slot, shape))
        if buf is None:
            buf = self.buffers[(slot, shape)] = torch.empty(shape, dtype=self.dt, device=self.dev)
        torch.matmul(a.reshape(B, h // self.G, self.G * x, n), b, out=buf)  # [B, h/G, G·x, y]
        return buf.view(B, h, x, b.shape[-1])  # [B, h, x, y]

    def scores(self, qa: torch.Tensor, ka: torch.Tensor, i0: int, i1: int, k0: int, k1: int,
               lse: torch.Tensor | None, folded: bool, defer_causal: bool = False):
        """(S − lse [B, h, bq, bk] or plain S when ``lse`` is None, allowed [#B, #h, bq, bk] or None,
        the diagonal to keep at and below when the caller must zero what lies above it after the exp
        (``defer_causal`` with a plain causal mask), else None), -inf where not allowed; None for a
        tile nobody may attend."""
        p = self.p
        allowed = diagonal = None
        if p.mask is not None:
            t = p.mask.classify(self.ext, i0, i1, k0, k1)
            if t is Tile.EMPTY:
                return None
            if t is Tile.PARTIAL and defer_causal and self.plain_causal:
                diagonal = i0 + self.c - k0  # key j allowed for row x when j <= x + diagonal
            elif t is Tile.PARTIAL:
                allowed = self.sel(as_4d(p.mask.block(self.ext, i0, i1, k0, k1, self.dev)))  # [#B, #h, bq, bk]
        S = self.matmul(qa, ka.transpose(-1, -2), "S")  # [B, h, bq, d+2] @ [B, h/G, d+2, bk] -> [B, h, bq, bk]
        if p.softcap is not None:
            S = torch.tanh(S.div_(p.softcap)).mul_(p.softcap)
        if p.bias is not None:
            bt = self.sel(as_4d(p.bias.block(self.ext, i0, i1, k0, k1, self.dev, self.dt)))  # [#B, #h, bq, bk]
            S = S.add_(bt)
            finite = bt > float("-inf")
            allowed = finite if allowed is None else allowed & finite
        if lse is not None and not folded:
            S = S.sub_(lse[..., None])  # [B, h, bq, bk] - [B, h, bq, 1]
        if allowed is not None:
            S = S.masked_fill_(~allowed, float("-inf"))
        return S, allowed, diagonal


def _add_diagonal(acc: torch.Tensor, P: torch.Tensor, delta: int, a: int) -> None:
    """acc [B, h, r] += the diagonal ``delta`` of the tile P [B, h, bq, bk] (row x's entry at column
    x + delta, if the tile has it), the tile's rows being the output rows from ``a``."""
    if -P.shape[-2] < delta < P.shape[-1]:
        diag = P.diagonal(delta, -2, -1)  # [B, h, n]
        x0 = max(0, -delta)
        acc[:, :, a + x0:a + x0 + diag.shape[-1]] += diag


def _first_key(sink: torch.Tensor, done: torch.Tensor | None, P: torch.Tensor, allowed: torch.Tensor | None,
               diagonal: int | None) -> torch.Tensor | None:
    """``sink`` [B, h, bq] (a view) takes P [B, h, bq, bk] on each row's first allowed key of this tile, for
    the rows ``done`` [B, h, bq] has not found one for yet (tiles come in key order); returns the rows
    found so far, or None once every row has its key. ``allowed`` [#B, #h, bq, bk] (None: every key, or
    with ``diagonal`` a causal tile: key j allowed for row x when j <= x + diagonal)."""
    if done is None:
        return None
    if allowed is None:
        first = P[..., 0]  # [B, h, bq]: column 0 is allowed (for every row, or for the causal rows below)
        ok = torch.ones_like(done) if diagonal is None else \
            (torch.arange(P.shape[-2], device=P.device) + diagonal >= 0).expand_as(done)  # [B, h, bq]
    else:
        A = allowed.expand(P.shape)  # [#B, #h, bq, bk] -> [B, h, bq, bk]
        ok = A.any(-1)  # [B, h, bq]
        first = P.gather(-1, A.to(torch.uint8).argmax(-1, keepdim=True))[..., 0]  # [B, h, bq]: argmax = first True
    new = ok & ~done
    sink.copy_(torch.where(new, first, sink))
    done = done | new
    return None if bool(done.all()) else done


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs [start, stop) of sorted unique query indices."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _spans(rows: list[int] | None, Q: int) -> list[tuple[int, int, int]]:
    """(i0, i1, o0): runs of consecutive call rows [i0, i1) and where they start in the output rows."""
    if rows is None:
        return [(0, Q, 0)]
    out, o = [], 0
    for i0, i1 in runs(rows):
        out.append((i0, i1, o))
        o += i1 - i0
    return out


def _fused_lse(p: Problem, heads: list[int], rows: list[int] | None) -> torch.Tensor | None:
    """The lse [B, h, r] from PyTorch's fused CPU flash kernel (which returns it), where it computes the
    call as bhqk does (no mask or a causal one it aligns the same way, no bias, softcap or dropout;
    the sinks are added after), else None."""
    from ..functional.spans_kernels import fused_lse, fused_refuses
    from ..functional.torch_sdpa import structure_free

    if (fused_refuses(p.q, exact_lse=True) is not None or p.softcap is not None or not structure_free(p)
            or p.ext.Q == 0 or p.ext.K == 0):
        return None
    H = p.ext.H
    if rows is not None and p.mask is not None:
        return None  # the causal offset of a row subset is not SDPA's top-left
    q = p.q if rows is None and len(heads) == H else heads_rows(p.q, heads, rows)  # [B, H, Q, d] -> [B, h, r, d]
    k = per_query_head(p.k, H, heads)  # [B, Hkv, K, d] -> [B, h, K, d]: head h reads K/V head h // G
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))  # the kernel reads d at stride 1 (design.md §4)
    try:
        # is_causal is top-left: only for a causal mask that is not a decode step (which sees every key)
        lse = fused_lse(q, k, not p.every_key, scale=p.scale)  # [B, h, r]
    except RuntimeError:  # a shape or dtype the kernel refuses: the online pass computes it
        return None
    if p.sinks is not None:
        lse = add_sinks(lse, p.sinks[heads])  # [B, h, r] with [h]
    return lse


def row_lse(p: Problem, heads: list[int], rows: list[int] | None, *, block_q: int | None = None,
            block_k: int | None = None) -> torch.Tensor:
    """The log-sum-exp [B, h, r] of the selected heads and rows, by PyTorch's fused kernel where it
    can compute the call, else by one online pass over key tiles (sinks included; -inf for a row that
    may attend nothing and has no sink)."""
    fused = _fused_lse(p, heads, rows)
    if fused is not None:
        return fused.to(compute_dtype(p.q))
    call = _Call(p, heads)
    B, K = call.ext.B, call.ext.K
    r = call.ext.Q if rows is None else len(rows)
    bq, bk = _blocks(B, call.h, r, K, block_q, block_k)
    out = torch.full((B, call.h, r), float("-inf"), dtype=call.dt, device=call.dev)
    for i0, i1, a, b in call.q_blocks(rows, bq):
        qa = call.q_tile(i0, i1, None)  # [B, h, bq, d+2]
        m = torch.full((B, call.h, i1 - i0), float("-inf"), dtype=call.dt, device=call.dev)  # running max
        l = torch.zeros_like(m)  # running Σ exp(S − m)
        for k0, k1, ka in call.k_tiles(bk):
            got = call.scores(qa, ka, i0, i1, k0, k1, None, False)
            if got is None:
                continue
            S = got[0]  # [B, h, bq, bk]
            m_new = torch.maximum(m, S.amax(-1))  # [B, h, bq]
            m_use = torch.where(torch.isfinite(m_new), m_new, 0.0)
            l = l * torch.exp(torch.where(torch.isfinite(m), m - m_use, float("-inf"))) \
                + torch.exp(S.sub_(m_use[..., None])).sum(-1)
            m = m_new
        out[:, :, a:b] = lse_of(m, l)  # [B, h, bq]: -inf where the row saw no key
    if call.sinks is not None:
        out = add_sinks(out, call.sinks)  # [B, h, r] with [h]
    return out


class _Rows:
    """One pass over the tiles of the selected rows: the call, the sizes, the lse [B, h, r] and the options."""

    def __init__(self, p: Problem, heads: list[int], rows: list[int] | None, lse: torch.Tensor, want: Want,
                 block_q: int | None, block_k: int | None) -> None:
        self.call = call = _Call(p, heads)
        self.B, self.K, self.h, self.dt, self.dev = call.ext.B, call.ext.K, call.h, call.dt, call.dev
        self.r = call.ext.Q if rows is None else len(rows)
        self.rows, self.want, self.d = rows, want, p.q.shape[-1]
        self.bq, self.bk = _blocks(self.B, self.h, self.r, self.K, block_q, block_k)
        self.lse_given, self.blocks = lse, (block_q, block_k)
        self.lse = torch.where(torch.isfinite(lse), lse, 0.0)  # a row that may attend nothing: its P is 0 whatever lse is used

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.B, self.h, self.r, dtype=self.dt, device=self.dev)  # [B, h, r]


@dataclass
class _Block:
    """A block of consecutive selected rows [i0, i1), output rows [a, b), with L = their lse [B, h, bq],
    qa = :meth:`_Call.q_tile` and pos [bq] their key positions."""

    i0: int
    i1: int
    a: int
    b: int
    L: torch.Tensor
    qa: torch.Tensor
    pos: torch.Tensor


@dataclass
class _Tile:
    """One tile of a block: keys [k0, k1), P [B, h, bq, bk] (0 where not allowed), how it is masked
    (:meth:`_Call.scores`), PK = P @ k_tile [B, h, bq, d + 2] and from it sP = Σ_j P, sPj = Σ_j P·(j − k0)."""

    k0: int
    k1: int
    P: torch.Tensor
    allowed: torch.Tensor | None
    diagonal: int | None
    PK: torch.Tensor
    sP: torch.Tensor
    sPj: torch.Tensor


class _Stat:
    """A statistic computed tile by tile: :meth:`block` at each row block, :meth:`tile` on each tile
    that may be attended, :meth:`end` after a block's last tile, :meth:`result` its tensors by name."""

    name = ""

    def __init__(self, s: _Rows) -> None:
        self.s = s
        self.acc = s.zeros()  # [B, h, r]

    def block(self, blk: _Block) -> None:
        pass

    def tile(self, blk: _Block, t: _Tile) -> None:
        raise NotImplementedError

    def end(self, blk: _Block, done: dict[str, _Stat]) -> None:
        pass

    def result(self) -> dict:
        return {self.name: self.acc}


class _Mass(_Stat):
    name = "mass"

    def tile(self, blk: _Block, t: _Tile) -> None:
        self.acc[:, :, blk.a:blk.b] += t.sP


class _Entropy(_Stat):
    name = "entropy"

    def block(self, blk: _Block) -> None:
        s = self.s
        fast = s.call.fast  # entropy linear in k: Σ_j P k_j through the PK matmul
        self.pk = torch.zeros(s.B, s.h, blk.i1 - blk.i0, s.d, dtype=s.dt, device=s.dev) if fast else None  # [B, h, bq, d]

    def tile(self, blk: _Block, t: _Tile) -> None:
        if self.pk is not None:
            self.pk += t.PK[..., :self.s.d]
        else:
            self.acc[:, :, blk.a:blk.b] -= torch.special.xlogy(t.P, t.P).sum(-1)

    def end(self, blk: _Block, done: dict[str, _Stat]) -> None:
        if self.pk is not None:
            # −Σ_j P (S_j − lse) = lse·ΣP − (q·scale)·Σ_j P k_j
            qs = blk.qa[..., :self.s.d]  # [B, h, bq, d]
            self.acc[:, :, blk.a:blk.b] = blk.L * done["mass"].acc[:, :, blk.a:blk.b] - (qs * self.pk).sum(-1)

    def result(self) -> dict:
        return {"entropy": self.acc.clamp_(min=0.0)}  # rounding of the linear form can go a hair below 0


class _Distance(_Stat):
    name = "distance"

    def tile(self, blk: _Block, t: _Tile) -> None:
        c, acc, pos = self.s.call.c, self.acc[:, :, blk.a:blk.b], blk.pos
        lo, hi = blk.i0 + c, blk.i1 - 1 + c  # positions of the block's first and last rows
        if t.k1 - 1 <= lo or self.s.call.causal:  # every (allowed) key at or before the row's position: pos − j
            acc += (pos - t.k0) * t.sP - t.sPj
        elif t.k0 >= hi:  # every key at or after: j − pos
            acc += t.sPj - (pos - t.k0) * t.sP
        else:
            D = (pos[:, None] - torch.arange(t.k0, t.k1, dtype=self.s.dt, device=self.s.dev)[None, :]).abs_()  # [bq, bk]
            acc += (t.P * D).sum(-1)


class _Sink(_Stat):
    name = "sink"

    def block(self, blk: _Block) -> None:
        s = self.s
        self.done: torch.Tensor | None = torch.zeros(s.B, s.h, blk.i1 - blk.i0, dtype=torch.bool, device=s.dev)  # first key found

    def tile(self, blk: _Block, t: _Tile) -> None:
        self.done = _first_key(self.acc[:, :, blk.a:blk.b], self.done, t.P, t.allowed, t.diagonal)


class _Offsets(_Stat):
    name = "offset"

    def __init__(self, s: _Rows) -> None:
        self.s = s
        self.offs = {o: s.zeros() for o in s.want.offsets}  # {o: [B, h, r]}

    def tile(self, blk: _Block, t: _Tile) -> None:
        for off, acc in self.offs.items():
            _add_diagonal(acc, t.P, blk.i0 + self.s.call.c - off - t.k0, blk.a)  # row x's key pos(x) − off: column x + delta

    def result(self) -> dict:
        return {"offset": self.offs}


class _Local(_Stat):
    name = "local"

    def tile(self, blk: _Block, t: _Tile) -> None:
        s, c = self.s, self.s.call.c
        W, lo, hi = s.want.window, blk.i0 + c, blk.i1 - 1 + c
        assert W is not None  # computed only with a window
        if t.k0 > hi - W and t.k1 - 1 < lo + W:  # the whole tile is inside every row's window
            self.acc[:, :, blk.a:blk.b] += t.sP
        elif W <= NARROW and t.k0 < hi + W and t.k1 - 1 > lo - W:  # a narrow band: its diagonals
            for off in range(0 if s.call.causal else -(W - 1), W):  # key pos − off
                _add_diagonal(self.acc, t.P, blk.i0 + c - off - t.k0, blk.a)
        elif t.k0 < hi + W and t.k1 - 1 > lo - W:  # the band crosses the tile
            D = (blk.pos[:, None] - torch.arange(t.k0, t.k1, dtype=s.dt, device=s.dev)[None, :]).abs_()  # [bq, bk]
            self.acc[:, :, blk.a:blk.b] += (t.P * (D < W)).sum(-1)


class _TopK(_Stat):
    name = "topk"

    def __init__(self, s: _Rows) -> None:
        self.s = s
        self.t = t = min(s.want.topk, s.K)
        self.p = torch.full((s.B, s.h, s.r, t), -1.0, dtype=s.dt, device=s.dev)  # [B, h, r, t]
        self.k = torch.zeros(s.B, s.h, s.r, t, dtype=torch.long, device=s.dev)  # [B, h, r, t]

    def tile(self, blk: _Block, t: _Tile) -> None:
        a, b = blk.a, blk.b
        v_, i_ = t.P.topk(min(self.t, t.k1 - t.k0), dim=-1)  # [B, h, bq, n]
        vals = torch.cat([self.p[:, :, a:b], v_], -1)  # [B, h, bq, t + n]
        keys = torch.cat([self.k[:, :, a:b], i_ + t.k0], -1)
        v2, j2 = vals.topk(self.t, dim=-1)  # [B, h, bq, t]
        self.p[:, :, a:b], self.k[:, :, a:b] = v2, keys.gather(-1, j2)

    def result(self) -> dict:
        return {"topk_weights": self.p.clamp_(min=0.0), "topk_keys": self.k}  # K = 0: [B, h, r, 0], no key to rank


class _Max(_Stat):
    name = "max"

    def tile(self, blk: _Block, t: _Tile) -> None:
        acc = self.acc[:, :, blk.a:blk.b]
        torch.maximum(acc, t.P.amax(-1), out=acc)  # [B, h, bq]; P >= 0, so 0 for a row that may attend nothing


ROW = ("B", "H", "Q")  # the named axes of a per-row statistic (H and Q: the captured heads and rows)


@dataclass(frozen=True)
class Statistic:
    """One named statistic: the tensors it adds to a record (name -> named axes), how it is computed
    (``tiles``: a :class:`_Stat` run tile by tile; or ``after``: from the pass's column sums and real
    rows), the capture option it needs (``offsets``, ``window``, ``topk``; None: named in ``what``),
    whether every capture of statistics has it (``always``) and whether the head table averages it
    over the real rows (``column``)."""

    outputs: dict[str, tuple[str, ...]]
    tiles: type[_Stat] | None = None
    after: Callable[[_Rows, dict, Problem, list[int]], None] | None = None
    option: str | None = None
    always: bool = False
    column: bool = False


def _real(s: _Rows, out: dict, p: Problem, heads: list[int]) -> None:
    """real [B, h, r]: the row gives weight to some key, and its own key (if any) receives weight from some row."""
    K, Q = s.K, s.call.ext.Q
    rows_t = torch.arange(Q) if s.rows is None else torch.tensor(s.rows)
    pos = rows_t + (K - Q)  # [r] key position of each row
    inside = (pos >= 0) & (pos < K)
    real = out["mass"] > 0  # [B, h, r]
    if bool(inside.any()):
        own = out["colsum"][:, :, pos.clamp(0, max(K - 1, 0)).to(real.device)] > 0  # [B, h, r]
        real &= own | ~inside.to(real.device)
    out["real"] = real


def _received(s: _Rows, out: dict, p: Problem, heads: list[int]) -> None:
    """received [B, h, K]: the column sums of P over the real rows (padding rows' share taken out again)."""
    out["received"] = out["colsum"]
    pad = (out["mass"] > 0) & ~out["real"]  # rows that attend but are padding: their share leaves received
    if bool(pad.any()):
        idx = pad.any(0).any(0).nonzero().flatten()  # output rows padded in some (b, h)
        rows_t = torch.arange(s.call.ext.Q) if s.rows is None else torch.tensor(s.rows)
        sub_rows = rows_t[idx.cpu()].tolist()
        out["received"] -= _weighted_colsum(p, heads, sub_rows, s.lse_given[:, :, idx], pad[:, :, idx].to(s.dt),
                                            s.blocks)


# The statistics, in the order a record lists them. A new statistic is one entry here (and its test).
STATISTICS: dict[str, Statistic] = {
    "entropy": Statistic({"entropy": ROW}, _Entropy, column=True),  # −Σ_j P log P
    "distance": Statistic({"distance": ROW}, _Distance, column=True),  # Σ_j P·|pos(i) − j|
    "sink": Statistic({"sink": ROW}, _Sink, column=True),  # P on the first key the row may attend
    "local": Statistic({"local": ROW}, _Local, option="window", column=True),  # Σ P with |pos(i) − j| < window
    "mass": Statistic({"mass": ROW}, _Mass, always=True),  # Σ_j P
    "real": Statistic({"real": ROW}, after=_real, always=True),  # the rows that count
    "received": Statistic({"received": ("B", "H", "K")}, after=_received),  # Σ over the real rows of P
    "offset": Statistic({}, _Offsets, option="offsets"),  # {o: P on key pos(i) − o}
    "topk": Statistic({"topk_weights": ("B", "H", "Q", "t"), "topk_keys": ("B", "H", "Q", "t")}, _TopK, option="topk"),
    "max": Statistic({"max": ROW}, _Max, column=True),  # max_j P: the largest weight of the row
}


def row_stats(p: Problem, heads: list[int], rows: list[int] | None, lse: torch.Tensor | None, want: Want = Want(),
              *, block_q: int | None = None, block_k: int | None = None) -> dict:
    """The statistics ``want`` asks for (:data:`STATISTICS`) for one call; ``lse``: the call's [B, H, Q]
    or None (recomputed for the selected heads and rows). Returns a dict of tensors in the compute dtype
    (``offset``: {o: tensor}), with ``mass``, ``real`` and ``lse`` [B, h, r]."""
    if lse is None:
        lse_sel = row_lse(p, heads, rows, block_q=block_q, block_k=block_k)  # [B, h, r]
    else:
        lse_sel = heads_rows(lse, heads, rows).to(compute_dtype(p.q))  # [B, H, Q] -> [B, h, r]
    s = _Rows(p, heads, rows, lse_sel, want, block_q, block_k)
    names = want.names()
    stats = []
    for n in names:
        tiles = STATISTICS[n].tiles
        if tiles is not None:
            stats.append(tiles(s))
    out = _row_pass(s, stats)
    for n in names:
        after = STATISTICS[n].after
        if after is not None:
            after(s, out, p, heads)
    out.pop("colsum")
    out["lse"] = lse_sel
    return out


def _row_pass(s: _Rows, stats: list[_Stat], weight: torch.Tensor | None = None) -> dict:
    """One pass over the tiles of the selected rows: each statistic of ``stats`` sees every tile; returns
    their results and ``colsum`` [B, h, K], Σ over the rows of P (of weight·P, ``weight`` [B, h, r])."""
    call, B, h, dt, dev = s.call, s.B, s.h, s.dt, s.dev
    colsum = torch.zeros(B, h, s.K, dtype=dt, device=dev)  # [B, h, K]
    done = {st.name: st for st in stats}
    for i0, i1, a, b in call.q_blocks(s.rows, s.bq):  # output rows [a, b) of this q block
        L = s.lse[:, :, a:b]  # [B, h, bq]
        qa = call.q_tile(i0, i1, L if call.fast else None)  # [B, h, bq, d+2]
        blk = _Block(i0, i1, a, b, L, qa, torch.arange(i0, i1, dtype=dt, device=dev) + call.c)  # pos [bq]
        for st in stats:
            st.block(blk)
        for k0, k1, ka in call.k_tiles(s.bk):  # ka [B, h/G, bk, d+2]
            got = call.scores(qa, ka, i0, i1, k0, k1, L, call.fast, defer_causal=True)
            if got is None:
                continue
            P, allowed, diagonal = got
            P = P.exp_()  # [B, h, bq, bk]: exp(S − lse), 0 where not allowed
            if diagonal is not None:
                P = P.tril_(diagonal)  # the causal mask, applied after the exp: 0 above the diagonal
            colsum[:, :, k0:k1] += P.sum(-2) if weight is None else (P * weight[:, :, a:b, None]).sum(-2)  # [B, h, bk]
            if not stats:
                continue
            PK = call.matmul(P, ka, "PK")  # [B, h, bq, bk] @ [B, h/G, bk, d+2] -> [B, h, bq, d+2]
            t = _Tile(k0, k1, P, allowed, diagonal, PK, PK[..., s.d], PK[..., s.d + 1])  # sP, sPj: [B, h, bq]
            for st in stats:
                st.tile(blk, t)
        for st in stats:
            st.end(blk, done)
    out: dict = {"colsum": colsum}
    for st in stats:
        out.update(st.result())
    return out


def _weighted_colsum(p: Problem, heads: list[int], rows: list[int], lse: torch.Tensor, weight: torch.Tensor,
                     blocks: tuple[int | None, int | None]) -> torch.Tensor:
    """Σ over the rows ``rows`` of weight·P: [B, h, K], with their lse [B, h, r] and ``weight`` [B, h, r]."""
    return _row_pass(_Rows(p, heads, rows, lse, Want(()), *blocks), [], weight)["colsum"]


__all__ = ["Want", "Statistic", "STATISTICS", "row_stats", "row_lse", "runs", "TILE_ENTRIES"]
