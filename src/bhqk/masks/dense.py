"""A mask given as a bool tensor broadcastable to [B, H, Q, K] (True = may attend)."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator

import torch

from ..errors import MaskError, warn_misuse
from ..shapes import Sizes, as_4d, check_broadcast, tile_of
from ..shortcuts import Store, declare
from .base import Extent, Mask, Tile


class Dense(Mask):
    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise MaskError(f"mask must be a bool tensor or a bhqk.masks mask, got {type(tensor).__name__}.")
        if tensor.dtype != torch.bool:
            hint = (
                " A float tensor is an additive bias: pass it as bias= (bhqk.bias.dense), not as mask."
                if tensor.is_floating_point()
                else " Convert 0/1 masks with .bool() (True = may attend), or use bhqk.masks.from_hf."
            )
            raise MaskError(f"mask must have dtype torch.bool (True = may attend), got {tensor.dtype}.{hint}")
        if tensor.dim() > 4:
            raise MaskError(f"mask has {tensor.dim()} axes {list(tensor.shape)}; it must broadcast to [B, H, Q, K].")
        self.tensor = as_4d(tensor)  # [#B, #H, #Q, #K]
        self._source = tensor  # as the caller passed it: its in-place version counter keys the grid cache

    @property
    def _grids(self) -> dict:
        """classify_grid's results per extent and grid, shared by every Dense on this tensor and
        valid while it is unchanged: an in-place write starts a new cache, as it must. An inference
        tensor has no version counter: its results are kept on this ``Dense`` alone (a new one wraps
        the tensor at each call)."""
        if self._source.is_inference():
            return self.__dict__.setdefault("_inference_grids", {})
        return _grids_of(self._source)

    @property
    def head_dependent(self) -> bool:  # type: ignore[override]
        return self.tensor.shape[1] != 1

    @property
    def looks_inverted(self) -> bool:  # type: ignore[override]
        """Looked at once per mask (``as_mask`` warns for the call's mask): see :func:`inverted_look`."""
        if "_inverted" not in self.__dict__:
            self._inverted = inverted_look(self.tensor)
        return self._inverted

    def select_heads(self, heads: list[int], H: int) -> Mask | None:
        if not self.head_dependent:
            return self
        return Dense(self.tensor[:, heads])  # [#B, H, #Q, #K] -> [#B, h, #Q, #K]

    def check(self, ext: Extent) -> None:
        check_broadcast("mask", self.tensor.shape, Sizes(B=ext.B, H=ext.H, Q=ext.Q, K=ext.K), MaskError)

    def block(self, ext, q0, q1, k0, k1, device=None):
        t = tile_of(self.tensor, q0, q1, k0, k1)  # [#B, #H, #q, #k]
        return t if device is None else t.to(device)

    def classify_grid(self, ext: Extent, block_q: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(empty, full): bool [⌈Q/block_q⌉, ⌈K/block_k⌉], every tile of the grid at once (see
        :meth:`grid_codes`)."""
        codes = self.grid_codes(ext, block_q, block_k)  # [nq, nk]
        return codes == 0, codes == 1

    def grid_codes(self, ext: Extent, block_q: int, block_k: int) -> torch.Tensor:
        """Every tile of the ``block_q × block_k`` grid at once: int8 [⌈Q/block_q⌉, ⌈K/block_k⌉] of
        ``GRID_CODES`` (0 empty, 1 full, 2 partial), over every batch element and head; the last
        row/column of tiles may be smaller. One pass over the tensor (row blocks of ``gcd(block_q,
        16)``, kept), then reductions of small tensors; cached per grid on this mask, so the tile
        planner's candidate grids, a forward and its backward, and ``block_mask`` share the work."""
        key = (ext.Q, ext.K, block_q, block_k)
        if ext.Q == 0 or ext.K == 0:
            return torch.zeros(-(-ext.Q // block_q), -(-ext.K // block_k), dtype=torch.int8)
        grids = self._grids if GRIDS.on else {}
        if key in grids:
            GRIDS.hits += 1
        else:
            with _one_thread():
                grids[key] = self._classify_grid(ext, block_q, block_k)
        return grids[key]

    def _classify_grid(self, ext: Extent, block_q: int, block_k: int) -> torch.Tensor:
        base = math.gcd(block_q, 16)
        hi, lo = self._row_blocks(base)  # [#K, ⌈Q/base⌉ | 1]: max and min per key and row block
        if hi.shape[0] != 1:
            hi, lo = _blocks(hi, 0, block_k, torch.amax), _blocks(lo, 0, block_k, torch.amin)  # [nk, #nq']
        if hi.shape[1] != 1 and block_q != base:
            hi, lo = _blocks(hi, 1, block_q // base, torch.amax), _blocks(lo, 1, block_q // base, torch.amin)  # [#nk, nq]
        codes = torch.full(hi.shape, 2, dtype=torch.int8, device=hi.device)  # partial
        codes[lo == 1] = 1  # full: every entry True
        codes[hi == 0] = 0  # empty: no entry True
        nq, nk = -(-ext.Q // block_q), -(-ext.K // block_k)
        return codes.cpu().t().expand(nq, nk)  # [#nk, #nq] -> [nq, nk]

    def _row_blocks(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Max and min of the mask (as uint8) over B, H and each ``rows`` query rows, transposed
        (later reductions then run along the outer axis, the fast one): [#K, ⌈Q/rows⌉ | 1] each;
        cached per ``rows``."""
        key = ("rows", rows)
        grids = self._grids if GRIDS.on else {}
        if key not in grids:
            t = self.tensor.detach().view(torch.uint8)  # [#B, #H, #Q, #K], 0/1 bytes
            if t.shape[0] * t.shape[1] == 1:
                hi = lo = t[0, 0]  # [#Q, #K]
            else:
                hi, lo = t.amax(dim=(0, 1)), t.amin(dim=(0, 1))  # [#Q, #K]: any / all over batch and heads
            if hi.shape[0] != 1:
                hi, lo = _blocks(hi, 0, rows, torch.amax), _blocks(lo, 0, rows, torch.amin)  # [⌈Q/rows⌉, #K]
            grids[key] = hi.t().contiguous(), lo.t().contiguous()  # [#K, ⌈Q/rows⌉ | 1]
        return grids[key]

    def natural_size(self):
        return (self.tensor.shape[2], self.tensor.shape[3])

    def __repr__(self) -> str:
        return f"dense(<bool {list(self.tensor.shape)}>)"


def inverted_look(t: torch.Tensor) -> bool:
    """A self-attention mask [#B, #H, N, N] that forbids every query its own key and allows some later
    key is, almost surely, ``nn.MultiheadAttention``'s polarity (True = masked out)."""
    n = t.shape[-1]
    if n < 2 or t.shape[-2] != n or bool(t.diagonal(dim1=-2, dim2=-1).any()):
        return False
    return bool(torch.triu(t, diagonal=1).any())  # [#B, #H, N, N]: some query may attend a later key


def warn_if_inverted(mask: Mask) -> None:
    """Warn (once, where a call's mask is made: ``as_mask``) when ``mask`` holds a tensor in
    ``nn.MultiheadAttention`` polarity outside any ``~`` (:attr:`Mask.looks_inverted`)."""
    if mask.looks_inverted:
        warn_misuse(
            "mask forbids every query its own position and allows later keys: this looks like a mask in "
            "nn.MultiheadAttention polarity (True = masked out). bhqk masks use True = may attend: convert "
            "with bhqk.masks.from_torch_mha(attn_mask=..., num_heads=H), invert with ~mask, or use "
            "bhqk.masks.causal()."
        )


_SHARED: dict[int, tuple[weakref.ref, int, dict]] = {}  # id(tensor) -> (tensor, its version, grids)
GRIDS = declare(Store(
    "dense mask grids", "classifying a dense mask's tiles again (one pass over its [B, H, Q, K] tensor) for each "
    "candidate grid, the backward, a later call and FlexAttention's block mask", "the tensor (by identity, held "
    "weakly) and its in-place version; (Q, K, block_q, block_k) per grid; an inference tensor's on its Dense alone",
    "one version per tensor (its grids, and the plan caches' store for it); gone with the tensor",
    "an in-place write into the tensor (a new version starts a new store)", _SHARED))


def _grids_of(tensor: torch.Tensor) -> dict:
    """The grid classifications of ``tensor``, shared by every ``Dense`` built on the same tensor
    while it is unchanged (its in-place version counter): a model hands the same mask tensor to
    every layer, and a new ``Dense`` wraps it at each call."""
    entry = _SHARED.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
        return entry[2]
    if entry is None or entry[0]() is not tensor:
        weakref.finalize(tensor, _SHARED.pop, id(tensor), None)
    grids: dict = {}
    _SHARED[id(tensor)] = (weakref.ref(tensor), tensor._version, grids)
    return grids


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Small reductions run single-threaded: with intra-op threads they waited at barriers for
    descheduled threads on the shared 2-core machines (0.02 ms alone, 20-35 ms with two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


GRID_CODES = {0: Tile.EMPTY, 1: Tile.FULL, 2: Tile.PARTIAL}  # classify_grid's int8 codes


def _blocks(x: torch.Tensor, dim: int, size: int, reduce) -> torch.Tensor:
    """``reduce`` (torch.amax / amin) over consecutive runs of ``size`` along ``dim``; the last run
    may be shorter: [.., n, ..] -> [.., ⌈n/size⌉, ..]."""
    n = x.shape[dim]
    whole = n // size * size
    parts = []
    if whole:
        parts.append(reduce(x.narrow(dim, 0, whole).unflatten(dim, (n // size, size)), dim=dim + 1))  # [.., n//size, ..]
    if whole < n:
        parts.append(reduce(x.narrow(dim, whole, n - whole), dim=dim, keepdim=True))  # the shorter last run
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def dense(tensor: torch.Tensor) -> Dense:
    """A bool tensor that broadcasts to [B, H, Q, K]; True = may attend."""
    return Dense(tensor)
