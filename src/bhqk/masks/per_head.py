"""Masks that differ by head: head h sees the mask ``parts[h]``.

``per_head([causal(), sliding_window(1), causal(), sliding_window(1)])`` at Q = K = 4, heads 0 and 1::

    ■ · · ·        ■ · · ·
    ■ ■ · ·        ■ ■ · ·
    ■ ■ ■ ·        · ■ ■ ·
    ■ ■ ■ ■        · · ■ ■

``choose(heads, if_true, if_false)`` is the same with two masks: ``if_true`` where the bool ``heads``
[H] is True. ``None`` for a part means every key (a head the mask leaves alone). A part is itself a
mask of the whole H-head call, read at its own head (a dense [B, H, Q, K] part gives head h its
slice h). Heads whose part is the same object share one structure: fast paths group them
(:meth:`head_groups`; the span path runs each group as one kernel call per span). With GQA the
query heads of one key/value head may share a part or differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import MaskError
from ..shapes import as_4d
from .base import Arithmetic, Composite, Extent, Mask, Tile, _as_mask, refine


class Everything(Arithmetic):
    """Every query may attend every key: the part ``None`` of a per-head mask."""

    head_dependent, shift_invariant, allows_all = False, True, True

    def block(self, ext, q0, q1, k0, k1, device=None):
        return torch.ones(1, 1, dtype=torch.bool, device=device).expand(q1 - q0, k1 - k0)  # [q, k]

    def edges(self, ext, q0, q1, k0, k1):
        return False, True

    def mask_mod(self, B, H, Q, K, device=None):
        return lambda b, h, q_idx, kv_idx: kv_idx >= 0

    def __repr__(self) -> str:
        return "None"


EVERYTHING = Everything()


class PerHead(Composite):
    """Head h may attend where ``parts[h]`` (a mask of the whole call, read at head h) may."""

    def __init__(self, parts: Sequence[Mask | torch.Tensor | None]) -> None:
        if isinstance(parts, (Mask, torch.Tensor)) or not isinstance(parts, Sequence) or not len(parts):
            raise MaskError(f"per_head: parts must be a non-empty list of masks, one per head (None: every key), "
                            f"got {type(parts).__name__}.")
        self.parts = tuple(EVERYTHING if m is None else _as_mask(m) for m in parts)  # [H] masks
        groups: dict[int, tuple[Mask, list[int]]] = {}
        for h, m in enumerate(self.parts):
            groups.setdefault(id(m), (m, []))[1].append(h)
        self._groups = list(groups.values())  # (part, its heads), in order of the first head

    # ---- what the fast paths ask: derived from the parts (Composite) -------------------------------

    @property
    def operands(self) -> tuple[Mask, ...]:
        """The distinct parts, in order of their first head."""
        return tuple(m for m, _ in self._groups)

    @property
    def head_dependent(self) -> bool:  # type: ignore[override]
        return len(self._groups) > 1 or self._groups[0][0].head_dependent

    def only_past(self, ext: Extent) -> bool:
        return all(m.only_past(ext) for m, _ in self._groups)

    def causal_diagonal(self, ext: Extent) -> int | None:
        found = {m.causal_diagonal(ext) for m, _ in self._groups}
        return found.pop() if len(found) == 1 else None

    def head_groups(self, H: int) -> list[list[int]]:
        """Heads with the same part, split further where that part's own structure differs by head."""
        if H != len(self.parts):
            return [list(range(H))]
        return refine([hs for _, hs in self._groups], *(m.head_groups(H) for m, _ in self._groups))

    def select_heads(self, heads: list[int], H: int) -> Mask | None:
        chosen: dict[int, Mask | None] = {}  # a part's selection, once per part: equal parts stay one object
        for h in heads:
            m = self.parts[h]
            if id(m) not in chosen:
                chosen[id(m)] = m.select_heads(heads, H) if m.head_dependent else m
        if any(m is None for m in chosen.values()):
            return None
        parts = [chosen[id(self.parts[h])] for h in heads]
        return parts[0] if all(m is parts[0] for m in parts) else PerHead(parts)

    def staged(self, device: torch.device) -> Mask:
        parts = {id(m): m.staged(device) for m, _ in self._groups}
        if all(parts[id(m)] is m for m, _ in self._groups):
            return self
        return PerHead([parts[id(m)] for m in self.parts])

    # ---- the mask -----------------------------------------------------------------------------------

    def check(self, ext: Extent) -> None:
        if ext.H != len(self.parts):
            raise MaskError(f"per_head has {len(self.parts)} masks (one per head) but the call has H={ext.H} query heads.")
        super().check(ext)

    def block(self, ext, q0, q1, k0, k1, device=None):
        if len(self._groups) == 1:
            return self._groups[0][0].block(ext, q0, q1, k0, k1, device)
        tiles = [(as_4d(m.block(ext, q0, q1, k0, k1, device)), hs) for m, hs in self._groups]  # [#B, #H, #q, #k] each
        B = max(t.shape[0] for t, _ in tiles)
        out = torch.empty(B, ext.H, q1 - q0, k1 - k0, dtype=torch.bool, device=tiles[0][0].device)  # [#B, H, q, k]
        for t, hs in tiles:
            idx = torch.tensor(hs, device=out.device)
            out[:, idx] = (t[:, idx] if t.shape[1] != 1 else t).expand(B, len(hs), q1 - q0, k1 - k0)  # [#B, h, q, k]
        return out

    def classify(self, ext, q0, q1, k0, k1):
        seen = {m.classify(ext, q0, q1, k0, k1) for m, _ in self._groups}
        return seen.pop() if len(seen) == 1 else Tile.PARTIAL

    def classify_grid(self, ext, block_q, block_k):
        grids = [m.classify_grid(ext, block_q, block_k) for m, _ in self._groups]  # (empty, full) [nq, nk] each
        empty, full = grids[0]
        for e, f in grids[1:]:
            empty, full = empty & e, full & f
        return empty, full

    def mask_mod(self, B, H, Q, K, device=None):
        mods = [m.mask_mod(B, H, Q, K, device) for m, _ in self._groups]
        if len(mods) == 1:
            return mods[0]
        group = torch.empty(H, dtype=torch.long)
        for i, (_, hs) in enumerate(self._groups):
            group[hs] = i
        group = group.to(device)  # [H]: the group of each head

        def by_head(b, h, q_idx, kv_idx):
            g = group[h]
            out = mods[-1](b, h, q_idx, kv_idx)
            for i in range(len(mods) - 2, -1, -1):
                out = torch.where(g == i, mods[i](b, h, q_idx, kv_idx), out)
            return out

        return by_head

    def natural_heads(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        return "per_head(" + "; ".join(f"heads {hs}: {m!r}" for m, hs in self._groups) + ")"


def per_head(parts: Sequence[Mask | torch.Tensor | None]) -> PerHead:
    """Head h sees ``parts[h]`` (one mask per query head; ``None``: every key). Give the same mask
    object to heads that share it: the fast paths run them together."""
    return PerHead(parts)


def choose(heads: torch.Tensor | Sequence[bool], if_true: Mask | torch.Tensor | None,
           if_false: Mask | torch.Tensor | None) -> PerHead:
    """Head h sees ``if_true`` where ``heads[h]`` (a bool [H]) is True, else ``if_false`` (``None``:
    every key). ``choose(full, None, ~key_span(0, S) | sliding_window(W, align="bottom_right"))``:
    the heads marked full see everything, the others a sink of S keys and a window of W."""
    if isinstance(heads, torch.Tensor):
        if heads.dtype != torch.bool or heads.dim() != 1:
            raise MaskError(f"choose: heads must be a bool tensor [H] (True: if_true), got dtype {heads.dtype} "
                            f"shape {list(heads.shape)}.")
        heads = heads.tolist()
    if not all(isinstance(x, bool) for x in heads):
        raise MaskError("choose: heads must be a bool tensor [H] or a list of bools (True: if_true).")
    a = if_true if if_true is None or isinstance(if_true, Mask) else _as_mask(if_true)
    b = if_false if if_false is None or isinstance(if_false, Mask) else _as_mask(if_false)
    return PerHead([a if x else b for x in heads])
