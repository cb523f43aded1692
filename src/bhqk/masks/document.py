"""Document masks for packed sequences: a query attends only to keys of its own document.

``document(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 0, 1, 1, 1]))``::

    ■ ■ · · ·
    ■ ■ · · ·
    · · ■ ■ ■
    · · ■ ■ ■
    · · ■ ■ ■
"""

from __future__ import annotations

import torch

from ..errors import MaskError
from .base import Extent, Mask, Tile


def _ids(name: str, ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() not in (1, 2):
        got = f"dtype {ids.dtype} shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise MaskError(f"document: {name} must be an integer tensor [Q] / [B, Q] of document ids, got {got}.")
    return ids if ids.dim() == 2 else ids[None]  # [#B, N]


class Document(Mask):
    head_dependent, arithmetic = False, True

    def __init__(self, q_ids: torch.Tensor, k_ids: torch.Tensor | None = None) -> None:
        self.q_ids = _ids("q_ids", q_ids)
        self.k_ids = self.q_ids if k_ids is None else _ids("k_ids", k_ids)
        self._range: dict[tuple[str, int, int], tuple[int, int]] = {}

    def check(self, ext: Extent) -> None:
        for name, ids, n, N in (("q_ids", self.q_ids, ext.Q, "Q"), ("k_ids", self.k_ids, ext.K, "K")):
            if ids.shape[0] not in (1, ext.B):
                raise MaskError(f"document: {name} has B={ids.shape[0]} but B={ext.B}.")
            if ids.shape[1] != n:
                raise MaskError(f"document: {name} has length {ids.shape[1]} but {N}={n}; one id per position.")

    def block(self, ext, q0, q1, k0, k1, device=None):
        qd = self.q_ids[:, q0:q1, None]  # [#B, q, 1]
        kd = self.k_ids[:, None, k0:k1]  # [#B, 1, k]
        out = (qd == kd)[:, None]  # [#B, 1, q, k]
        return out if device is None else out.to(device)

    def _minmax(self, side: str, a: int, b: int) -> tuple[int, int]:
        key = (side, a, b)
        if key not in self._range:
            ids = (self.q_ids if side == "q" else self.k_ids)[:, a:b]
            self._range[key] = (int(ids.min()), int(ids.max()))
        return self._range[key]

    def classify(self, ext, q0, q1, k0, k1):
        qlo, qhi = self._minmax("q", q0, q1)
        klo, khi = self._minmax("k", k0, k1)
        if qhi < klo or khi < qlo:
            return Tile.EMPTY
        if qlo == qhi == klo == khi:
            return Tile.FULL
        return Tile.PARTIAL

    def natural_size(self):
        return (self.q_ids.shape[1], self.k_ids.shape[1])

    def __repr__(self) -> str:
        return f"document(<ids {list(self.q_ids.shape)}>, <ids {list(self.k_ids.shape)}>)"

    def mask_mod(self, B, H, Q, K, device=None):
        q_ids = self.q_ids.to(device).expand(B, -1).contiguous()  # [B, Q]
        k_ids = self.k_ids.to(device).expand(B, -1).contiguous()  # [B, K]
        return lambda b, h, q_idx, kv_idx: q_ids[b, q_idx] == k_ids[b, kv_idx]

    def classify_grid(self, ext, block_q, block_k):
        def ranges(ids: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Smallest and largest id of each block of positions, over the batch: [n_blocks] each."""
            ids = ids.cpu().long()
            nb = -(-n // block)
            last = ids[:, -1:].expand(-1, nb * block - n)  # [#B, 1] -> [#B, pad]: a repeated id, no new min or max
            ids = torch.cat([ids, last], dim=1).reshape(-1, nb, block)  # [#B, nb, block]
            return ids.amin(dim=(0, 2)), ids.amax(dim=(0, 2))

        qlo, qhi = (x[:, None] for x in ranges(self.q_ids, ext.Q, block_q))  # [nq, 1]
        klo, khi = (x[None, :] for x in ranges(self.k_ids, ext.K, block_k))  # [1, nk]
        empty = (qhi < klo) | (khi < qlo)  # [nq, nk]
        return empty, ~empty & (qlo == qhi) & (klo == khi) & (qlo == klo)


def document(q_ids: torch.Tensor, k_ids: torch.Tensor | None = None) -> Document:
    """Packed sequences: query i may attend to key j when ``q_ids[b, i] == k_ids[b, j]``.
    Ids are ``[Q]`` (shared by the batch) or ``[B, Q]``; ``k_ids`` defaults to ``q_ids``."""
    return Document(q_ids, k_ids)
