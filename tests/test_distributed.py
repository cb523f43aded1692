"""Ring attention on real torch.distributed (gloo, 127.0.0.1) against single-process bhqk.attention.

Processes are started once per world size (2 and 4), both worlds at once, forked from one server that
imported torch and bhqk once (multiprocessing's forkserver; spawned where there is none); each worker runs every case
and writes what it measured, and the tests below judge it. The world of 4 then splits into two pairs
with a 3 s timeout, where a peer stalls (ranks 0, 1) or dies (ranks 2, 3): no world is spawned for
them alone. The pure parts (sharding, mask views) are tested in-process.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import bhqk
from bhqk import masks
from bhqk.distributed import RingMultiHeadAttention, gather, index_map, padded_length, positions, ring_attention, shard, unshard
from bhqk.errors import MaskError, ShapeError
from bhqk.masks import Extent, Tile
from bhqk.masks.view import IndexMap, View
from conftest import mask_kinds, qkv
from tolerance import FACTOR, bound

SCHEMES = ["contiguous", "zigzag", "striped"]


# ---------------------------------------------------------------- sharding and views (no processes)


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 5), c=st.integers(1, 4), scheme=st.sampled_from(SCHEMES), dim=st.integers(0, 2))
def test_shard_then_unshard_is_the_identity(P, c, scheme, dim):
    n = padded_length(c * P, P, scheme)
    shape = [2, 3, 4]
    shape[dim] = n
    x = torch.randn(shape)
    pieces = [shard(x, r, P, dim=dim, scheme=scheme) for r in range(P)]
    assert all(p.shape[dim] == n // P for p in pieces)
    assert torch.equal(unshard(pieces, dim=dim, scheme=scheme), x)
    for r, p in enumerate(pieces):  # each shard holds exactly the positions its index map names
        assert torch.equal(p, x.index_select(dim, positions(n, r, P, scheme)))


def test_zigzag_and_striped_positions():
    assert positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert positions(16, 1, 4, "striped").tolist() == [1, 5, 9, 13]
    assert positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]


def test_uneven_sequence_is_a_shape_error_that_says_how_to_pad():
    with pytest.raises(ShapeError, match=r"multiple of 8.*Pad it to 16.*padding\(10\)"):
        shard(torch.zeros(1, 1, 10, 4), 0, 4, scheme="zigzag")
    with pytest.raises(ValueError, match="sharding must be one of"):
        shard(torch.zeros(1, 1, 8, 4), 0, 4, scheme="blocky")
    assert padded_length(10, 4, "zigzag") == 16 and padded_length(10, 4, "striped") == 12


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("Q,K", [(16, 16), (8, 24)])
def test_a_view_of_a_global_mask_is_the_global_mask_at_the_shard_positions(scheme, Q, K):
    B, H, P = 2, 3, 2
    ext = Extent(B, H, Q, K)
    for name, m in mask_kinds(B, H, Q, K).items():
        full = m.materialize(B, H, Q, K).expand(B, H, Q, K)
        for r in range(P):
            qm = index_map(Q, r, P, scheme)
            for s in range(P):
                for a, b in [(0, K // P), (1, 4), (3, K // P)]:  # whole key shards and pieces of them
                    km = index_map(K, s, P, scheme).narrow(a, b)
                    view = View(m, ext, qm, km)
                    want = full[:, :, qm.positions()][:, :, :, km.positions()]
                    got = view.materialize(B, H, qm.n, km.n).expand_as(want)
                    assert torch.equal(got, want), (name, r, s, a, b)
                    loc = Extent(B, H, qm.n, km.n)
                    for q0, q1, k0, k1 in [(0, qm.n, 0, km.n), (1, 3, 0, 2), (2, qm.n, 1, km.n)]:
                        tile = want[:, :, q0:q1, k0:k1]
                        t = view.classify(loc, q0, q1, k0, k1)  # never wrong
                        assert t is not Tile.EMPTY or not tile.any(), (name, r, s)
                        assert t is not Tile.FULL or tile.all(), (name, r, s)


def test_views_skip_empty_pairs_of_a_contiguous_causal_mask():
    ext = Extent(1, 1, 16, 16)
    qm = index_map(16, 0, 4, "contiguous")
    km = index_map(16, 2, 4, "contiguous")
    assert View(masks.causal(), ext, qm, km).classify(Extent(1, 1, 4, 4), 0, 4, 0, 4) is Tile.EMPTY
    assert View(masks.causal(), ext, km, qm).classify(Extent(1, 1, 4, 4), 0, 4, 0, 4) is Tile.FULL


def test_a_view_names_what_does_not_fit():
    with pytest.raises(MaskError, match="index maps cover"):
        View(masks.causal(), Extent(1, 1, 8, 8), IndexMap.identity(4), IndexMap.identity(8))


def test_without_a_process_group_ring_attention_says_what_to_do():
    assert not dist.is_initialized()
    q, k, v = qkv(1, 2, None, 4, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, k, v)


def test_ring_module_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="no attention dropout"):
        RingMultiHeadAttention(16, 4, dropout=0.1)
    with pytest.raises(ValueError, match="sharding must be one of"):
        RingMultiHeadAttention(16, 4, sharding="blocky")
    m = RingMultiHeadAttention(16, 4)
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="cannot return weights"):
        m(x, return_weights=True)
    with pytest.raises(ValueError, match="no additive bias"):
        m(x, bias=torch.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match="no KV cache"):
        m(x, cache=object())


# ---------------------------------------------------------------- spawning workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(world: int, outdir):
    """Start ``_worker`` in ``world`` processes (not waiting for them). Where the platform has it, they
    are forked from one server process that has imported this module (torch, bhqk) once, so no worker
    pays seconds of imports of its own; the server itself has run no torch op (no threads to fork)."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload([__name__])
    return mp.start_processes(_worker, args=(world, _free_port(), str(outdir)), nprocs=world, start_method=method,
                              join=False)


def _join(ctx, world: int, outdir, deadline: float) -> dict[str, list[dict | None]]:
    """Wait for a world started by :func:`_start`; what each rank wrote, by file stem and rank (None:
    that rank exited before writing)."""
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"workers (world {world}) still running at their deadline")
    read = lambda f: json.loads(f.read_text()) if f.exists() else None  # noqa: E731
    out = {"cases": [read(outdir / f"{r}.json") for r in range(world)]}
    if world == 4:
        out.update({s: [read(outdir / f"{s}-{r}.json") for r in range(2)] for s in ("hang", "die")})
    return out


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name, fn in CASES.items():
        try:
            results[name] = {"ok": True, **fn(rank, world)}
        except Exception as e:  # recorded; the test that reads it fails with the message
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    if world != 4:
        dist.destroy_process_group()
        return
    # two pairs with a short timeout: in one a peer stalls, in the other it dies
    short = datetime.timedelta(seconds=3)
    pairs = [dist.new_group([0, 1], timeout=short), dist.new_group([2, 3], timeout=short)]  # every rank creates both
    scenario = "hang" if rank < 2 else "die"
    result = _peer_failure(rank % 2, scenario, outdir, pairs[rank // 2])
    with open(os.path.join(outdir, f"{scenario}-{rank % 2}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip tearing down groups whose peer is gone


# ---------------------------------------------------------------- the cases each worker runs


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| relative to max(1, max |b|)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max())) if a.numel() else 0.0


def _compare(rank, world, *, B=2, H=4, Hkv=None, Q=48, K=None, d=8, dv=None, dtype=torch.float64, mask=None,
             scheme="zigzag", layout="bhnd", kv_chunk=5, q_chunk=7, softcap=None, seed=0, ref_dtype=None):
    """Ring attention on this rank's shards, gathered, vs bhqk.attention (reference) on the whole sequence,
    the latter in ``ref_dtype`` (default: the same dtype) from the same input values."""
    K = Q if K is None else K
    q, k, v = qkv(B, H, Hkv, Q, K, d, dv, dtype=dtype, seed=seed)
    m = mask(B, Q, K) if callable(mask) else mask
    qr, kr, vr = (t.to(ref_dtype or dtype).requires_grad_() for t in (q, k, v))
    want = bhqk.attention(qr, kr, vr, m, backend="reference", softcap=softcap)  # [B, H, Q, dv]
    dout = _dout(want.shape, seed, dtype)
    grads = torch.autograd.grad(want, (qr, kr, vr), dout.to(want.dtype))
    dim = 2 if layout == "bhnd" else 1
    to = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))  # [B, H, N, ·] -> [B, N, H, ·]
    cut = lambda t: shard(to(t.detach()), rank, world, dim=dim, scheme=scheme)  # noqa: E731
    ql, kl, vl = (cut(t).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, m, sharding=scheme, layout=layout, kv_chunk=kv_chunk, q_chunk=q_chunk, softcap=softcap)
    got = torch.autograd.grad(out, (ql, kl, vl), cut(dout))
    assert out.shape == cut(want).shape and all(g.shape == cut(w).shape for g, w in zip(got, grads))
    whole = lambda t: to(gather(t.detach(), dim=dim, scheme=scheme))  # every rank's shard, put back: [B, H, N, ·]  # noqa: E731
    res = {"out": _err(whole(out), want)}
    res.update({f"d{n}": _err(whole(g), w) for n, g, w in zip("qkv", got, grads)})
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in (out, *got))
    return res


def _dout(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


def _causal(scheme):
    return lambda r, w: {**_compare(r, w, mask=masks.causal(), scheme=scheme), "tol": 1e-10}


def _doc_ids(B, N, seed=3):
    return torch.sort(torch.randint(0, 4, (B, N), generator=torch.Generator().manual_seed(seed)), dim=1).values


def _bf16(rank, world):
    """bf16: error against fp64 (same input values) at most ~2× PyTorch's math path at bf16 (docs/design.md §8)."""
    B, H, N, d = 2, 4, 64, 16
    ring_err = _compare(rank, world, B=B, H=H, Q=N, d=d, dtype=torch.bfloat16, mask=masks.causal(), kv_chunk=None,
                        ref_dtype=torch.float64)
    q, k, v = qkv(B, H, None, N, N, d, dtype=torch.bfloat16)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = bhqk.attention(q64, k64, v64, masks.causal(), backend="reference")
    dout = _dout(want.shape, 0, torch.bfloat16)
    gw = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    qb, kb, vb = (t.requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    gb = torch.autograd.grad(ob, (qb, kb, vb), dout)
    torch_err = {"out": _err(ob, want), **{f"d{n}": _err(g, w) for n, g, w in zip("qkv", gb, gw)}}
    return {"ring_err": {key: ring_err[key] for key in torch_err}, "torch_err": torch_err, "finite": ring_err["finite"]}


def _module(rank, world):
    """RingMultiHeadAttention on token shards == MultiHeadAttention on the whole sequence (outputs and grads)."""
    torch.manual_seed(0)
    B, N, D = 2, 32, 24
    ref = bhqk.MultiHeadAttention(D, 6, num_kv_heads=2).double()
    ring = RingMultiHeadAttention.from_module(ref, sharding="zigzag", kv_chunk=3)
    x = torch.randn(B, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    m = masks.causal() & masks.document(_doc_ids(B, N))
    want = ref(x, mask=m)  # [B, N, D]
    (want * want).sum().backward()
    xl = shard(x.detach(), rank, world, dim=1).requires_grad_()  # [B, N/P, D]
    out = ring(xl, mask=m)  # [B, N/P, D]
    (out * out).sum().backward()
    errs = {"out": _err(out, shard(want, rank, world, dim=1)), "dx": _err(xl.grad, shard(x.grad, rank, world, dim=1))}
    for (name, p), p_ref in zip(ring.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # each rank holds its tokens' share of the parameter gradient
        errs["d" + name] = _err(g, p_ref.grad)
    return {**errs, "tol": 1e-10}


def _sinks(rank, world):
    """Sinks [H] in ring attention: applied once after the ring; outputs, lse and q/k/v grads equal the
    reference's, and the all-reduced shares of the sinks' gradient equal its gradient."""
    B, H, Hkv, N = 2, 4, 2, 40
    q, k, v = qkv(B, H, Hkv, N, N, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    m = masks.causal() & masks.padding(torch.tensor([33, 0]))  # batch 1: every row fully masked
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    want, want_lse = bhqk.attention(qr, kr, vr, m, sinks=sr, backend="reference", return_lse=True)
    dout = _dout(want.shape, 3, torch.float64)
    grads = torch.autograd.grad(want, (qr, kr, vr, sr), dout)
    cut = lambda t: shard(t.detach(), rank, world, dim=2, scheme="zigzag")  # noqa: E731
    ql, kl, vl = (cut(t).requires_grad_() for t in (q, k, v))
    sl = sinks.clone().requires_grad_()
    out, lse = ring_attention(ql, kl, vl, m, sinks=sl, kv_chunk=7, q_chunk=5, return_lse=True)
    got = torch.autograd.grad(out, (ql, kl, vl, sl), cut(dout))
    dsinks = got[3].clone()
    dist.all_reduce(dsinks)  # each rank holds its rows' share
    whole = lambda t: gather(t.detach(), dim=2, scheme="zigzag")  # noqa: E731
    res = {"out": _err(whole(out), want), "lse": _err(whole(lse), want_lse), "dsinks": _err(dsinks, grads[3])}
    res.update({f"d{n}": _err(whole(g), w) for n, g, w in zip("qkv", got[:3], grads[:3])})
    return {**res, "finite": all(bool(torch.isfinite(t).all()) for t in (out, *got)), "tol": 1e-10}


def _skips(rank, world):
    """Contiguous causal sharding: rank r computes only the r+1 key shards at or before its own."""
    from bhqk.functional import tiled

    calls = []
    real = tiled.forward
    tiled.forward = lambda p: calls.append(p.ext.K) or real(p)
    try:
        _compare(rank, world, mask=masks.causal(), scheme="contiguous", kv_chunk=None, q_chunk=None)
    finally:
        tiled.forward = real
    return {"calls": len(calls), "want": rank + 1}


def _disagree(rank, world):
    """Rank 0 passes a longer shard: every rank raises the same ShapeError instead of hanging."""
    q, k, v = qkv(1, 2, None, 8 + (2 if rank == 0 else 0), 8, 4)
    try:
        ring_attention(q, k, v)
    except ShapeError as e:
        return {"raised": "ShapeError", "message": str(e)}
    return {"raised": None}


def _wrong_mask(rank, world):
    q, k, v = qkv(1, 2, None, 4, 4, 4)
    try:
        ring_attention(q, k, v, masks.document(torch.zeros(4, dtype=torch.long)))  # ids for 4, not 4·P positions
    except MaskError as e:
        return {"raised": "MaskError", "message": str(e)}
    return {"raised": None}


def _bad_scale(rank, world):
    """Arguments are checked by the same prepare() as bhqk.attention: a NaN scale is a ShapeError naming it."""
    q, k, v = qkv(1, 2, None, 4, 4, 4)
    try:
        ring_attention(q, k, v, scale=float("nan"))
    except ShapeError as e:
        return {"raised": "ShapeError", "message": str(e)}
    return {"raised": None}


# float32 against the float64 reference: errors relative to max(1, max|value|) (see _err), within
# tests/tolerance.py's bound for the longest sum behind a gradient (B·H·N rows of the GQA case)
F32 = bound(torch.float32, n=2 * 6 * 48, factor=2 * FACTOR)
CASES = {
    "none_contiguous": lambda r, w: {**_compare(r, w, scheme="contiguous"), "tol": 1e-10},
    "causal_zigzag": _causal("zigzag"),
    "causal_striped": _causal("striped"),
    "causal_contiguous": _causal("contiguous"),
    "padding_with_empty_rows": lambda r, w: {**_compare(r, w, mask=masks.padding(torch.tensor([29, 0]))), "tol": 1e-10},
    "causal_document": lambda r, w: {**_compare(r, w, mask=lambda B, Q, K: masks.causal() & masks.document(_doc_ids(B, Q)),
                                                scheme="striped"), "tol": 1e-10},
    "dense_striped": lambda r, w: {**_compare(r, w, mask=lambda B, Q, K: masks.dense(
        torch.rand(B, 1, Q, K, generator=torch.Generator().manual_seed(7)) > 0.7), scheme="striped"), "tol": 1e-10},
    "window_zigzag": lambda r, w: {**_compare(r, w, mask=masks.sliding_window(5, 2)), "tol": 1e-10},
    "cross_q_ne_k": lambda r, w: {**_compare(r, w, Q=24, K=56, mask=lambda B, Q, K: masks.causal("bottom_right")
                                             & masks.padding(torch.tensor([50, 56]))), "tol": 1e-10},
    "gqa_fp32": lambda r, w: {**_compare(r, w, H=6, Hkv=2, dv=5, dtype=torch.float32, mask=masks.causal()), "tol": F32},
    "mqa_fp32_cross": lambda r, w: {**_compare(r, w, H=4, Hkv=1, Q=16, K=40, dtype=torch.float32,
                                               mask=masks.causal("top_left")), "tol": F32},
    "bnhd_layout": lambda r, w: {**_compare(r, w, layout="bnhd", mask=masks.causal(), scheme="striped"), "tol": 1e-10},
    "softcap": lambda r, w: {**_compare(r, w, softcap=2.0, mask=masks.causal()), "tol": 1e-10},
    "bf16": _bf16,
    "module": _module,
    "sinks": _sinks,
    "skips": _skips,
    "disagree": _disagree,
    "wrong_mask": _wrong_mask,
    "bad_scale": _bad_scale,
}
NUMERIC = [n for n in CASES if n not in ("bf16", "skips", "disagree", "wrong_mask", "bad_scale")]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, dict[str, list[dict | None]]]:
    """Both worlds, started at once (their processes spend much of their time in imports and waits)."""
    dirs = {w: tmp_path_factory.mktemp(f"ring{w}") for w in (2, 4)}
    started = {w: _start(w, dirs[w]) for w in dirs}
    deadline = time.monotonic() + 300
    return {w: _join(started[w], w, dirs[w], deadline) for w in dirs}


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def ring_results(request, worlds):
    return worlds[request.param]["cases"]


def _case(results, name):
    for rank, res in enumerate(results):
        assert res[name]["ok"], f"rank {rank}: {res[name]['error']}"
    return [res[name] for res in results]


@pytest.mark.parametrize("case", NUMERIC)
def test_ring_outputs_and_gradients_equal_single_process_attention(ring_results, case):
    for rank, r in enumerate(_case(ring_results, case)):
        errs = {k: v for k, v in r.items() if k not in ("ok", "tol", "finite")}
        assert r.get("finite", True), f"rank {rank}: non-finite output or gradient"
        assert max(errs.values()) <= r["tol"], f"rank {rank}: {errs}"


def test_ring_bf16_error_is_within_twice_pytorchs_math_path(ring_results):
    for rank, r in enumerate(_case(ring_results, "bf16")):
        assert r["finite"]
        for key, e in r["ring_err"].items():
            assert e <= 2 * r["torch_err"][key] + 2e-4, f"rank {rank} {key}: ring {e:.2e} vs torch math {r['torch_err'][key]:.2e}"


def test_empty_pairs_are_skipped(ring_results):
    for r in _case(ring_results, "skips"):
        assert r["calls"] == r["want"], r


def test_ranks_that_disagree_on_shapes_all_raise(ring_results):
    for r in _case(ring_results, "disagree"):
        assert r["raised"] == "ShapeError"
        assert "rank 0: q [1, 2, 10, 4]" in r["message"] and "rank 1: q [1, 2, 8, 4]" in r["message"]


def test_a_mask_that_does_not_fit_the_global_sequence_is_a_mask_error(ring_results):
    for r in _case(ring_results, "wrong_mask"):
        assert r["raised"] == "MaskError" and "global positions" in r["message"]


def test_ring_arguments_are_checked_like_attention(ring_results):
    for r in _case(ring_results, "bad_scale"):
        assert r["raised"] == "ShapeError" and "scale" in r["message"]


# ---------------------------------------------------------------- a peer that dies or stalls


def _peer_failure(rank: int, scenario: str, outdir: str, group) -> dict:
    """In a pair (``group``, ranks 0 and 1 of it), rank 1 reaches the ring and then stalls ("hang")
    or exits ("die"); rank 0 must get an error."""
    from bhqk.distributed.ring import Ring

    if rank == 1:
        def stall(*a, **kw):
            deadline = time.monotonic() + 30
            reported = os.path.join(outdir, f"{scenario}-0.json")
            while scenario == "hang" and time.monotonic() < deadline and not os.path.exists(reported):
                time.sleep(0.2)  # alive but silent, past the 3 s timeout of its group, until rank 0 has reported
            os._exit(0)
        Ring.start = stall
    q, k, v = qkv(1, 2, None, 8, 8, 4)
    t0 = time.monotonic()
    try:
        ring_attention(q, k, v, group=group)
    except RuntimeError as e:
        return {"raised": "RuntimeError", "message": str(e), "seconds": time.monotonic() - t0}
    return {"raised": None}


@pytest.mark.parametrize("scenario", ["die", "hang"])
def test_a_peer_that_dies_or_stalls_raises_instead_of_hanging(scenario, worlds):
    r0 = worlds[4][scenario][0]
    assert r0["raised"] == "RuntimeError", r0
    assert "ring attention: rank 0 of 2 failed at step 0 passing K/V" in r0["message"]
    assert "timeout" in r0["message"]
