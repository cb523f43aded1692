"""The span path's planner (pure: no kernel is called): which calls of PyTorch's fused CPU flash
kernel compute an attention call, from its mask's tile classification (how the span path's three
modules divide the work: ``spans``).

The [Q, K] grid is cut into query blocks of ``block_q`` rows and, per block, into the runs of key
tiles the mask allows: an empty tile is skipped; a run of full tiles is one span without a mask; a
run with partial tiles is one span with a small additive mask (-inf where the mask forbids, plus the
bias, which makes every span of a call with a bias masked); a causal mask alone is the kernel's own
``is_causal`` (top-left, so bottom-right with Q ≠ K is a full span plus a top-left causal one; a
decoding step, which sees every key, has no mask).

Spans of equal length and kind in consecutive query blocks whose keys advance by a constant step
(a sliding window's band, a causal diagonal) form one :class:`Group`, computed in ONE kernel call
(the query blocks folded into the batch axis, the key spans a strided view). Blocks over the same
keys (a document, a prefix) become one tall block. A band's blocks are sized from the kernel's query
tiles and the band's width, with a backward plan of its own (``_band_width``); the ramp of blocks
before it is one call. Heads whose mask has one structure (``Mask.head_groups``) are planned as calls
of their own (:class:`HeadGroup`). Plans are kept per mask object and call key
(:data:`_PLANS`, a ``plan_cache.PlanCache`` keyed with :func:`plan_key`), like the tiled backend's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..masks import Extent, Mask, top_left_count
from ..shapes import Sizes
from .plan_cache import PlanCache
from .problem import Problem

BLOCK_Q = 128  # query rows per block where the mask is no band (a band's block: see _band_width)
BLOCK_K = 64  # key tile of the classification: spans start and end on these edges
KERNEL_TILE = 32  # the kernel's query tile below 192 query rows (64 below 768, 256 above): a band's block is a multiple
TILE_64_ROWS = 192  # the fewest query rows the kernel runs with 64-row tiles: a band's backward blocks (see _band_width)
BAND_OVER = 4  # a band's block of R rows computes (R + w)/w of its entries: R ≤ w/4 keeps that ≤ 1.25
ONE_SPAN = 1024  # a run of allowed key tiles up to this long with a partial tile in it is one masked span
MASK_ELEMS = 1 << 22  # a call's additive mask stays below this many entries (calls are split)
SMALL_MASK = 1 << 16  # a causal call with Q·K up to this many entries is one masked call, not two calls merged


class Group(NamedTuple):
    """One kernel call: ``n`` consecutive query blocks of ``rows`` rows from row ``r0`` (block j:
    rows ``r0 + j·rows …``) against keys ``k0 + j·kstep`` … ``+ L``. ``masked``: an additive mask
    (the bool mask and the bias) on it; ``causal``: the kernel's top-left ``is_causal`` relative to
    the span's corner instead of a mask."""

    r0: int
    rows: int
    n: int
    k0: int
    kstep: int
    L: int
    masked: bool
    causal: bool = False

    @property
    def entries(self) -> int:
        """Score entries computed per (batch, head)."""
        if self.causal:  # row i of the span sees keys 0 … i (all L when i ≥ L)
            return self.n * top_left_count(self.rows, self.L)
        return self.n * self.rows * self.L


@dataclass
class Plan:
    """The kernel calls of one attention call; ``single``: each query row is in exactly one span
    (no merge)."""

    groups: list[Group]
    single: bool
    masks: dict = field(default_factory=dict, repr=False, compare=False)  # kept call masks: see spans_kernels._kept_mask
    backward: Plan | None = field(default=None, repr=False, compare=False)  # the backward's own plan (a band's)
    by_heads: list[HeadGroup] = field(default_factory=list)  # heads of one structure, each a call of its own: see _by_heads

    @property
    def computed(self) -> int:
        if self.by_heads:  # per head, on average over the heads
            return sum(len(g.heads) * g.plan.computed for g in self.by_heads) // sum(len(g.heads) for g in self.by_heads)
        return sum(g.entries for g in self.groups)

    def fraction(self, ext: Extent) -> float:
        return self.computed / max(1, ext.Q * ext.K)

    def one_call(self, p: Problem) -> Group | None:
        """The group when the plan is one kernel call over every query row and key without a mask
        (none, or the kernel's own ``is_causal``), else None."""
        if len(self.groups) != 1:
            return None
        g = self.groups[0]
        whole = g.n == 1 and g.r0 == 0 and g.rows == p.ext.Q and g.k0 == 0 and g.L == p.ext.K
        return g if whole and not g.masked else None


class HeadGroup(NamedTuple):
    """Query heads whose mask has one structure (``Mask.head_groups``), run as one call: ``mask`` is
    the call's mask on those heads (``Mask.select_heads``), ``plan`` its spans."""

    heads: list[int]
    mask: Mask
    plan: Plan


def share(p: Problem, plan: Plan | None = None) -> float:
    """The fraction of the B·H·Q·K score entries the span path computes (1.0: it skips nothing)."""
    ext = p.ext
    if ext.Q == 0 or ext.K == 0:
        return 0.0
    return (plan if plan is not None else plan_for(p)).fraction(ext)

# ---- planning ---------------------------------------------------------------------------------------

def _blocks(p: Problem) -> tuple[int, int]:
    """(block_q, block_k): the caller's, or 0 for "chosen by the plan" (the defaults, and a band's rows)."""
    return max(0, int(p.options.get("block_q") or 0)), max(0, int(p.options.get("block_k") or 0))


def _band_width(plan: Plan) -> int | None:
    """The width w of a band (a sliding window; the same in a dense mask), from the plan at the
    default blocks: its largest group of blocks whose keys advance with their rows is the band, and
    a block in its middle spans w + rows keys (w: the band's width, rounded up to key tiles).

    A block of R rows computes R + w keys per row, so small blocks skip more; but PyTorch's CPU
    kernel splits a call's queries into tiles of 32 rows below 192 query rows, 64 below 768 and 256
    above (keys in tiles of 512; aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), and its cost
    per entry falls as that tile grows. So the forward's R is a whole number of 32-row tiles, at most
    w/4 (≤ 1.25× the band's entries); wide bands reach 64- and 256-row tiles that way. The backward's
    cost per entry falls much more from 32- to 64-row tiles (benchmarks/kernel_tiles.py), so where
    the forward's blocks run 32-row tiles its own are the smallest with 64-row tiles (192 rows) if
    that is at most w (≤ 1.75× the band's entries). None: no band."""
    bands = [g for g in plan.groups if g.n > 1 and g.kstep == g.rows < g.L]
    g = max(bands, key=lambda g: g.entries, default=None)
    if g is None or 2 * g.entries < plan.computed:  # no band, or not most of the work (a causal diagonal)
        return None
    r = g.r0 + g.n // 2 * g.rows  # a block in the band's middle: its spans (a wide band's are several) are the band
    w = sum(h.L for h in plan.groups if h.r0 <= r < h.r0 + h.n * h.rows) - g.rows
    return w


def plan_key(p: Problem) -> tuple[bool, bool]:
    """What a span plan depends on besides the mask and the call's sizes and block options: whether
    the call has no bias (its masks are kept, a causal mask is the kernel's ``is_causal``) and
    whether its scale is positive (``is_causal`` only then)."""
    return p.bias is None, p.scale_positive


_PLANS: PlanCache[Plan] = PlanCache("span plans", "the span path's plan: its kernel calls (and the call masks kept in it)",
                                    plan_key)


def plan_for(p: Problem) -> Plan:
    """The kernel calls for ``p``: one for no mask, one or two for a causal mask alone, else the
    spans of the tile classification, grouped (see the module docstring). Kept per mask object
    and call key (sizes, blocks, :func:`plan_key`; :class:`plan_cache.PlanCache`); within one call
    the registry hands the plan to ``share``, ``hands_off`` and ``run`` (``Choice.plan``)."""
    return _PLANS.for_call(p, lambda: _plan(p))


def _plan(p: Problem) -> Plan:
    ext = p.ext
    Q, K = ext.Q, ext.K
    if ext.B == 0 or ext.H == 0 or Q == 0 or K == 0:
        return Plan([], True)
    masked = p.bias is not None
    if p.mask is None:
        return Plan([Group(0, Q, 1, 0, 0, K, masked)], True)
    off = p.mask.causal_diagonal(ext) if not masked and p.scale_positive else None  # is_causal: NaN for a scale ≤ 0
    if off is not None:  # a causal mask: query i sees keys ≤ i + off
        if off >= K - 1:  # every row sees every key (a decoding step: Q = 1, bottom-right)
            return Plan([Group(0, Q, 1, 0, 0, K, False)], True)
        if off > 0 and Q * K <= SMALL_MASK:  # a few queries after many keys: one call with a small mask
            return Plan([Group(0, Q, 1, 0, 0, K, True)], True)
        if off >= 0:  # keys [0, off) for every row, then top-left causal over the rest
            causal = [Group(0, Q, 1, off, 0, K - off, False, True)] if off < K else []
            return Plan(([Group(0, Q, 1, 0, 0, min(off, K), False)] if off > 0 else []) + causal, off == 0 or off >= K)
        r = -off  # rows [0, r) see nothing; row r + i sees keys 0 … i
        return Plan([Group(r, Q - r, 1, 0, 0, K, False, True)] if r < Q else [], True)
    if not masked and p.mask.head_dependent and len(heads := p.mask.head_groups(ext.H)) > 1:
        by_heads = _by_heads(p, heads)
        if by_heads is not None:
            return Plan([], True, by_heads=by_heads)
    bq, bk = _blocks(p)
    per, mask = ext.B * (ext.H if masked else 1), p.mask
    plan = _grid_plan(p, mask, bq or BLOCK_Q, bk or BLOCK_K)
    w = None if bq else _band_width(plan)
    if w is None:
        return Plan(_ramp(plan.groups, per), plan.single)
    rows = max(KERNEL_TILE, w // BAND_OVER // KERNEL_TILE * KERNEL_TILE)  # see _band_width

    def band(rows: int) -> Plan:  # key tiles that divide the block: one chain
        plan = _grid_plan(p, mask, rows, bk or math.gcd(BLOCK_K, rows))
        return Plan(_ramp(plan.groups, per), plan.single)

    back = band(TILE_64_ROWS) if rows < TILE_64_ROWS <= w else None
    return dataclasses.replace(band(rows), backward=back)


def _by_heads(p: Problem, heads: list[list[int]]) -> list[HeadGroup] | None:
    """A plan per group of heads of one mask structure (None: the mask cannot name the part of each)."""
    out = []
    for hs in heads:
        m = p.mask.select_heads(hs, p.ext.H) if p.mask is not None else None
        if m is None:
            return None
        out.append(HeadGroup(hs, m, _plan(on_heads(p, hs, m))))
    return out


def on_heads(p: Problem, heads: list[int], mask: Mask) -> Problem:
    """The call on the query heads ``heads`` (sorted) only, with ``mask``: their key/value heads
    stay grouped where ``heads`` holds whole groups of them, else each query head gets a copy of
    its own (GQA heads of one key/value head in different groups)."""
    G = p.groups
    kv = sorted({h // G for h in heads})
    whole = heads == [j * G + r for j in kv for r in range(G)]
    kv_heads = kv if whole else [h // G for h in heads]

    def take(t: torch.Tensor, idx: list[int]) -> torch.Tensor:  # [B, H, N, x] -> [B, len(idx), N, x]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return t[:, idx[0]:idx[0] + len(idx)]  # a view
        return t.index_select(1, torch.tensor(idx, device=t.device))  # [B, H, N, x] -> [B, len(idx), N, x]

    sizes = Sizes(**{**p.sizes.size, "H": len(heads), "Hkv": len(kv_heads)})
    sinks = None if p.sinks is None else p.sinks[heads]  # [h]
    return dataclasses.replace(p, q=take(p.q, heads), k=take(p.k, kv_heads), v=take(p.v, kv_heads), sizes=sizes,
                               mask=mask, sinks=sinks)


def _grid_plan(p: Problem, mask: Mask, bq: int, bk: int) -> Plan:
    """The spans of ``mask``'s tile classification with blocks of ``bq`` queries and ``bk`` keys, grouped."""
    ext, masked = p.ext, p.bias is not None
    Q, K = ext.Q, ext.K
    empty, full = mask.classify_grid(ext, bq, bk)  # [nq, nk] each
    spans: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}  # (rows, L, masked) -> [(block, k0)]
    per_block = []
    for i in range(empty.shape[0]):
        rows = min(bq, Q - i * bq)
        cuts = _spans(empty[i].tolist(), full[i].tolist(), bk, K, masked)
        per_block.append(len(cuts))
        for k0, k1, m in cuts:
            spans.setdefault((rows, k1 - k0, m), []).append((i, k0))
    groups = [_tall(Group(i0 * bq, rows, n, k0, step, L, m)) for (rows, L, m), items in spans.items()
              for i0, n, k0, step in _chains(items)]
    groups.sort(key=lambda g: (g.r0, g.k0))
    return Plan(groups, all(c <= 1 for c in per_block))


def _ramp(groups: list[Group], per: int) -> list[Group]:
    """The first blocks before a band, each one span from key 0 of its own length (a causal
    window's ramp: keys 0 … 64, 0 … 128, …), as ONE masked call over the longest: at most twice
    their entries, which are few beside the band's, for one call in place of one per block (while
    its mask stays small)."""
    n, rows, L = 0, 0, 0
    while (n < len(groups) and groups[n].n == 1 and groups[n].k0 == 0 and groups[n].r0 == rows
           and not any(h.r0 < rows + groups[n].rows and h.r0 + h.n * h.rows > rows for h in groups[n + 1:])):
        rows, L, n = rows + groups[n].rows, max(L, groups[n].L), n + 1
    band = n < len(groups) and groups[n].n > 1 and groups[n].kstep == groups[n].rows  # the ramp leads into a band
    if n < 2 or not band or rows * L * per > MASK_ELEMS:
        return groups
    return [Group(0, rows, 1, 0, 0, L, True)] + groups[n:]


def _tall(g: Group) -> Group:
    """Consecutive blocks over the same keys (a document, a prefix) as one block of all their rows:
    one call whose kernel sums dk, dv over the rows itself (a masked one while its mask stays small)."""
    if g.n > 1 and g.kstep == 0 and (not g.masked or g.n * g.rows * g.L <= MASK_ELEMS):
        return g._replace(rows=g.n * g.rows, n=1)
    return g


def _spans(empty: list[bool], full: list[bool], bk: int, K: int, masked: bool) -> list[tuple[int, int, bool]]:
    """One query block's spans (k0, k1, masked) from its tiles' classification: runs of non-empty
    tiles; a run up to ``ONE_SPAN`` keys (or any run, with a bias) is one span, masked if any tile
    is partial; a longer one is cut into full runs (no mask) and partial runs."""
    out: list[tuple[int, int, bool]] = []
    j, nk = 0, len(empty)
    while j < nk:
        if empty[j]:
            j += 1
            continue
        e = j
        while e < nk and not empty[e]:
            e += 1
        k0, k1 = j * bk, min(K, e * bk)
        if masked or k1 - k0 <= ONE_SPAN or all(full[j:e]) or not any(full[j:e]):
            out.append((k0, k1, masked or not all(full[j:e])))
        else:
            s = j
            while s < e:
                t = s
                while t < e and full[t] == full[s]:
                    t += 1
                out.append((s * bk, min(K, t * bk), not full[s]))
                s = t
        j = e
    return out


def _chains(items: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Spans (block, k0) of one kind -> (first block, count, first k0, key step) runs of consecutive
    blocks whose k0 advances by a constant step ≥ 0 (each block at most once per run)."""
    live: list[list] = []  # [first block, count, first k0, step or None, last block, last k0]
    done: list[list] = []
    for i, k0 in sorted(items):
        for c in live:
            if c[4] == i - 1 and (k0 - c[5] == c[3] if c[3] is not None else k0 >= c[5]):
                c[1], c[3], c[4], c[5] = c[1] + 1, k0 - c[5], i, k0
                break
        else:
            live.append([i, 1, k0, None, i, k0])
        done += [c for c in live if c[4] < i - 1]  # chains that missed block i - 1 are closed
        live = [c for c in live if c[4] >= i - 1]
    return sorted((i0, n, k0, step or 0) for i0, n, k0, step, _, _ in done + live)


def chunks(p: Problem, g: Group) -> list[tuple[int, int]]:
    """Blocks [j0, j1) per call: the group, cut so a call's mask stays under ``MASK_ELEMS`` entries."""
    if not g.masked:
        return [(0, g.n)]
    per = g.rows * g.L * p.ext.B * (p.ext.H if p.bias is not None else 1)
    step = max(1, MASK_ELEMS // max(1, per))
    return [(j, min(g.n, j + step)) for j in range(0, g.n, step)]


def sub_group(g: Group, j0: int, j1: int) -> Group:
    return g._replace(r0=g.r0 + j0 * g.rows, n=j1 - j0, k0=g.k0 + j0 * g.kstep)


__all__ = ["BLOCK_K", "BLOCK_Q", "Group", "HeadGroup", "KERNEL_TILE", "MASK_ELEMS", "Plan", "TILE_64_ROWS", "chunks",
           "on_heads", "plan_for", "plan_key", "share", "sub_group"]
