"""The "flex" backend: PyTorch's FlexAttention (``torch.nn.attention.flex_attention``), compiled.

The mask becomes a ``BlockMask`` from the mask's own tile classification (``mask.block_mask``: no
per-pair evaluation as in ``create_block_mask``) and its ``mask_mod``; softcap and the bias a
``score_mod``, ``S → softcap·tanh(S/softcap) + bias`` (ALiBi from its slopes, a dense bias by
indexing; FlexAttention applies ``scale`` first). Sinks join through the lse (a ``score_mod``
cannot add a column to the denominator): ``merge.with_sinks`` after the kernel, which on the CPU
needs the lse the compiled kernel lacks.

Compiled kernels are kept per structure (:data:`KERNELS`, :func:`kernel_key`; one ``torch.compile``
per key, with its own code object and so its own recompile budget); ``dynamic=True``, the
BlockMask's tile counts marked dynamic and every size-dependent number captured as a tensor, so a
new length, window or padding does not recompile (dynamo still specializes sizes of 1, and Q = K
against Q ≠ K). Compiling takes tens of seconds on a 2-core CPU.

``why_not`` says the limits in words: no dropout; on the CPU (torch 2.13) forward only and no
log-sum-exp; torch.compile must work here. NaN/inf in q, k or v: handed to the tiled backend
(:func:`hands_off`). ``auto`` weighs it only where its costs were measured on this machine
(``bhqk calibrate --flex``) and charges a kernel not yet compiled in this process its whole compile
(:func:`estimate`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import types
import weakref

import torch

from ..bias import ALiBi, Bias
from ..bias import Dense as DenseBias
from ..bias import Sum as BiasSum
from ..errors import BackendError, PerformanceHint, warn_user
from ..masks import Mask
from ..masks.base import index4, scalar, tensor_versions
from ..shapes import compute_dtype
from ..shortcuts import Store, declare
from . import costs, nonfinite
from .costs import Costs, Estimate, FlexCosts
from .merge import with_sinks
from .problem import Problem

BLOCK = 128  # FlexAttention's sparse block (tile) size

_KERNELS: dict[tuple, object] = {}  # key -> compiled function
_WARM: set[tuple] = set()  # keys whose kernel has run (compiled) at least once
_WARM_BACKWARD: set[tuple] = set()  # keys that have run with gradients (their backward compiles at the first backward)
_BROKEN: dict[tuple, str] = {}  # keys whose kernel failed to compile in this process -> why
_COMPILE = True
_BLOCK_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> (key, BlockMask) of its last call


def _forget_kernels() -> None:
    for key in list(_KERNELS):
        forget(key)


KERNELS = declare(Store(
    "flex kernels", "compiling FlexAttention again (seconds) for a structure compiled before", "kernel_key(p): device, "
    "dtype, head dims, GQA, lse, scale, the mask's and bias's structure, softcap (sizes are dynamic)",
    "one compiled kernel per structure, none dropped (a model has a handful)", "none needed: the key holds all the "
    "compiled code specializes on; a kernel that fails to compile is dropped (forget) and refused", _KERNELS,
    _forget_kernels))
BLOCK_MASKS = declare(Store(
    "flex block masks", "building a mask's BlockMask again (its mask_mod over every 128×128 block)", "the mask object "
    "(weakly), (B, H, Q, K, device) and the version of every tensor it holds (masks.tensor_versions)",
    "one per mask object (its last call's sizes); gone with the mask", "new sizes or an in-place write into a tensor "
    "the mask holds; never kept for a predicate without key= or a mask holding an inference tensor", _BLOCK_MASKS))


def _flex():
    """FlexAttention's module, or None where this torch has none."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


@functools.cache
def _no_compiler(device_type: str) -> str | None:
    """Why torch.compile cannot build a kernel for ``device_type`` here (None: it can); looked up
    once per device type (``auto`` asks on every call)."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is unavailable in this Python / torch build"
    if device_type == "cpu" and not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        return "torch.compile for the CPU needs a C++ compiler (g++ / clang++) and none is on PATH"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "torch.compile for CUDA needs Triton, which is not installed"
    return None


def why_not(p: Problem, need_lse: bool) -> str | None:
    """Why FlexAttention cannot take this call, in words (None: it can)."""
    if _flex() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch ≥ 2.5)"
    dev = p.q.device
    if dev.type not in ("cpu", "cuda"):
        return f"bhqk runs FlexAttention on the CPU and CUDA only, not on {dev.type}"
    if _COMPILE:
        reason = _no_compiler(dev.type)
        if reason is not None:
            return reason
    if p.dropout_p > 0:
        return "FlexAttention has no dropout"
    if _COMPILE and _BROKEN and kernel_key(p) in _BROKEN:
        return _BROKEN[kernel_key(p)]
    if dev.type == "cuda" and min(p.sizes["d"], p.sizes["dv"]) < 16:
        return f"FlexAttention's CUDA kernel needs head dims of at least 16 (d={p.sizes['d']}, dv={p.sizes['dv']})"
    if dev.type == "cpu" and p.needs_grad:
        return ("FlexAttention does not support backward on CPU (torch 2.13); run under torch.no_grad() or with "
                "tensors that do not require grad, or use backend='tiled'")
    if dev.type == "cpu" and (need_lse or p.sinks is not None) and _COMPILE:
        return ("FlexAttention's compiled CPU kernel does not return the log-sum-exp (torch 2.13)"
                + ("; sinks need it" if p.sinks is not None else ""))
    return None


def hands_off(p: Problem, plan: None = None) -> tuple[str, str] | None:
    """("tiled", why) when q, k or v holds NaN/inf (FlexAttention lets them cross the mask; the
    tiled backend keeps them where they belong), else None."""
    return nonfinite.hand_off(p, False, "FlexAttention")


@contextlib.contextmanager
def uncompiled():
    """Run FlexAttention's unfused eager path inside this block: it builds the [B, H, Q, K] scores
    but compiles nothing (for tests and for debugging a mask_mod or score_mod)."""
    global _COMPILE
    fa = _flex()
    old, _COMPILE = _COMPILE, False
    debug = getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    if debug is not None:  # else FlexAttention traces its eager path with dynamo, seconds per new structure
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        _COMPILE = old
        if debug is not None:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug


# ---- the call's pieces: block mask, score_mod, kernel ------------------------------------------

def block_mask(mask: Mask | None, B: int, H: int, Q: int, K: int, device):
    """``mask.block_mask``, reused while the same mask object is called with the same sizes
    (every layer of a model shares one)."""
    return None if mask is None else _block_mask(mask, B, H, Q, K, device)[0]


def _block_mask(mask: Mask, B: int, H: int, Q: int, K: int, device) -> tuple:
    """(BlockMask, blocks it visits per (b, h)), cached as :func:`block_mask` says (:data:`BLOCK_MASKS`)."""
    versions = tensor_versions(mask) if BLOCK_MASKS.on else None
    key = (B, H, Q, K, str(device), versions)
    hit = _BLOCK_MASKS.get(mask) if versions is not None else None
    if hit is not None and hit[0] == key:
        BLOCK_MASKS.hits += 1
        return hit[1]
    bm = mask.block_mask(B, H, Q, K, BLOCK, device)
    blocks = int(bm.kv_num_blocks.sum()) + (int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0)
    if versions is not None:
        _BLOCK_MASKS[mask] = (key, (bm, blocks))
    return bm, blocks


def visited(p: Problem) -> int:
    """Score entries in the blocks FlexAttention computes for this call: its BlockMask's partial
    and full 128×128 blocks (every block without a mask), × B·H (the cost model's unit)."""
    e = p.ext
    if p.mask is None:
        blocks = -(-e.Q // BLOCK) * -(-e.K // BLOCK)
    else:
        blocks = _block_mask(p.mask, e.B, e.H, e.Q, e.K, p.q.device)[1]
    return blocks * BLOCK * BLOCK * e.B * e.H


def _bias_mod(bias: Bias, B: int, H: int, Q: int, K: int, device, dtype):
    """``bias`` as ``fn(b, h, q_idx, kv_idx) -> float``: ALiBi from its slopes, a sum term by term,
    anything else read from its dense tensor."""
    if isinstance(bias, BiasSum):
        fa, fb = _bias_mod(bias.a, B, H, Q, K, device, dtype), _bias_mod(bias.b, B, H, Q, K, device, dtype)
        return lambda b, h, q_idx, kv_idx: fa(b, h, q_idx, kv_idx) + fb(b, h, q_idx, kv_idx)
    if isinstance(bias, ALiBi):
        from ..masks.base import causal_offset

        off = scalar(causal_offset(bias.align, Q, K, "alibi"), device)
        slopes = bias.slopes.to(device=device, dtype=dtype)  # [H]
        return lambda b, h, q_idx, kv_idx: -slopes[h] * (q_idx + off - kv_idx).abs()
    t = bias.tensor if isinstance(bias, DenseBias) else bias.materialize(B, H, Q, K)
    return index4(t.to(device=device, dtype=dtype))  # [#B, #H, #Q, #K]


def score_mod(p: Problem):
    """Softcap and bias as FlexAttention's ``score_mod`` (None when the call has neither)."""
    if p.softcap is None and p.bias is None:
        return None
    dt = compute_dtype(p.q)
    e, dev = p.ext, p.q.device
    bias = None if p.bias is None else _bias_mod(p.bias, e.B, e.H, e.Q, e.K, dev, dt)
    cap = None if p.softcap is None else torch.tensor(p.softcap, dtype=dt, device=dev)

    def mod(score, b, h, q_idx, kv_idx):
        dtype = score.dtype  # float32 inside the compiled kernels; the input dtype on the eager path
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if bias is not None:
            score = score + bias(b, h, q_idx, kv_idx)
        return score.to(dtype)

    return mod


def _structure(x) -> str:
    """The shape of a mask / bias expression, for the kernel cache key (numbers are tensors, not part of it)."""
    if x is None:
        return "-"
    parts = [type(x).__name__, str(getattr(x, "align", ""))]
    for name in ("a", "b", "base", "parts"):  # parts: a per-head mask's, one per head
        value = getattr(x, name, None)
        parts += [_structure(y) for y in (value if isinstance(value, tuple) else (value,)) if isinstance(y, (Mask, Bias))]
    t = getattr(x, "tensor", None)
    if isinstance(t, torch.Tensor):
        parts.append(str(tuple(n == 1 for n in t.shape)))
    return "(" + ",".join(parts) + ")"


def _call(q, k, v, block_mask, score_mod, scale, enable_gqa, need_lse):
    fa = _flex()
    if not need_lse:
        return fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa), None
    out, aux = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                 return_aux=fa.AuxRequest(lse=True))
    return out, aux.lse


def kernel(key: tuple):
    """The compiled ``_call`` for ``key``; each key gets its own code object, so its own dynamo
    cache and recompile budget (at the limit dynamo would fall back to the unfused O(Q·K) path)."""
    fn = _KERNELS.get(key) if KERNELS.on else None
    if fn is not None:
        KERNELS.hits += 1
    else:
        code = _call.__code__.replace(co_name=f"_flex_{len(_KERNELS)}")
        fresh = types.FunctionType(code, _call.__globals__, code.co_name)
        fn = torch.compile(fresh, dynamic=True, fullgraph=True)
        if KERNELS.on:
            _KERNELS[key] = fn
    return fn


def kernels() -> list[tuple]:
    """The keys of the compiled kernels made so far in this process."""
    return list(_KERNELS)


def kernel_key(p: Problem) -> tuple:
    """What one compiled kernel serves: device, dtype, head dims, GQA, whether it returns the lse
    (always on CUDA, where it is nearly free, so a call that needs it shares the kernel; never on
    the CPU, whose compiled kernel has none), scale, mask and bias structure, softcap."""
    q = p.q
    return (q.device.type, q.device.index, q.dtype, p.sizes["d"], p.sizes["dv"], p.k.shape[1] != p.ext.H,
            q.device.type != "cpu", p.scale, _structure(p.mask), _structure(p.bias), p.softcap is not None)


def compiled(key: tuple, backward: bool = False) -> bool:
    """Whether the kernel for ``key`` has compiled (run once) in this process; ``backward``: and
    run with gradients (so its backward compiles, or has compiled, at the first backward)."""
    return key in (_WARM_BACKWARD if backward else _WARM)


def forget(key: tuple) -> None:
    """Drop the kernel for ``key``: its next call compiles again (``calibrate.measure_flex``)."""
    _KERNELS.pop(key, None)
    _WARM.discard(key)
    _WARM_BACKWARD.discard(key)


def run(p: Problem, need_lse: bool = False, plan: None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registry entry (no plan; its kernels are kept by structure, :data:`KERNELS`): O [B, H, Q, dv]
    in the input dtype, and lse [B, H, Q] (float32) when asked."""
    e = p.ext
    dv = p.sizes["dv"]
    if 0 in (e.B, e.H, e.Q, e.K):  # nothing to attend: every row is fully masked (lse -inf, or its sink)
        lse_dtype = compute_dtype(p.q)  # as the kernel's lse
        out = p.q.new_zeros(e.B, e.H, e.Q, dv)  # [B, H, Q, dv]
        lse = p.q.new_full((e.B, e.H, e.Q), float("-inf"), dtype=lse_dtype)  # [B, H, Q]
        if p.sinks is not None:
            out, lse = with_sinks(out, lse, p.sinks)
        return out, (lse if need_lse else None)
    q, k, v = p.q, p.k, p.v
    if not p.needs_grad:  # FlexAttention refuses CPU tensors that require grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    gqa = k.shape[1] != e.H
    bm = block_mask(p.mask, e.B, e.H, e.Q, e.K, q.device)
    mod = score_mod(p)
    with_lse = need_lse or p.sinks is not None
    if _COMPILE:
        key = kernel_key(p)
        with_lse = key[6]
        fn = kernel(key)
        if bm is not None:  # its tile counts follow Q and K: dynamic from the first compile, not after a recompile
            for t in bm.as_tuple():
                if isinstance(t, torch.Tensor) and t.dim() >= 3:
                    torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1)
                    if t.dim() == 4:
                        torch._dynamo.maybe_mark_dynamic(t, 2)
    else:
        fn = _call
    first = _COMPILE and key not in _WARM  # its first call compiles
    try:
        out, lse = fn(q, k, v, bm, mod, p.scale, gqa, with_lse)  # [B, H, Q, dv], [B, H, Q]
    except Exception as e:  # noqa: BLE001 — any compile failure: refused from now on, in words
        if not first:
            raise
        _BROKEN[key] = f"its kernel for this structure failed to compile here ({type(e).__name__}: {str(e)[:200]})"
        forget(key)
        raise BackendError(f"backend 'flex' cannot take this call: {_BROKEN[key]}.") from e
    if first:
        _WARM.add(key)
    if _COMPILE and p.needs_grad:
        _WARM_BACKWARD.add(key)
    if p.sinks is not None:  # the sink joins each row's denominator: weights shrink by sigmoid(lse - sink)
        out, lse = with_sinks(out, lse, p.sinks)
    return out, (lse if need_lse else None)


# ---- its cost model (what ``auto`` weighs; the numbers are measured by ``calibrate.measure_flex``) ----

def estimate(p: Problem, grad: bool, c: Costs) -> Estimate:
    """Seconds of compiled FlexAttention: per call plus per score entry of the blocks it visits (×
    the head width over 64), by its costs measured on this machine (none: inf, it is not weighed),
    plus the whole compile while this structure's kernel has not compiled in this process."""
    dev, dt = p.q.device, p.q.dtype
    fc = costs.kept(dev, dt, FlexCosts)
    if fc is None:
        hint(dev, dt)
        where = f"{dev.type}, {str(dt).removeprefix('torch.')}"
        return Estimate(math.inf, f"its costs were never measured on this machine ({where}); "
                                  "`bhqk calibrate --flex` measures them once (it compiles kernels)")
    if grad and fc.backward is None:
        return Estimate(math.inf, "its forward+backward was never measured on this machine")
    entries = visited(p)
    width = (p.sizes["d"] + p.sizes["dv"]) / 128
    t = (fc.call + entries * fc.elem * width) * ((fc.backward or 1.0) if grad else 1.0)
    note = f"{entries / max(1, p.ext.B * p.ext.H * p.ext.Q * p.ext.K):.0%} of the scores in the blocks it visits"
    key = kernel_key(p)
    if _COMPILE and not (compiled(key) and (not grad or compiled(key, backward=True))):
        return Estimate(t + fc.compile, note + f", compiling its kernel first ({fc.compile:.3g} s)")
    return Estimate(t, note + ", compiled")


_HINTED: set[tuple[str, torch.dtype]] = set()


def hint(device: torch.device, dtype: torch.dtype) -> None:
    """Once per (device type, dtype) off the CPU: a PerformanceHint that auto cannot weigh
    FlexAttention, usually much faster for masks on a GPU, until its costs are measured there."""
    if device.type != "cpu" and (device.type, dtype) not in _HINTED:
        _HINTED.add((device.type, dtype))
        warn_user(f"bhqk: auto cannot weigh FlexAttention on {device.type} ({str(dtype).removeprefix('torch.')}): its costs "
                  "were never measured on this machine; on a GPU it is usually much faster for masks: run "
                  f"`bhqk calibrate --device {device.type} --flex` once (it is kept for this machine), or pass backend='flex'.",
                  PerformanceHint)
