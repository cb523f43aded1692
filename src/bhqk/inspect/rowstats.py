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

from dataclasses import dataclass

import torch

from ..functional.problem import Problem
from ..masks import Tile
from ..shapes import as_4d, compute_dtype, per_query_head
from .layers import heads_rows, value_heads

TILE_ENTRIES = 1 << 22  # entries of one [B, h, bq, bk] score tile (16 MiB in float32)
NARROW = 32  # a window up to this wide is summed from its diagonals, not from a [bq, bk] band mask


@dataclass(frozen=True)
class Want:
    """Which statistics to compute."""

    entropy: bool = True
    distance: bool = True
    sink: bool = True
    received: bool = True
    offsets: tuple[int, ...] = ()
    window: int | None = None  # local: mass on keys with |pos(i) − j| < window
    topk: int = 0


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
    from ..functional.torch_sdpa import all_allowed, structure_free

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if (op is None or p.q.device.type != "cpu" or p.softcap is not None or not structure_free(p)
            or p.q.dtype not in (torch.float32, torch.float64) or p.ext.Q == 0 or p.ext.K == 0):
        return None
    H = p.ext.H
    if rows is not None and p.mask is not None:
        return None  # the causal offset of a row subset is not SDPA's top-left
    q = p.q if rows is None and len(heads) == H else heads_rows(p.q, heads, rows)  # [B, H, Q, d] -> [B, h, r, d]
    k = per_query_head(p.k, H, heads)  # [B, Hkv, K, d] -> [B, h, K, d]: head h reads K/V head h // G
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))  # the kernel reads d at stride 1 (design.md §4)
    try:
        # is_causal is top-left: only for a causal mask that is not a decode step (which sees every key)
        lse = op(q, k, k, 0.0, not all_allowed(p), scale=p.scale)[1]  # [B, h, r]; v = k: only the lse is kept
    except RuntimeError:  # a shape or dtype the kernel refuses: the online pass computes it
        return None
    if p.sinks is not None:
        lse = torch.logaddexp(lse, p.sinks[heads].to(lse.dtype)[None, :, None])  # [B, h, r] with [1, h, 1]
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
        out[:, :, a:b] = torch.where(l > 0, torch.log(l) + torch.where(torch.isfinite(m), m, 0.0), float("-inf"))
    if call.sinks is not None:
        out = torch.logaddexp(out, call.sinks[None, :, None])  # [B, h, r] with [1, h, 1]
    return out


def row_stats(p: Problem, heads: list[int], rows: list[int] | None, lse: torch.Tensor | None, want: Want = Want(),
              *, block_q: int | None = None, block_k: int | None = None) -> dict:
    """The statistics of the module docstring for one call; ``lse``: the call's [B, H, Q] or None
    (recomputed for the selected heads and rows). Returns a dict of tensors in the compute dtype."""
    if lse is None:
        lse_sel = row_lse(p, heads, rows, block_q=block_q, block_k=block_k)  # [B, h, r]
    else:
        lse_sel = heads_rows(lse, heads, rows).to(compute_dtype(p.q))  # [B, H, Q] -> [B, h, r]
    out = _pass(p, heads, rows, lse_sel, want, None, block_q, block_k)
    K, Q = p.ext.K, p.ext.Q
    rows_t = torch.arange(Q) if rows is None else torch.tensor(rows)
    pos = rows_t + (K - Q)  # [r] key position of each row
    inside = (pos >= 0) & (pos < K)
    # a row counts when it gives weight to some key, and its own key (if any) receives weight from some row
    row_any = out["mass"] > 0  # [B, h, r]
    real = row_any.clone()
    if bool(inside.any()):
        own = out["colsum"][:, :, pos.clamp(0, max(K - 1, 0)).to(real.device)] > 0  # [B, h, r]
        real &= own | ~inside.to(real.device)
    out["real"] = real
    colsum = out.pop("colsum")
    if want.received:
        out["received"] = colsum
        pad = row_any & ~real  # rows that attend but are padding: their share leaves received
        if bool(pad.any()):
            idx = pad.any(0).any(0).nonzero().flatten()  # output rows padded in some (b, h)
            sub_rows = rows_t[idx.cpu()].tolist()
            fix = _pass(p, heads, sub_rows, lse_sel[:, :, idx], Want(False, False, False, True), pad[:, :, idx].to(lse_sel.dtype),
                        block_q, block_k)
            out["received"] -= fix["received"]
    out["lse"] = lse_sel
    return out


def _pass(p: Problem, heads: list[int], rows: list[int] | None, lse: torch.Tensor, want: Want,
          row_weight: torch.Tensor | None, block_q: int | None, block_k: int | None) -> dict:
    """One pass over the tiles of the selected rows with their lse [B, h, r]."""
    call = _Call(p, heads)
    B, K, Q, h, dt, dev = call.ext.B, call.ext.K, call.ext.Q, call.h, call.dt, call.dev
    r = Q if rows is None else len(rows)
    bq, bk = _blocks(B, h, r, K, block_q, block_k)
    d = p.q.shape[-1]
    finite = torch.isfinite(lse)
    lse_use = torch.where(finite, lse, 0.0)  # a row that may attend nothing: its P is 0 whatever lse is used
    z = torch.zeros(B, h, r, dtype=dt, device=dev)
    res: dict = {"mass": z.clone(), "colsum": torch.zeros(B, h, K, dtype=dt, device=dev)}
    if want.entropy:
        res["entropy"] = z.clone()
    if want.distance:
        res["distance"] = z.clone()
    if want.sink:
        res["sink"] = z.clone()
    if want.window is not None:
        res["local"] = z.clone()
    if want.received and row_weight is not None:
        res["received"] = torch.zeros(B, h, K, dtype=dt, device=dev)
    offs = {o: z.clone() for o in want.offsets}
    t = min(want.topk, K)
    if t:
        top_p = torch.full((B, h, r, t), -1.0, dtype=dt, device=dev)
        top_k = torch.zeros(B, h, r, t, dtype=torch.long, device=dev)
    for i0, i1, a, b_ in call.q_blocks(rows, bq):  # b_: output rows [a, b_) of this q block
        L = lse_use[:, :, a:b_]  # [B, h, bq]
        qa = call.q_tile(i0, i1, L if call.fast else None)  # [B, h, bq, d+2]
        pos = torch.arange(i0, i1, dtype=dt, device=dev) + call.c  # [bq] key position of each row
        pk = torch.zeros(B, h, i1 - i0, d, dtype=dt, device=dev) if (want.entropy and call.fast) else None  # Σ_j P k_j
        w = None if row_weight is None else row_weight[:, :, a:b_, None]  # [B, h, bq, 1]
        sink_done = torch.zeros(B, h, i1 - i0, dtype=torch.bool, device=dev) if want.sink else None  # first key found
        for k0, k1, ka in call.k_tiles(bk):  # ka [B, h/G, bk, d+2]
            got = call.scores(qa, ka, i0, i1, k0, k1, L, call.fast, defer_causal=True)
            if got is None:
                continue
            P, allowed, diagonal = got
            P = P.exp_()  # [B, h, bq, bk]: exp(S − lse), 0 where not allowed
            if diagonal is not None:
                P = P.tril_(diagonal)  # the causal mask, applied after the exp: 0 above the diagonal
            if w is None:
                res["colsum"][:, :, k0:k1] += P.sum(-2)  # [B, h, bk]
            else:
                res["received"][:, :, k0:k1] += (P * w).sum(-2)  # [B, h, bk]
            if row_weight is not None and not (want.entropy or want.distance or want.sink or offs or t
                                               or want.window is not None):
                continue
            PK = call.matmul(P, ka, "PK")  # [B, h, bq, bk] @ [B, h/G, bk, d+2] -> [B, h, bq, d+2]
            sP, sPj = PK[..., d], PK[..., d + 1]  # Σ_j P and Σ_j P·(j − k0): [B, h, bq]
            res["mass"][:, :, a:b_] += sP
            if pk is not None:
                pk += PK[..., :d]
            elif want.entropy:
                res["entropy"][:, :, a:b_] -= torch.special.xlogy(P, P).sum(-1)
            if want.distance:
                lo, hi = i0 + call.c, i1 - 1 + call.c  # positions of the block's first and last rows
                if k1 - 1 <= lo or call.causal:  # every (allowed) key at or before the row's position: pos − j
                    res["distance"][:, :, a:b_] += (pos - k0) * sP - sPj
                elif k0 >= hi:  # every key at or after: j − pos
                    res["distance"][:, :, a:b_] += sPj - (pos - k0) * sP
                else:
                    D = (pos[:, None] - torch.arange(k0, k1, dtype=dt, device=dev)[None, :]).abs_()  # [bq, bk]
                    res["distance"][:, :, a:b_] += (P * D).sum(-1)
            if sink_done is not None:
                sink_done = _first_key(res["sink"][:, :, a:b_], sink_done, P, allowed, diagonal)
            for off, acc in offs.items():
                _add_diagonal(acc, P, i0 + call.c - off - k0, a)  # row x's key pos(x) − off: column x + delta
            if want.window is not None:
                W, lo, hi = want.window, i0 + call.c, i1 - 1 + call.c
                if k0 > hi - W and k1 - 1 < lo + W:  # the whole tile is inside every row's window
                    res["local"][:, :, a:b_] += sP
                elif W <= NARROW and k0 < hi + W and k1 - 1 > lo - W:  # a narrow band: its diagonals
                    for off in range(0 if call.causal else -(W - 1), W):  # key pos − off
                        _add_diagonal(res["local"], P, i0 + call.c - off - k0, a)
                elif k0 < hi + W and k1 - 1 > lo - W:  # the band crosses the tile
                    D = (pos[:, None] - torch.arange(k0, k1, dtype=dt, device=dev)[None, :]).abs_()  # [bq, bk]
                    res["local"][:, :, a:b_] += (P * (D < W)).sum(-1)
            if t:
                n = min(t, k1 - k0)
                v_, i_ = P.topk(n, dim=-1)  # [B, h, bq, n]
                vals = torch.cat([top_p[:, :, a:b_], v_], -1)  # [B, h, bq, t + n]
                keys = torch.cat([top_k[:, :, a:b_], i_ + k0], -1)
                v2, j2 = vals.topk(t, dim=-1)  # [B, h, bq, t]
                top_p[:, :, a:b_], top_k[:, :, a:b_] = v2, keys.gather(-1, j2)
        if pk is not None:
            # −Σ_j P (S_j − lse) = lse·ΣP − (q·scale)·Σ_j P k_j
            qs = qa[..., :d]  # [B, h, bq, d]
            res["entropy"][:, :, a:b_] = L * res["mass"][:, :, a:b_] - (qs * pk).sum(-1)
    if offs:
        res["offset"] = offs
    if t:
        res["topk_weights"], res["topk_keys"] = top_p.clamp_(min=0.0), top_k
    elif want.topk:  # K = 0: no key to rank
        res["topk_weights"] = torch.zeros(B, h, r, 0, dtype=dt, device=dev)
        res["topk_keys"] = torch.zeros(B, h, r, 0, dtype=torch.long, device=dev)
    if "entropy" in res:
        res["entropy"].clamp_(min=0.0)  # rounding of the linear form can go a hair below 0
    return res


__all__ = ["Want", "row_stats", "row_lse", "runs", "TILE_ENTRIES"]
