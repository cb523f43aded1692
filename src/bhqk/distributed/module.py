"""RingMultiHeadAttention: ``bhqk.MultiHeadAttention`` for a sequence sharded across ranks.

Projections are per token, so each rank applies them to its own tokens; only attention crosses
ranks (:func:`~bhqk.distributed.ring_attention`). Parameters are ordinary and replicated: wrap the
model in DDP (or all-reduce the gradients) as for data parallelism.
"""

from __future__ import annotations

from ..nn import MultiHeadAttention, merge_heads
from .ring import ring_attention
from .shard import SCHEMES


class RingMultiHeadAttention(MultiHeadAttention):
    """Multi-head attention over this rank's shard x [B, N/P, D] of a sequence split over ``group``.

    Takes MultiHeadAttention's arguments plus ``group`` (default: the world), ``sharding`` (how x
    was cut: ``"zigzag"``, ``"striped"``, ``"contiguous"``) and ``kv_chunk``. Masks are in global
    positions. No dropout, bias or returned weights (they would need the whole [B, H, Q, K]).
    """

    def __init__(self, d_model: int, num_heads: int, *, group=None, sharding: str = "zigzag",
                 kv_chunk: int | None = None, **kwargs) -> None:
        super().__init__(d_model, num_heads, **kwargs)
        if self.dropout:
            raise ValueError(f"RingMultiHeadAttention has no attention dropout, got dropout={self.dropout}; pass 0.")
        if sharding not in SCHEMES:
            raise ValueError(f"sharding must be one of {SCHEMES}, got {sharding!r}.")
        self.group, self.sharding, self.kv_chunk = group, sharding, kv_chunk

    @classmethod
    def from_module(cls, m: MultiHeadAttention, *, group=None, sharding: str = "zigzag",
                    kv_chunk: int | None = None) -> RingMultiHeadAttention:
        """A ring copy of ``m`` (same sizes, same weights)."""
        new = cls(m.d_model, m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, kdim=m.kdim, vdim=m.vdim,
                  bias=m.q_proj.bias is not None, group=group, sharding=sharding, kv_chunk=kv_chunk,
                  sinks=getattr(m, "sinks", None) is not None)
        new = new.to(device=m.q_proj.weight.device, dtype=m.q_proj.weight.dtype)
        new.load_state_dict(m.state_dict())
        return new

    def forward(self, x, key=None, value=None, *, cache=None, **kwargs):
        """x [B, N/P, D] (this rank's tokens; key/value: its shard of the context) → [B, N/P, D]."""
        if cache is not None:
            raise ValueError("RingMultiHeadAttention takes no KV cache: each rank holds only its shard of the keys.")
        return super().forward(x, key, value, **kwargs)

    def attend(self, q, k, v, *, mask=None, bias=None, return_weights=False, backend=None):
        """Heads of this rank's tokens in, model width out: ring attention [B, H, Q/P, dv] → [B, Q/P, D]."""
        if bias is not None:
            raise ValueError("RingMultiHeadAttention takes no additive bias (ring attention has none yet).")
        if return_weights:
            raise ValueError("RingMultiHeadAttention cannot return weights: they span every rank's keys "
                             "([B, H, Q, K]); gather q and k and call bhqk.attention_weights instead.")
        if backend is not None:
            raise ValueError(f"RingMultiHeadAttention always runs ring attention; backend={backend!r} does not apply.")
        o = ring_attention(q, k, v, mask, group=self.group, sharding=self.sharding, kv_chunk=self.kv_chunk,
                           sinks=self.sinks)  # [B, H, Q/P, dv]
        return self.out_proj(merge_heads(o))  # [B, Q/P, H·dv] -> [B, Q/P, D]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sharding={self.sharding!r}"
