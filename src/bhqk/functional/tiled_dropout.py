"""The tiled backend's dropout: a keep-mask regenerated per tile from (seed, b, h, q, k), never stored.

Each tile recomputes its entries from a per-row key (a 64-bit hash of seed, b, h, q, made once per
call, [B·H·Q]) and a per-key key (of seed, k, [K]), combined per entry with int32 ops:
x = row ^ col; x *= M1; x ^= x >> 16; x *= M2; keep where (x >> 1) < (1 - p)·2^31 - 2^30.
The comparison is made with integer arithmetic, ((x >> 1) - T) >> 31 = -1 (keep) or 0 (drop), and
applied to P by a bitwise AND of its bits (comparisons and bool masks are several times slower on
the CPU). The same function serves the forward, the backward and :func:`dropout_keep`, so both
passes drop the same entries whatever their tiles are.

Where it enters the online softmax (``tiled.py``): P̃'s entries are dropped after its row sums, so
l (and lse) has no dropout; the 1/(1 - p) of the kept entries is applied once, with the division by l.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from .problem import Problem

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX = (-4658895280553007687, -7723592293110705685)  # splitmix64's multipliers, signed
_M1, _M2 = -1640531535, -2048144789  # 0x9E3779B1, 0x85EBCA6B as signed int32

__all__ = ["KeepBits", "drop_", "dropout_keep", "dropout_seed", "seeded"]


def dropout_seed() -> int:
    """A dropout seed drawn from torch's default generator (one per call: ``torch.manual_seed``
    makes the tiled backend's dropout reproducible)."""
    return int(torch.randint(-(2**62), 2**62, (), dtype=torch.int64))


def seeded(p: Problem) -> Problem:
    """``p`` with a dropout seed in its options (drawn here if it has none) when it has dropout."""
    if p.dropout_p == 0 or "dropout_seed" in p.options:
        return p
    return dataclasses.replace(p, options={**p.options, "dropout_seed": dropout_seed()})


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (logical shifts by masking), then the top 32 bits as int32."""
    for s_, m in zip((30, 27), _MIX):
        x = (x ^ ((x >> s_) & ((1 << (64 - s_)) - 1))) * m
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return (((x >> 32) & 0xFFFFFFFF) - (1 << 31)).to(torch.int32)  # [.., ] in [-2^31, 2^31)


def _row_keys(seed: int, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, H: int, Q: int) -> torch.Tensor:
    """int32 keys of the rows (b, h, q), broadcast from the index tensors given."""
    return _mix64((((b * H + h) * Q + q) + 1) * _GOLDEN + seed)


def _col_keys(seed: int, K: int, device) -> torch.Tensor:
    """int32 keys of the keys 0…K-1, [K]."""
    return _mix64((torch.arange(K, device=device, dtype=torch.int64) - 1) * _GOLDEN + (seed ^ 0x5BD1E995))


def _threshold(p: float) -> int:
    return round((1.0 - p) * 2.0**31) - 2**30


def _keep_bits(rows: torch.Tensor, cols: torch.Tensor, threshold: int, x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Into ``x`` [.., r, c] (int32): -1 where the entry (row, col) is kept, 0 where dropped.
    ``rows`` [.., r, 1] and ``cols`` [.., 1, c] are int32 keys; ``tmp`` is scratch of x's shape."""
    torch.bitwise_xor(rows, cols, out=x)
    x.mul_(_M1)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_M2)
    torch.bitwise_right_shift(x, 1, out=x)
    x.sub_(threshold)
    return torch.bitwise_right_shift(x, 31, out=x)


def drop_(t: torch.Tensor, keep: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Zero the entries of ``t`` (float32/64) where ``keep`` (int32, -1 / 0) is 0, by ANDing bits
    (in place, or into ``out``)."""
    bits = t.view(torch.int32 if t.element_size() == 4 else torch.int64)  # same shape, the float's bits as integers
    k = keep if bits.dtype == torch.int32 else keep.to(torch.int64)  # -1 stays all ones
    dest = bits if out is None else out.view(bits.dtype)
    torch.bitwise_and(bits, k, out=dest)
    return t if out is None else out


def dropout_keep(seed: int, B: int, H: int, Q: int, K: int, p: float, device=None) -> torch.Tensor:
    """The keep-mask bool [B, H, Q, K] the tiled backend uses for a call with this seed and
    ``dropout_p = p`` (for tests and tools: the backend itself never builds it)."""
    ar = partial(torch.arange, device=device, dtype=torch.int64)
    rows = _row_keys(seed, ar(B)[:, None, None], ar(H)[None, :, None], ar(Q)[None, None, :], H, Q)  # [B, H, Q]
    cols = _col_keys(seed, K, device)  # [K]
    x = torch.empty(B, H, Q, K, dtype=torch.int32, device=device)
    # rows [B, H, Q] -> [B, H, Q, 1] x cols [K] -> keep [B, H, Q, K]
    return _keep_bits(rows[..., None], cols, _threshold(p), x, torch.empty_like(x)) != 0


@dataclass
class KeepBits:
    """One worker's keep-mask: its rows' keys [n, (Q G)], every key's [K], the threshold, and int32
    scratch for a rectangle's bits (flat, at most ``elems`` entries)."""

    rows: torch.Tensor
    cols: torch.Tensor
    threshold: int
    keep: torch.Tensor  # int32, flat
    tmp: torch.Tensor  # int32, flat

    @classmethod
    def of(cls, p: Problem, b: slice, hq: slice, Hkvw: int, G: int, elems: int) -> KeepBits | None:
        """For a worker's slice of the call ``p``: batch elements ``b``, query heads ``hq`` (= its
        ``Hkvw`` key/value heads × ``G``), rows in the order (q g); None without dropout."""
        if p.dropout_p == 0:
            return None
        seed, device = p.options["dropout_seed"], p.q.device
        B, H, Q = p.q.shape[:3]
        ar = partial(torch.arange, device=device, dtype=torch.int64)
        bs = ar(B)[b]
        rows = _row_keys(seed, bs.view(-1, 1, 1, 1),  # [Bw] -> [Bw, 1, 1, 1]
                         ar(H)[hq].view(1, Hkvw, 1, G),  # [Hw] -> [1, Hkvw, 1, G]: query head hkv·G + g
                         ar(Q).view(1, 1, Q, 1), H, Q)  # [Q] -> [1, 1, Q, 1]
        rows = rows.reshape(bs.shape[0] * Hkvw, Q * G)  # [Bw, Hkvw, Q, G] -> [n, (Q G)]
        scratch = [torch.empty(max(1, elems), dtype=torch.int32, device=device) for _ in range(2)]
        return cls(rows, _col_keys(seed, p.k.shape[2], device), _threshold(p.dropout_p), *scratch)

    def bits(self, r0: int, r1: int, k0: int, k1: int) -> torch.Tensor:
        """-1 / 0 (keep / drop) for the slice's rows (q g) r0:r1 and keys k0:k1, [n, rows, kw]."""
        shape = (self.rows.shape[0], r1 - r0, k1 - k0)
        numel = shape[0] * shape[1] * shape[2]
        x, tmp = self.keep[:numel].view(shape), self.tmp[:numel].view(shape)  # flat scratch as [n, rows, kw]
        # rows [n, (q G)] -> [n, rows, 1] x cols [kw] -> [n, rows, kw]
        return _keep_bits(self.rows[:, r0:r1, None], self.cols[k0:k1], self.threshold, x, tmp)
