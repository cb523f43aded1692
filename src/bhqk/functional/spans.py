"""The "spans" backend: PyTorch's fused CPU flash kernel, run only over the key spans a mask allows.

PyTorch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) is close to this
CPU's peak but cannot skip anything: a mask is added on every tile. bhqk's masks know per tile what
is empty, full or partial (``Mask.classify_grid``), so this backend cuts the [Q, K] grid into
query blocks of ``block_q`` rows and, per block, into the runs of key tiles the mask allows:

- an empty tile is skipped;
- a run of full tiles is one span without a mask;
- a run with partial tiles is one span with a small additive mask (``attn_mask``: -inf where the
  mask forbids, plus the bias, which makes every span of a call with a bias masked);
- a causal mask alone is the kernel's own ``is_causal`` (top-left, so bottom-right with Q ≠ K is a
  full span plus a top-left causal one; a decoding step, which sees every key, has no mask).

Spans of equal length and kind in consecutive query blocks whose keys advance by a constant step
(a sliding window's band, a causal diagonal) form one :class:`Group`, computed in ONE kernel call:
the query blocks are folded into the batch axis (a view of q when B = 1) and the key spans are a
strided view of k and v (``unfold``). Blocks over the same keys (a document, a prefix) become one
tall block. A band's mask (causal and window masks depend on k − q only) is built for one block and
broadcast. A band's blocks are sized from the kernel's query tiles and the band's width, with a
backward plan of its own (``_band_width``); the ramp of blocks before it is one call. Plans (and,
without a bias, their call masks) are kept per mask object, like the tiled backend's.

Each span gives (out, lse) over its keys; the spans of a row are merged by their log-sum-exp
(``merge.merge_``, the ring-attention merge), and sinks join once at the end (as ``merge.with_sinks``
does). The kernel gives lse 0 (not -inf) for a row that sees no key of its span, so the mask's rows
say which rows saw nothing. The backward calls the fused backward per span with the MERGED output
and lse (what makes per-span gradients exact: P = exp(S - lse) is then each entry's share of the
whole row) and adds up dq per row and dk, dv per key. A gradient of the returned lse (its users,
or nothing) adds ``g·P`` to dS: two more kernel calls per span, only when it is nonzero.

Refused (``why_not``): softcap, dropout, a bias that needs its gradient, non-CPU tensors, and an
empty head dimension. NaN/inf in q, k or v: handed to the tiled backend (``hands_off``), as the
torch adapter does. dv ≠ d: the narrower of v and (q, k) is padded with zero columns (the kernel
wants one head size; zero columns change neither the scores nor the output). The kernel takes any
strides but the last dimension's, which it reads as 1: q, k or v whose last stride is not 1 (a
slice of a wider buffer) is copied to a contiguous tensor once per call.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..bias import Bias, dense_parts, in_dtype
from ..masks import Extent, Mask, top_left_count
from ..shapes import Sizes
from ..shortcuts import Shortcut, declare
from . import nonfinite
from .merge import merge_, sinks_grad, with_sinks
from .plan_cache import PlanCache
from .problem import Problem

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

BLOCK_Q = 128  # query rows per block where the mask is no band (a band's block: see _band_rows)
BLOCK_K = 64  # key tile of the classification: spans start and end on these edges
KERNEL_TILE = 32  # the kernel's query tile below 192 query rows (64 below 768, 256 above): a band's block is a multiple
TILE_64_ROWS = 192  # the fewest query rows the kernel runs with 64-row tiles: a band's backward blocks (see _band_width)
BAND_OVER = 4  # a band's block of R rows computes (R + w)/w of its entries: R ≤ w/4 keeps that ≤ 1.25
ONE_SPAN = 1024  # a run of allowed key tiles up to this long with a partial tile in it is one masked span
MASK_ELEMS = 1 << 22  # a call's additive mask stays below this many entries (calls are split)
SMALL_MASK = 1 << 16  # a causal call with Q·K up to this many entries is one masked call, not two calls merged
KEEP_ELEMS = 1 << 22  # the forward's masks are kept for the backward up to this many entries in all
GRAD_ELEMS = 1 << 22  # a backward call's dk (and dv) per block stay below this many entries (calls are split)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # what the fused CPU kernel takes
# where its lse is as exact as a float32 pass over the upcast inputs: for bf16/fp16 inputs its lse is
# about 10x further from an fp64 lse (6e-5 vs 3e-6 to 7e-6 at d = 64, N = 300, measured for issue 28)
_EXACT_LSE_DTYPES = (torch.float32, torch.float64)


def fused_refuses(q: torch.Tensor, exact_lse: bool = False) -> str | None:
    """Why PyTorch's fused CPU flash kernel cannot take q's device and dtype, else None: the one
    eligibility rule of the span path (``exact_lse=False``: any dtype the kernel takes; it computes
    the call in the input dtype, as SDPA does) and of the statistics' lse (``exact_lse=True``: only
    where the kernel's lse is float32-exact; bf16/fp16 take the float32 online pass instead)."""
    if q.device.type != "cpu":
        return f"PyTorch's fused flash kernel for the CPU takes CPU tensors (these are on {q.device.type})"
    if q.dtype not in (_EXACT_LSE_DTYPES if exact_lse else _DTYPES):
        if exact_lse:
            return f"the fused CPU kernel's lse for {q.dtype} is not float32-exact"
        return f"the fused CPU kernel takes float32/64, bfloat16 and float16, not {q.dtype}"
    return None


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
    masks: dict = field(default_factory=dict, repr=False, compare=False)  # kept call masks: see _kept_mask
    backward: Plan | None = field(default=None, repr=False, compare=False)  # the backward's own plan (a band's)
    by_heads: list[HeadGroup] = field(default_factory=list)  # heads of one structure, each a call of its own: see _by_heads

    @property
    def computed(self) -> int:
        if self.by_heads:  # per head, on average over the heads
            return sum(len(g.heads) * g.plan.computed for g in self.by_heads) // sum(len(g.heads) for g in self.by_heads)
        return sum(g.entries for g in self.groups)

    def fraction(self, ext: Extent) -> float:
        return self.computed / max(1, ext.Q * ext.K)


class HeadGroup(NamedTuple):
    """Query heads whose mask has one structure (``Mask.head_groups``), run as one call: ``mask`` is
    the call's mask on those heads (``Mask.select_heads``), ``plan`` its spans."""

    heads: list[int]
    mask: Mask
    plan: Plan


# ---- what it can take -------------------------------------------------------------------------------

def why_not(p: Problem, need_lse: bool) -> str | None:
    """None when PyTorch's fused CPU kernel can compute the call, else why not."""
    if (why := fused_refuses(p.q)) is not None:
        return why
    if p.softcap is not None:
        return "the fused CPU kernel has no softcap"
    if p.dropout_p > 0:
        return "the span path has no dropout (the fused kernel would draw a different keep-mask per span)"
    if any(b.tensor.requires_grad for b in dense_parts(p.bias)):
        return "the fused kernel's backward gives no gradient for the bias"
    if p.sizes["d"] == 0 and p.sizes["dv"] == 0:
        return "the fused CPU kernel needs a head dimension above 0"
    return None


def hands_off(p: Problem, plan: Plan | None = None) -> tuple[str, str] | None:
    """("tiled", why) when q, or k or v where a mask applies, holds NaN/inf (the fused kernel lets
    them cross the mask and turns a NaN query row into zeros), else None. A call that is one kernel
    call without a mask (no mask; a decoding step) checks q only: every row attends every key, so
    NaN/inf in k or v reach every row there as in the formula (as the torch adapter does).
    ``plan``: :func:`plan_for` of ``p`` (made here if not given)."""
    plan = plan if plan is not None else plan_for(p)
    unmasked = len(plan.groups) == 1 and _whole(plan.groups[0], p) and not (plan.groups[0].masked or plan.groups[0].causal)
    return nonfinite.hand_off(p, unmasked or not (plan.groups or plan.by_heads), "the fused kernel")


def share(p: Problem, plan: Plan | None = None) -> float:
    """The fraction of the B·H·Q·K score entries the span path computes (1.0: it skips nothing)."""
    ext = p.ext
    if ext.Q == 0 or ext.K == 0:
        return 0.0
    return (plan if plan is not None else plan_for(p)).fraction(ext)


# ---- the plan ---------------------------------------------------------------------------------------

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
MASKS = declare(Shortcut(
    "span call masks", "building a masked span's additive mask again at the next call", "kept in its plan: "
    "q's dtype and device, the group and its blocks (the plan's key holds the mask and sizes); not with a bias",
    f"{KEEP_ELEMS} entries per plan", "with the plan"))


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
        return t.index_select(1, torch.tensor(idx, device=t.device))

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


# ---- one group's tensors ----------------------------------------------------------------------------

def _q_view(t: torch.Tensor, g: Group) -> torch.Tensor:
    """[B, H, Q, x] -> [B·n, H, rows, x]: the group's query blocks in the batch axis (a view when B = 1)."""
    B = t.shape[0]
    x = t[:, :, g.r0:g.r0 + g.n * g.rows].unflatten(2, (g.n, g.rows))  # [B, H, n, rows, x]
    return x.transpose(1, 2).reshape(B * g.n, t.shape[1], g.rows, t.shape[-1])  # [B, n, H, rows, x] -> [B·n, H, rows, x]


def _k_view(t: torch.Tensor, g: Group) -> torch.Tensor:
    """[B, Hkv, K, x] -> [B·n, Hkv, L, x]: block j's keys k0 + j·kstep … + L (a strided view when B = 1)."""
    B, Hkv = t.shape[0], t.shape[1]
    if g.n == 1:
        return t[:, :, g.k0:g.k0 + g.L]  # [B, Hkv, L, x]
    if g.kstep == 0:
        x = t[:, :, None, g.k0:g.k0 + g.L].expand(B, Hkv, g.n, g.L, t.shape[-1])  # [B, Hkv, n, L, x]
    else:
        end = g.k0 + (g.n - 1) * g.kstep + g.L
        x = t[:, :, g.k0:end].unfold(2, g.L, g.kstep).transpose(-1, -2)  # [B, Hkv, n, x, L] -> [B, Hkv, n, L, x]
    return x.transpose(1, 2).reshape(B * g.n, Hkv, g.L, t.shape[-1])  # [B, n, Hkv, L, x] -> [B·n, Hkv, L, x]


def _k_index(g: Group) -> torch.Tensor:
    """The key positions of the group's spans, block by block: [n·L]."""
    return (g.k0 + g.kstep * torch.arange(g.n)[:, None] + torch.arange(g.L)[None, :]).reshape(-1)  # [n, L] -> [n·L]


def _rows(t: torch.Tensor, g: Group) -> torch.Tensor:
    """[B, H, Q, ...] -> the group's rows [B, H, n, rows, ...] (a view)."""
    return t[:, :, g.r0:g.r0 + g.n * g.rows].unflatten(2, (g.n, g.rows))


def _from_batch(t: torch.Tensor, B: int, n: int) -> torch.Tensor:
    """[B·n, H, rows, ...] -> [B, H, n, rows, ...] (a view)."""
    return t.unflatten(0, (B, n)).transpose(1, 2)


def _mask(p: Problem, g: Group, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Blocks j0:j1 of the group: the additive mask [B·(j1-j0) or 1, H or 1, rows, L] in q's dtype
    (-inf: may not attend; the bias added) and the rows that see some key there, bool
    [B·(j1-j0) or 1, H or 1, rows] (None: all of them)."""
    ext, dev, n = p.ext, p.q.device, j1 - j0
    B = ext.B
    if n > 1 and g.kstep == g.rows and p.bias is None and p.mask is not None and p.mask.shift_invariant:  # a band: one mask
        j1, n = j0 + 1, 1
    qi = (g.r0 + g.rows * torch.arange(j0, j1, device=dev)[:, None] + torch.arange(g.rows, device=dev)[None, :])  # [n, rows]
    ki = (g.k0 + g.kstep * torch.arange(j0, j1, device=dev)[:, None] + torch.arange(g.L, device=dev)[None, :])  # [n, L]
    allowed = None
    if p.mask is not None:
        mod = p.mask.mask_mod(ext.B, ext.H, ext.Q, ext.K, dev)
        b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)  # [B] -> [B, 1, 1, 1, 1] (axes B, n, H, rows, L)
        h = torch.arange(ext.H, device=dev).view(1, 1, ext.H, 1, 1)  # [H] -> [1, 1, H, 1, 1]
        allowed = mod(b, h, qi.view(1, n, 1, g.rows, 1), ki.view(1, n, 1, 1, g.L))  # [#B, n, #H, rows, L]
        allowed = torch.as_tensor(allowed, device=dev).expand(-1, n, -1, g.rows, g.L)
    add = None
    if p.bias is not None:
        tiles = [_bias_tile(p, p.bias, int(qi[j, 0]), int(ki[j, 0]), g) for j in range(n)]  # [#B, #H, rows, L] each
        Bb = max(t.shape[0] for t in tiles)
        Hb = max(t.shape[1] for t in tiles)
        add = torch.stack([t.expand(Bb, Hb, g.rows, g.L) for t in tiles], dim=1)  # [#B, n, #H, rows, L]
        finite = add > float("-inf")
        allowed = finite if allowed is None else allowed & finite
    assert allowed is not None
    if add is None:
        add = torch.zeros((), dtype=p.q.dtype, device=dev)
    add = torch.where(allowed, add, float("-inf"))  # [#B, n, #H, rows, L]
    seen = allowed.any(dim=-1)  # [#B, n, #H, rows]
    if n > 1 and add.shape[0] == 1 and bool((add == add[:, :1]).all()):  # every block alike (a band): one mask
        add, seen = add[:, :1], seen[:, :1]
    Bm = B if add.shape[1] > 1 or add.shape[0] > 1 else 1  # the call's batch is [B, n] flattened
    nm, Hm = add.shape[1], add.shape[2]
    add = add.expand(Bm, nm, Hm, g.rows, g.L).reshape(Bm * nm, Hm, g.rows, g.L)  # [Bm·n, Hm, rows, L]
    seen = seen.expand(Bm, nm, Hm, g.rows).reshape(Bm * nm, Hm, g.rows)  # [Bm·n, Hm, rows]
    return add, seen


def _bias_tile(p: Problem, bias: Bias, q0: int, k0: int, g: Group) -> torch.Tensor:
    """The bias on one span [#B, #H, rows, L] in q's dtype; finite values below that dtype's lowest
    become its lowest, not -inf (as the torch adapter does)."""
    from ..shapes import as_4d

    t = in_dtype(bias, p.q.dtype, lambda dt: as_4d(bias.block(p.ext, q0, q0 + g.rows, k0, k0 + g.L, p.q.device, dt)))
    return t.expand(t.shape[0], t.shape[1], g.rows, g.L)  # [#B, #H, #rows, #L] -> [#B, #H, rows, L]


def _chunks(p: Problem, g: Group) -> list[tuple[int, int]]:
    """Blocks [j0, j1) per call: the group, cut so a call's mask stays under ``MASK_ELEMS`` entries."""
    if not g.masked:
        return [(0, g.n)]
    per = g.rows * g.L * p.ext.B * (p.ext.H if p.bias is not None else 1)
    step = max(1, MASK_ELEMS // max(1, per))
    return [(j, min(g.n, j + step)) for j in range(0, g.n, step)]


def _sub(g: Group, j0: int, j1: int) -> Group:
    return g._replace(r0=g.r0 + j0 * g.rows, n=j1 - j0, k0=g.k0 + j0 * g.kstep)


Call = tuple[Group, "torch.Tensor | None", "torch.Tensor | None"]


def _calls(p: Problem, plan: Plan):
    """Every kernel call: (group, attn_mask or None, rows that see a key or None)."""
    for i, g in enumerate(plan.groups):
        for j0, j1 in _chunks(p, g):
            s = _sub(g, j0, j1)
            if s.masked:
                add, seen = _kept_mask(p, plan, i, j0, j1)
                yield s, add, seen
            else:
                yield s, None, None


def _kept_mask(p: Problem, plan: Plan, i: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_mask` of blocks j0:j1 of group i, kept in the plan while the plan's masks stay under
    ``KEEP_ELEMS`` entries: without a bias it depends only on the mask and the sizes, which key the
    plan (a dense mask's band, gathered from its tensor, collapses to one block's mask)."""
    if p.bias is not None or not MASKS.on:
        return _mask(p, plan.groups[i], j0, j1)
    key = (p.q.dtype, p.q.device, i, j0, j1)
    got = plan.masks.get(key)
    if got is not None:
        MASKS.hits += 1
    else:
        got = _mask(p, plan.groups[i], j0, j1)
        if got[0].numel() + sum(a.numel() for a, _ in plan.masks.values()) <= KEEP_ELEMS:
            plan.masks[key] = got
    return got


def _kept(calls: list[Call]) -> list[Call] | None:
    """The forward's calls, masks and all, if their masks are small enough to keep for the backward."""
    return calls if sum(a.numel() for _, a, _ in calls if a is not None) <= KEEP_ELEMS else None


# ---- forward and backward ---------------------------------------------------------------------------

def _whole(g: Group, p: Problem) -> bool:
    """The group is one call over every query row and key."""
    return g.n == 1 and g.r0 == 0 and g.rows == p.ext.Q and g.k0 == 0 and g.L == p.ext.K


def _forward(p: Problem, plan: Plan, q, k, v, calls: list[Call] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Q, dv] in q's dtype, lse [B, H, Q] float32/64) without sinks."""
    B, H, Q = p.ext.B, p.ext.H, p.ext.Q
    dv = v.shape[-1]
    ldt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if len(plan.groups) == 1 and _whole(plan.groups[0], p) and not plan.groups[0].masked:
        g = plan.groups[0]
        out, lse = _FWD(q, _k_view(k, g), _k_view(v, g), 0.0, g.causal, scale=p.scale)  # [B, H, Q, dv], [B, H, Q]
        return out, lse
    if plan.single:  # each row in at most one span: written in place, in q's dtype; rows in no span are 0, -inf
        acc = torch.empty(B, Q, H, dv, dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, Q, dv], the kernel's layout
        acc_lse = torch.empty(B, H, Q, dtype=ldt, device=q.device)
        unseen = torch.ones(Q, dtype=torch.bool)
        for g in plan.groups:
            unseen[g.r0:g.r0 + g.n * g.rows] = False
        if bool(unseen.any()):
            acc[:, :, unseen] = 0.0
            acc_lse[:, :, unseen] = float("-inf")
    else:
        acc = torch.zeros(B, H, Q, dv, dtype=ldt, device=q.device)
        acc_lse = torch.full((B, H, Q), float("-inf"), dtype=ldt, device=q.device)
    for g, add, seen in calls if calls is not None else _calls(p, plan):
        out, lse = _FWD(_q_view(q, g), _k_view(k, g), _k_view(v, g), 0.0, g.causal, attn_mask=add, scale=p.scale)
        if seen is not None and not bool(seen.all()):  # the kernel gives lse 0 to a row that saw no key of the span
            lse = lse.masked_fill(~seen, float("-inf"))
        out, lse = _from_batch(out, B, g.n), _from_batch(lse, B, g.n)  # [B, H, n, rows, dv], [B, H, n, rows]
        if plan.single:
            _rows(acc, g).copy_(out)
            _rows(acc_lse, g).copy_(lse)
        else:
            merge_(_rows(acc, g), _rows(acc_lse, g), out, lse)
    return acc.to(q.dtype), acc_lse


def _backward(p: Problem, plan: Plan, q, k, v, out, lse, grad_out, grad_lse, calls: list[Call] | None = None):
    """dq, dk, dv from the fused backward per span with the final out and lse (sinks included)."""
    B = p.ext.B
    g_lse = grad_lse if grad_lse is not None and bool((grad_lse != 0).any()) else None
    if len(plan.groups) == 1 and g_lse is None and _whole(plan.groups[0], p) and not plan.groups[0].masked:
        g = plan.groups[0]  # one kernel call without a mask did it all (no mask, or causal)
        return _BWD(grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, g.causal, scale=p.scale)
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=lse.dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=lse.dtype, device=q.device)
    lse_b = torch.where(torch.isfinite(lse), lse, float("inf")).to(lse.dtype)  # a row that saw nothing: P = 0
    out = out.to(q.dtype)
    grad_out = grad_out.to(q.dtype)
    if g_lse is not None:  # dS gains g·P: dq += scale·g·(P·K), dk += scale·Pᵀ·(g·q)
        gq = (q.to(lse.dtype) * (g_lse.to(lse.dtype) * p.scale)[..., None]).to(q.dtype)  # [B, H, Q, d]
    pieces = (piece for call in (calls if calls is not None else _calls(p, plan))
              for piece in _split(call, B, max(1, GRAD_ELEMS // (call[0].L * k.shape[1] * k.shape[-1]))))
    for g, add in pieces:
        qg, kg, vg = _q_view(q, g), _k_view(k, g), _k_view(v, g)
        og, gog = _q_view(out, g), _q_view(grad_out, g)  # [B, H, Q, dv] -> the group's [B·n, H, rows, dv]
        lg = _q_view(lse_b[..., None], g)[..., 0]  # [B, H, Q] -> [B, H, Q, 1] -> [B·n, H, rows]
        gq_, gk_, gv_ = _BWD(gog, qg, kg, vg, og, lg, 0.0, g.causal, attn_mask=add, scale=p.scale)
        if g_lse is not None:
            pk, lk = _FWD(qg, kg, kg, 0.0, g.causal, attn_mask=add, scale=p.scale)  # P_span·K / its own sum
            w = torch.exp(lk - lg).nan_to_num(0.0)  # [B·n, H, rows]: the span's share of the row
            gs = _q_view(g_lse[..., None].to(lse.dtype) * p.scale, g)  # [B·n, H, rows, 1]
            gq_ = gq_ + pk.to(lse.dtype) * (w[..., None] * gs)
            _, _, extra = _BWD(_q_view(gq, g), qg, kg, kg, torch.zeros_like(og), lg, 0.0, g.causal,
                               attn_mask=add, scale=p.scale)  # its dV: Pᵀ·(g·q·scale)
            gk_ = gk_ + extra
        _rows(dq, g).add_(_from_batch(gq_, B, g.n))  # [B, H, n, rows, d]
        _add_keys(dk, gk_, g, B)
        _add_keys(dv, gv_, g, B)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _split(call: Call, B: int, most: int):
    """A call as calls of at most ``most`` query blocks each: (group, attn_mask) (the backward's
    dk, dv per block are [B·n, Hkv, L, x]: this bounds their memory)."""
    g, add, _ = call
    for j0 in range(0, g.n, most):
        j1 = min(g.n, j0 + most)
        part = add
        if add is not None and add.shape[0] > 1 and (j0, j1) != (0, g.n):  # one mask per block: [Bm·n, ...]
            part = add.unflatten(0, (add.shape[0] // g.n, g.n))[:, j0:j1].flatten(0, 1)  # [Bm, n, ...] -> [Bm·(j1-j0), ...]
        yield _sub(g, j0, j1), part


def _add_keys(acc: torch.Tensor, part: torch.Tensor, g: Group, B: int) -> None:
    """acc [B, Hkv, K, x] += the gradients of the group's key spans, part [B·n, Hkv, L, x]."""
    part = part.unflatten(0, (B, g.n)).transpose(1, 2)  # [B, Hkv, n, L, x] (a view)
    if g.n == 1 or g.kstep == 0:  # every block's span is the same keys
        acc[:, :, g.k0:g.k0 + g.L] += part.sum(dim=2)
    elif g.L % g.kstep == 0:  # blocks r, r + L/kstep, … cover disjoint, adjacent spans: added as one view each
        every = g.L // g.kstep
        for r in range(min(every, g.n)):
            blocks = part[:, :, r::every]  # [B, Hkv, m, L, x]
            m = blocks.shape[2]
            start = g.k0 + r * g.kstep
            acc[:, :, start:start + m * g.L] += blocks.flatten(2, 3)  # [B, Hkv, m·L, x]
    else:
        acc.index_add_(2, _k_index(g).to(acc.device), part.flatten(2, 3).to(acc.dtype))  # [B, Hkv, n·L, x]


class _SpanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: Problem, plan: Plan, q, k, v, sinks):
        calls = list(_calls(p, plan))
        out, lse = _forward(p, plan, q, k, v, calls)
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)  # sinks join once, after every span is merged
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.p, ctx.plan, ctx.calls = p, plan, (_kept(calls) if plan.backward is None else None)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _backward(ctx.p, ctx.plan.backward or ctx.plan, q, k, v, out, lse, grad_out, grad_lse, ctx.calls)
        dsinks = sinks_grad(sinks, out, lse, grad_out, grad_lse) if sinks is not None and ctx.needs_input_grad[5] else None
        return None, None, dq, dk, dv, dsinks


def run(p: Problem, need_lse: bool = False, plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry: out [B, H, Q, dv] and lse [B, H, Q] (float32; float64 for float64 inputs),
    differentiable in q, k, v, sinks (and through lse)."""
    plan = plan if plan is not None else plan_for(p)
    if plan.by_heads:
        return _run_by_heads(p, plan)
    q, k, v = p.q, p.k, p.v
    d, dv = q.shape[-1], v.shape[-1]
    if d < dv:  # one head size for the kernel: zero columns in q and k change no score
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))  # [.., d] -> [.., dv]
    elif dv < d:
        v = F.pad(v, (0, d - dv))  # [.., dv] -> [.., d]; the extra output columns are 0
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel reads head columns as stride 1
    inputs = (q, k, v) + ((p.sinks,) if p.sinks is not None else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out, lse = _SpanAttention.apply(p, plan, q, k, v, p.sinks)
    else:
        out, lse = _forward(p, plan, q, k, v)
        if p.sinks is not None:
            out, lse = with_sinks(out, lse, p.sinks)
    if dv < d:
        out = out[..., :dv]
    return out, lse


def _run_by_heads(p: Problem, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of heads as a call of its own, the results put back in head order."""
    outs, lses = zip(*(run(on_heads(p, g.heads, g.mask), True, g.plan) for g in plan.by_heads))
    order = torch.tensor([h for g in plan.by_heads for h in g.heads], device=p.q.device)
    back = torch.argsort(order)  # the position of head h among the groups' heads
    out = torch.cat(outs, dim=1).index_select(1, back)  # [B, h0 + h1 + …, Q, dv] -> [B, H, Q, dv]
    lse = torch.cat(lses, dim=1).index_select(1, back)  # [B, H, Q]
    return out, lse


__all__ = ["Group", "HeadGroup", "Plan", "hands_off", "plan_for", "plan_key", "run", "share", "why_not"]
