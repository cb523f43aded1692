"""The tiled backend's device path (what CUDA tensors take), run on the CPU with ``tiled.device_mode()``:
it equals the reference (outputs, lse, gradients of q, k, v, a dense bias and sinks) for every mask
kind and feature; its tile loops read nothing from the device (``Tensor.__bool__`` / ``item`` /
``tolist`` / ``__int__`` / ``__float__`` / ``__index__`` are counted while ``_forward_part`` and ``_backward_part``
run) and never use the worker pool; the CPU path still takes its host-checked shortcuts."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bhqk
from bhqk import masks
from bhqk.functional import prepare, reference, tiled, tiled_plan, tiled_threads
from bhqk.functional.tiled_plan import CPU_MODEL, CUDA_MODEL, device_mode, on_device, plan_for, split, workers
from conftest import mask_kinds, qkv

NAN, INF = float("nan"), float("inf")
READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")  # the ways a tensor's value reaches Python


class Reads:
    """Counts the host reads of tensors made while the tile loops run, and the worker pool's use."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loops = 0  # tile loops running now (worker threads may run several)
        self.in_loops: list[str] = []
        self.outside: list[str] = []
        self.pool_calls = 0
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        for name in ("_forward_part", "_backward_part"):
            monkeypatch.setattr(tiled, name, self._loop(getattr(tiled, name)))
        pool = tiled_threads.pool

        def counted_pool(n):
            self.pool_calls += 1
            return pool(n)

        monkeypatch.setattr(tiled_threads, "pool", counted_pool)

    def _counted(self, name, method):
        def read(t, *args, **kw):
            (self.in_loops if self.loops else self.outside).append(name)
            return method(t, *args, **kw)

        return read

    def _loop(self, part):
        def run(*args, **kw):
            self.loops += 1
            try:
                return part(*args, **kw)
            finally:
                self.loops -= 1

        return run


def both(q, k, v, mask=None, *, bias=None, sinks=None, blocks=(8, 16), dout_seed=1, lse_weight=0.5, **kw):
    """(out, lse, grads) of the tiled backend in device mode and of the reference; grads are of
    q, k, v, then a dense bias and the sinks when given."""
    results = []
    for backend in ("tiled", "reference"):
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        b = bias.detach().clone().requires_grad_(True) if isinstance(bias, torch.Tensor) else bias
        s = sinks.detach().clone().requires_grad_(True) if sinks is not None else None
        extra = dict(block_q=blocks[0], block_k=blocks[1]) if backend == "tiled" and blocks else {}
        with device_mode() if backend == "tiled" else contextlib.nullcontext():
            out, lse = bhqk.attention(*ts, mask, bias=b, sinks=s, backend=backend, return_lse=True, **kw, **extra)
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed), dtype=out.dtype)
            loss = (out * dout).sum() + lse_weight * torch.where(torch.isfinite(lse), lse, 0.0).sum()
            wrt = ts + ([b] if isinstance(b, torch.Tensor) else []) + ([s] if s is not None else [])
            results.append((out, lse, torch.autograd.grad(loss, wrt)))
    return results


def assert_same(got, want, atol=1e-10, rtol=1e-10):
    (out, lse, grads), (out_r, lse_r, grads_r) = got, want
    torch.testing.assert_close(out, out_r, atol=atol, rtol=rtol)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_r))  # -inf exactly on fully masked rows
    torch.testing.assert_close(lse.masked_fill(torch.isinf(lse), 0), lse_r.masked_fill(torch.isinf(lse_r), 0),
                               atol=atol, rtol=rtol)
    assert len(grads) == len(grads_r)
    for g, g_r in zip(grads, grads_r):
        torch.testing.assert_close(g, g_r, atol=atol, rtol=rtol)


# ---- the switch ------------------------------------------------------------------------------------


def test_device_mode_switches_workers_model_and_plan(two_threads):
    cpu = torch.device("cpu")
    assert not on_device(cpu) and on_device(torch.device("meta"))
    assert workers() == workers(cpu) == max(1, torch.get_num_threads())
    assert workers(torch.device("meta")) == 1
    p = prepare(*qkv(1, 8, None, 4096, 4096, 64, dtype=torch.float32))
    cpu_plan = plan_for(p)
    with device_mode():
        assert on_device(cpu) and workers(cpu) == 1
        assert workers() == max(1, torch.get_num_threads())  # None: a CPU call, as the registry asks today
        assert tiled_plan.model(cpu) is CUDA_MODEL
        dev_plan = plan_for(p)
    assert not on_device(cpu) and tiled_plan.model(cpu) is CPU_MODEL
    assert cpu_plan.model is CPU_MODEL and dev_plan.model is CUDA_MODEL
    assert dev_plan.tiles < cpu_plan.tiles  # bigger rectangles where each op is a launch
    assert dev_plan.computed == cpu_plan.computed == 4096 * 4096
    assert split(2, 4, workers(torch.device("meta"))) == [(slice(None), slice(None))]  # one bmm batch


def test_the_switch_is_one_flag_seen_from_both_modules():
    assert tiled.device_mode is device_mode  # tiled re-exports tiled_plan's switch
    with tiled.device_mode():
        with device_mode():  # nests
            assert on_device(torch.device("cpu"))
        assert on_device(torch.device("cpu"))
    assert not on_device(torch.device("cpu"))


def test_cpu_and_cuda_models():
    assert CPU_MODEL.tile_elems == 1 << 21
    assert CUDA_MODEL.tile_elems > CPU_MODEL.tile_elems and CUDA_MODEL.elem < CPU_MODEL.elem


# ---- no host reads inside the tile loops, no worker pool --------------------------------------------


@pytest.mark.parametrize("kind", ["none", "causal_br", "padding", "key_padding", "document", "predicate", "dense",
                                  "window|document", "~causal"])
def test_device_path_reads_nothing_in_the_tile_loops(monkeypatch, kind):
    B, H, Hkv, Q, K = 2, 4, 2, 33, 47
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, requires_grad=True)
    mask = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    bias = torch.randn(1, H, Q, K, dtype=torch.float64, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the CPU path would share this call between two workers
    try:
        reads = Reads(monkeypatch)
        with device_mode():
            out = bhqk.attention(q, k, v, mask, bias=bias, softcap=30.0, backend="tiled", block_q=8, block_k=16)
            out.sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert reads.in_loops == []
    assert reads.pool_calls == 0
    assert q.grad is not None and bias.grad is not None


def test_device_path_reads_nothing_in_the_loops_with_nonfinite_input_dropout_and_sinks(monkeypatch):
    q, k, v = qkv(2, 4, 2, 33, 47, d=8, requires_grad=False)
    k, v = k.clone(), v.clone()
    k[0, 1, 5, 2], v[1, 0, 30, 1] = INF, NAN
    q.requires_grad_(True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    reads = Reads(monkeypatch)
    with device_mode():
        out = bhqk.attention(q, k, v, masks.sliding_window(6, align="bottom_right"), sinks=sinks, dropout_p=0.2,
                             bias=bhqk.bias.alibi(4, "bottom_right"), backend="tiled", block_q=8, block_k=16)
        out[torch.isfinite(out)].sum().backward()
    assert reads.in_loops == [] and reads.pool_calls == 0


def test_device_path_per_call_reads_are_the_documented_ones(monkeypatch):
    """tiled.py's docstring: the forward reads the finiteness of k, v and q (one sum each), the
    backward the same three; structured masks of host numbers add none."""
    q, k, v = qkv(2, 4, 2, 33, 47, d=8, requires_grad=True)
    p = prepare(q.detach(), k.detach(), v.detach(), masks.causal("bottom_right") & masks.padding([40, 47]))
    reads = Reads(monkeypatch)
    with device_mode():
        plan = tiled.plan_for(p)
        assert reads.outside == []  # planning an arithmetic mask reads nothing
        out, lse = tiled.forward(p, plan)
        assert reads.outside == ["__float__"] * 3  # shapes.all_finite: float(sum) of each
        tiled.backward(p, out, lse, torch.ones_like(out), plan=plan)
    assert reads.outside == ["__float__"] * 6 and reads.in_loops == []


def test_cpu_path_still_checks_on_the_host(monkeypatch):
    """The switch is not a no-op: on the CPU path the optimistic forward reads each settled tile's
    row sums, and (with two threads and two K/V heads) the call is shared among workers."""
    q, k, v = qkv(1, 4, 2, 64, 256, d=8, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        reads = Reads(monkeypatch)
        out = bhqk.attention(q, k, v, masks.causal("bottom_right"), backend="tiled", block_q=32, block_k=32)
        out.sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert reads.in_loops.count("__bool__") > 0
    assert reads.pool_calls > 0


# ---- the device path against the reference -------------------------------------------------------------


@pytest.mark.parametrize("kind", list(mask_kinds(2, 4, 33, 47)) + ["none"])
def test_every_mask_kind(kind):
    B, H, Hkv, Q, K = 2, 4, 2, 33, 47  # Q ≠ K, GQA; block 8 × 16 divides neither
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=5)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    assert_same(*both(q, k, v, m))


@settings(max_examples=15, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), groups=st.integers(1, 3), Q=st.integers(1, 30), K=st.integers(1, 30),
    bq=st.integers(1, 16), bk=st.integers(1, 16), kind=st.sampled_from(list(mask_kinds(1, 1, 4, 4)) + ["none"]),
    seed=st.integers(0, 10_000),
)
def test_random_shapes_masks_and_blocks(B, Hkv, groups, Q, K, bq, bk, kind, seed):
    H = Hkv * groups
    q, k, v = qkv(B, H, Hkv, Q, K, 4, 3, seed=seed)
    m = None if kind == "none" else mask_kinds(B, H, Q, K, seed=seed)[kind]
    assert_same(*both(q, k, v, m, blocks=(bq, bk)))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Q, K", [(40, 40), (23, 57), (57, 23)])
def test_causal_both_alignments(align, Q, K):
    q, k, v = qkv(1, 2, None, Q, K, d=8)
    assert_same(*both(q, k, v, masks.causal(align)))


def test_combinations_and_mqa():
    B, H, Q, K = 2, 4, 37, 37
    q, k, v = qkv(B, H, 1, Q, K, d=8)  # MQA: one K/V head
    ids = torch.arange(Q)[None].expand(B, -1) * 3 // Q
    m = (masks.sliding_window(5, 2) | ~masks.document(ids)) & masks.padding([30, 37])
    assert_same(*both(q, k, v, m))


def test_dense_bias_gradient_and_alibi():
    B, H, Q, K = 2, 4, 25, 31
    q, k, v = qkv(B, H, 2, Q, K, d=8)
    bias = torch.randn(B, 1, Q, K, dtype=torch.float64)
    assert_same(*both(q, k, v, masks.causal("bottom_right"), bias=bias))
    assert_same(*both(q, k, v, masks.causal("bottom_right"), bias=bhqk.bias.alibi(H, "bottom_right")))


def test_softcap_and_sinks():
    q, k, v = qkv(2, 4, 2, 29, 45, d=8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    assert_same(*both(q, k, v, masks.sliding_window(7, align="top_left"), sinks=sinks, softcap=5.0))


def test_a_large_score_range_exercises_lazy_rescaling():
    """Rows whose max grows by far more than TAU across a row group's rectangles (scores ~ ±300)."""
    q, k, v = qkv(1, 2, None, 48, 96, d=8)
    k = k * torch.linspace(0.1, 40.0, 96, dtype=torch.float64)[:, None]  # later keys: larger scores
    assert_same(*both(q, k, v, blocks=(16, 16)), atol=1e-9, rtol=1e-9)


def test_planner_choice_without_given_blocks():
    q, k, v = qkv(1, 4, 2, 300, 300, d=8)
    assert_same(*both(q, k, v, masks.sliding_window(40), blocks=None))


def test_dropout_drops_what_the_cpu_path_drops():
    B, H, Hkv, Q, K, p = 2, 4, 2, 29, 45, 0.3
    q, k, v = qkv(B, H, Hkv, Q, K, d=8, dv=6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    got = []
    for forced in (True, False):
        ts = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        torch.manual_seed(7)
        with device_mode() if forced else contextlib.nullcontext():
            out, lse = bhqk.attention(*ts[:3], masks.causal("bottom_right"), sinks=ts[3], dropout_p=p, backend="tiled",
                                      return_lse=True, block_q=8, block_k=16)
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
            got.append((out, lse, torch.autograd.grad((out * dout).sum() + 0.5 * lse.sum(), ts)))
    assert_same(*got, atol=1e-12, rtol=1e-12)
    torch.manual_seed(7)
    keep = tiled.dropout_keep(tiled.dropout_seed(), B, H, Q, K, p)
    want, _ = reference.run(prepare(q, k, v, masks.causal("bottom_right"), dropout_p=p, sinks=sinks), True, keep=keep)
    torch.testing.assert_close(got[0][0], want, atol=1e-12, rtol=1e-12)


def test_fully_masked_rows():
    Q, K = 20, 30
    q, k, v = qkv(2, 2, None, Q, K, d=8)
    allowed = torch.rand(2, 1, Q, K, generator=torch.Generator().manual_seed(3)) > 0.5
    allowed[0, 0, 3] = False
    allowed[1, 0, 11:14] = False
    got, want = both(q, k, v, allowed)
    assert_same(got, want)
    assert (got[0][0, :, 3] == 0).all() and torch.isinf(got[1][1, :, 12]).all()


@pytest.mark.parametrize("B, Q, K", [(0, 5, 7), (2, 0, 7), (2, 5, 0)])
def test_empty_sizes(B, Q, K):
    q, k, v = qkv(B, 2, None, Q, K, d=8)
    with device_mode():
        out, lse = bhqk.attention(q, k, v, backend="tiled", return_lse=True)
    assert out.shape == (B, 2, Q, 8) and (out == 0).all() and (lse == -INF).all()


# ---- non-finite input: the decided behaviour of tests/test_edges.py, on the device path ----------------


def _banded(Q, K):
    i, j = torch.arange(Q)[:, None], torch.arange(K)[None]
    return (j - i).abs() <= 2  # [Q, K]: key j is attended by rows j-2 … j+2 only


@pytest.mark.parametrize("poison", [NAN, INF, -INF])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 8)])
def test_nonfinite_value_reaches_only_rows_that_attend_it(poison, blocks):
    Q = K = 40
    q, k, v = qkv(2, 4, 2, Q, K, 8, dtype=torch.float32)
    allowed, j = _banded(Q, K), 20
    v[0, 1, j, 3] = poison  # K/V head 1 serves query heads 2, 3
    with device_mode():
        out = bhqk.attention(q, k, v, allowed, backend="tiled", block_q=blocks[0], block_k=blocks[1])
    attends = allowed[:, j]  # [Q]
    clean = bhqk.attention(q, k, v.nan_to_num(0.0, 0.0, 0.0), allowed, backend="reference")
    assert not torch.isfinite(out[0, 2:, attends, 3]).any()
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[0, 2:, attends, 3] = False
    assert torch.isfinite(out[rest]).all()
    torch.testing.assert_close(out[rest], clean[rest])


@pytest.mark.parametrize("poison", [INF, -INF, NAN])
def test_nonfinite_key_never_reaches_rows_that_cannot_attend_it(poison):
    Q = K = 40
    q, k, v = qkv(2, 4, 2, Q, K, 8, dtype=torch.float64)
    allowed = _banded(Q, K)
    k[1, 0, 7] = poison
    ts = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with device_mode():
        out = bhqk.attention(*ts, allowed, backend="tiled", block_q=8, block_k=16)
        out[torch.isfinite(out)].sum().backward()
    rows = ~allowed[:, 7]
    clean = bhqk.attention(q, k.nan_to_num(0.0, 0.0, 0.0), v, allowed, backend="reference")
    assert torch.isfinite(out[1, :2, rows]).all()
    torch.testing.assert_close(out[1, :2, rows], clean[1, :2, rows])
    torch.testing.assert_close(out[0], clean[0])
    assert torch.isfinite(ts[0].grad[0]).all() and torch.isfinite(ts[0].grad[1, :2, rows]).all()


def test_nonfinite_value_gradients_stay_with_rows_that_attend_it():
    Q = K = 40
    q, k, v = qkv(1, 2, None, Q, K, 8, dtype=torch.float64)
    allowed = _banded(Q, K)
    v[0, 0, 20] = NAN
    q.requires_grad_(True)
    with device_mode():
        out = bhqk.attention(q, k, v, allowed, backend="tiled", block_q=8, block_k=16)
        out[torch.isfinite(out)].sum().backward()
    rows = ~allowed[:, 20]
    assert torch.isfinite(q.grad[0, 0, rows]).all() and torch.isfinite(q.grad[0, 1]).all()


def test_the_problem_is_unchanged_by_the_mode():
    """device_mode changes the path, never the call: the same Problem gives the same numbers."""
    q, k, v = qkv(1, 2, None, 30, 30, d=8)
    p = prepare(q, k, v, masks.causal())
    with device_mode():
        dev = tiled.forward(dataclasses.replace(p))
    cpu = tiled.forward(p)
    torch.testing.assert_close(dev, cpu, atol=1e-12, rtol=1e-12)


# ---- masks and biases staged on the device once per pass ----------------------------------------------


def _public_tensors(x):
    """Every public tensor attribute of a mask or bias tree."""
    out = []
    for name, value in vars(x).items():
        if isinstance(value, torch.Tensor) and not name.startswith("_"):
            out.append(value)
        elif isinstance(value, (masks.Mask, bhqk.bias.Bias)):
            out += _public_tensors(value)
    return out


@pytest.mark.parametrize("kind", list(mask_kinds(2, 4, 33, 47)))
def test_masks_and_biases_are_staged_on_the_device(kind):
    """The ``meta`` device stands in for a GPU: every tensor a tile reads is moved there once, the
    caller's mask and bias are left as they were, and the staged blocks have the same shape."""
    B, H, Q, K = 2, 4, 33, 47
    m = mask_kinds(B, H, Q, K)[kind]
    b = bhqk.bias.alibi(H, "top_left") + bhqk.bias.dense(torch.randn(B, 1, Q, K))
    before = [t.device for t in _public_tensors(m) + _public_tensors(b)]
    meta = torch.device("meta")
    sm, sb = m.staged(meta), b.staged(meta)
    assert all(t.device == meta for t in _public_tensors(sm) + _public_tensors(sb))
    assert [t.device for t in _public_tensors(m) + _public_tensors(b)] == before  # the caller's are untouched
    assert sb is not b and b.staged(torch.device("cpu")) is b  # nothing to move: the same object
    ext = masks.Extent(B, H, Q, K)
    cpu = torch.device("cpu")
    for staged, orig, what in ((sm, m, "block"), (sb, b, "block")):
        tile, want = getattr(staged, what)(ext, 8, 16, 16, 32, meta), getattr(orig, what)(ext, 8, 16, 16, 32, cpu)
        assert tile.device == meta and tile.shape == want.shape and tile.dtype == want.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_matches_the_cpu_path(dtype):
    q, k, v = (t.to(dtype) for t in qkv(2, 4, 2, 40, 64, d=16))
    m = masks.causal("bottom_right")
    with device_mode():
        dev, dev_lse = bhqk.attention(q, k, v, m, backend="tiled", return_lse=True, block_q=16, block_k=16)
    cpu, cpu_lse = bhqk.attention(q, k, v, m, backend="tiled", return_lse=True, block_q=16, block_k=16)
    assert dev.dtype == dtype and dev_lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dev, cpu, atol=tol, rtol=tol)
    torch.testing.assert_close(dev_lse, cpu_lse, atol=1e-5, rtol=1e-5)
