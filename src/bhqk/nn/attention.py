"""MultiHeadAttention: parameters around the pure ``attention`` function.

X [B, Q, D] → W_Q, W_K, W_V → split heads [B, H, N, d] → attention → merge [B, Q, H·dv] → W_O → [B, Q, D].
Self-attention when ``key`` is None; cross-attention (Q ≠ K) with ``key``/``value`` from a context.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from .. import observe
from ..errors import ShapeError, warn_misuse
from ..functional import attention, attention_weights
from ..shapes import Sizes
from .cache import AttendingLayer, KVCache
from .heads import merge_heads, split_heads


def _size(name: str, value: object, what: str) -> int:
    """A module size: a whole number >= 1 (never a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ShapeError(f"{name} ({what}) must be an integer >= 1, got {value!r}.")
    return int(value)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with H query heads and Hkv key/value heads (GQA when Hkv < H).

    ``head_dim`` defaults to ``d_model // num_heads`` (D = H·d); ``kdim``/``vdim`` are the widths of
    the key and value inputs for cross-attention (default ``d_model``). Every size is an integer >= 1.
    Inputs must have the parameters' dtype and device: no silent cast (a ShapeError names the input and
    both dtypes), except under ``torch.autocast``.
    """

    d_model: int  # D
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # d
    kdim: int  # Dk
    vdim: int  # Dv
    dropout: float
    backend: str
    sequence_first_source: bool
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Linear
    sinks: nn.Parameter | None  # [H]

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
        sinks: bool = False,
    ) -> None:
        super().__init__()
        d_model = _size("d_model", d_model, "D, the model width")
        num_heads = _size("num_heads", num_heads, "H, query heads")
        num_kv_heads = num_heads if num_kv_heads is None else _size("num_kv_heads", num_kv_heads, "Hkv, key/value heads")
        kdim = None if kdim is None else _size("kdim", kdim, "the width of the key input")
        vdim = None if vdim is None else _size("vdim", vdim, "the width of the value input")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}.")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}.")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name such as 'auto', got {backend!r}.")
        if head_dim is None:
            if d_model % num_heads:
                raise ShapeError(
                    f"D={d_model} is not divisible by H={num_heads}; D = H·d needs a whole head dimension d "
                    f"(or pass head_dim= explicitly)."
                )
            head_dim = d_model // num_heads
        head_dim = _size("head_dim", head_dim, "d, the head dimension")
        if num_heads % num_kv_heads:
            raise ShapeError(f"H={num_heads} is not divisible by Hkv={num_kv_heads}; "
                             "each key/value head serves H/Hkv query heads.")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.kdim = d_model if kdim is None else kdim
        self.vdim = self.kdim if vdim is None else vdim
        self.dropout, self.backend = float(dropout), backend
        self.sequence_first_source = False  # set by from_torch: the source module took [N, B, D]
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)  # D -> H·d
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * head_dim, bias=bias)  # Dk -> Hkv·d
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * head_dim, bias=bias)  # Dv -> Hkv·dv
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)  # H·dv -> D
        # sinks=True: a learned logit per query head in each row's softmax denominator (GPT-OSS), zeros at init
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # [H]

    def check_inputs(self, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Sizes:
        """Bind B, Q, K and the widths; the inputs need the parameters' dtype and device (no silent cast)."""
        sizes = Sizes(D=self.d_model, Dk=self.kdim, Dv=self.vdim)
        for arg, t in (("x", x), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{arg} must be a torch.Tensor [B, N, width], got {type(t).__name__}.")
        try:
            sizes.bind("x", x.shape, ("B", "Q", "D"))
            sizes.bind("key", key.shape, ("B", "K", "Dk"))
            sizes.bind("value", value.shape, ("B", "K", "Dv"))
        except ShapeError as e:
            if not self.sequence_first_source:
                raise
            raise ShapeError(f"{e}\nThis module came from a sequence-first nn.MultiheadAttention (batch_first=False); "
                             f"bhqk's module takes [B, N, D]: pass x.transpose(0, 1).") from None
        w = self.q_proj.weight
        for arg, t in (("x", x), ("key", key), ("value", value)):
            if t.dtype != w.dtype and not torch.is_autocast_enabled(t.device.type):  # autocast casts them itself
                raise sizes.fail(f"{arg} has dtype {t.dtype} but the module's parameters are {w.dtype}; convert the "
                                 f"input ({arg}.to({w.dtype})) or the module (module.to({t.dtype})).")
            if t.device != w.device:
                raise sizes.fail(f"{arg} is on {t.device} but the module's parameters are on {w.device}.")
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
        if isinstance(cache, KVCache) and len(cache) == 1:
            cache = cache[0]
        if getattr(cache, "attention", None) is not None:  # an AttendingLayer (a head-wise budget's) attends itself
            result = self._attend_in(cache, q, k, v, mask=mask, bias=bias, return_weights=return_weights,
                                     backend=backend)
        else:
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
            o = attention(q, k, v, mask, bias=bias, dropout_p=dropout_p, backend=backend, sinks=self.sinks)  # [B, H, Q, dv]
        out = self.out_proj(merge_heads(o))  # [B, Q, H·dv] -> [B, Q, D]
        if return_weights:
            return out, attention_weights(q, k, mask, bias=bias, sinks=self.sinks)  # [B, H, Q, K]
        return out

    def _attend_in(self, cache: AttendingLayer, q, k, v, *, mask, bias, return_weights, backend):
        """As :meth:`attend`, the cache layer storing k, v and attending over what it holds (``nn.cache.AttendingLayer``)."""
        dropout_p = self.dropout if self.training else 0.0
        backend = self.backend if backend is None else backend
        with observe.scope(self):
            o, w = cache.attention(q, k, v, mask, bias=bias, dropout_p=dropout_p, backend=backend, sinks=self.sinks,
                                   return_weights=return_weights)  # [B, H, Q, dv], [B, H, Q, K] or None
        out = self.out_proj(merge_heads(o))  # [B, Q, H·dv] -> [B, Q, D]
        return (out, w) if return_weights else out

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, *, backend: str = "auto",
                   batch_first: bool | None = None) -> MultiHeadAttention:
        """A copy of ``nn.MultiheadAttention``'s weights (packed or separate in_proj, either
        ``batch_first``). bhqk's module is always batch-first [B, N, D]: from a sequence-first
        module (``batch_first=False``, inputs [N, B, D]) a MisuseWarning says so, unless you pass
        ``batch_first=True`` to confirm that you will feed [B, N, D] (``x.transpose(0, 1)``)."""
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch: m must be a torch.nn.MultiheadAttention, got {type(m).__name__}.")
        if batch_first is not None and batch_first is not True:
            raise ValueError("from_torch: bhqk's module is always batch-first [B, N, D]; batch_first can only be True "
                             "(to confirm it) or None.")
        if not m.batch_first and batch_first is None:
            warn_misuse(
                "from_torch: the source nn.MultiheadAttention is sequence-first (batch_first=False, inputs [N, B, D]) "
                "but bhqk's MultiHeadAttention takes [B, N, D]: feed x.transpose(0, 1). Pass batch_first=True to "
                "from_torch to confirm and silence this warning."
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch: bias_k/bias_v and add_zero_attn have no bhqk equivalent.")
        E, H = m.embed_dim, m.num_heads
        has_bias = m.in_proj_bias is not None
        new = cls(E, H, kdim=m.kdim, vdim=m.vdim, bias=has_bias, dropout=m.dropout, backend=backend)
        new = new.to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
        new.sequence_first_source = not m.batch_first
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
