"""Key padding: batch element b may attend to its first ``lengths[b]`` keys (or where a bool [B, K] says).

``padding(torch.tensor([3, 5]))`` at Q=2, K=5, batch 0::

    ■ ■ ■ · ·
    ■ ■ ■ · ·
"""

from __future__ import annotations

import torch

from ..errors import MaskError
from . import args
from .base import Arithmetic, Extent, positions, scalar


class KeysBelow(Arithmetic):
    """Key j is visible to batch element b when ``j < limit[b]`` (an int applies to every element)."""

    head_dependent = False

    def __init__(self, limit: int | list[int] | torch.Tensor, name: str = "padding", arg: str = "lengths") -> None:
        self.name, self.arg = name, arg
        limit = args.lengths(name, arg, limit)  # an int, or int64 [B]
        if isinstance(limit, torch.Tensor):
            limit = limit.clone()  # a value: lo and hi summarize it, so a write into the caller's tensor must not reach it
        self.limit = limit
        values = limit.tolist() if isinstance(limit, torch.Tensor) else [limit]
        self.lo, self.hi = min(values), max(values)  # for tile classification across the batch

    def check(self, ext: Extent) -> None:
        if isinstance(self.limit, torch.Tensor) and self.limit.numel() not in (1, ext.B):
            raise MaskError(f"{self.name}: {self.arg} has {self.limit.numel()} entries but B={ext.B}; "
                            "give one length per batch element.")

    def block(self, ext, q0, q1, k0, k1, device=None):
        _, ki = positions(q0, q1, k0, k1, device)
        if isinstance(self.limit, torch.Tensor):
            lim = self.limit.to(device=ki.device)[:, None, None, None]  # [B, 1, 1, 1]
            return (ki < lim).expand(-1, 1, q1 - q0, -1)  # [B, 1, q, k]
        return (ki < self.limit).expand(q1 - q0, -1)  # [q, k]

    def edges(self, ext, q0, q1, k0, k1):
        return k0 >= self.hi, k1 <= self.lo  # past every element's limit / below all of them

    def natural_size(self):
        return (4, max(self.hi, 1) + 2)

    def __repr__(self) -> str:
        lim = self.limit.tolist() if isinstance(self.limit, torch.Tensor) else self.limit
        return f"{self.name}({lim})"

    def mask_mod(self, B, H, Q, K, device=None):
        if isinstance(self.limit, torch.Tensor):
            lim = self.limit.to(device=device, dtype=torch.long).reshape(-1).expand(B).contiguous()  # [B]
            return lambda b, h, q_idx, kv_idx: kv_idx < lim[b]
        lim = scalar(self.limit, device)
        return lambda b, h, q_idx, kv_idx: kv_idx < lim


def padding(lengths: int | list[int] | torch.Tensor) -> KeysBelow:
    """Per-batch valid key lengths ``[B]`` (an integer tensor or a list of ints; one int for the
    whole batch): batch element b attends to keys ``0 … lengths[b]-1``."""
    return KeysBelow(lengths, "padding")


class KeyPadding(Arithmetic):
    """A bool ``[B, K]`` with True = a real key that may be attended."""

    head_dependent = False

    def __init__(self, valid: torch.Tensor) -> None:
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
            got = f"dtype {valid.dtype} shape {list(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
            hint = " For Hugging Face's 1/0 attention_mask use bhqk.masks.from_hf." if isinstance(valid, torch.Tensor) else ""
            raise MaskError(f"key_padding: valid must be a bool tensor [B, K] (True = real key), got {got}.{hint}")
        self.valid = valid = valid.clone()  # a value: _all and _any summarize it (a write into the caller's must not reach it)
        zero = valid.new_zeros(1, dtype=torch.long)
        self._all = torch.cat([zero, valid.all(0).long().cumsum(0).cpu()])  # keys valid everywhere
        self._any = torch.cat([zero, valid.any(0).long().cumsum(0).cpu()])  # keys valid somewhere

    def check(self, ext: Extent) -> None:
        B, K = self.valid.shape
        if B not in (1, ext.B):
            raise MaskError(f"key_padding has B={B} but B={ext.B}; it must be [B, K].")
        if K != ext.K:
            raise MaskError(f"key_padding has K={K} but the keys have K={ext.K}; it must be [B, K].")

    def block(self, ext, q0, q1, k0, k1, device=None):
        v = self.valid[:, k0:k1]
        if device is not None:
            v = v.to(device)
        return v[:, None, None, :].expand(-1, 1, q1 - q0, -1)  # [B, 1, q, k]

    def edges(self, ext, q0, q1, k0, k1):
        # no key valid anywhere in k0:k1 / every key valid everywhere (the counts are prefix sums)
        return self._any[k1] - self._any[k0] == 0, self._all[k1] - self._all[k0] == k1 - k0

    def natural_size(self):
        return (4, self.valid.shape[1])

    def __repr__(self) -> str:
        return f"key_padding(<bool {list(self.valid.shape)}>)"

    def mask_mod(self, B, H, Q, K, device=None):
        valid = self.valid.to(device).expand(B, -1).contiguous()  # [B, K]
        return lambda b, h, q_idx, kv_idx: valid[b, kv_idx]


def key_padding(valid: torch.Tensor) -> KeyPadding:
    """Bool ``[B, K]``, True = a real key (Hugging Face's attention_mask polarity)."""
    return KeyPadding(valid)
