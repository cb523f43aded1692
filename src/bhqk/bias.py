"""Additive biases on the scores, a separate argument from the bool mask: ``S = S + bias``.

A bias is evaluated per tile like a mask, so fast paths never build [B, H, Q, K] for ALiBi.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .errors import MaskError
from .masks.args import count
from .masks.base import Extent, causal_offset, staged_copy
from .shapes import Sizes, as_4d, check_broadcast, tile_of


def _finite_floor(t: torch.Tensor) -> float:
    """The smallest finite value of a bias tensor (0.0 if it has none); NaN or +inf is a MaskError.
    -inf is allowed (a position that may not be attended); a huge finite negative value (Hugging
    Face's ``torch.finfo(dtype).min`` padding) is a number, and backends that rescale scores or
    compute in a narrower dtype use ``floor`` to keep it finite."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t.detach())
    if bool(torch.isnan(hi)) or bool(torch.isnan(lo)) or float(hi) == math.inf:
        what = "NaN" if bool(torch.isnan(t).any()) else "+inf"
        raise MaskError(f"bias holds {what}; a bias must be finite or -inf (-inf, or a bool mask, for positions "
                        f"that may not be attended).")
    if float(lo) == -math.inf:
        lo = t.detach().masked_fill(t == -math.inf, 0.0).amin()  # the smallest finite value
    return min(0.0, float(lo))


class Bias:
    """Base of every bias: :meth:`block` gives a float tile broadcastable to [B, H, q, k]."""

    floor = 0.0  # a lower bound of its finite values where they may be huge (see Dense), else 0

    def check(self, ext: Extent) -> None:
        """Raise MaskError if this bias cannot live in ``ext``."""

    def block(self, ext: Extent, q0: int, q1: int, k0: int, k1: int, device=None, dtype=torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def materialize(self, B: int, H: int, Q: int, K: int, device=None, dtype=torch.float32) -> torch.Tensor:
        ext = Extent(B, H, Q, K)
        self.check(ext)
        return as_4d(self.block(ext, 0, Q, 0, K, device, dtype))  # [#B, #H, #Q, #K]

    def staged(self, device: torch.device) -> Bias:
        """This bias with its public tensors, and its parts', on ``device`` (``masks.base.staged_copy``)."""
        return staged_copy(self, device)

    def __add__(self, other: Bias | torch.Tensor | None) -> Bias:
        other_ = as_bias(other)
        return self if other_ is None else Sum(self, other_)


class Sum(Bias):
    def __init__(self, a: Bias, b: Bias) -> None:
        self.a, self.b = a, b

    def check(self, ext):
        self.a.check(ext)
        self.b.check(ext)

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        return self.a.block(ext, q0, q1, k0, k1, device, dtype) + self.b.block(ext, q0, q1, k0, k1, device, dtype)

    @property
    def floor(self) -> float:  # type: ignore[override]
        return self.a.floor + self.b.floor

    def __repr__(self) -> str:
        return f"({self.a!r} + {self.b!r})"


class Dense(Bias):
    """A float tensor broadcastable to [B, H, Q, K]."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            is_bool = isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool
            hint = " A bool tensor is a mask: pass it as mask=." if is_bool else ""
            raise MaskError(f"bias must be a floating-point tensor, got {got}.{hint}")
        if tensor.dim() > 4:
            raise MaskError(f"bias has {tensor.dim()} axes {list(tensor.shape)}; it must broadcast to [B, H, Q, K].")
        self.floor = _finite_floor(tensor)
        self.tensor = as_4d(tensor)  # [#B, #H, #Q, #K]

    def check(self, ext):
        check_broadcast("bias", self.tensor.shape, Sizes(B=ext.B, H=ext.H, Q=ext.Q, K=ext.K), MaskError)

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        return tile_of(self.tensor, q0, q1, k0, k1).to(device=device, dtype=dtype)  # [#B, #H, #q, #k]

    def __repr__(self) -> str:
        return f"bias.dense(<{list(self.tensor.shape)}>)"


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi head slopes (Press et al.): a geometric sequence from 2^(-8/n) for a power of two n,
    with the interleaved extra slopes of the reference implementation otherwise."""
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if num_heads <= 0:
        raise MaskError(f"alibi needs num_heads >= 1, got {num_heads}.")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(Bias):
    """``bias[h, i, j] = -slope[h] · |pos(i) − j|``; under a causal mask this equals the usual
    ``slope · (j − i)`` and, up to a per-row constant that softmax ignores, BLOOM's ``slope · j``."""

    def __init__(self, num_heads: int, align: str | None = None) -> None:
        self.slopes = alibi_slopes(num_heads)
        self.num_heads, self.align = num_heads, align

    def check(self, ext):
        if ext.H != self.num_heads:
            raise MaskError(f"alibi was built for {self.num_heads} heads but H={ext.H}.")
        causal_offset(self.align, ext.Q, ext.K, "alibi")

    def block(self, ext, q0, q1, k0, k1, device=None, dtype=torch.float32):
        off = causal_offset(self.align, ext.Q, ext.K, "alibi")
        qi = torch.arange(q0, q1, device=device)[:, None] + off  # [q, 1]
        ki = torch.arange(k0, k1, device=device)[None, :]  # [1, k]
        dist = (qi - ki).abs().to(dtype)  # [q, k]
        return -self.slopes.to(device=device, dtype=dtype)[:, None, None] * dist  # [H, q, k]

    def __repr__(self) -> str:
        return f"alibi({self.num_heads})"


def alibi(num_heads: int, align: str | None = None) -> ALiBi:
    """ALiBi linear biases with the standard slopes; ``align`` as for causal masks when Q ≠ K."""
    return ALiBi(num_heads, align)


def dense(tensor: torch.Tensor) -> Dense:
    """Any float tensor broadcastable to [B, H, Q, K], added to the scores."""
    return Dense(tensor)


def clamp_finite(t: torch.Tensor, lowest: float) -> torch.Tensor:
    """``t`` with its finite values below ``lowest`` raised to it and -inf (a forbidden entry) kept:
    a finite bias stays finite however negative (docs/design.md §2, "Decided edges")."""
    return torch.where(t > float("-inf"), t.clamp(min=lowest), t)


def in_dtype(bias: Bias, dtype: torch.dtype, build: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
    """``build(dt)``, the bias (or a block of it) in ``dtype``: built in ``dtype`` where its finite
    floor fits, else in float32 and its finite values clamped to ``dtype``'s lowest (a float32
    ``finfo.min`` padding bias with bf16 inputs), never -inf."""
    lowest = torch.finfo(dtype).min
    if bias.floor >= lowest:
        return build(dtype)
    return clamp_finite(build(torch.float32), lowest).to(dtype)


def dense_parts(bias: Bias | None) -> list[Dense]:
    """The tensor-backed parts of a bias (itself, or the terms of a sum): those that can need a gradient."""
    if isinstance(bias, Dense):
        return [bias]
    if isinstance(bias, Sum):
        return dense_parts(bias.a) + dense_parts(bias.b)
    return []


def from_torch_mha(attn_mask: torch.Tensor, *, num_heads: int) -> Dense:
    """A float ``nn.MultiheadAttention`` attn_mask ([Q, K] or [B·H, Q, K]) as an additive bias
    (a bool attn_mask is a mask: ``bhqk.masks.from_torch_mha``)."""
    num_heads = count("bias.from_torch_mha", "num_heads", num_heads, minimum=1)
    if not isinstance(attn_mask, torch.Tensor) or not attn_mask.is_floating_point():
        got = f"dtype {attn_mask.dtype}" if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise MaskError(f"bias.from_torch_mha: attn_mask must be a float tensor [Q, K] or [B·H, Q, K] (added to the "
                        f"scores), got {got}; a bool attn_mask is a mask: use bhqk.masks.from_torch_mha.")
    if attn_mask.dim() == 3:
        bh, Q, K = attn_mask.shape
        if bh % num_heads:
            raise MaskError(f"bias.from_torch_mha: attn_mask's first axis {bh} is not B·H with H={num_heads}.")
        attn_mask = attn_mask.reshape(bh // num_heads, num_heads, Q, K)  # [B·H, Q, K] -> [B, H, Q, K]
    elif attn_mask.dim() != 2:
        raise MaskError(f"bias.from_torch_mha: attn_mask must be [Q, K] or [B·H, Q, K], got shape {list(attn_mask.shape)}.")
    return Dense(attn_mask)


def as_bias(bias: Bias | torch.Tensor | None) -> Bias | None:
    """Accept a bhqk bias, a float tensor (wrapped by ``dense``) or None."""
    if bias is None or isinstance(bias, Bias):
        return bias
    return Dense(bias)
