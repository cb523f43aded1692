"""Quantized keys and values for the budget cache (``plan.cache(model, bits=8 | 4)``, docs/design.md §9).

One quantizer, :func:`quantize`, used by the cache and by whatever emulates it (:func:`fake_quantize`
is ``dequantize(quantize(x))``, the same arithmetic bit for bit): asymmetric min-max over groups of
``group`` consecutive channels of ONE position (per token, for keys and values alike), a scale and a
zero point (the group's minimum) per group stored in float16, the integers in ``uint8`` — two per
byte at 4 bits (channel 2i in the low nibble, 2i + 1 in the high one). Per token, every position is
quantized on its own: a cache drops, crops and reorders positions without requantizing, and a NaN or
inf in one key or value spoils only that position's groups (it reaches only the rows that may attend
that position, as on every other path).

:func:`attend` never makes a float copy of the cache. A decode step (few query rows) uses
:func:`_factored`: a group's key is i·s + z, so q·k = s·(q·i) + z·Σq and Σ p·v = Σ (p·s)·i + Σ p·z — the
integers are converted to floats ``block`` positions at a time into one reused buffer and multiplied,
the scales and zero points apply to the products, one softmax over every column. Many rows (a prefill
chunk) use :func:`_blockwise`: each block dequantized and attended (two matmuls over the grouped query
heads), the partials merged by log-sum-exp (:func:`bhqk.functional.merge.merge`, as the span path merges
spans). A block whose scales are not all finite, or a non-finite float tail, goes through bhqk's
attention, which confines it to the rows that may attend it. Sinks join once at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import masks, observe
from ..errors import ShapeError
from ..functional import attention, attention_weights
from ..functional.merge import lse_of, merge, with_sinks
from ..shapes import as_4d
from .ring import own

BITS = (8, 4)
GROUP = 32  # channels per scale (the default where it divides d; else d)
RESIDUAL = 64  # the most recent positions kept in float (plus the positions a call writes)
BLOCK = 1024  # positions dequantized at a time by attend (the buffer is [B, Hkv, BLOCK, d] float32; docs/benchmarks.md)
SCALE_DTYPE = torch.float16  # scales and zero points: 4 bytes a group


def check(bits: object, group: object, d: int | None, where: str = "bits") -> int | None:
    """The group size to use (``group`` or the default for head size ``d``), or a ``ValueError`` for bits
    other than 8 and 4, or a group that is not a positive divisor of ``d`` (``d`` None: unknown yet)."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"{where}: bits must be one of {', '.join(map(str, BITS))} (or None: not quantized), got {bits!r}.")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ValueError(f"{where}: group must be a positive int (channels per scale), got {group!r}.")
    if d is None:
        return group
    g = group if group is not None else (GROUP if d % GROUP == 0 else d)
    if d % g:
        raise ValueError(f"{where}: group={g} does not divide the head size d={d}; choose a divisor of {d} "
                         f"(e.g. {', '.join(str(x) for x in (16, 32, 64, d) if d % x == 0 and x <= d)}).")
    if bits == 4 and d % 2:
        raise ValueError(f"{where}: bits=4 packs two channels a byte; the head size d={d} is odd.")
    return g


def position_bytes(d: int, bits: int, group: int) -> int:
    """Bytes of one quantized position of one head (the integers, scales and zero points)."""
    return d * bits // 8 + 2 * (d // group) * torch.empty((), dtype=SCALE_DTYPE).element_size()


@dataclass
class Quantized:
    """Positions of some heads in integers: ``data`` uint8 [B, h, n, d·bits/8], ``scale`` and ``zero``
    float16 [B, h, n, d/group]; ``dtype`` the float dtype they dequantize to."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    dtype: torch.dtype
    finite: bool = True  # every scale and zero point finite (then every value dequantizes finite); False: maybe not

    @property
    def n(self) -> int:
        """Positions held."""
        return int(self.data.shape[-2])

    @property
    def d(self) -> int:
        return int(self.data.shape[-1]) * 8 // self.bits

    def narrow(self, start: int, length: int) -> Quantized:
        """Positions ``start`` … ``start + length − 1`` (views)."""
        return self.map(lambda t: t.narrow(-2, start, length))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Quantized:
        """``fn`` on each of data, scale and zero (the same [B, h, n, ·] leading axes)."""
        return Quantized(fn(self.data), fn(self.scale), fn(self.zero), self.bits, self.group, self.dtype, self.finite)

    def cat(self, other: Quantized) -> Quantized:
        """These positions, then ``other``'s (copies)."""
        return Quantized(torch.cat([self.data, other.data], dim=-2), torch.cat([self.scale, other.scale], dim=-2),
                         torch.cat([self.zero, other.zero], dim=-2), self.bits, self.group, self.dtype,
                         self.finite and other.finite)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))

    def integers(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The integers of positions ``start`` … ``start + n − 1`` as floats into ``out`` [B, h, n, d] (any
        float dtype; unpacked at 4 bits), unscaled."""
        data = self.data.narrow(-2, start, out.shape[-2])  # [B, h, n, d·bits/8]
        if self.bits == 8:
            return out.copy_(data)  # uint8 [B, h, n, d] -> float
        out[..., 0::2].copy_(data & 15)  # [B, h, n, d/2] low nibbles: the even channels
        out[..., 1::2].copy_(data >> 4)  # high nibbles: the odd channels
        return out

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float [B, h, n, d] (into ``out`` when given: a buffer of that shape, reused by :func:`attend`)."""
        *lead, n, _ = self.data.shape
        d, g = self.d, self.group
        if out is None:
            out = torch.empty(*lead, n, d, dtype=self.dtype, device=self.data.device)
        grouped = self.integers(out).view(*lead, n, d // g, g)  # [B, h, n, d/g, g]
        grouped.mul_(self.scale.to(out.dtype)[..., None]).add_(self.zero.to(out.dtype)[..., None])
        return out


def quantize(x: torch.Tensor, bits: int, group: int) -> Quantized:
    """x float [B, h, n, d] → :class:`Quantized`: per position, groups of ``group`` channels, each
    ``round((x − min) / scale)`` in 0 … 2^bits − 1 with scale = (max − min) / (2^bits − 1), the scale and
    min rounded to float16 first (so the integers are computed from what is stored)."""
    *lead, n, d = x.shape
    top = (1 << bits) - 1
    xg = x.reshape(*lead, n, d // group, group)  # [B, h, n, d/g, g]
    lo, hi = xg.amin(-1), xg.amax(-1)  # [B, h, n, d/g] (NaN in a group: NaN, and the group dequantizes to NaN)
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - zero.to(x.dtype)) / top).to(SCALE_DTYPE)
    s = scale.to(x.dtype)
    s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: every integer 0
    q = ((xg - zero.to(x.dtype)[..., None]) / s[..., None]).round_().clamp_(0, top)  # [B, h, n, d/g, g]
    q = torch.nan_to_num(q, nan=0.0).to(torch.uint8).reshape(*lead, n, d)  # [B, h, n, d]
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # [B, h, n, d/2]: two channels a byte
    return Quantized(q, scale, zero, bits, group, x.dtype, _finite(scale, zero))


def _finite(scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether every value of these groups dequantizes finite (q·scale + zero, q ≤ 255: the float16 scale
    and zero point finite; d/group numbers a position, not d)."""
    return bool(torch.isfinite(scale).all()) and bool(torch.isfinite(zero).all())


def fake_quantize(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``quantize`` then ``dequantize``: the float values a quantized cache attends (x [.., n, d])."""
    shape = x.shape
    x4 = x.reshape(-1, 1, shape[-2], shape[-1]) if x.dim() != 4 else x  # [.., n, d] -> [B', 1, n, d]
    return quantize(x4, bits, group).dequantize().reshape(shape)  # [B', 1, n, d] -> [.., n, d]


def attend(query: torch.Tensor, qkeys: Quantized, qvalues: Quantized, keys: torch.Tensor, values: torch.Tensor,
           masks_at: Callable[[int, int], tuple[object, torch.Tensor | None]], *, scale: float | None,
           softcap: float | None, sinks: torch.Tensor | None, block: int = BLOCK) -> torch.Tensor:
    """Attention of ``query`` [B, H, Q, d] over positions held as ``qkeys``/``qvalues`` (columns 0 … nq − 1)
    then ``keys``/``values`` float [B, h, K − nq, ·] (columns nq … K − 1) → out [B, H, Q, dv].
    ``masks_at(a, b)``: (mask, additive bias) of columns a … b − 1. Few query rows (a decode step):
    :func:`_factored`, the scales applied to the products with the integers; else :func:`_blockwise`, each
    block of ``block`` positions dequantized and attended, merged by log-sum-exp. Sinks [H], if any, at the end."""
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32  # scores and sums (fp16/bf16 too)
    if _factored_fits(query, qkeys, qvalues, keys, values):
        out, lse = _factored(query.to(dt), qkeys, qvalues, keys.to(dt), values.to(dt), masks_at, scale, softcap, block)
    else:
        out, lse = _blockwise(query, qkeys, qvalues, keys, values, masks_at, scale, softcap, block, dt)
    if sinks is not None:
        bad = _spoiled(out, lse)  # [B, H, Q]
        out = torch.where(bad[..., None], out, with_sinks(out, lse, sinks)[0])
    return out.to(query.dtype)


def _blockwise(query: torch.Tensor, qkeys: Quantized, qvalues: Quantized, keys: torch.Tensor, values: torch.Tensor,
               masks_at: Callable[[int, int], tuple[object, torch.Tensor | None]], scale: float | None,
               softcap: float | None, block: int, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of quantized positions dequantized into one reused buffer and attended, the float tail
    through bhqk's attention, the partials merged by log-sum-exp → (out [B, H, Q, dv], lse [B, H, Q])."""
    nq = qkeys.n
    B, h = qkeys.data.shape[:2]
    kbuf = torch.empty(B, h, min(block, nq), qkeys.d, dtype=dt, device=query.device)  # reused per block
    vbuf = torch.empty(B, h, min(block, nq), qvalues.d, dtype=dt, device=query.device)
    qc = query.to(dt)
    out: torch.Tensor | None = None  # [B, H, Q, dv]: the partials merged so far
    lse: torch.Tensor | None = None  # [B, H, Q]
    for a in range(0, nq, block):
        b = min(nq, a + block)
        kq, vq = qkeys.narrow(a, b - a), qvalues.narrow(a, b - a)
        kb = kq.dequantize(kbuf[..., :b - a, :])  # [B, h, b − a, d]
        vb = vq.dequantize(vbuf[..., :b - a, :])  # [B, h, b − a, dv]
        m, bias = masks_at(a, b)
        if (qkeys.finite or _finite(kq.scale, kq.zero)) and (qvalues.finite or _finite(vq.scale, vq.zero)):
            o, lo = _block(qc, kb, vb, m, bias, scale, softcap)  # [B, H, Q, dv], [B, H, Q]
        else:  # a NaN or inf: bhqk's attention confines it to the rows that may attend it
            o, lo = attention(qc, kb, vb, m, bias=bias, scale=scale, softcap=softcap, return_lse=True)
        out, lse = (o, lo) if out is None or lse is None else _merge(out, lse, o, lo)
    K = nq + keys.shape[-2]
    if K > nq:
        m, bias = masks_at(nq, K)
        o, lo = attention(query, keys, values, m, bias=bias, scale=scale, softcap=softcap, return_lse=True)
        out, lse = (o, lo) if out is None or lse is None else _merge(out, lse, o, lo)
    assert out is not None and lse is not None
    return out, lse


def _factored_fits(query: torch.Tensor, qkeys: Quantized, qvalues: Quantized, keys: torch.Tensor,
                   values: torch.Tensor) -> bool:
    """Whether :func:`_factored` reads these: few query rows (G·Q rows × d/group groups per K/V head no more
    than d, so scaling per row and group costs less than dequantizing every position) and nothing
    non-finite (the float tail checked here; NaN and inf take the blockwise path, which confines them)."""
    B, H, Q, d = query.shape
    rows = H // qkeys.data.shape[1] * Q  # G·Q query rows per K/V head
    return (qkeys.n > 0 and rows * (d // qkeys.group) <= d and rows * (qvalues.d // qvalues.group) <= qvalues.d
            and qkeys.finite and qvalues.finite and bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all()))


def _factored(q: torch.Tensor, qk: Quantized, qv: Quantized, keys: torch.Tensor, values: torch.Tensor,
              masks_at: Callable[[int, int], tuple[object, torch.Tensor | None]], scale: float | None,
              softcap: float | None, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of few query rows (a decode step) that never forms a float key or value: a group's key is
    i·s + z, so q·k = s·(q·i) + z·Σq over the group, and a group's output is Σ p·(i·s + z) = Σ (p·s)·i +
    Σ p·z. The integers are read ``block`` positions at a time as floats into one buffer and multiplied
    (query rows spread over the groups: row (r, j) holds q_r's channels of group j, zeros elsewhere); the
    scales apply to the [rows, groups, positions] products; one softmax over every column.
    q [B, H, Q, d], keys/values the float tail [B, h, nf, ·], all in the compute dtype → (out, lse)."""
    B, H, Q, d = q.shape
    h, nq, dv = qk.data.shape[1], qk.n, qv.d
    G = H // h
    R, J, Jv = G * Q, d // qk.group, dv // qv.group  # rows, key groups, value groups per K/V head
    K = nq + keys.shape[-2]
    dt, dev = q.dtype, q.device
    qr = q.reshape(B, h, R, d)  # [B, H, Q, d] -> [B, h, G·Q, d]
    spread = torch.eye(J, dtype=dt, device=dev).repeat_interleave(qk.group, 1)  # [J, d]: 1 where channel c is in group j
    qj = (qr[..., None, :] * spread).reshape(B, h, R * J, d)  # [B, h, R·J, d]
    buf = torch.empty(B, h, min(block, nq), max(d, dv), dtype=dt, device=dev)  # reused per block
    parts = []
    for a in range(0, nq, block):
        n = min(block, nq - a)
        ints = qk.integers(buf[..., :n, :d], a)  # [B, h, n, d]
        parts.append(torch.matmul(qj, ints.transpose(-1, -2)))  # [B, h, R·J, n]
    qi = torch.cat(parts, -1).view(B, h, R, J, nq)  # [B, h, R, J, nq]: q_r's group j · the integers
    ks, kz = (t.to(dt).transpose(-1, -2) for t in (qk.scale, qk.zero))  # [B, h, nq, J] -> [B, h, J, nq]
    s = (qi * ks[:, :, None]).sum(3) + torch.matmul(qr.view(B, h, R, J, qk.group).sum(-1), kz)  # [B, h, R, nq]
    s = torch.cat([s, torch.matmul(qr, keys.transpose(-1, -2))], -1)  # [B, h, R, K]: the float tail's columns last
    s = s.mul_(d ** -0.5 if scale is None else scale).view(B, h, G, Q, K)  # [B, h, G, Q, K]
    p, top, total = _exp_scores(s, *masks_at(0, K), softcap)  # [B, h, G, Q, K], [B, h, G, Q] twice
    p = p.view(B, h, R, K)  # [B, h, G, Q, K] -> [B, h, G·Q, K]
    pq = p[..., :nq]  # [B, h, R, nq]
    vs = qv.scale.to(dt).transpose(-1, -2)  # [B, h, nq, Jv] -> [B, h, Jv, nq]
    pw = (pq[:, :, :, None, :] * vs[:, :, None]).reshape(B, h, R * Jv, nq)  # [B, h, R·Jv, nq]: p·s per value group
    acc = torch.zeros(B, h, R * Jv, dv, dtype=dt, device=dev)  # Σ (p·s)·i
    for a in range(0, nq, block):
        n = min(block, nq - a)
        acc.add_(torch.matmul(pw[..., a:a + n], qv.integers(buf[..., :n, :dv], a)))  # [B, h, R·Jv, dv]
    o = acc.view(B, h, R, Jv, Jv, qv.group).diagonal(dim1=3, dim2=4)  # [B, h, R, gv, Jv]: group j's channels of row (r, j)
    o = o.transpose(-1, -2).reshape(B, h, R, dv)  # [B, h, R, Jv, gv] -> [B, h, R, dv]
    o = o + torch.matmul(pq, qv.zero.to(dt)).repeat_interleave(qv.group, -1)  # Σ p·z per group, over its channels
    o = o + torch.matmul(p[..., nq:], values)  # [B, h, R, dv]: the float tail
    o = o.view(B, h, G, Q, dv)  # [B, h, G·Q, dv] -> [B, h, G, Q, dv]
    o = o / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return o.reshape(B, H, Q, dv), lse_of(top, total).reshape(B, H, Q)  # [B, H, Q, dv], [B, H, Q]


def _heads(t: torch.Tensor | None, h: int, G: int) -> torch.Tensor | None:
    """A mask or bias [#B, #H, #Q, n] in the grouped layout [#B, h or 1, G or 1, #Q, n] of :func:`_block`."""
    if t is None:
        return None
    if t.dim() == 4 and t.shape[1] == h * G and h * G > 1:
        return t.unflatten(1, (h, G))  # [#B, H, #Q, n] -> [#B, h, G, #Q, n]
    return t.reshape(*([1] * (4 - t.dim())), *t.shape)[:, :, None]  # [#B, 1, #Q, n] -> [#B, 1, 1, #Q, n]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m, bias: torch.Tensor | None, scale: float | None,
           softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, Q, d] over one block of finite keys k [B, h, n, d] and values v [B, h, n, dv]
    → (out [B, H, Q, dv], lse [B, H, Q]), no sinks: two matmuls of the h K/V heads' G query heads each (no
    per-call dispatch; a fully masked row gives out 0 and lse −inf)."""
    B, H, Q, d = q.shape
    h = k.shape[1]
    G = H // h
    s = torch.matmul(q.reshape(B, h, G * Q, d), k.transpose(-1, -2))  # [B, h, G·Q, n]
    s = s.mul_(d ** -0.5 if scale is None else scale).view(B, h, G, Q, -1)  # [B, h, G, Q, n]
    p, top, total = _exp_scores(s, m, bias, softcap)  # [B, h, G, Q, n], [B, h, G, Q] twice
    o = torch.matmul(p.view(B, h, G * Q, -1), v).view(B, h, G, Q, -1)  # [B, h, G, Q, dv]
    o = o / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return o.reshape(B, H, Q, -1), lse_of(top, total).reshape(B, H, Q)  # [B, H, Q, dv], [B, H, Q]


def _exp_scores(s: torch.Tensor, m, bias: torch.Tensor | None,
                softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled scores s [B, h, G, Q, n] → (exp(s − row max) [B, h, G, Q, n], row max, row sum [B, h, G, Q]):
    soft cap, then the additive bias and the mask [#B, #H, #Q, n] in the grouped layout; a row that sees
    nothing has max −inf and sum 0."""
    h, G = s.shape[1], s.shape[2]
    if softcap is not None:
        s = torch.tanh(s.div_(softcap)).mul_(softcap)
    b = _heads(bias, h, G)
    if b is not None:
        s = s + b.to(s.dtype)
    mk = _heads(m if isinstance(m, torch.Tensor) else None, h, G)
    if mk is not None:
        s = s.masked_fill(~mk, float("-inf"))
    top = s.amax(-1)  # [B, h, G, Q]
    p = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top))[..., None])  # [B, h, G, Q, n]
    return p, top, p.sum(-1)


def _spoiled(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """bool [B, H, Q]: rows a NaN or inf reached (they attend a non-finite key or value)."""
    return lse.isnan() | ~torch.isfinite(out).all(-1)


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~bhqk.functional.merge.merge`, keeping non-finite rows non-finite: a row a NaN or inf reached in
    either part (bhqk's attention confines them to the rows that may attend them) takes the non-finite
    parts' sum and lse NaN, where ``merge`` would read NaN as "saw nothing" (its partials are finite)."""
    bad_a, bad_b = _spoiled(out_a, lse_a), _spoiled(out_b, lse_b)  # [B, H, Q]
    out, lse = merge(out_a, lse_a, out_b, lse_b)  # [B, H, Q, dv], [B, H, Q]
    if not bool((bad_a | bad_b).any()):
        return out, lse
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    spoiled = torch.where(bad_a[..., None], out_a, zero) + torch.where(bad_b[..., None], out_b, zero)  # [B, H, Q, dv]
    bad = bad_a | bad_b
    return torch.where(bad[..., None], spoiled, out), torch.where(bad, torch.full_like(lse, float("nan")), lse)




def age(qk: Quantized | None, qv: Quantized | None, fk: torch.Tensor, fv: torch.Tensor, bits: int, group: int,
        residual: int) -> tuple[Quantized | None, Quantized | None, torch.Tensor, torch.Tensor]:
    """Quantize the float positions fk, fv [B, h, n, ·] older than the last ``residual`` and append them to
    ``qk``, ``qv`` → (qk, qv, fk, fv): after the call that wrote up to length L, positions < L − residual
    are integers (per position: :func:`quantize`), the last ``residual`` float (views of fk, fv)."""
    m = fk.shape[-2] - residual
    if m <= 0:
        return qk, qv, fk, fv
    nk, nv = quantize(fk[..., :m, :], bits, group), quantize(fv[..., :m, :], bits, group)  # [B, h, m, ·] -> integers
    qk = nk if qk is None else qk.cat(nk)  # [B, h, nq + m, ·]
    qv = nv if qv is None else qv.cat(nv)
    return qk, qv, fk[..., m:, :], fv[..., m:, :]  # the float tail: [B, h, residual, ·]


class QuantizedLayerCache:
    """One layer of bhqk's own :class:`~bhqk.nn.KVCache` whose K/V heads all keep every position, those
    older than the last ``residual`` in integers (``plan.kv_cache(model, bits=8 | 4)``: a plan's layer
    without streaming heads). It attends itself (``nn.cache.AttendingLayer``: :func:`attend`, never a
    float copy) — while capture, trace or edit look, or weights are asked for, over the dequantized keys
    in one call, as the emulation reads them. ``fits``: called with each call's k, v first (a plan's sizes)."""

    def __init__(self, bits: int, group: int | None = None, residual: int = RESIDUAL, block: int = BLOCK,
                 index: int = 0, fits: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        check(bits, group, None, f"KVCache layer {index}")
        self.bits, self.group, self.residual, self.block, self.index, self.fits = bits, group, residual, block, index, fits
        self.qk: Quantized | None = None  # [B, Hkv, nq, ·]: positions 0 … nq − 1
        self.qv: Quantized | None = None
        self.fk: torch.Tensor | None = None  # [B, Hkv, nf, d]: positions nq … length − 1, float
        self.fv: torch.Tensor | None = None
        self.end = 0

    @property
    def length(self) -> int:
        """Positions seen so far: the position of the next token."""
        return self.end

    def span(self, new: int) -> tuple[int, int]:
        """Every position: the mask of a call of ``new`` tokens covers [0, length + new)."""
        return 0, self.end + new

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Check k [B, Hkv, Q, d], v [B, Hkv, Q, dv] and append them in float; → the positions written before."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ShapeError(f"KVCache layer {self.index}: k must be [B, Hkv, Q, d] and v [B, Hkv, Q, dv] with the same "
                             f"B, Hkv, Q; got k {list(k.shape)}, v {list(v.shape)}.")
        if self.fits is not None:
            self.fits(k, v)
        where = f"KVCache layer {self.index}"
        self.group = check(self.bits, self.group, k.shape[-1], where)
        check(self.bits, self.group, v.shape[-1], f"{where} (values)")
        if self.fk is not None and self.fk.shape[:2] + self.fk.shape[3:] != k.shape[:2] + k.shape[3:]:
            raise ShapeError(f"{where} holds keys {list(self.fk.shape)} ([B, Hkv, n, d]); got {list(k.shape)}.")
        P = self.end
        self.fk = k if self.fk is None else torch.cat([self.fk, k], -2)  # [B, Hkv, nf + Q, d]
        self.fv = v if self.fv is None else torch.cat([self.fv, v], -2)  # [B, Hkv, nf + Q, dv]
        self.end = P + k.shape[-2]
        return P

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's keys and values in float (the quantized ones dequantized: a copy)."""
        assert self.fk is not None and self.fv is not None
        if self.qk is None or self.qv is None:
            return self.fk, self.fv
        return (torch.cat([self.qk.dequantize(), self.fk], -2),  # [B, Hkv, length, d]
                torch.cat([self.qv.dequantize(), self.fv], -2))

    def _age(self) -> None:
        assert self.fk is not None and self.fv is not None and self.group is not None
        self.qk, self.qv, fk, fv = age(self.qk, self.qv, self.fk, self.fv, self.bits, self.group, self.residual)
        self.fk, self.fv = own(fk), own(fv)  # the float tail owns its storage (not the whole call's keys)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v; → every position's keys and values in float (a copy: MultiHeadAttention calls
        :meth:`attention` instead, which reads the integers)."""
        self._store(k, v)
        out = self._dense()
        self._age()
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, bias=None,
                  dropout_p: float = 0.0, backend: str = "auto", sinks: torch.Tensor | None = None,
                  return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store k [B, Hkv, Q, d], v [B, Hkv, Q, dv] and attend q [B, H, Q, d] over every position (``mask``,
        ``bias`` [.., Q, length + Q] as for a plain cache) → (o [B, H, Q, dv], weights or None)."""
        if dropout_p:
            raise ValueError(f"KVCache layer {self.index}: a quantized cache is for inference; dropout_p must be 0.")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError(f"KVCache layer {self.index}: a quantized cache is for inference; run under torch.no_grad().")
        m = masks.as_mask(mask)
        self._store(k, v)
        B, H, Q, _ = q.shape
        K = self.end
        try:
            if self.qk is None or self.qv is None or return_weights or observe.active() or observe.editors():
                keys, values = self._dense()  # [B, Hkv, K, ·]: what the emulated run attends
                o = attention(q, keys, values, m, bias=bias, backend=backend, sinks=sinks)  # [B, H, Q, dv]
                return o, (attention_weights(q, keys, m, bias=bias, sinks=sinks) if return_weights else None)

            def masks_at(a: int, b: int):  # columns a … b − 1: ([#B, #H, #Q, b − a] bools or None, bias)
                mk = None if m is None else as_4d(m.block(masks.Extent(B, H, Q, K), 0, Q, a, b, q.device))
                return mk, (None if bias is None else bias[..., a:b])

            assert self.fk is not None and self.fv is not None
            return attend(q, self.qk, self.qv, self.fk, self.fv, masks_at, scale=None, softcap=None, sinks=sinks,
                          block=self.block), None
        finally:
            self._age()

    def check_crop(self, length: int) -> None:
        if not 0 <= length <= self.end:
            raise ValueError(f"KVCache layer {self.index}: cannot crop to {length}; it holds positions 0…{self.end - 1}.")

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (the quantized ones stay integers)."""
        self.check_crop(length)
        nq = 0 if self.qk is None else self.qk.n
        if self.qk is not None and self.qv is not None and length < nq:
            self.qk, self.qv = (t.map(lambda x: own(x.narrow(-2, 0, length))) for t in (self.qk, self.qv))  # [B, Hkv, length, ·]
        if self.fk is not None and self.fv is not None:
            keep = max(0, length - nq)
            self.fk, self.fv = own(self.fk[..., :keep, :]), own(self.fv[..., :keep, :])
        self.end = length

    def reset(self) -> None:
        self.qk = self.qv = self.fk = self.fv = None
        self.end = 0

    def nbytes(self) -> int:
        """Bytes held: the float tail's storage and the integers, scales and zero points."""
        return (sum(t.untyped_storage().nbytes() for t in (self.fk, self.fv) if t is not None)
                + sum(t.nbytes() for t in (self.qk, self.qv) if t is not None))

    def state(self) -> dict:
        shape = None if self.fk is None else [*self.fk.shape[:2], self.end, self.fk.shape[3]]
        vshape = None if self.fv is None else [*self.fv.shape[:2], self.end, self.fv.shape[3]]
        return {"length": self.end, "kept": self.end, "capacity": self.end, "keys": shape, "values": vshape,
                "grown_from": None, "bits": self.bits, "quantized": 0 if self.qk is None else self.qk.n}

    def __repr__(self) -> str:
        nq = 0 if self.qk is None else self.qk.n
        return f"QuantizedLayerCache(layer {self.index}, bits={self.bits}, length={self.end}, {nq} in integers)"


__all__ = ["BITS", "GROUP", "RESIDUAL", "BLOCK", "Quantized", "quantize", "fake_quantize", "attend", "check",
           "position_bytes", "age", "QuantizedLayerCache"]
