"""Tolerances from the arithmetic, for the whole suite (docs/design.md §8).

A float sum taken in another order (AVX2 vs AVX-512 kernels, one thread vs two, another tile size)
is a different, equally correct answer, so no test compares floats with a tolerance picked by eye
on one CPU. Every bound here is ``factor · eps(dtype) · √n · magnitude``:

- ``eps``: the unit roundoff's neighbour ``torch.finfo(dtype).eps`` of the dtype the path computes
  in (fp16/bf16 inputs: the output is rounded to that dtype, so its eps counts);
- ``n``: the length of the longest reduction behind one value (K for an attention output, d for a
  score, B·Q for a gradient of k or v); rounding errors of n terms grow like √n for random-order
  sums, which is what differs between machines (the worst case n·eps is far looser than needed);
- ``magnitude``: the size of the values summed (max |v| for an output; defaults to the larger of
  1 and the expected tensor's largest finite absolute value);
- ``factor``: headroom for the few roundings per term (exp, the rescale, the division by l).

Low precision (fp16/bf16) is judged against PyTorch's own math at the same precision instead, when
the test has it: :func:`assert_low_precision_close`.
"""

from __future__ import annotations

import math

import torch

FACTOR = 8.0


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def bound(dtype: torch.dtype, n: int = 1, magnitude: float = 1.0, factor: float = FACTOR) -> float:
    """The absolute error allowed for a value of ``magnitude`` computed in ``dtype`` by a reduction of ``n`` terms."""
    return factor * eps(dtype) * math.sqrt(max(n, 1)) * magnitude


def magnitude_of(t: torch.Tensor) -> float:
    """max(1, the largest finite |t|): the scale a bound multiplies."""
    t = t.detach()
    if t.numel() == 0:
        return 1.0
    finite = t[torch.isfinite(t)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None, n: int = 1,
                 magnitude: float | None = None, factor: float = FACTOR, msg: str = "") -> None:
    """``actual`` equals ``expected`` (best given in float64) within :func:`bound`; NaN where
    expected is NaN and the same infinities. ``dtype``: the precision ``actual`` was computed in
    (default: its own dtype)."""
    dtype = actual.dtype if dtype is None else dtype
    mag = magnitude_of(expected) if magnitude is None else magnitude
    atol = bound(dtype, n, mag, factor)
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), atol=atol, rtol=0.0, equal_nan=True,
                               msg=lambda m: f"{msg}\n{m}\n(bound {atol:.3g} = {factor}·eps({dtype})·√{n}·{mag:.3g})")


def assert_low_precision_close(actual: torch.Tensor, expected: torch.Tensor, torch_math: torch.Tensor, *,
                               ratio: float = 2.0, n: int = 1, msg: str = "") -> None:
    """fp16/bf16: the error of ``actual`` against the float64 ``expected`` is at most ``ratio`` × the
    error of PyTorch's own math path ``torch_math`` at the same precision, plus one rounding of the
    output (so an exact ``torch_math`` does not demand an exact answer)."""
    exp = expected.detach().double()
    err = (actual.detach().double() - exp).abs().max().item()
    ref = (torch_math.detach().double() - exp).abs().max().item()
    floor = bound(actual.dtype, n, magnitude_of(exp), factor=1.0)
    assert err <= ratio * ref + floor, (
        f"{msg}: error {err:.3g} against float64 exceeds {ratio}× PyTorch math's {ref:.3g} + {floor:.3g}"
    )


def assert_paths_close(actual: torch.Tensor, other: torch.Tensor, *, dtype: torch.dtype | None = None, n: int = 1,
                       magnitude: float | None = None, msg: str = "") -> None:
    """Two paths that both round in ``dtype`` (two backends, a module and PyTorch's, one tiling and
    another): each is within :func:`bound` of the exact value, so they are within twice it of each other."""
    assert_close(actual, other, dtype=dtype, n=n, magnitude=magnitude, factor=2 * FACTOR, msg=msg)


def assert_models_close(actual: torch.Tensor, expected: torch.Tensor, *, width: int, layers: int,
                        dtype: torch.dtype | None = None, msg: str = "") -> None:
    """Two implementations of a whole model (bhqk's and transformers'), both rounding in ``dtype``:
    each of ``layers`` layers adds the error of sums of at most ``width`` terms (its widest matmul),
    and those errors add up (a LayerNorm rescales, it does not shrink them): the bound of two paths
    with √n = √width · layers."""
    assert_paths_close(actual, expected, dtype=dtype, n=width * max(layers, 1) ** 2, msg=msg)
