"""Property-based fuzz of the public surface: random shapes, dtypes, masks, scales, biases, layouts,
backends, non-finite values and bad arguments into attention / attention_weights / masks /
MultiHeadAttention.

Oracle: either the answer of the fp64 formula written below (independently of the library: its own
mask semantics, its own softmax), or a ValueError/TypeError subclass whose message names the
argument — never another exception type, a NaN the formula does not have, or a hang.

Bounded: derandomized, a few dozen examples per test. ``BHQK_FUZZ_EXAMPLES=500`` runs more, with
fresh random examples.

Numerical edges (NaN/inf in a value a row may not attend, +inf in a key, a ``finfo.min`` bias,
scale/softcap/bias non-finite or not numbers, K = 0) live in
``test_fuzz_nonfinite_values_in_unattended_keys`` and ``test_kernel_cases``.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import bhqk
from bhqk import masks
from bhqk.errors import BackendError
from tolerance import assert_close

_MORE = int(os.environ.get("BHQK_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_MORE or 40, deadline=None, derandomize=not _MORE, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BACKENDS = ["reference", "tiled", "torch", "auto", "spans"]


@contextmanager
def no_hang(seconds: float = 30.0):
    """Fail (instead of hanging the suite) if the body takes longer than ``seconds``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def boom(*_):
        raise TimeoutError(f"call did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --- the fp64 formula, written without the library ---------------------------------------------

def formula(q, k, v, allowed, bias=None, scale=None, softcap=None):
    """q [B, H, Q, d], k [B, Hkv, K, d], v [B, Hkv, K, dv], allowed bool broadcastable to [B, H, Q, K].
    Returns (out [B, H, Q, dv], P [B, H, Q, K]) in float64. A key a row may not attend takes no part
    in that row (whatever its k or v hold); a row with no key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Q, d = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=1)  # [B, H, K, d]
    v = v.repeat_interleave(H // Hkv, dim=1)  # [B, H, K, dv]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    allowed = allowed.expand(B, H, Q, K)
    S = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if bias is not None:
        S = S + bias.double()
        allowed = allowed & (bias.double() != -math.inf)
    S = torch.where(allowed, S, torch.zeros((), dtype=S.dtype))  # masked scores never enter the sums
    m = torch.where(allowed, S, torch.full((), -math.inf, dtype=S.dtype)).amax(-1, keepdim=True) if K else S.sum(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=S.dtype))
    e = torch.where(allowed, torch.exp(S - m), torch.zeros((), dtype=S.dtype))
    P = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    P = torch.where(allowed, P, torch.zeros((), dtype=S.dtype))
    vz = torch.where(allowed[..., None], v[:, :, None], torch.zeros((), dtype=v.dtype))  # [B, H, Q, K, dv]
    out = (P[..., None] * vz).sum(-2)
    return out, P


def _finite_max(t) -> float:
    t = t.detach().double()
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def scores_size(q, k, scale=None, softcap=None, bias=None) -> float:
    """An upper bound of |S| that rounding acts on: |q·kᵀ·scale| ≤ d·max|q|·max|k|·scale (softcap:
    at most softcap), plus the largest bias entry of ordinary size (a huge bias uniform over a row,
    ``finfo.min`` padding, cancels in the softmax)."""
    d = q.shape[-1]
    s = d * _finite_max(q) * _finite_max(k) * (1.0 / math.sqrt(d) if scale is None else abs(scale))
    s = min(s, softcap) if softcap is not None else s
    if bias is not None and isinstance(bias, torch.Tensor):
        b = bias.detach().double()
        s += _finite_max(b[b.abs() < 1e4])
    return s


def check_against(got, want, dtype, what, *, n, magnitude):
    """Wherever the formula is finite, ``got`` equals it within tests/tolerance.py's bound for sums
    of ``n`` terms of ``magnitude`` (rounding S by eps·|S| scales every weight by 1 ± eps·|S|:
    magnitude = max|v|·(1 + max|S|)); where the formula is NaN (a row attends a NaN), anything goes."""
    got = got.double()
    finite = torch.isfinite(want)
    assert not bool(torch.isnan(got[finite]).any()), f"{what}: NaN where the formula has none"
    assert_close(got[finite], want[finite], dtype=dtype, n=n, magnitude=magnitude, msg=what)


def out_size(q, k, v, **kw) -> float:
    return max(1.0, _finite_max(v)) * (1.0 + scores_size(q, k, **kw))


# --- masks, each with its own independent meaning ------------------------------------------------

@st.composite
def mask_and_meaning(draw, B, Q, K, depth=0):
    """(mask for the library, bool [B, 1, Q, K] computed here from the mask's definition)."""
    qi = torch.arange(Q)[:, None]  # [Q, 1]
    kj = torch.arange(K)[None, :]  # [1, K]
    kinds = ["none", "causal", "padding", "window", "dense", "predicate", "document", "prefix"]
    if depth < 1:
        kinds += ["and", "or", "not"]
    kind = draw(st.sampled_from(kinds))
    full = torch.ones(B, 1, Q, K, dtype=torch.bool)
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    off = 0 if align == "top_left" else K - Q
    if kind == "none":
        return None, full
    if kind == "causal":
        return masks.causal(align), (kj <= qi + off).expand(B, 1, Q, K)
    if kind == "padding":
        lengths = draw(st.lists(st.integers(0, K + 2), min_size=B, max_size=B))
        as_list = draw(st.booleans())
        m = masks.padding(lengths if as_list else torch.tensor(lengths))
        return m, (kj[None, None] < torch.tensor(lengths)[:, None, None, None]).expand(B, 1, Q, K)
    if kind == "window":
        left, right = draw(st.integers(0, 4)), draw(st.integers(0, 2))
        pos = qi + off
        return masks.sliding_window(left, right, align=align), ((kj >= pos - left) & (kj <= pos + right)).expand(B, 1, Q, K)
    if kind == "dense":
        bits = draw(st.lists(st.booleans(), min_size=B * Q * K, max_size=B * Q * K))
        t = torch.tensor(bits, dtype=torch.bool).reshape(B, 1, Q, K)
        if Q == K and Q > 1:
            t[:, :, 0, 0] = True  # keep clear of the nn.MultiheadAttention-polarity warning
        return masks.dense(t), t
    if kind == "predicate":
        a = draw(st.integers(1, 3))
        return masks.predicate(lambda b, h, q, k: (q + k) % a != 0, "mod"), ((qi + kj) % a != 0).expand(B, 1, Q, K)
    if kind == "document":
        qd = sorted(draw(st.lists(st.integers(0, 2), min_size=Q, max_size=Q)))
        kd = sorted(draw(st.lists(st.integers(0, 2), min_size=K, max_size=K)))
        qt, kt = torch.tensor(qd), torch.tensor(kd)
        return masks.document(qt, kt), (qt[:, None] == kt[None, :]).expand(B, 1, Q, K)
    if kind == "prefix":
        p = draw(st.integers(0, K))
        return masks.prefix_lm(p, align=align), ((kj < p) | (kj <= qi + off)).expand(B, 1, Q, K)
    a, ma = draw(mask_and_meaning(B, Q, K, depth + 1))
    if kind == "not":
        a = a if a is not None else masks.dense(torch.ones(Q, K, dtype=torch.bool))
        return ~a, ~ma
    b, mb = draw(mask_and_meaning(B, Q, K, depth + 1))
    a = a if a is not None else masks.dense(torch.ones(Q, K, dtype=torch.bool))
    b = b if b is not None else masks.dense(torch.ones(Q, K, dtype=torch.bool))
    return (a & b, ma & mb) if kind == "and" else (a | b, ma | mb)


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    Q, K = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d, dv = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, H, Q, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, K, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, K, dv, generator=g, dtype=dtype)
    mask, allowed = draw(mask_and_meaning(B, Q, K))
    scale = draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False)))
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 30.0)))
    bias = None
    if draw(st.booleans()):
        bias = torch.randn(1, H, Q, K, generator=g, dtype=dtype)
        if draw(st.booleans()):  # -inf entries remove keys, like a mask
            bias = bias.masked_fill(torch.rand(1, H, Q, K, generator=g) < 0.3, -math.inf)
    # a NaN key a row may not attend: placed where no row of that batch element attends
    unseen = ~allowed.any(2, keepdim=True).expand(B, 1, Q, K)[:, 0, 0]  # [B, K] keys nobody attends
    if bias is not None:
        unseen = unseen & False  # a bias -inf is per head and row: keep it simple, no NaN
    if draw(st.booleans()) and bool(unseen.any()):
        k = k.clone()
        k[unseen[:, None, :, None].expand_as(k[..., :1]).expand_as(k)] = math.nan
    layout = draw(st.sampled_from(["bhnd", "bnhd"]))
    backend = draw(st.sampled_from(BACKENDS))
    return dict(q=q, k=k, v=v, mask=mask, allowed=allowed, scale=scale, softcap=softcap, bias=bias,
                layout=layout, backend=backend, dtype=dtype)


def _to_layout(t, layout):
    return t.transpose(1, 2) if layout == "bnhd" else t  # [B, H, N, d] <-> [B, N, H, d]


@FUZZ
@given(problems())
def test_fuzz_attention_matches_fp64_formula(p):
    want, P = formula(p["q"], p["k"], p["v"], p["allowed"], p["bias"], p["scale"], p["softcap"])
    lay = p["layout"]
    args = [_to_layout(p[n], lay) for n in ("q", "k", "v")]
    kw = dict(bias=p["bias"], scale=p["scale"], softcap=p["softcap"], layout=lay)
    with no_hang():
        try:
            out = bhqk.attention(*args, p["mask"], backend=p["backend"], **kw)
        except BackendError as e:  # an explicit backend may refuse a call, saying why
            assert p["backend"] != "auto" and ("softcap" in str(e) or "cannot take" in str(e)), e
        else:
            check_against(_to_layout(out, lay), want, p["dtype"], f"attention[{p['backend']}]", n=p["k"].shape[2],
                          magnitude=out_size(p["q"], p["k"], p["v"], scale=p["scale"], softcap=p["softcap"], bias=p["bias"]))
        weights = bhqk.attention_weights(args[0], args[1], p["mask"], **kw)
    check_against(weights, P, p["dtype"], "attention_weights", n=p["k"].shape[2],
                  magnitude=1.0 + scores_size(p["q"], p["k"], scale=p["scale"], softcap=p["softcap"], bias=p["bias"]))


# --- bad arguments: a ValueError/TypeError naming the argument ------------------------------------

def _qkv():
    return torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)


BAD_CALLS = {
    # name the message must contain -> call
    "mask": [
        lambda q, k, v: bhqk.attention(q, k, v, torch.ones(3, 5, dtype=torch.long)),
        lambda q, k, v: bhqk.attention(q, k, v, torch.ones(3, 5)),
        lambda q, k, v: bhqk.attention(q, k, v, [[True]]),
        lambda q, k, v: bhqk.attention(q, k, v, torch.ones(4, 5, dtype=torch.bool)),
        lambda q, k, v: bhqk.attention(q, k, v, torch.ones(2, 1, 1, 3, 5, dtype=torch.bool)),
        lambda q, k, v: bhqk.attention_weights(q, k, torch.ones(3, 6, dtype=torch.bool)),
    ],
    "bias": [
        lambda q, k, v: bhqk.attention(q, k, v, bias=torch.ones(3, 5, dtype=torch.bool)),
        lambda q, k, v: bhqk.attention(q, k, v, bias=torch.full((3, 5), math.nan)),
        lambda q, k, v: bhqk.attention(q, k, v, bias=torch.zeros(4, 5)),
        lambda q, k, v: bhqk.attention(q, k, v, bias=[[0.0]]),
    ],
    "softcap": [lambda q, k, v: bhqk.attention(q, k, v, softcap=0.0), lambda q, k, v: bhqk.attention(q, k, v, softcap=-1.0),
                lambda q, k, v: bhqk.attention(q, k, v, softcap=math.nan)],
    "dropout_p": [lambda q, k, v: bhqk.attention(q, k, v, dropout_p=1.0), lambda q, k, v: bhqk.attention(q, k, v, dropout_p=-0.1),
                  lambda q, k, v: bhqk.attention(q, k, v, dropout_p=math.nan)],
    "layout": [lambda q, k, v: bhqk.attention(q, k, v, layout="bqhd")],
    "backend": [lambda q, k, v: bhqk.attention(q, k, v, backend="fast"), lambda q, k, v: bhqk.attention(q, k, v, backend=3)],
    "block_q": [lambda q, k, v: bhqk.attention(q, k, v, backend="tiled", block_q=0),
                lambda q, k, v: bhqk.attention(q, k, v, backend="tiled", block_q=2.5)],
    "q": [lambda q, k, v: bhqk.attention(q.long(), k, v), lambda q, k, v: bhqk.attention(q.tolist(), k, v),
          lambda q, k, v: bhqk.attention(q[0], k, v)],
    "k": [lambda q, k, v: bhqk.attention(q, k.half(), v), lambda q, k, v: bhqk.attention(q, k[..., :3], v),
          lambda q, k, v: bhqk.attention(q, torch.randn(2, 2, 5, 4), v)],
    "v": [lambda q, k, v: bhqk.attention(q, k, v[:, :, :4]), lambda q, k, v: bhqk.attention(q, k, v[:, :1].expand(1, 3, 5, 4))],
    "lengths": [lambda *_: masks.padding(2.5), lambda *_: masks.padding("3"), lambda *_: masks.padding(torch.tensor([1.0])),
                lambda *_: masks.padding([1, -2]), lambda *_: masks.padding(True)],
    "left": [lambda *_: masks.sliding_window("3"), lambda *_: masks.sliding_window(-1), lambda *_: masks.sliding_window(1.5)],
    "align": [lambda *_: masks.causal("top"), lambda *_: masks.sliding_window(2, align=0),
              lambda *_: masks.prefix_lm(1, align="x"),
              lambda q, k, v: bhqk.attention(q, k, v, masks.causal())],  # Q ≠ K needs an alignment
    "prefix_len": [lambda *_: masks.prefix_lm(-1), lambda *_: masks.prefix_lm(0.5)],
    "predicate": [lambda q, k, v: bhqk.attention(q, k, v, masks.predicate(lambda b, h, i, j: i - j)),
                  lambda q, k, v: bhqk.attention(q, k, v, masks.predicate(lambda b, h, i, j: torch.ones(7, dtype=torch.bool)))],
    "key_padding_mask": [lambda *_: masks.from_torch_mha(key_padding_mask=torch.zeros(2, 3), num_heads=1)],
    "keyword": [lambda *_: masks.from_torch_mha(torch.zeros(3, 3, dtype=torch.bool), num_heads=1)],
    "num_heads": [lambda *_: bhqk.MultiHeadAttention(16, 0), lambda *_: bhqk.MultiHeadAttention(16, -4),
                  lambda *_: bhqk.MultiHeadAttention(16, 2.0), lambda *_: masks.from_torch_mha(num_heads=0)],
    "d_model": [lambda *_: bhqk.MultiHeadAttention(-16, 4), lambda *_: bhqk.MultiHeadAttention("16", 4)],
    "D=": [lambda *_: bhqk.MultiHeadAttention(10, 4)],
    "dropout": [lambda *_: bhqk.MultiHeadAttention(16, 4, dropout=2.0)],
    "x": [lambda *_: bhqk.MultiHeadAttention(16, 4)(torch.randn(1, 3, 16, dtype=torch.float64)),
          lambda *_: bhqk.MultiHeadAttention(16, 4)(torch.randn(1, 3, 15)),
          lambda *_: bhqk.MultiHeadAttention(16, 4)(torch.randn(3, 16))],
    "materialize": [lambda *_: masks.causal().materialize(1, 1, -1, 3), lambda *_: masks.causal().materialize(1, 1, 2.5, 3)],
}
BAD = [(name, i) for name, calls in BAD_CALLS.items() for i in range(len(calls))]


@settings(FUZZ, max_examples=_MORE or 60)
@given(st.sampled_from(BAD), st.sampled_from([torch.float32, torch.float64]))
def test_fuzz_bad_arguments_name_the_argument(case, dtype):
    name, i = case
    q, k, v = (t.to(dtype) for t in _qkv())
    with no_hang(), pytest.raises((ValueError, TypeError)) as e:
        BAD_CALLS[name][i](q, k, v)
    assert name in str(e.value), f"{type(e.value).__name__} does not name {name!r}: {e.value}"


# --- the cases the kernel branch fixes ------------------------------------------------------------

@st.composite
def nonfinite_in_unattended_values(draw):
    """Random keys hold NaN or ±inf in v (and sometimes k) under a per-row mask (causal, window,
    padding): rows that attend such a key are NaN in the formula (anything goes there); every other
    row must equal the formula, whatever the tile size."""
    B, H, Q, d = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(2, 12)), draw(st.integers(1, 8))
    K = draw(st.integers(Q, 40))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=dtype) for n in (Q, K, K))
    kind = draw(st.sampled_from(["causal", "window", "padding"]))
    qi, kj = torch.arange(Q)[:, None] + (K - Q), torch.arange(K)[None, :]  # bottom_right positions
    if kind == "causal":
        mask, allowed = masks.causal("bottom_right"), (kj <= qi)
    elif kind == "window":
        w = draw(st.integers(0, 5))
        mask, allowed = masks.sliding_window(w, align="bottom_right"), (kj <= qi) & (kj >= qi - w)
    else:
        lengths = draw(st.lists(st.integers(1, K), min_size=B, max_size=B))
        mask = masks.padding(lengths)
        allowed = torch.arange(K)[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]
    for j in draw(st.lists(st.integers(0, K - 1), min_size=1, max_size=3)):
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        v[:, :, j] = bad
        if draw(st.booleans()):
            k[:, :, j] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    block = draw(st.sampled_from([None, 1, 3, 16]))
    return q, k, v, mask, allowed, dtype, draw(st.sampled_from(["reference", "tiled", "torch", "auto"])), block


@settings(FUZZ, max_examples=_MORE or 25, phases=[Phase.explicit, Phase.generate])
@given(nonfinite_in_unattended_values())
def test_fuzz_nonfinite_values_in_unattended_keys(case):
    q, k, v, mask, allowed, dtype, backend, block = case
    want, _ = formula(q, k, v, allowed)
    opts = {"block_q": block, "block_k": block} if backend == "tiled" and block else {}
    with no_hang():
        out = bhqk.attention(q, k, v, mask, backend=backend, **opts)
    check_against(out, want, dtype, f"attention[{backend}]", n=k.shape[2], magnitude=out_size(q, k, v))


def _finfo_min_row(backend, dtype):
    """Hugging Face's padding idiom: a bias of finfo.min on every key of a row gives the mean of v
    (every key equally likely), as the formula says, on every backend."""
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=dtype) for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4, dtype=dtype)
    bias[..., 1, :] = torch.finfo(dtype).min
    want, _ = formula(q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool), bias.double().clamp_min(-1e300))
    check_against(bhqk.attention(q, k, v, bias=bias, backend=backend), want, dtype, backend, n=4, magnitude=out_size(q, k, v))


def _nan_v_unattended(backend):
    q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    v[:, :, 3] = math.nan  # key 3 is attended by the last query only under causal
    want, _ = formula(q, k, v, torch.ones(4, 4, dtype=torch.bool).tril())
    check_against(bhqk.attention(q, k, v, masks.causal(), backend=backend), want, torch.float64, backend, n=4,
                  magnitude=out_size(q, k, v))


def _names(argument, call):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError)) as e:
        call(q, k, v)
    assert argument in str(e.value), e.value


def _k_zero(fn):
    """K = 0, as decided (docs/design.md §2): every row is fully masked, so the output is 0 of the
    right shape (attention: [B, H, Q, dv]; weights: [B, H, Q, 0])."""
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 5)
    out = fn(q, k, v)
    want = torch.zeros(1, 2, 3, 5) if out.shape[-1] == 5 else torch.zeros(1, 2, 3, 0)
    assert out.shape == want.shape and bool((out == 0).all())


KERNEL_CASES = {
    "nan v unattended, reference": lambda: _nan_v_unattended("reference"),
    "nan v unattended, tiled": lambda: _nan_v_unattended("tiled"),
    "nan v unattended, torch": lambda: _nan_v_unattended("torch"),
    "finfo.min bias row, tiled fp32": lambda: _finfo_min_row("tiled", torch.float32),
    "finfo.min bias row, tiled bf16": lambda: _finfo_min_row("tiled", torch.bfloat16),
    "scale=nan": lambda: _names("scale", lambda q, k, v: bhqk.attention(q, k, v, scale=math.nan)),
    "scale=inf": lambda: _names("scale", lambda q, k, v: bhqk.attention(q, k, v, scale=math.inf)),
    "scale='x'": lambda: _names("scale", lambda q, k, v: bhqk.attention(q, k, v, scale="x")),
    "softcap=inf": lambda: _names("softcap", lambda q, k, v: bhqk.attention(q, k, v, softcap=math.inf)),
    "softcap='a'": lambda: _names("softcap", lambda q, k, v: bhqk.attention(q, k, v, softcap="a")),
    "dropout_p='a'": lambda: _names("dropout_p", lambda q, k, v: bhqk.attention(q, k, v, dropout_p="a")),
    "bias +inf": lambda: _names("bias", lambda q, k, v: bhqk.attention(q, k, v, bias=torch.full((3, 5), math.inf))),
    "weights scale=nan": lambda: _names("scale", lambda q, k, v: bhqk.attention_weights(q, k, scale=math.nan)),
    "K=0 reference": lambda: _k_zero(lambda q, k, v: bhqk.attention(q, k, v, backend="reference")),
    "K=0 auto padding(0)": lambda: _k_zero(lambda q, k, v: bhqk.attention(q, k, v, masks.padding(0))),
    "K=0 attention_weights": lambda: _k_zero(lambda q, k, v: bhqk.attention_weights(q, k)),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_cases(case):
    with no_hang():
        KERNEL_CASES[case]()
