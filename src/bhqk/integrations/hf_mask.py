"""The mask transformers' mask builders hand bhqk: :class:`HFMask`, a tensor to model code and a bhqk
mask to bhqk (``.structure``), and the recovery of that structure from transformers' ``mask_function``
(:func:`build_mask`, registered as the mask builder). See :mod:`bhqk.integrations.transformers`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import MaskError
from ..masks import KeysBelow, Mask, causal, dense, document, key_padding, predicate, sliding_window

ROW_BLOCK_ENTRIES = 1 << 22  # entries of transformers' mask evaluated at once while checking a structure


# ---- the mask as a tensor -----------------------------------------------------------------------


class HFMask(torch.Tensor):
    """A bhqk mask inside a Hugging Face model. bhqk's attention function reads ``structure``; to
    everything else it is a tensor: the one transformers' ``eager_mask`` returns for the same call,
    float [B, 1, Q, K] (0 = attend, ``finfo(dtype).min`` = masked; eager is the implementation every
    model's code supports), built on first use and kept.

    A wrapper subclass without storage: ``shape``, ``dtype``, ``device`` and ``ndim`` answer without
    building; any torch op on it (indexing, ``!=``, ``masked_fill``, ``torch.cat`` …) builds the
    tensor and runs on it (``__torch_function__``, above autograd), and its result is a plain tensor
    (``detach`` gives an HFMask again). So a mask the model changed reaches the attention function as
    a plain tensor. An in-place op on the mask, or on a view of its tensor, bumps the tensor's
    version: the attention function then uses the tensor, not the stale structure."""

    _is_param = False  # torch.Tensor only annotates it (nn.Parameter's isinstance reads it): a value, so pdoc can place it

    structure: Mask
    _build: Callable[[], torch.Tensor]
    _tensor: torch.Tensor | None
    _built_version: int

    @staticmethod
    def __new__(cls, structure: Mask, shape: tuple[int, ...], dtype: torch.dtype, device, build: Callable[[], torch.Tensor]):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device(device),
                                                   requires_grad=False)
        self.structure, self._build, self._tensor, self._built_version = structure, build, None, 0
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:  # shape, dtype, device …: the wrapper answers, nothing is built
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.detach and not args[0].modified:
            return args[0].__deepcopy__({})  # detach() (checkpointing, hooks) keeps the mask a mask
        # every other op runs on the built tensor, above autograd: a view of it shares its version
        # counter, an in-place op bumps it, and the result is a plain tensor
        return func(*_unwrap(args), **_unwrap(kwargs))

    def tensor(self) -> torch.Tensor:
        """The tensor transformers would have passed (built once): float [B, 1, Q, K]."""
        if self._tensor is None:
            with torch.inference_mode(False):  # a normal tensor: its version counter tells in-place changes
                t = self._build()  # [B, 1, Q, K]
            if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
                raise MaskError(f"HFMask: built a {t.dtype} tensor of shape {list(t.shape)} for a mask declared "
                                f"{self.dtype} {list(self.shape)}.")
            self._tensor, self._built_version = t, t._version
        return self._tensor

    @property
    def modified(self) -> bool:
        """Whether the tensor was changed in place since it was built (the structure is stale then)."""
        return self._tensor is not None and self._tensor._version != self._built_version

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # ops that did not pass __torch_function__
        return func(*_unwrap(args), **_unwrap(kwargs or {}))

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]  # noqa: ARG002
        B, _, Q, K = self.shape
        return f"HFMask({self.structure!r}, [B={B}, 1, Q={Q}, K={K}], {self.dtype})"

    def __reduce_ex__(self, proto):
        return self.tensor().__reduce_ex__(proto)  # a pickle holds the plain tensor

    def __deepcopy__(self, memo):
        if self.modified:  # the tensor is the mask now
            return self.tensor().clone()
        return HFMask(self.structure, tuple(self.shape), self.dtype, self.device, self._build)

    def numpy(self, *, force: bool = False):
        return self.tensor().numpy(force=force)


def _unwrap(tree):
    """``tree`` with every HFMask replaced by its built tensor."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.tensor() if isinstance(x, HFMask) else x, tree)


_T = torch.Tensor
_METADATA = frozenset({  # answered by the wrapper itself, without building the tensor
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.layout.__get__,  # type: ignore[attr-defined]
    _T.requires_grad.__get__, _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_meta.__get__,  # type: ignore[attr-defined]
    _T.is_quantized.__get__, _T.size, _T.dim, _T.numel, _T.nelement,  # type: ignore[attr-defined]
    _T.element_size, _T.is_floating_point, _T.is_complex, _T.get_device, _T.__len__, _T.__hash__, _T.requires_grad_,
})


# ---- mask builder -------------------------------------------------------------------------------


class AllKeys(KeysBelow):
    """Every key visible (bidirectional attention without padding). Unlike ``None``, it tells the
    attention function that the builder ran and found nothing to mask: no ``is_causal`` fallback."""

    def __init__(self, K: int) -> None:
        super().__init__(K, "all_keys")

    def __repr__(self) -> str:
        return "all_keys()"


def _align(c: int, Q: int, K: int) -> str | None:
    """bhqk's name for "query i sits at key position i + c", or None where neither alignment is it."""
    if c == K - Q:
        return "bottom_right"
    if c == 0:
        return "top_left"
    return None


def _band(c: int, Q: int, K: int, left: int | None, right: int) -> Mask:
    """Key j visible from query i when ``i + c - left <= j <= i + c + right`` (``left=None``: no
    lower bound, i.e. causal for ``right=0``)."""
    align = _align(c, Q, K)
    if align is not None:
        return causal(align) if left is None and right == 0 else sliding_window(Q + K if left is None else left, right, align)

    def band(b, h, qi, ki):  # pure: the tiled backend calls it from its worker threads
        pos = qi + c  # query position in key coordinates
        ok = ki <= pos + right
        return ok if left is None else ok & (ki >= pos - left)

    return predicate(band, f"band(offset={c}, left={left}, right={right})")


def _evaluate(mask_function: Callable, B: int, q0: int, q1: int, K: int, q_offset: int, kv_offset: int,
              use_vmap: bool, device, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Transformers' mask function on rows q0:q1 (and the padding of ``attention_mask``, if given): bool [B, 1, q, K]."""
    from transformers.masking_utils import sdpa_mask

    full = sdpa_mask(batch_size=B, q_length=q1 - q0, kv_length=K, q_offset=q_offset + q0, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)  # [B, 1, q, K]
    assert full is not None  # sdpa_mask returns None only when a skip is allowed
    return full


def _matches(cands: list[Mask], evaluate, B: int, Q: int, K: int, first: torch.Tensor | None = None) -> Mask | None:
    """The first candidate equal to the evaluated mask on every entry (None if none is). ``first``
    [B, Q], if given, receives each row's first visible key (-1 for none)."""
    from ..masks import Extent

    ext = Extent(B, 1, Q, K)
    alive = list(cands)
    step = max(1, ROW_BLOCK_ENTRIES // max(1, B * K))  # rows evaluated at once
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        if not alive and first is None:
            return None
        ev = evaluate(q0, q1)  # [B, 1, q, K]
        if first is not None:
            first[:, q0:q1] = torch.where(ev.any(-1), ev.to(torch.uint8).argmax(-1), -1)[:, 0]  # [B, q]
        alive = [m for m in alive if bool((m.block(ext, q0, q1, 0, K, ev.device) == ev).all())]
    return alive[0] if alive else None


def _padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> Mask | None:
    """``key_padding`` from the 2-D attention_mask [B, ≥ kv_offset + K] (1 = real token), or None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise MaskError(f"bhqk mask builder: attention_mask must be [B, K], got shape {list(attention_mask.shape)}.")
    from transformers.masking_utils import prepare_padding_mask

    padded = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # [B, ≥ kv_offset + K]
    assert padded is not None  # None only for attention_mask None
    valid = padded[:, kv_offset:kv_offset + kv_length]  # [B, K]
    return None if bool(valid.all()) else key_padding(valid)


def build_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    config=None,
    dtype: torch.dtype = torch.float32,
    **kwargs,
) -> HFMask:
    """transformers' mask-interface call → an :class:`HFMask` for [B, H, Q=q_length, K=kv_length].

    Query i sits at position ``q_offset + i``, key j at ``kv_offset + j`` (a KV cache gives offsets).
    ``attention_mask`` [B, ≥ kv_offset + K] marks real tokens (1) and padding (0). ``dtype`` (the
    model's, which transformers passes) is the dtype of the mask's tensor."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, eager_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    B, Q, K = int(batch_size), int(q_length), int(kv_length)
    if isinstance(attention_mask, HFMask):  # built before and handed back (transformers itself returns 4-D masks as is)
        if tuple(attention_mask.shape) != (B, 1, Q, K):
            raise MaskError(f"bhqk mask builder: got a prepared mask for {list(attention_mask.shape)} "
                            f"but this call is [B={B}, 1, Q={Q}, K={K}].")
        return attention_mask
    attention_mask = None if attention_mask is None else attention_mask.bool()  # [B, ≥ kv_offset + K]
    hf_args: dict[str, Any] = dict(batch_size=B, q_length=Q, kv_length=K, q_offset=q_offset, kv_offset=kv_offset,
                   mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap, device=device)
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a StaticCache gives q_offset as a tensor
    c = q_offset - kv_offset  # query i sits at key index i + c
    pad = _padding(attention_mask, K, kv_offset)

    if mask_function is causal_mask_function:
        structure: Mask | None = _band(c, Q, K, None, 0)
    elif mask_function is bidirectional_mask_function:
        structure = AllKeys(K)
    else:
        structure = _structure(mask_function, B, Q, K, q_offset, kv_offset, c, attention_mask, local_size,
                               config, use_vmap, device)
    if structure is None:  # unknown structure: the dense mask transformers' sdpa builder makes
        full = _evaluate(mask_function, B, 0, Q, K, q_offset, kv_offset, use_vmap, device, attention_mask)  # [B, 1, Q, K]
        out: Mask = dense(full.bool())
    elif isinstance(structure, AllKeys):
        out = AllKeys(K) if pad is None else pad
    else:
        out = structure if pad is None else structure & pad

    def build() -> torch.Tensor:  # transformers' own eager mask for this call: float [B, 1, Q, K]
        return eager_mask(**hf_args, dtype=dtype)

    return HFMask(out, (B, 1, Q, K), dtype, device, build)


def _structure(mask_function, B, Q, K, q_offset, kv_offset, c, attention_mask, local_size, config, use_vmap, device):
    """A structured mask equal to ``mask_function`` on every entry, or None."""
    def evaluate(q0, q1):
        return _evaluate(mask_function, B, q0, q1, K, q_offset, kv_offset, use_vmap, device)

    def ints(*xs):
        return sorted({int(x) for x in xs if isinstance(x, int) and x > 0})

    # transformers passes local_size = the window or the chunk size; the config says which it has
    chunk = getattr(config, "attention_chunk_size", None)
    window_sizes = ints(local_size if config is None or chunk is None else None, getattr(config, "sliding_window", None))
    chunk_sizes = ints(chunk, local_size if config is None else None)
    windows = []
    for W in window_sizes:
        windows.append(_band(c, Q, K, W - 1, 0))  # causal window: the W keys ending at the query's own
        windows.append(_band(c, Q, K, W, W))  # bidirectional window: |i - j| <= W
    cands = [_band(c, Q, K, None, 0), AllKeys(K), *windows]
    if chunk_sizes:  # chunked attention: chunks of C positions counted after the left padding
        lp = torch.zeros(B, dtype=torch.long)
        if attention_mask is not None:
            lp = (attention_mask.long().cumsum(-1) == 0).sum(-1).cpu()  # [B] left-padding tokens
        for C in chunk_sizes:
            q_ids = torch.div(torch.arange(Q) + q_offset - lp[:, None], C, rounding_mode="floor")  # [B, Q]
            k_ids = torch.div(torch.arange(K) + kv_offset - lp[:, None], C, rounding_mode="floor")  # [B, K]
            cands.append(_band(c, Q, K, None, 0) & document(q_ids, k_ids))
    found = _matches(cands, evaluate, B, Q, K)
    if found is not None or not (Q == K and c == 0):  # packed sequences only come without a cache
        return found
    # packed sequences: a document starts at each row whose first visible key is itself
    first = torch.full((B, Q), -1, dtype=torch.long)
    _matches([], evaluate, B, Q, K, first)
    starts = first == torch.arange(Q)  # [B, Q]
    starts[:, 0] = True
    ids = starts.long().cumsum(-1) - 1  # [B, Q] document index of each position
    docs = document(ids)
    return _matches([_band(0, Q, K, None, 0) & docs, *(w & docs for w in windows)], evaluate, B, Q, K)
