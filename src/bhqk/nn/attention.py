"""MultiHeadAttention: parameters around the pure ``attention`` function.

X [B, Q, D] → W_Q, W_K, W_V → split heads [B, H, N, d] → attention → merge [B, Q, H·dv] → W_O → [B, Q, D].
Self-attention when ``key`` is None; cross-attention (Q ≠ K) with ``key``/``value`` from a context.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import observe
from ..errors import ShapeError
from ..functional import attention, attention_weights
from ..shapes import Sizes
from .heads import merge_heads, split_heads


class MultiHeadAttention(nn.Module):
    """Multi-head attention with H query heads and Hkv key/value heads (GQA when Hkv < H).

    ``head_dim`` defaults to ``d_model // num_heads`` (D = H·d); ``kdim``/``vdim`` are the widths of
    the key and value inputs for cross-attention (default ``d_model``).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0:
            raise ShapeError(f"num_heads and num_kv_heads must be >= 1, got H={num_heads}, Hkv={num_kv_heads}.")
        if head_dim is None:
            if d_model % num_heads:
                raise ShapeError(
                    f"D={d_model} is not divisible by H={num_heads}; D = H·d needs a whole head dimension d "
                    f"(or pass head_dim= explicitly)."
                )
            head_dim = d_model // num_heads
        if num_heads % num_kv_heads:
            raise ShapeError(f"H={num_heads} is not divisible by Hkv={num_kv_heads}; each key/value head serves H/Hkv query heads.")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.kdim = d_model if kdim is None else kdim
        self.vdim = self.kdim if vdim is None else vdim
        self.dropout, self.backend = dropout, backend
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)  # D -> H·d
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * head_dim, bias=bias)  # Dk -> Hkv·d
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * head_dim, bias=bias)  # Dv -> Hkv·dv
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)  # H·dv -> D

    def check_inputs(self, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Sizes:
        sizes = Sizes(D=self.d_model, Dk=self.kdim, Dv=self.vdim)
        sizes.bind("x", x.shape, ("B", "Q", "D"))
        sizes.bind("key", key.shape, ("B", "K", "Dk"))
        sizes.bind("value", value.shape, ("B", "K", "Dv"))
        return sizes

    def forward(
        self,
        x: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask=None,
        bias=None,
        return_weights: bool = False,
        cache=None,
        backend: str | None = None,
    ):
        """x [B, Q, D]; key [B, K, kdim], value [B, K, vdim] (value defaults to key) → [B, Q, D],
        or ``(out, weights [B, H, Q, K])`` with ``return_weights=True`` (weights before dropout).

        ``cache``: a ``KVCache`` layer (``kv[i]``, or a one-layer ``KVCache``), self-attention only.
        This call's keys and values are appended to it in place and the Q new queries attend to
        all K it returns, themselves last: mask with ``causal(align="bottom_right")`` and give
        masks/biases for [Q, K]. ``backend`` overrides the module's backend for this call."""
        if cache is not None and key is not None:
            raise ValueError("cache= is for self-attention: the cached keys and values are projections of x; "
                             "for cross-attention project the context once and call attend().")
        key = x if key is None else key
        value = key if value is None else value
        self.check_inputs(x, key, value)
        q = split_heads(self.q_proj(x), self.num_heads, "q_proj(x)")  # [B, H, Q, d]
        k = split_heads(self.k_proj(key), self.num_kv_heads, "k_proj(key)")  # [B, Hkv, K, d]
        v = split_heads(self.v_proj(value), self.num_kv_heads, "v_proj(value)")  # [B, Hkv, K, dv]
        if cache is not None:
            k, v = cache.update(k, v)  # [B, Hkv, K_past + Q, d], [B, Hkv, K_past + Q, dv]
        result = self.attend(q, k, v, mask=mask, bias=bias, return_weights=return_weights, backend=backend)
        if observe.active():
            out = result[0] if return_weights else result
            observe.emit("mha", module=self, x=x, q=q, k=k, v=v, out=out)
        return result

    def attend(self, q, k, v, *, mask=None, bias=None, return_weights=False, backend=None):
        """Heads in, model width out: attention [B, H, Q, dv] → merge [B, Q, H·dv] → W_O [B, Q, D]."""
        dropout_p = self.dropout if self.training else 0.0
        backend = self.backend if backend is None else backend
        with observe.scope(self):  # observers see this module as the caller
            o = attention(q, k, v, mask, bias=bias, dropout_p=dropout_p, backend=backend)  # [B, H, Q, dv]
        out = self.out_proj(merge_heads(o))  # [B, Q, H·dv] -> [B, Q, D]
        if return_weights:
            return out, attention_weights(q, k, mask, bias=bias)  # [B, H, Q, K]
        return out

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, *, backend: str = "auto") -> MultiHeadAttention:
        """A copy of ``nn.MultiheadAttention``'s weights (packed or separate in_proj, either
        ``batch_first``); bhqk's module is always batch-first [B, N, D]."""
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch: bias_k/bias_v and add_zero_attn have no bhqk equivalent.")
        E, H = m.embed_dim, m.num_heads
        has_bias = m.in_proj_bias is not None
        new = cls(E, H, kdim=m.kdim, vdim=m.vdim, bias=has_bias, dropout=m.dropout, backend=backend)
        new = new.to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                wq, wk, wv = m.in_proj_weight.chunk(3, dim=0)  # [3E, E] -> 3 × [E, E]
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            for lin, w in ((new.q_proj, wq), (new.k_proj, wk), (new.v_proj, wv)):
                lin.weight.copy_(w)
            if has_bias:
                for lin, b in zip((new.q_proj, new.k_proj, new.v_proj), m.in_proj_bias.chunk(3)):
                    lin.bias.copy_(b)
            new.out_proj.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None and has_bias:
                new.out_proj.bias.copy_(m.out_proj.bias)
        return new

    def extra_repr(self) -> str:
        return (f"D={self.d_model}, H={self.num_heads}, Hkv={self.num_kv_heads}, d={self.head_dim}, "
                f"kdim={self.kdim}, vdim={self.vdim}, backend={self.backend!r}")
