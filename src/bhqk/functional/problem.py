"""One attention call, checked and in the bhnd layout: what every backend receives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..bias import Bias, as_bias
from ..errors import MaskError, ShapeError
from ..masks import Extent, Mask, as_mask
from ..shapes import Sizes, check_qkv, compute_dtype
from ..shortcuts import Cache, declare


@dataclass
class Problem:
    """q [B, H, Q, d], k [B, Hkv, K, d], v [B, Hkv, K, dv] (views of the caller's tensors)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sizes: Sizes
    mask: Mask | None = None
    bias: Bias | None = None
    scale: float = 1.0
    softcap: float | None = None
    dropout_p: float = 0.0
    options: dict = field(default_factory=dict)  # backend tuning, e.g. block_q / block_k for "tiled"
    sinks: torch.Tensor | None = None  # [H]: per-head logits in each row's softmax denominator, no value
    ext: Extent = field(init=False, repr=False, compare=False)  # [B, H, Q, K] from sizes, bound once per problem

    def __post_init__(self) -> None:
        self.ext = extent(self.sizes)

    @classmethod
    def kept(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: Sizes, ext: Extent, mask: Mask | None,
             scale: float, softcap: float | None, dropout_p: float, options: dict, every_key: bool) -> Problem:
        """The call of a family whose checks passed (``registry.Kept``: no bias, no sinks), its extent
        given and, where ``every_key``, its :attr:`every_key` known: the fields set as ``prepare``
        would, without the dataclass's ``__init__``."""
        p = cls.__new__(cls)
        p.q, p.k, p.v, p.sizes, p.mask, p.bias, p.scale = q, k, v, sizes, mask, None, scale
        p.softcap, p.dropout_p, p.options, p.sinks, p.ext = softcap, dropout_p, options, None, ext
        if every_key:
            p._every_key = True  # what every_key would compute (the family says so)
        return p

    @property
    def every_key(self) -> bool:
        """Every query may attend every key: no mask, or one query whose causal diagonal
        (``Mask.causal_diagonal``) reaches the last key (a decode step: bottom-right causal, its
        query at the last key position). Computed once per problem (a plain attribute, not
        ``functools.cached_property``, whose lock ``torch.compile`` cannot trace)."""
        known = getattr(self, "_every_key", None)
        if known is None:
            m, e = self.mask, self.ext
            known = m is None or (e.Q == 1 and (c := m.causal_diagonal(e)) is not None and c >= e.K - 1)
            self._every_key = known
        return known

    @property
    def needs_grad(self) -> bool:
        """Grad mode is on and q, k or v requires gradients: the call's backward will run."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))

    @property
    def scale_positive(self) -> bool:
        """The scale is a normal positive number in the fused kernels' arithmetic (float32, or float64
        for float64 inputs): their ``is_causal`` masks with -inf before scaling, so a scale <= 0 (or
        one that rounds to 0) would turn masked scores into NaN or +inf."""
        return self.scale >= torch.finfo(compute_dtype(self.q)).tiny

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 = plain multi-head, H = multi-query)."""
        return self.sizes["H"] // self.sizes["Hkv"]


EXTENTS: Cache[Extent] = Cache(  # Extent is frozen: one shared per (B, H, Q, K)
    "extents", "building a frozen Extent dataclass (about a microsecond) at every call", "(B, H, Q, K)", 1024,
    "none needed: an Extent is immutable and holds nothing but its key")
declare(EXTENTS)


def extent(sizes: Sizes) -> Extent:
    """The Extent [B, H, Q, K] of ``sizes`` (shared, :data:`EXTENTS`: building a frozen dataclass
    costs a microsecond)."""
    return extent_of(sizes["B"], sizes["H"], sizes["Q"], sizes["K"])


def extent_of(B: int, H: int, Q: int, K: int) -> Extent:
    """The shared Extent [B, H, Q, K] (:data:`EXTENTS`)."""
    key = (B, H, Q, K)
    if (e := EXTENTS.lookup(key)) is None:
        e = Extent(*key)
        EXTENTS.put(key, e)
    return e


def default_scale(d: int) -> float:
    """1/√d (1 for d = 0): the scale of a call that gives none."""
    return 1.0 / math.sqrt(d) if d > 0 else 1.0


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    bias=None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    layout: str = "bhnd",
    options: dict | None = None,
    sinks: torch.Tensor | None = None,
) -> Problem:
    """Check everything about a call once, bind the named sizes, and bring q, k, v to bhnd."""
    sizes = check_qkv(q, k, v, layout)
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, H, d] -> [B, H, N, d] (a view)
    mask = as_mask(mask)
    bias = as_bias(bias)
    if mask is not None or bias is not None:
        ext = extent(sizes)
        for value in (mask, bias):
            if value is not None:
                try:
                    value.check(ext)
                except MaskError as e:
                    raise MaskError(f"{e}\n{sizes.table()}") from None
    scale, softcap = check_scalars(sizes, scale, softcap)
    if type(dropout_p) is not float or dropout_p != 0.0:  # the default 0.0 needs no look
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}.")
    sinks = check_sinks(sizes, sinks, q.device)
    return Problem(q, k, v, sizes, mask, bias, scale, softcap, float(dropout_p), dict(options) if options else {}, sinks)


def check_sinks(sizes: Sizes, sinks, device: torch.device) -> torch.Tensor | None:
    """``sinks``: None, or a finite floating tensor [H] (one logit per query head) on q's device."""
    if sinks is None:
        return None
    what = "one logit per query head that joins each row's softmax denominator"
    if not isinstance(sinks, torch.Tensor):
        raise ShapeError(f"sinks must be a tensor [H={sizes['H']}] ({what}), got {type(sinks).__name__}.")
    sizes.bind("sinks", sinks.shape, ("H",), what=f" ({what})")
    if not sinks.is_floating_point():
        raise ShapeError(f"sinks must be a floating-point tensor [H={sizes['H']}], got {sinks.dtype}.")
    if sinks.device != device:
        raise ShapeError(f"sinks is on {sinks.device} but q is on {device}.")
    if not bool(torch.isfinite(sinks).all()):
        raise ShapeError(f"sinks must be finite ({what}), got {sinks.tolist() if sinks.numel() <= 16 else 'non-finite values'}.")
    return sinks


def check_scalars(sizes: Sizes, scale, softcap) -> tuple[float, float | None]:
    """``scale`` (default 1/√d) must be a finite number, ``softcap`` None or a finite positive number:
    a NaN or infinite one would turn every score into NaN or ±inf."""
    if scale is None:
        scale = default_scale(sizes["d"])  # a finite float: nothing to check
    else:
        scale = _number("scale", scale, "the factor on Q·Kᵀ, default 1/√d")
    if softcap is not None:
        softcap = _number("softcap", softcap, "scores become softcap·tanh(S/softcap)")
        if not softcap > 0:
            raise ShapeError(f"softcap must be a finite positive number (scores become softcap·tanh(S/softcap)), got {softcap}.")
    return scale, softcap


def _number(name: str, value, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ShapeError(f"{name} must be a finite number ({what}), got {value!r}.") from None
    if isinstance(value, bool) or not math.isfinite(x):
        raise ShapeError(f"{name} must be a finite number ({what}), got {value!r}.")
    return x
