"""Attention statistics in capture (bhqk.inspect.rowstats): every statistic equals the one computed
from the full weights P (the reference's, and Hugging Face eager's output_attentions), on every mask
kind, bias, softcap, sinks, GQA, selected heads and rows, tiles of any size, with and without a saved
lse; padding rows are left out; and no [Q, K] tensor is allocated."""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.functional import prepare as problem
from bhqk.inspect import capture
from bhqk.inspect.rowstats import Want, row_lse, row_stats
from conftest import mask_kinds, qkv
from tolerance import assert_close, assert_paths_close, magnitude_of

WHAT = ("entropy", "distance", "sink", "received")


def from_weights(P: torch.Tensor, K: int, Q: int, rows=None, offsets=(1,), window=None, real=None) -> dict:
    """The statistics by their formulas from full weights P [B, h, r, K] (float64)."""
    P = P.double()
    rows_t = torch.arange(Q) if rows is None else torch.tensor(rows)
    pos = (rows_t + K - Q).double()  # [r]
    j = torch.arange(K).double()  # [K]
    D = (pos[:, None] - j[None, :]).abs()  # [r, K]
    out = {
        "entropy": -torch.special.xlogy(P, P).sum(-1),
        "distance": (P * D).sum(-1),
        # P on the row's first key it may attend (key 0 unless masked: the first real key of a left-padded
        # row); on these random inputs the keys a row may attend are exactly those with P > 0
        "sink": P.gather(-1, (P > 0).to(torch.uint8).argmax(-1, keepdim=True))[..., 0],
        "mass": P.sum(-1),
    }
    for o in offsets:
        key = (rows_t + K - Q - o)  # [r]
        ok = (key >= 0) & (key < K)
        idx = key.clamp(0, K - 1)[:, None].expand(*P.shape[:-1], 1)  # [B, h, r, 1]
        out[f"offset{o}"] = torch.where(ok, P.gather(-1, idx)[..., 0], 0.0)
    if window is not None:
        out["local"] = (P * (D < window)).sum(-1)
    w = torch.ones(P.shape[:-1], dtype=P.dtype) if real is None else real.double()
    out["received"] = (P * w[..., None]).sum(-2)
    return out


def check(rec, exp: dict, n: int, offsets=(1,), window=None, msg=""):
    for name in ("entropy", "distance", "sink", "received", "mass"):
        got = getattr(rec, name)
        # entropy: lse·ΣP − q·ΣPk cancels terms of size |S| (≤ the magnitude of the scores) per key
        assert_close(got, exp[name], n=n, magnitude=magnitude_of(exp[name]) * 64, msg=f"{msg} {name}")
    for o in offsets:
        assert_close(rec.offset(o), exp[f"offset{o}"], n=n, msg=f"{msg} offset {o}")
    if window is not None:
        assert_close(rec.local, exp["local"], n=n, msg=f"{msg} local")


@pytest.mark.parametrize("kind", ["none", "causal_br", "padding", "key_padding", "window", "document", "dense",
                                  "~causal", "predicate", "causal&padding"])
@pytest.mark.parametrize("saved_lse", [True, False])
def test_statistics_equal_the_full_weights_on_every_mask(kind, saved_lse):
    B, H, Hkv, Q, K = 2, 4, 2, 9, 11
    q, k, v = qkv(B, H, Hkv, Q, K, 8, 6)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    backend = "reference" if saved_lse else "torch"
    if bhqk.why_not(backend, q, k, v, m) is not None:
        backend = "tiled"
    with capture(what=WHAT, offsets=(1, 0, 3), window=3, topk=2, block_q=4, block_k=3) as cap:
        bhqk.attention(q, k, v, m, backend=backend)
    rec = cap[0]
    P = bhqk.attention_weights(q, k, m)  # [B, H, Q, K]
    exp = from_weights(P, K, Q, offsets=(1, 0, 3), window=3, real=rec.real)
    check(rec, exp, K, offsets=(1, 0, 3), window=3, msg=kind)
    # top-2 keys of each row
    top = P.topk(2, dim=-1)
    assert_close(rec.topk_weights, top.values, n=K)
    picked = P.gather(-1, rec.topk_keys)  # the weights at the keys reported
    assert_close(picked, top.values, n=K)
    # real rows: those that may attend somewhere (and are no padding row)
    assert bool((rec.real <= (P.sum(-1) > 0)).all())


@pytest.mark.parametrize("case", ["bias", "softcap", "sinks", "bias+sinks+softcap"])
def test_statistics_with_bias_softcap_and_sinks(case):
    B, H, Q, K = 1, 3, 7, 7
    q, k, v = qkv(B, H, None, Q, K, 4)
    g = torch.Generator().manual_seed(1)
    kw = {}
    if "bias" in case:
        bias = torch.randn(B, H, Q, K, generator=g, dtype=torch.float64)
        bias[0, 1, 2, 3] = float("-inf")
        kw["bias"] = bias
    if "softcap" in case:
        kw["softcap"] = 2.0
    if "sinks" in case:
        kw["sinks"] = torch.randn(H, generator=g, dtype=torch.float64)
    m = masks.causal()
    for backend in ("reference", "tiled"):
        with capture(what=WHAT, offsets=(1,), window=2) as cap:
            bhqk.attention(q, k, v, m, backend=backend, **kw)
        P = bhqk.attention_weights(q, k, m, **kw)
        check(cap[0], from_weights(P, K, Q, window=2), K, window=2, msg=f"{case} {backend}")
        if "sinks" in case:
            assert float(cap[0].mass.max()) < 1.0  # the sink takes a share
    # without a saved lse: recomputed, sinks included
    p = problem(q, k, v, m, **kw)
    _, lse = bhqk.functional.reference.weights(p)
    assert_close(row_lse(p, [0, 1, 2], None, block_q=3, block_k=2), lse, n=K)


def test_selected_heads_and_rows_are_slices_of_the_full_statistics():
    B, H, Hkv, Q, K = 2, 6, 3, 10, 10
    q, k, v = qkv(B, H, Hkv, Q, K, 4)
    m = masks.causal() & masks.padding(torch.tensor([10, 7]))
    heads, rows = [1, 4, 5], [0, 2, 3, 4, 9]
    with capture(what=WHAT, heads=heads, rows=rows, offsets=(1, 2)) as cap:
        bhqk.attention(q, k, v, m, backend="torch")
    rec = cap[0]
    P = bhqk.attention_weights(q, k, m)[:, heads][:, :, rows]  # [B, h, r, K]
    exp = from_weights(P, K, Q, rows=rows, offsets=(1, 2), real=rec.real)
    check(rec, exp, K, offsets=(1, 2))
    assert rec.entropy.shape == (B, len(heads), len(rows)) and rec.received.shape == (B, len(heads), K)


def test_padding_rows_are_not_real_and_leave_received():
    # bidirectional attention with right padding: padded query rows attend the real keys (as BERT's do)
    B, H, N = 2, 2, 6
    q, k, v = qkv(B, H, None, N, N, 4)
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with capture(what=WHAT) as cap:
        bhqk.attention(q, k, v, masks.key_padding(valid), backend="reference")
    rec = cap[0]
    real = valid[:, None, :].expand(B, H, N)  # rows of real tokens
    assert torch.equal(rec.real, real)
    P = bhqk.attention_weights(q, k, masks.key_padding(valid))
    assert_close(rec.received, (P * real[..., None].double()).sum(-2), n=N)
    # causal with left padding: the padding rows may attend nothing
    left = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    with capture(what=WHAT) as cap:
        bhqk.attention(q, k, v, masks.causal() & masks.key_padding(left), backend="torch")
    assert torch.equal(cap[0].real, left[:, None, :].expand(B, H, N))


@pytest.mark.parametrize("blocks", [(1, 1), (3, 5), (64, 64)])
def test_any_tile_size_gives_the_same_statistics(blocks):
    q, k, v = qkv(1, 2, None, 13, 13, 4)
    p = problem(q, k, v, masks.sliding_window(3, 2))
    want = Want(offsets=(1, 5), window=2, topk=3)
    a = row_stats(p, [0, 1], None, None, want, block_q=blocks[0], block_k=blocks[1])
    b = row_stats(p, [0, 1], None, None, want, block_q=13, block_k=13)
    for name in ("entropy", "distance", "sink", "received", "local", "mass", "topk_weights"):
        assert_paths_close(a[name], b[name], n=13, msg=name)  # two tilings, each rounding
    assert_paths_close(a["offset"][5], b["offset"][5], n=13)


def test_statistics_never_allocate_a_query_by_key_tensor(monkeypatch):
    # fp32, Q = K = 512: a tile of 64 x 64 keys; any tensor with Q·K entries per head would be a leak
    Q = K = 512
    q, k, v = qkv(1, 2, None, Q, K, 8, dtype=torch.float32)
    sizes = []
    real = torch.matmul

    def spy(a, b, **kw):
        out = real(a, b, **kw)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "matmul", spy)
    with capture(what=WHAT, offsets=(1,), window=4, block_q=64, block_k=64) as cap:
        bhqk.attention(q, k, v, masks.causal(), backend="torch")
    assert sizes and max(sizes) <= 2 * 64 * 64, max(sizes)
    assert cap[0].received.shape == (1, 2, K)


def test_capture_errors_name_the_argument():
    with pytest.raises(ValueError, match="offsets"):
        capture(what=("offset",)).__enter__()
    with pytest.raises(ValueError, match="window"):
        capture(what=("entropy",), window=0).__enter__()
    with pytest.raises(KeyError, match="offset 2 was not captured"):
        q, k, v = qkv(1, 1, None, 3, 3, 4)
        with capture(what=("sink",), offsets=(1,)) as cap:
            bhqk.attention(q, k, v)
        cap[0].offset(2)


# ---- head tables ------------------------------------------------------------------------------------

def test_head_table_means_over_real_rows_of_every_call_of_a_layer():
    # head 0 looks at the previous key only, head 1 at key 0 only (a sink), under a causal mask
    N, d = 6, 8
    q = torch.zeros(1, 2, N, d, dtype=torch.float64)
    k = torch.zeros(1, 2, N, d, dtype=torch.float64)
    for i in range(N):
        k[0, 0, i, i] = 1.0
        q[0, 0, i, max(i - 1, 0)] = 1e3  # row i: key i - 1 (row 0: key 0)
    k[0, 1, 0, 0] = 1.0
    q[0, 1, :, 0] = 1e3
    v = torch.randn(1, 2, N, 3, dtype=torch.float64)
    lengths = torch.tensor([N])
    with capture(what=WHAT, offsets=(1,), window=2) as cap:
        bhqk.attention(q, k, v, masks.causal(), backend="reference")
        bhqk.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], masks.causal() & masks.padding(lengths - 2), backend="torch")
    t = cap.head_table(positions=(0,))
    assert t.layers == ["attention.0", "attention.1"]
    # float64; each value a softmax over at most N keys averaged over at most N rows
    assert_close(t["prev"][0], torch.tensor([(N - 1) / N, 1 / N], dtype=torch.float64), n=N)
    assert_close(t["sink"][:, 1], torch.tensor([1.0, 1.0], dtype=torch.float64), n=N)
    assert_paths_close(t["received@0"][0], t["sink"][0], n=N)  # mean P on key 0 either way
    assert t.top("prev", 1)[0][:2] == (0, 0)
    roles = {(li, h, role): x for li, h, role, x in t.roles()}
    assert_close(torch.tensor(roles[0, 1, "sink"]), torch.tensor(1.0, dtype=torch.float64), n=N)
    assert "prev" in str(t) and "top sink" in repr(t) and "<table" in t._repr_html_()
    assert set(t.to_dict()["values"]) == set(t.columns)
    with pytest.raises(ValueError, match="received@p .* cannot be restricted to rows"):
        bhqk.inspect.head_table(cap.records, positions=(0,), rows=slice(0, 2))  # received sums every row


def test_reprs_are_bounded_at_any_length():
    N = 3000
    q, k, v = qkv(1, 2, None, N, N, 4, dtype=torch.float32)
    with capture(what=WHAT, offsets=(1,)) as cap:
        for _ in range(12):
            bhqk.attention(q, k, v, masks.causal(), backend="torch")
    rec = cap[0]
    page = rec._repr_html_()
    assert "<svg" in page and "prev" in page and len(page) < 20_000
    assert len(cap._repr_html_()) < 40_000 and "… 4 more" in cap._repr_html_()
    assert "12 of 12 attention calls" in repr(cap) and len(repr(cap)) < 400
    assert "entropy [B=1, H=2, Q=3000]" in repr(rec) and "received [B=1, H=2, K=3000]" in repr(rec)
    assert_paths_close(rec.head_means()["sink"], rec.sink.double().mean((0, 2)), n=N)  # float64 sums of N rows


@pytest.mark.parametrize("Q,K", [(0, 5), (4, 0), (0, 0)])
def test_empty_sizes_give_empty_statistics(Q, K):
    q, k, v = qkv(1, 2, None, Q, K, 4)
    with capture(what=WHAT, offsets=(1,), window=2, topk=2) as cap:
        bhqk.attention(q, k, v)
    rec = cap[0]
    assert rec.entropy.shape == (1, 2, Q) and rec.received.shape == (1, 2, K)
    assert rec.topk_weights.shape == (1, 2, Q, min(2, K)) and not bool(rec.real.any())
    assert float(rec.entropy.abs().sum()) == 0.0


def test_low_precision_inputs_are_computed_in_float32():
    q, k, v = qkv(1, 2, 1, 6, 6, 4, dtype=torch.bfloat16)
    with capture(what=WHAT, offsets=(1,)) as cap:
        bhqk.attention(q, k, v, masks.causal())
    rec = cap[0]
    assert rec.entropy.dtype == torch.float32
    P = bhqk.attention_weights(q.float(), k.float(), masks.causal())  # the same bf16 values, in fp32
    check(rec, from_weights(P, 6, 6), 6)


def test_multi_head_attention_module_with_gqa_sinks_and_left_padding():
    torch.manual_seed(0)
    m = bhqk.MultiHeadAttention(32, 4, num_kv_heads=2, sinks=True).double()
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([0.5, 1.0, 2.0, -1.0]))
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    mask = masks.causal() & masks.key_padding(valid)
    with torch.no_grad(), capture(model=m, what=WHAT, offsets=(1,)) as cap:
        _, P = m(x, mask=mask, return_weights=True)  # P [B, H, Q, K]
    rec = cap.records[0]
    real = valid[:, None, :].expand(2, 4, 7)
    assert torch.equal(rec.real, real)
    check(rec, from_weights(P, 7, 7, real=real), 7)


@pytest.mark.parametrize("case", ["plain", "causal", "rows", "sinks"])
def test_lse_from_the_fused_kernel_equals_the_online_pass(case, monkeypatch):
    from bhqk.inspect import rowstats

    q, k, v = qkv(2, 4, 2, 9, 9, 8, dtype=torch.float32)
    kw = {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])} if case == "sinks" else {}
    p = problem(q, k, v, masks.causal() if case == "causal" else None, **kw)
    rows = [0, 3, 4, 8] if case == "rows" else None
    heads = [0, 2, 3]
    assert rowstats._fused_lse(p, heads, rows) is not None  # the kernel takes these calls
    fused = row_lse(p, heads, rows)
    monkeypatch.setattr(rowstats, "_fused_lse", lambda *a: None)
    online = row_lse(p, heads, rows, block_q=2, block_k=4)
    assert_paths_close(fused, online, n=9, magnitude=float(online.abs().max()))  # two fp32 paths


@pytest.mark.parametrize("kind", ["none", "causal_br", "key_padding", "window", "document", "dense", "~causal"])
def test_max_is_the_largest_weight_of_each_row(kind):
    # one entry of rowstats.STATISTICS: max_k P [B, h, r], 0 for a row that may attend nothing
    B, H, Hkv, Q, K = 2, 4, 2, 9, 11
    q, k, v = qkv(B, H, Hkv, Q, K, 8, 6)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    with capture(what=("max",), heads=[0, 3], block_q=4, block_k=3) as cap:
        bhqk.attention(q, k, v, m, backend="tiled")
    rec = cap[0]
    P = bhqk.attention_weights(q, k, m)[:, [0, 3]]  # [B, h, Q, K]: the reference backend's weights
    assert_close(rec["max"], P.amax(-1), n=K, msg=kind)
    assert rec.max is rec["max"] and rec.captured() == ["mass", "real", "max"]
    assert "max" in cap.head_table().columns
