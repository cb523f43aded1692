"""Tile plans for the tiled backend: which rectangles ``[r0:r1, k0:k1]`` of the [Q, K] score grid
are computed, and which of them need the mask evaluated (partial).

The grid of ``block_q × block_k`` blocks is classified with the mask's own ``classify``: empty
blocks are skipped, full ones need no mask. Arithmetic masks (causal, window, padding, document,
prefix-LM and their ``& | ~``) are classified top-down (a quadtree: cost grows with the mask's
boundary, and full regions come out as large rectangles); the others by their whole grid at once.
Query rows are processed in *row groups* of ``group_q`` rows that share the online-softmax state
(Algorithm 1's query block Q_i, times the G query heads of a key/value head): full regions are
computed as tall rectangles (up to a worker's ``tile_elems`` scores each), partial blocks one by
one, nearest the diagonal first (:func:`_diagonal_first`), so causal attention runs its full part
with the big matmuls of the unmasked case and only its diagonal with small tiles.

Costs and tile sizes come from a cost model per device type (:class:`Model`): ``CPU_MODEL`` fitted
on the 2-core reference CPU, ``CUDA_MODEL`` a launch-bound guess (not measured). :func:`on_device`
decides which path a call takes (any non-CPU device; CPU tensors too inside :func:`device_mode`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import BackendError
from ..masks import Extent, Mask, Tile
from ..masks.dense import GRID_CODES
from .costs import Costs, Estimate
from .plan_cache import PlanCache
from .problem import Problem


class Model(NamedTuple):
    """The planner's cost model for one device type: the score-tile size it aims for per worker
    (``tile_elems``, in elements of a worker's slice [B·Hkv / workers, G·block_q, block_k]) and the
    estimated seconds of one forward (float32, d = 64): per call, per query row and head a worker
    handles (the O(Q·d) passes), per rectangle and per row group a worker visits, per score entry
    (shared among the workers), and extra per entry and per rectangle that is partial (the mask)."""

    tile_elems: int
    call: float
    row: float
    tile: float
    block: float
    elem: float
    partial_elem: float
    partial_tile: float


# Fitted on the 2-core reference machine (Xeon, torch 2.13, fp32, d = 64). Per rectangle and row
# group: Python and per-op overhead, paid by every worker, and the two workers' contention for the
# GIL; per entry: two matmuls, exp2, sum. Checked against B=1, H=8, N = 512 … 4096, no mask,
# padding, document: within about 20%. Tiles of 2^21 elements (8 MiB fp32): 2^19-2^20 (which fit
# L2) lost more to per-op overhead than they gained in cache hits; 2^21 ran ~10% faster, 2^23
# slower again.
CPU_MODEL = Model(tile_elems=1 << 21, call=3e-3, row=1.0e-6, tile=400e-6, block=150e-6,
                  elem=2.3e-9, partial_elem=0.5e-9, partial_tile=40e-6)

# CUDA (and any other accelerator): NOT fitted or measured (no GPU was available when it was written). A
# launch-bound guess, there only so that the plan prefers few large rectangles on a GPU: each op
# is a kernel launch queued from Python (~10 µs with its dispatch), a rectangle is ~20 of them and
# a row group ~15, while a score entry costs ~1e-11 s (two fp32 matmuls at d = 64 and a few passes
# at HBM bandwidth). Tiles of 2^23 elements (32 MiB fp32) keep the launches few.
CUDA_MODEL = Model(tile_elems=1 << 23, call=1e-3, row=1e-10, tile=200e-6, block=150e-6,
                     elem=1e-11, partial_elem=1e-11, partial_tile=60e-6)

BLOCK_K = 256  # default block_k; block_q follows from the model's tile_elems

_FORCED = 0  # > 0 inside ``device_mode()``: CPU tensors take the device path


@contextmanager
def device_mode() -> Iterator[None]:
    """A test and debug tool: inside it, the tiled backend treats CPU tensors exactly as it treats
    tensors on a GPU (one worker, no thread pool, every decision inside the tile loops made on the
    device, the device cost model), so the GPU code path can be checked on a machine without one.
    Process-wide (the flag is read by whichever thread runs the call, autograd's included); slower
    than the CPU path. Not for production use."""
    global _FORCED
    _FORCED += 1
    try:
        yield
    finally:
        _FORCED -= 1


def on_device(device: torch.device) -> bool:
    """Whether a call on ``device`` takes the device path: any non-CPU device, or any device inside
    :func:`device_mode`."""
    return device.type != "cpu" or _FORCED > 0


def model(device: torch.device) -> Model:
    """The cost model for calls on ``device``: the CPU's, or CUDA's for every device path (other
    accelerators have no model of their own; CPU tensors inside :func:`device_mode` take it too)."""
    return CUDA_MODEL if on_device(device) else CPU_MODEL


class Rect(NamedTuple):
    """One computed rectangle of the score grid: query rows ``r0:r1``, keys ``k0:k1``; ``partial``:
    the mask must be evaluated on it (otherwise every entry may be attended)."""

    r0: int
    r1: int
    k0: int
    k1: int
    partial: bool

    @property
    def elems(self) -> int:
        return (self.r1 - self.r0) * (self.k1 - self.k0)


class RowGroup(NamedTuple):
    """Query rows ``q0:q1`` that share one online-softmax state, and their rectangles in the order
    they are processed (``q0 <= r0 < r1 <= q1`` for each)."""

    q0: int
    q1: int
    rects: list[Rect]


class KeySpan(NamedTuple):
    """Keys ``k0:k1`` and the rectangles over them (the backward walks the plan by key span)."""

    k0: int
    k1: int
    rects: list[Rect]


@dataclass
class Plan:
    """The computed rectangles, by row group (``rows``) and by key span (``cols``)."""

    block_q: int
    block_k: int
    rows: list[RowGroup]
    computed: int = 0  # Σ (r1 - r0)·(k1 - k0) over the computed rectangles
    tiles: int = 0
    partial: int = 0  # rectangles where the mask is evaluated
    partial_elems: int = 0  # Σ (r1 - r0)·(k1 - k0) over the partial ones
    model: Model = CPU_MODEL  # the cost model of the device it was made for
    _cols: list[KeySpan] | None = field(default=None, repr=False)

    @property
    def cols(self) -> list[KeySpan]:
        """The same rectangles by key span, in key order."""
        if self._cols is None:
            by_key: dict[tuple[int, int], list[Rect]] = {}
            for group in self.rows:
                for rect in group.rects:
                    by_key.setdefault((rect.k0, rect.k1), []).append(rect)
            self._cols = [KeySpan(k0, k1, by_key[(k0, k1)]) for k0, k1 in sorted(by_key)]
        return self._cols

    @property
    def rects(self) -> list[Rect]:
        """Every computed rectangle."""
        return [rect for group in self.rows for rect in group.rects]

    def fraction(self, ext: Extent) -> float:
        """Share of the [Q, K] grid that is computed (1.0 = everything)."""
        return self.computed / max(1, ext.Q * ext.K)

    @property
    def blocks(self) -> int:
        """Row groups with at least one rectangle."""
        return sum(1 for group in self.rows if group.rects)

    def cost(self, rows_per_q: int, n_workers: int = 1) -> float:
        """Estimated seconds of one float32 forward at d = dv = 64 (``rows_per_q`` = B·H), by the
        plan's cost model (``model``); ``n_workers`` threads share the score entries."""
        return sum(self.parts(rows_per_q, n_workers))

    def parts(self, rows_per_q: int, n_workers: int = 1) -> tuple[float, float, float]:
        """:meth:`cost` in three parts (:func:`estimate` scales the last two by the head width): fixed
        (per call, rectangle, row group), per entry and row (the matmuls, exp2, the O(Q·d) passes),
        and the mask's extra on partial rectangles."""
        m, Q = self.model, (self.rows[-1].q1 if self.rows else 0)
        fixed = m.call + self.tiles * m.tile + self.blocks * m.block
        entries = (self.computed * m.elem + Q * m.row) * rows_per_q / n_workers
        partial = self.partial * m.partial_tile + self.partial_elems * m.partial_elem * rows_per_q / n_workers
        return fixed, entries, partial


def _cuts(n: int, b: int) -> list[int]:
    return list(range(0, n, b)) + [n]


def classify_leaves(mask: Mask | None, ext: Extent, qcuts: list[int], kcuts: list[int]) -> list[tuple[int, int, int, int, Tile]]:
    """Rectangles of blocks ``(i0, i1, j0, j1, class)`` — rows ``qcuts[i0]:qcuts[i1]``, keys
    ``kcuts[j0]:kcuts[j1]`` — that together cover the grid once; partial ones are single blocks."""
    nq, nk = len(qcuts) - 1, len(kcuts) - 1
    if not nq or not nk:
        return []
    if mask is None:
        return [(0, nq, 0, nk, Tile.FULL)]
    if not mask.arithmetic:  # classify evaluates tensors: the whole grid at once
        return grid_leaves(mask, ext, qcuts, kcuts)
    leaves: list[tuple[int, int, int, int, Tile]] = []

    def visit(i0: int, i1: int, j0: int, j1: int) -> None:  # blocks [i0, i1) × [j0, j1)
        t = mask.classify(ext, qcuts[i0], qcuts[i1], kcuts[j0], kcuts[j1])
        if t is not Tile.PARTIAL or (i1 - i0 == 1 and j1 - j0 == 1):
            leaves.append((i0, i1, j0, j1, t))
        elif i1 - i0 >= j1 - j0:
            mid = (i0 + i1) // 2
            visit(i0, mid, j0, j1)
            visit(mid, i1, j0, j1)
        else:
            mid = (j0 + j1) // 2
            visit(i0, i1, j0, mid)
            visit(i0, i1, mid, j1)

    visit(0, nq, 0, nk)
    return leaves


def grid_codes(mask: Mask, ext: Extent, block_q: int, block_k: int) -> torch.Tensor | None:
    """Every tile of a uniform grid at once, int8 [nq, nk] of ``GRID_CODES`` (0 empty, 1 full,
    2 partial), from the mask's own ``classify_grid`` (dense masks: one vectorised reduction per
    grid, cached on the mask; structured masks: closed forms; ``& | ~``: combined). None for masks
    holding a predicate, which are evaluated tile by tile (never the whole [Q, K] at once)."""
    if not mask.whole_grid:
        return None
    empty, full = mask.classify_grid(ext, block_q, block_k)  # [nq, nk] each
    codes = torch.full(empty.shape, 2, dtype=torch.int8)  # partial
    codes[full] = 1
    codes[empty] = 0
    return codes


def grid_leaves(mask: Mask, ext: Extent, qcuts: list[int], kcuts: list[int]) -> list[tuple[int, int, int, int, Tile]]:
    """``classify_leaves`` for masks that are not arithmetic: the whole grid classified at once
    (``grid_codes``), then equal empty / full tiles merged into rectangles (runs along the keys,
    then identical runs down the rows); tile by tile only for a predicate or an uneven grid."""
    nq, nk = len(qcuts) - 1, len(kcuts) - 1
    bq, bk = qcuts[1] - qcuts[0], kcuts[1] - kcuts[0]
    codes = grid_codes(mask, ext, bq, bk) if qcuts == _cuts(ext.Q, bq) and kcuts == _cuts(ext.K, bk) else None
    if codes is None:
        return [(i, i + 1, j, j + 1, mask.classify(ext, qcuts[i], qcuts[i + 1], kcuts[j], kcuts[j + 1]))
                for i in range(nq) for j in range(nk)]
    leaves: list[tuple[int, int, int, int, Tile]] = []
    open_runs: dict[tuple[int, int, int], int] = {}  # (j0, j1, code) of empty/full runs -> first row
    for i, row in enumerate(codes.tolist() + [[]]):  # an empty last row closes every run
        runs, j = [], 0
        while j < len(row):
            j1 = j + 1
            if row[j] != 2:
                while j1 < len(row) and row[j1] == row[j]:
                    j1 += 1
            runs.append((j, j1, row[j]))
            j = j1
        still: dict[tuple[int, int, int], int] = {}
        for run in runs:
            if run[2] == 2:
                leaves.append((i, i + 1, run[0], run[1], Tile.PARTIAL))
            else:
                still[run] = open_runs.pop(run, i)
        leaves.extend((i0, i, j0, j1, GRID_CODES[c]) for (j0, j1, c), i0 in open_runs.items())
        open_runs = still
    return leaves


def make_plan(p: Problem, block_q: int, block_k: int, group_q: int | None = None) -> Plan:
    """Classify the ``block_q × block_k`` grid and lay out the computed rectangles: row groups of
    ``group_q`` rows (a multiple of block_q; default block_q); partial blocks one by one; full
    regions merged along the keys and cut into rectangles of at most a worker's ``tile_elems`` (the
    device's cost model)."""
    ext, m = p.ext, model(p.q.device)
    group_q = block_q if group_q is None else max(block_q, group_q // block_q * block_q)
    qcuts, kcuts = _cuts(ext.Q, block_q), _cuts(ext.K, block_k)
    per_q = max(1, ext.B * ext.H // shares(p))  # a worker's rows per query
    step = group_q // block_q  # blocks per row group
    groups: list[list[Rect]] = [[] for _ in range(0, max(1, len(qcuts) - 1), step)]
    for i0, i1, j0, j1, t in classify_leaves(p.mask, ext, qcuts, kcuts):
        if t is Tile.EMPTY:
            continue
        for g in range(i0 // step, (i1 - 1) // step + 1):  # a leaf may straddle row groups
            a, b = max(i0, g * step), min(i1, (g + 1) * step)
            groups[g].append(Rect(qcuts[a], qcuts[b], kcuts[j0], kcuts[j1], t is Tile.PARTIAL))
    rows = []
    for g, pieces in enumerate(groups):
        q0, q1 = qcuts[g * step], qcuts[min(len(qcuts) - 1, (g + 1) * step)]
        rects = [x for x in pieces if x.partial]
        for full in _merged_full(pieces):
            wide = max(block_k, m.tile_elems // (per_q * (full.r1 - full.r0)) // block_k * block_k)  # widest rectangle
            n = -(-(full.k1 - full.k0) // wide)
            cuts = [full.k0 + (full.k1 - full.k0) * c // n for c in range(n + 1)]
            rects.extend(full._replace(k0=a, k1=b) for a, b in zip(cuts, cuts[1:]))
        rows.append(RowGroup(q0, q1, _diagonal_first(rects, ext)))
    every = [rect for group in rows for rect in group.rects]
    partial = [rect for rect in every if rect.partial]
    return Plan(block_q, block_k, rows, sum(r.elems for r in every), len(every), len(partial),
                sum(r.elems for r in partial), m)


def _merged_full(pieces: list[Rect]) -> list[Rect]:
    """Full rectangles with the same rows and touching key ranges, merged."""
    merged: list[Rect] = []
    for rect in sorted(x for x in pieces if not x.partial):
        last = merged[-1] if merged else None
        if last and (last.r0, last.r1, last.k1) == (rect.r0, rect.r1, rect.k0):
            merged[-1] = last._replace(k1=rect.k1)
        else:
            merged.append(rect)
    return merged


def _diagonal_first(tiles: list[Rect], ext: Extent) -> list[Rect]:
    """Processing order in a row group: partial rectangles nearest the diagonal (either alignment)
    first, then the full ones. Δ from Alg. 1 (key blocks in order j = 1 … T_c), because of the
    optimistic exponent (``tiled._step``). The online softmax takes keys in any order, but needs a max pass
    until every row has a max; the diagonal blocks are small and, for causal, window, document and
    padding masks, give every row some key, so the large full rectangles skip the max pass."""
    def distance(t: Rect) -> tuple[bool, float, int]:
        rc, kc = (t.r0 + t.r1) / 2, (t.k0 + t.k1) / 2
        return (not t.partial, min(abs(kc - rc), abs(kc - rc - (ext.K - ext.Q))), t.r0)

    return sorted(tiles, key=distance)


def _given(p: Problem, name: str) -> int | None:
    value = p.options.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackendError(f"{name} must be a positive integer (a tile size for the tiled backend), got {value!r}.")
    return value


def _pow2_floor(x: float) -> int:
    n = 1
    while n * 2 <= x:
        n *= 2
    return n


def workers(device: torch.device | None = None) -> int:
    """Worker threads for one call on ``device``: 1 on the device path (:func:`on_device`: the
    whole call is one batch of every op, queued from the calling thread), else PyTorch's intra-op
    thread count (``torch.set_num_threads``). ``None``: a CPU call."""
    if device is not None and on_device(device):
        return 1
    return max(1, torch.get_num_threads())


def split(B: int, Hkv: int, n_workers: int) -> list[tuple[slice, slice]]:
    """How one call is divided among worker threads: ``(batch slice, key/value-head slice)`` per
    worker — contiguous ranges of the key/value heads, or of the batch when there is one head."""
    def ranges(n: int, parts: int) -> list[slice]:
        cuts = [round(i * n / parts) for i in range(parts + 1)]
        return [slice(a, b) for a, b in zip(cuts, cuts[1:])]

    if n_workers > 1 and Hkv > 1:
        return [(slice(None), h) for h in ranges(Hkv, min(n_workers, Hkv))]
    if n_workers > 1 and B > 1:
        return [(b, slice(None)) for b in ranges(B, min(n_workers, B))]
    return [(slice(None), slice(None))]


def shares(p: Problem) -> int:
    """Into how many worker slices the call ``p`` is divided (:func:`split`)."""
    return len(split(p.ext.B, p.sizes["Hkv"], workers(p.q.device)))


def default_blocks(p: Problem, block_k: int = BLOCK_K) -> tuple[int, int]:
    """The heuristic without a mask: ``block_k = 256``; ``block_q`` (and the row group) such that a
    worker's score tile [B·Hkv/workers, G·block_q, block_k] holds about the device model's
    ``tile_elems`` elements (16 … 2048)."""
    ext = p.ext
    bk = max(1, min(block_k, ext.K))
    bq = _pow2_floor(model(p.q.device).tile_elems * shares(p) / max(1, ext.B * ext.H * bk))  # B·Hkv·G = B·H rows per query
    bq = max(16, min(2048, bq))
    return max(1, min(bq, ext.Q)), bk


def plan_key(p: Problem) -> tuple[bool, int]:
    """What a tile plan depends on besides the mask and the call's sizes and block options: the
    device path and the worker count."""
    return on_device(p.q.device), workers(p.q.device)


_PLANS: PlanCache[Plan] = PlanCache("tiled plans", "the tiled backend's plan: its rectangles and their classification",
                                    plan_key)


def plan_for(p: Problem) -> Plan:
    """The tile plan for a call. ``block_q`` / ``block_k`` from ``p.options`` set the grid (and
    the row group is block_q rows); otherwise the row group comes from the heuristic and, with a
    mask, the grid is the candidate (``block_q`` = group/1 … /16, ``block_k`` = 256 or 128) whose
    estimated cost is lowest. No queries or no keys: an empty plan. Kept per mask object and call
    key (``plan_cache.PlanCache``, with :func:`plan_key`)."""
    return _PLANS.for_call(p, lambda: _plan(p))


def _plan(p: Problem) -> Plan:
    """:func:`plan_for`, uncached."""
    bq_given, bk_given = _given(p, "block_q"), _given(p, "block_k")
    if p.ext.Q == 0 or p.ext.K == 0:
        return Plan(bq_given or 1, bk_given or 1, [], model=model(p.q.device))
    group, bk0 = default_blocks(p, bk_given or BLOCK_K)
    if bq_given:
        return make_plan(p, bq_given, bk0)
    if p.mask is None:
        return make_plan(p, group, bk0, group)
    candidates = set()
    for fq in (1, 2, 4, 8, 16):
        for fk in (1, 2):
            bk = bk0 if bk_given else max(32, bk0 // fk)
            candidates.add((max(16, group // fq), min(bk, p.ext.K)))
    plans = [make_plan(p, bq, bk, group) for bq, bk in sorted(candidates, reverse=True)]
    return min(plans, key=lambda pl: pl.cost(p.ext.B * p.ext.H, shares(p)))


def estimate(p: Problem, grad: bool, c: Costs) -> Estimate:
    """The tiled backend's seconds: its tile plan's model seconds (the plan it will run; per-entry
    parts × the head width over 64) × this machine's measured scale (``costs.Costs.tiled_scale``,
    or ``tiled_backward`` for forward+backward). One scale for the whole model, so the estimate
    ranks plans as the planner does."""
    plan = plan_for(p)
    fixed, entries, partial = plan.parts(p.ext.B * p.ext.H, shares(p))
    model_s = fixed + (entries + partial) * (p.sizes["d"] + p.sizes["dv"]) / 128
    scale = (c.tiled_backward or c.tiled_scale) if grad else c.tiled_scale
    return Estimate(model_s * scale, f"{plan.fraction(p.ext):.0%} of the scores in {plan.tiles} tiles", plan)
