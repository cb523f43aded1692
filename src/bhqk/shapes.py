"""Named-size binding: every check binds B, H, Hkv, Q, K, d, dv, D and names the one that is wrong.

A name prefixed with ``#`` (jaxtyping's convention) is a broadcast axis: size 1 or the bound size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .dims import meaning, why_agree
from .errors import ShapeError
from .shortcuts import Cache, declare
from .text import named_shape

LAYOUTS = {
    # layout name -> axis names of q, k, v in that layout
    "bhnd": (("B", "H", "Q", "d"), ("B", "Hkv", "K", "d"), ("B", "Hkv", "K", "dv")),
    "bnhd": (("B", "Q", "H", "d"), ("B", "K", "Hkv", "d"), ("B", "K", "Hkv", "dv")),
}


class Sizes:
    """Named sizes bound so far, which argument bound each, and the named shape of every argument seen."""

    def __init__(self, **known: int) -> None:
        self.size: dict[str, int] = dict(known)
        self.bound_by: dict[str, str] = {n: "given" for n in known}
        self.seen: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = []

    def copy(self) -> Sizes:
        """An independent copy (binding more names into it leaves this one as it is)."""
        new = Sizes.__new__(Sizes)
        new.size, new.bound_by, new.seen = dict(self.size), dict(self.bound_by), list(self.seen)
        return new

    def again(self, layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Sizes:
        """A copy for a call whose q, k, v passed the same checks as the call these sizes were bound
        from, with K bound from ``k`` (a decode step's one more key) and this call's shapes seen."""
        qn, kn, vn = LAYOUTS[layout]
        new = self.copy()
        new.size["K"] = k.shape[kn.index("K")]
        new.seen = [("q", qn, tuple(q.shape)), ("k", kn, tuple(k.shape)), ("v", vn, tuple(v.shape))]
        return new

    def __getitem__(self, name: str) -> int:
        return self.size[name]

    def get(self, name: str, default: int | None = None) -> int | None:
        return self.size.get(name, default)

    def table(self) -> str:
        """The named shapes seen so far, one per line (the tail of every ShapeError)."""
        return "\n".join(f"  {arg}: {named_shape(names, shape)}" for arg, names, shape in self.seen)

    def fail(self, message: str) -> ShapeError:
        """A ShapeError whose message ends with the table of bound sizes."""
        tail = self.table()
        return ShapeError(message + ("\n" + tail if tail else ""))

    def bind(self, arg: str, shape: Sequence[int], names: Sequence[str], *, what: str = "") -> None:
        """Check ``shape`` against ``names`` (rank, then each size), binding new names."""
        shape = tuple(int(s) for s in shape)
        names = tuple(names)
        clean = tuple(n.lstrip("#") for n in names)
        if len(shape) != len(names):
            axes = ", ".join(f"{n} ({meaning(n)})" for n in clean)
            raise self.fail(
                f"{arg} must be {len(names)}-D [{', '.join(clean)}]{what}, got {len(shape)}-D shape "
                f"{list(shape)}; its axes are: {axes}."
            )
        for name, raw, size in zip(clean, names, shape):
            broadcast = raw.startswith("#")
            if name in self.size:
                bound = self.size[name]
                if size == bound or (broadcast and size == 1):
                    continue
                self.seen.append((arg, clean, shape))
                why = why_agree(name)
                raise self.fail(
                    f"{arg} has {meaning(name)} {name}={size} but {self.bound_by[name]} has {name}={bound}; {why}."
                )
            if not (broadcast and size == 1):
                self.size[name] = size
                self.bound_by[name] = arg
        self.seen.append((arg, clean, shape))

    def need_divisible(self, big: str, small: str, why: str) -> None:
        """``big % small == 0`` or a ShapeError that says ``why``."""
        b, s = self.size[big], self.size[small]
        if s <= 0 or b % s:
            raise self.fail(f"{big}={b} is not divisible by {small}={s}; {why}.")


def _bind_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> Sizes:
    sizes = Sizes()
    qn, kn, vn = LAYOUTS[layout]
    what = f" (layout={layout!r})"
    sizes.bind("q", q.shape, qn, what=what)
    sizes.bind("k", k.shape, kn, what=what)
    sizes.bind("v", v.shape, vn, what=what)
    sizes.need_divisible("H", "Hkv", "each key/value head serves H/Hkv query heads (GQA/MQA)")
    return sizes


CHECKED: Cache[Sizes] = Cache(  # a model's decode steps repeat a few signatures
    "checked sizes", "check_qkv's checks and bound sizes", "layout, and the shapes, dtypes and devices of q, k, v "
    "(all the checks read)", 256, "none needed: the key is everything the checks read; errors are never kept")
declare(CHECKED)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "bhnd") -> Sizes:
    """Bind B, H, Hkv, Q, K, d, dv from q, k, v and check dtype, device and the head grouping.
    A call whose shapes, dtypes, devices and layout passed before gets a copy of its sizes (the
    checks read nothing else); errors are never cached."""
    if layout not in LAYOUTS:
        raise ShapeError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}.")
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}.")
    if torch.compiler.is_compiling():  # traced once per graph: no cache to guard on
        return _check_qkv(q, k, v, layout)
    key = (layout, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
    if (hit := CHECKED.lookup(key)) is not None:
        return hit.copy()
    sizes = _check_qkv(q, k, v, layout)
    CHECKED.put(key, sizes.copy())
    return sizes


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> Sizes:
    try:
        sizes = _bind_qkv(q, k, v, layout)
    except ShapeError as e:
        other = "bnhd" if layout == "bhnd" else "bhnd"
        try:
            _bind_qkv(q, k, v, other)
        except ShapeError:
            raise e from None
        raise ShapeError(f"{e}\nThese shapes fit layout={other!r} ({', '.join(LAYOUTS[other][0])} for q): "
                         f"if that is how your tensors are laid out, pass layout={other!r}.") from None
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise sizes.fail(f"{arg} must be a floating-point tensor, got dtype {t.dtype}.")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise sizes.fail(f"{arg} has dtype {t.dtype} but q has {q.dtype}; q, k and v need one dtype.")
        if t.device != q.device:
            raise sizes.fail(f"{arg} is on {t.device} but q is on {q.device}; q, k and v need one device.")
    return sizes


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """A tensor broadcastable to [B, H, Q, K] with fewer axes, given the leading size-1 axes: [#B, #H, #Q, #K] (a view)."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # [.., #Q, #K] -> [#B, #H, #Q, #K]


def compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    """The dtype attention math runs in: float64 when any of ``ts`` is float64, else float32
    (fp16/bf16 are computed in float32 and rounded once at the end)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def per_query_head(t: torch.Tensor, H: int, heads: Sequence[int] | None = None) -> torch.Tensor:
    """[B, Hkv, K, x] -> [B, H, K, x]: query head h uses key/value head h // (H / Hkv) (GQA spelled
    out, for the paths that need one K/V head per query head); with ``heads``, those query heads only: [B, h, K, x]."""
    if heads is not None:
        return t.index_select(1, torch.tensor(heads, device=t.device) // (H // t.shape[1]))  # [B, Hkv, K, x] -> [B, h, K, x]
    return t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)


def all_finite(*ts: torch.Tensor) -> bool:
    """No NaN/inf in any of ``ts`` (:func:`finite`). Under ``torch.compile`` the check is skipped (a
    branch on data cannot be traced): compiled calls assume finite input."""
    return torch.compiler.is_compiling() or all(finite(t) for t in ts)


def finite(t: torch.Tensor) -> bool:
    """No NaN/inf in ``t``, read from its data (not under ``torch.compile``: :func:`all_finite`): a
    finite sum proves it without a bool copy; only a non-finite sum (NaN/inf, or finite values that
    overflow) needs the full check."""
    wide = torch.float32 if t.dtype == torch.float16 else None  # fp16 sums overflow at 65504; bf16 has fp32's range
    if t.requires_grad:
        t = t.detach()  # the check is no part of the graph
    return not t.numel() or math.isfinite(float(t.sum(dtype=wide))) or bool(torch.isfinite(t).all())


def tile_of(t: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """The [.., q0:q1, k0:k1] tile of a tensor broadcastable to [B, H, Q, K]; a size-1 Q or K axis
    broadcasts, so it is kept whole."""
    t = t[:, :, q0:q1] if t.shape[2] != 1 else t  # [#B, #H, q, #K]
    return t[:, :, :, k0:k1] if t.shape[3] != 1 else t  # [#B, #H, #q, k]


def check_broadcast(arg: str, shape: Sequence[int], sizes: Sizes, error: type[ValueError]) -> None:
    """``shape`` must broadcast to [B, H, Q, K]; otherwise ``error`` naming the axis that does not."""
    target = ("B", "H", "Q", "K")
    want = tuple(sizes[n] for n in target)
    full = named_shape(target, want)
    if len(shape) > 4:
        raise error(f"{arg} has {len(shape)} axes {list(shape)}; it must broadcast to {full}.")
    for offset, size in enumerate(reversed(tuple(shape))):
        name = target[3 - offset]
        if size not in (1, want[3 - offset]):
            raise error(
                f"{arg} axis {name} ({meaning(name)}) has size {size} but {name}={want[3 - offset]}; "
                f"{arg} of shape {list(shape)} must broadcast to {full}."
            )
