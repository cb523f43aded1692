"""A global mask seen from a shard: local query i is global query ``q_map[i]``, local key j is ``k_map[j]``.

Ring attention gives each process a slice of the queries and, step by step, slices of the keys. The
mask stays written in global positions (causal, padding lengths, document ids); a :class:`View`
evaluates it on a local tile by asking the global mask for the tiles it covers, so classification
(empty / full / partial) keeps working and empty work is skipped.

An :class:`IndexMap` lists runs of local positions and the global positions they stand for. Zig-zag
sharding of 16 positions over 4 ranks gives rank 1 chunks 1 and 6 (two runs)::

    local   0 1 | 2 3
    global  2 3 | 12 13

Striped sharding gives rank 1 the positions 1, 5, 9, 13 (one run with step 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import MaskError
from ..shapes import as_4d
from .base import Extent, Mask, Tile


@dataclass(frozen=True)
class Run:
    """Local positions ``start … start+length-1`` are global positions ``first, first+step, …``."""

    start: int
    length: int
    first: int
    step: int = 1


class IndexMap:
    """Global position of every local position, as runs of evenly spaced positions."""

    def __init__(self, runs: Sequence[tuple[int, int, int]], n_global: int) -> None:
        """``runs``: ``(length, first, step)`` in local order; ``n_global``: the global length."""
        out, start = [], 0
        for length, first, step in runs:
            if length <= 0:
                continue
            if first < 0 or first + step * (length - 1) >= n_global or step < 1:
                raise MaskError(f"index map run (length={length}, first={first}, step={step}) leaves 0…{n_global - 1}.")
            out.append(Run(start, int(length), int(first), int(step)))
            start += length
        self.runs: tuple[Run, ...] = tuple(out)
        self.n = start
        self.n_global = int(n_global)

    @classmethod
    def identity(cls, n: int) -> IndexMap:
        return cls([(n, 0, 1)], n)

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """The runs under local ``[a, b)``: ``(la, lb, g, step)``, local ``la … lb-1`` → global ``g, g+step, …``."""
        out = []
        for r in self.runs:
            lo, hi = max(a, r.start), min(b, r.start + r.length)
            if lo < hi:
                out.append((lo, hi, r.first + r.step * (lo - r.start), r.step))
        return out

    def narrow(self, a: int, b: int) -> IndexMap:
        """The map of local positions ``a … b-1``, renumbered from 0."""
        return IndexMap([(hi - lo, g, s) for lo, hi, g, s in self.pieces(a, b)], self.n_global)

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Global position of each local position: int64 [n]."""
        parts = [torch.arange(r.length, device=device) * r.step + r.first for r in self.runs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)

    def __repr__(self) -> str:
        runs = ", ".join(f"{r.first}:{r.first + r.length}" if r.step == 1 else f"{r.first}::{r.step}×{r.length}"
                         for r in self.runs)
        return f"IndexMap([{runs}] of {self.n_global})"


class View(Mask):
    """The part of ``base`` (a mask over the global ``ext``) that local queries and keys see."""

    @property
    def head_dependent(self) -> bool:  # type: ignore[override]
        return self.base.head_dependent

    def __init__(self, base: Mask, ext: Extent, q_map: IndexMap, k_map: IndexMap) -> None:
        if q_map.n_global != ext.Q or k_map.n_global != ext.K:
            raise MaskError(f"view: index maps cover Q={q_map.n_global}, K={k_map.n_global} but the global extent "
                            f"has Q={ext.Q}, K={ext.K}.")
        self.base, self.ext, self.q_map, self.k_map = base, ext, q_map, k_map

    def check(self, ext: Extent) -> None:
        if (ext.B, ext.H, ext.Q, ext.K) != (self.ext.B, self.ext.H, self.q_map.n, self.k_map.n):
            raise MaskError(f"view: built for local [B={self.ext.B}, H={self.ext.H}, Q={self.q_map.n}, K={self.k_map.n}] "
                            f"but used at [B={ext.B}, H={ext.H}, Q={ext.Q}, K={ext.K}].")
        self.base.check(self.ext)

    def _tile(self, qp, kp, device) -> torch.Tensor:
        (qa, qb, gq, sq), (ka, kb, gk, sk) = qp, kp
        t = as_4d(self.base.block(self.ext, gq, gq + sq * (qb - qa - 1) + 1, gk, gk + sk * (kb - ka - 1) + 1, device))
        if sq > 1 and t.shape[2] != 1:
            t = t[:, :, ::sq]  # covering global rows -> this run's rows
        if sk > 1 and t.shape[3] != 1:
            t = t[:, :, :, ::sk]
        return t  # [#B, #H, qb-qa | 1, kb-ka | 1]

    def block(self, ext, q0, q1, k0, k1, device=None):
        qs, ks = self.q_map.pieces(q0, q1), self.k_map.pieces(k0, k1)
        if len(qs) == 1 and len(ks) == 1 and qs[0][3] == ks[0][3] == 1:  # one contiguous global tile: no copy
            return self.base.block(self.ext, qs[0][2], qs[0][2] + q1 - q0, ks[0][2], ks[0][2] + k1 - k0, device)
        tiles = [[self._tile(qp, kp, device) for kp in ks] for qp in qs]
        b = max(t.shape[0] for row in tiles for t in row)
        h = max(t.shape[1] for row in tiles for t in row)
        rows = [
            torch.cat([t.expand(b, h, qp[1] - qp[0], kp[1] - kp[0]) for t, kp in zip(row, ks)], dim=3)  # [#B, #H, q_run, k]
            for row, qp in zip(tiles, qs)
        ]
        return torch.cat(rows, dim=2)  # [#B, #H, q1-q0, k1-k0]

    def classify(self, ext, q0, q1, k0, k1):
        seen = set()
        for qa, qb, gq, sq in self.q_map.pieces(q0, q1):
            for ka, kb, gk, sk in self.k_map.pieces(k0, k1):
                # the covering global tile: empty or full there means the same for the strided subset
                seen.add(self.base.classify(self.ext, gq, gq + sq * (qb - qa - 1) + 1, gk, gk + sk * (kb - ka - 1) + 1))
                if len(seen) > 1 or Tile.PARTIAL in seen:
                    return Tile.PARTIAL
        return seen.pop() if seen else Tile.EMPTY

    def natural_size(self):
        return (self.q_map.n, self.k_map.n)

    def draw(self, Q=None, K=None, *, b=0, h=0, B=None, H=None) -> str:
        return super().draw(self.q_map.n, self.k_map.n, b=b, h=h, B=self.ext.B, H=self.ext.H)

    def __repr__(self) -> str:
        return f"view({self.base!r}, q={self.q_map!r}, k={self.k_map!r})"

    def mask_mod(self, B, H, Q, K, device=None):
        self.check(Extent(B, H, Q, K))
        g = self.base.mask_mod(self.ext.B, self.ext.H, self.ext.Q, self.ext.K, device)
        q_pos, k_pos = self.q_map.positions(device), self.k_map.positions(device)  # global position of each local one
        return lambda b, h, q_idx, kv_idx: g(b, h, q_pos[q_idx], k_pos[kv_idx])


def view(mask: Mask | None, ext: Extent, q_map: IndexMap, k_map: IndexMap) -> View | None:
    """``mask`` (global positions, extent ``ext``) as seen by local queries ``q_map`` and keys ``k_map``."""
    return None if mask is None else View(mask, ext, q_map, k_map)
