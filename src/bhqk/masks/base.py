"""Mask values: what each query may attend to, in the [B, H, Q, K] layout. ``True`` = may attend.

A mask is evaluated on a tile ``[q0:q1, k0:k1]`` of the full extent (B, H, Q, K) and can say
whether a tile is empty, full or partial without evaluating it, so fast paths can skip work.
"""

from __future__ import annotations

import copy
import enum
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MaskError
from ..shapes import as_4d
from ..text import grid
from .args import extent

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # FlexAttention's mask_mod


class Tile(enum.Enum):
    EMPTY = "empty"  # no query in the tile may attend to any key in it: skip
    FULL = "full"  # every query may attend to every key: no mask to evaluate
    PARTIAL = "partial"  # evaluate the mask on this tile


@dataclass(frozen=True)
class Extent:
    """The full sizes a mask lives in: scores are [B, H, Q, K]."""

    B: int
    H: int
    Q: int
    K: int


def causal_offset(align: str | None, Q: int, K: int, who: str) -> int:
    """Query i sits at key position ``i + offset``: 0 for top_left, ``K - Q`` for bottom_right."""
    if align is None:
        if Q != K:
            raise MaskError(
                f"{who} needs an alignment because Q={Q} ≠ K={K}: pass align='top_left' (query i is key "
                f"position i, as PyTorch's is_causal) or align='bottom_right' (the last query is the last "
                f"key, as FlashAttention ≥ 2.1 and decoding with a KV cache)."
            )
        return 0
    if align == "top_left":
        return 0
    if align == "bottom_right":
        return K - Q
    raise MaskError(f"{who}: align must be 'top_left' or 'bottom_right', got {align!r}.")


def staged_copy(x: Any, device: torch.device) -> Any:
    """``x`` (a mask or a bias) with its public tensors on ``device``, and its public parts (anything
    with a ``staged`` method) staged too: a shallow copy where something had to move, else ``x``
    itself. Private attributes (caches read on the host) stay where they are."""
    moved: dict[str, object] = {}
    for name, value in vars(x).items():
        if name.startswith("_"):
            continue
        if isinstance(value, torch.Tensor) and value.device != device:
            moved[name] = value.to(device)
        elif hasattr(value, "staged") and not isinstance(value, type) and (inner := value.staged(device)) is not value:
            moved[name] = inner
    if not moved:
        return x
    out = copy.copy(x)
    vars(out).update(moved)
    return out


class Mask:
    """Base of every mask. Subclasses implement :meth:`block` and, where they can, :meth:`classify`.
    What the fast paths ask of a mask (below), each class declares for itself (``Composite`` masks
    derive it from their operands); the defaults are the safe answers for a mask that says nothing."""

    # ---- properties the fast paths read -----------------------------------------------------------

    head_dependent: bool = True  # its entries may differ between heads (a tile may have an H axis > 1)
    shift_invariant: bool = False  # it depends on k − q only: every block whose keys move with its rows looks alike
    arithmetic: bool = False  # classify is arithmetic on the tile's edges (no tensor evaluated) at any size
    whole_grid: bool = True  # classify_grid is affordable at any size (False: it evaluates a function on every entry)
    looks_inverted: bool = False  # holds a tensor in nn.MultiheadAttention's polarity (True = masked out), by its look
    allows_all: bool = False  # every query may attend every key (a per-head mask's part None)

    def only_past(self, ext: Extent) -> bool:
        """True when no query i may attend a key after its position i + K − Q (safe answer: False)."""
        return False

    def causal_diagonal(self, ext: Extent) -> int | None:
        """The offset c when this mask is exactly ``key j ≤ query i + c`` (a causal mask, which the
        fused kernels' ``is_causal`` can serve), else None."""
        return None

    def head_groups(self, H: int) -> list[list[int]]:
        """The heads 0 … H-1 in groups that see the same mask structure (one group: one structure for
        every head, or none known). A fast path may run each group as one call of its own."""
        return [list(range(H))]

    def select_heads(self, heads: list[int], H: int) -> Mask | None:
        """This mask (of an H-head call) as seen by a call that runs only ``heads``, in that order
        (a mask of a len(heads)-head call), or None when it cannot say without evaluating tiles
        (callers then wrap it)."""
        return None if self.head_dependent else self

    def staged(self, device: torch.device) -> Mask:
        """This mask with its public tensors, and its parts', on ``device`` (:func:`staged_copy`; the
        tiled device path evaluates every tile from them). A predicate's function is called as it is."""
        return staged_copy(self, device)

    # ---- the mask itself --------------------------------------------------------------------------

    def check(self, ext: Extent) -> None:
        """Raise MaskError if this mask cannot live in ``ext`` (wrong batch size, missing alignment...)."""

    def block(self, ext: Extent, q0: int, q1: int, k0: int, k1: int, device: torch.device | None = None) -> torch.Tensor:
        """Bool tensor broadcastable to [B, H, q1-q0, k1-k0]: the tile's entries of the mask."""
        raise NotImplementedError

    def classify(self, ext: Extent, q0: int, q1: int, k0: int, k1: int) -> Tile:
        """Empty, full or partial for the tile, over every batch element and head. Never wrong;
        PARTIAL is always safe. The default evaluates the tile."""
        t = self.block(ext, q0, q1, k0, k1)
        if not bool(t.any()):
            return Tile.EMPTY
        if bool(t.all()):
            return Tile.FULL
        return Tile.PARTIAL

    def materialize(self, B: int, H: int, Q: int, K: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole mask as a bool tensor broadcastable to [B, H, Q, K]."""
        ext = Extent(*extent("materialize", B, H, Q, K))
        self.check(ext)
        out = self.block(ext, 0, Q, 0, K, None if device is None else torch.device(device))
        return as_4d(out)  # [#B, #H, #Q, #K]

    def __and__(self, other: Mask) -> Mask:
        return And(self, _as_mask(other))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, _as_mask(other))

    def __invert__(self) -> Mask:
        return Not(self)

    def natural_size(self) -> tuple[int, int] | None:
        """(Q, K) this mask implies on its own, if any (a dense mask does); used by ``str``."""
        return None

    def natural_heads(self) -> int:
        """The number of heads this mask is drawn with on its own (a per-head mask's H; else 1)."""
        return 1

    def draw(self, Q: int | None = None, K: int | None = None, *,
             b: int = 0, h: int = 0, B: int | None = None, H: int | None = None) -> str:
        """The mask of one (batch, head) as rows of ■ (may attend) and · (masked), one row per query."""
        nat = self.natural_size() or (8, 8)
        Q = nat[0] if Q is None else Q
        K = nat[1] if K is None else K
        full = self.materialize(B if B is not None else b + 1, H if H is not None else max(h + 1, self.natural_heads()), Q, K)
        tile = full[min(b, full.shape[0] - 1), min(h, full.shape[1] - 1)].expand(Q, K)
        return grid(tile.tolist())

    def __str__(self) -> str:
        try:
            return f"{self!r}\n{self.draw()}"
        except MaskError as e:  # e.g. a causal mask with Q ≠ K and no alignment
            return f"{self!r} (cannot draw: {e})"

    HTML_MAX = 48  # the largest side drawn in a notebook; a larger mask shows its top-left corner

    def _repr_html_(self) -> str:
        """Jupyter: the mask's repr and its drawing (batch 0, head 0) at its natural size, at most
        ``HTML_MAX`` × ``HTML_MAX`` (the top-left corner of a larger one, said so; only that block is
        evaluated): bounded at any length."""
        import html

        nat = self.natural_size() or (8, 8)
        Q, K = min(nat[0], self.HTML_MAX), min(nat[1], self.HTML_MAX)
        note = f"{Q} queries × {K} keys" + (f" (the corner of {nat[0]} × {nat[1]})" if (Q, K) != tuple(nat) else "")
        try:
            ext = Extent(1, self.natural_heads(), nat[0], nat[1])
            self.check(ext)
            tile = as_4d(torch.as_tensor(self.block(ext, 0, Q, 0, K)))  # [.., #q, #k] -> [#B, #H, #q, #k]
            body = grid(tile[0, 0].expand(Q, K).tolist())  # [#q, #k] -> [Q, K]
        except MaskError as e:  # e.g. a causal mask with Q ≠ K and no alignment
            body, note = f"(cannot draw: {e})", ""
        return (f"<div><code>{html.escape(repr(self))}</code> <small>{html.escape(note)}; ■ may attend, · masked</small>"
                f"<pre style='line-height:1'>{html.escape(body)}</pre></div>")

    # ---- FlexAttention: the mask as a mask_mod and a BlockMask ------------------------------------

    def mask_mod(self, B: int, H: int, Q: int, K: int, device: torch.device | str | None = None) -> MaskMod:
        """This mask as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for scores [B, H, Q, K].

        Vectorised: the indices may be broadcastable index tensors or vmap's scalars, and nothing
        branches on their values, so ``torch.compile`` traces it. Numbers that follow from the sizes
        (a causal offset) or the mask's parameters are captured as tensors on ``device``, so a new
        length or window does not recompile a kernel. The default indexes :meth:`materialize`
        (O(Q·K) memory); every bhqk mask overrides it."""
        ext = Extent(B, H, Q, K)
        self.check(ext)
        return index4(self.materialize(B, H, Q, K, device))

    def classify_grid(self, ext: Extent, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(empty, full): bool [ceil(Q/block_q), ceil(K/block_k)] on the CPU, :meth:`classify` of every
        tile of the grid at once. The default asks :meth:`classify` tile by tile; masks with a
        closed form override it with a few tensor ops."""
        nq, nk = -(-ext.Q // block_q), -(-ext.K // block_k)
        empty = torch.zeros(nq, nk, dtype=torch.bool)
        full = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            for j in range(nk):
                t = self.classify(ext, i * block_q, min(ext.Q, (i + 1) * block_q), j * block_k, min(ext.K, (j + 1) * block_k))
                empty[i, j], full[i, j] = t is Tile.EMPTY, t is Tile.FULL
        return empty, full

    def block_mask(self, B: int, H: int, Q: int, K: int, block: int | tuple[int, int] = 128,
                   device: torch.device | str | None = None):
        """A FlexAttention ``BlockMask`` for scores [B, H, Q, K], built from :meth:`classify_grid`
        (empty tiles skipped, full tiles without ``mask_mod``, partial tiles with it): no per-pair
        evaluation, unlike ``create_block_mask``. One tile classification serves every batch
        element and head (the BlockMask has B = H = 1), so a tile is partial when it is partial
        for any of them. ``block``: tile size, or (block_q, block_k)."""
        from torch.nn.attention.flex_attention import BlockMask

        ext = Extent(B, H, Q, K)
        self.check(ext)
        bq, bk = (block, block) if isinstance(block, int) else block
        empty, full = self.classify_grid(ext, bq, bk)  # [nq, nk]
        full = full.clone()
        if Q % bq:  # a clipped edge tile counts as partial, as in create_block_mask (its padding is masked)
            full[-1] = False
        if K % bk:
            full[:, -1] = False
        kv_num, kv_idx = _ordered(~empty & ~full, device)  # partial tiles
        full_num, full_idx = _ordered(full, device)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(bq, bk),
                                        mask_mod=self.mask_mod(B, H, Q, K, device), seq_lengths=(Q, K))


class Arithmetic(Mask):
    """A mask whose tile classes follow from a tile's edges by one formula, :meth:`edges`, that serves
    one tile (ints: :meth:`classify`) and every tile of a grid at once (tensors: :meth:`classify_grid`)."""

    arithmetic = True

    def edges(self, ext: Extent, q0, q1, k0, k1) -> tuple[Any, Any]:
        """(empty, full) of the tiles ``[q0:q1, k0:k1]``: bools for ints; bool tensors broadcastable to
        [nq, nk] for the grid's edges q0, q1 [nq, 1] and k0, k1 [1, nk]. Never both for a tile with entries."""
        raise NotImplementedError

    def classify(self, ext, q0, q1, k0, k1):
        empty, full = self.edges(ext, q0, q1, k0, k1)
        return Tile.EMPTY if empty else Tile.FULL if full else Tile.PARTIAL

    def classify_grid(self, ext, block_q, block_k):
        q0, q1, k0, k1 = tile_bounds(ext, block_q, block_k)  # [nq, 1], [1, nk]
        empty, full = (torch.as_tensor(x).expand(q0.shape[0], k0.shape[1]) for x in self.edges(ext, q0, q1, k0, k1))
        return empty, full  # [nq, nk] each


_FROM_TENSOR: list[Callable[[torch.Tensor], Mask]] = []  # set by masks/__init__: register_tensor_mask(dense)


def register_tensor_mask(fn: Callable[[torch.Tensor], Mask]) -> None:
    """How ``mask & tensor``, ``and_masks(tensor, ...)`` and ``as_mask(tensor)`` read a bool tensor:
    ``masks/__init__`` registers ``dense`` (which imports this module, so this one cannot import it)."""
    _FROM_TENSOR[:] = [fn]


def _as_mask(m: object) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, torch.Tensor) and _FROM_TENSOR:
        return _FROM_TENSOR[0](m)
    raise MaskError(f"cannot combine a mask with {type(m).__name__}; use bhqk.masks.dense(tensor) for tensors.")


def refine(*partitions: list[list[int]]) -> list[list[int]]:
    """The coarsest partition of the heads finer than each of ``partitions`` (each a list of head
    groups covering the same heads), groups ordered by their first head."""
    of: dict[int, tuple] = {}
    for part in partitions:
        for i, group in enumerate(part):
            for h in group:
                of[h] = of.get(h, ()) + (i,)
    out: dict[tuple, list[int]] = {}
    for h in sorted(of):
        out.setdefault(of[h], []).append(h)
    return sorted(out.values(), key=lambda g: g[0])


class Composite(Mask):
    """A mask made of other masks (:attr:`operands`): what the fast paths ask is derived from them."""

    @property
    def operands(self) -> tuple[Mask, ...]:
        raise NotImplementedError

    @property
    def head_dependent(self) -> bool:  # type: ignore[override]
        return any(m.head_dependent for m in self.operands)

    @property
    def shift_invariant(self) -> bool:  # type: ignore[override]
        return all(m.shift_invariant for m in self.operands)

    @property
    def arithmetic(self) -> bool:  # type: ignore[override]
        return all(m.arithmetic for m in self.operands)

    @property
    def whole_grid(self) -> bool:  # type: ignore[override]
        return all(m.whole_grid for m in self.operands)

    @property
    def looks_inverted(self) -> bool:  # type: ignore[override]
        return any(m.looks_inverted for m in self.operands)

    def check(self, ext: Extent) -> None:
        for m in self.operands:
            m.check(ext)

    def natural_size(self):
        return next((s for m in self.operands if (s := m.natural_size()) is not None), None)

    def natural_heads(self) -> int:
        return max(m.natural_heads() for m in self.operands)


class _Pair(Composite):
    """``&`` and ``|``: ``op`` of the two parts' entries."""

    op: Callable[..., Any]  # operator.and_ or operator.or_, on bool tensors
    symbol: str

    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b

    @property
    def operands(self) -> tuple[Mask, ...]:
        return self.a, self.b

    def head_groups(self, H: int) -> list[list[int]]:
        return refine(self.a.head_groups(H), self.b.head_groups(H))

    def select_heads(self, heads: list[int], H: int) -> Mask | None:
        if not self.head_dependent:
            return self
        a, b = self.a.select_heads(heads, H), self.b.select_heads(heads, H)
        return None if a is None or b is None else self.like(a, b)

    def like(self, a: Mask, b: Mask) -> Mask:
        """The same combinator of other parts."""
        raise NotImplementedError

    def block(self, ext, q0, q1, k0, k1, device=None):
        return self.op(self.a.block(ext, q0, q1, k0, k1, device), self.b.block(ext, q0, q1, k0, k1, device))

    def mask_mod(self, B, H, Q, K, device=None):
        fa, fb, op = self.a.mask_mod(B, H, Q, K, device), self.b.mask_mod(B, H, Q, K, device), self.op
        return lambda b, h, q_idx, kv_idx: op(fa(b, h, q_idx, kv_idx), fb(b, h, q_idx, kv_idx))

    def __repr__(self) -> str:
        return f"({self.a!r} {self.symbol} {self.b!r})"


class And(_Pair):
    """May attend where both may attend."""

    op, symbol = operator.and_, "&"

    def only_past(self, ext: Extent) -> bool:
        return self.a.only_past(ext) or self.b.only_past(ext)

    def like(self, a: Mask, b: Mask) -> Mask:
        return b if a.allows_all else a if b.allows_all else And(a, b)

    def classify(self, ext, q0, q1, k0, k1):
        ta = self.a.classify(ext, q0, q1, k0, k1)
        if ta is Tile.EMPTY:
            return Tile.EMPTY
        tb = self.b.classify(ext, q0, q1, k0, k1)
        if tb is Tile.EMPTY:
            return Tile.EMPTY
        return Tile.FULL if ta is tb is Tile.FULL else Tile.PARTIAL

    def classify_grid(self, ext, block_q, block_k):
        (ea, fa), (eb, fb) = self.a.classify_grid(ext, block_q, block_k), self.b.classify_grid(ext, block_q, block_k)
        return ea | eb, fa & fb


class Or(_Pair):
    """May attend where either may attend."""

    op, symbol = operator.or_, "|"

    def only_past(self, ext: Extent) -> bool:
        return self.a.only_past(ext) and self.b.only_past(ext)

    def like(self, a: Mask, b: Mask) -> Mask:
        return a if a.allows_all else b if b.allows_all else Or(a, b)

    def classify(self, ext, q0, q1, k0, k1):
        ta = self.a.classify(ext, q0, q1, k0, k1)
        if ta is Tile.FULL:
            return Tile.FULL
        tb = self.b.classify(ext, q0, q1, k0, k1)
        if tb is Tile.FULL:
            return Tile.FULL
        return Tile.EMPTY if ta is tb is Tile.EMPTY else Tile.PARTIAL

    def classify_grid(self, ext, block_q, block_k):
        (ea, fa), (eb, fb) = self.a.classify_grid(ext, block_q, block_k), self.b.classify_grid(ext, block_q, block_k)
        return ea & eb, fa | fb


class Not(Composite):
    """May attend exactly where the inner mask may not."""

    looks_inverted = False  # type: ignore[assignment]  # a tensor under ~ is read with the opposite polarity: on purpose

    def __init__(self, a: Mask) -> None:
        self.a = a

    @property
    def operands(self) -> tuple[Mask, ...]:
        return (self.a,)

    def head_groups(self, H: int) -> list[list[int]]:
        return self.a.head_groups(H)

    def select_heads(self, heads: list[int], H: int) -> Mask | None:
        a = self.a.select_heads(heads, H)
        return None if a is None else self if a is self.a else Not(a)

    def block(self, ext, q0, q1, k0, k1, device=None):
        return ~self.a.block(ext, q0, q1, k0, k1, device)

    def classify(self, ext, q0, q1, k0, k1):
        t = self.a.classify(ext, q0, q1, k0, k1)
        return {Tile.EMPTY: Tile.FULL, Tile.FULL: Tile.EMPTY}.get(t, Tile.PARTIAL)

    def __repr__(self) -> str:
        return f"~{self.a!r}"

    def mask_mod(self, B, H, Q, K, device=None):
        fa = self.a.mask_mod(B, H, Q, K, device)
        return lambda b, h, q_idx, kv_idx: ~fa(b, h, q_idx, kv_idx)

    def classify_grid(self, ext, block_q, block_k):
        empty, full = self.a.classify_grid(ext, block_q, block_k)
        return full, empty


def tensor_versions(mask: object) -> tuple | None:
    """(address, in-place version) of every tensor ``mask`` holds, its parts' included, and the
    ``cache_key()`` of a mask that has one (a predicate's ``key=``): what a plan kept for the mask is
    keyed by, so writing into its tensor in place makes a new plan. None when one is an inference
    tensor (it has no version counter) or a ``cache_key()`` is None: such a mask cannot be kept."""
    if mask is None:
        return ()
    out: list = []
    if callable(own := getattr(mask, "cache_key", None)):  # a mask whose answer reads more than it holds (a predicate)
        if (extra := own()) is None:
            return None
        out.append(extra)
    for value in vars(mask).values():
        if isinstance(value, torch.Tensor):  # alive while its owner is: its address names it
            if value.is_inference():
                return None
            out.append((value.data_ptr(), value._version))
        else:
            for part in value if isinstance(value, tuple) else (value,):  # a per-head mask's parts: a tuple
                if isinstance(part, Mask):
                    inner = tensor_versions(part)
                    if inner is None:
                        return None
                    out.extend(inner)
    return tuple(out)


def and_masks(*masks: Mask) -> Mask:
    """All of ``masks`` (like FlexAttention's ``and_masks``)."""
    if not masks:
        raise MaskError("and_masks needs at least one mask.")
    return functools.reduce(operator.and_, masks[1:], _as_mask(masks[0]))


def or_masks(*masks: Mask) -> Mask:
    """Any of ``masks``."""
    if not masks:
        raise MaskError("or_masks needs at least one mask.")
    return functools.reduce(operator.or_, masks[1:], _as_mask(masks[0]))


def positions(q0: int, q1: int, k0: int, k1: int, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query indices [q, 1] and key indices [1, k] of a tile."""
    qi = torch.arange(q0, q1, device=device)[:, None]  # [q, 1]
    ki = torch.arange(k0, k1, device=device)[None, :]  # [1, k]
    return qi, ki


# ---- helpers for mask_mod and classify_grid ---------------------------------------------------------

def scalar(x: int, device) -> torch.Tensor:
    """A number captured by a mask_mod: a 0-d int64 tensor, so a new value does not recompile."""
    return torch.tensor(int(x), dtype=torch.long, device=device)


def index4(t: torch.Tensor) -> MaskMod:
    """A mod that reads ``t`` [#B, #H, #Q, #K] at (b, h, q_idx, kv_idx); a size-1 axis broadcasts."""
    t = as_4d(t)  # [#B, #H, #Q, #K]

    def at(b, h, q_idx, kv_idx):
        idx = [i if n != 1 else 0 for i, n in zip((b, h, q_idx, kv_idx), t.shape)]
        return t[idx[0], idx[1], idx[2], idx[3]]

    return at


def tile_bounds(ext: Extent, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q0, q1 [nq, 1] and k0, k1 [1, nk]: the edges of every tile of the grid (the last ones clipped)."""
    q0 = torch.arange(0, ext.Q, block_q)[:, None]  # [nq, 1]
    k0 = torch.arange(0, ext.K, block_k)[None, :]  # [1, nk]
    return q0, (q0 + block_q).clamp(max=ext.Q), k0, (k0 + block_k).clamp(max=ext.K)


def _ordered(blocks: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks [1, 1, nq], indices [1, 1, nq, nk]) of a bool [nq, nk], int32:
    each row's chosen tiles first, in key order."""
    num = blocks.sum(dim=-1, dtype=torch.int32)  # [nq]
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)  # [nq, nk]
    return num[None, None].to(device), idx[None, None].contiguous().to(device)  # [nq] -> [1, 1, nq]; [nq, nk] -> [1, 1, nq, nk]
